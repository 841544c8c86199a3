"""The model tiers the gateway can serve, and a tokenizer for each.

The tiers come from the router's ListModels (refreshed every `refresh_s`, and once more when
a request names a tier not seen yet); the tokenizer of a tier is loaded from the spec
configured for it (`--model-path TIER=SPEC`) or the default spec, once per spec.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from kvmesh.background import stop_loop
from kvmesh.contracts.sampling import AUTO_MODEL
from kvmesh.contracts.tokenizer import Tokenizer
from kvmesh.errors import InvalidArgument, KvmeshError, Unavailable
from kvmesh.service_rates import ServiceRates

log = logging.getLogger(__name__)


class TokenizerLike(Protocol):
    """What the gateway needs of a tokenizer (contracts.tokenizer.Tokenizer; tests fake it)."""

    vocab_size: int
    max_token_chars: int
    """The most characters of text one token stands for."""
    chat_template: str | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]: ...


@dataclass(slots=True, frozen=True)
class ModelSpec:
    """One model tier as the router reports it."""

    id: str
    base_model: str = ""
    quantization: str = "none"
    fingerprint: str = ""
    context_length: int = 2048
    usd_per_gpu_hour: float = 0.0
    tokens_per_second: float = 0.0
    available: bool = True
    fallback: str = ""
    service_rates: ServiceRates | None = None
    """How fast its workers serve a request now (measured by the router); None: unknown."""


class ModelCatalog:
    """Tiers by id, kept fresh from the router, with their tokenizers."""

    def __init__(
        self,
        fetch: Callable[[], Awaitable[list[ModelSpec]]],
        *,
        tokenizer_specs: Mapping[str, str],
        default_tokenizer: str,
        default_model: str = "",
        refresh_s: float = 10.0,
        load_tokenizer: Callable[[str], TokenizerLike] = Tokenizer.from_model_path,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._fetch = fetch
        self._tokenizer_specs = dict(tokenizer_specs)
        self._default_tokenizer = default_tokenizer
        self._default_model = default_model
        self._refresh_s = refresh_s
        self._load_tokenizer = load_tokenizer
        self._clock = clock
        self._models: list[ModelSpec] | None = None
        self._fetched_at = float("-inf")
        self._refresh_lock = asyncio.Lock()
        self._refreshing: asyncio.Task[None] | None = None
        """A refresh running behind the requests that go on with the list it replaces."""
        self._tokenizers: dict[str, asyncio.Task[TokenizerLike]] = {}

    async def models(self) -> list[ModelSpec]:
        """Every tier, in the router's order. A stale list is refetched behind the requests,
        which go on with it meanwhile (no request waits for the router's answer, a refusal
        least of all). Waited for: the first fetch, and the refetch of a list that named a tier
        before any of its workers had reported (a stack just started), stale or not."""
        stale = self._clock() - self._fetched_at >= self._refresh_s
        if self._models is None or not _settled(self._models):
            await self._refresh()  # at most one fetch a second (_refresh)
        elif stale and (self._refreshing is None or self._refreshing.done()):
            self._refreshing = asyncio.create_task(self._refresh())
        if self._models is None:
            raise Unavailable("the router is unreachable: no model list yet")
        return self._models

    def known(self, tier: str) -> ModelSpec | None:
        """The tier as last fetched, without contacting the router."""
        return _find(self._models or [], tier)

    async def resolve(self, name: str) -> ModelSpec:
        """The tier a request names ("" means the default, "auto" lets the router choose)."""
        models = await self.models()
        if not models:
            raise Unavailable("the router serves no model tiers")
        if name == "":
            name = self._default_model or models[0].id
        if name == AUTO_MODEL:
            return _auto_spec(models, self._default_model or models[0].id)
        found = _find(models, name)
        if found is None and self._clock() - self._fetched_at > 1.0:
            await self._refresh()  # a tier added since the last refresh
            found = _find(self._models or [], name)
        if found is None:
            known = ", ".join([m.id for m in models] + [AUTO_MODEL])
            raise InvalidArgument("model", f"unknown model {name!r} (available: {known})")
        if found.context_length <= 0:
            # Not a limit of the request: no worker of the tier has said what it serves yet.
            raise Unavailable(f"model {found.id!r}: no worker has reported its context length yet")
        return found

    async def tokenizer(self, model: ModelSpec) -> TokenizerLike:
        """The tokenizer of a tier, loaded on first use (concurrent callers share the load)."""
        tier = model.id
        if tier == AUTO_MODEL:
            tier = self._default_model or (await self.models())[0].id
        spec = self._tokenizer_specs.get(tier, self._default_tokenizer)
        task = self._tokenizers.get(spec)
        if task is None:
            task = asyncio.ensure_future(asyncio.to_thread(self._load_tokenizer, spec))
            self._tokenizers[spec] = task
        try:
            return await asyncio.shield(task)
        except Exception as error:
            self._tokenizers.pop(spec, None)  # retry the load on the next request
            log.exception("cannot load tokenizer %r for tier %r", spec, tier)
            raise Unavailable(f"cannot load the tokenizer of {tier!r}: {error}") from error

    async def warm_up(self) -> None:
        """Fetches the tiers and loads their tokenizers ahead of the first request."""
        try:
            models = await self.models()
        except KvmeshError as error:
            log.info("model list not available yet (%s): tokenizers load on first use", error)
            return
        for model in models:
            with contextlib.suppress(KvmeshError):
                await self.tokenizer(model)

    async def close(self) -> None:
        """Stops a refresh still running."""
        if self._refreshing is not None:
            await stop_loop(self._refreshing)

    async def _refresh(self) -> None:
        async with self._refresh_lock:
            if self._clock() - self._fetched_at < min(self._refresh_s, 1.0):
                return  # another caller just refreshed
            try:
                self._models = await self._fetch()
            except KvmeshError as error:
                log.warning("cannot list models from the router: %s", error)
                if self._models is None:
                    raise Unavailable(f"cannot list models from the router: {error}") from error
            self._fetched_at = self._clock()


def _settled(models: list[ModelSpec]) -> bool:
    """Whether every tier's workers had reported when the list was made (the router lists a
    tier whose workers have not answered yet with context length 0)."""
    return all(m.context_length > 0 for m in models)


def _find(models: list[ModelSpec], name: str) -> ModelSpec | None:
    return next((m for m in models if m.id == name), None)


def _auto_spec(models: list[ModelSpec], default_tier: str) -> ModelSpec:
    """What the gateway knows of "auto": the default tier's tokenizer, the smallest context.

    Routing by difficulty assumes the tiers share a tokenizer (tiers of one model family).
    """
    base = _find(models, default_tier) or models[0]
    shortest = min((m.context_length for m in models if m.context_length > 0), default=0)
    return replace(base, id=AUTO_MODEL, fingerprint="", context_length=shortest)


def parse_tier_map(entries: Sequence[str], what: str) -> dict[str, str]:
    """`("tier=value", ...)` -> {tier: value}; raises ValueError naming `what`."""
    mapping: dict[str, str] = {}
    for entry in entries:
        tier, sep, value = entry.partition("=")
        if not sep or not tier.strip() or not value.strip():
            raise ValueError(f"{what}: expected TIER=VALUE, got {entry!r}")
        mapping[tier.strip()] = value.strip()
    return mapping
