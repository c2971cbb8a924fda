"""One client must never hurt the others on the parallel path either (-tp 2 and -pp 2).

The Python-API cases of test_abuse.py that reach the executor, run against real worker processes
of the tiny llama: hostile sampling values (top_k beyond int64, tiny and huge temperatures,
extreme top_p, seeds beyond 64 bits), the most stop strings allowed, a row whose values break
the sampler, out-of-vocabulary prompts, and an abort storm. In each, greedy victims share the
attackers' batches (the first launch is held until everyone is in) and must get exactly the
tokens of a single-process server, the attackers get the single-process answer too (or a clear
error of their own), and the server stays healthy with every KV slot back.

One server per topology serves every case (module fixture); a single-process server of the same
model is the reference.
"""
from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from orca_ext.errors import InvalidRequestError
from orca_ext.sampling import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, SamplingParams
from orca_ext.server import Server

VICTIM_PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7], [2, 7]]
VICTIM_TOKENS = 10
GREEDY = SamplingParams(max_tokens=VICTIM_TOKENS, ignore_eos=True)
TOPOLOGIES = [(2, 1), (1, 2)]


def _options() -> dict:
    return dict(device="cpu", dtype="float32", n_slots=1200, max_batch_size=12)


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def local(model_dir):
    """The single-process reference."""
    server = Server(str(model_dir), **_options())
    yield server
    server.shutdown()


@pytest.fixture(scope="module")
def victim_reference(local):
    return [o.token_ids for o in local.generate(VICTIM_PROMPTS, GREEDY)]


@pytest.fixture(scope="module", params=TOPOLOGIES, ids=lambda t: f"tp{t[0]}-pp{t[1]}")
def parallel(request, model_dir):
    tp, pp = request.param
    server = Server(str(model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp, **_options())
    yield server
    server.shutdown()


def assert_healthy_and_idle(server: Server) -> None:
    deadline = time.monotonic() + 30  # an aborted request's slab returns with its batch
    while server.stats()["slots_allocated"] and time.monotonic() < deadline:
        time.sleep(0.02)
    st = server.stats()
    assert st["healthy"] and st["error"] is None, st["error"]
    assert (st["waiting"], st["running"], st["slots_reserved"], st["slots_used"], st["slots_allocated"]) \
        == (0, 0, 0, 0, 0), st


def alongside_victims(server: Server, victim_reference, attack) -> list:
    """Run `attack()` (it submits the hostile requests and returns their ids) in the same batches
    as greedy victims: the engine's first launch is held until everything is submitted. Checks
    every victim against the single-process tokens; returns the attackers' outputs."""
    executor = server.executor
    launch = executor.execute
    entered, release = threading.Event(), threading.Event()

    def held(batch):
        if not release.is_set():
            entered.set()
            release.wait(60)
        return launch(batch)

    executor.execute = held
    try:
        victims = [server.submit(VICTIM_PROMPTS[0], GREEDY)]
        assert entered.wait(60)  # the first victim's batch is being launched, held
        victims += [server.submit(p, GREEDY) for p in VICTIM_PROMPTS[1:]]
        attackers = attack()
    finally:
        release.set()
        executor.execute = launch
    outs = [server.result(rid, timeout=120) for rid in attackers]  # timeouts: hang guards
    for rid, want in zip(victims, victim_reference):
        out = server.result(rid, timeout=120)
        assert out.finish_reason == "length" and out.error is None, out
        assert out.token_ids == want
    assert_healthy_and_idle(server)
    return outs


@pytest.mark.parametrize("top_k", [2**63, 2**64 + 5, 10**40])
def test_top_k_beyond_int64_is_served_like_one_process(parallel, local, victim_reference, top_k):
    """top_k >= 2**63 is clamped to the vocabulary before the batch is packed for the workers, so
    it neither fails the batch nor the group: the request samples what one process samples."""
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=top_k, seed=3, ignore_eos=True)
    [out] = alongside_victims(parallel, victim_reference, lambda: [parallel.submit([1, 2, 3], params)])
    assert out.finish_reason == "length" and out.error is None
    assert out.token_ids == local.generate([1, 2, 3], params)[0].token_ids


@pytest.mark.parametrize("temperature", [1e-6, 1e-39, 5e-324])
def test_tiny_temperature_is_greedy(parallel, local, victim_reference, temperature):
    params = SamplingParams(max_tokens=8, temperature=temperature, seed=5, ignore_eos=True)
    [out] = alongside_victims(parallel, victim_reference, lambda: [parallel.submit([6, 1, 6], params)])
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    assert out.finish_reason == "length" and out.token_ids == local.generate([6, 1, 6], greedy)[0].token_ids


def test_extreme_top_p_and_temperature_match_one_process(parallel, local, victim_reference):
    """top_p = 1e-50 keeps the most likely token; a temperature of 1e300 is clamped to float32's
    range. Both sample exactly what one process samples with the same seeds."""
    nucleus = SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-50, seed=2, ignore_eos=True)
    hot = SamplingParams(max_tokens=20, temperature=1e300, top_k=50, seed=2, ignore_eos=True)
    a, b = alongside_victims(parallel, victim_reference,
                             lambda: [parallel.submit([8, 8], nucleus), parallel.submit([8, 9], hot)])
    assert a.token_ids == local.generate([8, 8], nucleus)[0].token_ids
    assert b.token_ids == local.generate([8, 9], hot)[0].token_ids
    assert len(set(b.token_ids)) > 5  # spread out, not one garbage id repeated


