"""``python -m tools.docgen [--check]``: shell completions, man pages and the flag reference from the one
CLI definition.

Writes ``completions/resilrun.{bash,zsh,fish}``, the exact text ``_RESILRUN_COMPLETE=source_<shell>
resilrun`` prints, ``man/resilrun.1`` plus ``man/resilrun-<command>.1``, roff in the style of
httpie's ``ManPageBuilder``, and ``docs/flags.md``, the same reference as Markdown, by walking
``typer.main.get_command(app)``: options grouped by their help panel, ENVIRONMENT from the ``Config``
field metadata and the worker environment contract, EXIT STATUS from ``ExitCode``. ``--check``
regenerates in memory and exits 1 listing the files that differ.

Invariants: the output is a function of the code alone: no build date (the title line carries the
release date and the version), no terminal width, no environment values; a default that would differ
between machines (a temp dir, the home directory, the host name) is written symbolically. Pages are
ASCII and pass ``groff -ww -man`` and ``mandoc -T lint`` without a warning.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import socket
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import typer

from resilrun import __version__
from resilrun.cli import app
from resilrun.cli._output import Output
from resilrun.config import CONFIG_FIELDS
from resilrun.env import STATE_LOST_EXIT_CODE, STATE_REFUSED_EXIT_CODE, UNHEALTHY_EXIT_CODE, WorkerEnv
from resilrun.errors import EXIT_CODE_MEANINGS, ExitCode

__all__ = ["generate", "main"]

ROOT = Path(__file__).resolve().parents[1]
PROG = "resilrun"
COMPLETE_VAR = "_RESILRUN_COMPLETE"  # typer's name: _<PROG>_COMPLETE
SHELLS = ("bash", "zsh", "fish")
# The release date of __version__: change both together (a date that changed on every run would
# make the drift check useless, and mandoc insists on a real date in .TH).
RELEASE_DATE = "2026-11-30"

# Defaults that exist only at run time, written as what they mean.
_SYMBOLIC_DEFAULTS = {
    "node_rank": "assigned at the rendezvous",
    "log_dir": "a new directory under $TMPDIR",
    "local_addr": "this host's fully qualified name",
    "rdzv_endpoint": "none (required when more than one node)",
}
_UNICODE = {"\u2265": r"\(>=", "\u2264": r"\(<=", "\u2014": r"\(em", "\u2013": r"\(en", "\u2019": "'", "\u2192": "->"}
_SOURCE_WIDTH = 80
_OPTION = re.compile(r"(?<![\w/.\-])(--?[A-Za-z][\w-]*)")

DESCRIPTIONS: dict[str, list[str]] = {
    "": [
        "resilrun launches distributed PyTorch training like torchrun, with the same flags, the same "
        "PET_* environment variables and the same worker environment, and keeps the job running through "
        "failures. Write resilrun where you wrote torchrun.",
        "resilrun SCRIPT [ARGS]... is short for resilrun run SCRIPT [ARGS]...: run is the default "
        "command, so a torchrun command line works unchanged.",
        "When a worker fails, every node restarts the job together, within --max-restarts. Scripts "
        "written on the three-call worker API (resilrun.init(), job.track(...), job.steps(total)) resume "
        "from the newest step every rank finished, restored from node memory, from a peer node's replica "
        "(--replicas) or from persistent storage (--checkpoint-uri, a directory or S3).",
    ],
    "run": [
        "Starts this node's workers and supervises them until the job succeeds, fails for good or is "
        "stopped. One resilrun runs on every node; the nodes meet at the rendezvous (--rdzv-endpoint, "
        "hosted by the node that owns that address) or use --standalone on one machine.",
        "Everything after SCRIPT goes to the script untouched. Each option can also be set by its "
        "environment variables (see ENVIRONMENT): a flag beats RESILRUN_*, which beats torchrun's PET_*, "
        "which beats the default. Every value is checked before anything starts.",
        "SIGINT and SIGTERM are forwarded to the workers, which get --shutdown-timeout seconds before "
        "SIGKILL. Workers run in their own process group and die with their agent, so nothing is orphaned.",
    ],
    "inspect-checkpoint": [
        "Reads a checkpoint written by the persistent tier (--checkpoint-uri of resilrun run) from a "
        "directory or an S3 prefix. It lists every step, complete or partial, and for one step (--step, "
        "else the newest complete one) every rank's tensors with dtype, shape and size, and totals.",
        "--verify downloads every file and checks the crc32 of every tensor and manifest. Reading never "
        "executes anything from a checkpoint: corrupt, truncated or forged files end as one error line. "
        "--json prints one document on stdout whose fields are only ever added to.",
    ],
    "export": [
        "Writes one persisted step of a checkpoint (a directory or an S3 prefix written by --checkpoint-uri) "
        "as files other tools read. --format safetensors (the default) writes one tracked module (--object, "
        "else the one module the script tracked) as a single safetensors file under the model's own "
        "parameter names, without the module. and _orig_mod. prefixes DDP and torch.compile add: it loads "
        "with safetensors.torch.load_file and model.load_state_dict. --format dcp writes every tracked "
        "object (or those named) as a directory torch.distributed.checkpoint.load reads.",
        "FSDP2 and other DTensor state is consolidated from every rank's shards by their saved placements; "
        "other tensors come from rank 0. Every checksum is verified, nothing is unpickled, the file appears "
        "only once complete, and nothing is replaced without --force. From Python, "
        "resilrun.checkpoint.load(URI, step) returns the tracked state dicts themselves.",
    ],
    "status": [
        "Shows a running job as its agents publish it in the rendezvous store: the job's state and "
        "generation, every node (host, node rank, active, waiting or lost, heartbeat age), every rank "
        "(pid, step, steps per second, heartbeat age, state), hot spares, how far each snapshot tier is "
        "behind, and the recent failures and recoveries with their timelines (detected, replacement "
        "chosen, collectives rebuilt, state transferred, first step done) and steps redone.",
        "It connects as a read-only client from any machine that reaches --rdzv-endpoint: it never hosts "
        "a store and never joins the job. Tables with health colours on a terminal, plain text otherwise; "
        "--json prints one document whose fields are only ever added to (docs/status.md); --watch "
        "refreshes every SECONDS (2 when omitted) until Ctrl-C, one JSON document per line with --json.",
        "An endpoint that does not answer within --timeout, or holds no such job, ends as one error line "
        "and exit status 3.",
    ],
}
# Commands that do not launch anything end with a subset of the codes, some meaning something else.
EXIT_CODES = {
    "inspect-checkpoint": (ExitCode.OK, ExitCode.USAGE, ExitCode.CHECKPOINT, ExitCode.STORAGE),
    "status": (ExitCode.OK, ExitCode.USAGE, ExitCode.RENDEZVOUS),
    "export": (ExitCode.OK, ExitCode.USAGE, ExitCode.CHECKPOINT, ExitCode.STORAGE),
}
EXIT_OVERRIDES = {
    "inspect-checkpoint": {ExitCode.OK: "the checkpoint was read (and with --verify, every checksum matched)"},
    "export": {
        ExitCode.OK: "the step was written to --to",
        ExitCode.USAGE: "a bad option, or --to names a missing directory or something that exists (see --force)",
        ExitCode.CHECKPOINT: "no such step or tracked name, an incomplete step, or a file that fails its checks",
    },
    "status": {
        ExitCode.OK: "the job's status was shown (whatever the job's health)",
        ExitCode.RENDEZVOUS: "the endpoint was not reachable within --timeout, or holds no such job",
    },
}
SEE_ALSO_URL = "https://pytorch.org/docs/stable/elastic/run.html"
EXAMPLES: dict[str, list[tuple[str, str]]] = {
    "run": [
        (
            "One machine, two workers, up to one restart:",
            "resilrun --standalone --nproc-per-node 2 --max-restarts 1 train.py --lr 3e-4",
        ),
        (
            "Two nodes (run the same command on each; head owns the endpoint and hosts the store):",
            "resilrun --nnodes 2 --nproc-per-node 8 --rdzv-endpoint head:29400 --rdzv-id job42 train.py",
        ),
        (
            "Elastic: start with one node, admit a second one when it arrives:",
            "resilrun --nnodes 1:2 --nproc-per-node 8 --rdzv-endpoint head:29400 train.py",
        ),
        (
            "Persist every 100th step to S3 and keep the newest three:",
            "resilrun --standalone --nproc-per-node 8 --checkpoint-uri s3://bucket/run7 --persist-every 100 "
            "--keep-last 3 train.py",
        ),
        (
            "Rehearse a failure (kill rank 1 when step 12 starts):",
            'RESILRUN_FAULTS="kill:rank=1,step=12" resilrun --standalone --nproc-per-node 2 --max-restarts 1 train.py',
        ),
    ],
    "inspect-checkpoint": [
        (
            "The steps of a checkpoint directory, and the tensors of its newest complete step:",
            "resilrun inspect-checkpoint /shared/ckpt/run7",
        ),
        (
            "Verify every checksum of step 400 on an S3-compatible store, as JSON:",
            "resilrun inspect-checkpoint s3://bucket/run7 --step 400 --verify --json "
            "--s3-endpoint-url http://minio:9000",
        ),
    ],
}
EXAMPLES["export"] = [
    (
        "The newest complete step's model, as one safetensors file:",
        "resilrun export /shared/ckpt/run7 --to model.safetensors",
    ),
    (
        "Step 400's model and optimizer from S3, as a DCP checkpoint:",
        "resilrun export s3://bucket/run7 --step 400 --format dcp --object model --object optimizer --to run7-400",
    ),
]
EXAMPLES["status"] = [
    ("The job at an endpoint, as a table:", "resilrun status --rdzv-endpoint head:29400"),
    (
        "One job of several at that endpoint, as JSON:",
        "resilrun status --rdzv-endpoint head:29400 --rdzv-id job42 --json",
    ),
    ("Refresh every 5 seconds until Ctrl-C:", "resilrun status --rdzv-endpoint head:29400 --watch 5"),
]
EXAMPLES[""] = (
    EXAMPLES["run"][:2]
    + EXAMPLES["inspect-checkpoint"][:1]
    + EXAMPLES["status"][:1]
    + [
        (
            "Install completion for the current shell (or source a script from completions/):",
            "resilrun --install-completion",
        ),
    ]
)
LOG_FILES = [
    (
        "<log-dir>/<run-id>/events.jsonl",
        "One JSON object per line for what happened (failure detected, spare promoted, state transferred, "
        "recovered, snapshot persisted, restart, node lost, exit), with wall and monotonic times; "
        "docs/status.md lists the fields.",
    ),
    (
        "<log-dir>/<run-id>/round_<r>/rank_<g>/stdout.log, stderr.log",
        "What global rank g printed in rendezvous round r (--redirects, --tee). Without --log-dir the base "
        "is a new directory under $TMPDIR, named in the agent's first log line.",
    ),
    (
        "<log-dir>/<run-id>/round_<r>/rank_<g>/error.json",
        "The worker's uncaught exception and traceback (torchrun's error file); the earliest one across all "
        "nodes is reported as the root cause.",
    ),
]
CHECKPOINT_FILES = [
    (
        "<checkpoint-uri>/step_<12 digits>/rank_<5 digits>.safetensors",
        "One rank's snapshot of one step: safetensors, never pickle, with a crc32 per tensor.",
    ),
    (
        "<checkpoint-uri>/step_<12 digits>/rank_<5 digits>.json",
        "That rank's manifest (sizes and checksums), written after its data file.",
    ),
    (
        "<checkpoint-uri>/step_<12 digits>/COMPLETE.json",
        "The commit point, written once every rank's manifest exists: a step without it is never restored. "
        "Only the newest --keep-last complete steps are kept.",
    ),
]
EXTRA_ENV = [
    ("RESILRUN_DEBUG", "Set to 1 to print the traceback of an error, not only its one-line message."),
    (
        "RESILRUN_FAULTS",
        "A fault plan for rehearsing failures, e.g. kill:rank=1,step=12; exit:rank=0,step=3,code=7 "
        "(kinds kill, exit, raise, hang (SIGSTOP), stall (sleeps with heartbeats running); step=restore "
        "fires while the rank restores during a recovery; attempt=N limits a fault to one restart attempt).",
    ),
    (
        "RESILRUN_FAULT_REPLICATION_DELAY_S",
        "Set for an agent, holds each of its replica pushes that many seconds, e.g. 0.3 (a slow link: "
        "training then waits for its replicas, and resilrun status shows how long).",
    ),
    (
        "RESILRUN_FAULT_PERSIST_DELAY_S",
        "Set for an agent, starts each of its uploads to the persistent tier that many seconds late, "
        "e.g. 4 (a slow storage link).",
    ),
    ("PYTHON_EXEC", "The interpreter that runs Python workers (default: the one running resilrun)."),
    (
        "RESILRUN_JOB_SECRET",
        "The job secret itself (at least 16 characters, the same on every node), where a file cannot be used; "
        "--job-secret-file wins when both are given. Either keeps the secret out of the rendezvous store.",
    ),
    (
        "AWS_PROFILE, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN, AWS_REGION",
        "S3 credentials and region come from the standard AWS chain (environment, shared config and "
        "credentials files, SSO, web identity, container and instance roles); resilrun takes no keys as flags.",
    ),
]

# The variables of EXTRA_ENV that only resilrun run reads.
_RUN_ONLY_ENV = (
    "RESILRUN_FAULTS",
    "RESILRUN_FAULT_REPLICATION_DELAY_S",
    "RESILRUN_FAULT_PERSIST_DELAY_S",
    "PYTHON_EXEC",
    "RESILRUN_JOB_SECRET",
)
# Codes a worker (not the launcher) exits with for its agent to read; they never end resilrun itself.
WORKER_EXIT_CODES = [
    (
        75,  # resilrun/worker/_abort.py SUPERSEDED_SETUP_EXIT_CODE
        "the worker was stuck setting up the process group of a generation that was superseded meanwhile "
        "and whose store is gone; a fresh process takes its rank in-process (docs/recovery.md)",
    ),
    (
        STATE_LOST_EXIT_CODE,
        "the job's state is in no tier (node memory, peer replicas, persistent storage): the agent stops "
        "the job at once instead of spending restarts on it (exit 4)",
    ),
    (
        STATE_REFUSED_EXIT_CODE,
        "the only copy of the state was refused (a persisted step failing its checksums or MACs): final, "
        'no spare and no restart; the job ends with "the job\'s state was refused" (exit 4)',
    ),
    (
        UNHEALTHY_EXIT_CODE,
        "its device failed the check before it took its rank (it did not answer within 20 s, or a GPU "
        "multiplied at under half its node's rate), or, a spare given a rank, its first collective with the "
        "other ranks did not complete within 60 s: the next spare takes the rank in-process "
        "(`device_unhealthy` event, docs/status.md)",
    ),
]


# -- completions -----------------------------------------------------------------------------------
def completion_script(shell: str) -> str:
    """What ``_RESILRUN_COMPLETE=source_<shell> resilrun`` prints: typer's shim for ``shell``."""
    from typer._click.shell_completion import get_completion_class  # typer's bundled click

    command = typer.main.get_command(app)  # also registers typer's completion classes
    completer = get_completion_class(shell)
    if completer is None:
        raise ValueError(f"typer has no completion for shell {shell!r}")
    return completer(command, {}, PROG, COMPLETE_VAR).source() + "\n"  # click.echo adds the newline


