"""Server reflection under both names that clients speak.

grpcio-reflection serves `grpc.reflection.v1alpha.ServerReflection` only; clients that speak
only the stable `grpc.reflection.v1.ServerReflection` (newer grpcurl, grpcui, Postman) then
find nothing. The two protocols are the same messages in another package, so one servicer
answers both names.
"""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
"""The stable reflection service name (same wire messages as v1alpha)."""


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> None:
    """Serves reflection for `service_names` (plus the reflection service) as v1alpha and v1."""
    servicer = reflection.aio.ReflectionServicer([*service_names, reflection.SERVICE_NAME])
    server.add_generic_rpc_handlers(
        tuple(
            grpc.method_handlers_generic_handler(
                name,
                {
                    "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(
                        servicer.ServerReflectionInfo,
                        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
                        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
                    )
                },
            )
            for name in (reflection.SERVICE_NAME, V1_SERVICE_NAME)
        )
    )
