"""Worker entry point: runs the user's script exactly as ``python -u script.py`` would.

Why a bootstrap at all: it records an uncaught exception into ``TORCHELASTIC_ERROR_FILE`` (what
torchrun's ``@record`` does, but without asking the user to decorate anything), so the agent's
root-cause report carries the worker's own traceback. It imports nothing heavy: torch is imported
by the user's script, not by us.

Usage: ``python -u -m resilrun.worker._bootstrap [-m] TARGET [ARGS...]``
"""

from __future__ import annotations

import faulthandler
import json
import os
import runpy
import sys
import time
import traceback


def write_error_file(exc: BaseException) -> None:
    """Write torchrun's error-file format, unless the script already wrote one (it knows better)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    record = {
        "message": {
            "message": f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(int(time.time())),
            },
        }
    }
    try:
        tmp = f"{path}.tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(record, handle)
        os.replace(tmp, path)
    except OSError:
        pass  # the report then falls back to the exit code; never mask the user's exception


def main(argv: list[str]) -> None:
    as_module = bool(argv) and argv[0] == "-m"
    if as_module:
        argv = argv[1:]
    target, args = argv[0], argv[1:]
    faulthandler.enable(all_threads=True)
    try:
        if as_module:
            sys.argv = [target, *args]
            sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *args]
            sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (None, 0):
            write_error_file(exc)
        raise
    except BaseException as exc:
        write_error_file(exc)
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
