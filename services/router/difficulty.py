"""Model "auto": a conservative rule that sends only clearly easy requests to the cheap tier.

Routing down saves money but may change the answer, so the rule errs towards the full tier:
an explicit "difficulty" label wins; without one, a request is easy only when its prompt and
its requested output are both short (an unset max_tokens counts as the engine default, 256).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvmesh.contracts.sampling import DEFAULT_MAX_TOKENS
from services.router.tiers import AutoRule

DIFFICULTY_LABEL = "difficulty"
"""Request label that overrides the length rule: "easy" or "hard"."""

_EASY = frozenset({"easy", "low", "simple"})
_HARD = frozenset({"hard", "high", "complex"})


@dataclass(slots=True, frozen=True)
class TierDecision:
    """The tier "auto" resolves to, and why."""

    tier: str
    reason: str


def choose_auto_tier(
    rule: AutoRule, prompt_tokens: int, max_tokens: int | None, labels: Mapping[str, str]
) -> TierDecision:
    """Applies the rule to one request."""
    label = labels.get(DIFFICULTY_LABEL, "").strip().lower()
    if label in _HARD:
        return TierDecision(rule.full, f"auto: labelled {label!r} -> full tier")
    if label in _EASY:
        return TierDecision(rule.cheap, f"auto: labelled {label!r} -> cheap tier")
    output = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if prompt_tokens <= rule.max_prompt_tokens and output <= rule.max_output_tokens:
        return TierDecision(
            rule.cheap,
            f"auto: short prompt ({prompt_tokens} <= {rule.max_prompt_tokens} tokens) and "
            f"output ({output} <= {rule.max_output_tokens}) -> cheap tier",
        )
    return TierDecision(
        rule.full,
        f"auto: prompt {prompt_tokens} tokens (cheap limit {rule.max_prompt_tokens}), "
        f"output {output} (cheap limit {rule.max_output_tokens}) -> full tier",
    )
