"""Every registered family beyond Llama (Qwen2, Qwen3, Mistral) against transformers, on tiny
random checkpoints written from transformers' own config classes (tests/tiny_checkpoints.py):
greedy tokens in a staggered continuous batch on both kernel paths, logits at every position,
the KV hand-off, prefix caching, int8, the offline LLM API, GGUF files, and the checkpoints
the engine refuses."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM

from kvmesh.contracts.constraints import Constraint, ConstraintKind
from services.worker.engine.api import EngineRequest, FinishReason, SamplingParams
from services.worker.engine.decode_kernel import load_decode_kernel
from services.worker.engine.decode_layers_kernel import DecodeLayers
from services.worker.engine.linear_kernel import (
    TRANSPOSED_MAX_ROWS,
    PackedProject,
    SmallBatchLinear,
    choose_bfloat16_project,
    load_linear_kernel,
    onednn_available,
)
from services.worker.engine.llm import LLM
from services.worker.engine.loader import LoadedModel, ModelLoadError, load_model, save_hf_folder
from services.worker.engine.model_runner import BatchEntry, ModelRunner
from services.worker.engine.models.llama import LlamaModel
from services.worker.engine.prefill_kernel import load_prefill_kernel
from services.worker.engine.rope_store_kernel import load_rope_store_kernel
from tests.tiny_checkpoints import (
    FAMILIES,
    TINY_CORPUS,
    TinyFamily,
    write_tiny_checkpoint,
    write_tiny_gguf,
)
from tests.unit.engine.greedy import transformers_greedy
from tests.unit.engine.test_engine import (
    GREEDY,
    NUM_NEW,
    PROMPT_LENGTHS,
    drive,
    make_engine,
    staggered,
)
from tests.unit.engine.test_structured_output import SCHEMAS, parse_json, sampling
from tests.unit.engine.test_structured_output import make_engine as grammar_engine
from tests.unit.engine.test_structured_output import prompt as constrained_prompt

FAMILY_NAMES = ["qwen2", "qwen3", "mistral"]
BLOCK_SIZE = 16
CPU = torch.device("cpu")
LOGIT_PROMPT = 64
# fp32 logits of the engine against transformers' (measured max |diff| over all 64 positions,
# both paths, all three families: 0.7e-5 to 4.0e-5, logits up to 8.3 in size).
LOGIT_TOLERANCE = 1e-4
# Share of positions where int8 picks the fp32 model's argmax (measured: 0.91-0.95).
INT8_AGREEMENT = 0.85


@pytest.fixture(scope="module", params=FAMILY_NAMES)
def family(request: pytest.FixtureRequest) -> TinyFamily:
    return FAMILIES[request.param]


@pytest.fixture(scope="module")
def family_dir(family: TinyFamily, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(family, tmp_path_factory.mktemp(f"tiny_{family.name}"))


@pytest.fixture(scope="module")
def loaded(family_dir: Path) -> LoadedModel:
    return load_model(str(family_dir))


@pytest.fixture(scope="module")
def hf_model(family_dir: Path) -> Any:
    return AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(loaded: LoadedModel) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    vocab = loaded.config.vocab_size
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def hf_greedy(family_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return transformers_greedy(family_dir, prompts, NUM_NEW)


def test_config_has_the_family_shape(family: TinyFamily, loaded: LoadedModel) -> None:
    config = loaded.config
    fields = family.fields
    assert config.model_type == family.name
    assert (config.num_heads, config.num_kv_heads) == (
        fields["num_attention_heads"],
        fields["num_key_value_heads"],
    )
    assert config.head_dim == fields.get("head_dim", fields["hidden_size"] // config.num_heads)
    assert config.vocab_size == fields["vocab_size"] and config.vocab_size % 2 == 1
    assert config.tie_word_embeddings == fields["tie_word_embeddings"]
    assert config.qkv_bias == (family.name == "qwen2")
    assert config.qk_norm == (family.name == "qwen3")
    assert config.sliding_window == fields.get("sliding_window")


@pytest.mark.parametrize("kernels", ["on", "off"])
def test_greedy_staggered_continuous_batch_matches_transformers(
    loaded: LoadedModel, prompts: list[list[int]], hf_greedy: list[list[int]], kernels: str
) -> None:
    engine = make_engine(
        loaded,
        decode_attention="kernel" if kernels == "on" else "sdpa",
        prefill_attention="kernel" if kernels == "on" else "sdpa",
        rope_store="kernel" if kernels == "on" else "torch",
        small_batch_linear="kernel" if kernels == "on" else "torch",
    )
    assert isinstance(engine.runner.project, SmallBatchLinear) == (kernels == "on")
    results = drive(engine, staggered(prompts))
    for i, expected in enumerate(hf_greedy):
        assert results[f"r{i}"].token_ids == expected, f"prompt {i} ({len(prompts[i])} tokens)"
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


WIDE_BATCH = 24
"""Requests of the wide batch below: decode steps of up to 24 rows, past WIDE_MAX_ROWS."""
WIDE_MAX_ROWS = 16
"""The small-batch kernel's largest step in that test (its default on AVX-512; on AVX2 it is
48), so that the batch crosses every threshold on any CPU."""
WIDE_BUDGET = TRANSPOSED_MAX_ROWS + 32
"""Its token budget: the first step's prefill rows go past TRANSPOSED_MAX_ROWS (128)."""


