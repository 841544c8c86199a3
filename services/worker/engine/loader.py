"""Load a model of a registered family (models/registry.py) from a Hugging Face folder or a
GGUF file.

Both paths produce the same thing: the family, a ModelConfig and weights under Hugging Face
names (GGUF tensors dequantized with the `gguf` package, Q/K rows un-permuted back from
llama.cpp's rope layout where its converter permuted them), which the family's weight mapping
turns into the model's parameters. The fingerprint is kvmesh.contracts.fingerprint's rule (the
one the vLLM backend applies to the same files), computed once, here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from kvmesh.contracts.fingerprint import (
    TensorBytes,
    fingerprint,
    folder_fingerprint,
    safetensors_files,
)
from kvmesh.contracts.model_facts import ModelFacts
from kvmesh.contracts.model_files import (
    ModelLoadError,
    model_name,
    read_json,
    resolve_model_path,
)
from kvmesh.contracts.tokenizer import Tokenizer
from services.worker.engine.config import QUANTIZATIONS
from services.worker.engine.models.family import ModelFamily
from services.worker.engine.models.llama import (
    LlamaModel,
    ModelConfig,
    split_rope_rows,
    split_rope_vector,
)
from services.worker.engine.models.registry import (
    UnsupportedArchitecture,
    family_for_gguf,
    family_for_hf_config,
)
from services.worker.engine.quant import quantize_model_int8

__all__ = ["LoadedModel", "ModelLoadError", "load_model", "resolve_model_path", "save_hf_folder"]

# torch dtypes of dequantized GGUF weights -> the safetensors codes the fingerprint names.
SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}

# GGUF tensor name (after "blk.{i}.") -> Hugging Face name (after "model.layers.{i}.").
GGUF_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GGUF_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


@dataclass(slots=True)
class LoadedModel:
    name: str
    config: ModelConfig
    model: LlamaModel
    tokenizer: Tokenizer
    fingerprint: str  # hash of config + weights, computed once at load
    quantization: str  # "none" | "int8"
    dtype: torch.dtype
    device: torch.device

    def facts(self) -> ModelFacts:
        """Its shape, tokenizer and fingerprint, as read_model_facts gives them."""
        config = self.config
        return ModelFacts(
            name=self.name,
            tokenizer=self.tokenizer,
            fingerprint=self.fingerprint,
            vocab_size=config.vocab_size,
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            max_position_embeddings=config.max_position_embeddings,
        )


def torch_dtype(name: str, device: str) -> torch.dtype:
    """The torch dtype of an EngineConfig.dtype name, "auto" resolved for the device (float32 on
    CPU, where the C kernels run; bfloat16 on CUDA)."""
    if name != "auto":
        return getattr(torch, name)  # type: ignore[no-any-return]
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load_model(
    spec: str,
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    quantization: str = "none",
) -> LoadedModel:
    """Load a folder, a .gguf file or a packaged model name.

    ModelLoadError (a ValueError) names what is missing or unsupported."""
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    target_device = torch.device(device)
    target_dtype = dtype or torch_dtype("auto", device)
    path = resolve_model_path(spec)
    dtype_label = dtype_name(target_dtype)
    if path.is_dir():
        family, config, weights = _read_hf_folder(path)
        tokenizer = Tokenizer.from_hf_folder(path)
        model_fingerprint = folder_fingerprint(path, dtype_label, quantization)
    else:
        family, config, weights, tokenizer = _read_gguf(path)
        model_fingerprint = fingerprint(
            config.to_hf_dict(), _tensor_bytes(weights), dtype_label, quantization
        )
    try:
        model = family.model_class.from_parameters(
            config, family.weight_mapping(config, weights), dtype=target_dtype, device=target_device
        )
    except KeyError as exc:
        raise ModelLoadError(f"{path}: weight {exc.args[0]} is missing") from exc
    except RuntimeError as exc:  # shape mismatches between config and weights
        raise ModelLoadError(f"{path}: weights do not match config.json: {exc}") from exc
    if quantization == "int8":
        quantize_model_int8(model)
    return LoadedModel(
        name=model_name(spec),
        config=config,
        model=model,
        tokenizer=tokenizer,
        fingerprint=model_fingerprint,
        quantization=quantization,
        dtype=target_dtype,
        device=target_device,
    )


def dtype_name(dtype: torch.dtype) -> str:
    """ "float32" for torch.float32: the dtype as configs and the fingerprint spell it."""
    return str(dtype).removeprefix("torch.")


def _tensor_bytes(weights: dict[str, torch.Tensor]) -> list[TensorBytes]:
    """Weights as the fingerprint reads them from a safetensors file."""
    result = []
    for name, weight in weights.items():
        tensor = weight.detach().contiguous().cpu()
        data = tensor.view(torch.uint8).numpy().data
        result.append(
            TensorBytes(name, SAFETENSORS_DTYPES[tensor.dtype], tuple(tensor.shape), data)
        )
    return result


def save_hf_folder(loaded: LoadedModel, out_dir: Path) -> None:
    """Write config.json, model.safetensors and tokenizer files that transformers/vLLM load."""
    if loaded.quantization != "none":
        raise ValueError("save_hf_folder needs an unquantized model")
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = loaded.tokenizer
    hf_config = loaded.config.to_hf_dict() | {
        "torch_dtype": dtype_name(loaded.dtype),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": sorted(tokenizer.eos_token_ids),
    }
    _write_json(out_dir / "config.json", hf_config)
    _write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": sorted(tokenizer.eos_token_ids)},
    )
    state = {
        name: tensor.contiguous().cpu() for name, tensor in loaded.model.hf_state_dict().items()
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.backend.save(str(out_dir / "tokenizer.json"))
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": loaded.config.max_position_embeddings,
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
    }
    if tokenizer.chat_template is not None:
        tok_config["chat_template"] = tokenizer.chat_template
    _write_json(out_dir / "tokenizer_config.json", tok_config)


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")


def _read_hf_folder(folder: Path) -> tuple[ModelFamily, ModelConfig, dict[str, torch.Tensor]]:
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{folder} has no config.json")
    raw = read_json(config_path)
    try:
        family = family_for_hf_config(raw)
        config = family.read_config(raw)
    except KeyError as exc:
        raise ModelLoadError(f"{config_path} lacks the field {exc.args[0]!r}") from exc
    except ValueError as exc:
        raise ModelLoadError(f"{config_path}: {exc}") from exc
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(folder):
        weights |= load_file(str(file))
    return family, config, weights


def _read_gguf(
    path: Path,
) -> tuple[ModelFamily, ModelConfig, dict[str, torch.Tensor], Tokenizer]:
    import gguf  # slow to import; only GGUF files need it

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc
    fields = reader.fields
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    family, config = _gguf_config(fields, tensors, str(path))
    weights: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        hf_name = _gguf_to_hf_name(name)
        if hf_name is None:
            raise ModelLoadError(
                f"{path}: unexpected tensor {name!r} for GGUF architecture "
                f"{family.gguf_architecture!r}"
            )
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if array.dtype != np.float32 or not array.flags.writeable:  # F32/F16: views of the file
            array = array.astype(np.float32)
        weight = torch.from_numpy(array)
        if family.gguf_rope_rows_interleaved:
            weight = _rope_rows_to_hf_order(hf_name, weight, config)
        weights[hf_name] = weight
    return family, config, weights, Tokenizer.from_gguf_fields(fields, source=str(path))


def _rope_rows_to_hf_order(hf_name: str, weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """llama.cpp's Llama converter stores Q/K rows (and their biases) with the rotary pairs
    interleaved; back to Hugging Face's half-split order."""
    heads = {"q_proj": config.num_heads, "k_proj": config.num_kv_heads}.get(
        hf_name.rsplit(".", 2)[-2]
    )
    if heads is None:
        return weight
    return split_rope_rows(weight, heads) if weight.dim() == 2 else split_rope_vector(weight, heads)


