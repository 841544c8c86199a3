"""Engine: the synchronous core. add_request / abort / step(), plus KV export and import.

One call to step() schedules a batch, runs the model once, samples, and returns one
RequestOutput per request that produced something. The engine is single-threaded: AsyncEngine
drives it from one thread, LLM from the caller's.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
import uuid
from collections.abc import Callable

import torch

from kvmesh.contracts.tokenizer import IncrementalDetokenizer
from services.worker.engine.allocator import keep_freed_memory
from services.worker.engine.api import (
    EngineRequest,
    EngineStats,
    FinishReason,
    ImportPlan,
    KvCapacityError,
    KvHandle,
    Priority,
    RequestOutput,
    TokenLogprob,
)
from services.worker.engine.block_pool import BlockPool
from services.worker.engine.config import (
    AMX_BFLOAT16_STEP_TOKENS,
    STEP_TOKENS,
    EngineConfig,
)
from services.worker.engine.decode_kernel import choose_decode_kernel
from services.worker.engine.grammar import GrammarCompiler, make_backend
from services.worker.engine.kernel_build import cpu_has_amx
from services.worker.engine.kv_cache_manager import KvCacheManager, cdiv
from services.worker.engine.linear_kernel import choose_bfloat16_project, choose_linear_kernel
from services.worker.engine.loader import LoadedModel, load_model, torch_dtype
from services.worker.engine.model_runner import BatchEntry, ModelRunner
from services.worker.engine.models import StepInterrupted
from services.worker.engine.output_processor import Emission, OutputProcessor
from services.worker.engine.prefill_kernel import choose_prefill_kernel
from services.worker.engine.request import RequestState
from services.worker.engine.rope_store_kernel import choose_rope_store_kernel
from services.worker.engine.sampler import Sampler, SampleRow, needs_host
from services.worker.engine.scheduler import ScheduledChunk, Scheduler
from services.worker.engine.throughput import ThroughputMeter

logger = logging.getLogger(__name__)


def step_tokens(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> int:
    """The step's token budget: EngineConfig.max_num_batched_tokens, or where it is None
    AMX_BFLOAT16_STEP_TOKENS for a bfloat16 model on a CPU with AMX, else STEP_TOKENS."""
    if config.max_num_batched_tokens is not None:
        return config.max_num_batched_tokens
    amx = device.type == "cpu" and dtype == torch.bfloat16 and cpu_has_amx()
    return AMX_BFLOAT16_STEP_TOKENS if amx else STEP_TOKENS


class Engine:
    """One model, one KV pool, one scheduler."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        config = config or EngineConfig(model=loaded.name)
        config.validate()
        if config.keep_freed_memory and loaded.device.type == "cpu":
            keep_freed_memory()
        self.config = config
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.fingerprint = loaded.fingerprint
        self.model_name = loaded.name
        self.vocab_size = loaded.config.vocab_size
        self.context_length = min(
            config.max_model_len or loaded.config.max_position_embeddings,
            loaded.config.max_position_embeddings,
        )
        num_blocks = _num_blocks(loaded, config)
        threads = torch.get_num_threads()
        self.runner = ModelRunner(
            loaded,
            num_blocks,
            config.block_size,
            decode_kernel=choose_decode_kernel(
                config.decode_attention, loaded.device, loaded.dtype, threads
            ),
            prefill_kernel=choose_prefill_kernel(
                config.prefill_attention, loaded.device, loaded.dtype, threads
            ),
            rope_store_kernel=choose_rope_store_kernel(
                config.rope_store, loaded.device, loaded.dtype, threads
            ),
            linear_kernel=choose_linear_kernel(
                config.small_batch_linear,
                loaded.device,
                loaded.dtype,
                threads,
                config.large_batch_linear,
            ),
            project=choose_bfloat16_project(
                config.large_batch_linear,
                config.small_batch_linear,
                loaded.device,
                loaded.dtype,
                threads,
            ),
        )
        self.layout = self.runner.layout
        self.pool = BlockPool(num_blocks)
        self.kv = KvCacheManager(
            self.pool, config.block_size, loaded.fingerprint, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv, step_tokens(config, loaded.dtype, loaded.device), config.max_num_seqs
        )
        self.sampler = Sampler()
        self.grammars = GrammarCompiler(
            functools.partial(
                make_backend, config.grammar_backend, loaded.tokenizer, self.vocab_size
            ),
            threads=config.grammar_compile_threads,
            timeout_s=config.grammar_compile_timeout_s,
            cache_entries=config.grammar_cache_entries,
            vocab_size=self.vocab_size,
            max_rows=config.max_num_seqs,
        )
        self._states: dict[str, RequestState] = {}
        self._imports: dict[str, tuple[ImportPlan, RequestState]] = {}
        self._ready_handles: dict[str, KvHandle] = {}
        self._pending: list[RequestOutput] = []
        self._arrivals = itertools.count()
        self.throughput = ThroughputMeter()
        self.last_step_num_tokens = 0
        self.num_interrupted_steps = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        """Load the model the config names and build an engine around it."""
        config.validate()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        loaded = load_model(
            config.model,
            device=config.device,
            dtype=torch_dtype(config.dtype, config.device),
            quantization=config.quantization,
        )
        return cls(loaded, config)

    # ---- requests -----------------------------------------------------------------------

    def add_request(self, req: EngineRequest, *, hold_after_prefill: bool = False) -> None:
        """Queue a request. With hold_after_prefill it stops after its first token and its
        prompt's blocks stay pinned under a KvHandle (take it with take_handle).

        A constrained request's grammar must compile first: this blocks on its compile unless
        the caller waited for it (AsyncEngine does, off the engine thread); a refusal is a
        ConstraintError naming the field."""
        self._check_new(req, max_new_tokens=1 if hold_after_prefill else req.sampling.max_tokens)
        state = self._new_state(req, hold_after_prefill)
        self._states[req.request_id] = state
        self.scheduler.add(state)

    def abort(self, request_id: str) -> bool:
        """Stop a live request now and free its blocks; an ABORT output follows at step()."""
        state = self._states.get(request_id)
        if state is None:
            return False
        self._pending.append(self._end(state, FinishReason.ABORT))
        return True

    def abort_all(
        self, reason: FinishReason = FinishReason.ABORT, error: str | None = None
    ) -> list[RequestOutput]:
        """End every live request; returns their final outputs with any not yet returned."""
        outputs, self._pending = self._pending, []
        outputs.extend(self._end(state, reason, error) for state in list(self._states.values()))
        return outputs

    def live_request_ids(self) -> list[str]:
        """Requests waiting or running (not held handles, not imports in progress)."""
        return list(self._states)

    def has_work(self) -> bool:
        return bool(self._pending) or self.scheduler.has_requests()

    def step(self, interactive_waiting: Callable[[], bool] | None = None) -> list[RequestOutput]:
        """Run one scheduled batch; returns the outputs it (and aborts since) produced.

        interactive_waiting: asked between layers of a step that computes batch work only;
        when it says True the step is abandoned (nothing advances: its chunks are scheduled
        again) so that the interactive request just submitted need not wait it out."""
        outputs, self._pending = self._pending, []
        self._expire_deadlines(outputs)
        plan = self.scheduler.schedule()
        self.last_step_num_tokens = plan.num_tokens
        if not plan.chunks:
            return outputs
        sampled = [chunk for chunk in plan.chunks if chunk.want_logits]
        batch_only = all(c.state.priority is Priority.BATCH for c in plan.chunks)
        try:
            logits = self.runner.forward(
                [self._batch_entry(chunk) for chunk in plan.chunks],
                interactive_waiting if batch_only else None,
            )
            matchers = [c.state.matcher for c in sampled]
            rows = [SampleRow(c.state.request.sampling, c.state.num_output_tokens) for c in sampled]
            if logits.device.type != "cpu" and (
                needs_host(rows) or any(m is not None for m in matchers)
            ):
                # The grammar masks, generators and index tensors live on the CPU: the logits
                # come over once (a few MB); plain greedy rows take their argmax on the device.
                logits = logits.cpu()
            self.grammars.mask_logits(logits, matchers)
            result = self.sampler.sample(logits, rows)
        except StepInterrupted:
            self.num_interrupted_steps += 1
            return outputs
        except Exception as exc:  # a failed batch ends its requests, not the engine
            logger.exception("engine step failed")
            error = f"{type(exc).__name__}: {exc}"
            outputs.extend(self._end(c.state, FinishReason.ERROR, error) for c in plan.chunks)
            return outputs
        for chunk in plan.chunks:
            chunk.state.num_computed_tokens += chunk.num_tokens
            self.kv.cache_computed_blocks(chunk.state)
        for chunk, token_id, logprob in zip(
            sampled, result.token_ids, result.logprobs, strict=True
        ):
            outputs.append(self._append_token(chunk.state, token_id, logprob))
        self.throughput.record(len(sampled))
        return outputs

    # ---- KV export (prefill role) -------------------------------------------------------

    def take_handle(self, request_id: str) -> KvHandle | None:
        """The KvHandle of a hold request whose first token was returned (once)."""
        return self._ready_handles.pop(request_id, None)

    def export_blocks(self, handle_id: str, indices: list[int]) -> list[bytes]:
        """Bytes of some of a handle's blocks (KeyError: unknown handle)."""
        return self.read_blocks(select_blocks(self.kv.held_blocks(handle_id), indices))

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Bytes of blocks, touching no engine state: safe on any thread for blocks nobody
        writes or frees meanwhile. A held handle's blocks are such: its request computes no
        more, and prefix-cache sharers only read full blocks. AsyncEngine exports this way so
        a pull does not wait for the current step."""
        return [self.runner.read_block(block_id) for block_id in block_ids]

    def release(self, handle_id: str) -> int:
        """Unpin a handle's blocks; returns how many (KeyError: unknown handle)."""
        return self.kv.release(handle_id)

    # ---- KV import (decode role) --------------------------------------------------------

    def start_import(
        self, req: EngineRequest, block_hashes: list[bytes], num_tokens: int
    ) -> ImportPlan:
        """Allocate blocks for a request prefilled elsewhere; leading ones cached here are
        reused. Raises KvCapacityError when the pool cannot take them."""
        if num_tokens != len(req.prompt_token_ids):
            raise ValueError(
                f"the lease covers {num_tokens} tokens, the prompt has {len(req.prompt_token_ids)}"
            )
        self._check_new(req, max_new_tokens=req.sampling.max_tokens)
        state = self._new_state(req, hold_after_prefill=False)
        block_ids, missing = self.kv.start_import(state, block_hashes, num_tokens)
        plan = ImportPlan(req.request_id, missing, block_ids, num_tokens, req)
        self._imports[req.request_id] = (plan, state)
        return plan

    def write_imported_block(self, plan: ImportPlan, index: int, data: bytes) -> None:
        self._import_state(plan)
        self.fill_imported_block(plan, index, data)

    def fill_imported_block(self, plan: ImportPlan, index: int, data: bytes) -> None:
        """write_imported_block without checking that the import is still in progress, and
        touching no engine state but the plan: safe on any thread while the import is in
        progress. The blocks it pulls were freshly allocated by start_import and nobody else
        sees them before commit_import registers them in the prefix cache, so the caller only
        has to end every write before committing or cancelling the import."""
        if index not in plan.missing_indices:
            raise ValueError(f"block {index} is not one the plan pulls")
        self.runner.write_block(plan.block_ids[index], data)
        plan.written.add(index)

    def commit_import(
        self, plan: ImportPlan, first_token_id: int, first_logprob: TokenLogprob | None = None
    ) -> None:
        """Start decoding after first_token_id (sampled by the prefill engine, with its
        logprob when the request asks for them); its outputs come from step() like any
        request's."""
        state = self._import_state(plan)
        unwritten = sorted(set(plan.missing_indices) - plan.written)
        if unwritten:
            raise ValueError(f"blocks {unwritten} of the plan were never written")
        if not 0 <= first_token_id < self.vocab_size:
            raise ValueError(f"first token id {first_token_id} outside the vocabulary")
        del self._imports[plan.request_id]
        state.num_computed_tokens = plan.num_tokens
        state.num_cached_prompt_tokens = (
            len(plan.block_ids) - len(plan.missing_indices)
        ) * self.config.block_size
        self.kv.cache_computed_blocks(state)
        state.token_ids.append(first_token_id)
        # Replays what the prefill engine did with this token (its text was sent from there),
        # so that stop strings, detokenization and the grammar continue from the same state.
        replayed, error = self._after_token(state, first_token_id, first_logprob)
        self._states[plan.request_id] = state
        self.scheduler.add_running(state)
        if replayed.finish is not None:
            self._pending.append(self._end(state, replayed.finish, error))

    def cancel_import(self, plan: ImportPlan) -> None:
        """Free every block the plan allocated."""
        self._import_state(plan)
        del self._imports[plan.request_id]
        self.kv.free(plan.request_id)

    # ---- stats --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return EngineStats(
            running=self.scheduler.num_running,
            waiting=self.scheduler.num_waiting,
            kv_blocks_free=self.pool.num_free_blocks,
            kv_blocks_total=self.pool.num_blocks,
            block_size=self.config.block_size,
            prefix_queries_tokens=self.kv.prefix_query_tokens,
            prefix_hit_tokens=self.kv.prefix_hit_tokens,
            cached_block_hashes=self.pool.cached_hashes(),
            tokens_per_second=self.throughput.tokens_per_second(),
            peak_tokens_per_second=self.throughput.peak_tokens_per_second(),
            layout=self.layout,
            fingerprint=self.fingerprint,
            num_held_handles=self.kv.num_held,
            num_preemptions=self.scheduler.num_preemptions,
            num_interrupted_steps=self.num_interrupted_steps,
        )

    # ---- internals ----------------------------------------------------------------------

    def _check_new(self, req: EngineRequest, max_new_tokens: int) -> None:
        rid = req.request_id
        if rid in self._states or rid in self._imports or rid in self._ready_handles:
            raise ValueError(f"request id {rid!r} is already in use")
        req.validate(self.vocab_size, self.context_length)
        # The last sampled token is never computed, so it needs no KV slot.
        kv_tokens = min(len(req.prompt_token_ids) + max_new_tokens, self.context_length) - 1
        needed = cdiv(kv_tokens, self.config.block_size)
        if needed > self.pool.num_blocks:
            raise KvCapacityError(
                f"request needs up to {needed} KV blocks, the pool has {self.pool.num_blocks}"
            )

    def _new_state(self, req: EngineRequest, hold_after_prefill: bool) -> RequestState:
        detokenizer = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids)
        processor = OutputProcessor(
            req.sampling, detokenizer, self.tokenizer.eos_token_ids, self.context_length
        )
        constraint = req.sampling.constraint
        return RequestState(
            matcher=None if constraint is None else self.grammars.matcher(constraint),
            request=req,
            arrival_seq=next(self._arrivals),
            token_ids=list(req.prompt_token_ids),
            num_prompt_tokens=len(req.prompt_token_ids),
            processor=processor,
            hold_after_prefill=hold_after_prefill,
        )

    def _import_state(self, plan: ImportPlan) -> RequestState:
        entry = self._imports.get(plan.request_id)
        if entry is None or entry[0] is not plan:
            raise KeyError(f"no import in progress for request {plan.request_id!r}")
        return entry[1]

    def _batch_entry(self, chunk: ScheduledChunk) -> BatchEntry:
        state = chunk.state
        end = chunk.start_pos + chunk.num_tokens
        return BatchEntry(
            token_ids=state.token_ids[chunk.start_pos : end],
            start_pos=chunk.start_pos,
            block_table=self.kv.block_table(state.request_id),
            want_logits=chunk.want_logits,
        )

    def _append_token(
        self, state: RequestState, token_id: int, logprob: TokenLogprob | None
    ) -> RequestOutput:
        state.token_ids.append(token_id)
        emission, error = self._after_token(state, token_id, logprob)
        if emission.finish is not None:
            self._retire(state)
        elif state.hold_after_prefill:
            self._hold(state)
        return self._output(state, emission, error, sampled=(token_id, logprob))

    def _after_token(
        self, state: RequestState, token_id: int, logprob: TokenLogprob | None
    ) -> tuple[Emission, str | None]:
        """What one token (already in state.token_ids) releases, and the error if it breaks
        the constraint: stop conditions first, then the grammar, which ends the request once
        it is complete."""
        emission = state.processor.process(
            token_id, logprob, state.num_output_tokens, state.num_tokens
        )
        matcher = state.matcher
        if emission.finish is not None or matcher is None:
            return emission, None
        if not matcher.accept(token_id):
            emission.finish = FinishReason.ERROR
            return emission, f"token {token_id} breaks the output constraint"
        if matcher.is_terminated():
            return emission.then(state.processor.flush(FinishReason.STOP)), None
        return emission, None

    def _hold(self, state: RequestState) -> None:
        handle_id = uuid.uuid4().hex
        num_tokens = state.num_computed_tokens
        hashes = self.kv.sequence_hashes(state, num_tokens)
        blocks = self.kv.hold(state.request_id, handle_id)
        self.scheduler.remove(state)
        del self._states[state.request_id]
        self._ready_handles[state.request_id] = KvHandle(
            handle_id, list(blocks), hashes, num_tokens
        )

    def _end(
        self, state: RequestState, reason: FinishReason, error: str | None = None
    ) -> RequestOutput:
        """Finish a request from outside the sampler (abort, deadline, error)."""
        self._retire(state)
        return self._output(state, state.processor.flush(reason), error)

    def _retire(self, state: RequestState) -> None:
        self.scheduler.remove(state)
        self.kv.free(state.request_id)
        del self._states[state.request_id]

    def _output(
        self,
        state: RequestState,
        emission: Emission,
        error: str | None = None,
        sampled: tuple[int, TokenLogprob | None] | None = None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=state.request_id,
            new_token_ids=emission.token_ids,
            text_delta=emission.text,
            logprobs=emission.logprobs or None,
            finish_reason=emission.finish,
            num_prompt_tokens=state.num_prompt_tokens,
            num_cached_prompt_tokens=state.num_cached_prompt_tokens,
            num_output_tokens=state.num_output_tokens,
            error=error,
            sampled_token_id=None if sampled is None else sampled[0],
            sampled_logprob=None if sampled is None else sampled[1],
        )

    def _expire_deadlines(self, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        expired = [
            state
            for state in self._states.values()
            if state.request.deadline is not None and state.request.deadline <= now
        ]
        outputs.extend(self._end(state, FinishReason.DEADLINE) for state in expired)


def select_blocks(block_ids: list[int], indices: list[int]) -> list[int]:
    """The blocks at `indices` of a handle's `block_ids` (ValueError: an index outside)."""
    for index in indices:
        if not 0 <= index < len(block_ids):
            raise ValueError(f"block index {index} outside the handle's {len(block_ids)} blocks")
    return [block_ids[index] for index in indices]


def _num_blocks(loaded: LoadedModel, config: EngineConfig) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    block_bytes = ModelRunner.bytes_per_block(loaded.config, loaded.dtype, config.block_size)
    num_blocks = config.kv_cache_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"kv_cache_bytes={config.kv_cache_bytes} is smaller than one KV block ({block_bytes} B)"
        )
    return num_blocks