# -- roff --------------------------------------------------------------------------------------------
def _symbolic(value: str) -> str:
    """Machine-specific parts of a default, written as what they are."""
    for path, symbol in ((tempfile.gettempdir(), "$TMPDIR"), (os.path.expanduser("~"), "~")):
        if len(path) > 1 and (value == path or value.startswith(path + os.sep)):
            return symbol + value[len(path) :]
    hostname = socket.gethostname()
    return "$(hostname)" if value == hostname and hostname != "localhost" else value


def _text(text: str, *, options: bool = True) -> str:
    """Plain text as roff: escapes, options in bold, ASCII only."""
    text = text.replace("\\", r"\e")
    for char, escape in _UNICODE.items():
        text = text.replace(char, escape)
    if options:
        text = _OPTION.sub(lambda m: r"\fB" + m.group(1).replace("-", r"\-") + r"\fR", text)
    text.encode("ascii")  # raises on a character roff would need a named escape for
    lines = [wrapped for line in text.splitlines() for wrapped in _wrap(line)]
    return "\n".join(r"\&" + line if line.startswith((".", "'")) else line for line in lines)


def _wrap(line: str) -> list[str]:
    """Source lines of at most 80 bytes (filled text: where a line breaks does not show)."""
    return textwrap.wrap(line, _SOURCE_WIDTH, break_long_words=False, break_on_hyphens=False) or [""]


