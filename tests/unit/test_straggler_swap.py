"""Straggler verdicts and swaps (agent/supervision/stragglers.py, agent/workers/step_fence.py):
the leader's judgement across readings, the swap orders under their budget, and the swap itself
driven through the supervisor's loop with fake processes on a fake clock (the harness of
test_recovery_paths.py)."""

from __future__ import annotations

import random
import signal
from pathlib import Path
from typing import Any

from resilrun import keys
from resilrun.agent.observability.telemetry import Telemetry
from resilrun.agent.supervision.rounds import Membership, RoundEnd
from resilrun.agent.supervision.stragglers import FENCE_WAIT_S, HOUR_S, SUSTAIN_CHECKS, StragglerWatch, Verdicts
from resilrun.agent.workers.step_fence import StepFence
from resilrun.rendezvous.memory import MemoryBackend
from resilrun.rendezvous.protocol import NodeInfo, RdzvState
from resilrun.status import records
from tests.unit.test_recovery_paths import RUN, World, finish_all, make_job, run_round


def doc(node: str, generation: int, compute: dict[int, float], ready: int = 1) -> dict[str, Any]:
    ranks = [{"rank": r, "state": "running", "compute_s": c} for r, c in compute.items()]
    return {"node_id": node, "host": f"{node}-host", "round": generation, "ranks": ranks, "spares": {"ready": ready}}


SLOW = [doc("a", 0, {0: 0.040, 1: 0.041}), doc("b", 0, {2: 0.090, 3: 0.039})]
EVEN = [doc("a", 0, {0: 0.040, 1: 0.041}), doc("b", 0, {2: 0.042, 3: 0.039})]


# -- the leader's verdicts ------------------------------------------------------------------------
def test_a_rank_becomes_a_straggler_only_after_sustained_readings_and_leaves_the_same_way() -> None:
    verdicts = Verdicts(swap=False, budget=2)
    changes = [verdicts.check(0, SLOW, now=i) for i in range(SUSTAIN_CHECKS)]
    assert changes[:-1] == [None] * (SUSTAIN_CHECKS - 1)
    assert changes[-1] is not None
    assert changes[-1]["stragglers"] == [
        {"rank": 2, "node_id": "b", "host": "b-host", "compute_s": 0.09, "others_median_s": 0.04, "ratio": 2.25}
    ]
    assert changes[-1]["swaps"] == []  # report only
    # A reading or two without it do not clear it (no flapping near the threshold) ...
    assert [verdicts.check(0, docs, now=9) for docs in (EVEN, EVEN, SLOW)] == [None, None, None]
    # ... as many readings in a row as it took to name it do
    cleared = [verdicts.check(0, EVEN, now=10 + i) for i in range(SUSTAIN_CHECKS)]
    assert cleared[:-1] == [None] * (SUSTAIN_CHECKS - 1)
    assert cleared[-1] is not None and cleared[-1]["stragglers"] == []


def test_a_new_generation_starts_the_count_again_and_other_generations_documents_are_ignored() -> None:
    verdicts = Verdicts(swap=False, budget=2)
    for i in range(SUSTAIN_CHECKS - 1):
        verdicts.check(0, SLOW, now=i)
    stale = [doc("a", 0, {0: 0.040, 1: 0.041}), doc("b", 1, {2: 0.040, 3: 0.039})]
    assert verdicts.check(1, stale, now=5) is None  # b's document is of generation 1, a's is stale
    assert verdicts.check(1, [doc("a", 1, {0: 0.04, 1: 0.04}), doc("b", 1, {2: 0.09, 3: 0.04})], now=6) is None


def test_noise_alone_names_nobody_over_a_long_run() -> None:
    draw = random.Random(7)
    verdicts = Verdicts(swap=True, budget=2)
    for i in range(2000):
        noisy = {r: 0.040 * draw.uniform(0.8, 1.2) for r in range(16)}
        assert verdicts.check(0, [doc("a", 0, noisy)], now=i) is None


