"""Sampling bounds and request rules every hop checks the same way (gateway, router, worker).

The gateway refuses what is out of bounds with a field-named error; the worker's engine checks
the same bounds again, since every service checks what it is sent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvmesh.v1 import common_pb2

MAX_LOGPROBS = 20
"""Most alternatives per token a request may ask log-probabilities for."""
DEFAULT_MAX_TOKENS = 256
"""Output tokens of a request that leaves max_tokens unset (before the context caps it)."""
AUTO_MODEL = "auto"
"""Model name that lets the router choose the tier by difficulty."""


def is_deterministic(sampling: common_pb2.SamplingParams) -> bool:
    """Greedy decoding, or sampling with a fixed seed, gives the same answer every time."""
    greedy = not sampling.HasField("temperature") or sampling.temperature == 0.0
    return greedy or sampling.HasField("seed")
