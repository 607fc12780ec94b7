"""S3 Storage through boto3: retries with backoff, multipart for large objects, bucket owner checks.

Invariants:
- boto3 is imported when an ``S3Storage`` is created, never when resilrun is imported.
- botocore's own retries are off (one attempt per call); tenacity is the single retry layer, so the
  bounds in ``RetryPolicy`` are the real bounds: at most ``max_attempts`` per call, no attempt started
  after ``total_timeout``, each attempt bounded by the connect and read timeouts.
- Objects above ``multipart_threshold`` go up as a multipart upload; if any part fails for good the
  upload is aborted, so no invisible half-uploaded parts keep costing storage.
- With an expected owner, ``ExpectedBucketOwner`` is sent on every request, and the owner is checked
  once per Storage before its first request (see ``_check_owner`` for stores that ignore the header).
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from resilrun.errors import StorageAuthError, StorageError, StorageNotFoundError
from resilrun.storage import _s3_errors
from resilrun.storage.api import Storage, check_key, check_prefix, clip_range

logger = logging.getLogger(__name__)
T = TypeVar("T")

MIB = 1024 * 1024
MIN_PART_SIZE = 5 * MIB  # S3 refuses smaller parts (except the last one)
MAX_PARTS = 10_000  # S3's limit on parts per upload
# An owner id no bucket has (AWS account ids are never all zeros): used to ask whether the
# endpoint enforces ExpectedBucketOwner at all.
_PROBE_OWNER = "000000000000"


@dataclass(frozen=True, slots=True, kw_only=True)
class RetryPolicy:
    """How hard one S3 call tries before it raises StorageError.

    The defaults ride out an S3 503 SlowDown burst or a brief network partition (5 attempts with
    0.2 s .. 10 s jittered exponential backoff, about 20 s in all) but give up within two minutes,
    because a checkpoint upload that cannot finish by then is better reported than stuck.
    """

    max_attempts: int = 5
    initial_backoff: timedelta = timedelta(seconds=0.2)
    max_backoff: timedelta = timedelta(seconds=10)
    total_timeout: timedelta = timedelta(seconds=120)
    # A TCP connect to S3 takes milliseconds; 10 s means the endpoint is unreachable.
    connect_timeout: timedelta = timedelta(seconds=10)
    # 60 s without a byte on an open connection (a 16 MiB part at a few hundred KB/s still moves).
    read_timeout: timedelta = timedelta(seconds=60)


def backoff_seconds(policy: RetryPolicy, attempt: int, rand: float) -> float:
    """Wait after failed attempt ``attempt`` (1-based): exponential, capped, plus up to one initial
    backoff of jitter (``rand`` in [0, 1)) so that many ranks retrying at once spread out."""
    initial = policy.initial_backoff.total_seconds()
    return min(policy.max_backoff.total_seconds(), initial * float(2 ** min(attempt - 1, 62))) + initial * rand


def plan_parts(size: int, part_size: int) -> list[tuple[int, int]]:
    """Split ``size`` bytes into ``[start, end)`` parts of ``part_size`` (the last one shorter).

    The part size grows when ``size`` would need more than S3's 10,000 parts.
    """
    part_size = max(part_size, math.ceil(size / MAX_PARTS))
    return [(start, min(start + part_size, size)) for start in range(0, size, part_size)]


class S3Storage(Storage):
    """See ``Storage``; keys live under ``s3://bucket/prefix/``."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        expected_owner: str | None = None,
        multipart_threshold: int = 64 * MIB,
        part_size: int = 16 * MIB,
        max_concurrency: int = 4,
        retry: RetryPolicy | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """Create the client (no request is sent yet).

        Args:
            bucket: the bucket name.
            prefix: the key prefix all keys live under ("" for the bucket root).
            endpoint_url: an S3-compatible endpoint; path-style addressing is used with it.
            expected_owner: the account id that must own the bucket (``ExpectedBucketOwner``).
            multipart_threshold: objects larger than this are uploaded in parts.
            part_size: bytes per part (at least 5 MiB, S3's minimum).
            max_concurrency: parts uploaded at once (bounds memory to this many part copies).
            retry: retry bounds and timeouts; see ``RetryPolicy``.
            sleep: how backoff waits; tests inject a fake.

        Raises:
            ValueError: a size or concurrency out of range (a programmer error).
        """
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size {part_size} is below S3's minimum of {MIN_PART_SIZE}")
        if multipart_threshold < part_size or max_concurrency < 1:
            raise ValueError("multipart_threshold must be >= part_size and max_concurrency >= 1")
        import boto3
        from botocore.config import Config

        self.bucket = bucket
        self._prefix = check_prefix(prefix.strip("/") + "/") if prefix.strip("/") else ""
        self.uri = f"s3://{bucket}/{self._prefix}".rstrip("/")
        self._retry = retry or RetryPolicy()
        self._sleep = sleep
        self._threshold = multipart_threshold
        self._part_size = part_size
        self._concurrency = max_concurrency
        self._expected_owner = expected_owner
        self._owner_kw: dict[str, str] = {"ExpectedBucketOwner": expected_owner} if expected_owner else {}
        self._owner_checked = expected_owner is None
        self._owner_lock = threading.Lock()
        config = Config(
            retries={"total_max_attempts": 1, "mode": "standard"},  # tenacity is the one retry layer
            connect_timeout=self._retry.connect_timeout.total_seconds(),
            read_timeout=self._retry.read_timeout.total_seconds(),
            max_pool_connections=max(10, 2 * max_concurrency),
            # S3-compatible stores (MinIO, Ceph, moto) generally need path-style addressing.
            s3={"addressing_style": "path"} if endpoint_url else None,
        )
        try:
            self._client: Any = boto3.session.Session().client("s3", endpoint_url=endpoint_url, config=config)
        except Exception as exc:  # noqa: BLE001 - botocore raises ValueError and its own errors here
            raise _s3_errors.translate(exc, "connect to", self.uri) from exc

    # -- the one call path: owner check, retries, translation --------------------------------------
    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._prefix}{key}"

    def _attempt(self, action: str, where: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` under the retry policy; translate its final failure into a StorageError."""
        import tenacity

        policy = self._retry
        retrying = tenacity.Retrying(
            stop=tenacity.stop_after_attempt(policy.max_attempts)
            | tenacity.stop_before_delay(policy.total_timeout.total_seconds()),
            wait=lambda state: backoff_seconds(policy, state.attempt_number, random.random()),
            retry=tenacity.retry_if_exception(_s3_errors.is_retryable),
            sleep=self._sleep,
            before_sleep=lambda state: _log_retry(action, where, state, policy.max_attempts),
            reraise=True,
        )
        try:
            return retrying(fn)
        except Exception as exc:  # noqa: BLE001 - translated at this one edge
            attempts = int(retrying.statistics.get("attempt_number", 1))
            raise _s3_errors.translate(exc, action, where, attempts=attempts) from exc

    def _call(self, action: str, key: str, fn: Callable[[], T]) -> T:
        self._check_owner()
        return self._attempt(action, self._where(key), fn)

    def _check_owner(self) -> None:
        """Refuse a bucket that is not owned by ``expected_owner`` before the first request.

        AWS S3 enforces ``ExpectedBucketOwner`` itself (403), but some S3-compatible stores, moto
        among them, ignore the header. So ask first: a HEAD with an owner id no bucket has. A 403
        means the endpoint enforces the header, and a HEAD with the expected owner settles it. A
        success means it does not, and the owner in the bucket ACL (the only owner such a store
        reports) must equal the expected one.
        """
        if self._owner_checked:
            return
        with self._owner_lock:
            if self._owner_checked:
                return
            try:
                self._verify_owner()
            except StorageNotFoundError as exc:  # a HEAD has no body: 404 is all S3 says
                raise StorageError(
                    f"bucket '{self.bucket}' does not exist", hint="check the bucket name in the s3:// URI"
                ) from exc
            self._owner_checked = True

    def _verify_owner(self) -> None:
        where = f"s3://{self.bucket}"
        try:
            self._attempt(
                "check the owner of",
                where,
                lambda: self._client.head_bucket(Bucket=self.bucket, ExpectedBucketOwner=_PROBE_OWNER),
            )
            enforced = False
        except StorageAuthError:
            enforced = True
        if enforced:
            try:
                self._attempt(
                    "check the owner of",
                    where,
                    lambda: self._client.head_bucket(Bucket=self.bucket, ExpectedBucketOwner=self._expected_owner),
                )
            except StorageAuthError as exc:
                raise self._owner_error() from exc
        else:
            acl = self._attempt(
                "read the owner of", where, lambda: self._client.get_bucket_acl(Bucket=self.bucket, **self._owner_kw)
            )
            if acl.get("Owner", {}).get("ID") != self._expected_owner:
                raise self._owner_error()

    def _owner_error(self) -> StorageAuthError:
        return StorageAuthError(
            f"bucket '{self.bucket}' is not owned by the expected owner '{self._expected_owner}' "
            "(or access to it is denied)",
            hint="check the bucket name and --s3-expected-owner; nothing was read or written",
        )

    # -- Storage -----------------------------------------------------------------------------------
    def put(self, key: str, data: bytes | memoryview) -> None:
        """See base class."""
        check_key(key)
        view = memoryview(data).cast("B")
        if view.nbytes > self._threshold:
            self._put_multipart(key, view)
            return
        body = bytes(view)  # botocore takes bytes or a file, not a memoryview
        self._call(
            "write",
            key,
            lambda: self._client.put_object(Bucket=self.bucket, Key=self._prefix + key, Body=body, **self._owner_kw),
        )

    def _put_multipart(self, key: str, view: memoryview) -> None:
        full_key = self._prefix + key
        started = self._call(
            "start a multipart upload of",
            key,
            lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=full_key, **self._owner_kw),
        )
        upload_id = started["UploadId"]
        try:
            parts = plan_parts(view.nbytes, self._part_size)
            with ThreadPoolExecutor(max_workers=min(self._concurrency, len(parts))) as pool:
                futures = [
                    pool.submit(self._upload_part, key, upload_id, number, view[start:end])
                    for number, (start, end) in enumerate(parts, start=1)
                ]
                wait(futures, return_when=FIRST_EXCEPTION)
                for future in futures:  # after a failure, parts not yet started never start
                    future.cancel()
            for future in futures:
                error = None if future.cancelled() else future.exception()
                if error is not None:
                    raise error
            done = [f.result() for f in futures]
            self._call(
                "finish the multipart upload of",
                key,
                lambda: self._client.complete_multipart_upload(
                    Bucket=self.bucket,
                    Key=full_key,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": done},
                    **self._owner_kw,
                ),
            )
        except BaseException:
            self._abort(key, upload_id)
            raise

    def _upload_part(self, key: str, upload_id: str, number: int, chunk: memoryview) -> dict[str, Any]:
        body = bytes(chunk)  # copied in the worker, so at most max_concurrency copies exist at once
        response = self._call(
            f"upload part {number} of",
            key,
            lambda: self._client.upload_part(
                Bucket=self.bucket,
                Key=self._prefix + key,
                UploadId=upload_id,
                PartNumber=number,
                Body=body,
                **self._owner_kw,
            ),
        )
        part = {"PartNumber": number, "ETag": response["ETag"]}
        # Newer botocore adds a CRC checksum to each part; S3 then wants it back when completing.
        part.update({k: v for k, v in response.items() if k.startswith("Checksum") and k != "ChecksumType"})
        return part

    def _abort(self, key: str, upload_id: str) -> None:
        """Best effort: a failed abort is logged (a bucket lifecycle rule can still clean up)."""
        try:
            self._call(
                "abort the multipart upload of",
                key,
                lambda: self._client.abort_multipart_upload(
                    Bucket=self.bucket, Key=self._prefix + key, UploadId=upload_id, **self._owner_kw
                ),
            )
        except Exception as exc:  # noqa: BLE001 - the original failure is the one to raise
            logger.warning("could not abort the multipart upload of %s: %s", self._where(key), exc)

    def get(self, key: str) -> bytes:
        """See base class."""
        check_key(key)

        def read() -> bytes:
            response = self._client.get_object(Bucket=self.bucket, Key=self._prefix + key, **self._owner_kw)
            return bytes(response["Body"].read())  # inside the retry: a dropped stream retries the GET

        return self._call("read", key, read)

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int]]) -> list[bytes]:
        """See base class: the requests run concurrently (latency, not bandwidth, bounds them)."""
        if len(ranges) <= 1:
            return [self.get_range(key, start, end) for start, end in ranges]
        with ThreadPoolExecutor(max_workers=min(self._concurrency, len(ranges))) as pool:
            return list(pool.map(lambda r: self.get_range(key, r[0], r[1]), ranges))

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """See base class."""
        check_key(key)
        clip_range(start, end, end)  # validates the arguments
        if start == end:
            self.size(key)  # still raises StorageNotFoundError for a missing key
            return b""

        def read() -> bytes:
            from botocore.exceptions import ClientError

            try:
                response = self._client.get_object(
                    Bucket=self.bucket, Key=self._prefix + key, Range=f"bytes={start}-{end - 1}", **self._owner_kw
                )
            except ClientError as exc:
                if _s3_errors.error_code(exc)[0] == "InvalidRange":  # start is at or past the end
                    return b""
                raise
            return bytes(response["Body"].read())

        return self._call("read", key, read)

    def size(self, key: str) -> int:
        """See base class."""
        check_key(key)
        response = self._call(
            "stat", key, lambda: self._client.head_object(Bucket=self.bucket, Key=self._prefix + key, **self._owner_kw)
        )
        return int(response["ContentLength"])

    def list(self, prefix: str = "") -> list[str]:
        """See base class."""
        check_prefix(prefix)

        def collect() -> list[str]:
            keys = []
            paginator = self._client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._prefix + prefix, **self._owner_kw):
                for item in page.get("Contents", ()):
                    # A zero-length "prefix/" directory marker (some tools create them) is not a key.
                    if item["Key"] != self._prefix:
                        keys.append(item["Key"][len(self._prefix) :])
            return keys

        return sorted(self._call("list", prefix, collect))

    def exists(self, key: str) -> bool:
        """See base class."""
        try:
            self.size(key)
        except StorageNotFoundError:
            return False
        return True

    def delete(self, key: str) -> None:
        """See base class."""
        check_key(key)
        self._call(
            "delete",
            key,
            lambda: self._client.delete_object(Bucket=self.bucket, Key=self._prefix + key, **self._owner_kw),
        )


def _log_retry(action: str, where: str, state: Any, max_attempts: int) -> None:
    exc = state.outcome.exception() if state.outcome else None
    code, status = _s3_errors.error_code(exc) if exc else ("", 0)
    reason = f"{code} (HTTP {status})" if status else type(exc).__name__
    delay = state.next_action.sleep if state.next_action else 0.0
    logger.warning(
        "S3: could not %s %s (%s); attempt %d of %d, retrying in %.2f s",
        action,
        where,
        _s3_errors.scrub(reason),
        state.attempt_number,
        max_attempts,
        delay,
    )
