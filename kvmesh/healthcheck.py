"""`python -m kvmesh.healthcheck HOST:PORT`: exit 0 when the service there is SERVING.

A container health check (docker-compose runs it inside each kvmesh container) and a quick
probe by hand. It asks the standard gRPC health service, so it works for every kvmesh gRPC
server; with `--http` it asks GET /health of an HTTP service instead (the OpenAI door). It
prints why it failed, which `docker inspect` shows as the health log.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
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


def check_http(address: str, timeout_s: float = 3.0) -> str:
    """Empty when GET http://ADDRESS/health answers 200, else why not."""
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout_s) as reply:
            return "" if reply.status == 200 else f"HTTP {reply.status}"
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}: {error.read().decode(errors='replace')}"
    except OSError as error:
        return str(error)


def main(argv: Sequence[str] | None = None) -> int:
    """Checks once; 0 when SERVING, 1 otherwise (with the reason on stderr)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("address", help="HOST:PORT of the gRPC server")
    parser.add_argument(
        "--service", default="", help='health service name; "" (default) is the whole server'
    )
    parser.add_argument("--timeout-s", type=float, default=3.0, help="deadline of the call")
    parser.add_argument(
        "--http", action="store_true", help="an HTTP service: GET /health must answer 200"
    )
    args = parser.parse_args(argv)
    if args.http:
        problem = check_http(args.address, args.timeout_s)
        if problem:
            print(f"{args.address}: {problem}", file=sys.stderr)
        return 1 if problem else 0
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
