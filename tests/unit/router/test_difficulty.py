"""The conservative "auto" rule."""

from __future__ import annotations

import pytest

from services.router.difficulty import choose_auto_tier
from services.router.tiers import AutoRule

RULE = AutoRule(cheap="small", full="big", max_prompt_tokens=64, max_output_tokens=32)


@pytest.mark.parametrize(
    ("prompt", "max_tokens", "labels", "tier"),
    [
        (10, 16, {}, "small"),  # short and short
        (64, 32, {}, "small"),  # the limits are inclusive
        (65, 16, {}, "big"),  # long prompt
        (10, 33, {}, "big"),  # long output
        (10, None, {}, "big"),  # unset max_tokens is the engine's 256
        (10, 16, {"difficulty": "hard"}, "big"),  # the label wins
        (500, 500, {"difficulty": "Easy"}, "small"),
        (10, 16, {"difficulty": "unknown"}, "small"),  # an unknown label falls to the lengths
    ],
)
def test_rule(prompt: int, max_tokens: int | None, labels: dict[str, str], tier: str) -> None:
    decision = choose_auto_tier(RULE, prompt, max_tokens, labels)
    assert decision.tier == tier
    assert decision.reason.startswith("auto: ")
