"""The job status document: store records in, one stable document out (no store server, no sleeps)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from resilrun import keys
from resilrun.agent.observability.metrics import StatusCollector
from resilrun.cli._status_render import (
    NODE_COLUMNS,
    RANK_COLUMNS,
    history_rows,
    node_rows,
    rank_rows,
    store_line,
    text_lines,
)
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.rendezvous.protocol import NodeInfo, RdzvState
from resilrun.status import records
from resilrun.status.view import DocumentVersions, compose, read_raw, timeline

ROOT = Path(__file__).resolve().parents[2]
RUN = "job1"


def node_doc(node_id: str, node_rank: int, ranks: list[int], *, round: int = 1, step: int = 20) -> dict[str, Any]:
    """A node document shaped as resilrun.agent.status.StatusPublisher.build writes it."""
    return {
        "schema": 1,
        "node_id": node_id,
        "host": f"host{node_rank}",
        "agent_pid": 100 + node_rank,
        "addr": "127.0.0.1",
        "state": "active",
        "node_rank": node_rank,
        "round": round,
        "seq": 7,
        "uptime_s": 12.5,
        "heartbeat_interval_s": 1.0,
        "ranks": [
            {
                "rank": r,
                "local_rank": i,
                "pid": 1000 + r,
                "state": "running",
                "exit_code": None,
                "step": step,
                "step_time_s": 0.25,
                "steps_per_s": 4.0,
                "compute_s": 0.2,
                "heartbeat_age_s": 0.2,
                "since_commit_s": 0.1,
            }
            for i, r in enumerate(ranks)
        ],
        "spares": {"configured": 1, "alive": 1, "ready": 1, "pids": [2000 + node_rank]},
        "tiers": {
            "memory": {"step": step, "bytes": 1024, "at_risk_steps": 0},
            "peer": {"step": step - 1, "lag_steps": 1, "at_risk_steps": 1, "waited_s": 0.5, "behind": []},
            "persistent": {
                "step": 19,
                "lag_steps": 1,
                "at_risk_steps": 1,
                "complete_step": 19 if node_rank == 0 else 9,
            },
        },
        "snapshots": {
            "every": "auto",
            "interval": 4,
            "max_overhead_pct": 3.0,
            "overhead": 0.021,
            "step_time_s": 0.25,
            "decided_at_step": 15 if node_rank == 0 else None,
            "replicate_every": 1,
            "persist_every": 10,
        },
        "peer_ages": {},
        "counts": {"failures": 0, "recoveries": 1, "restarts": 0, "nodes_lost": 0},
    }


def job(backend: MemoryBackend, *, lost_round: int | None = None, run_id: str = RUN) -> None:
    """Two nodes x two ranks in generation 1 after an in-process recovery of rank 1."""
    nodes = (NodeInfo("a", "127.0.0.1", 2), NodeInfo("b", "127.0.0.1", 2))
    state = RdzvState(round=1, complete=True, participants=nodes, recovering=True, recoveries=1)
    backend.set(keys.rdzv_state(run_id), state.to_bytes())
    for rank, node_id in enumerate(("a", "b")):
        records.register_node(backend, run_id, node_id)
        doc = node_doc(node_id, rank, [2 * rank, 2 * rank + 1])
        doc["peer_ages"] = {"b" if node_id == "a" else "a": 0.4 + rank}
        records.publish_node(backend, run_id, node_id, doc)
    assert records.claim(backend, run_id, "round-1", "a")
    records.append(backend, run_id, {**recovery_record(), "recorded_by": "a"})
    for node_rank in (0, 1):
        records.write_part(backend, run_id, 1, node_rank, part(node_rank))
    if lost_round is not None:
        marker = {"round": lost_round, "node_rank": 1, "host": "host1", "judged_by": "a", "at": 1005.0, "message": "x"}
        records.mark_lost(backend, run_id, "b", marker)
        records.append(backend, run_id, {"kind": "node_lost", "node_id": "b", **marker, "recorded_by": "a"})


def recovery_record() -> dict[str, Any]:
    return {
        "kind": "recovery",
        "round": 1,
        "recoveries": 1,
        "nodes": 2,
        "detected_at": 1000.0,
        "decided_at": 1000.05,
        "decided_s": 0.05,
        "failed_ranks": [1],
        "replacements": [{"rank": 1, "failed_pid": 1001, "spare_pid": 2000}],
        "rerun": False,
        "straggler": False,
        "cause": {"rank": 1, "node_rank": 0, "host": "host0", "exit_code": -9, "failed_at": 1000.0, "message": "m"},
    }


def part(node_rank: int, *, complete: bool = True) -> dict[str, Any]:
    ranks = {}
    for r in (2 * node_rank, 2 * node_rank + 1):
        info: dict[str, Any] = {"replacement": r == 1, "pid": 1000 + r, "collectives_at": 1000.2 + r / 100}
        info.update(restored_step=14, tier="memory", bytes=100, transfer_s=0.01, restored_at=1000.3 + r / 100)
        if complete:
            info.update(first_step=15, first_step_at=1000.6 + r / 100)
        ranks[str(r)] = info
    return {"round": 1, "node_rank": node_rank, "kind": "recovery", "entered_at": 1000.1,
            "newest_step_before": 14, "steps_redone": 0, "complete": complete, "ranks": ranks}  # fmt: skip


def status(backend: MemoryBackend) -> dict[str, Any]:
    return compose(read_raw(backend, RUN), endpoint="127.0.0.1:29400", backend="c10d")


# -- composition ----------------------------------------------------------------------------------------
def test_a_running_job_lists_its_nodes_ranks_spares_and_snapshot_progress() -> None:
    backend = MemoryBackend()
    job(backend)
    doc = status(backend)
    assert doc["job"]["state"] == "running" and doc["job"]["world_size"] == 4 and doc["job"]["step"] == 20
    assert [n["node_rank"] for n in doc["nodes"]] == [0, 1]
    assert [r["rank"] for r in doc["ranks"]] == [0, 1, 2, 3]
    assert [r["node_rank"] for r in doc["ranks"]] == [0, 0, 1, 1]
    assert doc["spares"] == {"processes_ready": 2, "processes_alive": 2, "nodes": 0, "processes_exited": 0}
    # each node's heartbeat age is what the other agent observed for it
    assert [n["heartbeat_age_s"] for n in doc["nodes"]] == [1.4, 0.4]
    # every rank holds 20 in memory, 19 at the peers; 19 is complete in storage (node 0 wrote it)
    assert doc["snapshots"] == {
        "memory": {"step": 20, "lag_steps": 0, "at_risk_steps": 0},
        "peer": {"step": 19, "lag_steps": 1, "at_risk_steps": 1},
        "persistent": {"step": 19, "lag_steps": 1, "at_risk_steps": 1},
    }
    # the interval every rank agreed, as the node that heard the newest decision (rank 0's) tells it
    assert doc["snapshot_policy"]["interval"] == 4 and doc["snapshot_policy"]["decided_at_step"] == 15


def test_a_node_marked_lost_in_its_round_is_lost_and_its_ranks_are_not_listed() -> None:
    backend = MemoryBackend()
    job(backend, lost_round=1)
    doc = status(backend)
    lost = [n for n in doc["nodes"] if n["state"] == "lost"]
    assert [n["node_id"] for n in lost] == ["b"] and lost[0]["node_rank"] == 1
    assert doc["nodes"][-1]["node_id"] == "b"  # lost nodes last
    assert [r["rank"] for r in doc["ranks"]] == [0, 1]
    assert doc["job"]["state"] == "degraded"
    assert doc["history"][-1]["kind"] == "node_lost"


def test_a_lost_marker_older_than_the_nodes_own_round_does_not_make_it_lost() -> None:
    # Given a node judged lost in round 0 that came back and published round 1
    backend = MemoryBackend()
    job(backend, lost_round=0)
    assert [n["state"] for n in status(backend)["nodes"]] == ["active", "active"]


def test_the_recovery_timeline_is_in_seconds_after_detection_with_duration_and_steps_redone() -> None:
    backend = MemoryBackend()
    job(backend)
    entry = status(backend)["history"][0]
    assert entry["kind"] == "recovery" and entry["complete"] is True
    assert entry["timeline"] == {
        "detected": 0.0,
        "replacement_chosen": 0.05,
        "collectives_rebuilt": 0.23,
        "state_transferred": 0.33,
        "state_bytes": 400,
        "state_tiers": ["memory"],
        "transfer_s": 0.01,
        "first_step_done": 0.63,
    }
    assert entry["duration_s"] == 0.63 and entry["steps_redone"] == 0


def test_a_swapped_straggler_is_told_apart_from_a_failure_in_the_history() -> None:
    failure = {**recovery_record(), "index": 1}
    swap = {**recovery_record(), "index": 2, "straggler": True, "cause": None}
    rows = history_rows({"history": [failure, swap]})
    assert [row[4] for row in rows] == ["rank 1 m", "rank 1 straggler swapped for a spare"]


def test_a_recovery_still_in_progress_has_no_duration_and_no_first_step() -> None:
    parts = [part(0), part(1, complete=False)]
    line, duration, redone, complete = timeline(recovery_record(), parts)
    assert (duration, complete, redone) == (None, False, 0)
    assert line["first_step_done"] is None and line["state_transferred"] == 0.33


def test_a_closed_job_shows_its_outcome() -> None:
    backend = MemoryBackend()
    job(backend)
    closed = RdzvState(round=1, complete=True, closed=True, outcome="succeeded")
    backend.set(keys.rdzv_state(RUN), closed.to_bytes())
    assert status(backend)["job"]["state"] == "succeeded"


# -- store records -------------------------------------------------------------------------------------
def test_the_history_ring_keeps_the_newest_64_records_in_order() -> None:
    backend = MemoryBackend()
    for i in range(70):
        records.append(backend, RUN, {"kind": "restart", "round": i})
    got = records.read_history(backend, RUN)
    assert [r["round"] for r in got] == list(range(6, 70))
    assert [r["round"] for r in records.read_history(backend, RUN, 3)] == [67, 68, 69]


def test_a_slot_overwritten_by_a_newer_record_is_skipped_not_misattributed() -> None:
    backend = MemoryBackend()
    for i in range(3):
        records.append(backend, RUN, {"round": i})
    backend.set(keys.history_slot(RUN, 2), json.dumps({"round": 66, "index": 66}).encode())
    assert [r["round"] for r in records.read_history(backend, RUN)] == [0, 2]


def test_a_job_wide_record_is_claimed_by_exactly_one_agent() -> None:
    backend = MemoryBackend()
    assert records.claim(backend, RUN, "round-3", "a")
    assert not records.claim(backend, RUN, "round-3", "b")
    assert records.claim(backend, RUN, "round-3", "a")  # idempotent for the owner


def test_nodes_are_listed_once_in_registration_order_and_the_run_is_the_newest() -> None:
    backend = MemoryBackend()
    for node in ("x", "y", "x"):
        records.register_node(backend, RUN, node)
    assert records.node_ids(backend, RUN) == ["x", "y"]
    assert records.latest_run(backend) == RUN


# -- the documented schema ---------------------------------------------------------------------------
def documented_example() -> dict[str, Any]:
    text = (ROOT / "docs" / "status.md").read_text()
    section = text[text.index("## `resilrun status --json`") :]
    block = re.search(r"```json\n(.*?)```", section, re.S)
    assert block is not None
    return json.loads(block.group(1))


def shape(value: Any) -> Any:
    """The keys of a document, recursively (lists by their first element; values by JSON kind)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value and isinstance(value[0], dict) else "list"
    return "value"


