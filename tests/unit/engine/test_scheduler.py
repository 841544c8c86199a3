from services.worker.engine.api import Priority
from services.worker.engine.block_pool import BlockPool
from services.worker.engine.kv_cache_manager import KvCacheManager
from services.worker.engine.request import RequestState, RequestStatus
from services.worker.engine.scheduler import TAIL_SHARE, Scheduler, SchedulerOutput
from tests.unit.engine.factories import make_state

BS = 4


def scheduler(num_blocks: int = 64, budget: int = 64, max_seqs: int = 8) -> Scheduler:
    return Scheduler(KvCacheManager(BlockPool(num_blocks), BS, "fp"), budget, max_seqs)


def run(sched: Scheduler) -> SchedulerOutput:
    """One step with a fake model: every chunk is computed; chunks with logits sample 7."""
    out = sched.schedule()
    for chunk in out.chunks:
        chunk.state.num_computed_tokens += chunk.num_tokens
        sched.kv.cache_computed_blocks(chunk.state)
        if chunk.want_logits:
            chunk.state.token_ids.append(7)
    return out


def shape(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(c.state.request_id, c.start_pos, c.num_tokens, c.want_logits) for c in out.chunks]


def test_prefill_is_chunked_under_the_token_budget() -> None:
    sched = scheduler(budget=10)
    sched.add(make_state("a", range(8), arrival_seq=0))
    sched.add(make_state("b", range(8), arrival_seq=1))
    assert shape(run(sched)) == [("a", 0, 8, True), ("b", 0, 2, False)]
    # Decodes first, then the rest of b's prompt.
    assert shape(run(sched)) == [("a", 8, 1, True), ("b", 2, 6, True)]
    assert shape(run(sched)) == [("a", 9, 1, True), ("b", 8, 1, True)]


def test_a_prompt_whose_last_chunk_would_leave_a_few_tokens_takes_them_over_the_budget() -> None:
    """Budget 64: up to 64 // TAIL_SHARE = 4 tokens over it, to finish a prompt in this step.
    The step then admits nothing more; a remainder longer than that is cut at the budget."""
    sched = scheduler(num_blocks=128, budget=64)
    assert sched.tail_tokens == 64 // TAIL_SHARE == 4
    sched.add(make_state("tail", range(68), arrival_seq=0))
    sched.add(make_state("next", range(1000, 1008), arrival_seq=1))
    assert shape(run(sched)) == [("tail", 0, 68, True)]
    assert shape(run(sched)) == [("tail", 68, 1, True), ("next", 0, 8, True)]
    # Beside two decodes 62 tokens are left: a 65-token prompt takes 3 over them.
    sched.add(make_state("beside", range(2000, 2065), arrival_seq=2))
    assert shape(run(sched))[2:] == [("beside", 0, 65, True)]
    # Beside three decodes, 61 left: 127 tokens go 61, then 61 (66 would be 5 over), then 5.
    sched.add(make_state("long", range(3000, 3127), arrival_seq=3))
    assert shape(run(sched))[3:] == [("long", 0, 61, False)]
    assert shape(run(sched))[3:] == [("long", 61, 61, False)]
    assert shape(run(sched))[3:] == [("long", 122, 5, True)]


def test_interactive_is_admitted_before_batch_and_fifo_within_a_class() -> None:
    sched = scheduler(budget=12)
    sched.add(make_state("batch-1", range(4), arrival_seq=0, priority=Priority.BATCH))
    sched.add(make_state("inter-1", range(4), arrival_seq=1))
    sched.add(make_state("inter-2", range(4), arrival_seq=2))
    sched.add(make_state("batch-2", range(4), arrival_seq=3, priority=Priority.BATCH))
    # Batch prompts sit out the step that computes the interactive ones.
    assert [c[0] for c in shape(run(sched))] == ["inter-1", "inter-2"]
    # Running decodes come first, then batch admissions in arrival order.
    assert [c[0] for c in shape(run(sched))] == ["inter-1", "inter-2", "batch-1", "batch-2"]


def test_batch_prefill_pauses_while_an_interactive_prompt_computes() -> None:
    sched = scheduler(budget=8)
    sched.add(make_state("decoding", range(2), arrival_seq=0, priority=Priority.BATCH))
    sched.add(make_state("long", range(20), arrival_seq=1, priority=Priority.BATCH))
    assert shape(run(sched)) == [("decoding", 0, 2, True), ("long", 0, 6, False)]
    sched.add(make_state("inter", range(100, 105), arrival_seq=2))
    # The interactive prompt runs with the batch decode; the batch prefill chunk waits.
    assert shape(run(sched)) == [("inter", 0, 5, True), ("decoding", 2, 1, True)]
    # Interactive is decoding now: the batch prefill resumes where it stopped.
    assert shape(run(sched)) == [
        ("inter", 5, 1, True),
        ("decoding", 3, 1, True),
        ("long", 6, 6, False),
    ]


