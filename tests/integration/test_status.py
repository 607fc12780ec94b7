"""``resilrun status``, events.jsonl and metrics against real agents and workers on loopback."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from resilrun.agent.observability.events import read_events
from tests.conftest import free_port
from tests.integration.conftest import ROOT, run_resilrun, wait_for
from tests.integration.test_tier1_restore import EXAMPLE
from tests.unit.test_status_view import assert_matches_documented

pytestmark = pytest.mark.integration


def status(port: int, run_id: str = "") -> dict[str, Any] | None:
    """``resilrun status --json`` as a user runs it (a separate process); None while not answerable."""
    args = ["status", "--rdzv-endpoint", f"127.0.0.1:{port}", "--json", *(["--rdzv-id", run_id] if run_id else [])]
    out = run_resilrun(*args)
    document = json.loads(out.stdout) if out.stdout.strip() else {}
    return document.get("data")


def poll(port: int, predicate: Any, timeout: float, what: str, nodes: Any = ()) -> dict[str, Any]:
    """The first status document for which ``predicate`` holds (on timeout: the agents' stderr)."""
    found: list[dict[str, Any]] = []
    seen: list[dict[str, Any] | None] = [None]

    def check() -> bool:
        doc = status(port)
        seen[0] = doc if doc is not None else seen[0]
        if doc is not None and predicate(doc):
            found.append(doc)
            return True
        return False

    try:
        wait_for(check, timeout, what)
    except TimeoutError as exc:
        logs = "\n".join(f"--- agent {n.pid}\n{n.stderr()[-2500:]}" for n in nodes)
        raise TimeoutError(f"{exc}\nlast status: {json.dumps(seen[0])[:3000]}\n{logs}") from None
    return found[0]


def children(pid: int) -> set[int]:
    return {p.pid for p in psutil.Process(pid).children()}


def scrape(url: str) -> dict[str, list[Any]]:
    with urllib.request.urlopen(url, timeout=10) as response:  # noqa: S310 - a loopback URL the agent printed
        text = response.read().decode()
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


@pytest.mark.timeout(400)
def test_status_shows_the_running_job_and_a_killed_workers_recovery_with_its_timeline(launcher, tmp_path: Path) -> None:
    # Given 2 agents x 2 workers with a hot spare each, metrics on, events under --log-dir
    port = free_port()
    logs = tmp_path / "logs"
    flags = [
        "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "st1",
        "--spares", "1", "--metrics-port", "0", "--log-dir", str(logs),
        str(EXAMPLE), "--steps", "120", "--hidden", "64", "--sleep", "0.25",
    ]  # fmt: skip
    nodes = [launcher("resilrun", *flags) for _ in range(2)]
    # When every rank is training and both spares are warm
    doc = poll(port, lambda d: len(d["ranks"]) == 4 and all(r["step"] is not None for r in d["ranks"])
               and d["spares"]["processes_ready"] == 2, 200, "4 ranks stepping and 2 ready spares", nodes)  # fmt: skip
    # Then status --json matches what runs: the agents, their workers' pids and their spares
    assert_matches_documented(doc)
    assert doc["run_id"] == "st1" and doc["job"]["state"] == "running" and doc["job"]["world_size"] == 4
    agents = {n.pid for n in nodes}
    assert {n["agent_pid"] for n in doc["nodes"]} == agents
    assert sorted(n["node_rank"] for n in doc["nodes"]) == [0, 1]
    for node in doc["nodes"]:
        kids = children(node["agent_pid"])
        ranks = [r for r in doc["ranks"] if r["node_rank"] == node["node_rank"]]
        assert {r["pid"] for r in ranks} <= kids and len(ranks) == 2
        assert set(node["spares"]["pids"]) <= kids and len(node["spares"]["pids"]) == 1
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3] and doc["history"] == []
    # and each rank's compute time per step (measured from the second step on), without the
    # script's 0.25 s sleep after its step, which its step time includes
    timed = poll(port, lambda d: all(r.get("compute_s") for r in d["ranks"]), 60, "compute times", nodes)
    assert all(0 < r["compute_s"] < r["step_time_s"] for r in timed["ranks"]), timed["ranks"]
    # and each agent serves its own node's metrics
    events = logs / "st1" / "events.jsonl"
    urls = [e["metrics"] for e in read_events(events) if e["event"] == "agent_started"]
    assert len(urls) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls)
    metrics = scrape(urls[0])
    assert {s.labels["rank"] for s in metrics["resilrun_rank_step"]} in ({"0", "1"}, {"2", "3"})
    assert {s.labels["rank"] for s in metrics["resilrun_rank_compute_seconds"]} in ({"0", "1"}, {"2", "3"})
    memory = [s for s in metrics["resilrun_snapshot_bytes"] if s.labels.get("tier") == "memory"]
    assert memory and memory[0].value > 0

    # When rank 1 is SIGKILLed
    victim = next(r for r in doc["ranks"] if r["rank"] == 1)
    killed_at = time.time()  # before the kill: the agent may stamp its detection before we read the clock again
    os.kill(victim["pid"], signal.SIGKILL)
    # Then the failure and its in-process recovery appear in the history, with a duration and timeline
    doc = poll(port, lambda d: any(h["kind"] == "recovery" and h["complete"] for h in d["history"]), 120,
               "the recovery to complete in status", nodes)  # fmt: skip
    (entry,) = [h for h in doc["history"] if h["kind"] == "recovery"]
    assert entry["failed_ranks"] == [1] and entry["cause"]["exit_code"] == -9
    assert entry["replacements"][0]["failed_pid"] == victim["pid"]
    line = entry["timeline"]
    assert 0 <= entry["detected_at"] - killed_at < 5
    assert 0 <= line["replacement_chosen"] <= line["collectives_rebuilt"] <= line["first_step_done"]
    assert line["state_transferred"] <= line["first_step_done"] == entry["duration_s"] < 60
    assert line["state_bytes"] > 0 and line["state_tiers"] == ["memory"]
    # (a survivor may have committed the step the killed rank had in flight: at most that one is redone)
    assert entry["steps_redone"] in (0, 1)
    rank1 = next(r for r in doc["ranks"] if r["rank"] == 1)
    assert rank1["pid"] == entry["replacements"][0]["spare_pid"] != victim["pid"]
    assert entry["replacements"][0]["warm"] is True  # the hot spare, started with the round
    assert doc["job"]["recoveries"] == 1
    assert_matches_documented(doc)

    # And the job finishes; every agent's events tell the story
    for node in nodes:
        assert node.wait(200) == 0, node.stderr()[-3000:]
    records = read_events(events)
    kinds = [e["event"] for e in records]
    for kind in ("failure_detected", "spare_promoted", "generation_entered", "state_transferred", "recovered"):
        assert kind in kinds, kind
    assert kinds.count("agent_started") == 2 and kinds.count("exit") == 2
    assert all(e["outcome"] == "succeeded" for e in records if e["event"] == "exit")
    assert kinds.count("state_transferred") == 4 and kinds.count("recovered") == 2
    failure = next(e for e in records if e["event"] == "failure_detected")
    assert failure["rank"] == 1 and failure["signal"] == "SIGKILL" and failure["pid"] == victim["pid"]
    assert all({"time", "wall", "mono", "node_id", "host"} <= set(e) for e in records)


