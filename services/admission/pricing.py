"""What a request costs, from what its tier's accelerator costs and how fast the tier runs.

A tier's price of 1,000 generated tokens is the accelerator's dollars per hour divided by
the tokens one worker generates in an hour. Other tokens are priced by what they cost to
produce relative to a generated token:
- a prompt token is computed in a batched prefill forward, many tokens per step, at roughly
  a tenth of the cost of a decode step's token;
- a prompt token found in the prefix cache is not computed at all: it only holds memory;
- a response-cache hit is a key lookup and a copy, no model step at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

PROMPT_TOKEN_FRACTION = 0.1
"""Cost of a computed prompt token relative to a generated one (batched prefill)."""
CACHED_PROMPT_TOKEN_FRACTION = 0.01
"""Cost of a prompt token served from the prefix cache (memory held, nothing computed)."""
RESPONSE_CACHE_TOKEN_FRACTION = 0.001
"""Cost of a token delivered from the response cache (a lookup and a copy)."""


@dataclass(slots=True, frozen=True)
class TierPrice:
    """The economics of one tier."""

    usd_per_gpu_hour: float
    tokens_per_second: float
    """Generation throughput of one worker of the tier, measured."""

    def __post_init__(self) -> None:
        if self.usd_per_gpu_hour < 0 or self.tokens_per_second <= 0:
            raise ValueError("usd_per_gpu_hour must be >= 0 and tokens_per_second > 0")

    @property
    def usd_per_1k_tokens(self) -> float:
        return self.usd_per_gpu_hour / (self.tokens_per_second * 3600.0) * 1000.0


@dataclass(slots=True, frozen=True)
class TokenCounts:
    """The tokens of one request, as the Finished event reports them."""

    prompt_tokens: int
    cached_prompt_tokens: int
    completion_tokens: int
    response_cache_hit: bool = False
    delivered_tokens: int = 0
    """Tokens sent to the client from the response cache (hits only)."""


def request_cost(price: TierPrice, tokens: TokenCounts) -> float:
    """Dollars one request cost on a tier."""
    per_token = price.usd_per_1k_tokens / 1000.0
    if tokens.response_cache_hit:
        delivered = tokens.prompt_tokens + tokens.delivered_tokens
        return per_token * RESPONSE_CACHE_TOKEN_FRACTION * delivered
    cached = min(tokens.cached_prompt_tokens, tokens.prompt_tokens)
    computed_prompt = tokens.prompt_tokens - cached
    return per_token * (
        tokens.completion_tokens
        + PROMPT_TOKEN_FRACTION * computed_prompt
        + CACHED_PROMPT_TOKEN_FRACTION * cached
    )


class PriceTable:
    """Prices per tier: configured overrides first, then what the router reports, then defaults."""

    def __init__(
        self,
        overrides: Mapping[str, TierPrice],
        *,
        default_usd_per_gpu_hour: float,
        default_tokens_per_second: float,
    ) -> None:
        self._overrides = dict(overrides)
        self._default = TierPrice(default_usd_per_gpu_hour, default_tokens_per_second)

    def price(
        self,
        tier: str,
        reported_usd_per_gpu_hour: float = 0.0,
        reported_tokens_per_second: float = 0.0,
    ) -> TierPrice:
        """The price of `tier`; reported values of 0 mean "not known yet"."""
        if tier in self._overrides:
            return self._overrides[tier]
        return TierPrice(
            reported_usd_per_gpu_hour or self._default.usd_per_gpu_hour,
            reported_tokens_per_second or self._default.tokens_per_second,
        )


def parse_price_overrides(entries: Sequence[str]) -> dict[str, TierPrice]:
    """`("tier=USD_PER_GPU_HOUR:TOKENS_PER_SECOND", ...)` -> {tier: TierPrice}."""
    overrides: dict[str, TierPrice] = {}
    for entry in entries:
        tier, _, numbers = entry.partition("=")
        usd, _, tps = numbers.partition(":")
        try:
            overrides[tier.strip()] = TierPrice(float(usd), float(tps))
        except ValueError as error:
            raise ValueError(
                f"price: expected TIER=USD_PER_GPU_HOUR:TOKENS_PER_SECOND, got {entry!r} ({error})"
            ) from None
        if not tier.strip():
            raise ValueError(f"price: missing tier name in {entry!r}")
    return overrides
