"""``resilrun export URI --to PATH``: a persisted step as a ``model.safetensors`` or a DCP directory.

The safetensors file holds one tracked module (``--object``, default the one module the script
tracked) under the model's own parameter names (DDP's ``module.`` and torch.compile's ``_orig_mod.``
removed), loadable with ``safetensors.torch.load_file`` and ``model.load_state_dict``. A DCP
directory holds every tracked object (or those named), readable by ``torch.distributed.checkpoint.load``.
FSDP2/DTensor shards are consolidated from every rank's file. Every checksum is verified (and, with
``--job-secret-file``, every MAC: a step changed since, or without MACs, is refused); nothing
from the checkpoint is unpickled. Progress is drawn on a terminal only.

``--json`` prints ``{"data": {"path", "format", "step", "names", "tensors", "bytes", "skipped"}}``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from resilrun.cli._errors import render
from resilrun.cli._output import Output
from resilrun.cli._progress import progress
from resilrun.cli._secret import secret_file_option


def export(
    uri: Annotated[str, typer.Argument(metavar="PATH|s3://bucket/prefix", help="Checkpoint directory or S3 URI.")],
    to: Annotated[
        Path,
        typer.Option(
            "--to", metavar="PATH", help="Where to write: a .safetensors file (or a directory for it), a DCP directory."
        ),
    ],
    step: Annotated[
        int | None,
        typer.Option("--step", min=0, metavar="INTEGER", help="Export this step (default: the newest complete one)."),
    ] = None,
    fmt: Annotated[
        str,
        typer.Option("--format", metavar="safetensors|dcp", help="safetensors: one model's weights; dcp: a DCP dir."),
    ] = "safetensors",
    objects: Annotated[
        list[str] | None,
        typer.Option("--object", metavar="NAME", help="A tracked name to export (repeatable; default: the model)."),
    ] = None,
    force: Annotated[bool, typer.Option("--force", metavar="", help="Replace what is at --to.")] = False,
    json_output: Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON document on stdout.")] = False,
    job_secret_file: Annotated[
        str | None,
        secret_file_option("The run's secret file: export only a step whose every MAC verifies."),
    ] = None,
    s3_endpoint_url: Annotated[
        str | None,
        typer.Option(
            "--s3-endpoint-url", metavar="URL", envvar="RESILRUN_S3_ENDPOINT_URL", help="S3-compatible endpoint URL."
        ),
    ] = None,
    s3_expected_owner: Annotated[
        str | None,
        typer.Option(
            "--s3-expected-owner",
            metavar="ACCOUNT",
            envvar="RESILRUN_S3_EXPECTED_OWNER",
            help="Account id that must own the bucket.",
        ),
    ] = None,
) -> None:
    """Write a persisted step's weights as model.safetensors or a DCP checkpoint."""
    out = Output(json_mode=json_output)
    try:
        from resilrun.checkpoint import export as exporter
        from resilrun.checkpoint import open_step
        from resilrun.errors import ConfigError

        if fmt not in exporter.FORMATS:
            raise ConfigError(f"--format {fmt!r} is not one of {', '.join(exporter.FORMATS)}")
        target = exporter.check_target(to, fmt, force)  # before any download
        opened = open_step(
            uri,
            step,
            s3_endpoint_url=s3_endpoint_url,
            s3_expected_owner=s3_expected_owner,
            job_secret_file=job_secret_file or None,
        )
        names = exporter.choose_names(opened, tuple(objects or ()), fmt)
        with progress(f"reading step {opened.step}", opened.world_size) as bar:
            done = exporter.export(opened, names, fmt, target, force=force, progress=bar.update)
    except Exception as exc:
        if not json_output:
            raise  # main() renders it as one line + hint
        raise typer.Exit(render(exc, out)) from None
    if json_output:
        out.json(dataclasses.asdict(done))
        return
    size = f"{done.bytes / 2**20:.1f} MiB" if done.bytes >= 2**20 else f"{done.bytes} B"
    out.data(f"exported step {done.step} ({', '.join(done.names)}: {done.tensors} tensors, {size}) to {done.path}")
    if done.skipped:
        out.info(f"not tensors, left out of the file: {', '.join(done.skipped)}")
