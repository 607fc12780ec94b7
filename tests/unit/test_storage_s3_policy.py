"""The S3 storage's pure parts: how long it retries, how it backs off, how an upload is cut into parts."""

from __future__ import annotations

from datetime import timedelta


def test_retry_policy_defaults_are_bounded() -> None:
    from resilrun.storage.s3 import RetryPolicy

    policy = RetryPolicy()
    assert 1 < policy.max_attempts <= 10
    assert policy.total_timeout <= timedelta(minutes=5)


def test_s3_part_plan_respects_the_10000_part_limit() -> None:
    from resilrun.storage.s3 import plan_parts

    mib = 1024 * 1024
    assert plan_parts(12 * mib, 5 * mib) == [(0, 5 * mib), (5 * mib, 10 * mib), (10 * mib, 12 * mib)]
    huge = plan_parts(10_001 * 5 * mib, 5 * mib)
    assert len(huge) <= 10_000
    assert huge[-1][1] == 10_001 * 5 * mib
    assert plan_parts(0, 5 * mib) == []


def test_s3_backoff_grows_exponentially_and_is_capped() -> None:
    from resilrun.storage.s3 import RetryPolicy, backoff_seconds

    policy = RetryPolicy(initial_backoff=timedelta(seconds=1), max_backoff=timedelta(seconds=5))
    assert [backoff_seconds(policy, n, 0.0) for n in (1, 2, 3, 4, 100)] == [1, 2, 4, 5, 5]
    assert backoff_seconds(policy, 1, 0.5) == 1.5
