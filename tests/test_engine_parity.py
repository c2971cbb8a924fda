"""Greedy parity with transformers under continuous batching.

Requests arrive from several threads at staggered times, so they join and leave batches that are
already running; each request's tokens must still equal transformers' greedy decoding of its
prompt run alone (`reference_greedy`, float32). One wave of arrivals is pinned inside a paused
iteration so the iteration records deterministically show prefills mixed with decodes and
requests joining mid-flight.
"""
from __future__ import annotations

import functools
import random
import threading
import time

import pytest
import torch

from orca_ext.sampling import SamplingParams
from orca_ext.server import Server
from tiny_models import FAMILIES, reference_greedy


class GatedModel:
    """A loaded model behind the models seam whose 2nd forward waits for `resume` (and sets
    `paused` when it starts), so that requests can arrive while an iteration runs."""

    def __init__(self, model):
        self.model = model
        self.paused, self.resume = threading.Event(), threading.Event()
        self.calls = 0

    def __getattr__(self, name):  # spec, device, dtype, kv_pools, allocate_kv_cache, ...
        return getattr(self.model, name)

    def forward(self, batch):
        self.calls += 1
        if self.calls == 2:
            self.paused.set()
            self.resume.wait(60)
        return self.model.forward(batch)


def gated_server(model_dir, tokenizer=None, **options) -> tuple[Server, GatedModel]:
    from orca_ext.models import load_model

    model = GatedModel(load_model(str(model_dir), device="cpu", dtype="float32"))
    return Server(model, tokenizer=tokenizer, **options), model


