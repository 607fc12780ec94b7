"""What only the S3 storage does, against a real moto server on loopback (a fault proxy in front
of it where a test needs failures): retries and their bounds, multipart uploads, the bucket
owner check, and credentials kept out of every message; boto3 imported only when S3 is used.

What every storage does is the contract (tests/contract/test_storage_contract.py)."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest

from resilrun.errors import ExitCode, StorageAuthError, StorageError, StorageNotFoundError
from resilrun.storage import Storage
from resilrun.storage.s3 import RetryPolicy
from tests.conftest import STORAGE_DATA as DATA
from tests.conftest import FaultProxy, S3Server


def test_s3_storage_module_imports_boto3_only_when_used() -> None:
    import subprocess
    import sys

    code = "import sys, resilrun.storage, resilrun.tiers.durable; print('boto3' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "False"


# -- retries, bounded failure, multipart, owner, credentials -------------------------------------
def _fast_retry(attempts: int = 4, total: float = 20.0) -> RetryPolicy:

    return RetryPolicy(
        max_attempts=attempts,
        initial_backoff=timedelta(milliseconds=1),
        max_backoff=timedelta(milliseconds=5),
        total_timeout=timedelta(seconds=total),
        connect_timeout=timedelta(seconds=2),
        read_timeout=timedelta(seconds=10),
    )


def _s3(endpoint_url: str, bucket: str, **kwargs: object) -> Storage:
    from resilrun.storage.s3 import S3Storage

    kwargs.setdefault("retry", _fast_retry())
    return S3Storage(bucket, "ckpt", endpoint_url=endpoint_url, **kwargs)  # type: ignore[arg-type]


def _is_put_object(method: str, path: str, headers: dict[str, str]) -> bool:
    return method == "PUT" and "uploadId" not in path


def test_s3_put_succeeds_after_injected_500_and_503_errors(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    proxy = s3_proxy
    proxy.fail(500, "InternalError", times=2, match=_is_put_object)
    proxy.fail(503, "SlowDown", times=1, match=_is_put_object)
    storage = _s3(proxy.endpoint_url, s3_bucket)
    storage.put("k", DATA)
    assert proxy.failures_served == 3
    assert storage.get("k") == DATA


def test_s3_get_and_list_succeed_after_injected_throttling(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    proxy = s3_proxy
    storage = _s3(proxy.endpoint_url, s3_bucket)
    storage.put("a/k", DATA)
    proxy.fail(503, "SlowDown", times=2, match=lambda method, path, headers: method == "GET")
    assert storage.get("a/k") == DATA
    proxy.fail(400, "Throttling", times=1)
    assert storage.list("a/") == ["a/k"]
    assert proxy.failures_served == 3


def test_s3_permanent_5xx_ends_in_storage_error_after_bounded_attempts(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    import time

    proxy = s3_proxy
    proxy.fail(503, "ServiceUnavailable")
    storage = _s3(proxy.endpoint_url, s3_bucket, retry=_fast_retry(attempts=4))
    started = time.monotonic()
    with pytest.raises(StorageError) as info:
        storage.put("k", DATA)
    assert time.monotonic() - started < 10
    assert len(proxy.requests) == 4
    assert "after 4 attempts" in info.value.message
    assert "ServiceUnavailable" in info.value.message
    assert info.value.exit_code == ExitCode.STORAGE


def test_s3_retries_stop_at_the_total_timeout_whatever_the_attempt_budget(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    import time

    from resilrun.storage.s3 import RetryPolicy

    proxy = s3_proxy
    proxy.fail(500, "InternalError")
    policy = RetryPolicy(
        max_attempts=10_000,
        initial_backoff=timedelta(milliseconds=20),
        max_backoff=timedelta(milliseconds=20),
        total_timeout=timedelta(milliseconds=300),
    )
    started = time.monotonic()
    with pytest.raises(StorageError):
        _s3(proxy.endpoint_url, s3_bucket, retry=policy).get("k")
    assert time.monotonic() - started < 5
    assert len(proxy.requests) < 100


def test_s3_client_errors_are_not_retried(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    proxy = s3_proxy
    proxy.fail(400, "InvalidArgument")
    with pytest.raises(StorageError, match="InvalidArgument"):
        _s3(proxy.endpoint_url, s3_bucket).put("k", b"x")
    assert len(proxy.requests) == 1


def test_s3_unreachable_endpoint_fails_within_bounded_time(s3_bucket: str) -> None:
    import time

    from tests.conftest import free_port

    started = time.monotonic()
    with pytest.raises(StorageError, match="could not be reached") as info:
        _s3(f"http://127.0.0.1:{free_port()}", s3_bucket, retry=_fast_retry(attempts=3)).get("k")
    assert time.monotonic() - started < 10
    assert "after 3 attempts" in info.value.message
    assert info.value.hint and "--s3-endpoint-url" in info.value.hint


def test_s3_missing_bucket_is_a_storage_error_with_a_hint(s3_server: S3Server) -> None:
    storage = _s3(s3_server.endpoint_url, "resilrun-no-such-bucket")
    with pytest.raises(StorageError) as info:
        storage.get("k")
    assert not isinstance(info.value, StorageNotFoundError)  # a missing bucket is not a missing checkpoint
    assert info.value.hint and "bucket" in info.value.hint


def test_s3_missing_bucket_with_an_owner_check_is_not_a_missing_object(s3_server: S3Server) -> None:
    storage = _s3(s3_server.endpoint_url, "resilrun-no-such-bucket", expected_owner="111122223333")
    with pytest.raises(StorageError, match="does not exist") as info:
        storage.size("k")
    assert not isinstance(info.value, StorageNotFoundError)


def _multipart_uploads(server: S3Server, bucket: str) -> list[object]:
    return list(server.client().list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def test_s3_large_object_goes_up_in_parts(s3_proxy: FaultProxy, s3_server: S3Server, s3_bucket: str) -> None:
    proxy = s3_proxy
    mib = 1024 * 1024
    payload = os.urandom(12 * mib)
    storage = _s3(proxy.endpoint_url, s3_bucket, multipart_threshold=5 * mib, part_size=5 * mib)
    storage.put("big.bin", memoryview(payload))
    parts = [path for method, path, _ in proxy.requests if method == "PUT" and "partNumber=" in path]
    assert len(parts) == 3
    assert storage.get("big.bin") == payload
    assert storage.size("big.bin") == 12 * mib
    etag = s3_server.client().head_object(Bucket=s3_bucket, Key="ckpt/big.bin")["ETag"]
    assert etag.strip('"').endswith("-3")
    assert _multipart_uploads(s3_server, s3_bucket) == []


def test_s3_multipart_retries_a_failed_part(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    proxy = s3_proxy
    mib = 1024 * 1024
    payload = os.urandom(11 * mib)
    proxy.fail(503, "SlowDown", times=2, match=lambda method, path, headers: "partNumber=2" in path)
    storage = _s3(proxy.endpoint_url, s3_bucket, multipart_threshold=5 * mib, part_size=5 * mib)
    storage.put("big.bin", payload)
    assert proxy.failures_served == 2
    assert storage.get("big.bin") == payload


def test_s3_multipart_upload_is_aborted_when_a_part_fails_for_good(
    s3_proxy: FaultProxy, s3_server: S3Server, s3_bucket: str
) -> None:
    proxy = s3_proxy
    mib = 1024 * 1024
    proxy.fail(500, "InternalError", match=lambda method, path, headers: "partNumber=2" in path)
    storage = _s3(proxy.endpoint_url, s3_bucket, multipart_threshold=5 * mib, part_size=5 * mib)
    with pytest.raises(StorageError, match="part 2"):
        storage.put("big.bin", os.urandom(12 * mib))
    assert any(method == "DELETE" and "uploadId=" in path for method, path, _ in proxy.requests)
    assert _multipart_uploads(s3_server, s3_bucket) == []
    assert not storage.exists("big.bin")


def test_moto_ignores_expected_bucket_owner_so_s3_storage_checks_it_itself(s3_server: S3Server, s3_bucket: str) -> None:
    # moto 5.2 accepts any ExpectedBucketOwner (AWS answers 403): this is why S3Storage falls back
    # to comparing the bucket ACL's owner when the endpoint does not enforce the header.
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="x", Body=b"x", ExpectedBucketOwner="111122223333")
    storage = _s3(s3_server.endpoint_url, s3_bucket, expected_owner="111122223333")
    with pytest.raises(StorageAuthError, match="not owned by the expected owner") as info:
        storage.put("k", b"must not be written")
    assert info.value.exit_code == ExitCode.STORAGE
    assert "ckpt/k" not in [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])]


def test_s3_matching_owner_is_accepted_and_sent_on_every_request(
    s3_proxy: FaultProxy, s3_server: S3Server, s3_bucket: str
) -> None:
    proxy = s3_proxy
    owner = s3_server.client().get_bucket_acl(Bucket=s3_bucket)["Owner"]["ID"]
    storage = _s3(proxy.endpoint_url, s3_bucket, expected_owner=owner)
    storage.put("k", DATA)
    assert storage.get("k") == DATA
    assert storage.list() == ["k"]
    storage.delete("k")
    assert [(m, p) for m, p, h in proxy.requests if "x-amz-expected-bucket-owner" not in h] == []
    sent = {h["x-amz-expected-bucket-owner"] for _, _, h in proxy.requests}
    assert sent == {owner, "000000000000"}  # the expected owner, and the one probe for enforcement


def test_s3_owner_mismatch_is_refused_by_an_enforcing_endpoint(s3_proxy: FaultProxy, s3_bucket: str) -> None:
    # Emulate AWS: a request whose ExpectedBucketOwner is not the owner's account id gets 403.
    proxy = s3_proxy
    account = "123456789012"

    def wrong_owner(method: str, path: str, headers: dict[str, str]) -> bool:
        return headers.get("x-amz-expected-bucket-owner", account) != account

    proxy.fail(403, "AccessDenied", match=wrong_owner)
    with pytest.raises(StorageAuthError, match="not owned by the expected owner"):
        _s3(proxy.endpoint_url, s3_bucket, expected_owner="111122223333").put("k", b"x")
    good = _s3(proxy.endpoint_url, s3_bucket, expected_owner=account)
    good.put("k", b"x")
    assert good.get("k") == b"x"
    assert not any("acl" in path for _, path, _ in proxy.requests)  # the header was enforced; no ACL fallback


def test_s3_error_messages_and_logs_never_carry_credentials(
    s3_proxy: FaultProxy, s3_server: S3Server, s3_bucket: str, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.conftest import FAKE_ACCESS_KEY_ID, FAKE_SECRET_ACCESS_KEY, free_port

    proxy = s3_proxy
    echo = "The key you sent: {authorization}"  # a server that echoes the Authorization header back
    errors: list[StorageError] = []
    caplog.set_level("WARNING")
    proxy.fail(403, "InvalidAccessKeyId", times=1, message=echo)
    proxy.fail(503, "SlowDown", times=4, message=echo)
    for action in (
        lambda: _s3(proxy.endpoint_url, s3_bucket).put("k", b"x"),
        lambda: _s3(proxy.endpoint_url, s3_bucket).put("k", b"x"),
        lambda: _s3(proxy.endpoint_url, s3_bucket).get("missing"),
        lambda: _s3(f"http://127.0.0.1:{free_port()}", s3_bucket, retry=_fast_retry(2)).get("k"),
        lambda: _s3(s3_server.endpoint_url, s3_bucket, expected_owner="111122223333").get("k"),
    ):
        with pytest.raises(StorageError) as info:
            action()
        errors.append(info.value)
    assert "<redacted>" in errors[0].message
    text = "\n".join(f"{e.message} {e.hint}" for e in errors) + caplog.text
    assert FAKE_ACCESS_KEY_ID not in text
    assert FAKE_SECRET_ACCESS_KEY not in text
    assert "Signature=" not in text
