"""The one mapping between kvmesh's exceptions and gRPC statuses, in both directions.

Servers abort with `abort_with_error` (through the error interceptor in grpc_server);
the client SDK turns a received `grpc.aio.AioRpcError` back into a typed exception with
`error_from_rpc`.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from kvmesh.errors import ERRORS_BY_STATUS, InvalidArgument, KvmeshError, QuotaViolation


def to_status_proto(error: KvmeshError) -> status_pb2.Status:
    """A google.rpc.Status with the error's code, message and structured details."""
    status = status_pb2.Status(code=code_pb2.Code.Value(error.status), message=error.message)
    if error.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(int(error.retry_after_s * 1e9))
        _pack(status, error_details_pb2.RetryInfo(retry_delay=delay))
    if error.field is not None:
        violation = error_details_pb2.BadRequest.FieldViolation(
            field=error.field, description=error.message
        )
        _pack(status, error_details_pb2.BadRequest(field_violations=[violation]))
    if error.quota_violations:
        _pack(
            status,
            error_details_pb2.QuotaFailure(
                violations=[
                    error_details_pb2.QuotaFailure.Violation(
                        subject=v.subject, description=v.description
                    )
                    for v in error.quota_violations
                ]
            ),
        )
    return status


def _pack(status: status_pb2.Status, detail: object) -> None:
    packed = any_pb2.Any()
    packed.Pack(detail)  # type: ignore[arg-type]
    status.details.append(packed)


async def abort_with_error(context: grpc.aio.ServicerContext, error: KvmeshError) -> None:
    """Ends the RPC with the error's status and details (raises, as context.abort does)."""
    await context.abort_with_status(rpc_status.to_status(to_status_proto(error)))


def error_from_rpc(error: grpc.aio.AioRpcError | grpc.RpcError) -> KvmeshError:
    """The typed kvmesh exception for a failed call, with retry-after and field restored."""
    code: grpc.StatusCode = error.code()  # type: ignore[attr-defined]
    message: str = error.details() or code.name  # type: ignore[attr-defined]
    status = rpc_status.from_call(error)  # type: ignore[arg-type]
    return _typed(code.name, message, status.details if status is not None else ())


def error_from_status(status: status_pb2.Status) -> KvmeshError:
    """The typed kvmesh exception a google.rpc.Status stands for (to_status_proto's inverse):
    an error carried inside a message rather than as a call's status."""
    name = code_pb2.Code.Name(status.code)
    return _typed(name, status.message or name, status.details)


def _typed(code: str, message: str, details: Iterable[any_pb2.Any]) -> KvmeshError:
    retry_after_s: float | None = None
    field: str | None = None
    quotas: list[QuotaViolation] = []
    for detail in details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            retry_after_s = info.retry_delay.ToNanoseconds() / 1e9
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            field = bad.field_violations[0].field if bad.field_violations else None
        elif detail.Is(error_details_pb2.QuotaFailure.DESCRIPTOR):
            failure = error_details_pb2.QuotaFailure()
            detail.Unpack(failure)
            quotas.extend(QuotaViolation(v.subject, v.description) for v in failure.violations)
    if code == "INVALID_ARGUMENT":
        prefix = f"{field}: " if field else ""
        return InvalidArgument(field or "request", message.removeprefix(prefix))
    cls = ERRORS_BY_STATUS.get(code, KvmeshError)
    result = cls(message, retry_after_s=retry_after_s, quota_violations=tuple(quotas))
    result.status = code  # type: ignore[misc]
    return result
