"""Structured output on the tiny random Llama, with both grammar backends.

The model is random, so whatever it "wants" to say is noise: every answer that parses and
validates does so because of the mask, not the model. Unconstrained requests sharing the batch
must produce exactly the tokens they produce without constrained neighbours.
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch

from kvmesh.contracts.constraints import (
    Constraint,
    ConstraintError,
    ConstraintKind,
    StructuralTag,
    Structure,
)
from services.worker.engine.api import EngineRequest, FinishReason, RequestOutput, SamplingParams
from services.worker.engine.async_engine import AsyncEngine
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.grammar import GrammarCompiler, GrammarMatcher
from services.worker.engine.grammar_xgrammar import XgrammarBackend
from services.worker.engine.loader import LoadedModel, load_model
from tests.procs import REPO_ROOT
from tests.unit.engine.test_engine import Result, drive

BACKENDS = ["xgrammar", "llguidance"]
MAX_TOKENS = 160

SCHEMAS: dict[str, dict[str, object]] = {
    "nested_object": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "address": {
                "type": "object",
                "properties": {
                    "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    "floor": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["zip", "floor"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array_item_counts": {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum_and_const": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "version": {"const": 2},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "version", "ok"],
        "additionalProperties": False,
    },
    "number_ranges": {
        "type": "object",
        "properties": {
            "count": {"type": "integer", "minimum": 10, "maximum": 20},
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["count", "ratio"],
        "additionalProperties": False,
    },
    "any_of_one_of": {
        "type": "object",
        "properties": {
            "id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]},
            "kind": {
                "oneOf": [
                    {"type": "string", "enum": ["cat", "dog"]},
                    {"type": "boolean"},
                ]
            },
        },
        "required": ["id", "kind"],
        "additionalProperties": False,
    },
    "defs_and_ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
        "required": ["from", "to"],
        "additionalProperties": False,
    },
}
SEEDS = [None, 0, 1, 2]
"""None: greedy; the others sample at temperature 0.9 with that seed."""


@pytest.fixture(scope="module")
def tiny_loaded(tiny_llama_dir: Path) -> LoadedModel:
    return load_model(str(tiny_llama_dir))


def make_engine(loaded: LoadedModel, backend: str, **overrides: object) -> Engine:
    config = EngineConfig(
        num_kv_blocks=256, max_num_batched_tokens=256, grammar_backend=backend
    ).replace(**overrides)
    return Engine(loaded, config)


def sampling(seed: int | None, constraint: Constraint | None = None) -> SamplingParams:
    if seed is None:
        return SamplingParams(max_tokens=MAX_TOKENS, constraint=constraint)
    return SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.95, seed=seed, constraint=constraint
    )


def prompt(n: int) -> list[int]:
    generator = torch.Generator().manual_seed(100 + n)
    return torch.randint(3, 300, (5 + n % 7,), generator=generator).tolist()


def unconstrained_requests() -> list[EngineRequest]:
    """Free-text neighbours: greedy, seeded, with top-k, and with a stop token id."""
    return [
        EngineRequest("free-greedy", prompt(90), SamplingParams(max_tokens=40, ignore_eos=True)),
        EngineRequest(
            "free-seeded",
            prompt(91),
            SamplingParams(max_tokens=40, temperature=0.8, top_k=20, seed=5, ignore_eos=True),
        ),
        EngineRequest("free-short", prompt(92), SamplingParams(max_tokens=7, ignore_eos=True)),
    ]


def parse_json(text: str) -> object:
    """Strict JSON: no raw control character (U+0000-U+001F) inside a string."""
    return json.loads(text)


def finished(results: dict[str, Result], request_id: str) -> Result:
    result = results[request_id]
    assert result.finish_reason is not None
    return result


@pytest.mark.parametrize("backend", BACKENDS)
def test_schema_suite_validates_in_one_batch_with_free_text_unchanged(
    tiny_loaded: LoadedModel, backend: str
) -> None:
    constrained = [
        EngineRequest(
            f"{name}-{seed}",
            prompt(n),
            sampling(seed, Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))),
        )
        for n, (name, schema) in enumerate(SCHEMAS.items())
        for seed in SEEDS
    ]
    free = unconstrained_requests()
    engine = make_engine(tiny_loaded, backend)
    mixed = drive(engine, {0: constrained[:12] + free[:2], 2: constrained[12:] + free[2:]})
    for request in constrained:
        result = finished(mixed, request.request_id)
        assert result.finish_reason is FinishReason.STOP, (request.request_id, result.text)
        schema = SCHEMAS[request.request_id.rsplit("-", 1)[0]]
        jsonschema.validate(parse_json(result.text), schema)
    alone = drive(make_engine(tiny_loaded, backend), {0: free[:2], 2: free[2:]})
    for request in free:
        assert mixed[request.request_id].token_ids == alone[request.request_id].token_ids
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


GRAMMARS = [
    (Constraint(ConstraintKind.REGEX, "[a-c]{2,4}-[0-9]{3}"), r"[a-c]{2,4}-[0-9]{3}"),
    (
        Constraint(ConstraintKind.CHOICE, options=("yes", "no", "a|b (c)", "x\ny")),
        r"yes|no|a\|b \(c\)|x\ny",
    ),
    (
        Constraint(ConstraintKind.EBNF, 'root ::= "(" [0-9] ("+" [0-9])* ")"'),
        r"\([0-9](\+[0-9])*\)",
    ),
    (Constraint(ConstraintKind.LARK, 'start: "<" WORD ">"\nWORD: /[a-z]{1,8}/'), r"<[a-z]{1,8}>"),
    (Constraint(ConstraintKind.JSON_OBJECT), None),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_choice_and_grammars_match(tiny_loaded: LoadedModel, backend: str) -> None:
    requests = [
        EngineRequest(f"g{i}-{seed}", prompt(i), sampling(seed, constraint))
        for i, (constraint, _) in enumerate(GRAMMARS)
        for seed in SEEDS
    ]
    engine = make_engine(tiny_loaded, backend)
    results = drive(engine, {0: requests})
    for request in requests:
        result = finished(results, request.request_id)
        assert result.finish_reason is FinishReason.STOP, (request.request_id, result.text)
        pattern = GRAMMARS[int(request.request_id[1 : request.request_id.index("-")])][1]
        if pattern is None:
            assert isinstance(parse_json(result.text), dict)
        else:
            assert re.fullmatch(pattern, result.text), (request.request_id, result.text)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "constraint",
    [
        Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "strnig"}'),
        Constraint(ConstraintKind.REGEX, "(unclosed"),
        Constraint(ConstraintKind.EBNF, "root ::= undefined_rule"),
        Constraint(ConstraintKind.LARK, "start: missing_rule"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_before_any_token(
    tiny_loaded: LoadedModel, backend: str, constraint: Constraint
) -> None:
    engine = make_engine(tiny_loaded, backend)
    with pytest.raises(ConstraintError) as refused:
        engine.add_request(EngineRequest("bad", prompt(1), sampling(None, constraint)))
    assert refused.value.field == constraint.field
    assert "does not compile" in refused.value.detail
    assert not engine.has_work() and engine.live_request_ids() == []


class GatedBackend:
    """The real xgrammar backend whose compiles wait for a gate: a compile as slow as the
    test needs, on any machine."""

    def __init__(self, engine: Engine) -> None:
        self.inner = XgrammarBackend(engine.tokenizer, engine.vocab_size)
        self.gate = threading.Event()
        self.matcher = self.inner.matcher
        self.fill_bitmask = self.inner.fill_bitmask

    def compile(self, constraint: Constraint) -> object:
        self.gate.wait()
        return self.inner.compile(constraint)


def gated(engine: Engine, timeout_s: float) -> GatedBackend:
    backend = GatedBackend(engine)
    engine.grammars = GrammarCompiler(
        lambda: lambda: backend,
        threads=2,
        timeout_s=timeout_s,
        cache_entries=256,
        vocab_size=engine.vocab_size,
        max_rows=8,
    )
    return backend


def test_a_compile_past_its_time_limit_is_refused(tiny_loaded: LoadedModel) -> None:
    engine = make_engine(tiny_loaded, "xgrammar")
    backend = gated(engine, timeout_s=0.05)
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS["defs_and_ref"]))
    with pytest.raises(ConstraintError, match=r"did not compile within 0\.05 s") as refused:
        engine.add_request(EngineRequest("slow", prompt(1), sampling(None, constraint)))
    assert refused.value.field == "sampling.json_schema"
    assert not engine.has_work()
    backend.gate.set()


class SlowBuild:
    """A backend whose build waits for a gate (the tokenizer tables of a loaded machine)."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.builds = 0

    def __call__(self) -> SlowBuild:
        self.gate.wait()
        self.builds += 1
        return self

    def compile(self, constraint: Constraint) -> object:
        return constraint.text


