import math

import pytest
import torch

from services.worker.engine.api import SamplingParams
from services.worker.engine.sampler import Sampler, SampleRow, needs_host

VOCAB = 50


def random_logits(rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=generator) * 3


def test_greedy_rows_take_the_argmax() -> None:
    logits = random_logits(3, 0)
    rows = [SampleRow(SamplingParams(), 0) for _ in range(3)]
    assert Sampler().sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_mixed_batch_keeps_greedy_rows_greedy() -> None:
    logits = random_logits(4, 1)
    hot = SamplingParams(temperature=1.0, seed=3)
    rows = [
        SampleRow(SamplingParams(), 0),
        SampleRow(hot, 0),
        SampleRow(SamplingParams(), 0),
        SampleRow(hot, 1),
    ]
    tokens = Sampler().sample(logits, rows).token_ids
    assert tokens[0] == int(logits[0].argmax())
    assert tokens[2] == int(logits[2].argmax())


def test_seeded_draws_do_not_depend_on_batch_mates() -> None:
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)
    logits = random_logits(1, 2)
    alone = [Sampler().sample(logits, [SampleRow(seeded, i)]).token_ids[0] for i in range(20)]
    batched = []
    for i in range(20):
        mates = random_logits(3, 100 + i)
        batch = torch.cat([mates[:2], logits, mates[2:]])
        rows = [
            SampleRow(SamplingParams(temperature=1.0), i),
            SampleRow(SamplingParams(temperature=0.5, seed=9), i),
            SampleRow(seeded, i),
            SampleRow(SamplingParams(), i),
        ]
        batched.append(Sampler().sample(batch, rows).token_ids[2])
    assert alone == batched
    assert len(set(alone)) > 1  # it really samples


def test_top_k_limits_the_support() -> None:
    logits = random_logits(1, 3)
    top3 = set(logits[0].topk(3).indices.tolist())
    params = SamplingParams(temperature=5.0, top_k=3, seed=0)
    drawn = {Sampler().sample(logits, [SampleRow(params, i)]).token_ids[0] for i in range(200)}
    assert drawn == top3


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    params = SamplingParams(temperature=1.0, top_p=0.8, seed=0)
    rows = [SampleRow(params, i) for i in range(200)]
    drawn = {Sampler().sample(probs.log(), [row]).token_ids[0] for row in rows}
    assert drawn == {0, 1}


def test_per_row_top_k_and_top_p_in_one_batch() -> None:
    logits = random_logits(2, 4)
    rows = [
        SampleRow(SamplingParams(temperature=1.0, top_k=1, seed=1), 0),
        SampleRow(SamplingParams(temperature=1.0, top_p=1e-6, seed=1), 0),
    ]
    assert Sampler().sample(logits, rows).token_ids == logits.argmax(-1).tolist()


def test_logprobs_of_chosen_and_top_tokens() -> None:
    logits = random_logits(2, 5)
    rows = [SampleRow(SamplingParams(logprobs=3), 0), SampleRow(SamplingParams(), 0)]
    out = Sampler().sample(logits, rows)
    assert out.logprobs[1] is None
    first = out.logprobs[0]
    assert first is not None
    expected = torch.log_softmax(logits[0], -1)
    assert first.token_id == out.token_ids[0]
    assert math.isclose(first.logprob, float(expected[first.token_id]), rel_tol=1e-5)
    assert [t for t, _ in first.top] == expected.topk(3).indices.tolist()
    assert first.top[0][1] == pytest.approx(float(expected.max()))


def test_zero_logprobs_gives_only_the_chosen_token() -> None:
    out = Sampler().sample(random_logits(1, 6), [SampleRow(SamplingParams(logprobs=0), 0)])
    assert out.logprobs[0] is not None
    assert out.logprobs[0].top == []


def test_only_plain_greedy_rows_sample_where_the_logits_are() -> None:
    """A GPU's logits stay there only for rows whose token is a bare argmax."""
    greedy, sampled = SamplingParams(), SamplingParams(temperature=0.7)
    with_logprobs = SamplingParams(logprobs=1)
    assert not needs_host([SampleRow(greedy, 0), SampleRow(greedy, 3)])
    assert needs_host([SampleRow(greedy, 0), SampleRow(sampled, 0)])
    assert needs_host([SampleRow(with_logprobs, 0)])
