"""Loading Hugging Face folders and GGUF files; clear errors; fingerprints; save_hf_folder."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from kvmesh.contracts.model_facts import read_model_facts
from services.worker.engine import loader
from services.worker.engine.loader import (
    ModelLoadError,
    load_model,
    resolve_model_path,
    save_hf_folder,
)


def copy_without(folder: Path, tmp_path: Path, *names: str) -> Path:
    out = tmp_path / "model"
    shutil.copytree(folder, out)
    for name in names:
        (out / name).unlink()
    return out


def test_hf_folder_loads_with_config_tokenizer_and_fingerprint(tiny_llama_dir: Path) -> None:
    loaded = load_model(str(tiny_llama_dir))
    hf = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    assert loaded.config.num_layers == 2 and loaded.config.num_kv_heads == 2
    assert loaded.config.rope_scaling is not None
    assert loaded.config.rope_scaling["rope_type"] == "llama3"
    assert not loaded.config.tie_word_embeddings
    assert loaded.dtype == torch.float32 and loaded.device == torch.device("cpu")
    assert loaded.quantization == "none" and loaded.name == tiny_llama_dir.name
    ours = loaded.model.hf_state_dict()
    assert set(ours) == set(hf.state_dict())
    for name, tensor in hf.state_dict().items():
        torch.testing.assert_close(ours[name], tensor, atol=0, rtol=0)
    eos = loaded.tokenizer.backend.token_to_id("<|im_end|>")
    assert loaded.tokenizer.eos_token_ids == frozenset({eos})
    assert len(loaded.fingerprint) == 16
    assert load_model(str(tiny_llama_dir)).fingerprint == loaded.fingerprint


def test_fingerprint_changes_with_weights_and_quantization(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    base = load_model(str(tiny_llama_dir))
    assert load_model(str(tiny_llama_dir), quantization="int8").fingerprint != base.fingerprint
    altered = copy_without(tiny_llama_dir, tmp_path)
    hf = LlamaForCausalLM.from_pretrained(altered, dtype=torch.float32)
    with torch.no_grad():
        hf.model.norm.weight[0] += 1e-3
    hf.save_pretrained(altered)
    assert load_model(str(altered)).fingerprint != base.fingerprint


@pytest.mark.parametrize(
    ("removed", "message"),
    [
        (("config.json",), "config.json"),
        (("model.safetensors",), "safetensors"),
        (("tokenizer.json",), "tokenizer.json"),
    ],
)
def test_missing_file_is_named(
    tiny_llama_dir: Path, tmp_path: Path, removed: tuple[str, ...], message: str
) -> None:
    broken = copy_without(tiny_llama_dir, tmp_path, *removed)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(broken))


def test_missing_weight_and_config_field_are_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = copy_without(tiny_llama_dir, tmp_path)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(str(broken))

    config_text = (tiny_llama_dir / "config.json").read_text()
    (broken / "config.json").write_text(config_text.replace('"hidden_size"', '"hidden_sizes"'))
    with pytest.raises(ModelLoadError, match="hidden_size"):
        load_model(str(broken))


def test_bad_specs_raise_model_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model_path(str(tmp_path / "nowhere"))
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"\x00")
    with pytest.raises(ModelLoadError, match=r"not a \.gguf"):
        resolve_model_path(str(not_gguf))
    with pytest.raises(ModelLoadError, match="quantization"):
        load_model("smollm2-135m", quantization="int4")
    assert issubclass(ModelLoadError, ValueError)


def test_save_hf_folder_round_trips(tiny_llama_dir: Path, tmp_path: Path) -> None:
    loaded = load_model(str(tiny_llama_dir))
    save_hf_folder(loaded, tmp_path / "saved")
    again = load_model(str(tmp_path / "saved"))
    assert again.config == loaded.config
    assert again.fingerprint == loaded.fingerprint
    assert again.tokenizer.eos_token_ids == loaded.tokenizer.eos_token_ids
    messages = [{"role": "user", "content": "hi"}]
    assert again.tokenizer.apply_chat_template(messages) == loaded.tokenizer.apply_chat_template(
        messages
    )
    with pytest.raises(ValueError, match="unquantized"):
        save_hf_folder(load_model(str(tiny_llama_dir), quantization="int8"), tmp_path / "q")


def test_model_facts_come_from_the_files_with_the_native_fingerprint(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the vLLM backend reads of a folder: no model is built (not even imported: the facts
    are torch-free), and the fingerprint is the native engine's, so the two backends can
    exchange KV."""
    loaded = load_model(str(tiny_llama_dir))

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was built")

    monkeypatch.setattr(loader.LlamaModel, "from_parameters", no_model)
    facts = read_model_facts(tiny_llama_dir, str(tiny_llama_dir), "float32")
    assert dataclasses.replace(facts, tokenizer=loaded.tokenizer) == loaded.facts()
    assert facts.tokenizer.encode("The quick brown fox") == loaded.tokenizer.encode(
        "The quick brown fox"
    )
    assert facts.fingerprint == loaded.fingerprint
    assert read_model_facts(tiny_llama_dir, "x", "bfloat16").fingerprint != facts.fingerprint


def test_model_facts_of_an_architecture_only_vllm_runs(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    other = copy_without(tiny_llama_dir, tmp_path)
    config = json.loads((other / "config.json").read_text())
    config |= {"model_type": "phi3", "architectures": ["Phi3ForCausalLM"], "head_dim": None}
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="architecture Phi3ForCausalLM is not supported"):
        load_model(str(other))  # the native engine does not run it
    facts = read_model_facts(other, str(other), "float32")
    native = load_model(str(tiny_llama_dir)).facts()
    assert (facts.num_layers, facts.num_kv_heads, facts.head_dim, facts.vocab_size) == (
        native.num_layers,
        native.num_kv_heads,
        native.head_dim,
        native.vocab_size,
    )
    assert facts.fingerprint != native.fingerprint
    assert read_model_facts(other, str(other), "float32").fingerprint == facts.fingerprint
