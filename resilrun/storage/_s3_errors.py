"""The one edge where botocore errors become StorageErrors, and the rule for which ones are retried.

Invariants: a message built here names the operation, the object and the S3 error code, and passes
every server-supplied text through ``scrub`` first, so an access key id, a signature or a secret
never reaches a log line or the terminal. botocore is imported inside the functions, so importing
resilrun.storage never imports boto3.
"""

from __future__ import annotations

import re
from typing import Any

from resilrun.errors import StorageAuthError, StorageError, StorageNotFoundError

# S3 error codes that mean "slow down and try again" (S3 sends SlowDown with 503; other
# S3-compatible stores use the generic AWS throttling codes with 400 or 429).
THROTTLE_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "RequestLimitExceeded",
        "ProvisionedThroughputExceededException",
        "BandwidthLimitExceeded",
        "RequestTimeout",
        "RequestTimeoutException",
        "PriorRequestNotComplete",
        "InternalError",
        "ServiceUnavailable",
    }
)
AUTH_CODES = frozenset(
    {
        "AccessDenied",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidAccessKeyId",
        "InvalidToken",
        "ExpiredToken",
        "TokenRefreshRequired",
        "SignatureDoesNotMatch",
        "InvalidSecurity",
        "Forbidden",
    }
)
NOT_FOUND_CODES = frozenset({"NoSuchKey", "NotFound", "404"})
AUTH_HINT = (
    "check the AWS credentials (environment, AWS_PROFILE, ~/.aws or an instance role), the bucket "
    "policy, and --s3-expected-owner"
)

_SECRET_PATTERNS = (
    # Access key ids (long-term AKIA, temporary ASIA, and the other IAM unique-id prefixes).
    re.compile(r"\b(?:AKIA|ASIA|AIDA|AROA|AGPA|ANPA|ANVA|AIPA|ABIA|ACCA)[A-Z0-9]{12,}\b"),
    # SigV4 fragments that servers echo back in some error bodies.
    re.compile(r"(?i)(Credential|Signature|X-Amz-Security-Token|X-Amz-Credential|X-Amz-Signature)=[^\s,&\"']+"),
    # Anything that looks like a secret key or session token (40+ base64 characters).
    re.compile(r"[A-Za-z0-9/+=]{40,}"),
)


def scrub(text: str) -> str:
    """Redact anything credential-like from ``text`` (server messages, exception strings)."""
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub("<redacted>", text)
    return text


def error_code(exc: BaseException) -> tuple[str, int]:
    """Return ``(S3 error code, HTTP status)`` of a botocore ``ClientError``, else ``("", 0)``."""
    response: Any = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return "", 0
    code = str(response.get("Error", {}).get("Code", ""))
    status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
    return code, status


def is_retryable(exc: BaseException) -> bool:
    """Whether ``exc`` is transient: a 5xx, throttling, a dropped connection or a timeout.

    Client errors (4xx other than throttling), auth failures and bad parameters are permanent:
    retrying them only delays the one-line error the user needs.
    """
    from botocore import exceptions as bce

    if isinstance(exc, bce.ClientError):
        code, status = error_code(exc)
        return status >= 500 or status == 429 or code in THROTTLE_CODES
    if isinstance(exc, bce.SSLError):  # a certificate problem does not heal by itself
        return False
    return isinstance(exc, bce.ConnectionError | bce.HTTPClientError | bce.IncompleteReadError)


def translate(exc: BaseException, action: str, where: str, *, attempts: int = 1) -> StorageError:
    """Turn ``exc`` from botocore into the StorageError a caller (and the CLI) understands.

    Args:
        exc: what botocore (or tenacity's last attempt) raised.
        action: a verb phrase for the message ("read", "write", "list").
        where: the ``s3://bucket/key`` concerned; never contains credentials.
        attempts: how many attempts were made, mentioned when more than one.
    """
    from botocore import exceptions as bce

    tries = f" after {attempts} attempts" if attempts > 1 else ""
    if isinstance(exc, bce.ClientError):
        code, status = error_code(exc)
        detail = scrub(str(exc.response.get("Error", {}).get("Message", "") or ""))
        reason = f"{code or 'HTTP ' + str(status)} (HTTP {status})" + (f": {detail}" if detail else "")
        message = f"could not {action} {where}{tries}: {reason}"
        if code in NOT_FOUND_CODES or (status == 404 and code != "NoSuchBucket"):
            return StorageNotFoundError(message)
        if code in AUTH_CODES or status == 403:
            return StorageAuthError(message, hint=AUTH_HINT)
        if code == "NoSuchBucket":
            return StorageError(message, hint="check the bucket name in the s3:// URI (and --s3-endpoint-url)")
        if is_retryable(exc):
            return StorageError(message, hint="the storage service is failing or throttling; try again later")
        return StorageError(message)
    if isinstance(exc, bce.NoCredentialsError | bce.PartialCredentialsError | bce.CredentialRetrievalError):
        return StorageAuthError(f"could not {action} {where}: no usable AWS credentials were found", hint=AUTH_HINT)
    if isinstance(exc, bce.ConnectionError | bce.HTTPClientError | bce.IncompleteReadError):
        reason = scrub(type(exc).__name__)
        return StorageError(
            f"could not {action} {where}{tries}: the S3 endpoint could not be reached or timed out ({reason})",
            hint="check --s3-endpoint-url, the network, and that the service is up",
        )
    if isinstance(exc, bce.BotoCoreError):
        return StorageError(f"could not {action} {where}: {scrub(str(exc))}")
    return StorageError(f"could not {action} {where}: {type(exc).__name__}: {scrub(str(exc))}")