def _without_tiers(value: Any) -> Any:
    """A node's shape less its optional parts (tiers, captured), which are checked on their own."""
    if not isinstance(value, list):
        return value
    return [{k: v for k, v in value[0].items() if k not in ("tiers", "captured")}]


# The fields of each ``peer.behind`` entry, as docs/status.md says them (its example is a healthy node's).
_BEHIND = {"peer", "reason"}


def _assert_tiers(got: dict[str, Any], documented: dict[str, Any], where: str) -> None:
    """Tiers are optional (peer: with --replicas and 2+ nodes; persistent: with --checkpoint-uri)."""
    assert "memory" in got or not got, where
    for tier, info in got.items():
        if tier == "peer" and info.get("behind"):
            assert all(set(entry) == _BEHIND for entry in info["behind"]), (where, info["behind"])
            info = {**info, "behind": []}
        assert shape(info) == shape(documented[tier]), (where, tier)


def assert_matches_documented(doc: dict[str, Any]) -> None:
    """Every documented field exists with the documented nesting (the history by record kind)."""
    example = documented_example()
    for key in ("job", "ranks", "spares"):
        assert shape(doc[key]) == shape(example[key]), key
    assert _without_tiers(shape(doc["nodes"])) == _without_tiers(shape(example["nodes"]))
    for node in doc["nodes"]:
        _assert_tiers(node["tiers"], example["nodes"][0]["tiers"], "nodes[].tiers")
        # null unless the node runs with --capture-dir
        assert "captured" in node, "nodes[].captured"
        if node["captured"] is not None:
            assert shape(node["captured"]) == shape(example["nodes"][0]["captured"]), "nodes[].captured"
    _assert_tiers(doc["snapshots"], example["snapshots"], "snapshots")
    assert set(doc) == set(example)
    documented = {e["kind"]: shape(e) for e in example["history"]}
    for entry in doc["history"]:
        want = documented[entry["kind"]]
        got = shape(entry)
        assert set(want) <= set(got), (entry["kind"], set(want) - set(got))


