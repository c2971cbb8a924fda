"""Batch-invariant outputs on CUDA: in the batch-invariant mode, a request's logits and tokens (greedy and
seeded sampling) are the same bits alone and in random crowds of up to 31 others, with and without
chunked prefill, in bfloat16, float16 and float32, eagerly and with decode iterations replayed as
CUDA graphs (padded buckets). The CPU twin is tests/test_batch_invariance.py."""
from __future__ import annotations

import random

import pytest
import torch

from invariance_cases import crowd, probes, run
from orca_ext import modes
from orca_ext.models import load_model
from orca_ext.cuda_graphs import DecodeGraphRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("family", ["qwen2", "llama"])
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_outputs_alone_equal_outputs_in_random_crowds(tiny_model_dir, dtype, family, graphs):
    model = load_model(tiny_model_dir(family), device="cuda", dtype=dtype)
    with modes.using(batch_invariant=True):  # before any capture: the graphs record the invariant forward
        if graphs:
            model = DecodeGraphRunner(model, max_batch_size=32)
        rng = random.Random(f"{family}{dtype}")
        mine = probes(rng)
        alone = run(model, mine, budget=None)
        for trial, (size, budget) in enumerate([(31, 48), (rng.randint(1, 30), None), (rng.randint(1, 30), 32)]):
            jobs = [(rid, p, params, rng.randint(0, 4)) for rid, p, params, _ in mine] + crowd(rng, size)
            together = run(model, jobs, budget)
            for rid, _, _, _ in mine:
                tokens, logits = together[rid]
                assert tokens == alone[rid][0], (family, dtype, trial, rid)
                assert torch.equal(logits, alone[rid][1]), (family, dtype, trial, rid, "logits differ")
        if graphs:  # the decode iterations did replay the graphs captured in this mode
            assert model.replayed_iterations > 0 and model.capture_modes.batch_invariant
