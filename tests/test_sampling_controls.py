"""Penalties, logit_bias and min_tokens in the batched sampler, against a float64 reference.

Random logits over an awkward vocabulary; ragged batches mix rows with and without controls,
greedy and sampled. Every row's token and logprob must equal the reference's for that row alone,
so no row's controls leak into another's; a row whose controls cannot be applied fails alone.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from orca_ext import SamplingParams, Server
from orca_ext.errors import InvalidRequestError
from orca_ext.request import Request
from orca_ext.sampling import Sampler

VOCAB = 1037
EOS = 3


def make_request(rng: random.Random, params: SamplingParams, n_out: int) -> Request:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 30))]
    req = Request(f"r{rng.random()}", prompt, params, eos_token_ids=frozenset({EOS}))
    # Histories with repeats, so counts above 1 occur.
    req.output_token_ids = [rng.choice(prompt + [rng.randrange(VOCAB)]) for _ in range(n_out)]
    return req


def reference(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """The controlled logits of one row [V], in float64, written out token by token."""
    p = req.params
    x = logits.double().clone()
    for t, v in p.logit_bias:
        x[t] += v
    if p.repetition_penalty != 1.0:
        for t in set(req.prompt_token_ids) | set(req.output_token_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(req.output_token_ids):
        x[t] -= p.frequency_penalty * req.output_token_ids.count(t) + p.presence_penalty
    if len(req.output_token_ids) < p.min_tokens:
        for t in req.stop_token_ids:
            x[t] = -math.inf
    return x


def random_params(rng: random.Random, sampled: bool) -> SamplingParams:
    kw = {}
    if rng.random() < 0.6:
        kw["presence_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.6:
        kw["frequency_penalty"] = rng.uniform(-2, 2)
    if rng.random() < 0.6:
        kw["repetition_penalty"] = rng.choice([0.5, 1.3, 2.0])
    if rng.random() < 0.6:
        kw["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 9))}
    if rng.random() < 0.4:
        kw["min_tokens"] = rng.randrange(0, 12)
        kw["stop_token_ids"] = [rng.randrange(VOCAB) for _ in range(3)]
    if sampled:
        kw.update(temperature=rng.uniform(0.5, 1.5), seed=rng.randrange(1 << 30))
    return SamplingParams(max_tokens=20, logprobs=3, **kw)


@pytest.mark.parametrize("seed", range(4))
def test_ragged_batch_equals_reference_row_by_row(seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    n = 9
    logits = torch.randn(n, VOCAB) * 4
    reqs = [make_request(rng, random_params(rng, sampled=i % 3 == 2), rng.randrange(0, 15)) for i in range(n)]
    reqs[0] = make_request(rng, SamplingParams(max_tokens=20, logprobs=3), 4)  # no controls at all
    result = Sampler()(logits.clone(), reqs)  # the sampler consumes its logits
    assert result.errors == [None] * n
    for i, req in enumerate(reqs):
        ref = reference(logits[i], req)
        if req.params.greedy:
            assert result.tokens[i] == ref.argmax().item()
            dist = ref.log_softmax(-1)
        else:
            dist = (ref / req.params.temperature).log_softmax(-1)
            assert math.isfinite(dist[result.tokens[i]].item())
        entry = result.logprobs[i]
        assert entry.token_id == result.tokens[i]
        assert entry.logprob == pytest.approx(dist[entry.token_id].item(), abs=1e-4)
        assert [v for _, v in entry.top] == pytest.approx(dist.topk(3).values.tolist(), abs=1e-4)
        # The same row alone: same token (a seeded row redraws from a fresh generator).
        alone = make_request(rng, req.params, 0)
        alone.prompt_token_ids, alone.output_token_ids = req.prompt_token_ids, req.output_token_ids
        assert Sampler()(logits[i:i + 1], [alone]).tokens == [result.tokens[i]]


def test_min_tokens_masks_stop_tokens_until_reached():
    rng = random.Random(1)
    params = SamplingParams(max_tokens=10, min_tokens=3, logit_bias={EOS: 100.0}, stop_token_ids=[7])
    logits = torch.randn(1, VOCAB)
    logits[0, 7] = 50.0
    for n_out, expected_stop in [(0, False), (2, False), (3, True), (5, True)]:
        req = make_request(rng, params, n_out)
        token = Sampler()(logits.clone(), [req]).tokens[0]
        assert (token in (EOS, 7)) == expected_stop, (n_out, token)


def test_a_failing_row_fails_alone():
    """A bias on an id outside the logits (the server refuses it at submit; here it reaches the
    sampler) fails its own request; the batch-mates get the reference tokens."""
    rng = random.Random(2)
    logits = torch.randn(3, VOCAB)
    good = [make_request(rng, SamplingParams(max_tokens=5, presence_penalty=1.0), 4) for _ in range(2)]
    bad = make_request(rng, SamplingParams(max_tokens=5, logit_bias={VOCAB + 5: 1.0}), 1)
    result = Sampler()(logits.clone(), [good[0], bad, good[1]])
    assert result.tokens[1] is None and "logits controls failed" in result.errors[1]
    for i, req in ((0, good[0]), (2, good[1])):
        assert result.errors[i] is None and result.tokens[i] == reference(logits[i], req).argmax().item()


@pytest.mark.parametrize("kwargs, field", [
    (dict(presence_penalty=2.01), "presence_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=1e9), "repetition_penalty"),
    (dict(logit_bias={1: 100.5}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={5: float("inf")}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17), "min_tokens"),
    (dict(min_tokens=True), "min_tokens"),
])
def test_bounds(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field and field in str(info.value)


def test_server_end_to_end(tiny_model_dir):
    """Through a server: a logit_bias forces its token; min_tokens holds EOS off; a bias id
    outside the vocabulary is refused at submit."""
    with Server(str(tiny_model_dir("llama")), device="cpu", dtype="float32", n_slots=256, max_batch_size=4) as s:
        eos = min(s.eos_token_ids)
        prompt = list(range(10, 30))
        forced = s.generate(prompt, SamplingParams(max_tokens=4, logit_bias={999: 100.0}, ignore_eos=True))[0]
        assert forced.token_ids == [999] * 4
        out = s.generate(prompt, SamplingParams(max_tokens=9, min_tokens=5, logit_bias={eos: 100.0}))[0]
        assert out.token_ids[:5] != [eos] * 5 and eos not in out.token_ids[:5]
        assert out.token_ids[5:] == [eos] and out.finish_reason == "stop"
        with pytest.raises(InvalidRequestError) as info:
            s.submit(prompt, SamplingParams(logit_bias={s.vocab_size: 1.0}))
        assert info.value.param == "logit_bias"
