"""The Storage contract: every implementation passes this suite unchanged.

Parametrised over the in-memory storage, a directory, and S3 through a real moto server on loopback
(HTTP, not an in-process mock). Implementation-specific behaviour (atomic local writes, S3 retries,
multipart and bucket owner checks) is tested in the sections after the contract.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from resilrun.errors import ExitCode, StorageAuthError, StorageError, StorageNotFoundError
from resilrun.storage import LocalStorage, MemoryStorage, Storage
from resilrun.storage.s3 import RetryPolicy
from tests.conftest import FaultProxy, S3Server

DATA = bytes(range(256)) * 4


@pytest.fixture(params=["memory", "local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Storage]:
    if request.param == "memory":
        yield MemoryStorage()
    elif request.param == "local":
        yield LocalStorage(tmp_path / "root")
    else:
        from resilrun.storage.s3 import S3Storage

        server: S3Server = request.getfixturevalue("s3_server")
        bucket: str = request.getfixturevalue("s3_bucket")
        yield S3Storage(bucket, "some/prefix", endpoint_url=server.endpoint_url)


# -- put / get -------------------------------------------------------------------------------------
def test_put_then_get_returns_the_same_bytes(storage: Storage) -> None:
    storage.put("a/b/c.bin", DATA)
    assert storage.get("a/b/c.bin") == DATA


def test_put_accepts_a_memoryview_and_stores_a_copy(storage: Storage) -> None:
    buffer = bytearray(DATA)
    storage.put("view.bin", memoryview(buffer)[10:20])
    buffer[10:20] = b"\xff" * 10  # the caller reuses its buffer
    assert storage.get("view.bin") == DATA[10:20]


def test_put_overwrites_the_previous_object(storage: Storage) -> None:
    storage.put("k", b"first, longer value")
    storage.put("k", b"second")
    assert storage.get("k") == b"second"


def test_an_empty_object_round_trips(storage: Storage) -> None:
    storage.put("empty", b"")
    assert storage.get("empty") == b""
    assert storage.size("empty") == 0
    assert storage.exists("empty")


def test_get_of_a_missing_key_raises_storage_not_found(storage: Storage) -> None:
    with pytest.raises(StorageNotFoundError) as info:
        storage.get("never/written")
    assert isinstance(info.value, StorageError)
    assert info.value.exit_code == ExitCode.STORAGE


def test_size_is_the_object_length(storage: Storage) -> None:
    storage.put("sized", DATA)
    assert storage.size("sized") == len(DATA)
    with pytest.raises(StorageNotFoundError):
        storage.size("missing")


# -- get_range -------------------------------------------------------------------------------------
def test_get_range_returns_the_half_open_range(storage: Storage) -> None:
    storage.put("r", DATA)
    assert storage.get_range("r", 0, 8) == DATA[:8]
    assert storage.get_range("r", 100, 300) == DATA[100:300]


def test_get_range_past_the_end_is_short_and_never_fails(storage: Storage) -> None:
    storage.put("r", DATA)
    assert storage.get_range("r", len(DATA) - 4, len(DATA) + 2**40) == DATA[-4:]
    assert storage.get_range("r", len(DATA), len(DATA) + 10) == b""
    assert storage.get_range("r", len(DATA) + 10, len(DATA) + 20) == b""
    assert storage.get_range("r", 5, 5) == b""


def test_get_range_of_a_missing_key_raises_storage_not_found(storage: Storage) -> None:
    with pytest.raises(StorageNotFoundError):
        storage.get_range("missing", 0, 8)
    with pytest.raises(StorageNotFoundError):
        storage.get_range("missing", 0, 0)


def test_get_range_rejects_a_reversed_or_negative_range(storage: Storage) -> None:
    storage.put("r", DATA)
    with pytest.raises(ValueError):
        storage.get_range("r", 10, 5)
    with pytest.raises(ValueError):
        storage.get_range("r", -1, 5)


# -- list / exists / delete ------------------------------------------------------------------------
def test_list_returns_sorted_keys_relative_to_the_root(storage: Storage) -> None:
    for key in ("step_2/b", "step_1/a", "step_1/sub/c", "other"):
        storage.put(key, b"x")
    assert storage.list() == ["other", "step_1/a", "step_1/sub/c", "step_2/b"]
    assert storage.list("step_") == ["step_1/a", "step_1/sub/c", "step_2/b"]
    assert storage.list("step_1/") == ["step_1/a", "step_1/sub/c"]
    assert storage.list("step_1/s") == ["step_1/sub/c"]
    assert storage.list("nothing/") == []


def test_list_of_an_empty_storage_is_empty(storage: Storage) -> None:
    assert storage.list() == []
    assert storage.list("step_") == []


def test_exists_is_true_only_for_stored_keys(storage: Storage) -> None:
    storage.put("here", b"x")
    assert storage.exists("here")
    assert not storage.exists("not/here")


def test_delete_removes_the_object_and_is_idempotent(storage: Storage) -> None:
    storage.put("d/one", b"1")
    storage.put("d/two", b"2")
    storage.delete("d/one")
    storage.delete("d/one")
    storage.delete("never/existed")
    assert not storage.exists("d/one")
    assert storage.list() == ["d/two"]


# -- keys ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "..", "a//b", "./a", "a/.", "a\\b", "a\x00b", "trailing/"])
def test_unsafe_keys_are_refused_before_any_io(storage: Storage, key: str) -> None:
    for call in (
        lambda: storage.put(key, b"x"),
        lambda: storage.get(key),
        lambda: storage.get_range(key, 0, 1),
        lambda: storage.size(key),
        lambda: storage.exists(key),
        lambda: storage.delete(key),
    ):
        with pytest.raises(StorageError):
            call()
    assert storage.list() == []


def test_list_refuses_a_prefix_that_climbs_out_of_the_root(storage: Storage) -> None:
    with pytest.raises(StorageError):
        storage.list("../")


# -- threads ---------------------------------------------------------------------------------------
def test_concurrent_puts_from_threads_are_all_stored(storage: Storage) -> None:
    def writer(index: int) -> None:
        for j in range(5):
            storage.put(f"t/{index}/{j}", f"{index}-{j}".encode())

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert len(storage.list("t/")) == 40
    assert storage.get("t/7/4") == b"7-4"


# -- local directory specifics ---------------------------------------------------------------------
def test_local_put_leaves_no_temporary_files(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path)
    storage.put("step/x.bin", DATA)
    storage.put("step/x.bin", DATA[:10])
    assert sorted(p.name for p in (tmp_path / "step").iterdir()) == ["x.bin"]


def test_local_list_ignores_temporary_files_of_an_interrupted_put(tmp_path: Path) -> None:
    (tmp_path / "step").mkdir()
    (tmp_path / "step" / ".resilrun-tmp-abc").write_bytes(b"torn")
    (tmp_path / "step" / "whole").write_bytes(b"whole")
    assert LocalStorage(tmp_path).list() == ["step/whole"]


def test_local_delete_removes_directories_it_empties_but_never_the_root(tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "root")
    storage.put("a/b/c", b"x")
    storage.delete("a/b/c")
    assert (tmp_path / "root").is_dir()
    assert list((tmp_path / "root").iterdir()) == []


def test_local_refuses_to_read_a_device_behind_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "step").mkdir()
    os.symlink("/dev/zero", tmp_path / "step" / "zero")
    storage = LocalStorage(tmp_path)
    with pytest.raises(StorageError, match="not a regular file"):
        storage.get("step/zero")
    with pytest.raises(StorageError, match="not a regular file"):
        storage.get_range("step/zero", 0, 2**40)


def test_local_put_under_a_file_is_a_storage_error_not_an_oserror(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_bytes(b"a file, not a directory")
    with pytest.raises(StorageError) as info:
        LocalStorage(tmp_path).put("blocker/key", b"x")
    assert "blocker/key" in info.value.message


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_local_permission_denied_is_a_storage_auth_error(tmp_path: Path) -> None:
    root = tmp_path / "locked"
    root.mkdir()
    root.chmod(0o500)
    try:
        with pytest.raises(StorageAuthError):
            LocalStorage(root).put("k", b"x")
    finally:
        root.chmod(0o700)


def test_s3_storage_module_imports_boto3_only_when_used() -> None:
    import subprocess
    import sys

    code = "import sys, resilrun.storage, resilrun.tiers.durable; print('boto3' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "False"


def test_retry_policy_defaults_are_bounded() -> None:
    from resilrun.storage.s3 import RetryPolicy

    policy = RetryPolicy()
    assert 1 < policy.max_attempts <= 10
    assert policy.total_timeout <= timedelta(minutes=5)


# -- S3 specifics: retries, bounded failure, multipart, owner, credentials -------------------------
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


def test_get_ranges_returns_each_range_as_get_range_would(storage: Storage) -> None:
    storage.put("r", DATA)
    ranges = [(0, 8), (100, 300), (len(DATA) - 4, len(DATA) + 10), (5, 5), (len(DATA) + 1, len(DATA) + 2)]
    assert storage.get_ranges("r", ranges) == [storage.get_range("r", s, e) for s, e in ranges]
    assert storage.get_ranges("r", []) == []
    with pytest.raises(StorageNotFoundError):
        storage.get_ranges("missing", [(0, 8), (8, 16)])
