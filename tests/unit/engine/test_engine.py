"""Engine on the tiny random Llama (fp32) against Hugging Face transformers' greedy generate."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from services.worker.engine import engine as engine_module
from services.worker.engine.api import (
    EngineRequest,
    FinishReason,
    KvCapacityError,
    Priority,
    RequestOutput,
    SamplingParams,
)
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.linear_kernel import SmallBatchLinear
from services.worker.engine.loader import LoadedModel, load_model
from tests.unit.engine.greedy import transformers_greedy

NUM_NEW = 32
PROMPT_LENGTHS = [5, 17, 33, 48, 64, 70, 90, 120]
GREEDY = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir))


@pytest.fixture(scope="module")
def prompts(tiny_loaded: LoadedModel) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    vocab = tiny_loaded.config.vocab_size
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def hf_greedy(tiny_llama_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return transformers_greedy(tiny_llama_dir, prompts, NUM_NEW)


def make_engine(loaded: LoadedModel, **overrides: object) -> Engine:
    config = EngineConfig(num_kv_blocks=64, max_num_batched_tokens=40).replace(**overrides)
    return Engine(loaded, config)


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    outputs: list[RequestOutput] = field(default_factory=list)


def drive(
    engine: Engine,
    arrivals: dict[int, list[EngineRequest]],
    on_step: Callable[[int, Engine], None] | None = None,
    max_steps: int = 2000,
    interactive_waiting: Callable[[], bool] | None = None,
) -> dict[str, Result]:
    """Step the engine, adding arrivals[step] before that step; collect every output."""
    results: dict[str, Result] = {}
    for step in range(max_steps):
        for req in arrivals.get(step, []):
            engine.add_request(req)
            results[req.request_id] = Result()
        if on_step is not None:
            on_step(step, engine)
        if step > max(arrivals) and not engine.has_work():
            return results
        for out in engine.step(interactive_waiting):
            result = results.setdefault(out.request_id, Result())
            result.outputs.append(out)
            result.token_ids.extend(out.new_token_ids)
            result.text += out.text_delta
            result.finish_reason = out.finish_reason
    raise AssertionError("engine did not drain")


def staggered(
    prompts: list[list[int]], sampling: SamplingParams = GREEDY
) -> dict[int, list[EngineRequest]]:
    """Prompt i arrives before step 3*i, shortest and longest interleaved."""
    order = [7, 0, 5, 2, 6, 1, 4, 3]
    return {3 * n: [EngineRequest(f"r{i}", prompts[i], sampling)] for n, i in enumerate(order)}


@pytest.mark.parametrize(
    ("attention", "small_batch_linear"), [("kernel", "kernel"), ("sdpa", "torch")]
)
def test_greedy_staggered_continuous_batch_matches_transformers(
    tiny_loaded: LoadedModel,
    prompts: list[list[int]],
    hf_greedy: list[list[int]],
    attention: str,
    small_batch_linear: str,
) -> None:
    engine = make_engine(
        tiny_loaded,
        decode_attention=attention,
        prefill_attention=attention,
        rope_store=small_batch_linear,
        small_batch_linear=small_batch_linear,
    )
    assert (engine.runner.decode_kernel is not None) == (attention == "kernel")
    assert (engine.runner.prefill_kernel is not None) == (attention == "kernel")
    assert (engine.runner.rope_store_kernel is not None) == (small_batch_linear == "kernel")
    assert isinstance(engine.runner.project, SmallBatchLinear) == (small_batch_linear == "kernel")
    max_running = 0

    def watch(step: int, eng: Engine) -> None:
        nonlocal max_running
        max_running = max(max_running, eng.scheduler.num_running)

    results = drive(engine, staggered(prompts), on_step=watch)
    for i, expected in enumerate(hf_greedy):
        assert results[f"r{i}"].token_ids == expected, f"prompt {i}"
        assert results[f"r{i}"].finish_reason is FinishReason.LENGTH
    assert max_running >= 6  # they really shared batches
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_tiny_kv_budget_preempts_and_still_matches(
    tiny_loaded: LoadedModel, prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    # The longest request alone needs ceil((120 + 32 - 1) / 16) = 10 blocks.
    engine = make_engine(tiny_loaded, num_kv_blocks=11)
    arrivals = {0: [EngineRequest(f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]}
    for i, req in enumerate(arrivals[0]):
        req.priority = Priority.BATCH if i % 2 else Priority.INTERACTIVE
    results = drive(engine, arrivals)
    assert engine.scheduler.num_preemptions > 0
    for i, expected in enumerate(hf_greedy):
        assert results[f"r{i}"].token_ids == expected, f"prompt {i}"
    assert engine.pool.num_free_blocks == 11


def test_interrupted_batch_steps_are_redone_exactly(
    tiny_loaded: LoadedModel, prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    """Batch-only steps abandoned between layers (some after a layer already wrote KV) are
    scheduled again: the tokens still equal transformers' and no block leaks."""
    engine = make_engine(tiny_loaded)
    arrivals = staggered(prompts)
    for requests in arrivals.values():
        for req in requests:
            req.priority = Priority.BATCH
    coin = random.Random(7)
    results = drive(engine, arrivals, interactive_waiting=lambda: coin.random() < 0.3)
    assert engine.num_interrupted_steps > 20
    for i, expected in enumerate(hf_greedy):
        assert results[f"r{i}"].token_ids == expected, f"prompt {i}"
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_steps_with_interactive_work_are_never_interrupted(
    tiny_loaded: LoadedModel, prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    engine = make_engine(tiny_loaded)
    short = SamplingParams(max_tokens=8, ignore_eos=True)
    # The batch request ends well before the interactive one, so it shares every step with
    # interactive work (alone, with an interactive request forever "waiting", it would stop).
    arrivals = {
        0: [
            EngineRequest("i", prompts[3], GREEDY),
            EngineRequest("b", prompts[0], short, priority=Priority.BATCH),
        ]
    }
    results = drive(engine, arrivals, interactive_waiting=lambda: True)
    assert engine.num_interrupted_steps == 0
    assert results["i"].token_ids == hf_greedy[3]
    assert results["b"].token_ids == hf_greedy[0][:8]


def test_prefix_cache_hit_gives_the_same_tokens_as_a_miss(
    tiny_loaded: LoadedModel, prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    engine = make_engine(tiny_loaded)
    first = drive(engine, {0: [EngineRequest("miss", prompts[7], GREEDY)]})["miss"]
    second = drive(engine, {0: [EngineRequest("hit", prompts[7], GREEDY)]})["hit"]
    assert first.outputs[0].num_cached_prompt_tokens == 0
    # 120 prompt tokens: 7 full blocks cached (the 8th is partial).
    assert second.outputs[0].num_cached_prompt_tokens == 112
    assert first.token_ids == second.token_ids == hf_greedy[7]
    stats = engine.stats()
    assert (stats.prefix_queries_tokens, stats.prefix_hit_tokens) == (240, 112)


def test_random_aborts_leave_every_block_free(
    tiny_loaded: LoadedModel, prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    engine = make_engine(tiny_loaded, num_kv_blocks=24)
    rng = random.Random(1234)
    aborted: set[str] = set()

    def abort_some(step: int, eng: Engine) -> None:
        live = sorted(eng.live_request_ids())
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            assert eng.abort(victim)
            aborted.add(victim)

    results = drive(engine, staggered(prompts), on_step=abort_some)
    assert 2 <= len(aborted) < len(prompts)
    for i, expected in enumerate(hf_greedy):
        result = results[f"r{i}"]
        if f"r{i}" in aborted:
            assert result.finish_reason is FinishReason.ABORT
            assert result.token_ids == expected[: len(result.token_ids)]
        else:
            assert result.token_ids == expected
    assert engine.pool.num_free_blocks == 24
    assert not engine.abort("r0")  # already gone


def test_export_on_a_import_on_b_continues_exactly(
    tiny_loaded: LoadedModel, prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    prompt = prompts[5]  # 70 tokens: 4 full blocks + 6
    engine_a = make_engine(tiny_loaded)
    engine_b = make_engine(tiny_loaded)
    engine_a.add_request(EngineRequest("p", prompt, GREEDY), hold_after_prefill=True)
    (first,) = engine_a.step() + engine_a.step()  # 40-token budget: two prefill steps
    handle = engine_a.take_handle("p")
    assert handle is not None and first.finish_reason is None
    assert (len(handle.block_ids), handle.num_tokens) == (5, 70)
    assert not engine_a.has_work()

    # B has already seen the first two blocks of the prompt.
    drive(engine_b, {0: [EngineRequest("q", [*prompt[:32], 1, 2, 3], GREEDY)]})
    continued = EngineRequest("p", prompt, GREEDY)
    plan = engine_b.start_import(continued, handle.block_hashes, handle.num_tokens)
    assert plan.missing_indices == [2, 3, 4]  # only the blocks B lacks are pulled
    blobs = engine_a.export_blocks(handle.handle_id, plan.missing_indices)
    for index, blob in zip(plan.missing_indices, blobs, strict=True):
        engine_b.write_imported_block(plan, index, blob)
    engine_b.commit_import(plan, first.new_token_ids[0])
    rest = drive(engine_b, {0: []})
    assert first.new_token_ids + rest["p"].token_ids == hf_greedy[5]
    assert rest["p"].outputs[-1].num_output_tokens == NUM_NEW

    assert engine_a.release(handle.handle_id) == 5
    assert engine_a.pool.num_free_blocks == engine_a.pool.num_blocks
    assert engine_b.pool.num_free_blocks == engine_b.pool.num_blocks


def test_cancelled_import_frees_its_blocks(
    tiny_loaded: LoadedModel, prompts: list[list[int]]
) -> None:
    source = make_engine(tiny_loaded)
    source.add_request(EngineRequest("p", prompts[2], GREEDY), hold_after_prefill=True)
    source.step()
    handle = source.take_handle("p")
    assert handle is not None
    target = make_engine(tiny_loaded)
    request = EngineRequest("p", prompts[2], GREEDY)
    plan = target.start_import(request, handle.block_hashes, handle.num_tokens)
    assert plan.missing_indices == [0, 1, 2]
    assert target.pool.num_free_blocks == 64 - 3
    with pytest.raises(ValueError, match="never written"):
        target.commit_import(plan, 1)
    target.cancel_import(plan)
    assert target.pool.num_free_blocks == 64
    with pytest.raises(KeyError):
        target.cancel_import(plan)
    assert source.release(handle.handle_id) == 3
    with pytest.raises(KeyError):
        source.export_blocks(handle.handle_id, [0])


def test_hold_request_finished_by_its_first_token_gets_no_handle(
    tiny_loaded: LoadedModel, prompts: list[list[int]]
) -> None:
    engine = make_engine(tiny_loaded)
    one = SamplingParams(max_tokens=1)
    engine.add_request(EngineRequest("p", prompts[1], one), hold_after_prefill=True)
    (out,) = engine.step()
    assert out.finish_reason is FinishReason.LENGTH
    assert engine.take_handle("p") is None
    assert engine.pool.num_free_blocks == 64


def test_seeded_sampling_is_identical_alone_and_in_a_batch(
    tiny_loaded: LoadedModel, prompts: list[list[int]]
) -> None:
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=42, ignore_eos=True)
    alone = drive(make_engine(tiny_loaded), {0: [EngineRequest("s", prompts[3], seeded)]})
    others = SamplingParams(max_tokens=24, temperature=0.7, ignore_eos=True)
    arrivals = {
        0: [EngineRequest("o1", prompts[0], others)],
        2: [EngineRequest("s", prompts[3], seeded), EngineRequest("o2", prompts[6], GREEDY)],
        5: [EngineRequest("o3", prompts[4], SamplingParams(temperature=1.3, seed=1))],
    }
    batched = drive(make_engine(tiny_loaded), arrivals)
    assert batched["s"].token_ids == alone["s"].token_ids
    assert len(set(alone["s"].token_ids)) > 5


def test_stop_string_ends_the_request_and_is_not_emitted(
    tiny_loaded: LoadedModel, prompts: list[list[int]]
) -> None:
    free_run = drive(make_engine(tiny_loaded), {0: [EngineRequest("a", prompts[4], GREEDY)]})
    text = free_run["a"].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    sampling = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True, stop=(stop,))
    stopped = drive(make_engine(tiny_loaded), {0: [EngineRequest("a", prompts[4], sampling)]})
    assert stopped["a"].finish_reason is FinishReason.STOP
    assert stopped["a"].text == text[: text.index(stop)]
    assert stop not in stopped["a"].text


def test_deadline_ends_with_partial_output(
    tiny_loaded: LoadedModel, prompts: list[list[int]], hf_greedy: list[list[int]]
) -> None:
    engine = make_engine(tiny_loaded)
    req = EngineRequest("d", prompts[0], GREEDY, deadline=time.monotonic() + 3600)
    engine.add_request(req)
    early = [out for _ in range(3) for out in engine.step()]
    assert [out.new_token_ids[0] for out in early] == hf_greedy[0][:3]
    req.deadline = time.monotonic()
    (last,) = engine.step()
    assert last.finish_reason is FinishReason.DEADLINE
    assert (last.new_token_ids, last.num_output_tokens) == ([], 3)
    assert engine.pool.num_free_blocks == 64


def test_logprobs_come_with_each_token(tiny_loaded: LoadedModel, prompts: list[list[int]]) -> None:
    sampling = SamplingParams(max_tokens=3, logprobs=2, ignore_eos=True)
    result = drive(make_engine(tiny_loaded), {0: [EngineRequest("l", prompts[2], sampling)]})
    for out in result["l"].outputs:
        assert out.logprobs is not None
        (logprob,) = out.logprobs
        assert logprob.token_id == out.new_token_ids[0]
        assert len(logprob.top) == 2
        assert logprob.top[0][0] == logprob.token_id  # greedy picks the most likely token
        assert logprob.logprob == pytest.approx(logprob.top[0][1])


def test_bad_requests_are_refused_with_clear_errors(
    tiny_loaded: LoadedModel, prompts: list[list[int]]
) -> None:
    engine = make_engine(tiny_loaded, num_kv_blocks=4)
    vocab = tiny_loaded.config.vocab_size
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(EngineRequest("e", [], GREEDY))
    with pytest.raises(ValueError, match="outside"):
        engine.add_request(EngineRequest("e", [vocab], GREEDY))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request(EngineRequest("e", [1], SamplingParams(max_tokens=0)))
    with pytest.raises(KvCapacityError, match="pool has 4"):
        engine.add_request(EngineRequest("e", prompts[7], GREEDY))
    with pytest.raises(ValueError, match="context"):
        engine.add_request(EngineRequest("e", [1] * 600, GREEDY))
    engine.add_request(EngineRequest("dup", [1, 2], GREEDY))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(EngineRequest("dup", [1, 2], GREEDY))


@pytest.mark.parametrize(
    ("given", "dtype", "device", "flags", "budget"),
    [
        (None, torch.float32, "cpu", {"amx_bf16"}, 1024),
        (None, torch.bfloat16, "cpu", {"avx512_bf16"}, 1024),
        (None, torch.bfloat16, "cpu", {"avx512_bf16", "amx_bf16"}, 2048),
        (None, torch.bfloat16, "cuda", {"amx_bf16"}, 1024),
        (512, torch.bfloat16, "cpu", {"amx_bf16"}, 512),
    ],
)
def test_the_step_budget_is_the_configs_or_its_default_for_the_dtype_and_cpu(
    monkeypatch: pytest.MonkeyPatch,
    given: int | None,
    dtype: torch.dtype,
    device: str,
    flags: set[str],
    budget: int,
) -> None:
    """max_num_batched_tokens as given; None: 2,048 for a bfloat16 model on a CPU with AMX,
    1,024 elsewhere (config.STEP_TOKENS, AMX_BFLOAT16_STEP_TOKENS)."""
    monkeypatch.setattr(engine_module, "cpu_has_amx", lambda: "amx_bf16" in flags)
    config = EngineConfig(max_num_batched_tokens=given)
    config.validate()
    assert engine_module.step_tokens(config, dtype, torch.device(device)) == budget


def test_an_engine_without_a_budget_schedules_by_the_default(tiny_loaded: LoadedModel) -> None:
    """The engine's scheduler takes the resolved budget (the tests' tiny model is float32)."""
    engine = Engine(tiny_loaded, EngineConfig(num_kv_blocks=64))
    assert engine.scheduler.max_num_batched_tokens == 1024
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        EngineConfig(max_num_batched_tokens=0).validate()
