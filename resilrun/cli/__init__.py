"""The command-line interface: the only package that imports typer/rich and prints.

``resilrun SCRIPT ...`` means ``resilrun run SCRIPT ...`` (``run`` is the default command). Errors
from any layer are rendered once, in ``main``, as a one-line message, a hint and an exit code.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import typer

from resilrun import __version__
from resilrun.cli import run as run_cmd
from resilrun.cli import status as status_cmd
from resilrun.cli._errors import render
from resilrun.cli._output import Output
from resilrun.cli.export import export
from resilrun.cli.inspect import inspect_checkpoint
from resilrun.env import SHELL_COMPLETE_ENV, shell_completion_request
from resilrun.errors import ExitCode

__all__ = ["app", "main"]

app = typer.Typer(
    name="resilrun",
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="A torchrun-compatible launcher for distributed PyTorch training that survives failures.",
    epilog="resilrun SCRIPT ARGS... is short for resilrun run SCRIPT ARGS... (see resilrun run --help).",
)


def _version(value: bool) -> None:
    if value:
        Output().data(f"resilrun {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """A torchrun-compatible launcher for distributed PyTorch training that survives failures."""


app.command("run", context_settings=run_cmd.CONTEXT)(run_cmd.run)
app.command("inspect-checkpoint")(inspect_checkpoint)
app.command("status")(status_cmd.status)
app.command("export")(export)

_TOP_LEVEL = {"--help", "-h", "--version", "--install-completion", "--show-completion"}


def _with_default_command(argv: list[str]) -> list[str]:
    """Insert ``run`` when the first word is neither a command nor a top-level option."""
    if not argv:
        return argv
    commands = set(typer.main.get_command(app).commands)  # type: ignore[attr-defined]  # a click Group
    first = argv[0]
    if first in commands or first in _TOP_LEVEL:
        return argv
    return ["run", *argv]


def _complete_with_default_command(command: Any) -> None:
    """Answer a shell-completion request knowing that ``run`` is the default command.

    typer completes the words as they stand, so ``resilrun --nn<TAB>`` would see only the top-level
    options. Here the words are completed as ``main`` parses them: after ``_with_default_command``,
    and a first word that is an option is offered both the top-level options and ``run``'s. Anything
    else (``source_<shell>``, a normal run) is left to typer.
    """
    instruction = shell_completion_request()
    if not instruction.startswith("complete_"):
        return
    from typer._click.shell_completion import get_completion_class  # typer's bundled click

    shell_class = get_completion_class(instruction.removeprefix("complete_"))
    if shell_class is None:
        return  # typer reports the unknown shell
    completer = shell_class(command, {}, "resilrun", SHELL_COMPLETE_ENV)
    complete_words = completer.get_completions

    def get_completions(args: list[str], incomplete: str) -> list[Any]:
        args = _with_default_command(list(args))
        items = list(complete_words(args, incomplete))
        if not args and incomplete.startswith("-"):
            seen = {item.value for item in items}
            items += [item for item in complete_words(["run"], incomplete) if item.value not in seen]
        return items

    completer.get_completions = get_completions  # type: ignore[method-assign]  # this one instance only
    Output().data(completer.complete())
    sys.exit(0)


def _setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[resilrun %(asctime)s %(levelname)s] %(message)s", "%H:%M:%S"))
    root = logging.getLogger("resilrun")
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    root.propagate = False


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point; never shows a traceback for a user mistake."""
    command = typer.main.get_command(app)
    _complete_with_default_command(command)
    args = status_cmd.normalize_argv(_with_default_command(list(sys.argv[1:] if argv is None else argv)))
    _setup_logging()
    out = Output()
    try:
        code = command.main(args, prog_name="resilrun", standalone_mode=False)
        sys.exit(int(code or 0) if isinstance(code, int) else 0)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        sys.exit(int(ExitCode.INTERRUPTED))
    except typer.TyperException as exc:  # typer's own (bundled click) usage errors
        if type(exc).__name__ == "NoArgsIsHelpError":
            exc.show()
        else:
            hint = "run 'resilrun run --help' for the options" if args[:1] == ["run"] else "run 'resilrun --help'"
            out.error(exc.format_message(), hint)
        sys.exit(int(ExitCode.USAGE))
    except BaseException as exc:  # noqa: BLE001 - the one place errors become exit codes
        if isinstance(exc, SystemExit):
            raise
        sys.exit(render(exc, out))
