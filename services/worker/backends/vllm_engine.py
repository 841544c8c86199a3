"""VllmEngine: the engine API (docs/engine_api.md) on vLLM's AsyncLLM, running in this process.

Generation maps onto vLLM request for request: sampling, stop token ids, seed, logprobs and
the cache salt go into vLLM's SamplingParams and prompt; what each token releases and when the
request stops (stop strings, stop tokens, max_tokens) is decided by kvmesh's OutputProcessor
over vLLM's token ids, as on the native engine; priority into vLLM's priority scheduling;
aborts into AsyncLLM.abort; a structured-output constraint into vLLM's structured outputs
(vllm_constraints.py). vLLM has no deadlines, so each request's deadline is
a timeout here that aborts it in vLLM and ends it with DEADLINE.

KV hand-off goes through kvmesh's connector (vllm_connector.py) and an entry store both sides
see (kv_files.py):
- prefill_and_hold runs the prompt with max_tokens=1 and asks the connector to export its
  blocks; the entry, not vLLM's pool, is what the lease holds, so vLLM's blocks go back to its
  prefix cache at once and a lease can never starve running requests.
- start_import / write_imported_block fill an entry with the pulled blocks; commit_import
  submits prompt + first token, and the connector loads the entry into vLLM's cache before
  the first forward pass. Blocks are named by kvmesh's chained hashes (same model fingerprint,
  block size and cache salt give the same names as on a native worker).

vLLM's own prefix cache lives in its scheduler process and cannot be queried from here, so the
hashes this engine reports as cached (stats, and the leading blocks start_import does not pull)
are those of prompts it recently ran, capped to its pool size. If vLLM evicted them meanwhile,
the connector offers nothing and vLLM recomputes the prompt: slower, never wrong.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm import SamplingParams as VllmSamplingParams
from vllm.config import KVTransferConfig, StructuredOutputsConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase

from kvmesh.contracts.block_hashes import hash_block_chain
from kvmesh.contracts.constraints import ConstraintError
from kvmesh.contracts.model_facts import read_model_facts
from kvmesh.contracts.model_files import resolve_model_path
from kvmesh.contracts.tokenizer import IncrementalDetokenizer
from services.worker.backends import vllm_connector
from services.worker.backends.kv_files import BlockFiles, make_store_dir
from services.worker.backends.kv_wire import WIRE_FORMATS
from services.worker.backends.vllm_constraints import VLLM_GRAMMAR_BACKENDS, structured_outputs
from services.worker.engine.api import (
    EngineRequest,
    EngineStats,
    FinishReason,
    ImportPlan,
    KvCapacityError,
    KvHandle,
    KvLayout,
    RequestOutput,
    SamplingParams,
    TokenLogprob,
)
from services.worker.engine.config import STEP_TOKENS, EngineConfig
from services.worker.engine.kv_cache_manager import cdiv
from services.worker.engine.loader import dtype_name, load_model, save_hf_folder, torch_dtype
from services.worker.engine.output_processor import Emission, OutputProcessor
from services.worker.engine.throughput import ThroughputMeter

log = logging.getLogger(__name__)

# vLLM's CPU attention kernels take blocks of a multiple of 32 tokens.
CPU_BLOCK_MULTIPLE = 32
VLLM_BLOCK_SIZE = 128
"""vLLM's own block size on a CPU, which its server runs: its decode attention is faster on
it than on 32-token blocks. bench.peers' serving row on an Intel Xeon (family 6 model 207, 2
cores), `kvmesh up --engine vllm` against vLLM's own server, two runs an hour apart on a
calm host: TPOT 106 against 101 ms and 0.96x the output tok/s on 128-token blocks, 122
against 105 ms and 0.88x on 32."""
_FINISH_REASONS = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
    "error": FinishReason.ERROR,
}


@dataclass(slots=True)
class _Load:
    """vLLM's load as its stat loggers report it, accumulated between Stats calls."""

    running: int = 0
    waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_queries_tokens: int = 0
    prefix_hit_tokens: int = 0
    # Prompt tokens whose KV the connector loaded (imported) instead of vLLM computing them.
    kv_loaded_tokens: int = 0
    throughput: ThroughputMeter = field(default_factory=ThroughputMeter)


