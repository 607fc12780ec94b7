"""How a ``Config`` field is also a ``run`` option: its field metadata and the text -> value rules.

A run option is defined once, on its ``Config`` field: ``option_meta`` gives the flag, the
environment names (``RESILRUN_*``, then torchrun's ``PET_*``), the help, the panel, the value
placeholder and the parser; ``cli/run.py`` builds the command from those fields, and
``tools/docgen.py`` the man pages. Beside ``option_values`` rather than in it: that module parses the
compound values a ``Config`` holds (ranges, endpoints, ``--rdzv-conf``) for every reader of them,
while this one only turns the text of a command line or an environment variable into a field's value.

Invariants: like ``config``, nothing here imports the CLI, reads the environment or touches the
network; bad text is a one-line ``ConfigError`` naming the flag, never typer's error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from resilrun.env import SNAPSHOT_AUTO
from resilrun.errors import ConfigError


def option_meta(
    flag: str,
    panel: str,
    help: str,
    *,
    pet: bool = True,
    short: tuple[str, ...] = (),
    value: str | None = None,
    parse: Callable[[str, str], Any] | None = None,
    show_envvar: bool = False,
) -> dict[str, Any]:
    """Everything the CLI needs of a field besides its name, type and default (the one definition
        of a ``run`` option: cli/run.py builds the command from these). ``parse(flag, text)`` converts
        the text given on the command line or in the environment; None: by the field's type
        (``cli_value``). ``value``: what the option takes, as ``--help`` and the man page show it
    (None: a flag that takes no value). ``short``: one-letter spellings; ``show_envvar``: ``--help``
    names the variables."""
    name = flag.lstrip("-").replace("-", "_").upper()
    envs = [f"RESILRUN_{name}"] + ([f"PET_{name}"] if pet else [])
    return {
        "flag": flag,
        "env": envs,
        "panel": panel,
        "help": help,
        "value": value,
        "short": short,
        "parse": parse,
        "show_envvar": show_envvar,
    }


# -- the command line's text -> a field's value (every conversion of a run option is here) ----------
def _integer(flag: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{flag} '{value}' is not an integer") from None


def _seconds(flag: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{flag} '{value}' is not a number of seconds") from None


def parse_every(flag: str, value: str) -> int:
    """``N`` or ``auto`` (SNAPSHOT_AUTO)."""
    if value.strip().lower() == "auto":
        return SNAPSHOT_AUTO
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise ConfigError(f"{flag} '{value}' is not a positive integer or auto", hint=f"e.g. {flag} 10 or {flag} auto")
    return number


def parse_percent(flag: str, value: str) -> float:
    try:
        return float(value.strip().removesuffix("%"))
    except ValueError:
        raise ConfigError(f"{flag} '{value}' is not a percentage", hint=f"e.g. {flag} 3") from None


def one_of(*choices: str) -> Callable[[str, str], str]:
    """A parser for an option that takes one of ``choices`` (the first is the default, named in the hint)."""

    def parse(flag: str, value: str) -> str:
        if value.strip().lower() not in choices:
            others = ", ".join(choices[1:-1])
            raise ConfigError(
                f"{flag} '{value}' is unknown",
                hint=f"use {choices[0]} (default){', ' + others if others else ''} or {choices[-1]}",
            )
        return value.strip().lower()

    return parse


def parse_count(flag: str, value: str) -> int:
    """A number of things, 0 or more."""
    number = _integer(flag, value)
    if number < 0:
        raise ConfigError(f"{flag} ({number}) must be >= 0")
    return number


_BY_TYPE: dict[str, Callable[[str, str], Any]] = {"int": _integer, "float": _seconds}


def _kind(spec: dataclasses.Field[Any]) -> str:
    """The field's type without ``| None`` (annotations are strings here)."""
    return str(spec.type).replace(" | None", "")


def cli_value(spec: dataclasses.Field[Any], value: Any) -> Any:
    """What the text given for ``spec``'s flag means as the field's value (None and "" for an
    optional field: not given).

    Raises:
        ConfigError: not a value of the field's kind (one line naming the flag).
    """
    meta = spec.metadata
    if isinstance(value, bool) or value is None:
        return value
    if value == "" and _kind(spec) != "str":
        return None  # given empty: as not given (an optional field stays None, others their default)
    parse = meta["parse"] or _BY_TYPE.get(_kind(spec))
    return parse(meta["flag"], value) if parse is not None else value


def cli_default(spec: dataclasses.Field[Any]) -> Any:
    """The default as the command line spells it (``--help`` shows it): text for options that
    take one, the bool for flags, None where there is none."""
    default = spec.default
    if default is None or isinstance(default, bool):
        return default
    if spec.metadata["parse"] is parse_every and default == SNAPSHOT_AUTO:
        return "auto"
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)