@pytest.mark.timeout(400)
def test_a_killed_agent_is_marked_lost_and_a_spare_node_takes_its_place(launcher, tmp_path: Path) -> None:
    # Given 2 active agents x 2 workers and a third agent standing by as a spare node
    port = free_port()
    flags = [
        "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "st2",
        "--replicas", "1", "--heartbeat-timeout", "3", "--max-restarts", "0", "--log-dir", str(tmp_path / "logs"),
        str(EXAMPLE), "--steps", "1000", "--hidden", "64", "--sleep", "0.2",
    ]  # fmt: skip
    # (long enough that the job is still running whenever status is read on a loaded machine)
    nodes = [launcher("resilrun", *flags) for _ in range(3)]
    doc = poll(port, lambda d: len(d["ranks"]) == 4 and all((r["step"] or 0) >= 3 for r in d["ranks"])
               and any(n["state"] == "spare" for n in d["nodes"]), 200, "2 nodes and a spare", nodes)  # fmt: skip
    assert doc["spares"]["nodes"] == 1
    spare = next(n for n in doc["nodes"] if n["state"] == "spare")
    assert spare["node_rank"] is None and len(spare["spares"]["pids"]) == 2  # its warm workers
    # When the active node that does not host the store loses its agent (SIGKILL: node loss)
    hosting = {n.pid for n in nodes if "hosting store" in n.stderr()}
    doomed = next(n for n in doc["nodes"] if n["state"] == "active" and n["agent_pid"] not in hosting)
    os.kill(doomed["agent_pid"], signal.SIGKILL)
    killed = time.monotonic()
    # Then status marks that node lost (heartbeat timeout 3 s)
    doc = poll(port, lambda d: any(n["node_id"] == doomed["node_id"] and n["state"] == "lost" for n in d["nodes"]),
               60, "the node to be marked lost", nodes)  # fmt: skip
    detected = time.monotonic() - killed
    lost = next(n for n in doc["nodes"] if n["node_id"] == doomed["node_id"])
    assert lost["node_rank"] == doomed["node_rank"] and lost["lost"]["round"] >= 0
    assert detected < 30, detected
    assert any(h["kind"] == "node_lost" and h["node_id"] == doomed["node_id"] for h in doc["history"])
    # and the spare node takes its node rank in-process: the history shows that recovery
    doc = poll(port, lambda d: any(h["kind"] == "recovery" and h["complete"] for h in d["history"]), 120,
               "the spare node's takeover to complete", nodes)  # fmt: skip
    entry = next(h for h in doc["history"] if h["kind"] == "recovery")
    assert entry["replacements"][0]["spare_node_id"] == spare["node_id"]
    assert entry["replacements"][0]["node_rank"] == doomed["node_rank"]
    assert "peer" in entry["timeline"]["state_tiers"] and entry["duration_s"] is not None
    taken = next(n for n in doc["nodes"] if n["node_id"] == spare["node_id"])
    assert taken["state"] == "active" and taken["node_rank"] == doomed["node_rank"]
    assert sorted(r["rank"] for r in doc["ranks"]) == [0, 1, 2, 3]
    assert all(r["state"] == "running" for r in doc["ranks"])  # the job goes on (the launcher fixture ends it)


