import pytest

from services.worker.engine.api import FinishReason, SamplingParams, TokenLogprob
from services.worker.engine.output_processor import Emission, OutputProcessor
from tests.unit.engine.factories import PieceDecoder

PIECES = ["Hi ", "there", " S", "TOP", " more", "x", "<eos>", "TO", "", "é", "P."]
EOS = 6
EMPTY = 8  # a token with no text of its own yet (the first bytes of a character)


def run(
    tokens: list[int], sampling: SamplingParams, context_length: int = 1000
) -> list[tuple[list[int], str, FinishReason | None]]:
    """(released token ids, released text, finish) after each token, until the end."""
    processor = OutputProcessor(sampling, PieceDecoder(PIECES), frozenset({EOS}), context_length)
    events = []
    for n, token in enumerate(tokens, start=1):
        emission = processor.process(token, None, n, 10 + n)
        events.append((emission.token_ids, emission.text, emission.finish))
        if emission.finish is not None:
            break
    return events


def released(events: list[tuple[list[int], str, FinishReason | None]]) -> tuple[list[int], str]:
    return [t for ids, _, _ in events for t in ids], "".join(text for _, text, _ in events)


def test_a_stop_string_split_across_tokens_is_in_neither_ids_nor_text() -> None:
    events = run([0, 1, 2, 3, 4], SamplingParams(stop=("STOP",)))
    assert events == [
        ([0], "Hi ", None),
        ([1], "there", None),
        ([2], " ", None),  # " S" begins before the stop string: kept, its text cut there
        ([], "", FinishReason.STOP),  # "TOP" carries only the stop string's text
    ]


def test_a_token_that_may_begin_a_stop_string_waits_with_its_text() -> None:
    events = run([0, 7, 5], SamplingParams(stop=("TOP",)))
    assert events == [([0], "Hi ", None), ([], "", None), ([7, 5], "TOx", None)]


def test_held_text_is_released_when_the_stop_string_does_not_complete() -> None:
    events = run([2, 5, 4], SamplingParams(stop=("STOP",)))
    assert events == [([2], " ", None), ([5], "Sx", None), ([4], " more", None)]


def test_text_before_a_stop_string_inside_one_token_is_kept_with_its_token() -> None:
    events = run([0, 4], SamplingParams(stop=("mo",)))
    assert events == [([0], "Hi ", None), ([4], " ", FinishReason.STOP)]


def test_the_rest_of_a_kept_token_may_follow_as_text_without_an_id() -> None:
    # the "." of "P." may begin ".S": token 10 goes out with "P", its "." follows later
    events = run([0, 10, 5], SamplingParams(stop=(".S",)))
    assert events == [([0], "Hi ", None), ([10], "P", None), ([5], ".x", None)]
    assert released(events) == ([0, 10, 5], "Hi P.x")


def test_earliest_of_several_stop_strings_wins() -> None:
    events = run([1], SamplingParams(stop=("re", "he")))
    assert events == [([1], "t", FinishReason.STOP)]


def test_eos_is_in_neither_unless_ignored() -> None:
    assert run([0, EOS], SamplingParams()) == [([0], "Hi ", None), ([], "", FinishReason.STOP)]
    events = run([0, EOS, 1], SamplingParams(ignore_eos=True, max_tokens=3))
    assert released(events) == ([0, EOS, 1], "Hi <eos>there")
    assert events[-1][2] == FinishReason.LENGTH


def test_a_stop_token_releases_what_was_held_but_not_itself() -> None:
    events = run([2, 5], SamplingParams(stop=("STOP",), stop_token_ids=(5,)))
    assert events == [([2], " ", None), ([], "S", FinishReason.STOP)]
    events = run([7, 5], SamplingParams(stop=("TOP",), stop_token_ids=(5,)))
    assert events == [([], "", None), ([7], "TO", FinishReason.STOP)]


def test_a_token_without_text_waits_for_its_text_only_when_a_stop_string_may_begin() -> None:
    assert run([0, EMPTY, 9], SamplingParams()) == [
        ([0], "Hi ", None),
        ([EMPTY], "", None),  # nothing can stop it: out at once
        ([9], "é", None),
    ]
    events = run([0, EMPTY, 9], SamplingParams(stop=("STOP",)))
    assert events == [([0], "Hi ", None), ([], "", None), ([EMPTY, 9], "é", None)]
    # ...and a stop string that starts with that text drops both
    events = run([EMPTY, 9], SamplingParams(stop=("é",)))
    assert events == [([], "", None), ([], "", FinishReason.STOP)]


def test_max_tokens_and_context_length_end_with_length_and_release_everything() -> None:
    assert run([0, 1, 0], SamplingParams(max_tokens=2))[-1] == ([1], "there", FinishReason.LENGTH)
    events = run([7, 1], SamplingParams(stop=("TOP",), max_tokens=1))
    assert events == [([7], "TO", FinishReason.LENGTH)]  # held-back tokens go out at the end
    assert run([0, 1], SamplingParams(), context_length=12) == [
        ([0], "Hi ", None),
        ([1], "there", FinishReason.LENGTH),
    ]


def test_flush_releases_held_tokens_with_their_logprobs() -> None:
    processor = OutputProcessor(
        SamplingParams(stop=("TOP",)), PieceDecoder(PIECES), frozenset({EOS}), 1000
    )
    logprob = TokenLogprob(7, -0.5, [(7, -0.5)])
    assert processor.process(7, logprob, 1, 11) == Emission([], "", [], None)
    assert processor.flush(FinishReason.ABORT) == Emission([7], "TO", [logprob], FinishReason.ABORT)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("top_k", -1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("seed", -1),
        ("stop", ("",)),
        ("stop_token_ids", (-2,)),
        ("logprobs", 21),
    ],
)
def test_sampling_params_validation_names_the_field(field: str, value: object) -> None:
    params = SamplingParams()
    setattr(params, field, value)
    with pytest.raises(ValueError, match=field):
        params.validate()
