"""Runs the requests of one plan on the gateway and merges their events in arrival order.

Each choice is its own request, run by the gateway's own admission (Gateway.generate, what its
gRPC servicer calls) for the authenticated caller. The first sample of each prompt starts at
once; the prompt's other samples start when its first token arrives, so their prefill finds the
prompt's KV blocks in a worker's prefix cache. Closing the generation cancels every request
still running, at every hop; so does the client going away (the awaitable `start` is given
finishing first), and the events end with ClientGone. A request with a deadline ends with
DeadlineExceeded when it passes, as gRPC ends a call whose deadline passed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from kvmesh.client import Chunk, GenerationRecord, GenerationResult
from kvmesh.errors import Cancelled, DeadlineExceeded, Internal, KvmeshError, Unavailable
from kvmesh.v1 import common_pb2, gateway_pb2
from services.admission.openai_http.translation import Plan, chunk_offsets

log = logging.getLogger(__name__)


Generate = Callable[
    [gateway_pb2.GenerateRequest, float | None], AsyncIterator[common_pb2.GenerateEvent]
]
"""Runs one request for the caller: its events, given the seconds left before its deadline
(None: no deadline); raises the KvmeshError that refuses or ends it."""


class ClientGone(Cancelled):
    """The HTTP client disconnected before its answer was complete."""


@dataclass(slots=True, frozen=True)
class Event:
    """One thing that happened to one choice: exactly one of the fields is set."""

    choice: int
    started: common_pb2.Started | None = None
    chunk: Chunk | None = None
    result: GenerationResult | None = None
    error: KvmeshError | None = None


@dataclass(slots=True)
class _Choice:
    released: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the choice's first token (or its end) arrived: its prompt is in the cache."""
    text_chars: int = 0
    offsets: list[int] = field(default_factory=list)
    """Text offset of each generated token (see translation.chunk_offsets)."""


class Generation:
    """The requests of one plan, one per choice."""

    def __init__(self, plan: Plan, generate: Generate) -> None:
        self._plan = plan
        self._generate = generate
        self._queue: asyncio.Queue[Event] = asyncio.Queue()
        self._choices = [_Choice() for _ in plan.requests]
        self._tasks: list[asyncio.Task[None]] = []
        self._watch: asyncio.Future[None] | None = None
        loop = asyncio.get_running_loop()
        deadline_s = plan.headers.deadline_s
        self._deadline = None if deadline_s is None else loop.time() + deadline_s

    def offsets(self, choice: int) -> list[int]:
        return self._choices[choice].offsets

    def start(self, client_gone: Awaitable[None]) -> None:
        """Starts every call: leaders now, the other samples of a prompt once it is cached; and
        the watch of `client_gone`, which abandons them all if it finishes first."""
        leader = 0
        for index in range(len(self._plan.requests)):
            if self._plan.first_of_prompt(index):
                leader = index
            gate = None if leader == index else self._choices[leader].released
            self._tasks.append(asyncio.create_task(self._run(index, gate)))
        self._watch = asyncio.ensure_future(client_gone)
        self._watch.add_done_callback(self._abandon)

    def _abandon(self, watch: asyncio.Future[None]) -> None:
        """The client went away: every call is cancelled, and events() ends with ClientGone."""
        if watch.cancelled():
            return
        for task in self._tasks:
            task.cancel()
        self._queue.put_nowait(Event(0, error=ClientGone("the client went away")))

    async def events(self) -> AsyncIterator[Event]:
        """Every event until each choice has its result, or up to the first error (after
        start())."""
        remaining = len(self._tasks)
        while remaining:
            event = await self._queue.get()
            yield event
            if event.error is not None:
                return
            if event.result is not None:
                remaining -= 1

    async def results(self) -> list[GenerationResult]:
        """Every choice's result in choice order; raises the first error."""
        results: list[GenerationResult | None] = [None] * len(self._plan.requests)
        async for event in self.events():
            if event.error is not None:
                raise event.error
            if event.result is not None:
                results[event.choice] = event.result
        return [r for r in results if r is not None]

    async def aclose(self) -> None:
        """Cancels every call still running (each cancel reaches every hop)."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _time_left(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.001, self._deadline - asyncio.get_running_loop().time())

    async def _run(self, index: int, gate: asyncio.Event | None) -> None:
        choice = self._choices[index]
        if gate is not None:
            await gate.wait()
        record = GenerationRecord()
        put = self._queue.put_nowait
        time_left = self._time_left()
        try:
            async with asyncio.timeout(time_left):
                # Cancelling this task (the client left, the generation closed, the deadline
                # passed) raises inside the gateway's generator, which ends the request there.
                async for event in self._generate(self._plan.requests[index], time_left):
                    self._note(index, record.record(event), event)
            if record.finished is None:
                raise Internal("the gateway ended the request without a Finished event")
            result = record.result()
            if result.finish_reason == "deadline" and not result.token_ids:
                # The gateway stops a request short of its deadline to send what it has; with
                # nothing to send, the answer is the deadline's error (a gRPC caller's call
                # ends with DEADLINE_EXCEEDED there).
                raise DeadlineExceeded("the request's deadline passed before its first token")
            if result.finish_reason == "error":
                raise Unavailable(result.error_message or "the generation failed")
            put(Event(index, result=result))
        except TimeoutError:
            put(Event(index, error=DeadlineExceeded("the request's deadline passed")))
        except KvmeshError as error:
            put(Event(index, error=error))
        except Exception as error:  # a bug must still end the request, as an error
            log.exception("unhandled error in a request of the HTTP door", exc_info=error)
            put(Event(index, error=Internal(f"internal error: {type(error).__name__}: {error}")))
        finally:
            choice.released.set()

    def _note(self, index: int, chunk: Chunk | None, event: common_pb2.GenerateEvent) -> None:
        """Queues a choice's Started event or chunk (its Finished is the result, queued last)."""
        if event.HasField("started"):
            self._queue.put_nowait(Event(index, started=event.started))
        elif chunk is not None:
            choice = self._choices[index]
            choice.offsets.extend(chunk_offsets(choice.text_chars, len(chunk.token_ids)))
            choice.text_chars += len(chunk.text)
            choice.released.set()
            self._queue.put_nowait(Event(index, chunk=chunk))
