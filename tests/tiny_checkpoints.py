"""Tiny random checkpoints of every model family, built from transformers' own config classes
and written as Hugging Face folders (and as GGUF files where llama.cpp has the family): one
piece of code for the tiny Llama every suite uses and for the families' tests."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Continuous batching refills finished slots in the same step.",
    "def add(a, b):\n    return a + b\n",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Unicode: café, naïve, 東京, 中文, emoji 😀🚀.",
]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENIZER_VOCAB = 400


@dataclass(frozen=True)
class TinyFamily:
    """A family's tiny checkpoint: its transformers config class and the fields set on it."""

    name: str
    config_class: str  # a class of transformers, e.g. "Qwen2Config"
    fields: dict[str, Any]
    # Draw the norm weights and biases at random too (transformers initializes them to 1 and
    # 0, which would hide a bias or norm weight laid out in the wrong order).
    random_norms_and_biases: bool = True
    # general.architecture of its GGUF file, None when none is written.
    gguf_architecture: str | None = None
    notes: list[str] = field(default_factory=list)


def train_tiny_tokenizer(out: Path, eager: list[str] | None = None) -> Any:
    """A byte-level BPE trained on TINY_CORPUS (with `eager` as added tokens), saved into `out`
    with the chat template; returns the `tokenizers` backend."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(TINY_CORPUS, trainer=trainer)
    if eager:
        backend.add_tokens(eager)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>"
    )
    hf_tokenizer.chat_template = TINY_CHAT_TEMPLATE
    hf_tokenizer.save_pretrained(out)
    return backend


def write_tiny_checkpoint(
    family: TinyFamily, out: Path, seed: int = 0, eager: list[str] | None = None
) -> Path:
    """The family's random model (fp32) and the tiny tokenizer, saved as a Hugging Face folder;
    with `eager` (untied embeddings only), those strings become added tokens and the first one
    the model's favourite next token everywhere."""
    import transformers

    backend = train_tiny_tokenizer(out, eager)
    config = getattr(transformers, family.config_class)(
        # Larger than the usual 0.02 so logits are spread out and greedy picks are not ties.
        initializer_range=0.2,
        bos_token_id=backend.token_to_id("<|im_start|>"),
        eos_token_id=backend.token_to_id("<|im_end|>"),
        **{"vocab_size": backend.get_vocab_size()} | family.fields,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)  # fp32: torch's default
    if family.random_norms_and_biases:
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("bias"):
                    parameter.normal_(0.0, 0.5)
                elif "norm" in name:
                    parameter.uniform_(0.5, 1.5)
    if eager:
        with torch.no_grad():
            model.model.embed_tokens.weight[:, 0] = 30.0
            model.lm_head.weight[:, 0] = 0.0
            model.lm_head.weight[backend.token_to_id(eager[0]), 0] = 100.0
    model.save_pretrained(out)
    return out


def write_tiny_gguf(family: TinyFamily, folder: Path, out: Path) -> Path:
    """The checkpoint in `folder` as a GGUF file of the family's llama.cpp architecture (F32
    tensors named by the gguf package's own name map, Q/K rows as llama.cpp's converter leaves
    them for this architecture: unpermuted), with its tokenizer and chat template."""
    import gguf
    from safetensors.torch import load_file

    if family.gguf_architecture is None:
        raise ValueError(f"llama.cpp has no GGUF architecture for {family.name}")
    config = json.loads((folder / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(out, family.gguf_architecture)
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    write_gguf_tokenizer(writer, folder)
    arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == family.gguf_architecture)
    names = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise ValueError(f"the gguf package has no name for {name}")
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def write_gguf_tokenizer(writer: Any, folder: Path, pre: str = "gpt2") -> None:
    """The folder's byte-level BPE as GGUF tokenizer.ggml.* metadata, with llama.cpp's
    pre-tokenizer name `pre` (the folder's own split is "gpt2": ByteLevel's regex)."""
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(tokenizer["model"]["vocab"])
    special = {token["content"]: token["id"] for token in tokenizer["added_tokens"]}
    tokens = sorted(vocab | special, key=lambda token: (vocab | special)[token])
    merges = [
        merge if isinstance(merge, str) else " ".join(merge)
        for merge in tokenizer["model"]["merges"]
    ]
    control, normal = 3, 1  # llama.cpp's token types
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([control if token in special else normal for token in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(special[tokenizer_config["bos_token"]])
    writer.add_eos_token_id(special[tokenizer_config["eos_token"]])
    template = folder / "chat_template.jinja"
    writer.add_chat_template(
        template.read_text() if template.is_file() else tokenizer_config["chat_template"]
    )


LLAMA = TinyFamily(
    name="llama",
    config_class="LlamaConfig",
    fields={
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        "tie_word_embeddings": False,
    },
    random_norms_and_biases=False,
)
# GQA with uneven head groups (6 query heads on 2 or 3 KV heads, 3 on 1), an odd vocabulary
# (larger than the tokenizer's, as Qwen's are), tied and untied embeddings.
QWEN2 = TinyFamily(
    name="qwen2",
    config_class="Qwen2Config",
    fields={
        "vocab_size": 411,
        "hidden_size": 96,
        "intermediate_size": 160,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": True,
    },
    gguf_architecture="qwen2",
)
QWEN3 = TinyFamily(
    name="qwen3",
    config_class="Qwen3Config",
    fields={
        "vocab_size": 403,
        "hidden_size": 64,
        "intermediate_size": 144,
        "num_hidden_layers": 3,
        "num_attention_heads": 6,
        "num_key_value_heads": 3,
        "head_dim": 24,  # not hidden_size / heads
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
        "tie_word_embeddings": False,
    },
    gguf_architecture="qwen3",
)
MISTRAL = TinyFamily(
    name="mistral",
    config_class="MistralConfig",
    fields={
        "vocab_size": 401,
        "hidden_size": 48,
        "intermediate_size": 112,
        "num_hidden_layers": 2,
        "num_attention_heads": 3,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "max_position_embeddings": 512,
        # Shorter than most test prompts: tokens outside it must really be hidden.
        "sliding_window": 24,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": True,
    },
)
FAMILIES = {family.name: family for family in (LLAMA, QWEN2, QWEN3, MISTRAL)}