class _LoadRecorder(StatLoggerBase):
    """A vLLM stat logger that copies each step's scheduler stats into a _Load."""

    def __init__(self, load: _Load, vllm_config: Any, engine_index: int = 0) -> None:
        self._load = load

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is not None:
            self._load.running = scheduler_stats.num_running_reqs
            self._load.waiting = scheduler_stats.num_waiting_reqs
            self._load.kv_cache_usage = scheduler_stats.kv_cache_usage
            self._load.prefix_queries_tokens += scheduler_stats.prefix_cache_stats.queries
            self._load.prefix_hit_tokens += scheduler_stats.prefix_cache_stats.hits
            if scheduler_stats.connector_prefix_cache_stats is not None:
                self._load.kv_loaded_tokens += scheduler_stats.connector_prefix_cache_stats.hits
        if iteration_stats is not None and iteration_stats.num_generation_tokens:
            self._load.throughput.record(iteration_stats.num_generation_tokens)

    def log_engine_initialized(self) -> None:
        return


@dataclass(slots=True)
class _Import:
    plan: ImportPlan
    key: str
    first_index: int  # blocks before it are expected in vLLM's own prefix cache


def default_block_size(kv_wire_format: str) -> int:
    """The block size where the configured one does not suit vLLM: its own, except in the
    native byte order, whose hand-offs with native workers need 32-token blocks on both sides
    (the smallest vLLM's kernels take; native workers run `--block-size 32`)."""
    return CPU_BLOCK_MULTIPLE if kv_wire_format == "native" else VLLM_BLOCK_SIZE


