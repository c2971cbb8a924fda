"""CUDA graphs for decode iterations against the eager forward, on the GPU.

The same driver as tests/test_decode_graphs.py (which runs the bookkeeping on the CPU with a
stand-in for the capture), here with real CUDA graphs: requests join and leave every step, so the
batch size, and with it the bucket and the padding, keeps changing; finished slabs are reused.
Each graph replay must give the eager model's tokens, request by request:
  * float32 (the CUDA-core attention, cuBLAS without TF32): exactly the same greedy tokens;
  * bfloat16 on the tensor-core attention (head dims 64 and 128, GQA): padding changes GEMM and
    attention shapes, so rounding differs; a token may differ only where the eager logits of the
    two tokens are within MARGIN of each other.
Models have random weights (no files needed).
"""
from __future__ import annotations

import pytest
import torch

from orca_ext.models.batch import ForwardBatch
from orca_ext.cuda_graphs import DECODE_BUCKETS, DecodeGraphRunner, bucket_for, with_decode_graphs
from orca_ext.random_weights import random_causal_lm, random_spec

from graph_driver import drive, eager_twin, written_slots

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MARGIN = 0.1  # logits; random-weight logits have a spread of about 2


def make_pair(dtype, max_batch_size, n_slots, seed=0, **overrides):
    model = random_causal_lm(random_spec(**overrides), "cuda", dtype, seed=seed)
    eager = eager_twin(model)
    runner = DecodeGraphRunner(model, max_batch_size)
    runner.allocate_kv_cache(n_slots)
    eager.allocate_kv_cache(n_slots)
    return runner, eager


@pytest.mark.parametrize("seed,overrides", [
    (0, {}),                                                      # head_dim 32: CUDA-core attention
    (1, dict(num_heads=8, num_kv_heads=1, head_dim=64, qk_norm=True)),
])
def test_float32_replay_gives_the_eager_tokens(seed, overrides):
    n_slots = 4000
    runner, eager = make_pair(torch.float32, 48, n_slots, seed, **overrides)
    assert sorted(runner.graphs) == [1, 2, 4, 8, 16, 32, 64]
    report = drive(runner, eager, n_slots=n_slots, steps=150, seed=seed, max_batch=48, max_prompt=80)
    assert not report.token_mismatches
    assert report.max_logit_diff < 1e-3
    assert runner.replayed_iterations > 60 and runner.eager_iterations == report.mixed_steps > 10
    assert {bucket_for(b, runner.buckets) for b in report.decode_batch_sizes} >= {1, 2, 4, 8, 16, 32, 64}
    torch.cuda.synchronize()
    assert torch.equal(written_slots(runner.model, n_slots), written_slots(eager, n_slots))


@pytest.mark.parametrize("seed,overrides", [
    (2, dict(hidden_size=256, num_heads=4, num_kv_heads=2, head_dim=64, intermediate_size=320)),
    (3, dict(hidden_size=256, num_heads=8, num_kv_heads=1, head_dim=128, intermediate_size=320, qkv_bias=True)),
])
def test_bfloat16_replay_follows_the_eager_tokens(seed, overrides):
    n_slots = 8000
    runner, eager = make_pair(torch.bfloat16, 100, n_slots, seed, **overrides)
    assert sorted(runner.graphs) == [1, 2, 4, 8, 16, 32, 64, 128]
    report = drive(runner, eager, n_slots=n_slots, steps=150, seed=seed, max_batch=100, max_prompt=120,
                   margin=MARGIN)
    assert len(report.token_mismatches) <= max(2, report.steps // 50), report.token_mismatches
    assert report.max_logit_diff < 0.5
    assert runner.replayed_iterations > 60
    assert {bucket_for(b, runner.buckets) for b in report.decode_batch_sizes} >= {1, 2, 4, 8, 16, 32, 64}


def test_batches_of_every_bucket_size_up_to_256():
    """One decode step at the edges of every bucket (exactly full, one row of padding, one over)."""
    n_slots = 600
    runner, eager = make_pair(torch.float32, 256, n_slots, seed=4, num_layers=2)
    assert tuple(sorted(runner.graphs)) == DECODE_BUCKETS
    sizes = sorted({s for b in DECODE_BUCKETS for s in (b - 1, b, b + 1) if 1 <= s <= 256})
    for n in sizes:
        # Contexts of 1 + i tokens in slabs of 2 slots: every request writes its own slot.
        batch = ForwardBatch.build([([7 + i], 1, 2 * i) for i in range(n)], "cuda")
        ours, ref = runner.forward(batch).float().clone(), eager.forward(batch).float()
        assert ours.shape == ref.shape == (n, runner.spec.vocab_size)
        assert torch.equal(ours.argmax(-1), ref.argmax(-1)), f"batch of {n}"
        torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3, msg=lambda m: f"batch of {n}: {m}")
    assert runner.replayed_iterations == len(sizes) and runner.eager_iterations == 0


def test_with_decode_graphs_wraps_a_cuda_model_unless_eager():
    model = random_causal_lm(random_spec(num_layers=1), "cuda", torch.bfloat16)
    assert isinstance(with_decode_graphs(model, 8), DecodeGraphRunner)
    assert with_decode_graphs(model, 8, enforce_eager=True) is model


def test_server_with_graphs_gives_the_tokens_of_an_eager_server():
    """End to end: requests of different lengths arrive together and leave one by one, so the
    decode batches shrink step by step through the buckets; float32 tokens must be identical."""
    from orca_ext import SamplingParams, Server

    model = random_causal_lm(random_spec(num_layers=2, num_heads=8, num_kv_heads=2, head_dim=64), "cuda",
                             torch.float32, seed=5)
    prompts = [[(7 * i + j) % 500 for j in range(1 + (i * 13) % 60)] for i in range(40)]
    params = [SamplingParams(max_tokens=1 + (i * 7) % 24) for i in range(40)]
    outputs = {}
    for eager in (False, True):
        with Server(model if not eager else eager_twin(model), n_slots=4000, max_batch_size=40,
                    enforce_eager=eager) as server:
            runner = server.executor.model
            assert isinstance(runner, DecodeGraphRunner) != eager
            outputs[eager] = [o.token_ids for o in server.generate(prompts, params)]
            if not eager:
                assert runner.replayed_iterations > 10
    assert outputs[False] == outputs[True]
