"""`python -m kvmesh.healthcheck HOST:PORT`: exit 0 when the service there is SERVING.

A container health check (docker-compose runs it inside each kvmesh container) and a quick
probe by hand. It asks the standard gRPC health service, so it works for every kvmesh server,
and it prints why it failed, which `docker inspect` shows as the health log.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

Status = health_pb2.HealthCheckResponse.ServingStatus


def check(address: str, service: str = "", timeout_s: float = 3.0) -> int:
    """The health status reported for `service` at `address` (a `Status` value).

    Raises grpc.RpcError when the server cannot be reached or does not know `service`.
    """
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    return int(reply.status)


def main(argv: Sequence[str] | None = None) -> int:
    """Checks once; 0 when SERVING, 1 otherwise (with the reason on stderr)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("address", help="HOST:PORT of the gRPC server")
    parser.add_argument(
        "--service", default="", help='health service name; "" (default) is the whole server'
    )
    parser.add_argument("--timeout-s", type=float, default=3.0, help="deadline of the call")
    args = parser.parse_args(argv)
    try:
        status = check(args.address, args.service, args.timeout_s)
    except grpc.RpcError as error:
        print(f"{args.address}: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    if status != Status.SERVING:
        print(f"{args.address}: {Status.Name(status)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
