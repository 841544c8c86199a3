"""SmolLM2-135M-Instruct from its GGUF: weights, tokenizer, greedy output vs transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.worker.engine.loader import LoadedModel
from tests.unit.engine.greedy import greedy_generate

PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "List three prime numbers."}],
]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2(smollm2_fp32: LoadedModel) -> LoadedModel:
    return smollm2_fp32


def test_gguf_config_and_tokenizer(smollm2: LoadedModel) -> None:
    config = smollm2.config
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (
        30,
        576,
        9,
        3,
    )
    assert config.tie_word_embeddings and config.vocab_size == 49152
    tokenizer = smollm2.tokenizer
    assert tokenizer.eos_token_ids == frozenset({tokenizer.backend.token_to_id("<|im_end|>")})
    ids = tokenizer.apply_chat_template(PROMPTS[0])
    text = tokenizer.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert tokenizer.encode("1234") == [tokenizer.backend.token_to_id(d) for d in "1234"]


@pytest.fixture(scope="module")
def transformers_reference(smollm2: LoadedModel, smollm2_gguf_path: Path) -> LlamaForCausalLM:
    """SmolLM2 as transformers reads the GGUF itself (its own dequantization and un-permuting)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = LlamaConfig(**smollm2.config.to_hf_dict())
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(
        str(smollm2_gguf_path), return_tensors=True, model_to_load=skeleton
    )["tensors"]
    model = LlamaForCausalLM(config)
    model.load_state_dict({name: torch.as_tensor(t) for name, t in tensors.items()}, strict=False)
    model.tie_weights()
    # Plain greedy continuation: no stopping at (and no suppression of) EOS.
    model.generation_config.eos_token_id = None
    return model.eval()


def test_gguf_weights_equal_transformers_gguf_reader(
    smollm2: LoadedModel, transformers_reference: LlamaForCausalLM
) -> None:
    reference = transformers_reference.state_dict()
    ours = smollm2.model.hf_state_dict()
    assert set(ours) <= set(reference)
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name


def test_greedy_matches_transformers_generate(
    smollm2: LoadedModel, transformers_reference: LlamaForCausalLM
) -> None:
    prompts = [smollm2.tokenizer.apply_chat_template(messages) for messages in PROMPTS]
    ours = greedy_generate(smollm2, prompts, NEW_TOKENS)
    for prompt, generated in zip(prompts, ours, strict=True):
        with torch.no_grad():
            expected = transformers_reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert generated == expected