def test_the_document_has_exactly_the_shape_docs_status_md_documents() -> None:
    backend = MemoryBackend()
    job(backend, lost_round=0)
    doc = status(backend)
    # Every tier is reported here, so each one's shape is checked (assert_matches_documented also
    # accepts none: the integration tests read nodes before their first snapshot, or without peers)
    every = {"memory", "peer", "persistent"}
    assert [set(node["tiers"]) for node in doc["nodes"]] == [every, every] and set(doc["snapshots"]) == every
    assert_matches_documented(doc)


def test_a_node_capturing_a_folder_has_the_documented_captured_section() -> None:
    backend = MemoryBackend()
    job(backend)
    doc = node_doc("a", 0, [0, 1])
    doc["captured"] = documented_example()["nodes"][0]["captured"]
    records.publish_node(backend, RUN, "a", doc)
    composed = status(backend)
    assert_matches_documented(composed)
    assert [n["captured"] is not None for n in composed["nodes"]] == [True, False]


# -- replayed documents ---------------------------------------------------------------------------------
def _versioned(doc: dict[str, Any], incarnation: str, seq: int, written_at: float) -> dict[str, Any]:
    return {**doc, "incarnation": incarnation, "seq": seq, "written_at": written_at}


def test_a_reader_that_reads_again_refuses_an_older_document_of_a_node_and_keeps_the_newest() -> None:
    """An old document keeps its valid MAC: a --watch reader tells it by the agent's numbering."""
    backend = MemoryBackend()
    job(backend)
    versions = DocumentVersions()
    old = _versioned(node_doc("a", 0, [0, 1], step=5), "00000000000000000100-aa", 3, 1000.0)
    new = _versioned(node_doc("a", 0, [0, 1], step=20), "00000000000000000100-aa", 9, 1010.0)
    records.publish_node(backend, RUN, "a", new)
    assert versions.admit(read_raw(backend, RUN)) == []
    records.publish_node(backend, RUN, "a", old)  # written back by a party that recorded it
    raw = read_raw(backend, RUN)
    assert versions.admit(raw) == [keys.node_status(RUN, "a")]
    doc = compose(raw, store={"verified": True, "refused": [], "replayed": [keys.node_status(RUN, "a")]})
    assert {r["step"] for r in doc["ranks"] if r["rank"] in (0, 1)} == {20}
    assert "1 refused (older than one read before: replayed)" in store_line(doc)
    # a document of the agent that ran on this node before sorts first too; a newer one is taken
    earlier = _versioned(node_doc("a", 0, [0, 1], step=30), "00000000000000000099-ff", 50, 1011.0)
    records.publish_node(backend, RUN, "a", earlier)
    assert versions.admit(read_raw(backend, RUN)) == [keys.node_status(RUN, "a")]
    later = _versioned(node_doc("a", 0, [0, 1], step=31), "00000000000000000100-aa", 10, 1012.0)
    records.publish_node(backend, RUN, "a", later)
    raw = read_raw(backend, RUN)
    assert versions.admit(raw) == [] and raw["nodes"][0]["doc"]["ranks"][0]["step"] == 31


