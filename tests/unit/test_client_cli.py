"""The SDK's request building and the CLI's offline commands (tenants add)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvmesh.cli import describe_error, main
from kvmesh.client import build_request
from kvmesh.errors import ResourceExhausted
from kvmesh.v1 import common_pb2
from services.admission.tenants import PriorityClass, TenantRegistry, load_tenants


def test_build_request_maps_every_option() -> None:
    request = build_request(
        "hello",
        model="tiny",
        max_tokens=7,
        temperature=0.5,
        top_p=0.9,
        top_k=40,
        seed=3,
        stop=["\n"],
        ignore_eos=True,
        priority="batch",
        cache_policy="refresh",
        idempotency_key="k",
        labels={"difficulty": "easy"},
    )
    assert request.prompt.text == "hello" and request.model == "tiny"
    sampling = request.sampling
    assert (sampling.max_tokens, sampling.top_k, sampling.seed) == (7, 40, 3)
    assert sampling.temperature == pytest.approx(0.5) and sampling.ignore_eos
    assert list(sampling.stop) == ["\n"]
    assert request.priority == common_pb2.PRIORITY_BATCH
    assert request.cache_policy == common_pb2.CACHE_POLICY_REFRESH
    assert request.idempotency_key == "k" and dict(request.labels) == {"difficulty": "easy"}


def test_unset_sampling_fields_stay_unset() -> None:
    sampling = build_request("x").sampling
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        assert not sampling.HasField(name)


def test_prompt_kinds() -> None:
    assert list(build_request([1, 2, 3]).prompt.token_ids.ids) == [1, 2, 3]
    chat = build_request([{"role": "user", "content": "hi"}]).prompt.chat
    assert chat.add_generation_prompt and chat.messages[0].role == "user"
    with pytest.raises(TypeError):
        build_request([1.5])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="priority"):
        build_request("x", priority="urgent")
    with pytest.raises(ValueError, match="cache_policy"):
        build_request("x", cache_policy="sometimes")


def test_errors_are_described_with_their_status_and_retry() -> None:
    error = ResourceExhausted("over budget", retry_after_s=12.0)
    assert describe_error(error) == "RESOURCE_EXHAUSTED: over budget (retry after 12.0s)"


def test_tenants_add_prints_the_key_once_and_stores_its_hash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "tenants.yaml"
    args = ["tenants", "add", "acme", "--file", str(path), "--tokens-per-minute", "900",
            "--models", "tiny,auto", "--highest-priority", "batch", "--shared-cache"]  # fmt: skip
    assert main(args) == 0
    key = capsys.readouterr().out.strip()
    assert key.startswith("kvm_") and key not in path.read_text()
    (tenant,) = load_tenants(path)
    assert tenant.tokens_per_minute == 900 and tenant.models == ("tiny", "auto")
    assert tenant.highest_priority is PriorityClass.BATCH and tenant.shared_cache
    assert TenantRegistry.from_file(path).by_key(key) == tenant
    assert main(args) == 2  # the name exists
    assert "exists" in capsys.readouterr().err
