"""Log probabilities of generated and prompt tokens, checked against transformers in float32.

A tiny random llama (tests/tiny_models.py) serves ragged batches under a small chunked-prefill
budget, so prompts are split into chunks and share iterations with decodes. Prompt logprobs must
equal transformers' log_softmax of its logits at every position; a generated token's logprob
must be of the distribution the sampler drew from (greedy: the logits themselves; sampled: after
temperature and top-k), and the alternatives must be that distribution's most likely tokens.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from orca_ext import SamplingParams, Server
from orca_ext.errors import InvalidRequestError
from orca_ext.sampling_params import MAX_LOGPROBS
from tiny_models import _hf_model

TOL = 1e-4  # float32 forward against float32 transformers, 3 layers


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir):
    # A budget of 16 tokens in every iteration: every prompt below is prefilled in several chunks.
    with Server(str(model_dir), device="cpu", dtype="float32", n_slots=1024, max_batch_size=6,
                max_num_batched_tokens=16, prefill_only_tokens=None) as s:
        yield s


def hf_logprobs(model_dir, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax over the vocabulary at every position of `ids` [len, V]."""
    with torch.no_grad():
        return _hf_model(str(model_dir))(torch.tensor([ids])).logits[0].double().log_softmax(-1)


def check_entry(entry, token: int, ref: torch.Tensor, k: int) -> None:
    """entry (TokenLogprob) against a reference log-distribution ref [V]."""
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(ref[token].item(), abs=TOL)
    assert len(entry.top) == k
    values = torch.tensor([v for _, v in entry.top], dtype=torch.float64)
    assert torch.allclose(values, ref.topk(k).values, atol=TOL)
    for t, v in entry.top:  # ids agree wherever the reference's values are not tied
        assert ref[t].item() == pytest.approx(v, abs=TOL)


def test_prompt_logprobs_match_transformers_across_chunks(server, model_dir):
    rng = random.Random(7)
    vocab = server.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 2, 15, 16, 17, 41, 70)]
    ks = [0, 1, 5, 3, MAX_LOGPROBS, 2, 4]
    rids = [server.submit(p, SamplingParams(max_tokens=0 if i % 2 else 3, prompt_logprobs=k, ignore_eos=True))
            for i, (p, k) in enumerate(zip(prompts, ks))]
    for i, (rid, prompt, k) in enumerate(zip(rids, prompts, ks)):
        out = server.result(rid, timeout=300)
        assert out.finish_reason == "length", out
        assert len(out.token_ids) == (0 if i % 2 else 3)
        assert out.logprobs is None  # not asked for
        assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
        ref = hf_logprobs(model_dir, prompt)
        for p in range(1, len(prompt)):
            check_entry(out.prompt_logprobs[p], prompt[p], ref[p - 1], k)


def test_greedy_logprobs_are_the_model_distribution(server, model_dir):
    rng = random.Random(11)
    prompts = [[rng.randrange(server.vocab_size) for _ in range(n)] for n in (3, 20, 33)]
    rids = [server.submit(p, SamplingParams(max_tokens=6, logprobs=k, ignore_eos=True))
            for p, k in zip(prompts, (0, 5, MAX_LOGPROBS))]
    for rid, prompt, k in zip(rids, prompts, (0, 5, MAX_LOGPROBS)):
        out = server.result(rid, timeout=300)
        assert len(out.logprobs) == len(out.token_ids) == 6
        ref = hf_logprobs(model_dir, prompt + out.token_ids)
        for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(prompt) - 1 + j]
            assert token == row.argmax().item()
            check_entry(entry, token, row, k)


def test_sampled_logprobs_are_of_the_processed_distribution(server, model_dir):
    """Temperature divides the logits and top-k rules the rest out (-inf), before the draw."""
    prompt = list(range(100, 131))
    temperature, top_k, k = 0.7, 4, 6
    out = server.generate(prompt, SamplingParams(max_tokens=5, temperature=temperature, top_k=top_k, seed=5,
                                                 logprobs=k, ignore_eos=True))[0]
    with torch.no_grad():
        logits = _hf_model(str(model_dir))(torch.tensor([prompt + out.token_ids])).logits[0].double()
    for j, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        scaled = logits[len(prompt) - 1 + j] / temperature
        kept = scaled.topk(top_k).indices
        processed = torch.full_like(scaled, -math.inf)
        processed[kept] = scaled[kept]
        ref = processed.log_softmax(-1)
        assert token in kept.tolist()
        assert entry.logprob == pytest.approx(ref[token].item(), abs=TOL)
        values = [v for _, v in entry.top]
        assert values[top_k:] == [-math.inf] * (k - top_k)
        assert torch.allclose(torch.tensor(values[:top_k], dtype=torch.float64), ref.topk(top_k).values, atol=TOL)


def test_logprobs_do_not_change_the_tokens(server):
    """Asking for logprobs changes nothing about what is generated, seeded or greedy."""
    prompt = list(range(200, 219))
    for params in (dict(temperature=0.0), dict(temperature=1.0, top_p=0.9, seed=123)):
        plain = server.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, **params))[0]
        scored = server.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2,
                                                        prompt_logprobs=1, **params))[0]
        assert scored.token_ids == plain.token_ids


@pytest.mark.parametrize("kwargs, field", [
    (dict(logprobs=MAX_LOGPROBS + 1), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=True), "logprobs"),
    (dict(logprobs=1.0), "logprobs"),
    (dict(prompt_logprobs=MAX_LOGPROBS + 1), "prompt_logprobs"),
    (dict(prompt_logprobs="3"), "prompt_logprobs"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=0, logprobs=2), "max_tokens"),
    (dict(max_tokens=-1, prompt_logprobs=0), "max_tokens"),
])
def test_logprobs_bounds(kwargs, field):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == field and field in str(info.value)


def test_a_failing_logprobs_row_fails_alone(monkeypatch):
    """Should the logprobs of one row fail, only its request fails; its batch-mates keep their
    tokens and logprobs."""
    import orca_ext.sampling as sampling
    from orca_ext.request import Request
    from orca_ext.sampling import Sampler

    real = sampling.token_logprobs

    def failing_for_seven(logits, chosen, k):
        if k == 7:
            raise RuntimeError("no logprobs for 7")
        return real(logits, chosen, k)

    monkeypatch.setattr(sampling, "token_logprobs", failing_for_seven)
    logits = torch.randn(3, 53)
    reqs = [Request(f"r{k}", [1, 2], SamplingParams(logprobs=k)) for k in (1, 7, 2)]
    result = Sampler()(logits, reqs)
    assert result.tokens[1] is None and "no logprobs for 7" in result.errors[1]
    for i, k in ((0, 1), (2, 2)):
        assert result.errors[i] is None and result.tokens[i] == logits[i].argmax().item()
        assert result.logprobs[i].logprob == pytest.approx(logits[i].log_softmax(-1).max().item(), abs=1e-5)
        assert len(result.logprobs[i].top) == k