def test_a_swap_is_ordered_only_with_a_ready_spare_on_the_rank_node_once_per_generation_within_the_budget() -> None:
    no_spare = [SLOW[0], {**SLOW[1], "spares": {"ready": 0}}]
    verdicts = Verdicts(swap=True, budget=2)
    for i in range(SUSTAIN_CHECKS):
        verdicts.check(0, no_spare, now=i)
    assert verdicts.orders == []  # never swap without a spare
    assert verdicts.check(0, SLOW, now=10) is not None  # a spare came up on b
    assert [(o["id"], o["rank"], o["node_id"], o["round"]) for o in verdicts.orders] == [(1, 2, "b", 0)]
    assert verdicts.check(0, SLOW, now=11) is None  # one order per generation

    def slow_in(generation: int) -> list[dict[str, Any]]:
        return [doc("a", generation, {0: 0.040, 1: 0.041}), doc("b", generation, {2: 0.090, 3: 0.039})]

    for i in range(SUSTAIN_CHECKS):
        verdicts.check(1, slow_in(1), now=20 + i)
    assert [o["id"] for o in verdicts.orders] == [1, 2]
    for i in range(SUSTAIN_CHECKS):
        verdicts.check(2, slow_in(2), now=40 + i)
    assert [o["id"] for o in verdicts.orders] == [1, 2]  # the budget: 2 in any hour
    for i in range(SUSTAIN_CHECKS):
        verdicts.check(3, slow_in(3), now=HOUR_S + 11 + i)
    assert [o["id"] for o in verdicts.orders] == [2, 3]  # the first order is an hour old


def test_a_new_leader_counts_its_predecessors_orders_against_the_budget() -> None:
    verdicts = Verdicts(swap=True, budget=1)
    earlier = {"id": 4, "rank": 1, "node_id": "a", "round": 0, "at": 5}
    verdicts.resume({"round": 0, "stragglers": [], "swaps": [earlier]})
    for i in range(SUSTAIN_CHECKS):
        verdicts.check(1, [doc("a", 1, {0: 0.040, 1: 0.041}), doc("b", 1, {2: 0.090, 3: 0.039})], now=10 + i)
    assert [o["id"] for o in verdicts.orders] == [4]


# -- the watch: the leader writes, every node speaks for its own ranks ------------------------------
class Said(Telemetry):
    def __init__(self) -> None:
        self.said: list[tuple[str, int]] = []

    def straggler(self, kind: str, rank: int, **evidence: Any) -> None:
        self.said.append((kind, rank))


def _membership(node: str) -> Membership:
    membership = Membership(node)
    nodes = tuple(NodeInfo(node_id=n, addr=f"{n}.local", local_world_size=2, hostname=n) for n in ("a", "b"))
    membership.enter(RdzvState(round=0, complete=True, participants=nodes))
    return membership


def test_the_leader_judges_and_the_straggler_node_reports_and_receives_the_swap_order() -> None:
    backend = MemoryBackend()
    leader_said, b_said, orders = Said(), Said(), []
    leader = StragglerWatch(
        backend, RUN, _membership("a"), leader_said, swap=True, budget=2, request_swap=orders.append, wall=lambda: 0.0
    )
    other = StragglerWatch(backend, RUN, _membership("b"), b_said, swap=True, budget=2, request_swap=orders.append)
    a_doc, b_doc = {**SLOW[0], "node_rank": 0}, {**SLOW[1], "node_rank": 1}
    for _ in range(SUSTAIN_CHECKS):
        records.publish_node(backend, RUN, "b", b_doc)
        leader.observe(a_doc)
        other.observe(b_doc)
    shared = records.stragglers(backend, RUN)
    assert shared is not None and [e["rank"] for e in shared["stragglers"]] == [2]
    assert leader_said.said == []  # rank 2 is b's: b says it
    assert b_said.said == [("detected", 2)]
    assert [(o["rank"], o["node_id"]) for o in orders] == [(2, "b")]
    other.observe(b_doc)
    assert len(orders) == 1 and b_said.said == [("detected", 2)]  # each said and acted on once
    backend.set(keys.stragglers(RUN), b'{"round": 0, "stragglers": [], "swaps": []}')
    other.observe(b_doc)
    assert b_said.said == [("detected", 2), ("cleared", 2)]


