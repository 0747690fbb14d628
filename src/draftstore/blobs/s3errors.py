"""What an S3 failure means for the store: obstore's errors mapped to the draftstore family.

No I/O here. obstore (Rust ``object_store``) raises ``FileNotFoundError`` for a
404, ``PermissionDeniedError`` / ``UnauthenticatedError`` for 403 / 401 and
``GenericError`` for the rest; the S3 error code and HTTP status are only in
the message (the XML body S3 answered with), so both are read from there.

The mapping, in order:

- ``NoSuchBucket`` (whatever the status): ``BackendUnavailable`` naming the bucket;
- a rejected identity (401, 403, ``AccessDenied``, ``SignatureDoesNotMatch``,
  ``InvalidAccessKeyId``, expired tokens): ``BackendUnavailable``;
- ``InvalidBucketName``: ``ConfigInvalid``;
- 5xx, 429 or a throttling code, a refused or dropped connection, a timeout
  (obstore has already retried these ``max_attempts`` times):
  ``BackendUnavailable``;
- anything else: ``BackendError``.

A missing object is not an error: the store turns ``FileNotFoundError`` with
any code but ``NoSuchBucket`` into "absent" itself (``is_missing_object``).
"""

from __future__ import annotations

import re

from obstore.exceptions import PermissionDeniedError, UnauthenticatedError

from ..errors import BackendError, BackendUnavailable, ConfigInvalid, DraftstoreError

__all__ = ["S3Failure", "is_missing_object", "is_past_the_end", "map_s3_error", "s3_code"]

_CODE = re.compile(r"<Code>([^<]{1,100})</Code>")
_STATUS = re.compile(r"status code: (\d{3})")

NO_BUCKET = "NoSuchBucket"
AUTH_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken",
              "AuthorizationHeaderMalformed", "401", "403"}
TRANSIENT_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout", "RequestTimeoutException",
                   "Throttling", "ThrottlingException", "ThrottledException", "RequestThrottled",
                   "RequestThrottledException", "RequestLimitExceeded", "TooManyRequestsException",
                   "PriorRequestNotComplete", "BandwidthLimitExceeded", "EC2ThrottledException"}


class S3Failure:
    """The S3 error code and HTTP status read from one obstore exception ("" / 0 when absent)."""

    __slots__ = ("code", "status", "summary")

    def __init__(self, exc: BaseException) -> None:
        text = str(exc)
        code = _CODE.search(text[:8192])
        status = _STATUS.search(text[:8192])
        self.status = int(status.group(1)) if status else 0
        self.code = code.group(1) if code else (str(self.status) if self.status else "")
        # the first line names the request and its outcome; the rest is the XML body and a Rust debug dump
        self.summary = text.split("\n", 1)[0][:300]


def s3_code(exc: BaseException) -> str:
    """The S3 error code of ``exc`` (``NoSuchKey``...), else its HTTP status, else ""."""
    return S3Failure(exc).code


def is_missing_object(exc: BaseException) -> bool:
    """True if ``exc`` says the object is absent (a 404 that is not a missing bucket)."""
    return isinstance(exc, FileNotFoundError) and S3Failure(exc).code != NO_BUCKET


def is_past_the_end(exc: BaseException) -> bool:
    """True if ``exc`` is S3's answer to a byte range that starts past the object's end."""
    failure = S3Failure(exc)
    return failure.status == 416 or failure.code == "InvalidRange"


def map_s3_error(exc: BaseException, *, bucket: str, operation: str, where: str, endpoint: str,
                 attempts: int) -> DraftstoreError:
    """The draftstore error for an obstore failure of ``operation`` on ``where`` (module docstring);
    the caller raises it ``from exc``. Never carries a credential: S3 signs in headers, and
    obstore's messages name the URL and the answer only."""
    failure = S3Failure(exc)
    details = {"bucket": bucket, "operation": operation, "s3_code": failure.code}
    if failure.code == NO_BUCKET:
        return BackendUnavailable(f"S3 bucket {bucket!r} does not exist ({operation})", **details)
    if isinstance(exc, (PermissionDeniedError, UnauthenticatedError)) or failure.code in AUTH_CODES:
        return BackendUnavailable(f"S3 rejected the credentials for bucket {bucket!r} "
                                  f"({operation}: {failure.code or 'denied'})", **details)
    if failure.code == "InvalidBucketName":
        return ConfigInvalid(f"invalid S3 bucket name {bucket!r}", **details)
    if failure.status >= 500 or failure.status == 429 or failure.code in TRANSIENT_CODES:
        return BackendUnavailable(f"S3 unavailable during {operation} on {where} after {attempts} attempt(s): "
                                  f"{failure.code}", **details)
    if not failure.status and not isinstance(exc, ValueError):  # no answer at all: refused, reset, timed out
        return BackendUnavailable(f"S3 endpoint {endpoint} unavailable during {operation} of {where} "
                                  f"after {attempts} attempt(s): {failure.summary}", **details)
    return BackendError(f"S3 error during {operation} on {where}: {failure.code}", **details)
