"""How long one request takes on a tier's workers: what the router measures, the gateway uses.

The router measures its calls to the workers (services/router/rates.py) and reports the result
in ListModels (`ModelInfo.service_rates`); the gateway's admission sheds a request whose
expected wait plus this service time would outlast its deadline.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmesh.v1 import gateway_pb2


@dataclass(slots=True, frozen=True)
class ServiceRates:
    """The measured cost of a request's parts, in seconds."""

    prefill_base_s: float
    """Time to the first token that does not grow with the prompt (worker queueing included)."""
    prefill_s_per_token: float
    """Time to the first token per uncached prompt token."""
    decode_s_per_token: float
    """Time between two output tokens of one sequence at the workers' present load."""

    def service_s(self, prompt_tokens: int, max_tokens: int) -> float:
        """Expected time from the router's start of the request to its last token."""
        prefill = self.prefill_base_s + prompt_tokens * self.prefill_s_per_token
        return prefill + max(max_tokens - 1, 0) * self.decode_s_per_token

    def to_proto(self) -> gateway_pb2.ServiceRates:
        return gateway_pb2.ServiceRates(
            prefill_base_ms=self.prefill_base_s * 1000.0,
            prefill_ms_per_token=self.prefill_s_per_token * 1000.0,
            decode_ms_per_token=self.decode_s_per_token * 1000.0,
        )

    @classmethod
    def from_proto(cls, rates: gateway_pb2.ServiceRates) -> ServiceRates:
        return cls(
            prefill_base_s=rates.prefill_base_ms / 1000.0,
            prefill_s_per_token=rates.prefill_ms_per_token / 1000.0,
            decode_s_per_token=rates.decode_ms_per_token / 1000.0,
        )
