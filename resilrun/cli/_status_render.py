"""How a job status document looks: plain text lines (pipes, logs) and rich tables (a terminal).

Pure functions of the document ``resilrun.status.view.compose`` returns; nothing here reads a
store or the clock, so the same document always renders the same way (and tests compare text).
Health colours on a terminal: green is healthy, yellow needs a look (recovering, a late heartbeat,
a lagging tier), red is broken (failed, lost, unresponsive).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

GOOD = {"running", "active", "succeeded", "finished", "complete"}
WARN = {"recovering", "restarting", "forming", "joining", "starting", "waiting", "spare", "degraded", "in progress"}
BAD = {"failed", "lost", "unresponsive", "stopped", "error", "unknown"}


def colour(state: str) -> str:
    if state in GOOD:
        return "green"
    if state in WARN:
        return "yellow"
    return "red" if state in BAD else "white"


def _num(value: Any, fmt: str = "{}", missing: str = "-") -> str:
    return missing if value is None else fmt.format(value)


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"


def _duration(seconds: float | None) -> str:
    """A rank's compute time per step: milliseconds below a second, where steps usually are."""
    if seconds is None:
        return "-"
    return f"{seconds * 1000:.0f}ms" if seconds < 1 else f"{seconds:.2f}s"


def _bytes(n: int | None) -> str:
    if not n:
        return "0 B"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]  # int to float on purpose
    return f"{n} B"


def _clock(wall: float | None) -> str:
    return "-" if wall is None else datetime.fromtimestamp(wall).strftime("%H:%M:%S")


def _span(ranks: list[int]) -> str:
    if not ranks:
        return "-"
    ranks = sorted(ranks)
    return (
        f"{ranks[0]}-{ranks[-1]}"
        if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 1
        else ",".join(map(str, ranks))
    )


def _tier(info: dict[str, Any] | None) -> str:
    if not info:
        return "-"
    step = _num(info.get("step"))
    lag = info.get("lag_steps")
    shown = step if not lag else f"{step} (-{lag})"
    waited = info.get("waited_s") or 0.0
    shown = shown if waited < 0.1 else f"{shown}, waited {waited:.1f} s"  # training held for its replicas
    behind = info.get("behind") or []
    return shown if not behind else f"{shown}, {len(behind)} peer(s) behind"  # not waited for: lag grows


# -- the pieces, as rows ---------------------------------------------------------------------------------
def summary(doc: dict[str, Any]) -> str:
    job = doc["job"]
    spares = doc["spares"]
    return (
        f"job {doc['run_id']}: {job['state']}, round {_num(job['round'])}, {job['nodes']} node(s), "
        f"world size {job['world_size']}, step {_num(job['step'])}, restarts {job['restarts']}, "
        f"recoveries {job['recoveries']}, spares ready {spares['processes_ready']}"
        + (f" + {spares['nodes']} spare node(s)" if spares["nodes"] else "")
        + (f" ({spares['processes_exited']} spare(s) exited while waiting)" if spares.get("processes_exited") else "")
    )


# spares: hot spare processes ready / alive; memory, peer, persisted: newest step (-lag behind memory).
NODE_COLUMNS = ("node", "host", "state", "round", "heartbeat", "ranks", "spares", "memory", "peer", "persisted")


def _state(node: dict[str, Any]) -> str:
    """The node's state, and how old its document is when it is stale (a silent agent, or a replay)."""
    if node.get("status_stale"):
        return f"{node['state']} (status {node['status_age_s']:.0f} s old)"
    return str(node["state"])