def slow_compiler(build: SlowBuild, timeout_s: float) -> GrammarCompiler:
    return GrammarCompiler(
        lambda: build,  # type: ignore[arg-type,return-value]
        threads=1, timeout_s=timeout_s, cache_entries=4, vocab_size=64, max_rows=2,
    )  # fmt: skip


# Run in a fresh interpreter: which modules a thread imported is only visible in a process
# that had not imported them before.
IMPORT_THREAD_PROBE = """
import sys, threading
import torch
from kvmesh.contracts.constraints import Constraint, ConstraintKind
from services.worker.engine.config import EngineConfig
from services.worker.engine.engine import Engine
from services.worker.engine.loader import load_model

modules = (sys.argv[2], f"services.worker.engine.grammar_{sys.argv[2]}")
config = EngineConfig(num_kv_blocks=64, grammar_backend=sys.argv[2])
engine = Engine(load_model(sys.argv[1]), config)
print("imported-by-the-engine", any(name in sys.modules for name in modules))
imports = set()
real_import = __builtins__.__import__

def watched(name, *args, **kwargs):
    if threading.current_thread() is not threading.main_thread():
        imports.add(name)
    return real_import(name, *args, **kwargs)

__builtins__.__import__ = watched
compiler = engine.grammars
compiler.preload()
print("imported-at-preload", all(name in sys.modules for name in modules))
matcher = compiler.matcher(Constraint(ConstraintKind.REGEX, "[a-z]+"))
logits = torch.zeros(1, engine.vocab_size)
compiler.mask_logits(logits, [matcher])
print("masked", int(torch.isinf(logits).sum()) > 0)
print("dynamo", "torch._dynamo" in sys.modules)
ours = ("xgrammar", "llguidance", "services")
print("thread-imports", sorted(name for name in imports if name.split(".")[0] in ours))
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_backend_library_is_imported_at_first_use_by_its_caller_never_by_a_compile_thread(
    tiny_llama_dir: Path, backend: str
) -> None:
    """An engine that never sees a constraint imports no grammar library (about 0.9 s with
    transformers); preload() or the first constraint imports it on the calling thread. An import
    on a compile thread holds the module's import lock while it runs (one never finished in CI,
    and every later constrained request waited on it); and llguidance's mask path must not
    import torch._dynamo (its torch helpers run torch.compile at import)."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_THREAD_PROBE, str(tiny_llama_dir), backend],
        capture_output=True, text=True, timeout=100, check=False, cwd=REPO_ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "imported-by-the-engine False",
        "imported-at-preload True",
        "masked True",
        "dynamo False",
        "thread-imports []",
    ]


