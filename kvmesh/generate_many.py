"""GenerateMany from the caller's side: many generations on one bidi stream, each by its number.

The SDK runs a client's requests on the gateway this way (Gateway.GenerateMany), the gateway
its requests on the router (Router.GenerateMany), the router its colocated generations on each
worker (Worker.GenerateMany). Each message (GenerateManyClientMessage to the gateway,
GenerateManyMessage below it: the same fields around each hop's request) opens or cancels one
generation; the service answers with everything its generations produced since its
last send, in one GenerateManyEvents message (kvmesh/generation_mux.py runs them), so that under
a continuous batch one message carries a step's tokens for all its requests instead of one
message each.

`GenerateManyCall` and `Generation` are the caller's side (the SDK's too: nothing here is a
server's); kvmesh/serve_many.py is a servicer's.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Generic, TypeVar

import grpc
from google.rpc import status_pb2
from opentelemetry import propagate

from kvmesh.client_streams import open_stream
from kvmesh.errors import DeadlineExceeded, KvmeshError, Unavailable
from kvmesh.rpc_status import error_from_rpc, error_from_status
from kvmesh.v1 import common_pb2, gateway_pb2

Message = TypeVar("Message", common_pb2.GenerateManyMessage, gateway_pb2.GenerateManyClientMessage)
"""A GenerateMany message: the gateway's from clients, or the one below the gateway."""

Item = common_pb2.GenerateEvent | KvmeshError | None
"""What reaches a generation: its next event, the error that ended it, or None: cut."""

IDLE_LINGER_S = 5.0
"""How long a call stays open after its last generation ended, for the caller's next one."""


class GenerateManyCall(Generic[Message]):
    """One GenerateMany call from the caller's side: the generations it runs on one service,
    each under a number of the call's, their events coming back batched.

    It lasts while generations are open and `linger_s` after its last one ends, so that a
    caller's next request rides the open call instead of opening one on each hop (a new
    call's first message waits about 0.3-0.6 ms to leave and its handler as long again to
    start). Then it half-closes and takes no more, and the service ends the call (so that the
    channel of a service that left can close: the router's peers.py); the next generation
    opens a new call. A service that drains says so (GenerateManyEvents.draining): the call
    then takes no more and half-closes once its generations have ended, without lingering. A
    call that breaks fails every generation on it with its status."""

    def __init__(
        self,
        start: Callable[[AsyncIterator[Message]], Any],
        message_type: type[Message],
        service: str,
        linger_s: float = IDLE_LINGER_S,
    ) -> None:
        """start: the stub's GenerateMany (given the messages to send); message_type: what it
        takes; service: who answers, as a message names it ("the router"); linger_s: how long
        it stays open with no generation."""
        self.takes_more = True
        """False once it has half-closed, or broke: generations go to a new call."""
        self._message_type: type[Message] = message_type
        self._service = service
        self._outbox: asyncio.Queue[Message | None] = asyncio.Queue()
        self._inboxes: dict[int, asyncio.Queue[Item]] = {}
        self._numbers = itertools.count(1)
        self._linger_s = linger_s
        self._idle_timer: asyncio.TimerHandle | None = None
        self._half_closed = False
        self._call = open_stream(start, self._messages())
        self.ended = asyncio.create_task(self._read())
        """Done when the call has ended."""

    def generate(self, opening: Message, time_left: float | None) -> Generation:
        """Opens a generation: `opening` holds its request; its number, `time_left` (seconds;
        None: no deadline) and the current trace context are filled in here."""
        self._stop_idle_timer()
        stream_id = next(self._numbers)
        inbox = self._inboxes[stream_id] = asyncio.Queue()
        opening.stream_id = stream_id
        opening.timeout_ms = 0 if time_left is None else max(1, round(time_left * 1000))
        propagate.inject(opening.trace_context)
        self._outbox.put_nowait(opening)
        deadline = None if time_left is None else time.monotonic() + time_left
        return Generation(self, stream_id, inbox, deadline)

    def send_cancel(self, stream_id: int, reason: str) -> None:
        """Asks the service to abort a generation (nothing to ask once the call has ended)."""
        if self.takes_more:
            cancel = common_pb2.Cancel(reason=reason)
            self._outbox.put_nowait(self._message_type(stream_id=stream_id, cancel=cancel))

    def release(self, stream_id: int) -> None:
        """Forgets a generation; after the last one the call half-closes, `linger_s` later
        unless another opened meanwhile, at once when the service is draining."""
        if self._inboxes.pop(stream_id, None) is None or self._inboxes:
            return
        if self.takes_more:
            loop = asyncio.get_running_loop()
            self._idle_timer = loop.call_later(self._linger_s, self._half_close)
        else:
            self._half_close()

    def finish(self) -> None:
        """Takes no more generations: half-closes once those open have ended (now when none
        is), without lingering."""
        self.takes_more = False
        self._stop_idle_timer()
        if not self._inboxes:
            self._half_close()

    def _half_close(self) -> None:
        self._idle_timer = None
        self.takes_more = False
        if not self._half_closed:
            self._half_closed = True
            self._outbox.put_nowait(None)

    def _stop_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    async def _messages(self) -> AsyncIterator[Message]:
        while (message := await self._outbox.get()) is not None:
            yield message

    async def _read(self) -> None:
        """Hands each event to its generation; when the call ends, every generation still
        open gets the call's error (UNAVAILABLE when the service ended it without one)."""
        failure: grpc.aio.AioRpcError | None = None
        try:
            async for message in self._call:
                for item in message.events:
                    if (inbox := self._inboxes.get(item.stream_id)) is not None:
                        inbox.put_nowait(_event_or_error(item))
                if message.draining and self.takes_more:
                    self.finish()
        except grpc.aio.AioRpcError as error:
            failure = error
        finally:
            self.takes_more = False
            self._stop_idle_timer()
            for inbox in self._inboxes.values():  # an error each: callers may rename theirs
                ended = Unavailable(f"{self._service} ended its GenerateMany stream")
                inbox.put_nowait(ended if failure is None else error_from_rpc(failure))


