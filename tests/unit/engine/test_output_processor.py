import pytest

from services.worker.engine.api import FinishReason, SamplingParams
from services.worker.engine.output_processor import OutputProcessor
from tests.unit.engine.factories import PieceDecoder

PIECES = ["Hi ", "there", " S", "TOP", " more", "x", "<eos>", "TO"]
EOS = 6


def run(
    tokens: list[int], sampling: SamplingParams, context_length: int = 1000
) -> list[tuple[str, FinishReason | None]]:
    processor = OutputProcessor(sampling, PieceDecoder(PIECES), frozenset({EOS}), context_length)
    events = []
    for n, token in enumerate(tokens, start=1):
        events.append(processor.process(token, n, 10 + n))
        if events[-1][1] is not None:
            break
    return events


def test_stop_string_split_across_tokens_is_never_emitted() -> None:
    events = run([0, 1, 2, 3, 4], SamplingParams(stop=("STOP",)))
    assert events == [
        ("Hi ", None),
        ("there", None),
        (" ", None),  # "S" is held: it may start "STOP"
        ("", FinishReason.STOP),
    ]


def test_held_text_is_released_when_the_stop_string_does_not_complete() -> None:
    events = run([2, 5, 4], SamplingParams(stop=("STOP",)))
    assert events == [(" ", None), ("Sx", None), (" more", None)]


def test_text_before_a_stop_string_inside_one_token_is_emitted() -> None:
    events = run([0, 4], SamplingParams(stop=("mo",)))
    assert events == [("Hi ", None), (" ", FinishReason.STOP)]


def test_earliest_of_several_stop_strings_wins() -> None:
    events = run([1], SamplingParams(stop=("re", "he")))
    assert events == [("t", FinishReason.STOP)]


def test_eos_stops_without_text_unless_ignored() -> None:
    assert run([0, EOS], SamplingParams()) == [("Hi ", None), ("", FinishReason.STOP)]
    events = run([0, EOS, 1], SamplingParams(ignore_eos=True, max_tokens=3))
    assert events == [("Hi ", None), ("<eos>", None), ("there", FinishReason.LENGTH)]


def test_stop_token_ids_release_held_text() -> None:
    events = run([2, 5], SamplingParams(stop=("STOP",), stop_token_ids=(5,)))
    assert events == [(" ", None), ("S", FinishReason.STOP)]


def test_max_tokens_and_context_length_end_with_length() -> None:
    assert run([0, 1, 0], SamplingParams(max_tokens=2))[-1] == ("there", FinishReason.LENGTH)
    events = run([7, 1], SamplingParams(stop=("TOP",), max_tokens=1))
    assert events == [("TO", FinishReason.LENGTH)]  # held-back text is flushed at the end
    assert run([0, 1], SamplingParams(), context_length=12) == [
        ("Hi ", None),
        ("there", FinishReason.LENGTH),
    ]


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