@pytest.mark.parametrize("seed", [2**64 - 1, -2**63, -5])
def test_seeds_at_the_ends_of_their_range_match_one_process(parallel, local, victim_reference, seed):
    """Seeds in [MIN_SEED, MAX_SEED] are taken mod 2**64, on the workers as in one process."""
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=seed, ignore_eos=True)
    [out] = alongside_victims(parallel, victim_reference, lambda: [parallel.submit([4, 2], params)])
    assert out.finish_reason == "length" and out.token_ids == local.generate([4, 2], params)[0].token_ids


def test_a_numpy_seed_is_packed_like_the_int(parallel, victim_reference):
    as_numpy = SamplingParams(max_tokens=8, temperature=0.8, seed=np.uint64(2**64 - 1), ignore_eos=True)
    as_int = SamplingParams(max_tokens=8, temperature=0.8, seed=2**64 - 1, ignore_eos=True)
    [out] = alongside_victims(parallel, victim_reference, lambda: [parallel.submit([4, 2], as_numpy)])
    assert out.finish_reason == "length" and out.token_ids == parallel.generate([4, 2], as_int)[0].token_ids


def test_most_stop_strings_allowed_match_one_process(parallel, local, victim_reference):
    stops = [chr(0x100 + i) * MAX_STOP_STRING_CHARS for i in range(MAX_STOP_STRINGS)]  # never generated
    params = SamplingParams(max_tokens=12, ignore_eos=True, stop=stops)
    [out] = alongside_victims(parallel, victim_reference, lambda: [parallel.submit([7, 7, 7], params)])
    want = local.generate([7, 7, 7], params)[0]
    assert (out.finish_reason, out.token_ids, out.text) == (want.finish_reason, want.token_ids, want.text)


@pytest.mark.parametrize("field, value", [("seed", "1"), ("top_k", "x")])
def test_a_row_whose_values_break_fails_alone(parallel, victim_reference, field, value):
    """A row whose sampling values cannot be packed (forced past validation here) fails alone
    with "sampling failed", as in one process; its batch-mates get their tokens."""
    broken = SamplingParams(max_tokens=5, temperature=1.0, seed=1, top_k=5)
    object.__setattr__(broken, field, value)
    [out] = alongside_victims(parallel, victim_reference, lambda: [parallel.submit([4, 4], broken)])
    assert out.finish_reason == "error" and "sampling failed" in out.error and out.token_ids == []


def test_out_of_vocabulary_prompts_are_rejected_at_submit(parallel, victim_reference):
    vocab = parallel.executor.spec.vocab_size
    errors = []

    def attack():
        for prompt in ([vocab], [1, vocab + 10**6], [-1], [2**63]):
            with pytest.raises(InvalidRequestError) as info:
                parallel.submit(prompt, GREEDY)
            errors.append(info.value.param)
        return []

    alongside_victims(parallel, victim_reference, attack)
    assert errors == ["prompt"] * 4


def test_an_abort_storm_leaves_the_victims_exact(parallel, victim_reference):
    """Requests submitted and aborted at random moments, many while their batch is in flight,
    change nothing for the victims running beside them, and every slab comes back."""
    aborted = []

    def storm(seed: int):
        rng = random.Random(seed)
        for _ in range(25):
            rid = parallel.submit([rng.randrange(1, 500) for _ in range(rng.randint(1, 30))],
                                  SamplingParams(max_tokens=rng.randint(1, 40), ignore_eos=True))
            time.sleep(rng.uniform(0.0, 0.02))
            if parallel.abort(rid):
                aborted.append(rid)

    threads = [threading.Thread(target=storm, args=(seed,)) for seed in range(3)]
    for t in threads:
        t.start()
    victims = [parallel.submit(p, GREEDY) for p in VICTIM_PROMPTS]
    for rid, want in zip(victims, victim_reference):
        out = parallel.result(rid, timeout=120)
        assert out.finish_reason == "length" and out.token_ids == want, out
    for t in threads:
        t.join(120)
    assert aborted
    assert_healthy_and_idle(parallel)


def test_a_prompt_batch_over_http_matches_one_process(parallel, local):
    """A completions batch (token-id prompts of awkward lengths, n = 2, echo with logprobs:
    forked siblings take the first sequence's prompt logprobs) gets the single process's
    choices; a batch with one refused prompt queues nothing; every slot comes back."""
    import openai
    from http_utils import with_openai_client

    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 26)]
    body = dict(model="m", prompt=prompts, n=2, max_tokens=6, temperature=0, echo=True, logprobs=2,
                extra_body={"ignore_eos": True})

    async def ask(client, _):
        batch = await client.completions.create(**body)
        with pytest.raises(openai.BadRequestError) as info:
            await client.completions.create(**{**body, "prompt": prompts + [[1, 10**7]]})
        return batch, info.value

    got, refused = with_openai_client(parallel, ask)
    want, _ = with_openai_client(local, ask)
    assert refused.body["param"] == "prompt.3"
    assert [c.index for c in got.choices] == list(range(6))
    for g, w in zip(got.choices, want.choices):
        assert (g.text, g.logprobs.tokens) == (w.text, w.logprobs.tokens)
        assert g.logprobs.token_logprobs == pytest.approx(w.logprobs.token_logprobs, abs=1e-5, nan_ok=True)
    assert got.usage == want.usage
    assert_healthy_and_idle(parallel)