def test_a_live_nodes_old_document_is_shown_stale_with_its_age() -> None:
    backend = MemoryBackend()
    job(backend)
    records.publish_node(backend, RUN, "a", _versioned(node_doc("a", 0, [0, 1]), "1-a", 4, 1000.0))
    records.publish_node(backend, RUN, "b", _versioned(node_doc("b", 1, [2, 3]), "1-b", 4, 1041.0))
    doc = compose(read_raw(backend, RUN), now=1042.0)
    ages = {n["node_id"]: (n["status_age_s"], n["status_stale"]) for n in doc["nodes"]}
    assert ages == {"a": (42.0, True), "b": (1.0, False)}
    rows = {row[1]: row[2] for row in node_rows(doc)}
    assert rows == {"host0": "active (status 42 s old)", "host1": "active"}
    # an ended node's document is old by nature, and without the reader's clock nothing is judged
    closed = _versioned({**node_doc("a", 0, [0, 1]), "state": "succeeded"}, "1-a", 5, 1000.0)
    records.publish_node(backend, RUN, "a", closed)
    assert not compose(read_raw(backend, RUN), now=1042.0)["nodes"][0]["status_stale"]
    assert compose(read_raw(backend, RUN))["nodes"][0]["status_age_s"] is None


def test_a_node_whose_replica_peer_is_behind_says_so_in_its_peer_column() -> None:
    backend = MemoryBackend()
    job(backend)
    doc = node_doc("a", 0, [0, 1])
    doc["tiers"]["peer"]["behind"] = [{"peer": "198.18.0.2:29500", "reason": "slower than training: ..."}]
    records.publish_node(backend, RUN, "a", doc)
    rows = {row[1]: row[NODE_COLUMNS.index("peer")] for row in node_rows(status(backend))}
    assert rows == {"host0": "19 (-1), waited 0.5 s, 1 peer(s) behind", "host1": "19 (-1), waited 0.5 s"}


