"""``resilrun inspect-checkpoint PATH|s3://bucket/prefix``: what a durable checkpoint holds, verified.

Lists every step (complete or partial) and, for one step (``--step N``, else the newest complete
one), every rank's tensors with dtype, shape and size, and totals; then the files a script saved
itself that ``--capture-dir`` captured (docs/captured-checkpoints.md). ``--verify`` downloads every
file and checks every crc32 (a captured file: its SHA-256); ``--job-secret-file`` (the run's) also
checks every MAC the run wrote and says whether the step, and each captured file, is authentic
(written by the job, unchanged since). Reading a checkpoint never executes anything from it:
corrupt, truncated or forged step files end as one error line with a hint and exit code 4 (5 when
storage fails, 2 for usage). Captured files are reported one by one; one whose bytes differ from
its index, or whose MAC does not verify under the given secret, makes the exit code 4 after the
report (an unsigned one does not: the job never restores it from storage).

``--json`` prints one document on stdout with this stable shape (fields are only ever added)::

    {"data": {
      "uri": str,
      "steps": [{"step": int, "complete": bool, "ranks": [int, ...]}, ...],       # oldest first
      "latest_complete_step": int | null,
      "selected": null | {                                                       # null: nothing complete
        "step": int, "complete": bool, "world_size": int | null, "verified": bool,
        "authentic": bool | null,     # null: not checked (no secret); false: the step carries no MACs
        "ranks": [{"rank": int, "file": str, "file_bytes": int, "tensor_bytes": int,
                   "tensors": [{"name": str, "dtype": str, "shape": [int, ...], "bytes": int, "crc32": int}],
                   "values": <the tracked non-tensor values, any JSON>}],
        "totals": {"ranks": int, "tensors": int, "tensor_bytes": int, "file_bytes": int}},
      "captured": [{"path": str, "bytes": int, "sha256": str,                    # by path
                    "captured_at": float,    # the capturing agent's wall clock, Unix seconds
                    "node": str,             # the capturing agent's node id
                    "signed": bool,          # its index carries a MAC
                    "authentic": bool | null,  # the MAC verifies under the secret; null: no secret
                    "verified": bool | null,   # --verify: the bytes hash to sha256; null: not checked
                    "problem": str | null}]}}  # why verified or authentic is false

or, on failure, ``{"error": {"code": <error class name>, "message": str, "hint": str | null}}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Annotated, Any

import typer

from resilrun.cli._errors import render
from resilrun.cli._output import Output
from resilrun.cli._progress import progress as _progress
from resilrun.cli._secret import secret_file_option
from resilrun.errors import CheckpointError, CheckpointNotFoundError, ExitCode, StorageError
from resilrun.log import rank_ranges

# Ranks are read concurrently: per-request latency, not bandwidth, dominates S3 reads of headers.
_HEADER_CONCURRENCY = 8
# --verify holds each rank's whole file in memory while checking it: two at a time bounds memory
# to two snapshots and still overlaps one download with one checksum pass.
_VERIFY_CONCURRENCY = 2


def inspect_checkpoint(
    uri: Annotated[str, typer.Argument(metavar="PATH|s3://bucket/prefix", help="Checkpoint directory or S3 URI.")],
    step: Annotated[
        int | None,
        typer.Option("--step", min=0, metavar="INTEGER", help="Show this step (default: the newest complete one)."),
    ] = None,
    verify: Annotated[
        bool, typer.Option("--verify", metavar="", help="Download every file and check every checksum.")
    ] = False,
    json_output: Annotated[bool, typer.Option("--json", metavar="", help="Print one JSON document on stdout.")] = False,
    job_secret_file: Annotated[
        str | None,
        secret_file_option("The run's secret file: also check every MAC (implies --verify); say if authentic."),
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
    """List a checkpoint's steps, ranks, tensors and captured files; --verify checks every checksum."""
    out = Output(json_mode=json_output)
    try:
        report = _inspect(uri, step, verify, job_secret_file or None, s3_endpoint_url, s3_expected_owner)
    except Exception as exc:
        if not json_output:
            raise  # main() renders it as one line + hint
        raise typer.Exit(render(exc, out)) from None
    if json_output:
        out.json(report)
    else:
        for line in _human(report):
            out.data(line)
    failed = [c["path"] for c in report["captured"] if _failed(c)]
    if failed:
        if not json_output:  # (in --json, each entry's "problem" says it; one document on stdout)
            out.error(
                f"{len(failed)} captured file(s) failed their check: {', '.join(sorted(failed)[:5])}",
                "a job restores none of them from storage; see the lines above",
            )
        raise typer.Exit(int(ExitCode.CHECKPOINT))


