"""Structured output: the grammar-backend interface, the compile cache, the per-step mask.

A constrained request's Constraint is compiled once per engine (one tokenizer) by a grammar
backend (grammar_xgrammar.py, the default, or grammar_llguidance.py) on a small thread pool,
never on the step loop: AsyncEngine awaits the compile before it hands the request to the
engine thread, so a request waiting for its grammar holds up nobody. Requests with the same
constraint share one compile (one future per key, however many wait on it), and a compile
that passes its time limit, fails, or uses a feature the backend lacks is a ConstraintError
naming the request field, raised before the request has any token.

Each step, GrammarCompiler.mask_logits fills one token bitmask for the constrained rows only,
in one batched backend call, and sets the logits of every token the grammar forbids to -inf
before sampling; rows without a constraint are not touched.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import torch

from kvmesh.contracts.constraints import Constraint, ConstraintError

if TYPE_CHECKING:
    from kvmesh.contracts.tokenizer import Tokenizer

BITMASK_BITS = 32
"""Tokens per int32 word of a token bitmask (the layout xgrammar and llguidance share)."""
JSON_OBJECT_SCHEMA = '{"type": "object"}'
"""What `json_object` compiles as: any JSON object (not any JSON value)."""
REGEX_SPECIALS = frozenset("\\.^$|?*+()[]{}")


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False when the grammar forbids it."""
        ...

    def is_terminated(self) -> bool:
        """The answer is complete and its end (a stop token) was accepted."""
        ...


class GrammarBackend(Protocol):
    """A constrained-decoding library bound to one tokenizer and vocabulary size."""

    def compile(self, constraint: Constraint) -> object:
        """The compiled grammar (blocking, thread-safe); ConstraintError when refused."""
        ...

    def matcher(self, compiled: object) -> GrammarMatcher:
        """A fresh matcher at the start of a compiled grammar."""
        ...

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Row i of the int32 bitmask [len(matchers), words] gets matcher i's allowed tokens,
        in one call for the whole batch."""
        ...


def choice_regex(options: Sequence[str]) -> str:
    """A regex matching exactly one of the options (both backends read it the same way)."""
    return "(" + "|".join(_escape_regex(option) for option in options) + ")"


def _escape_regex(text: str) -> str:
    controls = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return "".join(controls.get(ch, "\\" + ch if ch in REGEX_SPECIALS else ch) for ch in text)


def refusal(constraint: Constraint, error: Exception) -> ConstraintError:
    """A backend's compile error as the request's refusal (its first line names the cause)."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return ConstraintError(constraint.field, f"does not compile: {lines[0][:500]}")