def test_an_interactive_request_that_cannot_start_does_not_stall_batch_prefill() -> None:
    sched = scheduler(budget=8, max_seqs=1)
    sched.add(make_state("long", range(12), arrival_seq=0, priority=Priority.BATCH))
    assert shape(run(sched)) == [("long", 0, 8, False)]
    sched.add(make_state("inter", range(4), arrival_seq=1))  # no running slot for it
    assert shape(run(sched)) == [("long", 8, 4, True)]
    assert sched.num_waiting == 1


def test_running_cap_limits_admissions() -> None:
    sched = scheduler(max_seqs=2)
    for i in range(3):
        sched.add(make_state(f"r{i}", range(4), arrival_seq=i))
    assert [c[0] for c in shape(run(sched))] == ["r0", "r1"]
    assert sched.num_waiting == 1
    finished = sched.running[0]
    sched.remove(finished)
    sched.kv.free(finished.request_id)
    assert [c[0] for c in shape(run(sched))] == ["r1", "r2"]


def test_head_of_line_that_does_not_fit_blocks_the_queue() -> None:
    sched = scheduler(num_blocks=3, budget=64)
    sched.add(make_state("big", range(16), arrival_seq=0))  # 4 blocks: never fits now
    sched.add(make_state("small", range(2), arrival_seq=1))
    assert run(sched).chunks == []
    assert sched.num_waiting == 2


def test_preemption_takes_batch_before_interactive_newest_first() -> None:
    # 5 blocks of 4 tokens; four 4-token prompts take one each, and each decode needs a second.
    # Batch prompts of 3 tokens end their first step with 4 tokens: still one block each.
    sched = scheduler(num_blocks=5, budget=64)
    sched.add(make_state("b-old", range(3), arrival_seq=1, priority=Priority.BATCH))
    sched.add(make_state("b-new", range(3), arrival_seq=2, priority=Priority.BATCH))
    run(sched)
    sched.add(make_state("i-old", range(4), arrival_seq=0))
    sched.add(make_state("i-new", range(4), arrival_seq=3))
    assert [c[0] for c in shape(run(sched))] == ["i-old", "i-new", "b-old", "b-new"]
    assert sched.kv.pool.num_free_blocks == 1
    # i-old takes the free block; i-new's block comes from b-new; b-old is then the
    # newest batch request left and gives way itself.
    out = run(sched)
    assert [s.request_id for s in out.preempted] == ["b-new", "b-old"]
    assert [c[0] for c in shape(out)] == ["i-old", "i-new"]
    assert [s.request_id for s in sched.waiting[Priority.BATCH]] == ["b-old", "b-new"]
    for victim in out.preempted:
        assert victim.num_computed_tokens == 0
        assert victim.status is RequestStatus.WAITING
        assert not sched.kv.has_blocks(victim.request_id)


def test_preempted_request_recomputes_its_output_tokens_too() -> None:
    sched = scheduler(num_blocks=2, budget=64)
    a = make_state("a", range(3), arrival_seq=0)
    b = make_state("b", range(3), arrival_seq=1)
    sched.add(a)
    sched.add(b)
    run(sched)  # both prompts computed, each sampled a token (4 tokens, 1 block each)
    run(sched)  # decode position 3: still one block each; now 5 tokens
    out = run(sched)  # position 4 needs a second block for each: b is preempted
    assert [s.request_id for s in out.preempted] == ["b"]
    assert b.token_ids == [0, 1, 2, 7, 7]
    sched.remove(a)
    sched.kv.free("a")
    # b comes back and recomputes prompt + output; its own cached block 0 is reused.
    assert shape(run(sched)) == [("b", 4, 1, True)]


def test_a_request_that_cannot_grow_alone_preempts_itself() -> None:
    sched = scheduler(num_blocks=1, budget=64)
    a = make_state("a", range(3), arrival_seq=0)
    sched.add(a)
    run(sched)
    run(sched)  # 4 tokens computed... the 5th needs a second block
    out = run(sched)
    assert out.preempted == [a]
    assert out.chunks == []


def test_remove_from_either_queue() -> None:
    sched = scheduler()
    waiting = make_state("w", range(4), arrival_seq=0)
    running: RequestState = make_state("r", range(4), arrival_seq=1)
    sched.add(running)
    run(sched)
    sched.add(waiting)
    sched.remove(waiting)
    sched.remove(running)
    assert not sched.has_requests()
    assert waiting.status is RequestStatus.FINISHED
