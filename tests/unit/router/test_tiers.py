"""The pools file."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.router.tiers import TierConfigError, load_pools, parse_pools, usd_per_1k_tokens

DOC = """
tiers:
  - name: full
    usd_per_gpu_hour: 3.6
    tokens_per_second: 1000
    fallback: cheap
    prefill: [127.0.0.1:1, 127.0.0.1:2]
    decode: [127.0.0.1:3]
  - name: cheap
    quantization: int8
    colocated: [127.0.0.1:4]
auto: {cheap: cheap, full: full, max_prompt_tokens: 64, max_output_tokens: 32}
"""


def test_load_pools(tmp_path: Path) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(DOC)
    pools = load_pools(path)
    full, cheap = pools.tiers
    assert full.prefill == ("127.0.0.1:1", "127.0.0.1:2")
    assert full.decode == ("127.0.0.1:3",) and full.colocated == ()
    assert full.fallback == "cheap" and cheap.fallback == ""
    assert cheap.quantization == "int8" and cheap.base_model == "cheap"
    # 3.6 $/h over 1000 tok/s: 1e-6 $ per token.
    assert usd_per_1k_tokens(full.usd_per_gpu_hour, full.tokens_per_second) == pytest.approx(0.001)
    assert usd_per_1k_tokens(cheap.usd_per_gpu_hour, cheap.tokens_per_second) == 0.0
    assert pools.auto is not None and pools.auto.max_prompt_tokens == 64
    assert pools.tier("cheap") is cheap and pools.tier("nope") is None


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("{}", "'tiers' list"),
        ("tiers: []", "at least one tier"),
        ("tiers: [{prefill: []}]", "needs a name"),
        ("tiers: [{name: a}, {name: a}]", "unique"),
        ("tiers: [{name: a, fallback: b}]", "fallback 'b'"),
        ("tiers: [{name: a, decode: localhost}]", "list of host:port"),
        ("tiers: [{name: a, decode: [localhost]}]", "not host:port"),
        ("tiers: [{name: a}]\nauto: {cheap: a, full: b}", "auto.full"),
    ],
)
def test_malformed_pools_name_the_problem(doc: str, message: str, tmp_path: Path) -> None:
    import yaml

    with pytest.raises(TierConfigError, match=message):
        parse_pools(yaml.safe_load(doc))


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(TierConfigError, match="cannot read"):
        load_pools(tmp_path / "missing.yaml")