# -- the fence ------------------------------------------------------------------------------------
def test_the_fence_stops_only_the_asked_worker_once_after_its_commit() -> None:
    stopped: list[int] = []
    resumed: list[int] = []
    fence = StepFence(stop=stopped.append, resume=resumed.append)
    assert fence.at_commit(11, 5) is False
    fence.ask(11)
    assert (fence.at_commit(12, 5), fence.closed(11)) == (False, None)
    assert (fence.at_commit(11, 6), fence.closed(11), stopped) == (True, 6, [11])
    assert fence.at_commit(11, 7) is False  # stopped once
    fence.release(11, resume=True)
    assert (resumed, fence.closed(11)) == ([11], None)
    fence.ask(13)
    fence.release(13, resume=True)  # asked, never stopped: nothing to continue
    assert resumed == [11] and fence.at_commit(13, 1) is False


# -- the swap through the supervisor's loop -------------------------------------------------------
def _order(rank: int, generation: int = 0) -> dict[str, Any]:
    return {"id": 1, "rank": rank, "node_id": "b", "round": generation, "at": 0.0}


def test_a_straggler_is_stopped_at_its_commit_and_its_rank_given_to_the_hot_spare(tmp_path: Path) -> None:
    stopped: list[int] = []
    fence = StepFence(stop=stopped.append, resume=lambda pid: None)
    job = make_job(tmp_path, spares=1, fence=fence)
    seen: dict[str, int] = {}

    def order(world: World) -> None:
        seen.update(slow=world.worker(3).pid, survivor=world.worker(2).pid, spare=world.spares()[0].pid)
        job.sup.straggler_swap.request(_order(3))  # type: ignore[union-attr]

    job.world.at(2, order)
    # It commits step 7 a few ticks later (the commit path closes the fence)
    job.world.at(6, lambda world: fence.at_commit(seen["slow"], 7))
    job.world.at(12, finish_all)

    assert run_round(job) is RoundEnd.DONE

    assert stopped == [seen["slow"]]
    state = job.world.state()
    assert (state.restarts, state.recoveries) == (0, 1)
    workers = job.sup.membership.current.workers  # type: ignore[union-attr]
    assert [w.pid for w in workers] == [seen["survivor"], seen["spare"]]
    assert job.control.assigned[seen["spare"]]["RANK"] == "3"
    assert job.telemetry.stragglers == [True]
    assert job.sup.membership.current.recovered_at_step == 7  # type: ignore[union-attr]
    swapped = [args for kind, args in job.telemetry.calls if kind == "straggler_swapped"]
    assert [(rank, e["step"], e["pid"], e["spare_pid"]) for rank, e in swapped] == [(3, 7, seen["slow"], seen["spare"])]
    assert (seen["slow"], signal.SIGKILL) in job.processes.stopped  # released once its place was taken
    assert "failures" not in job.telemetry.kinds()  # a swap is not a failure


def test_no_commit_within_the_wait_leaves_the_straggler_running(tmp_path: Path) -> None:
    resumed: list[int] = []
    fence = StepFence(stop=lambda pid: None, resume=resumed.append)
    job = make_job(tmp_path, spares=1, fence=fence)
    ticks = int(FENCE_WAIT_S / 0.1) + 20
    job.world.max_ticks = ticks + 50
    job.world.at(2, lambda world: job.sup.straggler_swap.request(_order(3)))  # type: ignore[union-attr]
    job.world.at(ticks, finish_all)

    assert run_round(job) is RoundEnd.DONE

    assert job.world.state().recoveries == 0
    skipped = [args for kind, args in job.telemetry.calls if kind == "straggler_swap_skipped"]
    assert skipped == [(3, {"reason": f"no commit within {FENCE_WAIT_S:.0f} s"})]
    assert resumed == []  # never stopped, nothing to continue


def test_a_plain_script_is_never_fenced(tmp_path: Path) -> None:
    stopped: list[int] = []
    job = make_job(tmp_path, spares=1, fence=StepFence(stop=stopped.append, resume=lambda pid: None))
    job.world.on_api = False
    job.world.at(2, lambda world: job.sup.straggler_swap.request(_order(3)))  # type: ignore[union-attr]
    job.world.at(8, finish_all)

    assert run_round(job) is RoundEnd.DONE

    skipped = [args[0] for kind, args in job.telemetry.calls if kind == "straggler_swap_skipped"]
    assert skipped == [3] and stopped == [] and job.world.state().recoveries == 0