def _roff_name(name: str) -> str:
    return name.replace("-", r"\-")


def _bold(text: str) -> str:
    return r"\fB" + _text(text, options=False).replace("-", r"\-") + r"\fR"


def _italic(text: str) -> str:
    return r"\fI" + _text(text, options=False) + r"\fR"


class ManPage:
    """A roff man(7) page built line by line, like httpie's ManPageBuilder."""

    def __init__(self, name: str, summary: str) -> None:
        self.lines = [
            f'.TH {name.upper()} 1 {RELEASE_DATE} "{PROG} {__version__}" "{PROG} Manual"',
            ".nh",  # flags and variable names must never be hyphenated
            ".ad l",
            ".SH NAME",
            *_wrap(rf"{_roff_name(name)} \- {_text(summary, options=False)}"),
        ]

    @contextmanager
    def section(self, title: str) -> Iterator[None]:
        self.lines.append(f".SH {title}")
        yield

    def subsection(self, title: str) -> None:
        self.lines.append(f'.SS "{title}"')

    def paragraph(self, text: str) -> None:
        if not self.lines[-1].startswith((".SH", ".SS")):
            self.lines.append(".PP")
        self.lines.append(_text(text))

    def item(self, label: str, body: str) -> None:
        """A tagged paragraph; ``label`` is roff already."""
        self.lines += [".TP", label, _text(body)]

    def example(self, description: str, command: str) -> None:
        """A description, then the command as it would be typed, continued with backslashes."""
        self.paragraph(description)
        words = command.split(" ")
        lines = [words[0]]
        for word in words[1:]:
            if len(lines[-1]) + len(word) > _SOURCE_WIDTH - 10 and word.startswith("-"):
                lines[-1] += " \\"
                lines.append("    " + word)
            else:
                lines[-1] += " " + word
        shown = [_text(line, options=False).replace("-", r"\-") for line in lines]
        self.lines += [".RS 4", ".nf", *shown, ".fi", ".RE"]

    def raw(self, *lines: str) -> None:
        self.lines += lines

    def build(self) -> str:
        return "\n".join(self.lines) + "\n"


