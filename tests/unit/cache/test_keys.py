"""Cache keys hash every field that changes the answer, and nothing else."""

from __future__ import annotations

from kvmesh.v1 import cache_pb2, common_pb2
from services.cache.keys import cache_key


def base_key() -> cache_pb2.CacheKey:
    return cache_pb2.CacheKey(
        model="smollm2-135m",
        model_fingerprint="abc123",
        prompt_token_ids=[1, 2, 3],
        sampling=common_pb2.SamplingParams(max_tokens=16, temperature=0.0),
        tenant="acme",
    )


def test_key_is_stable_hex_sha256() -> None:
    key = cache_key(base_key())
    assert key == cache_key(base_key())
    assert len(key) == 64
    int(key, 16)


def test_every_output_changing_field_changes_the_key() -> None:
    original = cache_key(base_key())
    variants: list[cache_pb2.CacheKey] = []
    for mutate in (
        lambda k: setattr(k, "model", "smollm2-135m-int8"),
        lambda k: setattr(k, "model_fingerprint", "def456"),
        lambda k: k.prompt_token_ids.append(4),
        lambda k: setattr(k, "tenant", "globex"),
        lambda k: setattr(k.sampling, "max_tokens", 17),
        lambda k: setattr(k.sampling, "temperature", 0.5),
        lambda k: setattr(k.sampling, "top_k", 5),
        lambda k: setattr(k.sampling, "top_p", 0.9),
        lambda k: setattr(k.sampling, "seed", 7),
        lambda k: k.sampling.stop.append("\n"),
        lambda k: k.sampling.stop_token_ids.append(2),
        lambda k: setattr(k.sampling, "logprobs", 2),
        lambda k: setattr(k.sampling, "ignore_eos", True),
        lambda k: setattr(k.sampling, "json_schema", '{"type": "object"}'),
        lambda k: setattr(k.sampling, "json_object", True),
        lambda k: setattr(k.sampling, "regex", "[a-z]+"),
        lambda k: k.sampling.grammar.CopyFrom(
            common_pb2.Grammar(notation=common_pb2.GRAMMAR_NOTATION_EBNF, source='root ::= "a"')
        ),
        lambda k: k.sampling.grammar.CopyFrom(
            common_pb2.Grammar(notation=common_pb2.GRAMMAR_NOTATION_LARK, source='root ::= "a"')
        ),
        lambda k: k.sampling.choice.options.extend(["yes", "no"]),
        lambda k: k.sampling.choice.options.extend(["no", "yes"]),
    ):
        key = base_key()
        mutate(key)
        variants.append(key)
    keys = [cache_key(k) for k in variants]
    assert original not in keys
    assert len(set(keys)) == len(keys)


def test_token_boundaries_are_unambiguous() -> None:
    a = base_key()
    b = base_key()
    a.prompt_token_ids[:] = [12, 3]
    b.prompt_token_ids[:] = [1, 23]
    assert cache_key(a) != cache_key(b)


def test_shared_scope_ignores_tenant_and_differs_from_private() -> None:
    acme = base_key()
    globex = base_key()
    globex.tenant = "globex"
    private = cache_key(acme)
    acme.shared = globex.shared = True
    assert cache_key(acme) == cache_key(globex)
    assert cache_key(acme) != private
