"""bench.peers' arithmetic against the machine (the work of a step and the serving row's floor),
the order in which the servers and the offline libraries take turns, and whose processes a
timed region counts, and which runs go again on a slowed host."""

from __future__ import annotations

import asyncio
import os
from dataclasses import asdict, dataclass
from typing import Any

import pytest

import bench.peers
from bench.peers import (
    Report,
    Request,
    Server,
    Shapes,
    Workload,
    _ours,
    _region_line,
    best,
    decode_read_floor_line,
    machine_probe,
    offline_turns,
    prefix_row,
    server_rows,
    serving_prefill_floor_lines,
    settled,
    step_flops,
    turns,
)

SHAPES = Shapes(layer_params=10, num_layers=2, heads_dim=4, lm_head=100)
QUIET = {"other_cores": 0.0}


def test_a_step_counts_projections_causal_attention_and_the_logits_read() -> None:
    # Two 3-token prompts: 6 rows through 10 weights, each query scoring (and summing)
    # its own and the earlier positions, 1 + 2 + 3 per prompt; two logits rows.
    per_layer = 2 * 10 * 6 + 4 * 4 * (6 + 6)
    assert step_flops(SHAPES, [(0, 3), (0, 3)], logit_rows=2) == 2 * per_layer + 2 * 100 * 2
    # A chunk after 5 cached positions attends to them too.
    assert step_flops(SHAPES, [(5, 2)], logit_rows=1) == 2 * (40 + 16 * (10 + 3)) + 200


def _serving(p99_ms: float) -> dict[str, Any]:
    return {"serving": [{"ttft_p99_ms": p99_ms, "region": QUIET}]}


def test_the_serving_floor_sets_the_p99_goal_against_the_burst_prefill_at_the_peak() -> None:
    work = step_flops(SHAPES, [(0, 3), (0, 3)], logit_rows=2)  # 1,024 FLOP
    report = Report(
        workload={"serving_requests": 2, "serving_prompt": 3},
        steps={
            "shapes": asdict(SHAPES),
            "matmul_peak_flops": work / 0.002,  # the burst's prefill: 2 ms at the peak
            "step_flops": {"prefill_512": 1000.0},
            "step_s": {"prefill_512": 0.001 * 1000 / work * 4},  # 4 ms at the step's rate
        },
        servers={"kvmesh colocated": _serving(5.0), "vllm": _serving(3.0)},
    )
    (line,) = serving_prefill_floor_lines(report)
    assert "all 2 prompts (2 x 3 tokens, 0 GFLOP)" in line
    assert "2 ms at the peak and 4 ms at the 512-token step's rate" in line
    assert "TTFT p99 kvmesh colocated 5 ms, vllm 3 ms" in line
    assert line.endswith("the goal's 0.8x of vLLM's is 2 ms = 1.20x the time at the peak.")


def test_the_decode_step_is_read_against_its_weights_and_its_rows_kv() -> None:
    steps = {
        "step_rows": {"decode_32": 2},
        "decode_context": 3,
        "kv_bytes_per_token": 1_000_000,
        "weight_bytes": 2_000_000,
        "copy_bytes_per_s": 1e9,
        "step_s": {"decode_32": 0.015},
    }
    # 2 rows x (3 + 1) tokens of KV = 8 MB, and the weights: 10 MB, 10 ms at 1 GB/s.
    assert decode_read_floor_line(steps) == (
        "- kvmesh, the 32-row decode step against what it reads: 10 MB (the weights once and "
        "8 MB of its rows' KV), 10.0 ms at the copy bandwidth; the step takes 1.50x that."
    )


def test_no_floor_without_vllm_serving_or_the_model_shapes() -> None:
    steps = {"shapes": asdict(SHAPES)}
    workload = {"serving_requests": 2, "serving_prompt": 3}
    alone = Report(workload=workload, steps=steps, servers={"kvmesh colocated": _serving(5.0)})
    assert serving_prefill_floor_lines(alone) == []
    assert (
        serving_prefill_floor_lines(Report(workload=workload, servers={"vllm": _serving(3)})) == []
    )