def _gguf_to_hf_name(name: str) -> str | None:
    if name in GGUF_GLOBAL_TENSORS:
        return GGUF_GLOBAL_TENSORS[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in GGUF_LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{GGUF_LAYER_TENSORS[parts[2]]}"
    return None


def _gguf_config(
    fields: Any, tensors: dict[str, Any], source: str
) -> tuple[ModelFamily, ModelConfig]:
    def field(key: str, default: Any = None) -> Any:
        return fields[key].contents() if key in fields else default

    arch = field("general.architecture")
    try:
        family = family_for_gguf(str(arch))
    except UnsupportedArchitecture as exc:
        raise ModelLoadError(f"{source}: {exc}") from exc
    if field(f"{arch}.expert_count"):
        raise ModelLoadError(f"{source}: mixture-of-experts GGUF files are not supported")
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError(f"{source}: GGUF rope_freqs (baked-in rope scaling) is not supported")

    def required(key: str) -> Any:
        value = field(f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{source}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden_size = int(required("embedding_length"))
    num_heads = int(required("attention.head_count"))
    scaling = None
    scaling_type = field(f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        scaling = {"rope_type": "linear", "factor": float(required("rope.scaling.factor"))}
    elif scaling_type != "none":
        raise ModelLoadError(f"{source}: GGUF rope scaling type {scaling_type!r} is not supported")
    tokens = field("tokenizer.ggml.tokens") or []
    config = ModelConfig(
        vocab_size=int(field(f"{arch}.vocab_size") or len(tokens)),
        hidden_size=hidden_size,
        intermediate_size=int(required("feed_forward_length")),
        num_layers=int(required("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(field(f"{arch}.attention.head_count_kv") or num_heads),
        head_dim=int(field(f"{arch}.attention.key_length") or hidden_size // num_heads),
        rope_theta=float(field(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(required("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(required("context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        architecture=family.architecture,
        model_type=family.model_type,
        qkv_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )
    return family, config
