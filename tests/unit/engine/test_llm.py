"""The offline LLM API on SmolLM2-135M (from its GGUF) against transformers' greedy generate."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from services.worker.engine.api import FinishReason, SamplingParams
from services.worker.engine.llm import LLM
from services.worker.engine.loader import LoadedModel, save_hf_folder

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Here is a short list of fruits: apple, banana,",
]
NUM_NEW = 24


@pytest.fixture(scope="module")
def llm(smollm2_fp32: LoadedModel) -> LLM:
    return LLM(smollm2_fp32, max_num_batched_tokens=64)


def test_llm_loads_a_model_by_name(tiny_llama_dir: Path) -> None:
    llm = LLM(str(tiny_llama_dir), num_kv_blocks=8)
    (completion,) = llm.generate(["The quick"], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(completion.token_ids) == 3
    assert llm.engine.pool.num_blocks == 8


def test_smollm2_llm_generate_matches_transformers(llm: LLM, tmp_path: Path) -> None:
    sampling = SamplingParams(max_tokens=NUM_NEW, ignore_eos=True)
    completions = llm.generate(PROMPTS, sampling)

    # transformers on the very weights the engine loaded (dequantized from the GGUF).
    save_hf_folder(llm.engine.loaded, tmp_path)
    model = LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    for prompt, completion in zip(PROMPTS, completions, strict=True):
        ids = llm.tokenizer.encode(prompt)
        assert completion.prompt_token_ids == ids
        with torch.no_grad():
            tensor = torch.tensor([ids])
            out = model.generate(
                tensor,
                attention_mask=torch.ones_like(tensor),
                max_new_tokens=NUM_NEW,
                do_sample=False,
                pad_token_id=0,
            )
        assert completion.token_ids == out[0, len(ids) :].tolist(), prompt
        assert completion.finish_reason is FinishReason.LENGTH
        assert completion.text == llm.tokenizer.decode(completion.token_ids)


def test_llm_stops_at_eos_and_keeps_prompt_order(llm: LLM) -> None:
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    short, long = llm.generate(
        [chat, "Once upon a time"],
        [SamplingParams(max_tokens=64), SamplingParams(max_tokens=5)],
    )
    assert short.finish_reason is FinishReason.STOP
    # The EOS token that stopped it is in neither the token ids nor the text.
    assert short.token_ids and not set(short.token_ids) & llm.tokenizer.eos_token_ids
    assert short.text == llm.tokenizer.decode(short.token_ids)
    assert len(long.token_ids) == 5 and long.finish_reason is FinishReason.LENGTH
    assert llm.engine.pool.num_free_blocks == llm.engine.pool.num_blocks