@pytest.mark.timeout(120)  # about 20 s alone on 2 cores
def test_a_restart_is_recorded_with_its_timeline(launcher, tmp_path: Path) -> None:
    # Given one node, 2 workers, no spare, one restart allowed; rank 1 is SIGKILLed at step 8, and
    # again in the new process that took its place in-process: no progress, so the job restarts
    logs = tmp_path / "logs"
    run = launcher(
        "resilrun", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--log-dir", str(logs),
        str(EXAMPLE), "--steps", "150", "--hidden", "64", "--sleep", "0.2",
        env={"RESILRUN_FAULTS": "kill:rank=1,step=8; kill:rank=1,step=8,attempt=1"},
    )  # fmt: skip
    wait_for(lambda: any(logs.glob("*/events.jsonl")), 120, "the events file")
    events = next(logs.glob("*/events.jsonl"))
    wait_for(lambda: any(e["event"] == "agent_started" for e in read_events(events)), 60, "the agent to start")
    endpoint = next(e["endpoint"] for e in read_events(events) if e["event"] == "agent_started")
    port = int(endpoint.rsplit(":", 1)[1])
    # Then status shows the torchrun-style restart with its timeline, and the job resumed from memory
    doc = poll(port, lambda d: any(h["kind"] == "restart" and h["complete"] for h in d["history"]), 90,
               "the restart to complete in status")  # fmt: skip
    recovery, entry = doc["history"]
    assert recovery["kind"] == "recovery" and recovery["round"] == 1 and recovery["failed_ranks"] == [1]
    assert recovery["replacements"][0]["warm"] is False  # no spare: a new process was started for rank 1
    assert entry["round"] == 2 and entry["restarts"] == 1 and entry["failed_ranks"] == [1]
    assert entry["timeline"]["state_tiers"] == ["memory"] and entry["steps_redone"] == 0
    assert 0 < entry["timeline"]["replacement_chosen"] <= entry["duration_s"]
    assert doc["job"]["restarts"] == 1 and doc["job"]["state"] == "running"
    kinds = [e["event"] for e in read_events(events)]
    assert "restart" in kinds and "recovered" in kinds
    assert run.popen.poll() is None  # ~140 steps of 0.2 s are left: the job trains on after its restart


