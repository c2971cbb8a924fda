"""Guided decoding in the engine: bounds, compilation, the batched mask, and generation.

The reference for a mask is llguidance's own per-token check (`validate_tokens`) on a fresh
matcher, token by token; generated outputs are checked with `json` / `jsonschema`-free property
checks (parsed, typed fields present) and `re.fullmatch`.
"""
from __future__ import annotations

import json
import re

import time

import pytest
import torch

from orca_ext import SamplingParams, Server
from orca_ext.errors import InvalidRequestError
from orca_ext.guided import (MAX_CHOICES, MAX_GRAMMAR_BYTES, MAX_SCHEMA_DEPTH, GrammarCompiler,
                             apply_token_masks, choice_spec, json_object_spec, json_schema_spec,
                             llg_tokenizer, regex_spec)
from orca_ext.request import Request

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def hf_tokenizer(tokenizer_dir):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture(scope="module")
def compiler(hf_tokenizer):
    return GrammarCompiler(llg_tokenizer(hf_tokenizer, [hf_tokenizer.eos_token_id]))


# -- bounds -------------------------------------------------------------------------------------

def test_bounds_name_the_field():
    deep = {"type": "object"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "array", "items": deep}
    cases = [
        (lambda: json_schema_spec(deep, "response_format"), "deeper"),
        (lambda: json_schema_spec({"enum": ["x" * MAX_GRAMMAR_BYTES]}, "guided_json"), "bytes"),
        (lambda: json_schema_spec("{not json", "guided_json"), "not valid JSON"),
        (lambda: json_schema_spec([1, 2], "guided_json"), "schema object"),
        (lambda: choice_spec([str(i) for i in range(MAX_CHOICES + 1)], "guided_choice"), "at most"),
        (lambda: choice_spec(["a", ""], "guided_choice"), "non-empty"),
        (lambda: regex_spec("", "guided_regex"), "non-empty"),
    ]
    for make, words in cases:
        with pytest.raises(InvalidRequestError) as err:
            make()
        assert words in str(err.value)
        assert err.value.param in ("response_format", "guided_json", "guided_choice", "guided_regex")


@pytest.mark.parametrize("spec, words", [
    (json_schema_spec({"type": "bogus"}, "guided_json"), "bogus"),
    (regex_spec("(unclosed", "guided_regex"), "unclosed"),
])
def test_invalid_constraints_are_refused_and_cached(compiler, spec, words):
    for _ in range(2):
        with pytest.raises(InvalidRequestError) as err:
            compiler.compile(spec)
        assert words in str(err.value) and err.value.param == spec.field
    before = compiler.compiles
    with pytest.raises(InvalidRequestError):
        compiler.compile(spec)
    assert compiler.compiles == before  # the refusal was cached


def test_cache_is_keyed_by_schema_text(compiler):
    a = compiler.compile(json_schema_spec(SCHEMA, "guided_json"))
    # The same schema as pretty-printed text: the same compiled grammar.
    b = compiler.compile(json_schema_spec(json.dumps(SCHEMA, indent=3), "response_format"))
    assert a is b


def test_the_compile_budget_counts_cpu_time_not_waiting(hf_tokenizer, monkeypatch):
    """A compile that waits (a busy machine, its low priority) is not refused for the wait; one that
    spends more CPU than the budget is, with the field and the limit named."""
    from orca_ext.guided import spec as spec_module

    tok = llg_tokenizer(hf_tokenizer, [hf_tokenizer.eos_token_id])
    slow_to_start = spec_module.GuidedSpec.grammar

    def waits_then_builds(self):
        time.sleep(0.4)  # wall time passes, the thread's CPU time does not
        return slow_to_start(self)

    monkeypatch.setattr(spec_module.GuidedSpec, "grammar", waits_then_builds)
    patient = GrammarCompiler(tok, timeout=0.2)
    assert patient.compile(json_schema_spec(SCHEMA, "guided_json")).spec.kind == "json_schema"
    monkeypatch.setattr(spec_module.GuidedSpec, "grammar", slow_to_start)
    strict = GrammarCompiler(tok, timeout=1e-9)
    with pytest.raises(InvalidRequestError, match=r"response_format took \d+\.\d s of CPU to compile; the limit is 1e-09 s") as err:
        strict.compile(json_schema_spec(SCHEMA, "response_format"))
    assert err.value.param == "response_format"


# -- the batched mask against llguidance's per-token check -----------------------------------------

def test_masks_match_per_token_reference(compiler, hf_tokenizer):
    gen = torch.Generator().manual_seed(1)
    grammars = [compiler.compile(json_object_spec("response_format")),
                compiler.compile(choice_spec(["yes", "no", "maybe (later)"], "guided_choice")),
                compiler.compile(regex_spec(r"[0-9]{2,4}-[a-z]+", "guided_regex"))]
    prefixes = [hf_tokenizer.encode('{"name": ["Al', add_special_tokens=False),
                hf_tokenizer.encode("ma", add_special_tokens=False),
                hf_tokenizer.encode("123", add_special_tokens=False)]
    vocab = len(hf_tokenizer) + 13  # a model vocabulary padded past the tokenizer's
    # Rows: unconstrained, guided, unconstrained, guided, guided (ragged placement).
    matchers = []
    for g, prefix in zip(grammars, prefixes):
        m = g.matcher()
        for t in prefix:
            assert m.accept(t) is None
        matchers.append(m)
    rows = [(1, matchers[0]), (3, matchers[1]), (4, matchers[2])]
    logits = torch.randn(5, vocab, generator=gen)
    before = logits.clone()
    assert apply_token_masks(logits, rows) == {}
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for (row, _), g, prefix in zip(rows, grammars, prefixes):
        ref = g.matcher()._m  # llguidance's own matcher: validate_tokens counts the accepted prefix
        assert ref.consume_tokens(prefix)
        allowed = torch.isfinite(logits[row])
        for t in range(vocab):
            ok = t < g.vocab_size and ref.validate_tokens([t]) == 1
            assert bool(allowed[t]) == ok, (row, t)
        assert torch.equal(logits[row][allowed], before[row][allowed])
        assert allowed.sum() > 0


