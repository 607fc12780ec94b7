"""--s3-expected-owner holds for every S3 call resilrun makes, not only the simple ones.

The proxy in front of moto plays AWS: a request whose ExpectedBucketOwner is not the bucket
owner's account gets 403 (moto itself ignores the header). Every request the durable tier makes
(multipart upload and abort, ranged reads, HEAD, LIST, DELETE) must carry the expected owner, and
a wrong owner must stop the storage before any object is read or written.
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch

from resilrun.errors import StorageAuthError, StorageError
from resilrun.storage.s3 import RetryPolicy, S3Storage
from resilrun.tiers import durable
from tests.conftest import FaultProxy, S3Server, make_snapshot

MIB = 1024 * 1024
ACCOUNT = "123456789012"
PROBE = "000000000000"  # the one owner id S3Storage sends to learn whether the endpoint enforces


def _retry() -> RetryPolicy:
    return RetryPolicy(
        max_attempts=2,
        initial_backoff=timedelta(milliseconds=1),
        max_backoff=timedelta(milliseconds=5),
        total_timeout=timedelta(seconds=20),
        connect_timeout=timedelta(seconds=2),
        read_timeout=timedelta(seconds=10),
    )


def _enforce_owner(proxy: FaultProxy) -> None:
    def wrong_owner(method: str, path: str, headers: dict[str, str]) -> bool:
        return headers.get("x-amz-expected-bucket-owner") != ACCOUNT

    proxy.fail(403, "AccessDenied", match=wrong_owner)


def _storage(proxy: FaultProxy, bucket: str, owner: str) -> S3Storage:
    return S3Storage(
        bucket, "run", endpoint_url=proxy.endpoint_url, expected_owner=owner, retry=_retry(),
        multipart_threshold=5 * MIB, part_size=5 * MIB,
    )  # fmt: skip


def test_every_request_of_the_durable_tier_carries_the_expected_owner(
    s3_proxy: FaultProxy, s3_server: S3Server, s3_bucket: str
) -> None:
    # Given an endpoint that enforces ExpectedBucketOwner, and the right owner
    _enforce_owner(s3_proxy)
    storage = _storage(s3_proxy, s3_bucket, ACCOUNT)
    big = make_snapshot({"w": torch.arange(3 * MIB, dtype=torch.float32)})  # 12 MiB: a multipart upload
    small = make_snapshot({"w": torch.ones(4)})
    # When the persister's whole path runs: uploads (multipart too), commit, restore reads, retention
    for step in (4, 9, 14):
        durable.write_rank(storage, step, 0, 2, big if step == 4 else small, {"step": step})
        durable.write_rank(storage, step, 1, 2, small, {"step": step})
        durable.commit_step(storage, step, 2)
        durable.retain(storage, keep_last=1)
    assert durable.latest_complete_step(storage) == 14
    _, data, _ = durable.read_rank(storage, 14, 1, verify=True)
    assert data == small
    key = storage.list()[0]
    assert storage.exists(key) and len(storage.get_range(key, 0, 8)) == 8
    # and a multipart upload that fails for good is aborted
    s3_proxy.faults.insert(0, _part_failure())
    with pytest.raises(StorageError):
        storage.put("doomed.bin", os.urandom(11 * MIB))
    # Then every request carried the expected owner (the probe aside), none was refused,
    requests = s3_proxy.requests
    assert any(m == "POST" and "uploads" in p for m, p, _ in requests)  # a multipart upload started
    assert any(m == "PUT" and "partNumber" in p for m, p, _ in requests)
    assert any(m == "DELETE" and "uploadId" in p for m, p, _ in requests)  # the abort
    assert any(m == "GET" and "list-type=2" in p for m, p, _ in requests)
    assert any(m == "HEAD" for m, p, _ in requests)
    owners = [h.get("x-amz-expected-bucket-owner") for _, _, h in requests]
    assert None not in owners
    assert set(owners) == {ACCOUNT, PROBE}
    assert owners.count(PROBE) == 1


def _part_failure():  # noqa: ANN202 - a tests.conftest.Fault
    from tests.conftest import Fault

    return Fault(500, "InternalError", None, lambda method, path, headers: "partNumber=2" in path)


def test_a_wrong_owner_is_refused_before_any_object_is_touched(
    s3_proxy: FaultProxy, s3_server: S3Server, s3_bucket: str
) -> None:
    s3_server.client().put_object(Bucket=s3_bucket, Key="run/step_000000000004/COMPLETE.json", Body=b"{}")
    _enforce_owner(s3_proxy)
    storage = _storage(s3_proxy, s3_bucket, "111122223333")
    for call in (
        lambda: storage.put("k", b"x"),
        lambda: storage.put("big", os.urandom(6 * MIB)),
        lambda: storage.get("step_000000000004/COMPLETE.json"),
        lambda: storage.get_range("step_000000000004/COMPLETE.json", 0, 1),
        lambda: storage.list(),
        lambda: storage.delete("step_000000000004/COMPLETE.json"),
        lambda: durable.latest_complete_step(storage),
    ):
        with pytest.raises(StorageAuthError, match="not owned by the expected owner"):
            call()
    # only bucket-level HEADs (the owner check) reached the endpoint: no object request at all
    assert {(m, p.split("?")[0]) for m, p, _ in s3_proxy.requests} == {("HEAD", f"/{s3_bucket}")}
