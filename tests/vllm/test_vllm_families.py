"""The vLLM backend serves a family kvmesh's native engine is not asked to build (issue 18.3).

A tiny random Qwen2 (q/k/v biases, GQA with 4 query and 2 KV heads, an odd vocabulary, untied
embeddings) from transformers' own config class: the worker reads its shape, tokenizer, chat
template and fingerprint from the files alone, and vLLM's greedy tokens equal transformers'.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch

from kvmesh.contracts.fingerprint import folder_fingerprint
from kvmesh.contracts.tokenizer import Tokenizer
from tests.service.worker_mesh import GREEDY, InProcessWorker, all_idle, colocated, request
from tests.vllm.conftest import start_vllm_worker, vllm_engine

pytestmark = pytest.mark.asyncio(loop_scope="module")

PROMPTS = [list(range(20, 31)), list(range(100, 170)), [5, 9, 200, 301, 7]]


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("tiny_qwen2")
    for file in tiny_llama_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(file, out / file.name)
    vocab_size = Tokenizer.from_hf_folder(tiny_llama_dir).vocab_size
    config = Qwen2Config(
        vocab_size=vocab_size + 3,  # odd, and larger than the tokenizer's, as Qwen's are
        hidden_size=128,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,  # head_dim 32: the smallest vLLM's CPU attention takes
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)  # float32
    with torch.no_grad():  # random biases, so a bias the engine dropped would show
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0.0, 0.5)
    model.save_pretrained(out)
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def qwen2_worker(tiny_qwen2_dir: Path) -> AsyncIterator[InProcessWorker]:
    started = await start_vllm_worker(tiny_qwen2_dir, "colocated")
    yield started
    await started.stop()


def transformers_greedy(folder: Path, prompt: list[int], max_tokens: int) -> list[int]:
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(folder, dtype=torch.float32)
    generated = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_tokens,
        min_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return [int(t) for t in generated[0, len(prompt) :]]


async def test_qwen2_greedy_tokens_equal_transformers(
    qwen2_worker: InProcessWorker, tiny_qwen2_dir: Path
) -> None:
    for index, prompt in enumerate(PROMPTS):
        result = await colocated(qwen2_worker.stub, request(f"q{index}", prompt))
        assert result.token_ids == transformers_greedy(tiny_qwen2_dir, prompt, GREEDY.max_tokens)
    assert await all_idle([qwen2_worker.stub])


async def test_shape_tokenizer_and_fingerprint_come_from_the_files(
    qwen2_worker: InProcessWorker, tiny_qwen2_dir: Path, tiny_llama_dir: Path
) -> None:
    engine = vllm_engine(qwen2_worker)
    layout = engine.layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim) == (2, 2, 32)
    assert engine.vocab_size == Tokenizer.from_hf_folder(tiny_llama_dir).vocab_size + 3
    stats = await qwen2_worker.stats()
    assert stats.model_fingerprint == folder_fingerprint(tiny_qwen2_dir, "float32")
    assert stats.model_fingerprint != folder_fingerprint(tiny_llama_dir, "float32")
    tokenizer = engine.tokenizer
    hf = Tokenizer.from_hf_folder(tiny_llama_dir)
    messages = [{"role": "user", "content": "hello there"}]
    assert tokenizer.chat_template is not None
    assert tokenizer.apply_chat_template(messages) == hf.apply_chat_template(messages)
