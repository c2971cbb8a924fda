"""The logits-side API features on tensor and pipeline parallel workers equal the single process.

Logprobs (with top alternatives), prompt logprobs (echo, max_tokens 0, over chunked prefill),
penalties, logit_bias, min_tokens, guided decoding (JSON, regex, choice) and n = 3 seeded
sequences sharing one prefill run in one ragged stream next to plain rows, on -tp 2 and -pp 2
CPU workers of a tiny random model, and must equal a single-process server request by request.
The driver samples these rows with the single process's code, so the results differ only as
much as the logits do: not at all with pipeline stages (tokens, logprobs and prompt logprobs are
equal exactly, float32), and by the rounding of the tensor-parallel all-reduce's order with -tp
(tokens equal, logprobs within 1e-5).
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from orca_ext import logits_controls
from orca_ext.guided import GrammarCompiler, choice_spec, json_object_spec, llg_tokenizer, regex_spec
from orca_ext.sampling import SamplingParams
from orca_ext.server import Server

SERVER_OPTIONS = dict(device="cpu", dtype="float32", max_batch_size=4, n_slots=1024, max_num_batched_tokens=16,
                      prefill_only_tokens=None)
N_SEQUENCES = 3


def make_jobs(compiler) -> list[tuple[list[int], SamplingParams]]:
    """A mixed stream with awkward prompt lengths; the last N_SEQUENCES jobs are one n = 3 request."""
    rng = random.Random(7)

    def prompt(n):
        return [rng.randrange(50, 5000) for _ in range(n)]

    seeded = dict(temperature=0.8, top_k=40, top_p=0.9)
    jobs = [
        (prompt(5), SamplingParams(max_tokens=7, ignore_eos=True)),                            # plain greedy
        (prompt(23), SamplingParams(max_tokens=6, seed=11, ignore_eos=True, **seeded)),         # plain seeded
        (prompt(9), SamplingParams(max_tokens=5, logprobs=3, ignore_eos=True)),
        (prompt(31), SamplingParams(max_tokens=6, logprobs=5, seed=2**64 - 3, ignore_eos=True, **seeded)),
        (prompt(37), SamplingParams(max_tokens=0, prompt_logprobs=2)),                         # echo, scoring
        (prompt(19), SamplingParams(max_tokens=4, prompt_logprobs=1, logprobs=2, seed=5, temperature=1.1)),
        (prompt(13), SamplingParams(max_tokens=8, seed=21, temperature=1.0, repetition_penalty=1.3,
                                    frequency_penalty=0.5, presence_penalty=0.3, min_tokens=4,
                                    logit_bias={101: 4.0, 7: -3.0}, logprobs=1, stop_token_ids=[101])),
        (prompt(3), SamplingParams(max_tokens=40, seed=3, temperature=1.0,
                                   guided=compiler.compile(json_object_spec("response_format")))),
        (prompt(11), SamplingParams(max_tokens=12, guided=compiler.compile(regex_spec(r"[a-c]{3}-[0-9]{1,3}",
                                                                                      "guided_regex")))),
        (prompt(7), SamplingParams(max_tokens=10, seed=9, temperature=1.0, logprobs=2,
                                   guided=compiler.compile(choice_spec(["red", "green (g)", "blue"],
                                                                       "guided_choice")))),
    ]
    n_params = SamplingParams(max_tokens=5, seed=77, logprobs=2, ignore_eos=True, **seeded)
    shared = prompt(21)
    jobs += [(shared, n_params.for_sequence(i)) for i in range(N_SEQUENCES)]
    return jobs


def run_jobs(server: Server, jobs) -> list:
    """Submit every job at once (the n = 3 siblings share the first one's prefill); outputs in order."""
    first_of_n = len(jobs) - N_SEQUENCES
    rids = []
    for i, (prompt, params) in enumerate(jobs):
        share = rids[first_of_n] if i > first_of_n else None
        rids.append(server.submit(prompt, params, share_prefill_with=share))
    return [server.result(r, timeout=300) for r in rids]


def outcome(out) -> tuple:
    return (out.finish_reason, out.error, out.token_ids, _comparable(out.logprobs),
            _comparable(out.prompt_logprobs))


def _comparable(entries):
    """TokenLogprobs as tuples, without the ids of -inf alternatives: when a grammar leaves fewer
    than k tokens possible, which impossible tokens fill the top k is a tie that topk breaks
    arbitrarily."""
    if entries is None:
        return None
    return [None if e is None else (e.token_id, e.logprob,
                                    tuple((t if v != float("-inf") else None, v) for t, v in e.top))
            for e in entries]


def assert_same(got: tuple, want: tuple, exact: bool, what: str) -> None:
    """Outcomes equal; with exact=False the log-probabilities within 1e-5 (the ids equal)."""
    if exact:
        assert got == want, what
        return
    assert got[:3] == want[:3], what
    for g_list, w_list in ((got[3], want[3]), (got[4], want[4])):
        assert (g_list is None) == (w_list is None) and len(g_list or ()) == len(w_list or ()), what
        for g, w in zip(g_list or (), w_list or ()):
            assert (g is None) == (w is None), what
            if g is None:
                continue
            assert g[0] == w[0] and g[1] == pytest.approx(w[1], abs=1e-5), what
            assert [t for t, _ in g[2]] == [t for t, _ in w[2]], what
            assert [v for _, v in g[2]] == pytest.approx([v for _, v in w[2]], abs=1e-5), what


@pytest.fixture(scope="module")
def compiler(tiny_model_dir):
    with Server(str(tiny_model_dir("llama")), **SERVER_OPTIONS) as probe:
        tokenizer = llg_tokenizer(probe.tokenizer, probe.eos_token_ids, probe.vocab_size)
    return GrammarCompiler(lambda: tokenizer)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, compiler):
    """The single-process outputs of the mixed stream."""
    jobs = make_jobs(compiler)
    with Server(str(tiny_model_dir("llama")), **SERVER_OPTIONS) as local:
        return jobs, [outcome(o) for o in run_jobs(local, jobs)]