@pytest.fixture(scope="module")
def wide_prompts(loaded: LoadedModel) -> list[list[int]]:
    generator = torch.Generator().manual_seed(13)
    vocab = loaded.config.vocab_size
    lengths = [5 + (7 * i) % 37 for i in range(WIDE_BATCH)]
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


@pytest.fixture(scope="module")
def hf_wide_greedy(family_dir: Path, wide_prompts: list[list[int]]) -> list[list[int]]:
    return transformers_greedy(family_dir, wide_prompts, NUM_NEW)


@pytest.mark.parametrize("large", ["panels", "onednn", "torch"])
def test_greedy_across_the_kernels_row_thresholds_matches_transformers(
    loaded: LoadedModel,
    wide_prompts: list[list[int]],
    hf_wide_greedy: list[list[int]],
    large: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The small-batch kernel, then the panel kernel, oneDNN on reordered weights or torch's
    transposed and plain products (large_batch_linear), each adding Qwen2's Q/K/V bias
    itself: steps of 1 to 16 rows, 17 to 128 and more than 128 in one continuous batch all
    give transformers' greedy tokens (with panels most steps run their layers in one call,
    which chooses between the kernels by the same thresholds)."""
    prompts = wide_prompts
    engine = make_engine(
        loaded,
        num_kv_blocks=WIDE_BATCH * 4,
        max_num_batched_tokens=WIDE_BUDGET,
        small_batch_linear="kernel",
        large_batch_linear=large,
    )
    rows: set[int] = set()
    project = engine.runner.project

    def recorded(module: torch.nn.Module, x: torch.Tensor, **fused: Any) -> torch.Tensor:
        rows.add(x.shape[0])
        return project(module, x, **fused)

    assert isinstance(project, SmallBatchLinear)
    # The layer-by-layer path's threshold; the one-call layers keep the one they were built
    # with, the default (WIDE_MAX_ROWS too where the kernels are built for AVX-512).
    project.max_rows = WIDE_MAX_ROWS
    engine.runner.project = recorded
    if (layers := engine.runner.decode_layers) is not None:
        monkeypatch.setattr(engine.runner, "decode_layers", RecordedLayers(layers, rows))
    # Six prompts at once (more prefill rows than TRANSPOSED_MAX_ROWS), then one per step.
    arrivals = {0: [EngineRequest(f"r{i}", prompts[i], GREEDY) for i in range(6)]}
    for i in range(6, WIDE_BATCH):
        arrivals[i - 5] = [EngineRequest(f"r{i}", prompts[i], GREEDY)]
    results = drive(engine, arrivals)
    assert max(rows) > TRANSPOSED_MAX_ROWS
    assert {n for n in rows if WIDE_MAX_ROWS < n <= TRANSPOSED_MAX_ROWS}
    assert {n for n in rows if n <= WIDE_MAX_ROWS}
    for i, tokens in enumerate(hf_wide_greedy):
        assert results[f"r{i}"].token_ids == tokens, f"prompt {i} ({len(prompts[i])} tokens)"


class RecordedLayers:
    """A runner's one-call decoder layers that note the rows of every step they run."""

    def __init__(self, layers: DecodeLayers, rows: set[int]) -> None:
        self.layers = layers
        self.rows = rows
        self.max_rows = layers.max_rows
        self.runs_prefills = layers.runs_prefills

    def __call__(self, hidden: torch.Tensor, *args: Any) -> torch.Tensor:
        self.rows.add(hidden.shape[0])
        return self.layers(hidden, *args)