# -- gathering -------------------------------------------------------------------------------------
def _inspect(
    uri: str,
    step: int | None,
    verify: bool,
    job_secret_file: str | None,
    endpoint_url: str | None,
    expected_owner: str | None,
) -> dict[str, Any]:
    from resilrun.checkpoint import durable_mac_key
    from resilrun.storage import create_storage
    from resilrun.tiers import durable

    storage = create_storage(uri, s3_endpoint_url=endpoint_url, s3_expected_owner=expected_owner)
    mac_key = durable_mac_key(job_secret_file, storage.uri)  # (bound to the checkpoint's URI)
    verify = verify or mac_key is not None
    steps = durable.list_steps(storage)
    listed = _list_captured(storage, mac_key)
    captured = [entry for _, entry in listed]
    if not steps and not captured:
        raise CheckpointNotFoundError(
            f"no checkpoint under {storage.uri}",
            hint="check the path or URI; a checkpoint holds step_<12 digits>/ folders or captured/ files",
        )
    complete = [info.step for info in steps if info.complete]
    latest = max(complete) if complete else None
    report: dict[str, Any] = {
        "uri": storage.uri,
        "steps": [{"step": s.step, "complete": s.complete, "ranks": list(s.ranks)} for s in steps],
        "latest_complete_step": latest,
        "selected": None,
        "captured": captured,
    }
    chosen = latest if step is None else step
    if chosen is None:
        if verify and steps and not captured:
            raise CheckpointNotFoundError(
                f"no step under {storage.uri} is complete, so none can be verified",
                hint="pass --step N to verify the ranks a partial step has",
            )
    else:
        info = next((s for s in steps if s.step == chosen), None)
        if info is None:
            shown = ", ".join(str(s.step) for s in steps[-5:]) or "none (captured files only)"
            hint = f"the newest steps are {shown}"
            raise CheckpointNotFoundError(f"step {chosen} is not in {storage.uri}", hint=hint)
        report["selected"] = _describe(storage, info, verify, mac_key)
    if verify and listed:
        _verify_captured(storage, listed)
    return report


def _list_captured(storage: Any, mac_key: bytes | None) -> list[tuple[Any, dict[str, Any]]]:
    """The captured files the persistent tier lists (``tiers.captured.durable``), newest version of
    each path; an index that does not parse is left out with a warning on stderr (``listed``)."""
    from resilrun.tiers.captured import durable as captured

    found = []
    for stored in sorted(captured.listed(storage, mac_key), key=lambda s: s.version.path):
        version = stored.version
        signed = stored.signed or _carries_mac(storage, captured.index_key(version.path))
        problem = None
        if mac_key is not None and not stored.signed:
            problem = "its MAC does not verify under the job secret" if signed else "unsigned"
        found.append(
            (
                version,
                {
                    "path": version.path,
                    "bytes": version.size,
                    "sha256": version.sha256,
                    "captured_at": round(version.captured_ns / 1e9, 3),
                    "node": version.node,
                    "signed": signed,
                    "authentic": None if mac_key is None else stored.signed,
                    "verified": None,
                    "problem": problem,
                },
            )
        )
    return found


