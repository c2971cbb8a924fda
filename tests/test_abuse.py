"""One client must never hurt the others: hostile parameters, inputs and connections.

Every test is a regression test for one way a single request used to fail, stall or corrupt other
requests. Each asserts the error shape the attacker gets AND that bystanders running alongside it
finish with exactly the fake model's greedy reference, with every KV slot back afterwards.

No assertion is about time: where the defect was a cost (stop strings, tokenization), the test
counts work (profiler events on the engine thread) or blocks the attacker on an event and checks
that bystanders finish meanwhile.
"""
from __future__ import annotations

import sys
import threading

import pytest
import torch

from fake_model import FakeModel, FakeSpec, FakeTokenizer, fake_reference
from orca_ext.errors import InvalidRequestError
from orca_ext.sampling import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from orca_ext.server import Server

V = FakeSpec().vocab_size
BYSTANDER_PROMPTS = [[3, 1, 4, 1, 5], [9, 2, 6], [5, 3, 5, 8, 9, 7], [2, 7]]
BYSTANDER_TOKENS = 12


@pytest.fixture
def make_server():
    servers = []

    def make(model=None, tokenizer=None, **kw):
        kw.setdefault("n_slots", 2000)
        kw.setdefault("max_batch_size", 8)
        s = Server(model or FakeModel(), tokenizer=tokenizer or FakeTokenizer(), **kw)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.shutdown()


def assert_idle(server: Server) -> None:
    st = server.stats()
    assert st["waiting"] == 0 and st["running"] == 0
    assert st["slots_reserved"] == 0 and st["slots_used"] == 0 and st["slots_allocated"] == 0


def alongside_bystanders(server: Server, model: FakeModel, attack) -> list:
    """Run `attack()` (which submits the hostile requests and returns their ids) in the same
    iterations as greedy bystanders: a gated first forward holds the engine while everything is
    submitted, so all of them share the next batch. Checks every bystander against the fake
    model's reference and returns the attackers' final outputs."""
    gate = threading.Event()
    model.gate = gate
    model.entered.clear()
    params = SamplingParams(max_tokens=BYSTANDER_TOKENS, ignore_eos=True)
    bystanders = [server.submit(BYSTANDER_PROMPTS[0], params)]
    assert model.entered.wait(30)  # the first bystander's prefill is executing, held at the gate
    bystanders += [server.submit(p, params) for p in BYSTANDER_PROMPTS[1:]]
    attackers = attack()
    model.gate = None
    gate.set()
    outs = [server.result(rid) for rid in attackers]
    for rid, prompt in zip(bystanders, BYSTANDER_PROMPTS):
        out = server.result(rid)
        assert out.finish_reason == "length" and out.error is None, out
        assert out.token_ids == fake_reference(prompt, BYSTANDER_TOKENS)
    assert_idle(server)
    return outs


# -- one request used to fail its whole batch -----------------------------------------------------
@pytest.mark.parametrize("top_k", [2**63, 2**64 + 5, 10**40])
def test_top_k_beyond_int64_is_served_and_fails_nobody(make_server, top_k):
    """Before: top_k = 2**63 passed validation and overflowed the sampler's int64 tensor; the
    exception failed every request of the iteration. Now top_k is clamped to the vocabulary
    (top_k >= vocab keeps every token), so the request is served like top_k = 0."""
    model = FakeModel()
    server = make_server(model)
    params = SamplingParams(max_tokens=8, temperature=1.0, top_k=top_k, seed=3, ignore_eos=True)
    [out] = alongside_bystanders(server, model, lambda: [server.submit([1, 2, 3], params)])
    assert out.finish_reason == "length" and len(out.token_ids) == 8
    assert all(0 <= t < V for t in out.token_ids)
    same = SamplingParams(max_tokens=8, temperature=1.0, top_k=0, seed=3, ignore_eos=True)
    assert server.generate([1, 2, 3], same)[0].token_ids == out.token_ids


