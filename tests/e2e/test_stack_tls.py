"""`kvmesh up --tls`: the whole path over mutual TLS with the tiny model (issue 15 point 1).

A client of the gateway with the stack's CA gets the engine's tokens (the CLI and the SDK);
without the CA it cannot connect; at every internal port a client without a certificate of the
stack is refused at the handshake, and a certificate of another CA is refused too.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvmesh.client import Client
from kvmesh.stack import CACHE_PORT, FIRST_WORKER_PORT, ROUTER_PORT, tls_folder
from kvmesh.tls import CA_CERT, StackAuthority, TlsFiles
from kvmesh.v1 import worker_pb2, worker_pb2_grpc
from tests.e2e.test_stack import MAX_TOKENS, PROMPT, RunningStack, expected_tokens, start_kvmesh_up

INTERNAL_PORTS = {
    "cache": CACHE_PORT,
    "router": ROUTER_PORT,
    "prefill-0": FIRST_WORKER_PORT,
    "decode-0": FIRST_WORKER_PORT + 1,
}


@pytest.fixture(scope="module")
def tls_stack(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningStack]:
    # Split workers, so the KV pull between them goes over TLS too.
    running = start_kvmesh_up(
        tiny_llama_dir, tmp_path_factory.mktemp("tls-stack"), "--tls", "--mode", "disaggregated"
    )
    yield running
    running.proc.send_signal(signal.SIGINT)
    running.proc.wait(timeout=90)
    running.kill()


def ca_file(stack: RunningStack) -> Path:
    return tls_folder(stack.state_dir) / CA_CERT


def test_a_client_with_the_ca_gets_the_engines_tokens(
    tls_stack: RunningStack, tiny_llama_dir: Path
) -> None:
    expected = expected_tokens(tiny_llama_dir, PROMPT)
    reply = tls_stack.cli(
        "generate",
        "--target",
        tls_stack.gateway,
        "--ca-file",
        str(ca_file(tls_stack)),
        "--max-tokens",
        str(MAX_TOKENS),
        "--temperature",
        "0",
        "--json",
        PROMPT,
    )
    assert reply.returncode == 0, reply.stderr

    async def sdk() -> list[int]:
        async with Client(tls_stack.gateway, ca_file=ca_file(tls_stack)) as client:
            result = await client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
        return list(result.token_ids)

    assert asyncio.run(sdk()) == expected
    # kvmesh status reaches the router with the operator's certificate.
    status = tls_stack.cli("status", "--target", tls_stack.gateway)
    assert status.returncode == 0, status.stderr
    assert "prefill" in status.stdout and "decode" in status.stdout


def test_a_client_without_the_ca_cannot_reach_the_gateway(tls_stack: RunningStack) -> None:
    async def plaintext() -> None:
        async with Client(tls_stack.gateway) as client:
            await client.generate(PROMPT, max_tokens=2, deadline_s=5)

    with pytest.raises(Exception) as raised:
        asyncio.run(plaintext())
    assert "UNAVAILABLE" in str(raised.value) or "unavailable" in str(raised.value).lower()


async def _stats(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    channel = (
        grpc.aio.insecure_channel(address)
        if credentials is None
        else grpc.aio.secure_channel(address, credentials)
    )
    async with channel:
        try:
            await worker_pb2_grpc.WorkerStub(channel).Stats(worker_pb2.StatsRequest(), timeout=5)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


@pytest.mark.parametrize("service", list(INTERNAL_PORTS))
def test_every_internal_port_refuses_a_client_without_a_stack_certificate(
    tls_stack: RunningStack, tmp_path: Path, service: str
) -> None:
    address = f"127.0.0.1:{INTERNAL_PORTS[service] + tls_stack.offset}"
    stack_ca = ca_file(tls_stack).read_bytes()
    # Another CA's certificate, for a role and name the stack's policy would let through.
    stranger = StackAuthority.open(tmp_path / "other-ca")
    files = stranger.issue("router", "router:router", ["127.0.0.1"])
    forged = TlsFiles(files.cert.read_bytes(), files.key.read_bytes(), stack_ca)
    for credentials in (
        None,  # plaintext
        grpc.ssl_channel_credentials(root_certificates=stack_ca),  # TLS, no certificate
        forged.channel_credentials(),
    ):
        assert asyncio.run(_stats(address, credentials)) == grpc.StatusCode.UNAVAILABLE
