"""The router's pools file: model tiers, their workers, prices, fallbacks and the "auto" rule.

```yaml
tiers:
  - name: smollm2-135m              # tier id callers ask for
    base_model: smollm2-135m        # what ListModels reports as the underlying model
    quantization: none
    usd_per_gpu_hour: 2.0           # price of the accelerator hour the tier runs on
    tokens_per_second: 400          # one worker's throughput until its workers measure theirs
    fallback: smollm2-135m-int8     # tier that takes the requests when this one is down
    prefill: [127.0.0.1:50061]
    decode: [127.0.0.1:50062]
    colocated: []
    placement: prefix-affinity     # or least-load, round-robin (services/router/policies)
  - name: smollm2-135m-int8
    ...
auto:                               # model "auto": easy requests go to the cheap tier
  cheap: smollm2-135m-int8
  full: smollm2-135m
  max_prompt_tokens: 256
  max_output_tokens: 128
```
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from services.router.policies import DEFAULT_POLICY, POLICIES


class TierConfigError(ValueError):
    """The pools file is malformed; the message names the offending entry."""


@dataclass(slots=True, frozen=True)
class TierSpec:
    """One model tier as configured."""

    name: str
    base_model: str
    quantization: str
    usd_per_gpu_hour: float
    tokens_per_second: float
    fallback: str
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    colocated: tuple[str, ...]
    placement: str = DEFAULT_POLICY
    """How the prompt's worker is picked: a name in services/router/policies.POLICIES."""


def usd_per_1k_tokens(usd_per_gpu_hour: float, tokens_per_second: float) -> float:
    """Price of 1,000 generated tokens on one worker running at `tokens_per_second`."""
    if tokens_per_second <= 0:
        return 0.0
    return usd_per_gpu_hour / 3600.0 / tokens_per_second * 1000.0


@dataclass(slots=True, frozen=True)
class AutoRule:
    """The conservative difficulty rule behind model "auto".

    A request goes to the cheap tier only when it is labelled easy, or when nothing marks it
    as hard and both its prompt and its requested output are short; anything else goes to the
    full tier.
    """

    cheap: str
    full: str
    max_prompt_tokens: int = 256
    max_output_tokens: int = 128


@dataclass(slots=True, frozen=True)
class PoolsConfig:
    """The whole pools file."""

    tiers: tuple[TierSpec, ...]
    auto: AutoRule | None

    def tier(self, name: str) -> TierSpec | None:
        """The tier called `name`, if configured."""
        return next((t for t in self.tiers if t.name == name), None)


def _addresses(entry: Mapping[str, Any], key: str, tier: str) -> tuple[str, ...]:
    value = entry.get(key) or []
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise TierConfigError(f"tier {tier!r}: {key} must be a list of host:port addresses")
    for address in value:
        if not isinstance(address, str) or ":" not in address:
            raise TierConfigError(f"tier {tier!r}: {key} entry {address!r} is not host:port")
    return tuple(value)


def _placement(entry: Mapping[str, Any], tier: str) -> str:
    policy = str(entry.get("placement", DEFAULT_POLICY))
    if policy not in POLICIES:
        raise TierConfigError(
            f"tier {tier!r}: placement {policy!r} is not one of {', '.join(POLICIES)}"
        )
    return policy


def _tier(entry: Any) -> TierSpec:
    if not isinstance(entry, Mapping) or not entry.get("name"):
        raise TierConfigError(f"each tier needs a name, got {entry!r}")
    name = str(entry["name"])
    return TierSpec(
        name=name,
        base_model=str(entry.get("base_model", name)),
        quantization=str(entry.get("quantization", "none")),
        usd_per_gpu_hour=float(entry.get("usd_per_gpu_hour", 0.0)),
        tokens_per_second=float(entry.get("tokens_per_second", 0.0)),
        fallback=str(entry.get("fallback", "") or ""),
        prefill=_addresses(entry, "prefill", name),
        decode=_addresses(entry, "decode", name),
        colocated=_addresses(entry, "colocated", name),
        placement=_placement(entry, name),
    )


def parse_pools(data: Any) -> PoolsConfig:
    """Validates the parsed YAML document and builds the config."""
    if not isinstance(data, Mapping) or not isinstance(data.get("tiers"), Sequence):
        raise TierConfigError("the pools file needs a 'tiers' list")
    tiers = tuple(_tier(entry) for entry in data["tiers"])
    if not tiers:
        raise TierConfigError("the pools file needs at least one tier")
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise TierConfigError(f"tier names must be unique, got {names}")
    for tier in tiers:
        if tier.fallback and tier.fallback not in names:
            raise TierConfigError(f"tier {tier.name!r}: fallback {tier.fallback!r} is not a tier")
    auto = None
    if data.get("auto") is not None:
        raw = data["auto"]
        if not isinstance(raw, Mapping):
            raise TierConfigError("'auto' must be a mapping")
        auto = AutoRule(
            cheap=str(raw.get("cheap", "")),
            full=str(raw.get("full", "")),
            max_prompt_tokens=int(raw.get("max_prompt_tokens", 256)),
            max_output_tokens=int(raw.get("max_output_tokens", 128)),
        )
        for role, tier_name in (("cheap", auto.cheap), ("full", auto.full)):
            if tier_name not in names:
                raise TierConfigError(f"auto.{role}: {tier_name!r} is not a tier")
    return PoolsConfig(tiers=tiers, auto=auto)


def load_pools(path: Path) -> PoolsConfig:
    """Reads and validates a pools YAML file."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as error:
        raise TierConfigError(f"cannot read pools file {path}: {error}") from error
    return parse_pools(data)