def test_a_sampler_failure_fails_only_its_row(make_server):
    """A value that slipped past validation (forced in here) makes the batched sampler raise.
    Before, that exception failed every request of the iteration; now the rows are re-run one
    by one and only the guilty request ends with an error."""
    model = FakeModel()
    server = make_server(model)
    broken = SamplingParams(max_tokens=5, temperature=1.0, seed=1)
    object.__setattr__(broken, "seed", "1")  # no generator can be seeded with it
    [out] = alongside_bystanders(server, model, lambda: [server.submit([4, 4], broken)])
    assert out.finish_reason == "error" and "sampling failed" in out.error and out.token_ids == []


class WideLogitsModel(FakeModel):
    """A model whose logits are wider than its vocabulary (padded lm_head) and which, like
    CausalLM, rejects a whole batch holding an out-of-vocabulary token id. A context holding
    `trigger` puts its greedy token at id V, outside the vocabulary."""

    def __init__(self, trigger: int, **kw):
        super().__init__(**kw)
        self.trigger = trigger

    def forward(self, batch):
        if batch.max_token_id >= self.spec.vocab_size:
            raise ValueError(f"batch has token id {batch.max_token_id} but vocab_size={self.spec.vocab_size}")
        logits = super().forward(batch)
        wide = torch.cat([logits, torch.full((logits.shape[0], 3), -1e4)], dim=1)
        for b, (s, n) in enumerate(zip(batch.kv_start.tolist(), batch.kv_len.tolist())):
            if self.trigger in self.cache[s:s + n].tolist():
                wide[b, V] = 1e4
        return wide


def test_an_unusable_forward_input_fails_only_its_request(make_server):
    """Before: the out-of-vocabulary token sampled for one request made the next forward raise
    for the whole batch, failing every bystander. Now the engine checks each row's inputs and
    leaves the bad row out of the forward."""
    trigger = 100
    assert all(trigger not in p + fake_reference(p, BYSTANDER_TOKENS) for p in BYSTANDER_PROMPTS)
    model = WideLogitsModel(trigger)
    server = make_server(model, tokenizer=FakeTokenizer(vocab_size=V + 3))  # can show id V
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    [out] = alongside_bystanders(server, model, lambda: [server.submit([7, trigger], params)])
    assert out.finish_reason == "error" and "outside the vocabulary" in out.error
    assert out.token_ids == [V]  # the sampled id that no forward can take


# -- tiny temperatures and top_p used to return garbage with success ------------------------------
@pytest.mark.parametrize("temperature", [1e-6, 1e-39, 5e-324])
def test_tiny_temperature_is_greedy(make_server, temperature):
    """Before: temperatures below ~1e-38 divided the logits into inf/NaN; argmax then returned
    token 0 every step with finish_reason 'length'. Below GREEDY_TEMPERATURE (1e-5) a request is
    now greedy, so it must equal the greedy reference."""
    model = FakeModel()
    server = make_server(model)
    params = SamplingParams(max_tokens=10, temperature=temperature, seed=5, ignore_eos=True)
    assert params.greedy
    [out] = alongside_bystanders(server, model, lambda: [server.submit([6, 1, 6], params)])
    assert out.finish_reason == "length" and out.token_ids == fake_reference([6, 1, 6], 10)


def test_extreme_top_p_and_temperature_give_valid_tokens(make_server):
    """top_p = 1e-50 rounds to 0 in float32 and used to mask every token (an all -inf row, then
    NaN probabilities); the nucleus always keeps the most likely token now, so such a request is
    greedy. A temperature of 1e300 (inf in float32) is clamped and samples almost uniformly."""
    model = FakeModel()
    server = make_server(model)
    nucleus = SamplingParams(max_tokens=10, temperature=1.0, top_p=1e-50, seed=2, ignore_eos=True)
    hot = SamplingParams(max_tokens=30, temperature=1e300, top_k=50, seed=2, ignore_eos=True)
    a, b = alongside_bystanders(server, model, lambda: [server.submit([8, 8], nucleus),
                                                        server.submit([8, 9], hot)])
    assert a.finish_reason == "length" and a.token_ids == fake_reference([8, 8], 10)
    assert b.finish_reason == "length" and len(b.token_ids) == 30 and all(0 <= t < V for t in b.token_ids)
    assert len(set(b.token_ids)) > 10  # spread out, not one garbage id repeated