@pytest.mark.parametrize("tp,pp,prefix_caching", [(2, 1, False), (1, 2, True)], ids=["tp2-fork", "pp2-prefix-cache"])
def test_logits_features_equal_the_single_process(tiny_model_dir, reference, tp, pp, prefix_caching, monkeypatch):
    """-tp 2 shares the n = 3 prefill by the engine's fork, -pp 2 (a batch is mostly in flight,
    so no fork) by prefix cache hits on the first sequence's rows: both copy KV rows in the
    workers (move_slabs)."""
    jobs, want = reference
    assert all(w[0] in ("length", "stop") for w in want), want
    assert any(w[3] for w in want) and any(w[4] for w in want)  # logprobs and prompt logprobs were asked
    with Server(str(tiny_model_dir("llama")), tensor_parallel_size=tp, pipeline_parallel_size=pp,
                record_iterations=True, prefix_caching=prefix_caching, **SERVER_OPTIONS) as server:
        outs = run_jobs(server, jobs)
        got = [outcome(o) for o in outs]
        exact = tp == 1  # pipeline stages pass activations on; -tp sums partial products in another order
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, exact, f"job {i}: {jobs[i][1]}")
        # Chunked prefill split the scored prompts; the siblings copied the first sequence's
        # prompt KV in the workers.
        assert max(c for rec in server.iterations() for c in rec.chunk_sizes) <= 16
        forked = server._engine.num_forked_tokens
        shared = forked + sum(o.num_cached_tokens for o in outs[-N_SEQUENCES + 1:])
        assert shared == (N_SEQUENCES - 1) * (len(jobs[-1][0]) - 1)
        assert (forked > 0) == (not prefix_caching)

        # A row whose sampling fails on the driver fails its request alone: its batch-mates (on
        # the driver and on the worker) end as in one process.
        real = logits_controls.apply_to_rows

        def failing(x, rows, requests):
            if any(r.params.logit_bias and dict(r.params.logit_bias).get(4242) for r in requests):
                raise RuntimeError("controls broken on purpose")
            return real(x, rows, requests)

        monkeypatch.setattr(logits_controls, "apply_to_rows", failing)
        broken = (jobs[6][0], SamplingParams(max_tokens=3, logit_bias={4242: 1.0}))
        mates = [jobs[0], jobs[2], jobs[6]]
        rids = [server.submit(p, params) for p, params in [broken] + mates]
        outs = [server.result(r, timeout=300) for r in rids]
        assert outs[0].finish_reason == "error" and "controls broken on purpose" in outs[0].error
        for out, i in zip(outs[1:], (0, 2, 6)):
            assert_same(outcome(out), want[i], exact, f"batch-mate job {i}")
        assert server.executor.error is None