def _event_or_error(item: common_pb2.GenerationEvent) -> common_pb2.GenerateEvent | KvmeshError:
    if item.WhichOneof("outcome") == "error":
        return error_from_status(status_pb2.Status.FromString(item.error))
    return item.event


class Generation:
    """One generation on a GenerateManyCall. `events()` gives its events until Finished, and
    raises the error that ended it (DeadlineExceeded past its deadline, as its own call's
    would); `cancel` asks the service to abort it, `cut` stops waiting for it, `close` ends
    it, with a Cancel first when it is still running."""

    def __init__(
        self,
        call: GenerateManyCall[Any],
        stream_id: int,
        inbox: asyncio.Queue[Item],
        deadline: float | None,
    ) -> None:
        self._call = call
        self._stream_id = stream_id
        self._inbox = inbox
        self._deadline = deadline
        self.ended = False
        """Its Finished or its error arrived: nothing more will, a Cancel is too late."""
        self._cut = False
        self._cancel_sent = False

    async def events(self) -> AsyncGenerator[common_pb2.GenerateEvent]:
        """Its events until Finished; ends early, without Finished, once cut."""
        while (event := await self.next_event()) is not None:
            yield event

    async def next_event(self) -> common_pb2.GenerateEvent | None:
        """Its next event; None once it has ended or was cut. Once it has ended the call
        forgets it (the call half-closes a while after its last one)."""
        if self.ended or self._cut:
            return None
        item = await self._next()
        if isinstance(item, KvmeshError):
            self._end()
            raise item
        if item is not None and item.WhichOneof("event") == "finished":
            self._end()
        return item

    def _end(self) -> None:
        self.ended = True
        self._call.release(self._stream_id)

    def cancel(self, reason: str) -> None:
        """Asks the service to abort it (once; not after it has ended)."""
        if not (self.ended or self._cancel_sent):
            self._cancel_sent = True
            self._call.send_cancel(self._stream_id, reason)

    def cut(self) -> None:
        """Stops waiting for it: `events()` ends now (a generation still running was asked to
        abort by `cancel`, or is by `close`)."""
        if not self._cut:
            self._cut = True
            self._inbox.put_nowait(None)

    def close(self, reason: str) -> None:
        """Ends it on the caller's side: cancelled with `reason` when still running; safe to
        call more than once."""
        self.cancel(reason)
        self.cut()
        self._call.release(self._stream_id)

    async def _next(self) -> Item:
        if self._deadline is None:
            return await self._inbox.get()
        try:
            remaining = max(self._deadline - time.monotonic(), 0.0)
            return await asyncio.wait_for(self._inbox.get(), remaining)
        except TimeoutError:
            return DeadlineExceeded("Deadline Exceeded")
