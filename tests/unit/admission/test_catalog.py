"""The model catalog's refresh: a stale list is refetched behind the requests."""

from __future__ import annotations

import asyncio

import pytest

from kvmesh.errors import Unavailable
from services.admission.catalog import ModelCatalog, ModelSpec
from tests.fake_clock import FakeClock


class SlowRouter:
    """ListModels that answers only when the test lets it."""

    def __init__(self) -> None:
        self.calls = 0
        self.answer = asyncio.Event()

    async def list_models(self) -> list[ModelSpec]:
        self.calls += 1
        if self.calls > 1:
            await self.answer.wait()
        return [ModelSpec(f"tier-{self.calls}")]


async def test_a_stale_list_serves_while_it_is_refetched() -> None:
    router, clock = SlowRouter(), FakeClock()
    catalog = ModelCatalog(
        router.list_models, tokenizer_specs={}, default_tokenizer="x", refresh_s=2.0, clock=clock
    )
    assert [m.id for m in await catalog.models()] == ["tier-1"]  # the first fetch is awaited
    clock.now = 3.0
    # Stale: the answer comes at once from the old list, one refetch runs behind it.
    for _ in range(3):
        assert [m.id for m in await asyncio.wait_for(catalog.models(), 1.0)] == ["tier-1"]
    await asyncio.sleep(0)
    assert router.calls == 2
    router.answer.set()
    for _ in range(10):
        await asyncio.sleep(0)
    assert [m.id for m in await catalog.models()] == ["tier-2"]
    await catalog.close()


async def test_close_stops_a_refresh_still_running() -> None:
    router, clock = SlowRouter(), FakeClock()
    catalog = ModelCatalog(
        router.list_models, tokenizer_specs={}, default_tokenizer="x", refresh_s=2.0, clock=clock
    )
    await catalog.models()
    clock.now = 3.0
    await catalog.models()
    await asyncio.sleep(0)
    await asyncio.wait_for(catalog.close(), 1.0)  # the router never answers
    assert [m.id for m in await catalog.models()] == ["tier-1"]


class StartingRouter:
    """ListModels of a stack just started: context length 0 until a worker has reported."""

    def __init__(self) -> None:
        self.calls = 0
        self.reported = False

    async def list_models(self) -> list[ModelSpec]:
        self.calls += 1
        return [ModelSpec("tiny", context_length=2048 if self.reported else 0)]


async def test_a_list_made_before_the_workers_reported_is_refetched_in_the_request() -> None:
    router, clock = StartingRouter(), FakeClock()
    catalog = ModelCatalog(
        router.list_models, tokenizer_specs={}, default_tokenizer="x", refresh_s=2.0, clock=clock
    )
    with pytest.raises(Unavailable, match="no worker has reported its context length yet"):
        await catalog.resolve("tiny")  # never "at most 0 tokens" (INVALID_ARGUMENT)
    router.reported = True
    clock.now = 1.5
    # Unsettled, though not stale: this request waits for the refetch, not the old list.
    assert (await asyncio.wait_for(catalog.resolve("tiny"), 1.0)).context_length == 2048
    assert router.calls == 2
    await catalog.close()
