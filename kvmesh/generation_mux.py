"""Many generations on one stream: each runs as a task of its own, their events go out together.

Gateway.GenerateMany carries every request of one SDK client, Router.GenerateMany every request
a gateway sends its router, Worker.GenerateMany every colocated generation a router sends one
worker. A per-request stream costs a message, with its
read and write on both sides, for every token of every request; here one message carries what
all the generations produced since the last send: under a continuous batch, a step's tokens
for all its requests (kvmesh/generate_many.py speaks the protocol over it).

Nothing here imports gRPC: a generation is any async iterator of events, opened under the
caller's number for it, and its failure is handed out as the KvmeshError it raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Generic, TypeVar

from kvmesh.errors import AlreadyExists, Internal, KvmeshError

log = logging.getLogger(__name__)

Event = TypeVar("Event")

Generation = Callable[[asyncio.Event], AsyncIterator[Event]]
"""Opens a generation's events, given the event its cancel sets."""


class GenerationMux(Generic[Event]):
    """Runs generations side by side; `batches()` hands out (stream id, event or error) pairs
    in the order each generation produced them, all that are ready at once."""

    def __init__(self) -> None:
        self._ready: list[tuple[int, Event | KvmeshError]] = []
        self._wake = asyncio.Event()
        self._running: dict[int, asyncio.Task[None]] = {}
        self._cancels: dict[int, asyncio.Event] = {}
        self._no_more = False
        self._flush = False

    def open(self, stream_id: int, generation: Generation[Event]) -> None:
        """Starts a generation under `stream_id`; one whose id is still open is refused with
        AlreadyExists, handed out as that id's error (the open one runs on)."""
        if stream_id in self._running:
            error = AlreadyExists(f"stream id {stream_id} is already open on this stream")
            self._hand_out(stream_id, error)
            return
        cancelled = self._cancels[stream_id] = asyncio.Event()
        task = asyncio.create_task(self._run(stream_id, generation(cancelled)))
        self._running[stream_id] = task

    def cancel(self, stream_id: int) -> None:
        """Cancels a generation; one already ended (its Finished may be on its way) is left be."""
        if (cancelled := self._cancels.get(stream_id)) is not None:
            cancelled.set()

    def fail(self, stream_id: int, error: KvmeshError) -> None:
        """Hands out an error for a message about `stream_id` that opened nothing."""
        self._hand_out(stream_id, error)

    def no_more(self) -> None:
        """The caller opens no more generations: `batches()` ends once the open ones have."""
        self._no_more = True
        self._wake.set()

    def flush(self) -> None:
        """Has `batches()` hand out a batch now, even an empty one (for news of the caller's
        own to go out beside it)."""
        self._flush = True
        self._wake.set()

    async def batches(self) -> AsyncIterator[list[tuple[int, Event | KvmeshError]]]:
        """Everything ready since the last batch, as it becomes ready."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            if self._ready or self._flush:
                batch, self._ready, self._flush = self._ready, [], False
                yield batch
            if self._no_more and not self._running and not self._ready:
                return

    async def close(self) -> None:
        """Cancels every generation still running and waits for each to stop (each frees what
        it holds on its way out)."""
        tasks = list(self._running.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self, stream_id: int, events: AsyncIterator[Event]) -> None:
        try:
            async for event in events:
                self._hand_out(stream_id, event)
        except KvmeshError as error:
            self._hand_out(stream_id, error)
        except Exception as error:  # a bug ends its own generation, never the others
            log.exception("generation %d failed", stream_id, exc_info=error)
            self._hand_out(stream_id, Internal(f"{type(error).__name__}: {error}"))
        finally:
            del self._running[stream_id]
            del self._cancels[stream_id]
            self._wake.set()

    def _hand_out(self, stream_id: int, item: Event | KvmeshError) -> None:
        self._ready.append((stream_id, item))
        self._wake.set()