def test_without_a_waiting_spare_the_stopped_straggler_is_continued(tmp_path: Path) -> None:
    resumed: list[int] = []
    fence = StepFence(stop=lambda pid: None, resume=resumed.append)
    job = make_job(tmp_path, spares=1, fence=fence)
    job.world.warm_spares = False  # the spare never reaches "waiting for a rank"
    slow: dict[str, int] = {}

    def order(world: World) -> None:
        slow["pid"] = world.worker(3).pid
        job.sup.straggler_swap.request(_order(3))  # type: ignore[union-attr]

    job.world.at(2, order)
    job.world.at(5, lambda world: fence.at_commit(slow["pid"], 4))
    job.world.at(10, finish_all)

    assert run_round(job) is RoundEnd.DONE

    assert resumed == [slow["pid"]]
    assert job.world.state().recoveries == 0
    assert [k for k in job.telemetry.kinds() if k.startswith("straggler")] == ["straggler_swap_skipped"]


def test_without_a_spare_process_a_straggler_host_is_given_to_a_spare_node() -> None:
    no_spare = [SLOW[0], {**SLOW[1], "spares": {"ready": 0}}]
    verdicts = Verdicts(swap=True, budget=2)
    for i in range(SUSTAIN_CHECKS):
        verdicts.check(0, no_spare, now=i, spare_nodes=1)
    assert [(o["kind"], o["rank"], o["node_id"]) for o in verdicts.orders] == [("host", 2, "b")]
    with_spare = Verdicts(swap=True, budget=2)
    for i in range(SUSTAIN_CHECKS):
        with_spare.check(0, SLOW, now=i, spare_nodes=1)
    assert [o["kind"] for o in with_spare.orders] == ["process"]  # a spare process first: no node moves


def test_a_straggler_host_stops_every_rank_after_the_same_step_and_a_spare_node_takes_its_place(
    tmp_path: Path,
) -> None:
    stopped: list[int] = []
    fence = StepFence(stop=stopped.append, resume=lambda pid: None)
    job = make_job(tmp_path, spares=0, spare_nodes=("s",), fence=fence)
    pids: dict[int, int] = {}

    def order(world: World) -> None:
        pids.update({rank: world.worker(rank).pid for rank in (2, 3)})
        job.sup.straggler_swap.request({**_order(3), "kind": "host"})  # type: ignore[union-attr]

    def rank_3_commits_7_after_rank_2(world: World) -> None:
        world.control.report_step(pids[2], 7)  # rank 2 committed step 7 and waits in step 8 for rank 3
        world.control.report_step(pids[3], 7)
        fence.at_commit(pids[3], 7)

    job.world.at(2, order)
    job.world.at(5, rank_3_commits_7_after_rank_2)

    assert run_round(job) is RoundEnd.REJOIN  # this node stands by from here

    assert sorted(stopped) == sorted(pids.values())  # both stopped after step 7, then released
    state = job.world.state()
    assert (state.round, state.restarts, [p.node_id for p in state.participants]) == (1, 0, ["a", "s"])
    swapped = [args for kind, args in job.telemetry.calls if kind == "straggler_swapped"]
    assert [(rank, e["by"], e["step"], e["round"]) for rank, e in swapped] == [(3, "spare node", 7, 1)]
    assert {pid for pid, sig in job.processes.stopped if sig == signal.SIGKILL} >= set(pids.values())


def test_a_straggler_and_its_swap_are_in_the_metrics_with_the_evidence() -> None:
    from resilrun.agent.observability.metrics import AgentMetrics

    metrics = AgentMetrics()

    def sample(name: str, **labels: str) -> float | None:
        return metrics.registry.get_sample_value(f"resilrun_{name}", labels)

    metrics.on_straggler("detected", 2, {"ratio": 2.25, "compute_s": 0.09, "others_median_s": 0.04})
    assert sample("rank_straggler_ratio", rank="2") == 2.25
    metrics.on_straggler("swapped", 2, {"by": "spare node", "step": 7})
    assert sample("rank_straggler_ratio", rank="2") == 0.0
    assert sample("straggler_swaps_total", by="spare node") == 1.0
    metrics.on_straggler("detected", 3, {"ratio": 1.8})
    metrics.on_straggler("cleared", 3, {})
    assert sample("rank_straggler_ratio", rank="3") == 0.0