# -- stop strings used to multiply the engine's per-token work ------------------------------------
@pytest.mark.parametrize("stop, message", [
    (["x"] * (MAX_STOP_STRINGS + 1), rf"stop has {MAX_STOP_STRINGS + 1} strings; at most {MAX_STOP_STRINGS}"),
    (["ok", "y" * (MAX_STOP_STRING_CHARS + 1)],
     rf"stop\[1\] has {MAX_STOP_STRING_CHARS + 1} characters; at most {MAX_STOP_STRING_CHARS}"),
    (["ok", "\ud800"], r"stop\[1\] is not valid Unicode"),
    (b"STOP", "stop must be a string or a list of strings"),
])
def test_stop_string_limits(stop, message):
    """Before: 1,000 stop strings of 1,000 characters were accepted."""
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(stop=stop)
    with pytest.raises(InvalidRequestError, match=rf"at most {MAX_STOP_TOKEN_IDS}"):
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    SamplingParams(stop=["z" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS)  # the limits themselves pass


class OneTokenModel(FakeModel):
    """Always predicts token 0 ('A' for FakeTokenizer): the text is 'AAAA...'."""

    def forward(self, batch):
        logits = super().forward(batch)  # keeps the fake model's KV bookkeeping checks
        out = torch.full_like(logits, -1.0)
        out[:, 0] = 0.0
        return out


def engine_thread_calls(server: Server, prompt, params) -> tuple[int, object]:
    """Profiler events (Python and C calls) the engine thread spends on one request run alone."""
    counter = server._test_profile_counter
    before = counter[0]
    out = server.generate(prompt, params)[0]
    return counter[0] - before, out


def test_stop_check_cost_does_not_multiply_with_the_stop_strings(make_server):
    """Before: each token checked every prefix of every stop string against the text's end (about
    count x length^2 character comparisons: 16 x 255 endswith calls per token here, 10^6 with
    1,000 x 1,000). Now the check reads only the new characters. The work is counted as profiler
    events on the engine thread: a request with the largest allowed, never-matching stop strings
    may cost only a few events per generated character more than the same request without them
    (plus at most the longest stop string, for a streaming matcher's failure transitions)."""
    counter = [0]

    def profile(frame, event, arg):
        if event in ("call", "c_call"):
            counter[0] += 1

    threading.setprofile(profile)  # applies to threads started from now on: the engine's loop
    try:
        server = make_server(OneTokenModel())
    finally:
        threading.setprofile(None)
    server._test_profile_counter = counter
    n = 120
    # Every prefix of every stop is checked and fails ('B'/'C'/... never follow the text's 'A's).
    stops = [chr(0x42 + i) + "A" * (MAX_STOP_STRING_CHARS - 1) for i in range(MAX_STOP_STRINGS)]
    plain_calls, plain = engine_thread_calls(server, [1, 2], SamplingParams(max_tokens=n, ignore_eos=True))
    stop_calls, stopped = engine_thread_calls(server, [1, 2], SamplingParams(max_tokens=n, ignore_eos=True,
                                                                            stop=stops))
    assert plain.text == stopped.text == "A" * n
    extra = stop_calls - plain_calls
    assert extra <= 8 * (n + MAX_STOP_STRING_CHARS), (extra, plain_calls)
    # Stops that do match the text's pattern: held back while they could still complete, then cut.
    hit, = server.generate([1, 2], SamplingParams(max_tokens=n, stop=["A" * 50 + "B", "A" * 40]))
    assert hit.finish_reason == "stop" and hit.text == ""
    assert_idle(server)
    assert sys.getprofile() is None  # this thread was never profiled
