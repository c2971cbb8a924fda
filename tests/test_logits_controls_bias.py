"""logit_bias maps as large as allowed, over many steps: the batched controls against a float64
reference written out entry by entry.

Each request's map is converted to a tensor once and reused on later steps (logits_controls
keeps recent maps' tensors), so the checks repeat steps with the same maps, with maps that are
equal but distinct objects, with more maps than are kept, and with maps freed and replaced (whose
ids Python may reuse): every step must still apply each row's own map and no other.
"""
from __future__ import annotations

import gc
import random

import pytest
import torch

from orca_ext import logits_controls
from orca_ext.logits_controls import apply_controls
from orca_ext.request import Request
from orca_ext.sampling_params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams

VOCAB = 50_021


def bias_request(rng: random.Random, n_entries: int) -> Request:
    bias = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(n_entries)}
    return Request(f"r{rng.random()}", [1, 2, 3], SamplingParams(max_tokens=4, logit_bias=bias))


def reference(logits: torch.Tensor, requests: list) -> torch.Tensor:
    """float64, row by row from the request's own map (rows without controls unchanged)."""
    x = logits.double().clone()
    for i, r in enumerate(requests):
        bias = dict(r.params.logit_bias)
        if bias:
            x[i, list(bias)] += torch.tensor(list(bias.values()), dtype=torch.float64)
    return x


def check_step(rng: random.Random, requests: list) -> None:
    logits = torch.randn(len(requests), VOCAB) * 5
    got = logits.clone()
    apply_controls(got, requests, [None] * len(requests))  # in place
    want = reference(logits, requests)
    # float32 addition of one bias per entry: within one float32 rounding of the float64 sum.
    error = (got.double() - want).abs().max().item()
    assert error <= 2e-5 * (1 + want.abs().max().item()), error
    untouched = [i for i, r in enumerate(requests) if not r.params.logit_bias]
    assert torch.equal(got[untouched], logits[untouched])


def test_the_largest_maps_over_many_steps_match_the_reference():
    rng = random.Random(11)
    requests = [bias_request(rng, MAX_LOGIT_BIAS_ENTRIES) for _ in range(3)]
    requests.insert(1, Request("plain", [4, 5], SamplingParams(max_tokens=4)))
    for _ in range(4):  # the same map objects every step
        check_step(rng, requests)
    # Equal maps in distinct objects, and rows in another order.
    twins = [Request(f"t{i}", [1], SamplingParams(max_tokens=4, logit_bias=dict(r.params.logit_bias)))
             for i, r in enumerate(requests)]
    check_step(rng, twins[::-1] + requests)


def test_more_maps_than_are_kept_and_replaced_maps_still_apply_their_own_entries():
    rng = random.Random(12)
    for round_ in range(2):
        requests = [bias_request(rng, rng.randrange(1, 40)) for _ in range(logits_controls.BIAS_PAIRS_KEPT + 7)]
        for lo in range(0, len(requests), 37):  # awkward batch sizes
            check_step(rng, requests[lo:lo + 37])
        del requests
        gc.collect()  # the maps' ids may now be reused by the next round's maps
    assert len(logits_controls._BIAS_PAIRS) <= logits_controls.BIAS_PAIRS_KEPT


def test_a_bias_id_outside_the_vocabulary_fails_only_its_row():
    rng = random.Random(13)
    good = bias_request(rng, 50)
    bad = Request("bad", [1], SamplingParams(max_tokens=4, logit_bias={VOCAB + 3: 1.0}))
    logits = torch.randn(2, VOCAB)
    errors = [None, None]
    got = logits.clone()
    apply_controls(got, [good, bad], errors)
    assert errors[0] is None and "outside the vocabulary" in errors[1]
    assert torch.isneginf(got[1]).all()
    torch.testing.assert_close(got[0].double(), reference(logits[:1], [good])[0], rtol=0, atol=1e-3)


@pytest.mark.parametrize("value", [1e-7, -99.99999, 100.0, 0.1])
def test_a_bias_converts_to_float32_as_the_python_value_does(value):
    r = Request("r", [1], SamplingParams(max_tokens=1, logit_bias={7: value}))
    got = torch.zeros(1, 10)
    apply_controls(got, [r], [None])
    assert got[0, 7].item() == torch.tensor(value, dtype=torch.float32).item()