@pytest.mark.timeout(300)
def test_with_snapshot_every_auto_status_and_metrics_show_the_interval_and_the_steps_at_risk(
    launcher, tmp_path: Path
) -> None:
    # Given a job whose snapshots auto spaces out (large state next to its step time)
    port = free_port()
    logs = tmp_path / "logs"
    flags = [
        "--nnodes", "1", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "st-auto", "--nproc-per-node", "2",
        "--snapshot-every", "auto", "--max-overhead", "1", "--metrics-port", "0", "--log-dir", str(logs),
        str(EXAMPLE), "--steps", "400", "--hidden", "64", "--state-mib", "16", "--sleep", "0.05",
    ]  # fmt: skip
    node = launcher("resilrun", *flags)
    # When the ranks agreed an interval and trained past the next snapshot
    doc = poll(
        port,
        lambda d: (
            (d.get("snapshot_policy") or {}).get("interval") is not None
            and (d["job"]["newest_step"] or 0) > d["snapshot_policy"]["decided_at_step"] + 5
        ),
        200,
        "an agreed interval",
        [node],
    )
    # Then status says how often, at what measured cost, and how many steps a failure would redo now
    assert_matches_documented(doc)
    policy = doc["snapshot_policy"]
    assert policy["every"] == "auto" and policy["max_overhead_pct"] == 1.0 and policy["interval"] > 1, policy
    assert 0 < policy["overhead"] <= 0.01 and policy["step_time_s"] >= 0.05, policy
    memory = doc["snapshots"]["memory"]
    assert 0 <= memory["at_risk_steps"] <= policy["interval"] + 1, (memory, policy)  # +1: a step finishing
    # and the node's metrics carry the same numbers
    events = logs / "st-auto" / "events.jsonl"
    (url,) = [e["metrics"] for e in read_events(events) if e["event"] == "agent_started"]
    metrics = scrape(url)
    (interval,) = metrics["resilrun_snapshot_interval_steps"]
    assert interval.value >= 1
    (risk,) = [s for s in metrics["resilrun_snapshot_at_risk_steps"] if s.labels["tier"] == "memory"]
    assert 0 <= risk.value <= interval.value + 2
    (overhead,) = metrics["resilrun_snapshot_overhead_ratio"]
    assert 0 < overhead.value <= 0.01
    # and the text view says it in words
    text = run_resilrun("status", "--rdzv-endpoint", f"127.0.0.1:{port}").stdout
    assert "at risk" in text and "auto: every" in text and "budget 1%" in text, text
    os.kill(node.pid, signal.SIGTERM)
    node.wait(60)


@pytest.mark.timeout(300)
def test_a_rank_slowed_down_is_named_a_straggler_and_the_others_are_not(launcher) -> None:  # noqa: ANN001
    # Given three workers of a DDP script, rank 2's forward passes 40 ms slower (a throttled device)
    port = free_port()
    flags = [
        "--nnodes", "1", "--nproc-per-node", "3", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "slow",
        str(ROOT / "tests" / "helpers" / "slow_rank.py"), str(EXAMPLE), "--steps", "400", "--hidden", "64",
        "--sleep", "0.05",
    ]  # fmt: skip
    node = launcher("resilrun", *flags, env={"SLOW_RANK": "2", "SLOW_S": "0.02"})
    # When every rank has been timed for a few steps
    doc = poll(port, lambda d: d["ranks"] and all((r["step"] or 0) >= 10 for r in d["ranks"]), 200, "steps", [node])
    # Then status names rank 2, with its compute time against the others' median, and no other rank
    assert [s["rank"] for s in doc["stragglers"]] == [2], doc["ranks"]
    straggler = doc["stragglers"][0]
    assert straggler["ratio"] >= 1.5 and straggler["compute_s"] >= 0.04 > straggler["others_median_s"]
    assert straggler["node_rank"] == 0
    text = run_resilrun("status", "--rdzv-endpoint", f"127.0.0.1:{port}", env={"NO_COLOR": "1"}).stdout
    assert "stragglers: rank 2 (node 0, " in text, text