@dataclass(slots=True)
class _Idle:
    """What turns() reads of a server: its name."""

    name: str
    roots: tuple[int, ...] = ()

    async def request(self, prompt: list[int], max_tokens: int) -> Request:
        raise AssertionError("turns() sends no request")


def test_the_servers_take_turns_on_each_row_in_the_opposite_order_on_the_second_run() -> None:
    kvmesh, vllm, split = _Idle("kvmesh"), _Idle("vllm"), _Idle("split")
    rows = {"kvmesh": ["serving", "single"], "vllm": ["serving", "single"], "split": ["serving"]}
    order = [(run, row, server.name) for run, row, server in turns([kvmesh, vllm, split], rows, 2)]
    assert order == [
        (0, "serving", "kvmesh"),
        (0, "serving", "vllm"),
        (0, "serving", "split"),
        (0, "single", "kvmesh"),
        (0, "single", "vllm"),
        (1, "serving", "split"),
        (1, "serving", "vllm"),
        (1, "serving", "kvmesh"),
        (1, "single", "vllm"),
        (1, "single", "kvmesh"),
    ]


def test_the_offline_libraries_take_turns_and_transformers_runs_once() -> None:
    order = list(offline_turns(["kvmesh", "vllm", "transformers"], 3))
    assert order == [
        (0, "kvmesh"),
        (0, "vllm"),
        (0, "transformers"),
        (1, "vllm"),
        (1, "kvmesh"),
        (2, "kvmesh"),
        (2, "vllm"),
    ]


@dataclass(slots=True)
class _Answering:
    """A server whose TTFT is the prompt's first token id, in seconds."""

    name: str = "fake"
    roots: tuple[int, ...] = ()

    async def request(self, prompt: list[int], max_tokens: int) -> Request:
        return Request(prompt[0], prompt[0], [prompt[-1]], "length", "")


def test_the_prefix_row_reports_the_medians_of_the_cold_and_the_warm_requests() -> None:
    # Three prefixes (cold TTFTs 5, 1 and 3 s), each with two warm requests.
    groups = [[[5, 0], [2, 1], [9, 2]], [[1, 3], [4, 4], [6, 5]], [[3, 6], [8, 7], [7, 8]]]
    row = asyncio.run(prefix_row(_Answering(), groups))
    assert row["cold_ttft_ms"] == 3000
    assert row["warm_ttft_ms"] == 6500
    assert row["outputs"] == [[0], [3], [6], [1], [2], [4], [5], [7], [8]]


def test_a_region_counts_the_roots_descendants_and_this_process_as_the_system() -> None:
    me = os.getpid()
    # pid -> (parent, ticks): two servers started by this process, each with a child.
    ticks = {me: (1, 0), 10: (me, 0), 11: (10, 0), 20: (me, 0), 21: (20, 0), 30: (1, 0)}
    assert _ours(ticks, (20,)) == {me, 20, 21}
    # Without roots, everything this process started is the system's (the offline children).
    assert _ours(ticks) == {me, 10, 11, 20, 21}


