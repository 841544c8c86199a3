"""The model fingerprint: one rule for every engine backend, computed from the files.

A fingerprint names "these weights under this config, dtype and quantization": it is part of
every KV block hash, and the router pairs a prefill and a decode worker only when theirs agree.
Native and vLLM workers of the same Hugging Face folder must therefore compute the same one,
without either building the other's model. The rule (sha256, first 16 hex digits) covers:

- the config keys that decide what the weights compute (`KV_CONFIG_KEYS`, as config.json
  spells them), a missing key as null, with the defaults every family shares filled in
  (`num_key_value_heads` = heads, `head_dim` = hidden / heads) and RoPE written one way
  (transformers 4.x `rope_theta` + `rope_scaling` or 5.x `rope_parameters`; the default rope
  type as no scaling). Bookkeeping keys (versions, token ids, dropout) are left out, so a
  folder saved again by another tool keeps its fingerprint;
- the dtype the engine runs and the quantization it applies;
- every tensor, in name order: its name, stored dtype code (safetensors' "F32", "BF16", ...),
  shape, and bytes as stored.

Imports no torch: a folder's tensors are read straight from the safetensors files.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvmesh.contracts.model_files import ModelLoadError, read_json

FINGERPRINT_CHARS = 16

KV_CONFIG_KEYS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "sliding_window",
    "use_sliding_window",
    "max_window_layers",
)
"""config.json keys the fingerprint covers (RoPE's are added in one normalized form)."""


@dataclass(slots=True, frozen=True)
class TensorBytes:
    """One weight as the fingerprint sees it."""

    name: str
    dtype: str
    """safetensors dtype code ("F32", "BF16", "F16", ...)."""
    shape: tuple[int, ...]
    data: bytes | memoryview


def canonical_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The part of a config.json the fingerprint covers, in one spelling (see the module)."""
    config = {key: raw.get(key) for key in KV_CONFIG_KEYS}
    heads = raw.get("num_attention_heads")
    if config["num_key_value_heads"] is None:
        config["num_key_value_heads"] = heads
    if config["head_dim"] is None and heads and raw.get("hidden_size"):
        config["head_dim"] = int(raw["hidden_size"]) // int(heads)
    config["rope_theta"], config["rope_scaling"] = _rope(raw)
    return config


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    parameters = raw.get("rope_parameters")
    if isinstance(parameters, dict):
        theta = parameters.get("rope_theta", raw.get("rope_theta", 10000.0))
        scaling = {key: value for key, value in parameters.items() if key != "rope_theta"}
    else:
        theta = raw.get("rope_theta", 10000.0)
        scaling = dict(raw.get("rope_scaling") or {})
    rope_type = scaling.pop("type", None) or scaling.get("rope_type", "default")
    if rope_type == "default" and not (set(scaling) - {"rope_type"}):
        return float(theta), None
    return float(theta), scaling | {"rope_type": rope_type}


def fingerprint(
    config: dict[str, Any], tensors: Iterable[TensorBytes], dtype: str, quantization: str
) -> str:
    """The rule of the module over a raw config dict and the weights (any order)."""
    digest = hashlib.sha256()
    header = {"config": canonical_config(config), "dtype": dtype, "quantization": quantization}
    digest.update(json.dumps(header, sort_keys=True).encode())
    for tensor in sorted(tensors, key=lambda t: t.name):
        digest.update(f"{tensor.name}:{tensor.dtype}:{list(tensor.shape)}".encode())
        digest.update(tensor.data)
    return digest.hexdigest()[:FINGERPRINT_CHARS]


def folder_fingerprint(folder: Path, dtype: str, quantization: str = "none") -> str:
    """The fingerprint of a Hugging Face folder (config.json + its safetensors files)."""
    config = read_json(folder / "config.json")
    with ExitStack() as files:
        tensors = [
            tensor
            for path in safetensors_files(folder)
            for tensor in _tensors(files.enter_context(path.open("rb")), path)
        ]
        return fingerprint(config, tensors, dtype, quantization)


def safetensors_files(folder: Path) -> list[Path]:
    """The folder's weight files: those its index names, else every *.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(read_json(index).get("weight_map", {}).values()))
        missing = [name for name in names if not (folder / name).is_file()]
        if missing:
            raise ModelLoadError(
                f"{folder}: weight files listed in {index.name} missing: {missing}"
            )
        return [folder / name for name in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weight files")
    return files


def _tensors(file: Any, path: Path) -> Iterator[TensorBytes]:
    """The tensors of one safetensors file, their bytes a view of the mapped file (the format:
    an 8-byte little-endian header length, a JSON header, then the data)."""
    try:
        (header_len,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(header_len))
        mapped = memoryview(mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ))
    except (struct.error, ValueError, OSError) as error:
        raise ModelLoadError(f"{path} is not a readable safetensors file: {error}") from None
    start = 8 + header_len
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        yield TensorBytes(
            name, entry["dtype"], tuple(entry["shape"]), mapped[start + begin : start + end]
        )