class GrammarCompiler:
    """Compiles constraints off the step loop, caches them, and masks logits each step."""

    def __init__(
        self,
        import_backend: Callable[[], Callable[[], GrammarBackend]],
        *,
        threads: int,
        timeout_s: float,
        cache_entries: int,
        vocab_size: int,
        max_rows: int,
    ) -> None:
        """import_backend runs once, at preload() or else at the first constrained request, on
        that caller's thread (it imports the library: see make_backend); the build it returns
        runs on a compile thread (a library's tokenizer tables take seconds to build). An
        engine that never sees a constraint imports no grammar library."""
        self._import_backend = import_backend
        self._loading: Future[GrammarBackend] | None = None
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvmesh-grammar")
        self.timeout_s = timeout_s
        self._cache_entries = cache_entries
        self._lock = threading.Lock()
        self._compiled: OrderedDict[Constraint, Future[object]] = OrderedDict()
        words = -(-vocab_size // BITMASK_BITS)
        self._bitmask = torch.zeros((max_rows, words), dtype=torch.int32)
        self._shifts = torch.arange(BITMASK_BITS, dtype=torch.int32)
        self.num_compiles = 0

    # ---- compiling (any thread) ---------------------------------------------------------

    def preload(self) -> None:
        """Starts building the backend now, on a compile thread (a worker calls this at start,
        so that its first constrained request waits for its own compile only)."""
        self._load()

    def _load(self) -> Future[GrammarBackend]:
        """The backend's build, submitted once and before any compile: the pool runs tasks in
        order, so a compile thread waiting for the build never holds the thread it needs."""
        with self._lock:
            if self._loading is None:
                self._loading = self._pool.submit(self._import_backend())
            return self._loading

    def submit(self, constraint: Constraint) -> Future[object]:
        """The compile of this constraint: started now, in flight, or done (cached)."""
        self._load()
        with self._lock:
            future = self._compiled.get(constraint)
            if future is not None:
                self._compiled.move_to_end(constraint)
                return future
            future = self._pool.submit(self._compile, constraint)
            self._compiled[constraint] = future
            self.num_compiles += 1
            while len(self._compiled) > self._cache_entries:
                oldest = next(iter(self._compiled))
                if not self._compiled[oldest].done():
                    break  # everything older is still compiling: keep them
                del self._compiled[oldest]
            return future

    def wait(self, constraint: Constraint) -> object:
        """Block until compiled; ConstraintError when refused or past the time limit, which
        counts from the moment the backend is built (its build is once per process, however
        loaded the machine, and says nothing about the constraint)."""
        compiling = self.submit(constraint)
        self.backend()
        try:
            return compiling.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            raise self._timed_out(constraint) from None

    async def wait_async(self, constraint: Constraint) -> None:
        """wait() for the event loop: the loop keeps running; other waiters keep waiting."""
        future = asyncio.wrap_future(self.submit(constraint))
        await asyncio.wrap_future(self._load())
        try:
            await asyncio.wait_for(asyncio.shield(future), self.timeout_s)
        except TimeoutError:
            raise self._timed_out(constraint) from None

    def _timed_out(self, constraint: Constraint) -> ConstraintError:
        return ConstraintError(
            constraint.field, f"did not compile within {self.timeout_s:g} s; simplify it"
        )

    def _compile(self, constraint: Constraint) -> object:
        return self.backend().compile(constraint)

    def backend(self) -> GrammarBackend:
        """The backend, built first if need be (blocking)."""
        return self._load().result()

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A matcher at the start of the constraint's grammar (compiled first if need be)."""
        compiled = self.wait(constraint)  # first: it bounds the wait for the backend too
        return self.backend().matcher(compiled)

    # ---- the step (engine thread) -------------------------------------------------------

    def mask_logits(self, logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> None:
        """Row i of logits [len(matchers), vocab] keeps only matcher i's allowed tokens; rows
        whose matcher is None are left exactly as they are."""
        rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return
        if len(rows) > self._bitmask.shape[0]:
            # Imported requests join the running set past max_num_seqs (they hold their blocks
            # already: Scheduler.add_running), so a step may have more rows than that.
            self._bitmask = self._bitmask.new_zeros((len(rows), self._bitmask.shape[1]))
        bitmask = self._bitmask[: len(rows)]
        self.backend().fill_bitmask([m for m in matchers if m is not None], bitmask)
        with torch.inference_mode():  # the model runner's logits are inference tensors
            allowed = ((bitmask.unsqueeze(-1) >> self._shifts) & 1).flatten(1).bool()
            index = torch.tensor(rows)
            constrained = logits.index_select(0, index)
            constrained.masked_fill_(~allowed[:, : logits.shape[-1]], -torch.inf)
            logits.index_copy_(0, index, constrained)


def hf_tokenizer(tokenizer: Tokenizer) -> Any:
    """The engine's tokenizer as the transformers tokenizer both libraries read."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)


def make_backend(name: str, tokenizer: Tokenizer, vocab_size: int) -> Callable[[], GrammarBackend]:
    """The build of the named backend over the engine's tokenizer. The library is imported
    here, on the caller's thread, and only its tables are built on a compile thread: an import
    on a pool thread holds Python's lock on that module for as long as it runs, and one such
    import never finished in CI, so that every later constrained request waited for it."""
    backend: Callable[[Tokenizer, int], GrammarBackend]
    if name == "xgrammar":
        from services.worker.engine.grammar_xgrammar import XgrammarBackend as backend
    else:
        from services.worker.engine.grammar_llguidance import LlguidanceBackend as backend
    return functools.partial(backend, tokenizer, vocab_size)