# -- pages ---------------------------------------------------------------------------------------------
def _panel(param: Any) -> str:
    if not isinstance(param, typer.core.TyperOption):
        return "Arguments"
    return param.rich_help_panel or "Options"


def _metavar(param: Any) -> str:
    if param.metavar:
        return str(param.metavar)
    name = "ARGS" if param.name == "script_args" else param.name.upper()
    return name


def _option_label(param: Any) -> str:
    opts = sorted([*param.opts, *param.secondary_opts], key=lambda opt: opt.startswith("--"))  # -m before --module
    names = ", ".join(_bold(opt) for opt in opts)
    return names if param.is_flag else f"{names} {_italic(_metavar(param))}"


def _option_body(param: Any) -> list[str]:
    """The help text, then a line with the default and the environment variables (roff lines)."""
    body = (param.help or "").strip()
    notes = []
    default = param.default
    if default in (None, "", False, ()) and param.name in _SYMBOLIC_DEFAULTS and "default" not in body:
        notes.append(f"Default: {_text(_SYMBOLIC_DEFAULTS[param.name])}.")
    elif default not in (None, "", False, ()) and not param.is_flag:
        notes.append(rf"Default: \fB{_text(_symbolic(str(default)), options=False)}\fR.")
    envvar = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
    if envvar:
        notes.append("Environment: " + ", ".join(_bold(e) for e in envvar) + ".")
    return [_text(body), ".br", *notes] if notes else [_text(body)]