def test_preload_builds_the_backend_once_and_before_any_compile() -> None:
    build = SlowBuild()
    build.gate.set()
    compiler = slow_compiler(build, timeout_s=60)
    compiler.preload()
    assert compiler.backend() is build and build.builds == 1
    assert compiler.wait(Constraint(ConstraintKind.REGEX, "a+")) == "a+"
    assert build.builds == 1


def test_a_compile_time_limit_does_not_count_the_backend_build() -> None:
    """The first constrained request of a process whose backend build outlasts the time limit
    (one thread: its compile even queues behind the build) still compiles."""
    build = SlowBuild()
    compiler = slow_compiler(build, timeout_s=0.05)
    compiled: list[object] = []
    waiter = threading.Thread(
        target=lambda: compiled.append(compiler.wait(Constraint(ConstraintKind.REGEX, "b+")))
    )
    waiter.start()
    waiter.join(0.3)  # past the time limit, the build still waiting for its gate
    build.gate.set()
    waiter.join()
    assert compiled == ["b+"]


async def test_a_request_waiting_for_its_grammar_holds_up_nobody(
    tiny_loaded: LoadedModel,
) -> None:
    engine = make_engine(tiny_loaded, "xgrammar")
    backend = gated(engine, timeout_s=60)
    async_engine = AsyncEngine(engine)
    await async_engine.start()
    try:
        constraint = Constraint(ConstraintKind.REGEX, "[0-9]{3}")
        waiting = [
            asyncio.ensure_future(collect(async_engine, f"c{i}", sampling(i, constraint)))
            for i in range(3)
        ]
        free = await collect(async_engine, "free", SamplingParams(max_tokens=8, ignore_eos=True))
        assert len(free) == 8 and not any(task.done() for task in waiting)
        backend.gate.set()
        answers = await asyncio.gather(*waiting)
        assert engine.grammars.num_compiles == 1
        texts = [engine.tokenizer.decode(ids) for ids in answers]
        assert all(re.fullmatch("[0-9]{3}", text) for text in texts), texts
    finally:
        await async_engine.shutdown()


