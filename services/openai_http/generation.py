"""Runs the Generate calls of one plan on the gateway and merges their events in arrival order.

Each choice is its own Generate call, through the kvmesh SDK with the caller's API key. The
first sample of each prompt starts at once; the prompt's other samples start when its first
token arrives, so their prefill finds the prompt's KV blocks in a worker's prefix cache.
Closing the generation cancels every call still running, at every hop; so does the client going
away (the awaitable `start` is given finishing first), and the events end with ClientGone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field

import grpc

from kvmesh.client import Chunk, Client, GenerationResult
from kvmesh.errors import Cancelled, DeadlineExceeded, Internal, KvmeshError, Unavailable
from kvmesh.v1 import common_pb2
from services.openai_http.translation import Plan, chunk_offsets


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
    """The Generate calls of one plan."""

    def __init__(self, plan: Plan, channel: grpc.aio.Channel) -> None:
        self._plan = plan
        self._client = Client(channel=channel, api_key=plan.headers.api_key)
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

    def at_deadline(self, error: KvmeshError) -> KvmeshError:
        """The error a call ended with, where an INTERNAL after the request's deadline is the
        deadline: gRPC's core can end a call whose deadline passed while it was being set up
        with INTERNAL ("Internal error from Core") rather than DEADLINE_EXCEEDED."""
        if not isinstance(error, Internal) or self._deadline is None:
            return error
        if asyncio.get_running_loop().time() < self._deadline:
            return error
        return DeadlineExceeded(f"the request's deadline passed ({error.message})")

    def _time_left(self) -> float | None:
        if self._deadline is None:
            return None
        return max(0.001, self._deadline - asyncio.get_running_loop().time())

    async def _run(self, index: int, gate: asyncio.Event | None) -> None:
        choice = self._choices[index]
        if gate is not None:
            await gate.wait()
        stream = self._client.stream_request(
            self._plan.requests[index], deadline_s=self._time_left()
        )
        put = self._queue.put_nowait
        try:
            put(Event(index, started=await stream.wait_started()))
            async for chunk in stream:
                choice.offsets.extend(chunk_offsets(choice.text_chars, len(chunk.token_ids)))
                choice.text_chars += len(chunk.text)
                choice.released.set()
                put(Event(index, chunk=chunk))
            result = stream.result
            if result.finish_reason == "error":
                raise Unavailable(result.error_message or "the generation failed")
            put(Event(index, result=result))
        except KvmeshError as error:
            put(Event(index, error=self.at_deadline(error)))
        finally:
            choice.released.set()
            await stream.aclose()
