"""The typer option of a Config field, built from the field's metadata (cli/run.py makes the
``run`` command's parameters with it).

Flag names, environment spellings (``RESILRUN_*`` then torchrun's ``PET_*``), help text and panels
come from the ``Config`` fields' metadata (declared with ``resilrun.options.option_meta``); a test
checks that the ``run`` command and ``Config`` stay one-to-one.
"""

from __future__ import annotations

from typing import Any

import typer

from resilrun.config import CONFIG_FIELDS

_FIELDS = {f.name: f for f in CONFIG_FIELDS}


def _decls(flag: str) -> list[str]:
    decls = [flag]
    if "-" in flag[2:]:
        decls.append("--" + flag[2:].replace("-", "_"))
    return decls


def option(name: str, *short: str, **kwargs: Any) -> Any:
    meta = _FIELDS[name].metadata
    return typer.Option(
        *_decls(meta["flag"]),
        *short,
        envvar=list(meta["env"]),
        help=meta["help"],
        rich_help_panel=meta["panel"],
        metavar=meta["value"] or "",  # a flag takes no value: show none (typer would say <bool>)
        show_default=True,
        **kwargs,
    )