def _visible(command: Any) -> list[Any]:
    return [p for p in command.params if not getattr(p, "hidden", False)]


def _options(page: ManPage, command: Any) -> None:
    panels: dict[str, list[Any]] = {}
    for param in _visible(command):
        panels.setdefault(_panel(param), []).append(param)
    with page.section("OPTIONS"):
        for title, params in panels.items():
            page.subsection(title)
            for param in params:
                if title == "Arguments":
                    label = _italic(_metavar(param)) + (" ..." if param.nargs == -1 else "")
                    page.item(label, (param.help or "").strip())
                else:
                    page.raw(".TP", _option_label(param), *_option_body(param))
        if "Options" not in panels:
            page.subsection("Options")
        page.item(f"{_bold('-h')}, {_bold('--help')}", "Show the help and exit.")


def _synopsis(command: Any, words: str) -> str:
    parts = [_bold(words)]
    if any(isinstance(p, typer.core.TyperOption) for p in _visible(command)):
        parts.append(r"[\fIOPTIONS\fR]")
    for param in _visible(command):
        if isinstance(param, typer.core.TyperOption):
            continue
        text = _italic(_metavar(param)) + (" ..." if param.nargs == -1 else "")
        parts.append(text if param.required else f"[{text}]")
    return " ".join(parts)


