"""Workers on the vLLM backend (the .venv-vllm environment; `make test-vllm` runs these)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, cast

import grpc
import pytest
import torch

from kvmesh.config import load_config
from services.worker.__main__ import build_worker
from services.worker.backends.vllm_engine import VllmEngine
from services.worker.config import WorkerConfig
from tests.service.worker_mesh import InProcessWorker, worker_args

if TYPE_CHECKING:
    from services.worker.engine.async_engine import AsyncEngine


async def start_vllm_worker(model: Path, role: str, wire_format: str = "vllm") -> InProcessWorker:
    """A worker on the vLLM backend (eager), one thread, a 64-block pool, on a free port, on
    32-token blocks (not vLLM's 128) so that the tests' short prompts span whole blocks and a
    partial one."""
    config = load_config(WorkerConfig, worker_args(model, role))
    engine = VllmEngine.from_config(
        config.engine_config.replace(block_size=32), kv_wire_format=wire_format, eager=True
    )
    # The servicer is typed against AsyncEngine; VllmEngine has the same API (EngineBackend).
    worker = build_worker(config, cast("AsyncEngine", engine))
    await worker.start()
    return InProcessWorker(worker, grpc.aio.insecure_channel(worker.server.address))


def vllm_engine(worker: InProcessWorker) -> VllmEngine:
    engine = worker.worker.engine
    assert isinstance(engine, VllmEngine)
    return engine


@pytest.fixture(scope="session")
def tiny_llama32_dir(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama of tests/conftest.py widened to head_dim 32 (hidden 128), the
    smallest head size vLLM's CPU attention kernels take; same tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny_llama32")
    for file in tiny_llama_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(file, out / file.name)
    config = LlamaConfig.from_pretrained(tiny_llama_dir)
    config.hidden_size = 128
    config.intermediate_size = 256
    config.head_dim = 32
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)  # float32
    model.save_pretrained(out)
    return out
