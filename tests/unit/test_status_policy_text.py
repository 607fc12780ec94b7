"""The one-line snapshot policy in ``resilrun status``'s text view."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from resilrun.agent.observability.metrics import StatusCollector
from resilrun.agent.status import snapshot_policy
from resilrun.cli._status_render import policy_text
from resilrun.config import Config


def test_fixed_and_auto_intervals_read_as_a_sentence() -> None:
    assert policy_text({"every": 1, "interval": 1, "replicate_every": 1}) == "every 1 step"
    assert policy_text({"every": 4, "interval": 4, "replicate_every": 8}) == "every 4 steps, replicas every 8"
    auto = {"every": "auto", "interval": 7, "overhead": 0.021, "max_overhead_pct": 3.0, "replicate_every": 1}
    assert policy_text(auto) == "auto: every 7 steps, 2.1% of step time (budget 3%)"
    assert policy_text({**auto, "interval": None, "overhead": None}) == "auto: measuring (budget 3%)"


def test_replicate_every_auto_says_which_snapshots_go_to_the_peers() -> None:
    auto = {"every": "auto", "interval": 4, "max_overhead_pct": 3.0, "replicate_every": "auto"}
    spaced = {**auto, "replicate_every_snapshots": 5, "replica_interval": 20}
    assert policy_text(spaced).endswith(", replicas: every 5th snapshot (~20 steps)")
    second = {**auto, "replicate_every_snapshots": 2, "replica_interval": 8}
    assert policy_text(second).endswith("every 2nd snapshot (~8 steps)")
    assert policy_text({**auto, "replicate_every_snapshots": 1}).endswith(", replicas: each snapshot")
    assert policy_text(auto).endswith(", replicas: auto")  # before the first decision


def test_no_replicas_means_no_replica_interval_whatever_replicate_every_says() -> None:
    """--replicas 0 takes no replica: neither the policy nor the gauge may claim an interval."""
    config = Config(nnodes="1", nproc_per_node=1, replicas=0, replicate_every=4, snapshot_every=2)
    policy = snapshot_policy(config, None, persisting=False)
    assert policy["replicas"] == 0 and policy["replicate_every"] is None
    assert policy_text(policy) == "every 2 steps, no replicas"
    assert _gauge_value({"snapshots": policy}, "resilrun_replica_interval_steps") is None

    replicated = snapshot_policy(
        Config(nnodes="2", nproc_per_node=1, replicas=1, replicate_every=4), None, persisting=False
    )
    assert replicated["replicas"] == 1 and replicated["replicate_every"] == 4
    assert _gauge_value({"snapshots": replicated}, "resilrun_replica_interval_steps") == 4


def _gauge_value(doc: dict, name: str) -> float | None:
    registry = CollectorRegistry()
    registry.register(StatusCollector(lambda: doc))
    return registry.get_sample_value(name)
