"""Price per 1K tokens from $/GPU-hour and tokens/s; cached tokens priced near zero."""

from __future__ import annotations

import pytest

from services.admission.pricing import (
    PriceTable,
    TierPrice,
    TokenCounts,
    parse_price_overrides,
    request_cost,
)


def test_price_per_1k_tokens() -> None:
    # $3.60 an hour at 100 tokens/s: 360,000 tokens an hour, so $0.01 per 1K tokens.
    assert TierPrice(3.6, 100.0).usd_per_1k_tokens == pytest.approx(0.01)


def test_generated_tokens_cost_the_full_rate_and_prompt_tokens_less() -> None:
    price = TierPrice(3.6, 100.0)
    generated = request_cost(price, TokenCounts(0, 0, 1000))
    prompt = request_cost(price, TokenCounts(1000, 0, 0))
    cached = request_cost(price, TokenCounts(1000, 1000, 0))
    assert generated == pytest.approx(0.01)
    assert cached < prompt < generated
    assert cached <= generated / 50  # near zero


def test_a_response_cache_hit_costs_next_to_nothing() -> None:
    price = TierPrice(3.6, 100.0)
    computed = request_cost(price, TokenCounts(100, 0, 200))
    hit = request_cost(price, TokenCounts(100, 0, 0, response_cache_hit=True, delivered_tokens=200))
    assert 0 < hit < computed / 100


def test_table_prefers_overrides_then_reported_then_defaults() -> None:
    table = PriceTable(
        {"big": TierPrice(8.0, 20.0)}, default_usd_per_gpu_hour=2.0, default_tokens_per_second=50.0
    )
    assert table.price("big", 1.0, 999.0) == TierPrice(8.0, 20.0)
    assert table.price("small", 1.0, 10.0) == TierPrice(1.0, 10.0)
    assert table.price("small") == TierPrice(2.0, 50.0)
    assert table.price("small", 0.0, 25.0) == TierPrice(2.0, 25.0)


def test_parse_overrides() -> None:
    assert parse_price_overrides(["a=2.5:100", "b=0:1"]) == {
        "a": TierPrice(2.5, 100.0),
        "b": TierPrice(0.0, 1.0),
    }
    for bad in ["a=2.5", "a=x:1", "=1:1", "a=1:0"]:
        with pytest.raises(ValueError):
            parse_price_overrides([bad])
