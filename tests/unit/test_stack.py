"""kvmesh/stack.py: what `kvmesh up --engine` gives each worker."""

from __future__ import annotations

import pytest

from kvmesh.config import load_config
from kvmesh.stack import StackOptions, plan_workers
from services.worker.config import WorkerConfig


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
@pytest.mark.parametrize("engine", ["native", "vllm"])
def test_every_worker_runs_the_chosen_engine(mode: str, engine: str) -> None:
    workers = plan_workers(StackOptions(mode=mode, engine=engine))  # type: ignore[arg-type]
    assert workers
    for worker in workers:
        config = load_config(WorkerConfig, list(worker.args), {})
        assert config.engine == engine
        assert config.role == worker.role