def position_runner(loaded: LoadedModel, prompt_len: int, kernels: bool) -> ModelRunner:
    """A runner with a block table of its own for each prefix of the prompt, and one more."""
    threads = torch.get_num_threads()
    chosen: dict[str, Any] = (
        {"decode_kernel": load_decode_kernel(threads), "linear_kernel": load_linear_kernel(threads)}
        if kernels
        else {}
    )
    blocks = -(-prompt_len // BLOCK_SIZE)
    return ModelRunner(
        loaded, num_blocks=blocks * (prompt_len + 1), block_size=BLOCK_SIZE, **chosen
    )


def tables_of(prompt_len: int) -> list[list[int]]:
    blocks = -(-prompt_len // BLOCK_SIZE)
    return [list(range(i * blocks, (i + 1) * blocks)) for i in range(prompt_len + 1)]


def prefill_logits(loaded: LoadedModel, prompt: list[int], kernels: bool) -> torch.Tensor:
    """[positions, vocab]: every prefix of the prompt as its own prefill entry, one batch."""
    runner = position_runner(loaded, len(prompt), kernels)
    tables = tables_of(len(prompt))
    return runner.forward([BatchEntry(prompt[: n + 1], 0, tables[n]) for n in range(len(prompt))])


def decode_logits(loaded: LoadedModel, prompt: list[int], kernels: bool) -> torch.Tensor:
    """[positions, vocab]: the prompt fed one decode step at a time."""
    runner = position_runner(loaded, len(prompt), kernels)
    table = tables_of(len(prompt))[-1]
    return torch.stack(
        [
            runner.forward([BatchEntry([token], position, table)])[0]
            for position, token in enumerate(prompt)
        ]
    )


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
def test_logits_match_transformers_at_every_position(
    loaded: LoadedModel, hf_model: Any, kernels: bool
) -> None:
    generator = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, loaded.config.vocab_size, (LOGIT_PROMPT,), generator=generator)
    with torch.no_grad():
        expected = hf_model(prompt[None]).logits[0].float()
    for logits in (
        prefill_logits(loaded, prompt.tolist(), kernels),
        decode_logits(loaded, prompt.tolist(), kernels),
    ):
        torch.testing.assert_close(logits, expected, atol=LOGIT_TOLERANCE, rtol=LOGIT_TOLERANCE)


KERNEL_MODELS = ["float32", "int8", "bfloat16"]
"""The models the fused layers are checked on: float32 and int8 weights (the float32 build of
decode_layers.c), and bfloat16 (its bfloat16 build)."""


def kernel_model(kind: str, family_dir: Path, loaded: LoadedModel) -> LoadedModel:
    if kind == "bfloat16" and not onednn_available():
        pytest.skip("a bfloat16 model's projections need torch's oneDNN")
    if kind == "int8":
        return load_model(str(family_dir), quantization="int8")
    return load_model(str(family_dir), dtype=torch.bfloat16) if kind == "bfloat16" else loaded


def bfloat16_project(model: LoadedModel) -> PackedProject | None:
    """A bfloat16 model's projections as the engine chooses them (None for other dtypes). A
    test makes one and gives it to both its runners: each new one measures where oneDNN runs
    faster than the panel kernel, which a busy machine can move across a step's row count, and
    the two products round differently."""
    if model.dtype != torch.bfloat16:
        return None
    return choose_bfloat16_project("auto", "auto", CPU, model.dtype, torch.get_num_threads())


def kernel_runner(
    model: LoadedModel,
    prompts: int,
    fuse: bool,
    project: PackedProject | None,
    *,
    prefill: bool = False,
) -> ModelRunner:
    """A runner on the CPU kernels of the model's dtype (a float32 model's larger steps on
    panels; a bfloat16 model's on `project`), 4 blocks a prompt; chunks attend on the prefill
    kernel only when asked (through torch otherwise)."""
    threads, dtype = torch.get_num_threads(), model.dtype
    bfloat16 = dtype == torch.bfloat16
    return ModelRunner(
        model,
        num_blocks=4 * prompts,
        block_size=BLOCK_SIZE,
        decode_kernel=load_decode_kernel(threads, dtype),
        prefill_kernel=load_prefill_kernel(threads, dtype) if prefill else None,
        rope_store_kernel=load_rope_store_kernel(threads, dtype),
        linear_kernel=None if bfloat16 else load_linear_kernel(threads, "panels"),
        project=project,
        fuse_small_decodes=fuse,
    )


def kernel_projects(runner: ModelRunner) -> bool:
    """Whether the runner's projections run on the kernels, as the fused layers need: a
    bfloat16 model's stay on torch's ops where oneDNN has no bfloat16 products (AVX2)."""
    return isinstance(runner.project, SmallBatchLinear | PackedProject)


def small_batch_rows(runner: ModelRunner, kind: str) -> int:
    """The most rows of a step the runner's small-batch product computes in the fused layers
    (BFLOAT16_SMALL_MAX_ROWS for a bfloat16 model: fewer without AVX-512 BF16 pairs)."""
    project = runner.project
    assert isinstance(project, SmallBatchLinear | PackedProject)
    projections = project.layer_projections(kind == "int8")
    assert projections is not None
    return projections.small_rows


def fused_panels(runner: ModelRunner) -> bool:
    """Whether the runner's fused layers run steps past the small-batch kernel's rows on the
    panel kernel (a bfloat16 model's only where the panel kernel has a bfloat16 build)."""
    project = runner.project
    if isinstance(project, PackedProject):
        return project.crossover is not None
    return kernel_projects(runner)


@pytest.mark.parametrize("rows", [1, 3, 20], ids=["one", "few", "panels"])
@pytest.mark.parametrize("kind", KERNEL_MODELS)
def test_fused_decode_layers_give_the_layer_by_layer_logits_exactly(
    family_dir: Path, loaded: LoadedModel, kind: str, rows: int
) -> None:
    """Decode steps run all their layers in one C call (decode_layers_kernel.py) where the
    family's layers allow it (not Qwen3's per-head Q/K norm): the same kernels in the same
    order, so the logits equal the layer-by-layer path's bit for bit. One row runs on the
    small-batch kernel; 3 float32 rows on the panel kernel (PANEL_MIN_ROWS), 3 int8 or bfloat16
    ones on the small-batch kernel where it takes that many (without AVX-512 BF16, as on an
    Intel Xeon model 207 guest that shows AVX-512 but not BF16, neither its bfloat16 pairs nor
    the panel kernel's bfloat16 build run: it takes 1 bfloat16 row, and a 3-row step runs layer
    by layer); 20 rows are past its rows: float32 and bfloat16 projections
    on the panel kernel in both paths (bfloat16: where it has a bfloat16 build, else oneDNN,
    layer by layer), int8 ones layer by layer on torch."""
    model = kernel_model(kind, family_dir, loaded)
    generator = torch.Generator().manual_seed(9)
    # One block, a part-filled second, past the tiny Mistral window.
    prompts = [
        torch.randint(0, loaded.config.vocab_size, (n,), generator=generator).tolist()
        for n in ([5, 23, 40] * rows)[:rows]
    ]
    tables = [list(range(i * 4, (i + 1) * 4)) for i in range(len(prompts))]
    steps: dict[bool, torch.Tensor] = {}
    project = bfloat16_project(model)
    for fuse in (True, False):
        runner = kernel_runner(model, len(prompts), fuse, project)
        fused = runner.decode_layers
        assert (fused is not None) == (
            fuse and not loaded.config.qk_norm and kernel_projects(runner)
        )
        if fused is not None:
            panels = fused_panels(runner) and kind != "int8"
            small_rows = small_batch_rows(runner, kind)
            assert (rows <= fused.max_rows) == (rows <= small_rows or panels)
        runner.forward([BatchEntry(p[:-1], 0, t) for p, t in zip(prompts, tables, strict=True)])
        tokens, logits = [p[-1] for p in prompts], []
        for step in range(4):
            entries = [
                BatchEntry([token], len(p) - 1 + step, table)
                for token, p, table in zip(tokens, prompts, tables, strict=True)
            ]
            logits.append(runner.forward(entries))
            tokens = logits[-1].argmax(-1).tolist()
        steps[fuse] = torch.stack(logits)
    assert torch.equal(steps[True], steps[False])


@pytest.mark.parametrize("kind", KERNEL_MODELS)
def test_fused_layers_run_prefill_steps_with_the_layer_by_layer_logits_exactly(
    family_dir: Path, loaded: LoadedModel, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps with prefill chunks run their layers in the one C call too where every chunk
    attends on the prefill kernel and the larger steps' projections run on panels (float32 or
    bfloat16, not int8): three whole prompts and the first chunk of a fourth in one step, then
    their decode rows beside the fourth's second chunk (a prefix before it). The logits equal
    the layer-by-layer path's bit for bit; a batch step (interruptible between layers) and the
    int8 model's steps still run layer by layer."""
    model = kernel_model(kind, family_dir, loaded)
    generator = torch.Generator().manual_seed(13)
    prompts = [
        torch.randint(0, loaded.config.vocab_size, (n,), generator=generator).tolist()
        for n in (5, 23, 40, 30)
    ]
    tables = [list(range(i * 4, (i + 1) * 4)) for i in range(len(prompts))]
    layer_by_layer_steps = 0
    layer_by_layer = LlamaModel.forward

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal layer_by_layer_steps
        layer_by_layer_steps += 1
        return layer_by_layer(*args, **kwargs)

    monkeypatch.setattr(LlamaModel, "forward", counted)
    steps: dict[bool, list[torch.Tensor]] = {}
    project = bfloat16_project(model)
    for fuse in (True, False):
        runner = kernel_runner(model, len(prompts), fuse, project, prefill=True)
        fused = runner.decode_layers
        runs_prefills = fused is not None and fused.runs_prefills
        panels = fused_panels(runner) and kind != "int8"
        assert runs_prefills == (fuse and not loaded.config.qk_norm and panels)
        layer_by_layer_steps = 0
        first = runner.forward(
            [BatchEntry(p, 0, t) for p, t in zip(prompts[:3], tables[:3], strict=True)]
            + [BatchEntry(prompts[3][:9], 0, tables[3], want_logits=False)]
        )
        tokens = first.argmax(-1).tolist()
        second = runner.forward(
            [
                BatchEntry([token], len(p), t)
                for token, p, t in zip(tokens, prompts[:3], tables[:3], strict=True)
            ]
            + [BatchEntry(prompts[3][9:], 9, tables[3])]
        )
        assert layer_by_layer_steps == (0 if runs_prefills else 2)
        # A batch step (one that may be interrupted between layers) stays layer by layer.
        runner.forward([BatchEntry(prompts[3][:4], 0, tables[3])], lambda: False)
        assert layer_by_layer_steps == (1 if runs_prefills else 3)
        steps[fuse] = [first, second]
    assert all(torch.equal(a, b) for a, b in zip(steps[True], steps[False], strict=True))


def test_mistral_window_shorter_than_the_prompt_hides_the_tokens_before_it(
    family_dir: Path, loaded: LoadedModel, hf_model: Any
) -> None:
    """The window really changes the output (so the matches above test it): transformers
    without the window disagrees with the engine past the window."""
    if loaded.config.sliding_window is None:
        pytest.skip(f"{loaded.config.model_type} has no sliding window")
    window = loaded.config.sliding_window
    assert window < LOGIT_PROMPT
    prompt = torch.arange(LOGIT_PROMPT) % loaded.config.vocab_size
    windowless = AutoModelForCausalLM.from_pretrained(
        family_dir, dtype=torch.float32, sliding_window=None
    ).eval()
    with torch.no_grad():
        full = windowless(prompt[None]).logits[0]
        windowed = hf_model(prompt[None]).logits[0]
    ours = decode_logits(loaded, prompt.tolist(), kernels=True)
    torch.testing.assert_close(ours[:window], full[:window], atol=1e-4, rtol=1e-4)
    assert (ours[window:] - full[window:]).abs().amax() > 1e-2
    torch.testing.assert_close(ours, windowed, atol=LOGIT_TOLERANCE, rtol=LOGIT_TOLERANCE)


def test_kv_hand_off_between_two_engines_continues_exactly(
    loaded: LoadedModel, prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    prompt = prompts[5]  # 70 tokens: 4 full blocks + 6
    engine_a, engine_b = make_engine(loaded), make_engine(loaded)
    assert engine_a.runner.layout.head_dim == loaded.config.head_dim
    engine_a.add_request(EngineRequest("p", prompt, GREEDY), hold_after_prefill=True)
    (first,) = engine_a.step() + engine_a.step()  # 40-token budget: two prefill steps
    handle = engine_a.take_handle("p")
    assert handle is not None
    plan = engine_b.start_import(EngineRequest("p", prompt, GREEDY), handle.block_hashes, 70)
    blobs = engine_a.export_blocks(handle.handle_id, plan.missing_indices)
    for index, blob in zip(plan.missing_indices, blobs, strict=True):
        engine_b.write_imported_block(plan, index, blob)
    engine_b.commit_import(plan, first.new_token_ids[0])
    rest = drive(engine_b, {0: []})
    assert first.new_token_ids + rest["p"].token_ids == hf_greedy[5]
    assert engine_a.release(handle.handle_id) == 5


def test_prefix_cache_hit_gives_the_same_tokens(
    loaded: LoadedModel, prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    engine = make_engine(loaded)
    miss = drive(engine, {0: [EngineRequest("miss", prompts[7], GREEDY)]})["miss"]
    hit = drive(engine, {0: [EngineRequest("hit", prompts[7], GREEDY)]})["hit"]
    assert hit.outputs[0].num_cached_prompt_tokens == 112  # 7 full blocks of 120 tokens
    assert miss.token_ids == hit.token_ids == hf_greedy[7]


def test_int8_follows_the_fp32_model(family_dir: Path, loaded: LoadedModel) -> None:
    """int8 weight-only (Qwen2's Q/K/V bias kept in float) on every path (the kernel's int8
    rows, torch's int8 matmul on bf16 activations; prefill and decode) mostly picks the fp32
    model's argmax at every position of a 64-token prompt."""
    int8 = load_model(str(family_dir), quantization="int8")
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, loaded.config.vocab_size, (LOGIT_PROMPT,), generator=generator)
    expected = prefill_logits(loaded, prompt.tolist(), kernels=False).argmax(-1)
    paths = {
        # One row a step: the small-batch kernel on the int8 weights.
        "decode, kernels": decode_logits(int8, prompt.tolist(), kernels=True),
        # Many rows: torch's int8 matmul on bf16 activations.
        "prefill, torch": prefill_logits(int8, prompt.tolist(), kernels=False),
    }
    for path, logits in paths.items():
        agreement = float((logits.argmax(-1) == expected).float().mean())
        assert agreement >= INT8_AGREEMENT, (path, agreement)


def test_offline_llm_api_generates_the_transformers_tokens(family_dir: Path, hf_model: Any) -> None:
    llm = LLM(str(family_dir), num_kv_blocks=32)
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    (completion,) = llm.generate(["The quick brown fox"], sampling)
    ids = llm.tokenizer.encode("The quick brown fox")
    (expected,) = transformers_greedy(family_dir, [ids], 12)
    assert completion.prompt_token_ids == ids
    assert completion.token_ids == expected
    assert completion.finish_reason is FinishReason.LENGTH


def test_gguf_file_of_the_family_loads_the_same_model(
    family: TinyFamily, family_dir: Path, loaded: LoadedModel, tmp_path: Path
) -> None:
    """Written with the gguf package (its own tensor names, Qwen's Q/K rows unpermuted, as
    llama.cpp's converter leaves them): the same config, weights and tokens."""
    if family.gguf_architecture is None:
        pytest.skip(f"llama.cpp writes {family.name} checkpoints as another architecture")
    from_gguf = load_model(str(write_tiny_gguf(family, family_dir, tmp_path / "tiny.gguf")))
    # GGUF stores the epsilon as a float32.
    assert from_gguf.config.rms_norm_eps == pytest.approx(loaded.config.rms_norm_eps, rel=1e-6)
    assert dataclasses.replace(from_gguf.config, rms_norm_eps=loaded.config.rms_norm_eps) == (
        loaded.config
    )
    ours, theirs = loaded.model.hf_state_dict(), from_gguf.model.hf_state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    for text in TINY_CORPUS:
        assert from_gguf.tokenizer.encode(text) == loaded.tokenizer.encode(text), text
    messages = [{"role": "user", "content": "hi"}]
    assert from_gguf.tokenizer.apply_chat_template(messages) == (
        loaded.tokenizer.apply_chat_template(messages)
    )


def test_save_hf_folder_round_trips_the_family(loaded: LoadedModel, tmp_path: Path) -> None:
    """What the vLLM backend and the benchmarks write: transformers' config of the family, the
    weights back under Hugging Face names (bias and norm rows in their own order)."""
    save_hf_folder(loaded, tmp_path / "saved")
    again = load_model(str(tmp_path / "saved"))
    assert again.config == loaded.config
    ours, theirs = loaded.model.hf_state_dict(), again.model.hf_state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_structured_output_and_seeded_sampling(loaded: LoadedModel, backend: str) -> None:
    """The grammar masks cover the family's vocabulary (larger than its tokenizer's here):
    seeded-sampled JSON validates against its schema, a greedy regex answer matches."""
    schema = SCHEMAS["enum_and_const"]
    json_constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    requests = [
        EngineRequest(f"json-{seed}", constrained_prompt(seed), sampling(seed, json_constraint))
        for seed in (1, 2, 3)
    ]
    regex = Constraint(ConstraintKind.REGEX, r"[a-z]{3,6}( [a-z]{3,6}){2}")
    requests.append(EngineRequest("regex", constrained_prompt(4), sampling(None, regex)))
    # A generous compile limit: on a busy machine the JSON schema took over 10 s to compile.
    engine = grammar_engine(loaded, backend, grammar_compile_timeout_s=120.0)
    results = drive(engine, {0: requests})
    for request in requests[:-1]:
        result = results[request.request_id]
        assert result.finish_reason is FinishReason.STOP, result.text
        jsonschema.validate(parse_json(result.text), schema)
    assert re.fullmatch(r"[a-z]{3,6}( [a-z]{3,6}){2}", results["regex"].text)


def edited_copy(folder: Path, tmp_path: Path, **changes: Any) -> Path:
    """A copy of the checkpoint with config.json fields changed (None removes one)."""
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (copy / "config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"architectures": ["Qwen2MoeForCausalLM"], "num_experts": 8},
            r"mixture-of-experts checkpoints \(Qwen2MoeForCausalLM, num_experts\)",
        ),
        (
            {"architectures": ["Qwen2VLForConditionalGeneration"], "vision_config": {}},
            r"multimodal checkpoints \(Qwen2VLForConditionalGeneration, vision_config\)",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
            "unsupported rope_scaling type 'yarn'",
        ),
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture GPT2LMHeadModel is not supported"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
    ],
    ids=["moe", "multimodal", "rope-yarn", "unknown-architecture", "activation"],
)
def test_unsupported_checkpoints_are_refused_in_one_line(
    family_dir: Path, tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ModelLoadError, match=message) as refused:
        load_model(str(edited_copy(family_dir, tmp_path, **changes)))
    assert "\n" not in str(refused.value)


def test_qwen_layer_sliding_window_is_refused(family_dir: Path, tmp_path: Path) -> None:
    if not family_dir.name.startswith("tiny_qwen"):
        pytest.skip("only Qwen configs have use_sliding_window")
    edited = edited_copy(family_dir, tmp_path, use_sliding_window=True, sliding_window=32)
    with pytest.raises(ModelLoadError, match="use_sliding_window"):
        load_model(str(edited))
