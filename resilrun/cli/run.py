"""``resilrun [run] [OPTIONS] SCRIPT [ARGS...]``: launch and supervise this node's workers.

The command's options are not written here: each is a ``Config`` field (resilrun/config.py: its
flag, environment names, help, panel, default and parser, declared with resilrun/options.py), and
``run``'s signature is built from those fields, so adding a flag touches one definition. typer reads
the built signature.
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any

import typer

from resilrun.cli._options import option
from resilrun.config import CONFIG_FIELDS
from resilrun.errors import ConfigError
from resilrun.options import cli_default, cli_value

CONTEXT = {
    "allow_extra_args": True,
    "ignore_unknown_options": True,
    "allow_interspersed_args": False,
    "help_option_names": ["-h", "--help"],
}

_Script = Annotated[
    str, typer.Argument(metavar="SCRIPT", help="Training script (or module with -m, program with --no-python).")
]
_ScriptArgs = Annotated[
    list[str] | None, typer.Argument(metavar="ARGS", help="Arguments passed to the script untouched.")
]


def _launch(script: str, script_args: list[str] | None = None, **options: Any) -> None:
    """Launch SCRIPT on this node's workers and supervise them (torchrun's flags and semantics)."""
    from resilrun.config import Config

    if script.startswith("-") and not options.get("no_python"):
        raise ConfigError(f"unknown option '{script}'", hint="run 'resilrun run --help' for the options")
    values = {spec.name: cli_value(spec, options[spec.name]) for spec in CONFIG_FIELDS}
    config = Config.from_cli(**values, script=script, script_args=tuple(script_args or ()))
    from resilrun import agent

    agent.run(config)


def _parameter(spec: Any) -> inspect.Parameter:
    """The keyword parameter typer makes ``spec``'s option from: a flag is a bool, everything else
    text (converted by ``cli_value``, so a bad value gets resilrun's one-line error, not typer's)."""
    meta = spec.metadata
    default = cli_default(spec)
    kind: Any = bool if isinstance(default, bool) else (str if default is not None else str | None)
    decl = option(spec.name, *meta["short"], **({"show_envvar": True} if meta["show_envvar"] else {}))
    return inspect.Parameter(
        spec.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=Annotated[kind, decl]
    )


def _command() -> Any:
    def run(script: str, script_args: list[str] | None = None, **options: Any) -> None:
        _launch(script, script_args, **options)

    parameters = [
        inspect.Parameter("script", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=_Script),
        inspect.Parameter("script_args", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=None, annotation=_ScriptArgs),
        *(_parameter(spec) for spec in CONFIG_FIELDS),
    ]
    run.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    run.__doc__ = _launch.__doc__
    return run


run = _command()
