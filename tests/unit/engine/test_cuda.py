"""The engine on a CUDA device, where it runs its torch path (the C kernels are CPU float32
only): greedy tokens against transformers on the same device, bfloat16 (the default there),
seeded sampling with logprobs, a grammar, prefix caching and the KV hand-off's block bytes.

Skipped where torch sees no GPU, as in CI: run on a GPU machine with
`pytest tests/unit/engine/test_cuda.py` (BENCHMARKS.md, "Peers on CUDA", says when it last ran).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kvmesh.contracts.constraints import Constraint, ConstraintKind
from services.worker.engine.api import EngineRequest, FinishReason, SamplingParams
from services.worker.engine.engine import Engine
from services.worker.engine.loader import LoadedModel, load_model
from services.worker.engine.model_runner import BatchEntry
from tests.unit.engine.greedy import transformers_greedy, transformers_model
from tests.unit.engine.test_engine import drive, make_engine, staggered

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device here: these run on a GPU machine"
)
NUM_NEW = 16
PROMPT_LENGTHS = (5, 17, 33, 64, 3, 40, 9, 24)
GREEDY = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)


def loaded_on_cuda(folder: Path, dtype: torch.dtype) -> LoadedModel:
    loaded = load_model(str(folder), device="cuda", dtype=dtype)
    assert loaded.device.type == "cuda" and loaded.dtype == dtype
    return loaded


@pytest.fixture(scope="module")
def prompts(tiny_llama_dir: Path) -> list[list[int]]:
    generator = torch.Generator().manual_seed(7)
    vocab = load_model(str(tiny_llama_dir)).config.vocab_size
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in PROMPT_LENGTHS]


def outputs_of(engine: Engine, arrivals: dict[int, list[EngineRequest]]) -> list[list[int]]:
    results = drive(engine, arrivals)
    assert all(r.finish_reason is FinishReason.LENGTH for r in results.values())
    assert engine.pool.num_free_blocks == engine.pool.num_blocks  # nothing leaked
    return [results[f"r{i}"].token_ids for i in range(len(results))]


def test_float32_continuous_batch_matches_transformers_on_the_device(
    tiny_llama_dir: Path, prompts: list[list[int]]
) -> None:
    engine = make_engine(loaded_on_cuda(tiny_llama_dir, torch.float32))
    assert engine.runner.kv_cache.device.type == "cuda"
    assert engine.runner.decode_kernel is None and engine.runner.prefill_kernel is None
    expected = transformers_greedy(tiny_llama_dir, prompts, NUM_NEW, "cuda", torch.float32)
    assert outputs_of(engine, staggered(prompts, GREEDY)) == expected


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 0.05)])
def test_prefill_logits_match_transformers_on_the_device(
    tiny_llama_dir: Path, prompts: list[list[int]], dtype: torch.dtype, tolerance: float
) -> None:
    """The last position's logits of each prompt, against transformers in the same dtype on
    the same device, within `tolerance` of the largest logit (bfloat16 rounds each product's
    inputs to 8 bits of mantissa, and the two sum in different orders)."""
    runner = make_engine(loaded_on_cuda(tiny_llama_dir, dtype)).runner
    model = transformers_model(tiny_llama_dir, "cuda", dtype)
    for prompt in prompts:
        table = list(range(math.ceil(len(prompt) / runner.block_size)))
        ours = runner.forward([BatchEntry(prompt, 0, table)])[0]
        with torch.no_grad():
            theirs = model(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
        scale = theirs.abs().max()
        assert (ours - theirs).abs().max() <= tolerance * scale, len(prompt)


def test_bfloat16_default_generates_without_leaks(
    tiny_llama_dir: Path, prompts: list[list[int]]
) -> None:
    loaded = load_model(str(tiny_llama_dir), device="cuda")  # dtype "auto": bfloat16 there
    assert loaded.dtype == torch.bfloat16
    outputs = outputs_of(make_engine(loaded), staggered(prompts, GREEDY))
    assert [len(tokens) for tokens in outputs] == [NUM_NEW] * len(prompts)


def test_seeded_sampling_logprobs_and_a_grammar_on_the_device(
    tiny_llama_dir: Path, prompts: list[list[int]]
) -> None:
    engine = make_engine(loaded_on_cuda(tiny_llama_dir, torch.float32))
    seeded = SamplingParams(
        max_tokens=NUM_NEW, temperature=0.9, top_k=20, top_p=0.9, seed=11, logprobs=2,
        ignore_eos=True,
    )  # fmt: skip
    choice = SamplingParams(
        max_tokens=8, constraint=Constraint(ConstraintKind.CHOICE, options=("yes", "no"))
    )
    arrivals = {
        0: [
            EngineRequest("a", prompts[1], seeded),
            EngineRequest("greedy", prompts[2], SamplingParams(max_tokens=4, ignore_eos=True)),
            EngineRequest("choice", prompts[3], choice),
        ],
        2: [EngineRequest("b", prompts[1], seeded)],
    }
    results = drive(engine, arrivals)
    a, b = results["a"], results["b"]
    assert a.token_ids == b.token_ids and len(a.token_ids) == NUM_NEW
    for out in a.outputs:
        if out.new_token_ids:
            assert out.logprobs is not None
            (logprob,) = out.logprobs
            assert logprob.token_id == out.new_token_ids[0]
            assert len(logprob.top) == 2 and logprob.logprob <= 0.0
    assert results["choice"].text in ("yes", "no")
    assert results["choice"].finish_reason is FinishReason.STOP
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_prefix_cache_and_block_bytes_on_the_device(
    tiny_llama_dir: Path, prompts: list[list[int]]
) -> None:
    engine = make_engine(loaded_on_cuda(tiny_llama_dir, torch.float32))
    prompt = [*prompts[3], 1, 2]  # 64 tokens (four full 16-token blocks) and two more
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    first = drive(engine, {0: [EngineRequest("first", prompt, sampling)]})["first"]
    second = drive(engine, {0: [EngineRequest("second", prompt, sampling)]})["second"]
    assert second.outputs[0].num_cached_prompt_tokens == 64
    assert second.token_ids == first.token_ids
    # A block's bytes go over the wire from the host: read, written elsewhere, read back.
    runner = engine.runner
    data = runner.read_block(1)
    assert data == runner.kv_cache[:, :, 1].contiguous().cpu().view(torch.uint8).numpy().tobytes()
    runner.write_block(40, data)
    assert runner.read_block(40) == data
    assert torch.equal(runner.kv_cache[:, :, 40], runner.kv_cache[:, :, 1])