async def collect(engine: AsyncEngine, request_id: str, params: SamplingParams) -> list[int]:
    tokens: list[int] = []
    async for output in engine.generate(EngineRequest(request_id, prompt(7), params)):
        tokens.extend(output.new_token_ids)
    return tokens


def test_one_compile_per_constraint_however_many_wait(tiny_loaded: LoadedModel) -> None:
    engine = make_engine(tiny_loaded, "xgrammar")
    constraint = Constraint(ConstraintKind.REGEX, "[0-9]{4}")
    futures = {id(engine.grammars.submit(constraint)) for _ in range(8)}
    requests = [
        EngineRequest(f"r{i}", prompt(i), sampling(i, Constraint(ConstraintKind.REGEX, "[0-9]{4}")))
        for i in range(8)
    ]
    results = drive(engine, {0: requests})
    assert len(futures) == 1 and engine.grammars.num_compiles == 1
    assert all(re.fullmatch("[0-9]{4}", results[r.request_id].text) for r in requests)


@pytest.mark.parametrize("backend", BACKENDS)
def test_preemption_and_prefix_hits_keep_the_constraint(
    tiny_loaded: LoadedModel, backend: str
) -> None:
    """A pool too small for every request at once: requests are preempted (recompute) and
    readmitted with prefix-cache hits, and every answer still validates."""
    schema = SCHEMAS["defs_and_ref"]
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    params = [SamplingParams(60, 0.9, seed=seed, constraint=constraint) for seed in range(6)]
    requests = [EngineRequest(f"p{seed}", prompt(seed) * 2, params[seed]) for seed in range(6)]
    engine = make_engine(tiny_loaded, backend, num_kv_blocks=20, block_size=4)
    results = drive(engine, {0: requests})
    assert engine.scheduler.num_preemptions > 0
    for request in requests:
        result = finished(results, request.request_id)
        assert result.finish_reason is FinishReason.STOP
        jsonschema.validate(parse_json(result.text), schema)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


def test_length_abort_and_deadline_mid_answer_free_every_block(tiny_loaded: LoadedModel) -> None:
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS["nested_object"]))
    engine = make_engine(tiny_loaded, "xgrammar")
    cut = EngineRequest("cut", prompt(1), SamplingParams(max_tokens=5, constraint=constraint))
    aborted = EngineRequest("aborted", prompt(2), sampling(0, constraint))
    late = EngineRequest("late", prompt(3), sampling(1, constraint))

    def on_step(step: int, engine: Engine) -> None:
        if step == 4:
            engine.abort("aborted")
            late.deadline = 0.0  # passed: the next step ends it

    results = drive(engine, {0: [cut, aborted, late]}, on_step)
    assert results["cut"].finish_reason is FinishReason.LENGTH
    assert len(results["cut"].token_ids) == 5 and results["cut"].text.startswith('{"name')
    assert results["aborted"].finish_reason is FinishReason.ABORT
    assert results["late"].finish_reason is FinishReason.DEADLINE
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [None, 4])
def test_split_prefill_and_decode_equals_colocated(
    tiny_loaded: LoadedModel, backend: str, seed: int | None
) -> None:
    """The prefill engine samples the first token under the constraint; the decode engine
    rebuilds the matcher from the constraint and that token and continues token for token."""
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS["nested_object"]))
    request = EngineRequest("s", prompt(5), sampling(seed, constraint))
    colocated = drive(make_engine(tiny_loaded, backend), {0: [request]})["s"]

    prefill, decode = make_engine(tiny_loaded, backend), make_engine(tiny_loaded, backend)
    first = hand_off(prefill, decode, request)
    rest = drive(decode, {0: []})["s"]
    assert first.new_token_ids + rest.token_ids == colocated.token_ids
    assert first.text_delta + rest.text == colocated.text
    assert rest.finish_reason is FinishReason.STOP
    assert decode.pool.num_free_blocks == decode.pool.num_blocks


