"""Helpers for the bidirectional streams every hop serves: first message, cancel watch, coalescing.

The router and the worker both take a request as the first message of a bidi stream, watch the
rest of that stream for a Cancel, and forward events that should be coalesced: when the consumer
is slower than the producer, one message carries everything produced since the last send.
Nothing here imports gRPC; the stream is any async iterator of messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Generic, TypeVar

from opentelemetry import trace

from kvmesh.background import reap
from kvmesh.errors import InvalidArgument

log = logging.getLogger(__name__)

T = TypeVar("T")
Message = TypeVar("Message")

END_OF_STREAM_GRACE_S = 1.0
"""Longest wait, after the last event, for a caller that neither half-closes nor cancels."""


async def first_message(messages: AsyncIterator[Message], what: str) -> Message:
    """The stream's first message; InvalidArgument when the caller sent none."""
    try:
        return await anext(messages)
    except StopAsyncIteration:
        raise InvalidArgument(what, "the stream ended before its first message") from None


class CancelWatch(Generic[Message]):
    """Reads the rest of a request stream in the background and sets `cancelled` on a Cancel.

    `reason_of(message)` returns the cancel reason for a Cancel message and None otherwise.
    A stream that simply half-closes is not a cancel. The reason is logged (naming `label`,
    the request) and added to the current span.
    """

    def __init__(
        self,
        messages: AsyncIterator[Message],
        reason_of: Callable[[Message], str | None],
        label: str = "a request",
    ) -> None:
        self._messages = messages
        self._reason_of = reason_of
        self._label = label
        self.cancelled = asyncio.Event()
        self.reason = ""
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts reading the stream."""
        self._task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        async for message in self._messages:
            reason = self._reason_of(message)
            if reason is None:
                continue
            self.reason = reason or "no reason given"
            log.info("%s cancelled by the caller: %s", self._label, self.reason)
            trace.get_current_span().add_event("kvmesh.cancel", {"kvmesh.reason": self.reason})
            self.cancelled.set()
            return

    async def caller_done(self, timeout_s: float = END_OF_STREAM_GRACE_S) -> None:
        """After the answer's last event: waits (at most `timeout_s`) until the caller
        half-closes or sends its Cancel. A Cancel racing the end of the stream then reaches a
        call still open: grpc aio turns a write to a call whose status has arrived into
        INTERNAL on the writer's side, losing the answer (grpc/grpc#36066)."""
        if self._task is not None and not self._task.done():
            await asyncio.wait({self._task}, timeout=timeout_s)

    async def close(self) -> None:
        """Stops reading; safe to call more than once."""
        if self._task is None:
            return
        self._task.cancel()
        # Awaited even when it already ended: a read that failed as the call ended (an
        # ordinary end of the request stream) is retrieved here, never left to the loop.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


async def run_unless_cancelled(work: Awaitable[T], cancelled: asyncio.Event) -> T | None:
    """Runs `work`; returns None (and cancels it) if `cancelled` is set first.

    Work that takes something (a slot) must hand it to an owner itself when it is cancelled
    after taking it (services.admission.holdings): its result is not seen here then. A cancel
    of the caller's own task propagates, never swallowed by the wait for `work` to end."""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(cancelled.wait())
    answered = False
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            answered = True
            return task.result()
    finally:
        waiter.cancel()
        if not answered:
            # Nobody asks for its outcome past here, even when it ended with an error just as
            # our own task was cancelled (a deadline passing on both sides of a hop at once).
            reap(task, "work abandoned by a cancel", logging.DEBUG)
        if not task.done():
            # Waited for (a generator being advanced must stop before it can be closed),
            # without swallowing a cancel of our own task: that one propagates after.
            task.cancel()
            await asyncio.wait({task})
    return None


_END = object()
_WAKE = object()  # wakes a consumer waiting for a batch: Coalescer.interrupt()


class _Failure:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Coalescer(Generic[T]):
    """Async iterator of batches: every item `source` produced since the previous batch.

    Draining starts at construction, in a background task, so the source runs even before
    the first batch is asked for (the engine starts a request when its iterator is first
    advanced). A slow consumer receives batches, a fast one single items. `aclose()` cancels
    the drain and closes `source` (for the engine, closing its iterator aborts the request).
    `interrupt()` ends the batches early (a cancel, a worker gone).
    """

    def __init__(self, source: AsyncIterator[T]) -> None:
        self._source = source
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._ended = False
        self.interrupted = False
        """interrupt() ended the batches (not the source)."""
        self._watchers: list[asyncio.Future[None]] = []
        self._pump = asyncio.create_task(self._drain())

    def interrupt(self) -> None:
        """Ends the batches now: a consumer waiting for one, or asking for the next, sees the
        end (items not yet taken are dropped). Safe to call more than once."""
        if not self.interrupted:
            self.interrupted = True
            self._queue.put_nowait(_WAKE)

    def when_drained(self, callback: Callable[[], None]) -> None:
        """Calls `callback` once the drain is over: `source` ended or failed, or aclose()
        cancelled it (even before it started, when `source` never ran)."""
        self._pump.add_done_callback(lambda _: callback())

    def interrupt_when(self, event: asyncio.Event) -> None:
        """interrupt() once `event` is set: one task for the iterator's life (racing every
        batch against the event took two tasks a batch, the most a token cost a hop)."""
        self._watchers.append(asyncio.ensure_future(self._interrupt_on(event)))

    async def _interrupt_on(self, event: asyncio.Event) -> None:
        await event.wait()
        self.interrupt()

    async def _drain(self) -> None:
        try:
            async for item in self._source:
                self._queue.put_nowait(item)
        except Exception as error:  # noqa: BLE001 - handed to the consumer, which re-raises it
            self._queue.put_nowait(_Failure(error))
            return
        self._queue.put_nowait(_END)

    def __aiter__(self) -> Coalescer[T]:
        return self

    async def __anext__(self) -> list[T]:
        if self._ended or self.interrupted:
            raise StopAsyncIteration
        batch: list[T] = []
        item = await self._queue.get()
        while True:
            if item is _WAKE:
                raise StopAsyncIteration
            if item is _END or isinstance(item, _Failure):
                if batch:
                    # Deliver what came before; the end (or error) follows on the next call.
                    self._queue.put_nowait(item)
                    return batch
                self._ended = True
                if isinstance(item, _Failure):
                    raise item.error
                raise StopAsyncIteration
            batch.append(item)  # type: ignore[arg-type]
            if self._queue.empty():
                return batch
            item = self._queue.get_nowait()

    async def aclose(self) -> None:
        """Stops draining and closes the source; safe to call more than once."""
        self._ended = True
        for watcher in self._watchers:
            watcher.cancel()
        if not self._pump.done():
            self._pump.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._pump
        closer = getattr(self._source, "aclose", None)
        if closer is not None:
            with contextlib.suppress(Exception):
                await closer()
