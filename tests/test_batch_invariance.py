"""Batch-invariant outputs on CPU: a request's logits and tokens, greedy or seeded sampling, are
the same bits alone and in a crowd of up to 31 random batch-mates, with or without chunked
prefill, in float32 and bfloat16.

The engine is driven directly with a sampler that records each request's logits rows, so the
comparison is bit for bit on the logits (which decide the tokens), not only on the tokens. A
control run without the batch-invariant mode shows that the same crowds do change some logits
there.
"""
from __future__ import annotations

import random

import pytest
import torch

from invariance_cases import crowd, probes, run
from orca_ext import modes
from orca_ext.models import load_model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_alone_equal_outputs_in_random_crowds(tiny_model_dir, dtype):
    model = load_model(tiny_model_dir("qwen2"), device="cpu", dtype=dtype)  # biases on q/k/v
    rng = random.Random(str(dtype))
    mine = probes(rng)
    with modes.using(batch_invariant=True):
        alone = run(model, mine, budget=None)
        for trial, (size, budget) in enumerate([(31, 48), (rng.randint(1, 30), None), (rng.randint(1, 30), 32)]):
            # The probes arrive at random steps, among the crowd's arrivals.
            jobs = [(rid, p, params, rng.randint(0, 4)) for rid, p, params, _ in mine] + crowd(rng, size)
            together = run(model, jobs, budget)
            for rid, _, _, _ in mine:
                tokens, logits = together[rid]
                assert tokens == alone[rid][0], (dtype, trial, rid)
                assert torch.equal(logits, alone[rid][1]), (dtype, trial, rid, "logits differ")


def test_without_batch_invariance_the_same_crowd_changes_logits(tiny_model_dir):
    """The control: the default kernels do depend on the batch, so the test above has teeth."""
    model = load_model(tiny_model_dir("qwen2"), device="cpu", dtype=torch.float32)
    rng = random.Random(1)
    mine = probes(rng)
    with modes.using(batch_invariant=False):
        alone = run(model, mine, budget=None)
        together = run(model, mine + crowd(rng, 31), budget=48)
    assert any(not torch.equal(together[rid][1], alone[rid][1]) for rid, _, _, _ in mine)