# -- generation in the engine ------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with Server(str(tiny_model_dir("llama")), max_batch_size=8, n_slots=2048) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine_compiler(server):
    return GrammarCompiler(lambda: llg_tokenizer(server.tokenizer, server.eos_token_ids, server.vocab_size))


def test_random_model_follows_its_grammar_in_a_ragged_batch(server, engine_compiler):
    """A random-weight model's output is valid only because of the mask: every guided request of
    a mixed batch ends complete and valid, seeded sampled and greedy alike."""
    # (Bounded schemas: a random model fills an open one, like json_object's, until max_tokens.)
    flag = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
            "additionalProperties": False}
    specs = [json_schema_spec(SCHEMA, "guided_json"), json_schema_spec(flag, "response_format"),
             choice_spec(["red", "green", "blue"], "guided_choice"),
             regex_spec(r"[a-c]{3}-[0-9]{1,3}", "guided_regex")]
    grammars = [engine_compiler.compile(s) for s in specs]
    rids = []
    for k in range(12):
        g = grammars[k % 4] if k % 3 else None
        params = SamplingParams(max_tokens=120, temperature=0.0 if k % 2 else 1.0, seed=k, guided=g)
        rids.append((g, server.submit(list(range(5, 5 + 3 + k)), params)))
    for g, rid in rids:
        out = server.result(rid, timeout=300)
        if g is None:
            continue
        assert out.finish_reason == "stop", (g, out.finish_reason, out.text)
        kind = g.spec
        if kind.field == "guided_json":
            value = json.loads(out.text)
            assert set(value) == {"name", "age"} and isinstance(value["age"], int)
            assert isinstance(value["name"], str) and len(value["name"]) <= 12
        elif kind.field == "response_format":
            assert isinstance(json.loads(out.text)["ok"], bool)
        elif kind.field == "guided_choice":
            assert out.text in ("red", "green", "blue")
        else:
            assert re.fullmatch(r"[a-c]{3}-[0-9]{1,3}", out.text), out.text


def test_request_gets_its_own_matcher(engine_compiler):
    g = engine_compiler.compile(choice_spec(["ab", "cd"], "guided_choice"))
    a = Request("a", [1], SamplingParams(guided=g))
    b = Request("b", [1], SamplingParams(guided=g))
    assert a.guided is not b.guided


def test_params_refuse_a_non_grammar():
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(guided='{"type": "object"}')
    assert err.value.param == "guided"


class _Failing:
    """A matcher whose grammar fails at the mask or at the token (as llguidance's does when a
    step runs over its budget)."""

    vocab_size = 64

    def __init__(self, at: str) -> None:
        self.at = at

    def fill_mask(self, ptr, nbytes):
        import ctypes

        ctypes.memset(ptr, 0xFF, nbytes)  # every token allowed
        return "guided decoding failed: step budget" if self.at == "mask" else None

    def accept(self, token):
        return "guided decoding failed: refused" if self.at == "accept" else None


@pytest.mark.parametrize("at", ["mask", "accept"])
def test_a_failing_grammar_fails_only_its_row(at):
    from orca_ext.sampling import Sampler

    reqs = [Request(f"r{i}", [1], SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i)) for i in range(4)]
    reqs[2].guided = _Failing(at)
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits.clone(), reqs)
    assert out.tokens[2] is None and "guided decoding failed" in out.errors[2]
    ref = Sampler()(logits.clone(), [Request(f"r{i}", [1], SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i))
                                     for i in range(4)])
    for i in (0, 1, 3):
        assert out.errors[i] is None and out.tokens[i] == ref.tokens[i]


def test_concurrent_compiles_of_one_schema_share_one_run(compiler):
    from concurrent.futures import ThreadPoolExecutor

    schema = {"type": "object", "properties": {"shared": {"type": "integer"}}, "required": ["shared"]}
    before = compiler.compiles
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: compiler.compile(json_schema_spec(schema, "guided_json")), range(8)))
    assert all(g is got[0] for g in got)
    assert compiler.compiles == before + 1


def test_a_compiler_bug_does_not_leave_waiters_hanging(compiler, monkeypatch):
    spec = regex_spec("[a-z]+bug", "guided_regex")

    def broken():
        raise RuntimeError("boom")

    monkeypatch.setattr(spec.__class__, "grammar", lambda self: broken())
    for _ in range(2):  # not cached: each call runs (and fails) again, none waits forever
        with pytest.raises(RuntimeError):
            compiler.compile(spec)


def test_parallel_workers_leave_guided_rows_to_the_driver(engine_compiler):
    """-tp/-pp workers sample without a matcher: a guided request's row is sampled on the driver,
    which holds its matcher, and never unconstrained on a worker."""
    from orca_ext.distributed.driver_sampling import samples_on_driver
    from orca_ext.distributed.messages import sampling_row

    g = engine_compiler.compile(choice_spec(["x", "y"], "guided_choice"))
    assert samples_on_driver(Request("a", [1], SamplingParams(guided=g)), 1)
    assert not samples_on_driver(Request("b", [1], SamplingParams()), 1)
    assert sampling_row(0, SamplingParams(guided=g), True, 100, on_driver=True).on_driver
    assert sampling_row(0, SamplingParams(), True, 100).seed is None
