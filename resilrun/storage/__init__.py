"""Persistent storage behind one small interface: S3 (or S3-compatible), a directory, or memory.

``create_storage`` is the one place a URI becomes a Storage; a URI it cannot use is a ConfigError
(exit code 2) with a hint, raised before any request is sent. The S3 implementation (and boto3) is
imported only for ``s3://`` URIs.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from resilrun.errors import ConfigError
from resilrun.storage.api import Storage
from resilrun.storage.local import LocalStorage
from resilrun.storage.memory import MemoryStorage

if TYPE_CHECKING:
    from resilrun.storage.s3 import S3Storage

__all__ = ["LocalStorage", "MemoryStorage", "Storage", "create_storage", "parse_s3_uri"]

# S3's bucket naming rules (3-63 characters, lower case, digits, dots, hyphens).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_URI_HINT = "use s3://bucket/prefix or a directory path"


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/prefix`` into ``(bucket, prefix)``; the prefix has no surrounding '/'.

    Raises:
        ConfigError: not an s3 URI, a bad bucket name, or a prefix with '.', '..' or empty segments.
    """
    if not uri.startswith("s3://"):
        raise ConfigError(f"'{uri}' is not an s3:// URI", hint=_URI_HINT)
    bucket, _, prefix = uri[len("s3://") :].partition("/")
    if not _BUCKET.match(bucket):
        raise ConfigError(f"'{bucket}' in '{uri}' is not a valid S3 bucket name", hint=_URI_HINT)
    prefix = prefix.strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ConfigError(f"the prefix '{prefix}' in '{uri}' has an empty, '.' or '..' segment", hint=_URI_HINT)
    return bucket, prefix


def _check_endpoint(endpoint_url: str) -> None:
    scheme, sep, rest = endpoint_url.partition("://")
    if not sep or scheme not in ("http", "https") or not rest:
        raise ConfigError(
            f"--s3-endpoint-url '{endpoint_url}' is not an http(s) URL", hint="for example http://127.0.0.1:9000"
        )
    if "@" in rest.split("/", 1)[0]:
        # Never echo the URL: it carries credentials.
        raise ConfigError(
            "--s3-endpoint-url must not contain credentials",
            hint="give credentials through the standard AWS chain (environment, AWS_PROFILE, ~/.aws)",
        )


def create_storage(uri: str, *, s3_endpoint_url: str | None = None, s3_expected_owner: str | None = None) -> Storage:
    """Open the storage a URI names; sends no request.

    Args:
        uri: ``s3://bucket/prefix``, a directory path or ``file:///abs/path``. (A MemoryStorage is
            built directly: one made from a URI would be empty and private to its caller.)
        s3_endpoint_url: an S3-compatible endpoint (MinIO, Ceph, moto) instead of AWS.
        s3_expected_owner: the account id that must own the bucket; refused otherwise.

    Raises:
        ConfigError: the URI or an option is unusable (exit code 2).
    """
    if not isinstance(uri, str) or not uri.strip():
        raise ConfigError("the checkpoint URI is empty", hint=_URI_HINT)
    if uri.startswith("s3://"):
        bucket, prefix = parse_s3_uri(uri)
        if s3_endpoint_url is not None:
            _check_endpoint(s3_endpoint_url)
        if s3_expected_owner is not None and not s3_expected_owner.strip():
            raise ConfigError("--s3-expected-owner is empty", hint="give the 12-digit account id that owns the bucket")
        return _create_s3(bucket, prefix, s3_endpoint_url, s3_expected_owner)
    if s3_endpoint_url is not None or s3_expected_owner is not None:
        raise ConfigError(
            f"--s3-endpoint-url and --s3-expected-owner apply only to s3:// URIs, not '{uri}'", hint=_URI_HINT
        )
    if uri.startswith("file://"):
        path = uri[len("file://") :]
        if not path.startswith("/"):
            raise ConfigError(f"'{uri}' is not a file:///absolute/path URI", hint=_URI_HINT)
        return LocalStorage(path)
    if "://" in uri:
        raise ConfigError(f"'{uri.split('://', 1)[0]}://' URIs are not supported", hint=_URI_HINT)
    return LocalStorage(uri)


def _create_s3(bucket: str, prefix: str, endpoint_url: str | None, expected_owner: str | None) -> S3Storage:
    from resilrun.storage.s3 import S3Storage

    return S3Storage(bucket, prefix, endpoint_url=endpoint_url, expected_owner=expected_owner)