def test_http_tp2_serves_the_logits_fields(tiny_model_dir):
    """With -tp 2 the API's logits-side fields are served (no 400): echo with logprobs,
    logit_bias, min_tokens, a penalty and a guided choice, in one request."""
    import openai
    from http_utils import ServerProcess

    model_dir = tiny_model_dir("llama")
    choices = ["yes", "no", "maybe (later)"]
    with ServerProcess("--model", str(model_dir), "--device", "cpu", "--dtype", "float32", "-tp", "2",
                       "--n-slots", "800", env={"OMP_NUM_THREADS": "1"}) as proc:
        client = openai.OpenAI(base_url=proc.url("/v1"), api_key="none", max_retries=0, timeout=120)
        got = client.completions.create(model=Path(model_dir).name, prompt="The answer is", max_tokens=8,
                                        temperature=0, logprobs=2, echo=True, logit_bias={"5": 2.0},
                                        presence_penalty=0.5,
                                        extra_body={"min_tokens": 1, "guided_choice": choices})
        choice = got.choices[0]
        assert choice.text.startswith("The answer is") and choice.text[len("The answer is"):] in choices
        lp = choice.logprobs
        assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) >= 4


def test_rows_sampled_on_the_driver_travel_with_their_logits_rows():
    """The forward message says which rows the driver samples and how many logits rows each
    returns; the worker builds its ForwardBatch from that."""
    from orca_ext.distributed.messages import SamplingRow, pack_forward, payload_len, unpack_forward

    inputs = [([1, 2, 3], 0, 10), ([7], 5, 40), ([4, 4, 9, 9], 0, 0)]
    rows = [SamplingRow(3, None, 0.0, 0, 1.0), SamplingRow(9, 2**64 - 5, 0.7, 5, 0.9, True, True, 1),
            SamplingRow(10, None, 0.0, 0, 1.0, False, True, 4)]
    hdr, payload = pack_forward(12, inputs, rows, [5])
    assert payload.numel() == payload_len(hdr)
    msg = unpack_forward(hdr, payload)
    assert msg.rows == rows and msg.inputs == inputs and msg.free == [5]
    assert msg.logit_rows == [1, 1, 4]
    assert unpack_forward(*pack_forward(13, inputs, rows[:2] + [rows[0]], [])).logit_rows is None


def test_a_failure_on_the_driver_fails_only_the_rows_sampled_there():
    """Should sampling on the driver raise, its rows fail with the reason and the worker's rows
    keep their tokens."""
    import torch

    from orca_ext.distributed.driver_sampling import DriverRows, WorkerResult
    from orca_ext.request import Request
    from orca_ext.sampling import SampleResult, Sampler

    class Broken(Sampler):
        def __call__(self, logits, requests):
            raise RuntimeError("broken on purpose")

    requests = [Request(str(i), [1, 2, 3], SamplingParams(max_tokens=2, logprobs=1 if i % 2 else None))
                for i in range(4)]
    inputs = [([1, 2, 3], 0, 16 * i) for i in range(4)]
    rows = DriverRows(requests, inputs, None, [1, 3])
    answer = WorkerResult(SampleResult([5, 0, 6, 0], [None] * 4), torch.randn(2, 32))
    result = rows.merge(Broken(), answer)
    assert result.tokens[0::2] == [5, 6] and result.errors[0::2] == [None, None]
    assert result.tokens[1::2] == [None, None] and all("broken on purpose" in e for e in result.errors[1::2])
    # The same rows through the real sampler: greedy tokens of their own logits rows, with logprobs.
    logits = torch.randn(2, 32)
    result = DriverRows(requests, inputs, None, [1, 3]).merge(Sampler(), WorkerResult(
        SampleResult([5, 0, 6, 0], [None] * 4), logits))
    assert result.tokens == [5, int(logits[0].argmax()), 6, int(logits[1].argmax())]
    assert result.logprobs[0] is None and result.logprobs[1].token_id == result.tokens[1]
    assert result.logprobs[3].logprob == pytest.approx(float(logits[1].double().log_softmax(0).max()), abs=1e-6)
