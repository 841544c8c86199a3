"""AsyncEngine: the Engine driven by one background thread, used from asyncio.

The engine thread owns the Engine. Calls from the event loop become commands on a queue,
applied between steps on the engine thread; their results come back as futures. Outputs of
each step go back to the loop in one call_soon_threadsafe and are routed to per-request
queues.

KV block copies (export of a held handle, writes into an import) are the exception: they run on
a small thread pool without waiting for the current step, and the commands that end their
blocks wait for them instead (see block_copies.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import queue
import threading
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from services.worker.engine.api import (
    EngineRequest,
    EngineStats,
    FinishReason,
    ImportPlan,
    KvHandle,
    Priority,
    RequestOutput,
    TokenLogprob,
)
from services.worker.engine.block_copies import BlockCopies
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine, select_blocks

logger = logging.getLogger(__name__)

T = TypeVar("T")
# How long the engine thread sleeps when requests exist but none can run (e.g. the pool is
# pinned by handles); commands still wake it at once.
IDLE_POLL_S = 0.005
# Threads for KV block copies: copies are memory-bound, so more would not go faster; two let
# an export and an import on a worker serving both roles overlap.
COPY_THREADS = 2

_Delivery = list[tuple[RequestOutput, KvHandle | None]]


class _Stop:
    """Sentinel command that ends the engine thread."""


class AsyncEngine:
    """Thread-backed asyncio facade over Engine (see docs/engine_api.md)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self.tokenizer = engine.tokenizer
        self.layout = engine.layout
        self.fingerprint = engine.fingerprint
        self.model_name = engine.model_name
        self.context_length = engine.context_length
        self._commands: queue.SimpleQueue[Callable[[], None] | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._hold_waiters: dict[str, asyncio.Future[tuple[RequestOutput, KvHandle | None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Set when an interactive request is being submitted; a step of batch work only
        # stops between layers when it sees it (Engine.step), so the newcomer starts at once.
        self._interactive_arrived = threading.Event()
        self._stats = engine.stats()
        self._copier: ThreadPoolExecutor | None = None
        self._exports = BlockCopies()  # held handles, by handle id
        self._imports = BlockCopies()  # imports in progress, by request id

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        """Load the model and build the engine (blocking; call before the loop is busy).

        The build runs on a thread of its own that ends before this returns, never on the
        caller's: see `_load_apart`."""
        return cls(_load_apart(config))

    @property
    def engine(self) -> Engine:
        """The wrapped engine; touch it only while the engine thread is not running."""
        return self._engine

    async def start(self) -> None:
        if self._thread is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._copier = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="kvmesh-kv-copy")
        self._thread = threading.Thread(target=self._run, name="kvmesh-engine", daemon=True)
        self._thread.start()

    async def shutdown(self) -> None:
        """Stop the engine thread; every open stream ends with ABORT."""
        thread = self._thread
        if thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(thread.join)
        self._thread = None
        if self._copier is not None:
            await asyncio.to_thread(self._copier.shutdown)  # lets copies in flight end
            self._copier = None

    def stats(self) -> EngineStats:
        """Snapshot taken by the engine thread after its latest step."""
        return self._stats

    # ---- generation ---------------------------------------------------------------------

    def generate(self, req: EngineRequest) -> AsyncGenerator[RequestOutput, None]:
        """Outputs of one request until it finishes; closing the iterator early aborts it."""
        return self._stream(req.request_id, lambda: self._add(req))

    async def abort(self, request_id: str) -> None:
        await self._call(lambda: self._engine.abort(request_id))

    async def prefill_and_hold(self, req: EngineRequest) -> tuple[RequestOutput, KvHandle | None]:
        """Run the prompt, sample the first token, keep the prompt's blocks pinned.

        The handle is None when the first token already finished the request.
        """
        rid = req.request_id
        self._check_unused(rid)
        waiter: asyncio.Future[tuple[RequestOutput, KvHandle | None]] = (
            asyncio.get_running_loop().create_future()
        )
        self._hold_waiters[rid] = waiter
        try:
            await self._add(req, hold=True)
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                # Delivered just before the cancel landed: nobody will ever see this handle.
                _, handle = waiter.result()
                if handle is not None:
                    # The caller's cancel is what propagates, even if the engine is already
                    # shutting down (RuntimeError) and took the handle with it.
                    with contextlib.suppress(RuntimeError):
                        await asyncio.shield(self.release(handle.handle_id))
            else:
                self._submit(lambda: self._abort_hold(rid))
            raise
        except BaseException:
            self._hold_waiters.pop(rid, None)
            raise

    def _abort_hold(self, request_id: str) -> None:
        """Engine thread: end a hold request whose caller went away.

        If it is still live, its ABORT output removes the waiter on delivery. If not, its
        output (and handle, released in _deliver) is already on the way, or it was never
        added: either way forgetting the waiter is safe.
        """
        if not self._engine.abort(request_id) and self._loop is not None:
            self._loop.call_soon_threadsafe(self._hold_waiters.pop, request_id, None)

    # ---- KV export / import -------------------------------------------------------------

    async def export_blocks(self, handle_id: str, indices: list[int]) -> list[bytes]:
        """Read on a copy thread, not between steps: a held handle's blocks no longer change,
        and a release waits for the read to end before the engine frees them."""
        copier = self._check_running()
        held = self._exports.block_ids(handle_id)
        if held is None:
            raise KeyError(handle_id)
        read = functools.partial(self._engine.read_blocks, select_blocks(held, indices))
        return await self._exports.copy(handle_id, copier, read)

    async def release(self, handle_id: str) -> int:
        return await self._call_when_idle(
            self._exports, handle_id, None, lambda: self._engine.release(handle_id)
        )

    async def start_import(
        self, req: EngineRequest, block_hashes: list[bytes], num_tokens: int
    ) -> ImportPlan:
        self._check_unused(req.request_id)
        await self._grammar_ready(req)
        plan = await self._call(lambda: self._engine.start_import(req, block_hashes, num_tokens))
        self._imports.open(plan.request_id, plan.block_ids, owner=plan)
        return plan

    async def write_imported_block(self, plan: ImportPlan, index: int, data: bytes) -> None:
        """Written on a copy thread, not between steps; commit and cancel wait for it."""
        copier = self._check_running()
        if self._imports.block_ids(plan.request_id, plan) is None:
            raise KeyError(f"no import in progress for request {plan.request_id!r}")
        write = functools.partial(self._engine.fill_imported_block, plan, index, data)
        await self._imports.copy(plan.request_id, copier, write)

    def commit_import(
        self, plan: ImportPlan, first_token_id: int, first_logprob: TokenLogprob | None = None
    ) -> AsyncGenerator[RequestOutput, None]:
        """Decoding continues after first_token_id; outputs as from generate()."""

        async def start() -> None:
            idle = asyncio.get_running_loop().create_future()
            self._imports.close(plan.request_id, functools.partial(_set_once, idle), plan)
            await idle  # every write ended
            await self._call(
                lambda: self._engine.commit_import(plan, first_token_id, first_logprob)
            )

        return self._stream(plan.request_id, start)

    async def cancel_import(self, plan: ImportPlan) -> None:
        await self._call_when_idle(
            self._imports, plan.request_id, plan, lambda: self._engine.cancel_import(plan)
        )

    # ---- event-loop side ----------------------------------------------------------------

    async def _stream(
        self, request_id: str, start: Callable[[], Awaitable[None]]
    ) -> AsyncGenerator[RequestOutput, None]:
        """start() puts the request into the engine; its outputs stream until it finishes."""
        self._check_unused(request_id)
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = outputs
        started = finished = False
        try:
            await start()
            started = True
            while not finished:
                output = await outputs.get()
                finished = output.finish_reason is not None
                yield output
        finally:
            del self._streams[request_id]
            if started and not finished:
                self._submit(lambda: self._engine.abort(request_id))

    def _check_unused(self, request_id: str) -> None:
        if request_id in self._streams or request_id in self._hold_waiters:
            raise ValueError(f"request id {request_id!r} is already in use")

    async def _grammar_ready(self, req: EngineRequest) -> None:
        """Wait here, on the loop, for a constrained request's grammar to compile, so the
        engine thread never waits for it (ConstraintError when refused or too slow)."""
        constraint = req.sampling.constraint
        if constraint is not None:
            constraint.validate()
            await self._engine.grammars.wait_async(constraint)

    async def _add(self, req: EngineRequest, *, hold: bool = False) -> None:
        await self._grammar_ready(req)
        if req.priority is Priority.INTERACTIVE:
            # Before the command is queued: the engine thread clears the flag only once it has
            # taken a command, so the flag never outlives the command that raised it.
            self._interactive_arrived.set()
        await self._call(lambda: self._engine.add_request(req, hold_after_prefill=hold))

    async def _call(self, fn: Callable[[], T]) -> T:
        self._check_running()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        self._commands.put(_command(future, fn))
        return await asyncio.wrap_future(future)

    async def _call_when_idle(
        self, copies: BlockCopies, key: str, owner: object, fn: Callable[[], T]
    ) -> T:
        """fn on the engine thread once no copy of the block set is in flight.

        fn frees or hands over the set's blocks, so once asked for it runs even if the
        caller is cancelled meanwhile (the blocks would leak otherwise).
        """
        self._check_running()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        copies.close(key, lambda: self._commands.put(_command(future, fn)), owner)
        waited = asyncio.wrap_future(future)
        waited.add_done_callback(_retrieve)
        return await asyncio.shield(waited)

    def _check_running(self) -> ThreadPoolExecutor:
        """The copy threads; RuntimeError unless the engine thread runs."""
        if self._thread is None or self._copier is None:
            raise RuntimeError("AsyncEngine is not running: await start() first")
        return self._copier

    def _submit(self, fn: Callable[[], object]) -> None:
        """Fire-and-forget command (safe from finalizers and cancelled tasks)."""

        def run() -> None:
            try:
                fn()
            except Exception:  # nobody awaits it; a handle may already be gone
                logger.exception("background engine command failed")

        self._commands.put(run)

    def _deliver(self, items: _Delivery) -> None:
        for output, handle in items:
            waiter = self._hold_waiters.pop(output.request_id, None)
            if waiter is not None and not waiter.done():
                if handle is not None:
                    self._exports.open(handle.handle_id, handle.block_ids)
                waiter.set_result((output, handle))
                continue
            if handle is not None:  # its prefill caller went away: unpin the blocks
                self._submit(functools.partial(self._engine.release, handle.handle_id))
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)

    # ---- engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        engine = self._engine
        idle = False
        while True:
            if not self._apply_commands(wait=not engine.has_work(), idle=idle):
                break
            if engine.has_work():
                try:
                    outputs = engine.step(self._interactive_arrived.is_set)
                except Exception as exc:  # a bug in the engine: end all requests, keep serving
                    logger.exception("engine step crashed")
                    outputs = engine.abort_all(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
                idle = not outputs and engine.last_step_num_tokens == 0
                self._publish(outputs)
            self._stats = engine.stats()
        self._publish(engine.abort_all())
        self._stats = engine.stats()

    def _apply_commands(self, *, wait: bool, idle: bool) -> bool:
        """Run queued commands; False when told to stop.

        wait: block until a command comes (nothing to step). idle: requests exist but none
        could run last step, so pause briefly instead of spinning.
        """
        try:
            if wait or idle:
                command = self._commands.get(timeout=None if wait else IDLE_POLL_S)
            else:
                command = self._commands.get_nowait()
            self._interactive_arrived.clear()  # whatever raised it is in this batch of commands
            while True:
                if isinstance(command, _Stop):
                    return False
                command()
                command = self._commands.get_nowait()
        except queue.Empty:
            return True

    def _publish(self, outputs: list[RequestOutput]) -> None:
        if not outputs or self._loop is None:
            return
        items = [(output, self._engine.take_handle(output.request_id)) for output in outputs]
        try:
            self._loop.call_soon_threadsafe(self._deliver, items)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            for _, handle in items:
                if handle is not None:
                    self._engine.release(handle.handle_id)


def _load_apart(config: EngineConfig) -> Engine:
    """Engine.from_config on a short-lived thread.

    Loading runs torch's parallel ops, and the first one on a thread gives that thread an
    OpenMP team that lives as long as the thread. torch's libgomp counts every team's threads,
    and once they outnumber the cores its threads wait at each barrier by sleeping after a
    hundred spins instead of some 300,000, whatever OMP_WAIT_POLICY or GOMP_SPINCOUNT say. A
    team left on the caller (the worker's main thread) beside the engine thread's own did
    just that: every layer of every step woke a sleeping thread. The team of a thread that
    ends goes with it, so the engine thread's is the only one.
    """
    with ThreadPoolExecutor(1, thread_name_prefix="kvmesh-engine-load") as loader:
        return loader.submit(Engine.from_config, config).result()


def _command(future: concurrent.futures.Future[T], fn: Callable[[], T]) -> Callable[[], None]:
    """An engine-thread command that runs fn into future, unless future was cancelled."""

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except Exception as exc:  # noqa: BLE001 - handed to the awaiting caller
            future.set_exception(exc)

    return run


def _set_once(future: asyncio.Future[None]) -> None:
    if not future.done():  # its awaiter may have been cancelled
        future.set_result(None)


def _retrieve(future: asyncio.Future[T]) -> None:
    """Mark a shielded future's exception as seen: its caller may have stopped waiting."""
    if not future.cancelled():
        future.exception()