def _machine_running(cores: list[float], monkeypatch: pytest.MonkeyPatch) -> None:
    """_busy_ticks as a machine whose processes use cores[i] in window i (the last one on)."""
    per_window = os.sysconf("SC_CLK_TCK") * bench.peers.SETTLE_WINDOW_S
    ticks, readings = 0.0, 0

    def busy_ticks() -> float:
        nonlocal ticks, readings
        # Two readings a window: before its sleep and after.
        if readings % 2 == 1:
            ticks += cores[min(readings // 2, len(cores) - 1)] * per_window
        readings += 1
        return ticks

    monkeypatch.setattr(bench.peers, "_busy_ticks", busy_ticks)


def test_a_row_waits_for_the_machine_to_settle_and_no_longer_than_the_most(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench.peers, "SETTLE_WINDOW_S", 0.01)
    # A vLLM worker polling at 0.09 cores for two windows, then the machine quiet.
    _machine_running([0.09, 0.09, 0.01], monkeypatch)
    assert 0.03 <= asyncio.run(settled()) < 0.03 + 0.5
    # A machine that never settles: the row runs after SETTLE_MOST_S anyway.
    monkeypatch.setattr(bench.peers, "SETTLE_MOST_S", 0.1)
    _machine_running([0.5], monkeypatch)
    assert 0.1 <= asyncio.run(settled()) < 0.1 + 0.5


def test_the_machine_probe_measures_a_matmul_rate_and_a_copy_bandwidth() -> None:
    machine = machine_probe()
    assert set(machine) == {"matmul_gflops", "copy_gb_s"}
    # Any CPU this runs on does more than a GFLOP/s and copies more than a GB/s.
    assert machine["matmul_gflops"] > 1.0
    assert machine["copy_gb_s"] > 1.0


def test_a_region_line_gives_the_machine_probed_before_the_run() -> None:
    region = {"seconds": 6.94, "load_start": 1.6, "load_end": 2.0, "other_cores": 0.03}
    probed = {"matmul_gflops": 311.6, "copy_gb_s": 23.14}
    assert _region_line("serving vllm", {"region": region, "machine": probed}) == (
        "serving vllm: 6.9 s, load 1.6 -> 2.0, other processes 0.03 cores; "
        "the machine just before: 312 GFLOP/s, 23.1 GB/s copy"
    )
    assert _region_line("serving vllm", {"region": region}) == (
        "serving vllm: 6.9 s, load 1.6 -> 2.0, other processes 0.03 cores"
    )


def test_a_run_probed_on_a_slowed_host_is_run_again_and_its_figure_left_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The probes before the runs in the order they go: vLLM's first run after 240 GFLOP/s,
    # under SLOW_HOST_SHARE of kvmesh's 300 before it; its repeat after 290 is calm.
    probes = iter([300.0, 240.0, 290.0, 310.0, 250.0, 305.0])
    tok_s = {1: 50.0, 2: 60.0, 3: 40.0, 4: 45.0}  # by prompt set: run 1, run 2, their spares

    async def server_row(
        server: _Idle, row: str, work: Workload, prompts: dict[str, Any]
    ) -> dict[str, Any]:
        machine = {"matmul_gflops": next(probes), "copy_gb_s": 20.0}
        region = {"seconds": 12.0, "load_start": 1.0, "load_end": 1.2, "other_cores": 0.02}
        return {"region": region, "machine": machine, "tok_s": tok_s[prompts["set"]]}

    async def warm_up(*args: Any) -> dict[str, Any]:
        return {}

    monkeypatch.setattr(bench.peers, "_server_row", server_row)
    monkeypatch.setattr(bench.peers, "serving_row", warm_up)
    sets: list[dict[str, Any]] = [{"set": i, "serving": [[1]] * 4} for i in range(5)]
    rows = {"kvmesh": ["serving"], "vllm": ["serving"]}
    servers: list[Server] = [_Idle("kvmesh"), _Idle("vllm")]
    results = asyncio.run(server_rows(servers, rows, Workload(runs=2), sets))

    vllm = results["vllm"]["serving"]
    # Run 1 (slowed, 50 tok/s), its repeat on the spare set, then run 2, calm at 310.
    assert [r["tok_s"] for r in vllm] == [50.0, 40.0, 60.0]
    assert [r["slow_host"] for r in vllm] == [True, False, False]
    assert vllm[1]["repeat_of_disturbed"] == 0
    # kvmesh's second run (250 against the fastest 310 before it) goes again after 305.
    kvmesh = results["kvmesh"]["serving"]
    assert [r["tok_s"] for r in kvmesh] == [50.0, 60.0, 45.0]
    assert [r["slow_host"] for r in kvmesh] == [False, True, False]
    # The slowed run's figure counts only where a row has no calm run.
    assert best(kvmesh, "tok_s") == 50.0
    assert best([kvmesh[1]], "tok_s") == 60.0
    assert "**slow host**" in _region_line("serving kvmesh", kvmesh[1])
    assert "(repeat of run 2)" in _region_line("serving kvmesh", kvmesh[2])
