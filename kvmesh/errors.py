"""kvmesh's exceptions: one class per outcome a caller must tell apart.

The logic below the servicers raises these and never imports gRPC; `kvmesh.rpc_status`
maps them to gRPC status codes (with RetryInfo, BadRequest and QuotaFailure details)
once, in the error interceptor, and back again in the client SDK.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


@dataclass(slots=True, frozen=True)
class QuotaViolation:
    """One exceeded limit, reported to the caller as a QuotaFailure detail."""

    subject: str
    """Who is limited, e.g. "tenant:acme"."""
    description: str
    """Which limit and by how much, e.g. "tokens per minute: 1200 of 1000"."""


class KvmeshError(Exception):
    """Base of every error kvmesh reports to a caller.

    `status` names the gRPC status code (as in `grpc.StatusCode`) the error maps to.
    """

    status: ClassVar[str] = "INTERNAL"

    def __init__(
        self,
        message: str,
        *,
        retry_after_s: float | None = None,
        field: str | None = None,
        quota_violations: tuple[QuotaViolation, ...] = (),
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s
        self.field = field
        self.quota_violations = quota_violations

    def __str__(self) -> str:
        return self.message


class InvalidArgument(KvmeshError):
    """The request is malformed; `field` names the offending field."""

    status = "INVALID_ARGUMENT"

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}", field=field)


class Unauthenticated(KvmeshError):
    """No credentials, or credentials that match no tenant."""

    status = "UNAUTHENTICATED"


class PermissionDenied(KvmeshError):
    """The tenant is known but may not do this (model, priority, other tenant's usage)."""

    status = "PERMISSION_DENIED"


class ResourceExhausted(KvmeshError):
    """Over budget, queue full or overloaded; `retry_after_s` says when to come back."""

    status = "RESOURCE_EXHAUSTED"


class DeadlineExceeded(KvmeshError):
    """The caller's deadline passed before any output could be returned."""

    status = "DEADLINE_EXCEEDED"


class Unavailable(KvmeshError):
    """A dependency (worker, router) is down or broke mid-stream."""

    status = "UNAVAILABLE"


class NotFound(KvmeshError):
    """The named thing (lease, model, tenant) does not exist or has expired."""

    status = "NOT_FOUND"


class AlreadyExists(KvmeshError):
    """Something the request would create exists already (a request id in use)."""

    status = "ALREADY_EXISTS"


class FailedPrecondition(KvmeshError):
    """The request is valid but the system is not in a state to run it (layout mismatch)."""

    status = "FAILED_PRECONDITION"


class DataLoss(KvmeshError):
    """Data arrived corrupted (KV chunk checksum mismatch)."""

    status = "DATA_LOSS"


class Cancelled(KvmeshError):
    """The caller cancelled."""

    status = "CANCELLED"


class Unimplemented(KvmeshError):
    """The method exists in the contract but this server does not provide it."""

    status = "UNIMPLEMENTED"


class Internal(KvmeshError):
    """A bug: an invariant broke. The message is safe to show."""

    status = "INTERNAL"


ERRORS_BY_STATUS: dict[str, type[KvmeshError]] = {
    cls.status: cls
    for cls in (
        Unauthenticated,
        PermissionDenied,
        ResourceExhausted,
        DeadlineExceeded,
        Unavailable,
        NotFound,
        AlreadyExists,
        FailedPrecondition,
        DataLoss,
        Cancelled,
        Unimplemented,
        Internal,
    )
}
"""Status name -> error class, for turning a received status back into an exception.

InvalidArgument is rebuilt separately because its constructor takes the field name."""