def test_the_peers_behind_are_a_gauge_for_alerting_and_absent_without_replicas() -> None:
    def scraped(tiers: dict[str, Any]) -> float | None:
        registry = CollectorRegistry()
        registry.register(StatusCollector(lambda: {"tiers": tiers}))
        return registry.get_sample_value("resilrun_replica_peers_behind")

    peer = {"step": 9, "lag_steps": 4, "behind": [{"peer": "198.18.0.2:29500", "reason": "slower than training"}]}
    assert scraped({"peer": peer}) == 1
    assert scraped({"peer": {**peer, "behind": []}}) == 0
    assert scraped({"memory": {"step": 9}}) is None  # no replicas: nothing to be behind


def test_each_ranks_compute_time_is_a_column_and_a_gauge_where_it_was_measured() -> None:
    backend = MemoryBackend()
    job(backend)
    a, b = node_doc("a", 0, [0, 1]), node_doc("b", 1, [2, 3])
    a["ranks"][0]["compute_s"] = 0.0423
    a["ranks"][1]["compute_s"] = None  # nothing measured (a plain script)
    b["ranks"][0]["compute_s"] = 1.5
    records.publish_node(backend, RUN, "a", a)
    records.publish_node(backend, RUN, "b", b)
    column = RANK_COLUMNS.index("compute")
    assert [row[column] for row in rank_rows(status(backend))] == ["42ms", "-", "1.50s", "200ms"]
    registry = CollectorRegistry()
    registry.register(StatusCollector(lambda: a))
    assert registry.get_sample_value("resilrun_rank_compute_seconds", {"rank": "0"}) == 0.0423
    assert registry.get_sample_value("resilrun_rank_compute_seconds", {"rank": "1"}) is None


def test_a_rank_the_others_wait_for_is_listed_with_its_evidence_under_the_ranks() -> None:
    backend = MemoryBackend()
    job(backend)
    b = node_doc("b", 1, [2, 3])
    b["ranks"][1]["compute_s"] = 0.45  # rank 3: the others compute 0.2 s per step
    records.publish_node(backend, RUN, "b", b)
    doc = status(backend)
    assert doc["stragglers"] == [
        {"rank": 3, "node_rank": 1, "host": "host1", "compute_s": 0.45, "others_median_s": 0.2, "ratio": 2.25}
    ]
    assert "stragglers: rank 3 (node 1, host1) computes 2.2x the others' median (450ms vs 200ms)" in text_lines(doc)
    b["ranks"][1]["compute_s"] = 0.22
    records.publish_node(backend, RUN, "b", b)
    doc = status(backend)
    assert doc["stragglers"] == [] and not any(line.startswith("stragglers") for line in text_lines(doc))


def test_a_peer_tier_with_peers_behind_still_has_the_documented_shape() -> None:
    # (seen in CI: status read while a replica push was refused during a recovery; the example
    # documents a healthy node, whose list is empty, and the text each entry's fields)
    backend = MemoryBackend()
    job(backend)
    doc = node_doc("a", 0, [0, 1])
    doc["tiers"]["peer"]["behind"] = [{"peer": "198.18.0.2:4000", "reason": "refused step 8 of rank 2"}]
    records.publish_node(backend, RUN, "a", doc)
    assert_matches_documented(status(backend))
    doc["tiers"]["peer"]["behind"] = [{"peer": "198.18.0.2:4000"}]  # an entry without its reason is not
    records.publish_node(backend, RUN, "a", doc)
    with pytest.raises(AssertionError):
        assert_matches_documented(status(backend))
