"""Structured output on a vLLM worker (issue 16.7): kvmesh's constraint as vLLM's.

The same schema suite and grammar cases as the native engine's (tests/unit/engine/
test_structured_output.py) on the tiny random Llama: the model is noise, so an answer that
parses and validates does so because vLLM masked the logits with the mapped constraint.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import jsonschema
import pytest
import pytest_asyncio
from vllm import SamplingParams as VllmSamplingParams
from vllm.inputs import TokensPrompt

from kvmesh.contracts.constraints import Constraint, ConstraintKind, StructuralTag, Structure
from kvmesh.v1 import common_pb2, worker_pb2
from services.worker.backends.vllm_constraints import structured_outputs
from tests.service.worker_mesh import (
    InProcessWorker,
    all_idle,
    colocated,
    decode_start,
    prefill_request,
    request,
)
from tests.unit.engine.test_structured_output import CALL_SCHEMA, GRAMMARS, SCHEMAS
from tests.vllm.conftest import start_vllm_worker, vllm_engine

pytestmark = pytest.mark.asyncio(loop_scope="module")

MAX_TOKENS = 160
PROMPT = list(range(30, 47))
SEEDS = [None, 0, 1]
"""None: greedy; the others sample at temperature 0.9 with that seed."""
_NOTATIONS = {
    ConstraintKind.EBNF: common_pb2.GRAMMAR_NOTATION_EBNF,
    ConstraintKind.LARK: common_pb2.GRAMMAR_NOTATION_LARK,
}


def sampling(constraint: Constraint, seed: int | None = None) -> common_pb2.SamplingParams:
    """The constraint as a request carries it, greedy or sampled with `seed`."""
    params = common_pb2.SamplingParams(max_tokens=MAX_TOKENS)
    if seed is not None:
        params.temperature, params.top_p, params.seed = 0.9, 0.95, seed
    kind = constraint.kind
    if kind is ConstraintKind.JSON_SCHEMA:
        params.json_schema = constraint.text
    elif kind is ConstraintKind.JSON_OBJECT:
        params.json_object = True
    elif kind is ConstraintKind.REGEX:
        params.regex = constraint.text
    elif kind is ConstraintKind.CHOICE:
        params.choice.options.extend(constraint.options)
    elif kind is ConstraintKind.STRUCTURAL_TAG:
        params.structural_tag = constraint.text
    else:
        params.grammar.notation = _NOTATIONS[kind]
        params.grammar.source = constraint.text
    return params


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def worker(tiny_llama32_dir: Path) -> AsyncIterator[InProcessWorker]:
    started = await start_vllm_worker(tiny_llama32_dir, "colocated")
    yield started
    await started.stop()


async def answer(
    worker: InProcessWorker, rid: str, params: common_pb2.SamplingParams, *, bounded: bool = True
) -> str:
    """The answer's text; it must be complete (STOP) unless the constraint is unbounded (any
    JSON object), whose answer a random model may still be writing at max_tokens."""
    result = await colocated(worker.stub, request(rid, PROMPT, params))
    finish = result.finished.finish_reason
    if not bounded and finish == common_pb2.FINISH_REASON_LENGTH:
        assert result.finished.usage.completion_tokens == MAX_TOKENS
        return ""
    assert finish == common_pb2.FINISH_REASON_STOP, result.text
    return result.text


@pytest.mark.parametrize("name", sorted(SCHEMAS))
async def test_every_schema_answer_parses_and_validates(worker: InProcessWorker, name: str) -> None:
    schema = SCHEMAS[name]
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    for seed in SEEDS:
        text = await answer(worker, f"{name}-{seed}", sampling(constraint, seed))
        # xgrammar's JSON strings admit raw control characters (see the native suite).
        jsonschema.validate(json.loads(text, strict=False), schema)
    assert await all_idle([worker.stub])


async def test_regex_choice_grammars_and_json_object_match(worker: InProcessWorker) -> None:
    for index, (constraint, pattern) in enumerate(GRAMMARS):
        for seed in SEEDS:
            params = sampling(constraint, seed)
            text = await answer(worker, f"g{index}-{seed}", params, bounded=pattern is not None)
            if pattern is None:
                assert not text or isinstance(json.loads(text, strict=False), dict)
            else:
                assert re.fullmatch(pattern, text), (constraint, text)
    assert await all_idle([worker.stub])


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        # Lark whose string literal holds "::=": vLLM would read it as EBNF.
        (Constraint(ConstraintKind.LARK, 'start: "a ::= b"'), "sampling.grammar.notation"),
        # EBNF without a "::=" rule: vLLM would read it as Lark.
        (Constraint(ConstraintKind.EBNF, 'root: "x"'), "sampling.grammar.notation"),
        (Constraint(ConstraintKind.EBNF, "root ::= undefined_rule"), "sampling.grammar"),
        (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "strnig"}'), "sampling.json_schema"),
        (Constraint(ConstraintKind.REGEX, "(unclosed"), "sampling.regex"),
    ],
)
async def test_a_constraint_vllm_cannot_take_is_invalid_argument_naming_the_field(
    worker: InProcessWorker, constraint: Constraint, field: str
) -> None:
    call = worker.stub.Generate(timeout=30)
    await call.write(
        worker_pb2.WorkerGenerateMessage(request=request("bad", PROMPT, sampling(constraint)))
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        events = [event async for event in call]
        assert not [event for event in events if event.WhichOneof("event") == "chunk"]
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (raised.value.details() or "").startswith(field + ":"), raised.value.details()
    assert await all_idle([worker.stub])
    # The worker still serves.
    assert await answer(worker, "after", sampling(GRAMMARS[0][0]))


async def test_a_constrained_hand_off_to_a_vllm_decode_worker_is_refused(
    worker: InProcessWorker,
) -> None:
    """vLLM cannot resume a grammar after the prefill's first token: refused, never free text."""
    req = request("split", PROMPT, sampling(GRAMMARS[0][0]))
    prefilled = await worker.stub.Prefill(prefill_request(req, worker))
    assert re.match(r"[a-c]", prefilled.first_token.text)
    call = worker.stub.Decode(timeout=10)
    await call.write(decode_start(req, prefilled))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        _ = [event async for event in call]
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (raised.value.details() or "").startswith("sampling.regex:")
    await worker.stub.ReleaseKv(worker_pb2.ReleaseKvRequest(lease_id=prefilled.lease.lease_id))
    assert await all_idle([worker.stub])