def hand_off(prefill: Engine, decode: Engine, request: EngineRequest) -> RequestOutput:
    """The request prefilled on one engine and its KV imported into the other, which goes on
    from the first token; returns the prefill's output (that token)."""
    prefill.add_request(request, hold_after_prefill=True)
    (first,) = prefill.step()
    handle = prefill.take_handle(request.request_id)
    assert handle is not None
    plan = decode.start_import(request, handle.block_hashes, handle.num_tokens)
    blobs = prefill.export_blocks(handle.handle_id, plan.missing_indices)
    for index, blob in zip(plan.missing_indices, blobs, strict=True):
        decode.write_imported_block(plan, index, blob)
    decode.commit_import(plan, first.new_token_ids[0])
    prefill.release(handle.handle_id)
    return first


@pytest.mark.parametrize("backend", BACKENDS)
def test_imports_past_max_num_seqs_are_all_masked(tiny_loaded: LoadedModel, backend: str) -> None:
    """Imported requests join the running set whatever max_num_seqs says (they hold their
    blocks already), so a decode step can mask more constrained rows than max_num_seqs: each
    still ends as the colocated run does."""
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMAS["nested_object"]))
    requests = [EngineRequest(f"r{i}", prompt(5 + i), sampling(None, constraint)) for i in range(3)]
    colocated = drive(make_engine(tiny_loaded, backend), {0: requests})
    prefill = make_engine(tiny_loaded, backend)
    decode = make_engine(tiny_loaded, backend, max_num_seqs=2)
    for request in requests:
        hand_off(prefill, decode, request)
    rest = drive(decode, {0: []})
    for request in requests:
        name = request.request_id
        assert rest[name].finish_reason is FinishReason.STOP, rest[name]
        assert rest[name].token_ids == colocated[name].token_ids[1:]
    assert decode.pool.num_free_blocks == decode.pool.num_blocks


CALL_BEGIN, CALL_END = "<tool_call>\n", "\n</tool_call>"
CALL_SCHEMA = SCHEMAS["enum_and_const"]


def call_tag(stop_after_first: bool = True) -> Constraint:
    tag = StructuralTag(
        ("<tool_call>",), (Structure(CALL_BEGIN, CALL_SCHEMA, CALL_END),), stop_after_first
    )
    return Constraint(ConstraintKind.STRUCTURAL_TAG, tag.as_json())


def utf8_prefix_tokens(engine: Engine, token_ids: list[int]) -> int:
    """How many leading tokens decode to valid UTF-8 text."""
    return max(
        k
        for k in range(len(token_ids) + 1)
        if "\ufffd" not in engine.tokenizer.decode(token_ids[:k])
    )