def _environment(page: ManPage, command: Any | None) -> None:
    with page.section("ENVIRONMENT"):
        if command is None or command.name == "run":
            page.paragraph(
                "Every option of resilrun run has an environment variable: RESILRUN_<NAME>, and for torchrun's "
                "options also torchrun's PET_<NAME>. A flag beats RESILRUN_*, which beats PET_*."
            )
            for field in CONFIG_FIELDS:
                meta = field.metadata
                names = ", ".join(_bold(env) for env in meta["env"])
                page.item(names, f"{meta['flag']}: {meta['help']}")
        else:
            for param in _visible(command):
                envvar = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
                if envvar:
                    page.item(", ".join(_bold(e) for e in envvar), f"{param.opts[0]}: {param.help}")
        for names, meaning in EXTRA_ENV:
            if command is not None and command.name != "run" and names in _RUN_ONLY_ENV:
                continue
            page.item(", ".join(_bold(n) for n in names.split(", ")), meaning)
        if command is None or command.name == "run":
            page.subsection("Set for every worker")
            page.paragraph(
                "torchrun's worker environment, with the same names and meanings, plus resilrun's own: "
                + ", ".join(_worker_variables())
                + ". OMP_NUM_THREADS is set to 1 when unset and a node runs more than one worker."
            )


def _worker_variables() -> list[str]:
    """The names ``WorkerEnv.to_env`` sets, including those it sets only for non-empty values."""
    placeholders: dict[str, Any] = {"int": 0, "float": 0.0, "bool": True, "str": "x"}
    values = {}
    for field in dataclasses.fields(WorkerEnv):
        kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", "")
        if field.default is dataclasses.MISSING or field.default in ("", False):
            values[field.name] = placeholders.get(kind, "x")
    return list(WorkerEnv(**values).to_env({}))


def _exit_status(page: ManPage, which: str) -> None:
    codes, meanings = EXIT_CODES.get(which, tuple(ExitCode)), {**EXIT_CODE_MEANINGS, **EXIT_OVERRIDES.get(which, {})}
    with page.section("EXIT STATUS"):
        for code in codes:
            page.item(rf"\fB{int(code)}\fR", f"{meanings[code]} ({code.name}).")


def _files(page: ManPage, which: str) -> None:
    entries = {"inspect-checkpoint": CHECKPOINT_FILES, "status": LOG_FILES[:1]}.get(which, LOG_FILES + CHECKPOINT_FILES)
    with page.section("FILES"):
        for path, meaning in entries:
            page.item(_italic(path), meaning)


def _see_also(page: ManPage, which: str) -> None:
    pages = [f"{PROG}-{name}" if name else PROG for name in ["", *_commands()] if name != which]
    with page.section("SEE ALSO"):
        refs = [
            rf".BR {p.replace('-', chr(92) + '-')} (1)" + ("," if i < len(pages) - 1 else "")
            for i, p in enumerate(pages)
        ]
        page.raw(*refs)
        page.paragraph(f"torchrun: {SEE_ALSO_URL}")


def _commands() -> list[str]:
    group = typer.main.get_command(app)
    return [name for name in group.commands if not group.commands[name].hidden]  # type: ignore[attr-defined]


def _page(which: str) -> str:
    group = typer.main.get_command(app)
    command = group if which == "" else group.commands[which]  # type: ignore[attr-defined]
    name = f"{PROG}-{which}" if which else PROG
    summary = (command.help or "").strip().splitlines()[0].rstrip(".")
    page = ManPage(name, summary[0].lower() + summary[1:])
    with page.section("SYNOPSIS"):
        if which == "":
            page.raw(_synopsis(command, PROG) + r" \fICOMMAND\fR [\fIARGS\fR ...]", ".br")
            page.raw(_synopsis(group.commands["run"], PROG))  # type: ignore[attr-defined]
        elif which == "run":
            page.raw(_synopsis(command, f"{PROG} run"), ".br", _synopsis(command, PROG))
        else:
            page.raw(_synopsis(command, f"{PROG} {which}"))
    with page.section("DESCRIPTION"):
        for text in DESCRIPTIONS.get(which, [command.help or ""]):
            page.paragraph(text)
    if which == "":
        with page.section("COMMANDS"):
            for sub in _commands():
                help_text = group.commands[sub].help or ""  # type: ignore[attr-defined]
                page.item(_bold(sub), f"{help_text.strip().splitlines()[0]} See {PROG}-{sub}(1).")
    _options(page, command)
    _environment(page, None if which == "" else command)
    _exit_status(page, which)
    _files(page, which)
    with page.section("EXAMPLES"):
        for description, line in EXAMPLES.get(which, []):
            page.example(description, line)
    _see_also(page, which)
    return page.build()