def node_rows(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for node in doc["nodes"]:
        gone = node["state"] == "lost"  # its last document is history: show what it ran, not its tiers
        spares = {} if gone else node.get("spares") or {}
        tiers = {} if gone else node.get("tiers") or {}
        rows.append(
            (
                _num(node["node_rank"]),
                str(node.get("host") or "?"),
                _state(node),
                _num(node.get("round")),
                _age(node.get("heartbeat_age_s")),
                _span(node.get("ranks") or []),
                f"{spares.get('ready', 0)}/{spares.get('alive', 0)}" if spares else "-",
                _tier(tiers.get("memory")),
                _tier(tiers.get("peer")),
                _tier(tiers.get("persistent")),
            )
        )
    return rows


RANK_COLUMNS = ("rank", "node", "local", "pid", "state", "step", "steps/s", "compute", "heartbeat")


def rank_rows(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    return [
        (
            str(r["rank"]),
            _num(r.get("node_rank")),
            str(r.get("local_rank")),
            str(r.get("pid")),
            r["state"] if r.get("exit_code") in (None, 0) else f"{r['state']} ({r['exit_code']})",
            _num(r.get("step")),
            _num(r.get("steps_per_s"), "{:.2f}"),
            _duration(r.get("compute_s")),
            _age(r.get("heartbeat_age_s")),
        )
        for r in doc["ranks"]
    ]


def straggler_line(doc: dict[str, Any]) -> str:
    """The ranks the others wait for, with the evidence (status/stragglers.py says the rule)."""
    said = [
        f"rank {s['rank']} (node {_num(s.get('node_rank'))}, {s.get('host') or '?'}) computes "
        f"{s['ratio']:.1f}x the others' median ({_duration(s['compute_s'])} vs {_duration(s['others_median_s'])})"
        for s in doc["stragglers"]
    ]
    return "stragglers: " + "; ".join(said)


def snapshot_line(doc: dict[str, Any]) -> str:
    parts = [f"{tier} {_held(info)}" for tier, info in doc["snapshots"].items()]
    line = "snapshots (newest step every rank holds, steps a failure would redo): " + (
        ", ".join(parts) if parts else "none yet"
    )
    policy = doc.get("snapshot_policy")
    return line if not policy else f"{line}; {policy_text(policy)}"


def _held(info: dict[str, Any]) -> str:
    step = _num(info.get("step"))
    risk = info.get("at_risk_steps")
    return step if risk is None else f"{step} ({risk} at risk)"


def policy_text(policy: dict[str, Any]) -> str:
    """``every 1 step`` or ``auto: every 7 steps, 2.1% of step time (budget 3%)``, plus the tiers'."""
    interval = policy.get("interval")
    steps = "?" if interval is None else f"{interval} step{'s' if interval != 1 else ''}"
    if policy.get("every") == "auto":
        text = f"auto: every {steps}" if interval is not None else "auto: measuring"
        overhead = policy.get("overhead")
        budget = policy.get("max_overhead_pct")
        if overhead is not None:
            text += f", {overhead * 100:.1f}% of step time"
        if budget is not None:
            text += f" (budget {budget:g}%)"
    else:
        text = f"every {steps}"
    replicate = policy.get("replicate_every", 1)
    if replicate == "auto":
        spacing, steps_apart = policy.get("replicate_every_snapshots"), policy.get("replica_interval")
        if spacing == 1:
            text += ", replicas: each snapshot"
        elif spacing is not None:
            text += f", replicas: every {_ordinal(spacing)} snapshot (~{steps_apart} steps)"
        else:
            text += ", replicas: auto"
    elif replicate is None and policy.get("replicas") == 0:
        text += ", no replicas"
    elif replicate not in (1, None):
        text += f", replicas every {replicate}"
    return text


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


CAPTURED_COLUMNS = ("path", "size", "captured", "tiers")


def captured_nodes(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The nodes that capture a folder (``--capture-dir``); a lost node's last list is history."""
    return [n for n in doc["nodes"] if n.get("captured") and n["state"] != "lost"]


def captured_header(node: dict[str, Any]) -> str:
    """``node 0 (host0): /data/run (files matching *.pt), 3 file(s), 2.0 MiB in node memory``."""
    captured = node["captured"]
    pattern = captured.get("pattern")
    count = len(captured.get("files") or []) + int(captured.get("more_files") or 0)
    return (
        f"node {_num(node.get('node_rank'))} ({node.get('host') or '?'}): {captured.get('dir')}"
        + ("" if pattern in (None, "*") else f" (files matching {pattern})")
        + f", {count} file(s), {_bytes(captured.get('bytes_in_memory'))} in node memory"
    )


def captured_tiers(entry: dict[str, Any]) -> str:
    """Where one captured file is held now: ``memory, 1 peer, persisted``."""
    if not entry.get("own"):  # a peer's capture this node keeps a replica of: its node tells its tiers
        return "replica of a peer's file" + ("" if entry.get("memory") else " (bytes not kept: memory ran short)")
    # Too large for node memory: the agent reads it back from the script's folder to ship it.
    parts = ["memory" if entry.get("memory") else "folder only"]
    replicas = int(entry.get("replicas") or 0)
    parts.append(f"{replicas} peer{'' if replicas == 1 else 's'}")
    persisted = entry.get("persisted")
    if persisted is not None:  # None: no --checkpoint-uri
        parts.append("persisted" if persisted else "not persisted yet")
    return ", ".join(parts)


def captured_rows(node: dict[str, Any]) -> list[tuple[str, ...]]:
    return [
        (
            str(entry.get("path")),
            _bytes(entry.get("bytes")),
            _date(entry.get("captured_at")),
            captured_tiers(entry),
        )
        for entry in node["captured"].get("files") or []
    ]


def captured_more(node: dict[str, Any]) -> str | None:
    more = int(node["captured"].get("more_files") or 0)
    shown = len(node["captured"].get("files") or [])
    return f"... and {more} more (the newest {shown} are listed)" if more else None


def _date(wall: float | None) -> str:
    """A capture time with its date: a file found at start is dated by its mtime, maybe days ago."""
    return "-" if wall is None else datetime.fromtimestamp(wall).strftime("%Y-%m-%d %H:%M:%S")


HISTORY_COLUMNS = ("#", "time", "kind", "round", "what", "duration", "timeline")


def history_rows(doc: dict[str, Any]) -> list[tuple[str, ...]]:
    rows: list[tuple[str, ...]] = []
    for entry in doc["history"]:
        kind = entry.get("kind", "?")
        cause = entry.get("cause") or {}
        if kind == "node_lost":
            what = f"node {_num(entry.get('node_rank'))} ({entry.get('host')}) lost"
            when = entry.get("at")
        else:
            failed = entry.get("failed_ranks") or []
            what = f"rank {','.join(map(str, failed))} " if failed else ""
            what += "straggler swapped for a spare" if entry.get("straggler") else (cause.get("message") or "")[:60]
            when = entry.get("detected_at")
        duration = entry.get("duration_s")
        rows.append(
            (
                str(entry.get("index", "")),
                _clock(when),
                kind,
                _num(entry.get("round")),
                what.strip(),
                _num(duration, "{:.2f}s", "in progress" if kind in ("recovery", "restart") else "-"),
                timeline_text(entry) if "timeline" in entry else "",
            )
        )
    return rows


def timeline_text(entry: dict[str, Any]) -> str:
    line = entry["timeline"]
    steps = [("detected", line.get("detected"))]
    if line.get("replacement_chosen") is not None:
        decided = "spare chosen" if entry.get("kind") == "recovery" else "restart decided"
        steps.append((decided, line["replacement_chosen"]))
    steps.append(("collectives", line.get("collectives_rebuilt")))
    state = line.get("state_transferred")
    if state is not None:
        tiers = "+".join(line.get("state_tiers") or []) or "?"
        steps.append((f"state {_bytes(line.get('state_bytes'))} from {tiers}", state))
    steps.append(("first step", line.get("first_step_done")))
    text = " > ".join(f"{name} {_num(t, '{:.2f}s')}" for name, t in steps if t is not None)
    redone = entry.get("steps_redone")
    return text + ("" if redone is None else f"; steps redone {redone}")


# -- plain text -----------------------------------------------------------------------------------------
def _table(columns: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*columns).rstrip(), *(fmt.format(*row).rstrip() for row in rows)]


def store_line(doc: dict[str, Any]) -> str:
    """Whether the documents shown were verified with the job secret, and which were refused."""
    store = doc.get("store") or {}
    if not store.get("verified"):
        return "store documents: not verified (give the job's --job-secret-file to verify them)"
    refused = store.get("refused") or []
    replayed = store.get("replayed") or []
    if not refused and not replayed:
        return "store documents: verified with the job secret"
    said = []
    if refused:
        said.append(f"{len(refused)} refused (no valid MAC: forged): {', '.join(refused[:3])}")
    if replayed:
        said.append(f"{len(replayed)} refused (older than one read before: replayed): {', '.join(replayed[:3])}")
    return "store documents: verified; " + "; ".join(said)


def text_lines(doc: dict[str, Any]) -> list[str]:
    """The document as plain lines (no colour, no box drawing): for pipes, files and logs."""
    lines = [summary(doc), f"endpoint {doc['endpoint']} ({doc['backend']})", store_line(doc), "", "NODES"]
    lines += _table(NODE_COLUMNS, node_rows(doc))
    lines += ["", "RANKS"] + (_table(RANK_COLUMNS, rank_rows(doc)) if doc["ranks"] else ["(no ranks running)"])
    lines += [straggler_line(doc)] if doc.get("stragglers") else []
    lines += ["", snapshot_line(doc)]
    capturing = captured_nodes(doc)
    if capturing:
        lines += ["", "CAPTURED CHECKPOINTS"]
    for node in capturing:
        lines.append(captured_header(node))
        rows = captured_rows(node)
        lines += ["  " + line for line in _table(CAPTURED_COLUMNS, rows)] if rows else ["  (no complete file yet)"]
        more = captured_more(node)
        lines += [f"  {more}"] if more else []
    lines += ["", "HISTORY"]
    lines += _table(HISTORY_COLUMNS, history_rows(doc)) if doc["history"] else ["(no failures)"]
    return lines


# -- rich -----------------------------------------------------------------------------------------------
def rich_view(doc: dict[str, Any]) -> Any:
    """The document as rich tables with health colours (only ever called on a terminal)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def table(title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]], state_col: int | None) -> Table:
        t = Table(title=title, title_justify="left", expand=False, show_edge=False, pad_edge=False)
        for column in columns:
            t.add_column(column, overflow="fold")
        for row in rows:
            cells: list[Any] = list(row)
            if state_col is not None:
                cells[state_col] = Text(row[state_col], style=colour(row[state_col].split(" ")[0]))
            t.add_row(*cells)
        return t

    head = Text(summary(doc), style=f"bold {colour(doc['job']['state'])}")
    parts: list[Any] = [head, Text(f"endpoint {doc['endpoint']} ({doc['backend']})", style="dim")]
    refused = (doc.get("store") or {}).get("refused")
    parts.append(Text(store_line(doc), style="bold red" if refused else "dim"))
    parts.append(table("Nodes", NODE_COLUMNS, node_rows(doc), 2))
    parts.append(table("Ranks", RANK_COLUMNS, rank_rows(doc), 4))
    if doc.get("stragglers"):
        parts.append(Text(straggler_line(doc), style="bold yellow"))
    parts.append(Text(snapshot_line(doc)))
    for node in captured_nodes(doc):
        title = f"Captured checkpoints, {captured_header(node)}"
        rows = captured_rows(node)
        if rows:
            parts.append(table(title, CAPTURED_COLUMNS, rows, None))
        else:
            parts.append(Text(f"{title}: no complete file yet"))
        more = captured_more(node)
        if more:
            parts.append(Text(more, style="dim"))
    if doc["history"]:
        parts.append(table("History", HISTORY_COLUMNS, history_rows(doc), None))
    else:
        parts.append(Text("History: no failures", style="green"))
    return Group(*parts)
