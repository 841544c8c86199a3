"""kvmesh/stack.py: what `kvmesh up --engine` gives each worker."""

from __future__ import annotations

import pytest

from kvmesh.config import load_config
from kvmesh.stack import SHARED_CORES_ENV, StackOptions, plan_workers
from kvmesh.supervisor import service_environment
from kvmesh.up import in_rotation
from kvmesh.v1 import router_pb2
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


@pytest.mark.parametrize(
    ("options", "shared"),
    [
        (StackOptions(mode="colocated"), False),
        (StackOptions(mode="colocated", decode=2), True),
        (StackOptions(mode="disaggregated"), True),
        (StackOptions(mode="disaggregated", engine="vllm"), False),
    ],
    ids=["one-colocated", "two-colocated", "split", "split-on-vllm"],
)
def test_native_workers_that_share_the_cores_wait_passively(
    options: StackOptions, shared: bool
) -> None:
    """Several native workers on one machine: no OpenMP thread spins on another's core."""
    for worker in plan_workers(options):
        assert dict(worker.env) == (dict(SHARED_CORES_ENV) if shared else {})


def test_a_variable_the_caller_set_wins_over_the_plans() -> None:
    worker = plan_workers(StackOptions(mode="disaggregated"))[0]
    assert service_environment(worker, {"PATH": "/bin"}, {})["OMP_WAIT_POLICY"] == "PASSIVE"
    mine = service_environment(worker, {"OMP_WAIT_POLICY": "ACTIVE"}, {"KVMESH_X": "1"})
    assert mine == {"OMP_WAIT_POLICY": "ACTIVE", "PYTHONUNBUFFERED": "1", "KVMESH_X": "1"}


def test_kvmesh_scale_waits_for_the_router_to_call_the_newcomer_healthy() -> None:
    pool = router_pb2.PoolStatus(
        workers=[
            router_pb2.WorkerStatus(address="127.0.0.1:1", healthy=True),
            router_pb2.WorkerStatus(address="127.0.0.1:2", healthy=False),
        ]
    )
    status = router_pb2.RouterStatusResponse(pools=[pool])
    assert in_rotation(status, "127.0.0.1:1")
    assert not in_rotation(status, "127.0.0.1:2")  # its first check failed: not yet
    assert not in_rotation(status, "127.0.0.1:3")  # not registered at all