@functools.lru_cache(maxsize=1)
def _hf(model_dir: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy_until_eos(model_dir, prompt: list[int], max_new_tokens: int, eos: int) -> list[int]:
    """transformers greedy decoding with its normal EOS stop (the EOS token is kept)."""
    from transformers import GenerationConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=eos)
    with torch.no_grad():
        out = _hf(str(model_dir)).generate(torch.tensor([prompt]), generation_config=gen,
                                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def run_waves(server: Server, gate: GatedModel, jobs: list[tuple[list[int], int]], seed: int,
              ignore_eos: bool = True) -> list:
    """jobs[0:2] start first; jobs[2:4] are submitted from threads while iteration 1 is paused;
    the rest come from threads at random times. Returns the final outputs in job order."""
    paused, resume = gate.paused, gate.resume
    results: list = [None] * len(jobs)
    ids: list = [None] * len(jobs)

    def params(i):
        return SamplingParams(max_tokens=jobs[i][1], ignore_eos=ignore_eos)

    for i in (0, 1):
        ids[i] = server.submit(jobs[i][0], params(i))
    assert paused.wait(60)
    submitted = threading.Barrier(3)

    def mid_flight(i):
        ids[i] = server.submit(jobs[i][0], params(i))
        submitted.wait(60)
        results[i] = server.result(ids[i])

    def staggered(i):
        time.sleep(random.Random(seed + i).uniform(0.0, 0.05))
        results[i] = server.generate([jobs[i][0]], params(i))[0]

    threads = [threading.Thread(target=mid_flight, args=(i,)) for i in (2, 3)]
    threads += [threading.Thread(target=staggered, args=(i,)) for i in range(4, len(jobs))]
    for t in threads:
        t.start()
    submitted.wait(60)  # both mid-flight requests are in the pool before iteration 1 returns
    resume.set()
    for i in (0, 1):
        results[i] = server.result(ids[i])
    for t in threads:
        t.join(120)
    return results


def check_mixing(server: Server) -> None:
    recs = server.iterations()
    assert any(r.num_prefill_tokens > 0 and r.num_decode_tokens > 0 for r in recs), \
        "no iteration mixed a prefill with decodes"
    seen: set = set()
    joined_mid_flight = False
    for prev, rec in zip(recs, recs[1:]):
        seen |= set(prev.request_ids)
        new = set(rec.request_ids) - seen
        if new and set(rec.request_ids) & set(prev.request_ids):
            joined_mid_flight = True
    assert joined_mid_flight, "no request joined a running batch"
    # The two requests submitted during the paused iteration 1 joined iteration 2.
    assert len(recs[2].request_ids) >= 3 and recs[2].num_decode_tokens >= 1


def assert_idle(server: Server) -> None:
    st = server.stats()
    assert (st["waiting"], st["running"], st["slots_reserved"], st["slots_used"]) == (0, 0, 0, 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_models_match_transformers_under_continuous_batching(tiny_model_dir, family):
    model_dir = tiny_model_dir(family)
    rng = random.Random(hash(family) % 1000)
    # Awkward prompt lengths; the first two run long enough to still be decoding at iteration 2.
    jobs = [([rng.randrange(1000) for _ in range(rng.randint(1, 37))], rng.randint(3, 14)) for _ in range(8)]
    jobs[0] = (jobs[0][0], 17)
    jobs[1] = (jobs[1][0], 12)
    server, gate = gated_server(model_dir, max_batch_size=5, n_slots=600, record_iterations=True)
    with server:
        outs = run_waves(server, gate, jobs, seed=1)
        for (prompt, n), out in zip(jobs, outs):
            assert out.finish_reason == "length"
            assert out.token_ids == reference_greedy(model_dir, prompt, n), (family, prompt)
        check_mixing(server)
        assert_idle(server)


def test_static_policy_matches_transformers(tiny_model_dir):
    model_dir = tiny_model_dir("qwen2")
    rng = random.Random(7)
    jobs = [([rng.randrange(1000) for _ in range(rng.randint(2, 20))], rng.randint(2, 9)) for _ in range(5)]
    with Server(str(model_dir), device="cpu", dtype="float32", max_batch_size=2, n_slots=300,
                scheduler="static") as server:
        outs = server.generate([p for p, _ in jobs], [SamplingParams(max_tokens=n, ignore_eos=True)
                                                      for _, n in jobs])
        assert [o.token_ids for o in outs] == [reference_greedy(model_dir, p, n) for p, n in jobs]
        assert_idle(server)


def test_smollm2_matches_transformers_under_continuous_batching(default_model_dir):
    """The real model, with EOS handling on: a request stops at EOS exactly where transformers does."""
    from orca_ext.models import apply_chat_template, load_tokenizer

    tok = load_tokenizer(default_model_dir)
    questions = ["What is the capital of France?", "Write a haiku about rain.",
                 "List three prime numbers.", "Why is the sky blue?", "Say hi.",
                 "What is 12 times 7?"]
    prompts = [tok.encode(apply_chat_template(tok, [{"role": "user", "content": q}]), add_special_tokens=False)
               for q in questions]
    prompts.append(tok.encode("The quick brown fox", add_special_tokens=False))
    lengths = [20, 16, 12, 14, 24, 12, 9]
    jobs = list(zip(prompts, lengths))
    server, gate = gated_server(default_model_dir, tokenizer=tok, max_batch_size=8, n_slots=2048,
                                record_iterations=True)
    with server:
        eos = gate.spec.eos_token_ids[0]
        outs = run_waves(server, gate, jobs, seed=2, ignore_eos=False)
        reasons = set()
        for (prompt, n), out in zip(jobs, outs):
            ref = hf_greedy_until_eos(default_model_dir, prompt, n, eos)
            assert out.token_ids == ref
            assert out.finish_reason == ("stop" if ref[-1] == eos else "length")
            assert out.text == tok.decode(ref, skip_special_tokens=True)
            reasons.add(out.finish_reason)
        assert reasons == {"stop", "length"}  # both the EOS stop and the length limit occurred
        check_mixing(server)
        assert_idle(server)
        st = server.stats()
        assert st["device"] == "cpu" and st["dtype"] == "float32" and st["finished"] == len(jobs)
