"""Continuous batching: which requests compute which tokens in the next step.

Each step spends a token budget under a cap on running requests. Running requests go first
(interactive before batch, oldest first), then waiting requests are admitted with (chunked)
prefills, interactive before batch, FIFO within a class. When the pool runs out of blocks a
running request is preempted by recompute: batch before interactive, newest first; it loses
its blocks and returns to the front of its waiting queue.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.worker.engine.kv_cache_manager import KvCacheManager
from services.worker.engine.request import Priority, RequestState, RequestStatus


@dataclass(slots=True)
class ScheduledChunk:
    """Tokens [start_pos, start_pos + num_tokens) of one request, computed this step."""

    state: RequestState
    start_pos: int
    num_tokens: int
    # Only a chunk that reaches the last known token yields the next token.
    want_logits: bool


def _chunk(state: RequestState, start_pos: int, num_tokens: int) -> ScheduledChunk:
    return ScheduledChunk(state, start_pos, num_tokens, start_pos + num_tokens == state.num_tokens)


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[RequestState] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)


class Scheduler:
    """Waiting queues per priority class and the running set."""

    def __init__(self, kv: KvCacheManager, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: dict[Priority, deque[RequestState]] = {p: deque() for p in Priority}
        self.running: list[RequestState] = []
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self.waiting.values())

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_requests(self) -> bool:
        return bool(self.running) or self.num_waiting > 0

    def add(self, state: RequestState) -> None:
        state.status = RequestStatus.WAITING
        self.waiting[state.priority].append(state)

    def add_running(self, state: RequestState) -> None:
        """A request that already holds its blocks (an import) joins the running set."""
        state.status = RequestStatus.RUNNING
        state.admitted_once = True
        self.running.append(state)

    def remove(self, state: RequestState) -> None:
        """Take a request out (finished or aborted); its blocks are the caller's to free."""
        if state.status is RequestStatus.RUNNING:
            self.running.remove(state)
        elif state.status is RequestStatus.WAITING:
            self.waiting[state.priority].remove(state)
        state.status = RequestStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        scheduled: dict[RequestState, ScheduledChunk] = {}
        budget = self.max_num_batched_tokens
        for state in sorted(self.running, key=_preemption_order):
            if budget == 0:
                break
            if state.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(state.num_tokens - state.num_computed_tokens, budget)
            while not self.kv.allocate_slots(state, num_new):
                victim = max(self.running, key=_preemption_order)
                self._preempt(victim)
                out.preempted.append(victim)
                dropped = scheduled.pop(victim, None)
                if dropped is not None:
                    budget += dropped.num_tokens
                if victim is state:
                    break
            else:
                scheduled[state] = _chunk(state, state.num_computed_tokens, num_new)
                budget -= num_new
        # After a preemption the pool is short: admitting new work would only thrash.
        if not out.preempted:
            self._admit_waiting(scheduled, budget)
        out.chunks = list(scheduled.values())
        return out

    def _admit_waiting(self, scheduled: dict[RequestState, ScheduledChunk], budget: int) -> None:
        for priority in Priority:
            queue = self.waiting[priority]
            while queue and budget > 0 and len(self.running) < self.max_num_seqs:
                state = queue[0]
                cached = self.kv.find_cached_prefix(state)
                num_cached = len(cached) * self.kv.block_size
                num_new = min(state.num_tokens - num_cached, budget)
                if not self.kv.admit(state, cached, num_new):
                    return  # the head doesn't fit: nobody behind it jumps the queue
                queue.popleft()
                state.num_computed_tokens = num_cached
                if not state.admitted_once:
                    state.num_cached_prompt_tokens = num_cached
                    state.admitted_once = True
                state.status = RequestStatus.RUNNING
                self.running.append(state)
                scheduled[state] = _chunk(state, num_cached, num_new)
                budget -= num_new

    def _preempt(self, state: RequestState) -> None:
        self.running.remove(state)
        self.kv.free(state.request_id)
        state.num_computed_tokens = 0
        state.status = RequestStatus.WAITING
        self.waiting[state.priority].appendleft(state)
        self.num_preemptions += 1


def _preemption_order(state: RequestState) -> tuple[int, int]:
    """Ascending: served first. The maximum is the first victim (batch, then newest)."""
    return (state.priority, state.arrival_seq)
