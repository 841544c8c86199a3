"""`python -m kvmesh.healthcheck HOST:PORT`: exit 0 when the service there is SERVING.

A container health check (docker-compose runs it inside each kvmesh container) and a quick
probe by hand. It asks the standard gRPC health service, so it works for every kvmesh gRPC
server; with `--http` it asks GET /health of an HTTP service instead (the OpenAI door). It
prints why it failed, which `docker inspect` shows as the health log.

Over TLS it verifies the server with the stack's CA and shows a certificate of the stack, since
the internal services take no connection without one (the health service itself answers any
member): --tls-cert-file/--tls-key-file/--tls-ca-file, or KVMESH_HEALTHCHECK_TLS_CERT_FILE,
..._KEY_FILE, ..._CA_FILE in the environment (deploy/compose.tls.yaml sets them).
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.tls import TlsFiles, client_credentials

Status = health_pb2.HealthCheckResponse.ServingStatus
TLS_ENV_PREFIX = "KVMESH_HEALTHCHECK_"


def probe_channel(
    address: str, tls: TlsFiles | None = None, ca_file: Path | None = None
) -> grpc.Channel:
    """A channel to `address`: mutual TLS with `tls`, server-verified TLS with only `ca_file`,
    else plaintext."""
    if tls is not None:
        return grpc.secure_channel(address, tls.channel_credentials())
    if ca_file is not None:
        return grpc.secure_channel(address, client_credentials(ca_file))
    return grpc.insecure_channel(address)


def check(
    address: str,
    service: str = "",
    timeout_s: float = 3.0,
    tls: TlsFiles | None = None,
    ca_file: Path | None = None,
) -> int:
    """The health status reported for `service` at `address` (a `Status` value).

    Raises grpc.RpcError when the server cannot be reached or does not know `service`.
    """
    with probe_channel(address, tls, ca_file) as channel:
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


def tls_option(
    parser: argparse.ArgumentParser, name: str, help_text: str, environ: Mapping[str, str]
) -> None:
    """A --tls-NAME-file flag whose default is KVMESH_HEALTHCHECK_TLS_NAME_FILE."""
    variable = f"{TLS_ENV_PREFIX}TLS_{name.upper()}_FILE"
    default = environ.get(variable)
    parser.add_argument(
        f"--tls-{name}-file",
        type=Path,
        default=Path(default) if default else None,
        help=f"{help_text} (env {variable})",
    )


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    """Checks once; 0 when SERVING, 1 otherwise (with the reason on stderr)."""
    environ = os.environ if environ is None else environ
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("address", help="HOST:PORT of the gRPC server")
    parser.add_argument(
        "--service", default="", help='health service name; "" (default) is the whole server'
    )
    parser.add_argument("--timeout-s", type=float, default=3.0, help="deadline of the call")
    parser.add_argument(
        "--http", action="store_true", help="an HTTP service: GET /health must answer 200"
    )
    tls_option(parser, "cert", "certificate to show the server (PEM)", environ)
    tls_option(parser, "key", "its private key (PEM)", environ)
    tls_option(parser, "ca", "CA that signed the server's certificate (PEM)", environ)
    args = parser.parse_args(argv)
    if args.http:
        problem = check_http(args.address, args.timeout_s)
        if problem:
            print(f"{args.address}: {problem}", file=sys.stderr)
        return 1 if problem else 0
    try:
        own_certificate = args.tls_cert_file is not None or args.tls_key_file is not None
        tls = TlsFiles.load(args.tls_cert_file, args.tls_key_file, args.tls_ca_file)
        tls = tls if own_certificate else None
    except (OSError, ValueError) as error:
        print(f"{args.address}: TLS files: {error}", file=sys.stderr)
        return 1
    try:
        status = check(args.address, args.service, args.timeout_s, tls, args.tls_ca_file)
    except grpc.RpcError as error:
        print(f"{args.address}: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    if status != Status.SERVING:
        print(f"{args.address}: {Status.Name(status)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