def angle_tag(stop_after_first: bool) -> Constraint:
    """A structural tag whose trigger is one byte token: "<", a JSON value, ">"."""
    tag = StructuralTag(("<",), (Structure("<", CALL_SCHEMA, ">"),), stop_after_first)
    return Constraint(ConstraintKind.STRUCTURAL_TAG, tag.as_json())


async def test_a_structural_tag_leaves_untriggered_text_free(worker: InProcessWorker) -> None:
    """The greedy answer never writes the trigger here: token for token the free answer."""
    free = common_pb2.SamplingParams(max_tokens=40, ignore_eos=True)
    plain = await colocated(worker.stub, request("plain", PROMPT, free))
    assert "<" not in plain.text
    tagged = sampling(angle_tag(False))
    tagged.max_tokens, tagged.ignore_eos = 40, True
    result = await colocated(worker.stub, request("tagged", PROMPT, tagged))
    assert result.token_ids == plain.token_ids
    assert await all_idle([worker.stub])


async def test_a_triggered_structure_validates_and_ends_the_answer(
    worker: InProcessWorker,
) -> None:
    """The mapped tag straight on vLLM, its trigger made certain with vLLM's logit bias (which
    the grammar's mask overrides inside the structure): the value validates, the answer
    stops after the first structure."""
    engine = vllm_engine(worker)
    trigger = engine.tokenizer.backend.token_to_id("<")
    params = VllmSamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logit_bias={trigger: 100.0},
        structured_outputs=structured_outputs(angle_tag(True), "xgrammar"),
    )
    outputs = [
        out
        async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=PROMPT), params, "angle")
    ]
    final = outputs[-1].outputs[0]
    assert final.finish_reason == "stop", final.text
    assert final.text.startswith("<") and final.text.endswith(">"), final.text
    jsonschema.validate(json.loads(final.text[1:-1]), CALL_SCHEMA)