class VllmEngine:
    """The engine API over vLLM (see the module docstring)."""

    def __init__(
        self, config: EngineConfig, *, kv_wire_format: str = "vllm", eager: bool = False
    ) -> None:
        """Loads the model's metadata and fingerprint (blocking); start() launches vLLM,
        compiled by inductor unless `eager`."""
        config.validate()
        if kv_wire_format not in WIRE_FORMATS:
            raise ValueError(
                f"kv_wire_format must be one of {WIRE_FORMATS}, got {kv_wire_format!r}"
            )
        if config.quantization != "none":
            raise ValueError("the vLLM backend serves unquantized weights only")
        if config.block_size % CPU_BLOCK_MULTIPLE:
            # e.g. the native default of 16: vLLM takes its own size, and the layout says so.
            config = config.replace(block_size=default_block_size(kv_wire_format))
        self.config = config
        self._wire_format = kv_wire_format
        self._eager = eager
        self._work_dir = make_store_dir()
        dtype = torch_dtype(config.dtype, config.device)
        path = resolve_model_path(config.model)
        if path.is_dir():
            # No model is built here: vLLM loads the weights itself, whatever the architecture;
            # shape, tokenizer and fingerprint come from the files (kvmesh.contracts).
            facts = read_model_facts(path, config.model, dtype_name(dtype))
            self._model_dir = path
        else:
            # vLLM reads Hugging Face folders: a GGUF model is converted into one first.
            loaded = load_model(config.model, device=config.device, dtype=dtype)
            facts = loaded.facts()
            self._model_dir = self._work_dir / "model"
            save_hf_folder(loaded, self._model_dir)
            del loaded
        self.tokenizer = facts.tokenizer
        self.fingerprint = facts.fingerprint
        self.model_name = facts.name
        self.vocab_size = facts.vocab_size
        max_len = facts.max_position_embeddings
        self.context_length = min(config.max_model_len or max_len, max_len)
        self.layout = KvLayout(
            dtype=dtype_name(dtype),
            block_size=config.block_size,
            num_layers=facts.num_layers,
            num_kv_heads=facts.num_kv_heads,
            head_dim=facts.head_dim,
            engine="native" if kv_wire_format == "native" else "vllm",
        )
        self._store_dir = self._work_dir / "kv"
        self._store_dir.mkdir()
        self._files = BlockFiles(self._store_dir, self.layout.block_bytes)
        self._num_blocks = config.num_kv_blocks or config.kv_cache_bytes // self.layout.block_bytes
        self._llm: AsyncLLM | None = None
        self._load = _Load()
        self._held: dict[str, int] = {}  # lease handle id (= entry key) -> blocks
        self._imports: dict[str, _Import] = {}
        self._live: set[str] = set()
        self._known_hashes: OrderedDict[bytes, None] = OrderedDict()

    @classmethod
    def from_config(
        cls, config: EngineConfig, *, kv_wire_format: str = "vllm", eager: bool = False
    ) -> VllmEngine:
        return cls(config, kv_wire_format=kv_wire_format, eager=eager)

    # ---- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        """Launch vLLM's engine processes (blocking for the model load, tens of seconds)."""
        if self._llm is not None:
            return
        # vLLM's CPU docs: bind its model runner's OpenMP threads to every core (by default
        # it keeps one for its engine loop). A set thread count (a shared machine, tests)
        # binds none and runs that many; VLLM_CPU_OMP_THREADS_BIND in the environment wins.
        if self.config.num_threads is None:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", every_core())
        else:
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
            os.environ["OMP_NUM_THREADS"] = str(self.config.num_threads)
        try:
            self._llm = AsyncLLM.from_engine_args(
                self._engine_args(), stat_loggers=[self._make_load_recorder]
            )
        except BaseException:
            shutil.rmtree(self._work_dir, ignore_errors=True)  # nobody will call shutdown()
            raise

    def _make_load_recorder(self, vllm_config: Any, engine_index: int) -> StatLoggerBase:
        return _LoadRecorder(self._load, vllm_config, engine_index)

    def _engine_args(self) -> AsyncEngineArgs:
        config = self.config
        transfer = KVTransferConfig(
            kv_connector="KvmeshConnector",
            kv_connector_module_path=vllm_connector.__name__,
            kv_role="kv_both",
            kv_connector_extra_config={
                vllm_connector.EXTRA_STORE_DIR: str(self._store_dir),
                vllm_connector.EXTRA_BLOCK_BYTES: self.layout.block_bytes,
                vllm_connector.EXTRA_WIRE_FORMAT: self._wire_format,
            },
        )
        return AsyncEngineArgs(
            model=str(self._model_dir),
            dtype=self.layout.dtype,
            block_size=config.block_size,
            kv_cache_memory_bytes=self._num_blocks * self.layout.block_bytes,
            max_model_len=self.context_length,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens or STEP_TOKENS,
            enable_prefix_caching=config.enable_prefix_caching,
            scheduling_policy="priority",
            enforce_eager=self._eager,
            disable_log_stats=False,
            kv_transfer_config=transfer,
            # Compact JSON, as on the native engine: no run of whitespace to wander into.
            structured_outputs_config=StructuredOutputsConfig(
                backend=VLLM_GRAMMAR_BACKENDS[config.grammar_backend],
                disable_any_whitespace=True,
            ),
        )

    async def shutdown(self) -> None:
        """Stop vLLM (open streams end with ABORT) and delete every entry."""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
        self._held.clear()
        self._imports.clear()
        shutil.rmtree(self._work_dir, ignore_errors=True)

    @property
    def llm(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError("VllmEngine is not running: await start() first")
        return self._llm

    @property
    def kv_loaded_tokens(self) -> int:
        """Prompt tokens imported through the connector so far (vLLM computed none of them)."""
        return self._load.kv_loaded_tokens

    @property
    def num_entries(self) -> int:
        """Entries on disk: held leases and imports in progress (0 when nothing is held)."""
        return len(self._files.keys())

    def stats(self) -> EngineStats:
        load = self._load
        total = self.llm.vllm_config.cache_config.num_gpu_blocks or self._num_blocks
        used = round(load.kv_cache_usage * total)
        return EngineStats(
            running=load.running,
            waiting=load.waiting,
            kv_blocks_free=total - used,
            kv_blocks_total=total,
            block_size=self.layout.block_size,
            prefix_queries_tokens=load.prefix_queries_tokens,
            prefix_hit_tokens=load.prefix_hit_tokens,
            cached_block_hashes=list(self._known_hashes),
            tokens_per_second=load.throughput.tokens_per_second(),
            peak_tokens_per_second=load.throughput.peak_tokens_per_second(),
            layout=self.layout,
            fingerprint=self.fingerprint,
            num_held_handles=len(self._held),
        )

    # ---- generation ---------------------------------------------------------------------

    async def generate(self, req: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes; closing the iterator early aborts it."""
        self._check_new(req, req.sampling.max_tokens)
        self._remember_prompt(req)
        params = self._sampling(req.sampling, req.sampling.max_tokens)
        async for output in self._run(req, params):
            yield output

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def _run(
        self,
        req: EngineRequest,
        params: VllmSamplingParams,
        *,
        first_token: tuple[int, TokenLogprob | None] | None = None,
        cached_prompt_tokens: int | None = None,
        hold_open: bool = False,
    ) -> AsyncIterator[RequestOutput]:
        """One vLLM request's outputs as engine outputs, until it finishes or its deadline.

        kvmesh's own OutputProcessor decides what each token releases and when the request
        stops (stop strings, stop tokens, max_tokens, the context), as on the native engine:
        token ids and text describe the same tokens; closing vLLM's stream aborts it there.
        first_token: the token a prefill engine sampled (its output already went out): it is
        replayed through the processor, and vLLM continues after it.
        hold_open: vLLM stopping at its own max_tokens (the prefill's one token) does not end
        the request.
        """
        processor = OutputProcessor(
            req.sampling,
            IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids),
            self.tokenizer.eos_token_ids,
            self.context_length,
        )
        prompt_ids = list(req.prompt_token_ids)
        num_output = 0
        if first_token is not None:
            prompt_ids.append(first_token[0])
            num_output = 1
            replayed = processor.process(*first_token, num_output, len(prompt_ids))
            if replayed.finish is not None:
                yield self._output(req, Emission(finish=replayed.finish), num_output, 0)
                return
        rid = req.request_id
        prompt = TokensPrompt(prompt_token_ids=prompt_ids)
        if req.cache_salt:
            prompt["cache_salt"] = req.cache_salt.hex()
        self._live.add(rid)
        stream = self.llm.generate(prompt, params, rid, priority=int(req.priority))
        num_cached = 0
        try:
            while True:
                try:
                    async with asyncio.timeout_at(req.deadline):
                        out = await anext(stream)
                except StopAsyncIteration:
                    return
                except VLLMValidationError as error:  # raised before any token
                    constraint = req.sampling.constraint
                    if constraint is None:
                        raise ValueError(str(error)) from None
                    raise ConstraintError(constraint.field, str(error)) from None
                except TimeoutError:
                    emission = processor.flush(FinishReason.DEADLINE)
                    yield self._output(req, emission, num_output, num_cached)
                    return
                completion = out.outputs[0]
                num_cached = (
                    cached_prompt_tokens
                    if cached_prompt_tokens is not None
                    else (out.num_cached_tokens or 0)
                )
                logprobs = _logprobs(completion.logprobs, req.sampling.logprobs)
                emission, fed, sampled = _feed(
                    processor, completion.token_ids, logprobs, req, num_output
                )
                num_output += fed
                ended_by_vllm = completion.finish_reason is not None and not hold_open
                if emission.finish is None and ended_by_vllm:
                    # vLLM ended it for a reason of its own (an abort, an error).
                    reason = _FINISH_REASONS.get(str(completion.finish_reason), FinishReason.ERROR)
                    emission = emission.then(processor.flush(reason))
                yield self._output(req, emission, num_output, num_cached, sampled)
                if emission.finish is not None or completion.finish_reason is not None:
                    return
        finally:
            self._live.discard(rid)
            await stream.aclose()  # aborts the request in vLLM if it has not finished

    def _output(
        self,
        req: EngineRequest,
        emission: Emission,
        num_output: int,
        num_cached: int,
        sampled: tuple[int, TokenLogprob | None] | None = None,
    ) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=emission.token_ids,
            text_delta=emission.text,
            logprobs=emission.logprobs or None,
            finish_reason=emission.finish,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_cached_prompt_tokens=num_cached,
            num_output_tokens=num_output,
            sampled_token_id=None if sampled is None else sampled[0],
            sampled_logprob=None if sampled is None else sampled[1],
        )

    def _sampling(
        self, sampling: SamplingParams, max_tokens: int, kv_params: dict[str, Any] | None = None
    ) -> VllmSamplingParams:
        constraint = sampling.constraint
        return VllmSamplingParams(
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_k=sampling.top_k,
            top_p=sampling.top_p,
            seed=sampling.seed,
            # Stop strings are kvmesh's (OutputProcessor in _run); the stop tokens stay vLLM's
            # too, so that it stops computing at once.
            stop_token_ids=list(sampling.stop_token_ids),
            logprobs=sampling.logprobs,
            ignore_eos=sampling.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            structured_outputs=(
                None
                if constraint is None
                else structured_outputs(constraint, self.config.grammar_backend)
            ),
            extra_args={"kv_transfer_params": kv_params} if kv_params else None,
        )

    # ---- KV export (prefill role) -------------------------------------------------------

    async def prefill_and_hold(self, req: EngineRequest) -> tuple[RequestOutput, KvHandle | None]:
        """Run the prompt, sample the first token, keep the prompt's blocks in an entry.

        The handle is None when the first token already finished the request.
        """
        self._check_new(req, 1)
        self._remember_prompt(req)
        key = uuid.uuid4().hex
        params = self._sampling(req.sampling, 1, {vllm_connector.PARAM_EXPORT: key})
        outputs: list[RequestOutput] = []
        try:
            async for output in self._run(req, params, hold_open=True):
                outputs.append(output)
            first = _merge(outputs)
            if first.finish_reason is not None:
                self._files.delete(key)
                return first, None
            num_blocks = cdiv(len(req.prompt_token_ids), self.layout.block_size)
            if self._files.num_blocks(key) != num_blocks:
                raise RuntimeError(
                    f"vLLM exported {self._files.num_blocks(key)} blocks, not {num_blocks}"
                )
        except BaseException:
            self._files.delete(key)
            raise
        self._held[key] = num_blocks
        handle = KvHandle(
            handle_id=key,
            block_ids=list(range(num_blocks)),
            block_hashes=self._hashes(req),
            num_tokens=len(req.prompt_token_ids),
        )
        return first, handle

    async def export_blocks(self, handle_id: str, indices: list[int]) -> list[bytes]:
        """Bytes of some of a held entry's blocks (KeyError: unknown handle)."""
        if handle_id not in self._held:
            raise KeyError(handle_id)
        return await asyncio.to_thread(self._files.read_blocks, handle_id, indices)

    async def release(self, handle_id: str) -> int:
        """Drop a held entry; returns its blocks (KeyError: unknown handle)."""
        num_blocks = self._held.pop(handle_id)
        self._files.delete(handle_id)
        return num_blocks

    # ---- KV import (decode role) --------------------------------------------------------

    async def start_import(
        self, req: EngineRequest, block_hashes: list[bytes], num_tokens: int
    ) -> ImportPlan:
        """An entry for a request prefilled elsewhere; leading blocks this engine ran
        recently are not pulled. Raises KvCapacityError when vLLM's pool cannot hold it."""
        if num_tokens != len(req.prompt_token_ids):
            raise ValueError(
                f"the lease covers {num_tokens} tokens, the prompt has {len(req.prompt_token_ids)}"
            )
        if req.request_id in self._imports:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        constraint = req.sampling.constraint
        if constraint is not None:
            # vLLM starts a grammar at the first output token and takes none already produced,
            # so it could not continue after the prefill's constrained first token.
            raise ConstraintError(
                constraint.field,
                "a vLLM decode worker cannot continue a constrained answer prefilled elsewhere; "
                "serve it on a colocated worker",
            )
        self._check_new(req, req.sampling.max_tokens)
        expected = self._hashes(req)
        if list(block_hashes) != expected:
            raise ValueError(
                "the lease's block hashes are not this prompt's under this worker's model, "
                f"block size ({self.layout.block_size}) and cache salt"
            )
        num_full = num_tokens // self.layout.block_size
        reused = 0
        while reused < num_full and expected[reused] in self._known_hashes:
            reused += 1
        key = uuid.uuid4().hex
        self._files.create(key, len(expected))
        missing = list(range(reused, len(expected)))
        plan = ImportPlan(req.request_id, missing, list(range(len(expected))), num_tokens, req)
        self._imports[req.request_id] = _Import(plan, key, reused)
        return plan

    async def write_imported_block(self, plan: ImportPlan, index: int, data: bytes) -> None:
        entry = self._import(plan)
        if index not in plan.missing_indices:
            raise ValueError(f"block {index} is not one the plan pulls")
        await asyncio.to_thread(self._files.write_block, entry.key, index, data)
        plan.written.add(index)

    async def commit_import(
        self, plan: ImportPlan, first_token_id: int, first_logprob: TokenLogprob | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Decoding continues after first_token_id; outputs as from generate()."""
        entry = self._import(plan)
        unwritten = sorted(set(plan.missing_indices) - plan.written)
        if unwritten:
            raise ValueError(f"blocks {unwritten} of the plan were never written")
        if not 0 <= first_token_id < self.vocab_size:
            raise ValueError(f"first token id {first_token_id} outside the vocabulary")
        del self._imports[plan.request_id]
        req = plan.request
        try:
            self._remember_prompt(req)
            cached = entry.first_index * self.layout.block_size
            params = self._sampling(
                req.sampling,
                max(req.sampling.max_tokens - 1, 1),
                {
                    vllm_connector.PARAM_IMPORT: {
                        "key": entry.key,
                        "num_tokens": plan.num_tokens,
                        "first_index": entry.first_index,
                    }
                },
            )
            async for output in self._run(
                req,
                params,
                first_token=(first_token_id, first_logprob),
                cached_prompt_tokens=cached,
            ):
                yield output
        finally:
            self._files.delete(entry.key)

    async def cancel_import(self, plan: ImportPlan) -> None:
        """Drop the entry of an import that will not be committed."""
        entry = self._import(plan)
        del self._imports[plan.request_id]
        self._files.delete(entry.key)

    def _import(self, plan: ImportPlan) -> _Import:
        entry = self._imports.get(plan.request_id)
        if entry is None or entry.plan is not plan:
            raise KeyError(f"no import in progress for request {plan.request_id!r}")
        return entry

    # ---- internals ----------------------------------------------------------------------

    def _check_new(self, req: EngineRequest, max_new_tokens: int) -> None:
        if req.request_id in self._live:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        req.validate(self.vocab_size, self.context_length)
        kv_tokens = min(len(req.prompt_token_ids) + max_new_tokens, self.context_length)
        needed = cdiv(kv_tokens, self.layout.block_size)
        if needed > self._num_blocks:
            raise KvCapacityError(
                f"request needs up to {needed} KV blocks, the pool has {self._num_blocks}"
            )

    def _hashes(self, req: EngineRequest) -> list[bytes]:
        return hash_block_chain(
            req.prompt_token_ids, self.layout.block_size, self.fingerprint, req.cache_salt
        )

    def _remember_prompt(self, req: EngineRequest) -> None:
        """Note the prompt's full blocks as (probably) in vLLM's prefix cache."""
        if not self.config.enable_prefix_caching:
            return
        num_full = len(req.prompt_token_ids) // self.layout.block_size
        for block_hash in self._hashes(req)[:num_full]:
            self._known_hashes[block_hash] = None
            self._known_hashes.move_to_end(block_hash)
        while len(self._known_hashes) > self._num_blocks:
            self._known_hashes.popitem(last=False)


def every_core() -> str:
    """VLLM_CPU_OMP_THREADS_BIND naming every core of the machine ("0-1")."""
    return f"0-{(os.cpu_count() or 1) - 1}"


def _feed(
    processor: OutputProcessor,
    token_ids: Sequence[int],
    logprobs: list[TokenLogprob] | None,
    req: EngineRequest,
    num_output: int,
) -> tuple[Emission, int, tuple[int, TokenLogprob | None] | None]:
    """What vLLM's new tokens release, how many were fed (up to the one that ends it), and
    the last one fed with its logprob."""
    emission = Emission()
    sampled: tuple[int, TokenLogprob | None] | None = None
    fed = 0
    for fed, token_id in enumerate(token_ids, start=1):
        sampled = (token_id, logprobs[fed - 1] if logprobs else None)
        total = len(req.prompt_token_ids) + num_output + fed
        emission = emission.then(processor.process(*sampled, num_output + fed, total))
        if emission.finish is not None:
            break
    return emission, fed, sampled


def _merge(outputs: list[RequestOutput]) -> RequestOutput:
    """One output carrying every token and text delta of several (the last one's counts)."""
    if not outputs:
        raise RuntimeError("vLLM ended the request without any output")
    last = outputs[-1]
    logprobs = [entry for output in outputs for entry in output.logprobs or []]
    return RequestOutput(
        request_id=last.request_id,
        new_token_ids=[t for output in outputs for t in output.new_token_ids],
        text_delta="".join(output.text_delta for output in outputs),
        logprobs=logprobs if any(o.logprobs is not None for o in outputs) else None,
        finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_cached_prompt_tokens=last.num_cached_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        error=last.error,
        sampled_token_id=next(
            (o.sampled_token_id for o in reversed(outputs) if o.sampled_token_id is not None), None
        ),
        sampled_logprob=next(
            (o.sampled_logprob for o in reversed(outputs) if o.sampled_logprob is not None), None
        ),
    )


def _logprobs(entries: Any, num_top: int | None) -> list[TokenLogprob] | None:
    """vLLM's per-token {token id: Logprob} dicts (the sampled token first, then the top
    ones) as engine TokenLogprobs."""
    if num_top is None or entries is None:
        return None
    result = []
    for position in entries:
        sampled_id, sampled = next(iter(position.items()))
        ranked = sorted(position.items(), key=lambda item: item[1].rank)
        top = [(token_id, float(lp.logprob)) for token_id, lp in ranked[:num_top]]
        result.append(TokenLogprob(sampled_id, float(sampled.logprob), top))
    return result