# -- docs/flags.md -------------------------------------------------------------------------------------
FLAGS_DOC = "docs/flags.md"
# Where each help panel of resilrun run is explained at length (links relative to docs/).
PANEL_DOCS = {
    "Rendezvous": "[multi-host.md](multi-host.md)",
    "Processes": "[recovery.md](recovery.md) (restarts), [status.md](status.md#per-rank-logs) (logs)",
    "Health": "[recovery.md](recovery.md#detection)",
    "Checkpoints": "[recovery.md](recovery.md#checkpoint-tiers), [integrations.md](integrations.md)",
    "Observability": "[status.md](status.md)",
    "Security": "[security.md](security.md)",
}
COMPLETION_LINES = [
    "source completions/resilrun.bash                  # or: resilrun --install-completion",
    "cp completions/resilrun.zsh ~/.zfunc/_resilrun    # zsh, with fpath+=~/.zfunc before compinit",
    "cp completions/resilrun.fish ~/.config/fish/completions/",
    "man -l man/resilrun-run.1                         # one page per command, and man/resilrun.1",
]


def _md(text: str) -> str:
    """Plain help text as a Markdown table cell: options in code, pipes escaped, one line."""
    text = " ".join(text.split())
    return _OPTION.sub(lambda m: f"`{m.group(1)}`", text).replace("|", r"\|")


def _md_code(text: str) -> str:
    return "`" + text.replace("|", r"\|") + "`"


def _md_default(param: Any) -> str:
    default = param.default
    if param.is_flag:
        return "off"
    if default in (None, "", ()):
        return _SYMBOLIC_DEFAULTS.get(param.name, "")
    return _md_code(_symbolic(str(default)))


def _md_label(param: Any) -> str:
    """The option's spellings without torchrun's underscore aliases, then what it takes."""
    opts = sorted([*param.opts, *param.secondary_opts], key=lambda opt: opt.startswith("--"))
    shown = [opt for opt in opts if "_" not in opt] or opts
    names = ", ".join(_md_code(opt) for opt in shown)
    return names if param.is_flag else f"{names} {_md_code(_metavar(param))}"


def _md_envvars(param: Any) -> str:
    envvar = [param.envvar] if isinstance(param.envvar, str) else list(param.envvar or ())
    return ", ".join(_md_code(e) for e in envvar)


def _md_options(lines: list[str], command: Any, level: str) -> None:
    panels: dict[str, list[Any]] = {}
    for param in _visible(command):
        panels.setdefault(_panel(param), []).append(param)
    for title, params in panels.items():
        lines += ["", f"{level} {title}", ""]
        if title in PANEL_DOCS:
            lines += [f"Explained in {PANEL_DOCS[title]}.", ""]
        if title == "Arguments":
            lines += ["| argument | meaning |", "| --- | --- |"]
            for param in params:
                label = _md_code(_metavar(param) + (" ..." if param.nargs == -1 else ""))
                lines.append(f"| {label} | {_md((param.help or '').strip())} |")
            continue
        lines += ["| option | default | environment | meaning |", "| --- | --- | --- | --- |"]
        for param in params:
            row = [_md_label(param), _md_default(param), _md_envvars(param), _md((param.help or "").strip())]
            lines.append("| " + " | ".join(row) + " |")