def force_text_after(engine: Engine, target: Constraint, text: str, after: int) -> None:
    """Test hook: the rows under `target` write `text` (its tokens' logits raised far above
    the rest, before the grammar's mask) once they have sampled `after` tokens of their own."""
    forced = engine.tokenizer.encode(text)
    counts: dict[int, int] = {}
    make_matcher, mask_logits = engine.grammars.matcher, engine.grammars.mask_logits

    def matcher(constraint: Constraint) -> GrammarMatcher:
        made = make_matcher(constraint)
        if constraint == target:
            counts[id(made)] = 0
        return made

    def masked(logits: torch.Tensor, matchers: Sequence[GrammarMatcher | None]) -> None:
        for row, made in enumerate(matchers):
            if made is None or id(made) not in counts:
                continue
            sampled = counts[id(made)]
            counts[id(made)] = sampled + 1
            if after <= sampled < after + len(forced):
                with torch.inference_mode():  # the model runner's logits are inference tensors
                    logits[row, forced[sampled - after]] += 1e4
        mask_logits(logits, matchers)

    engine.grammars.matcher = matcher  # type: ignore[method-assign]
    engine.grammars.mask_logits = masked  # type: ignore[method-assign]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_structural_tag_leaves_text_free_and_constrains_what_a_trigger_opens(
    tiny_loaded: LoadedModel, backend: str
) -> None:
    """tool_choice auto's constraint: a row that never writes the trigger produces exactly the
    tokens it produces unconstrained; a row made to write it after 5 free tokens continues
    with the rest of the begin, a JSON value that validates, and the end, then stops (also
    when sampled). A trigger written in pieces counts: the forced text is several tokens.
    llguidance's free text is UTF-8 text, so a random row that writes a byte sequence that is
    not (the tiny vocabulary has lone UTF-8 bytes) differs from there on: for that backend
    each row is compared up to its first byte that is not UTF-8."""
    free_params = [SamplingParams(max_tokens=40), sampling(3)]
    tagged = [
        EngineRequest(f"free-{i}", prompt(i), replace(p, constraint=call_tag(False)))
        for i, p in enumerate(free_params)
    ]
    forcing = call_tag(stop_after_first=True)
    calls = [
        EngineRequest(f"call-{seed}", prompt(20 + i), sampling(seed, forcing))
        for i, seed in enumerate(SEEDS)
    ]
    engine = make_engine(tiny_loaded, backend)
    force_text_after(engine, forcing, "<tool_call>", after=5)
    results = drive(engine, {0: tagged + calls})
    plain = drive(
        make_engine(tiny_loaded, backend),
        {0: [replace(r, sampling=replace(r.sampling, constraint=None)) for r in tagged + calls]},
    )

    def free_tokens(request: EngineRequest, limit: int) -> list[int]:
        expected = plain[request.request_id].token_ids[:limit]
        if backend == "llguidance":
            expected = expected[: utf8_prefix_tokens(engine, expected)]
        return expected

    for request in tagged:
        expected = free_tokens(request, MAX_TOKENS)
        assert expected and results[request.request_id].token_ids[: len(expected)] == expected
    for request in calls:
        result = finished(results, request.request_id)
        assert result.finish_reason is FinishReason.STOP, (request.request_id, result.text)
        expected = free_tokens(request, 5)
        assert result.token_ids[: len(expected)] == expected
        free, _, call = result.text.partition("<tool_call>")
        assert "<tool_call>" not in free
        assert call.startswith("\n") and call.endswith(CALL_END), result.text
        jsonschema.validate(json.loads(call[1 : -len(CALL_END)]), CALL_SCHEMA)
    assert engine.pool.num_free_blocks == engine.pool.num_blocks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "maxLength": 8},
        {"type": "string", "minLength": 1},
        {"type": "object", "properties": {"k": {"type": "string", "maxLength": 3}}},
        {"type": "object"},
    ],
)
def test_json_strings_never_hold_a_raw_control_character(
    tiny_loaded: LoadedModel, backend: str, schema: dict[str, object]
) -> None:
    """Inside a JSON string (length-bounded ones included: xgrammar's own rule for those let
    U+0000-U+001F through), every token that writes a raw control character is masked."""
    engine = make_engine(tiny_loaded, backend)
    grammars = engine.grammars
    matcher = grammars.matcher(Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)))
    opening = '{"k": "' if schema["type"] == "object" else '"'
    for token_id in engine.tokenizer.encode(opening):
        assert matcher.accept(token_id)
    vocab = engine.vocab_size
    controls = [i for i in range(vocab) if any(ord(c) < 0x20 for c in engine.tokenizer.decode([i]))]
    assert controls  # the tiny byte-level vocabulary has them (e.g. "\x01", "\n")
    logits = torch.zeros((1, vocab))
    grammars.mask_logits(logits, [matcher])
    assert torch.isinf(logits[0, controls]).all()
    assert not torch.isinf(logits[0]).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_trigger_that_is_an_added_token_opens_the_structure(
    tiny_tool_caller_dir: Path, backend: str
) -> None:
    """The tiny model that always writes its added token <tool_call> (tests/conftest.py): under
    the structural tag it goes on with a call that validates and stops, greedy and sampled;
    unconstrained it writes <tool_call> again and again."""
    loaded = load_model(str(tiny_tool_caller_dir))
    requests = [
        EngineRequest(f"call-{seed}", prompt(30 + i), sampling(seed, call_tag()))
        for i, seed in enumerate(SEEDS)
    ]
    free = EngineRequest("free", prompt(30), SamplingParams(max_tokens=4))
    engine = make_engine(loaded, backend)
    results = drive(engine, {0: [*requests, free]})
    for request in requests:
        result = finished(results, request.request_id)
        assert result.finish_reason is FinishReason.STOP, (request.request_id, result.text)
        assert result.text.startswith(CALL_BEGIN) and result.text.endswith(CALL_END)
        jsonschema.validate(json.loads(result.text[len(CALL_BEGIN) : -len(CALL_END)]), CALL_SCHEMA)
    assert results["free"].text == "<tool_call>" * 4
    assert engine.pool.num_free_blocks == engine.pool.num_blocks