def _failed(entry: dict[str, Any]) -> bool:
    """A captured file whose bytes differ from its index, or whose MAC does not verify: corruption
    or tampering. An unsigned one is not a failure (a job without a secret writes them so, and
    never restores them from storage)."""
    return entry["verified"] is False or (entry["signed"] and entry["authentic"] is False)


def _carries_mac(storage: Any, key: str) -> bool:
    """Whether an index names a MAC at all: without the secret that is all one can tell, and with it
    a MAC that does not verify (forged, or another job's) differs from none (a job without secret)."""
    try:
        description = json.loads(storage.get(key))
    except (StorageError, ValueError):
        return False
    return isinstance(description, dict) and "mac" in description


def _verify_captured(storage: Any, listed: list[tuple[Any, dict[str, Any]]]) -> None:
    """Download each captured file and check its bytes against the SHA-256 its index names."""
    from resilrun.tiers.captured import durable

    with _progress("verifying captured files", len(listed)) as bar:
        for version, entry in listed:
            try:
                durable.read(storage, version)
                entry["verified"] = True
            except (CheckpointError, StorageError) as exc:
                entry["verified"] = False
                entry["problem"] = exc.message if entry["problem"] is None else f"{entry['problem']}; {exc.message}"
            bar.advance(1)


def _describe(storage: Any, info: Any, verify: bool, mac_key: bytes | None) -> dict[str, Any]:
    from resilrun.tiers import durable

    complete = durable.read_complete(storage, info.step) if info.complete else None
    ranks = list(range(complete["world_size"])) if complete else list(info.ranks)
    total = sum(complete["ranks"][str(r)]["file_bytes"] for r in ranks) if complete and verify else len(ranks)

    if mac_key is not None and complete is None:
        raise CheckpointNotFoundError(
            f"step {info.step} is partial: it has no COMPLETE.json, whose MAC vouches for its ranks",
            hint="drop --job-secret-file to check the checksums of a partial step",
        )

    def read(rank: int) -> tuple[Any, dict[str, Any], int]:
        if verify:
            layout, data, manifest = durable.read_rank(
                storage,
                info.step,
                rank,
                verify=True,
                complete=complete,
                require_complete=info.complete,
                mac_key=mac_key,
            )
            return layout, manifest, len(data) if complete else 1
        layout, manifest = durable.read_layout(
            storage, info.step, rank, complete=complete, require_complete=info.complete
        )
        return layout, manifest, 1

    described = []
    label = f"{'verifying' if verify else 'reading'} step {info.step}"
    pool = ThreadPoolExecutor(max_workers=_VERIFY_CONCURRENCY if verify else _HEADER_CONCURRENCY)
    try:
        with _progress(label, total) as bar:
            for rank, (layout, manifest, done) in zip(ranks, pool.map(read, ranks), strict=True):
                described.append(_describe_rank(rank, layout, manifest))
                bar.advance(done)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # the first corrupt rank ends the run at once
    world_size = complete["world_size"] if complete else (described[0]["world_size"] if described else None)
    marks = {entry.pop("authentic") for entry in described}
    for entry in described:
        entry.pop("world_size")
    return {
        "step": info.step,
        "complete": info.complete,
        "world_size": world_size,
        "verified": verify,
        "authentic": None if mac_key is None else marks == {True},
        "ranks": described,
        "totals": {
            "ranks": len(described),
            "tensors": sum(len(r["tensors"]) for r in described),
            "tensor_bytes": sum(r["tensor_bytes"] for r in described),
            "file_bytes": sum(r["file_bytes"] for r in described),
        },
    }


def _describe_rank(rank: int, layout: Any, manifest: dict[str, Any]) -> dict[str, Any]:
    tensors = [
        {
            "name": e.name,
            "dtype": e.dtype,
            "shape": list(e.shape),
            "bytes": e.nbytes,
            "crc32": manifest["tensors"][e.name]["crc32"],
        }
        for e in layout.entries
    ]
    return {
        "rank": rank,
        "world_size": manifest["world_size"],
        "file": manifest["file"],
        "file_bytes": manifest["file_bytes"],
        "tensor_bytes": sum(t["bytes"] for t in tensors),
        "tensors": tensors,
        "values": manifest["values"],
        "authentic": manifest.get("authentic"),
    }