def flags_markdown() -> str:
    """docs/flags.md: every command's options, the environment, the files and the exit codes."""
    group = typer.main.get_command(app)
    lines = [
        "<!-- Generated by python -m tools.docgen from the CLI definition (resilrun/config.py, resilrun/cli/): edit",
        "     those and regenerate; python -m tools.docgen --check (run by the tests) fails when this differs. -->",
        "",
        "# Flags, environment variables and exit codes",
        "",
        f"The reference of every `{PROG}` command, generated from the same definition as `--help` and the man",
        f"pages (`man -l man/{PROG}-run.1`). `{PROG} SCRIPT [ARGS]...` is short for `{PROG} run SCRIPT [ARGS]...`:",
        "everything after SCRIPT goes to the script untouched.",
        "",
        "Every torchrun flag keeps its name, its underscore spelling (`--nproc_per_node`) and its `PET_*`",
        "environment variable; every option of `run` is also `RESILRUN_<NAME>`. Precedence: flag >",
        "`RESILRUN_*` > `PET_*` > default. Every value is checked before anything starts (a bad one: exit 2).",
        "",
        f"Commands: {', '.join(f'[`{name}`](#{PROG}-{name})' for name in _commands())}; "
        "[environment](#environment-variables), [files](#files), [exit codes](#exit-codes), "
        "[completion and man pages](#shell-completion-and-man-pages).",
    ]
    for name in _commands():
        command = group.commands[name]  # type: ignore[attr-defined]
        summary = (command.help or "").strip().splitlines()[0]
        lines += ["", f"## `{PROG} {name}`", "", _md(summary)]
        _md_options(lines, command, "###")
    lines += [
        "",
        "## Environment variables",
        "",
        "Besides each option's own (above):",
        "",
        "| variable | meaning |",
        "| --- | --- |",
    ]
    for names, meaning in EXTRA_ENV:
        scope = f" (`{PROG} run` only)" if names in _RUN_ONLY_ENV else ""
        lines.append(f"| {', '.join(_md_code(n) for n in names.split(', '))} | {_md(meaning)}{scope} |")
    lines += [
        "",
        "Set for every worker: torchrun's worker environment, with the same names and meanings, plus",
        "resilrun's own: " + ", ".join(_md_code(v) for v in _worker_variables()) + ".",
        "`OMP_NUM_THREADS` is set to 1 when unset and a node runs more than one worker.",
        "",
        "## Files",
        "",
        "| path | what it holds |",
        "| --- | --- |",
    ]
    for path, meaning in LOG_FILES + CHECKPOINT_FILES:
        lines.append(f"| {_md_code(path)} | {_md(meaning)} |")
    lines += [
        "",
        "## Exit codes",
        "",
        f"What `{PROG} run` exits with (`{PROG}` with no command is `run`):",
        "",
        "| code | name | meaning |",
        "| --- | --- | --- |",
    ]
    for code in ExitCode:
        lines.append(f"| {int(code)} | `{code.name}` | {_md(EXIT_CODE_MEANINGS[code])} |")
    lines += [
        "",
        "The commands that launch nothing exit with some of these codes, some meaning something else:",
        "",
        "| command | code | meaning |",
        "| --- | --- | --- |",
    ]
    for which, codes in EXIT_CODES.items():
        meanings = {**EXIT_CODE_MEANINGS, **EXIT_OVERRIDES.get(which, {})}
        for code in codes:
            lines.append(f"| `{PROG} {which}` | {int(code)} | {_md(meanings[code])} |")
    lines += [
        "",
        "A worker (not the launcher) exits with these codes for its agent to read:",
        "",
        "| code | meaning |",
        "| --- | --- |",
    ]
    for code, meaning in WORKER_EXIT_CODES:
        lines.append(f"| {code} | {_md(meaning)} |")
    lines += [
        "",
        "## Shell completion and man pages",
        "",
        "Generated from the CLI definition and committed with this file (`python -m tools.docgen` writes them):",
        "",
        "```",
        *COMPLETION_LINES,
        "```",
        "",
        f"Completion knows that `run` is the default command: `{PROG} --nn<TAB>` offers `--nnodes`.",
    ]
    return "\n".join(lines) + "\n"


def generate() -> dict[str, str]:
    """Every generated file, by path relative to the repository root."""
    files = {f"completions/{PROG}.{shell}": completion_script(shell) for shell in SHELLS}
    for which in ["", *_commands()]:
        files[f"man/{PROG}-{which}.1" if which else f"man/{PROG}.1"] = _page(which)
    files[FLAGS_DOC] = flags_markdown()
    return files


def stale(root: Path = ROOT) -> list[str]:
    """The generated files that are missing or differ under ``root``."""
    out = []
    for rel, text in generate().items():
        path = root / rel
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            out.append(rel)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.docgen", description="Write completions/, man/ and docs/flags.md from the CLI definition."
    )
    parser.add_argument("--check", action="store_true", help="fail (exit 1) if a committed file differs")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    out = Output()
    if args.check:
        differ = stale(args.root)
        for rel in differ:
            out.data(rel)
        if differ:
            out.error(f"{len(differ)} generated file(s) differ from the CLI", "run: python -m tools.docgen")
            return 1
        return 0
    for rel, text in generate().items():
        path = args.root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.is_file() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            out.info(f"wrote {rel}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