# -- rendering -------------------------------------------------------------------------------------
def _human(report: dict[str, Any]) -> Iterator[str]:
    yield f"checkpoint {report['uri']}"
    yield from _human_steps(report)
    yield from _human_captured(report["captured"])


def _human_steps(report: dict[str, Any]) -> Iterator[str]:
    steps = report["steps"]
    if not steps:
        yield "no steps (nothing saved through resilrun.init/track)"
        return
    yield f"{len(steps)} step(s), {sum(s['complete'] for s in steps)} complete"
    yield from _table(
        [("STEP", "STATE", "RANKS")]
        + [(str(s["step"]), "complete" if s["complete"] else "partial", rank_ranges(s["ranks"]) or "-") for s in steps],
        indent=2,
    )
    selected = report["selected"]
    if selected is None:
        yield "no complete step; pass --step N to show a partial one"
        return
    state = "complete" if selected["complete"] else "partial (not committed)"
    checked = "every checksum verified" if selected["verified"] else "checksums not verified (use --verify)"
    if selected.get("authentic") is True:
        checked += "; authentic: every MAC verifies under the job secret"
    elif selected.get("authentic") is False:
        checked += "; NOT authenticated: the step carries no MACs (its run had no secret from outside the store)"
    yield ""
    yield f"step {selected['step']}: {state}, world size {selected['world_size']}, {checked}"
    for rank in selected["ranks"]:
        yield f"  rank {rank['rank']}  {rank['file']}  {_size(rank['file_bytes'])}"
        rows = [("NAME", "DTYPE", "SHAPE", "BYTES")] + [
            (t["name"], t["dtype"], "[" + ", ".join(map(str, t["shape"])) + "]", _size(t["bytes"]))
            for t in rank["tensors"]
        ]
        yield from _table(rows, indent=4)
        if isinstance(rank["values"], dict) and rank["values"]:
            yield f"    values: {', '.join(sorted(rank['values']))}"
    totals = selected["totals"]
    yield (
        f"total: {totals['ranks']} rank(s), {totals['tensors']} tensor(s), "
        f"{_size(totals['tensor_bytes'])} of tensor data, {_size(totals['file_bytes'])} on storage"
    )


def _human_captured(captured: list[dict[str, Any]]) -> Iterator[str]:
    if not captured:
        return
    yield ""
    yield f"Captured files ({len(captured)}, saved by the script itself under --capture-dir)"
    rows = [("PATH", "BYTES", "SHA256", "CAPTURED", "NODE", "CHECK")] + [
        (
            c["path"],
            _size(c["bytes"]),
            c["sha256"][:12],
            datetime.fromtimestamp(c["captured_at"]).strftime("%Y-%m-%d %H:%M:%S"),
            c["node"],
            _check(c),
        )
        for c in captured
    ]
    yield from _table(rows, indent=2)
    for entry in captured:
        if _failed(entry):
            yield f"  {entry['path']}: {entry['problem']}"
    if any(c["authentic"] is None for c in captured):
        yield "  (MACs not checked: give the run's --job-secret-file; only signed files are restored from storage)"


def _check(entry: dict[str, Any]) -> str:
    """``authentic, bytes verified``; what failed, in capitals, when something did."""
    if entry["authentic"] is None:
        said = "signed" if entry["signed"] else "unsigned"
    elif entry["authentic"]:
        said = "authentic"
    else:
        said = "NOT authentic (" + ("MAC does not verify" if entry["signed"] else "unsigned") + ")"
    if entry["verified"] is True:
        said += ", bytes verified"
    elif entry["verified"] is False:
        said += ", BYTES NOT VERIFIED"
    return said


def _table(rows: Sequence[Sequence[str]], *, indent: int) -> Iterator[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        yield " " * indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()


def _size(nbytes: int) -> str:
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{nbytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
