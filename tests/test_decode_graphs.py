"""The decode-graph machinery (orca_ext/cuda_graphs.py) on the CPU, with EagerReplayBackend
standing in for the CUDA graph capture: 'replay' re-runs the captured forward on the current
contents of the input buffers and writes into the captured output, which is what a CUDA graph
replay does. Everything around the graph is real: bucketing, the input copies, the padding rows
and their scratch slot, the output slicing, re-capture on a new cache, the fallback when a capture
fails. The same driver runs real CUDA graphs in tests/cuda/test_cuda_graphs.py.
"""
from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from orca_ext import modes
from orca_ext.models.batch import ForwardBatch
from orca_ext.cuda_graphs import (DECODE_BUCKETS, DecodeGraphRunner, DecodeInputs, EagerReplayBackend,
                                         bucket_for, is_decode_only, with_decode_graphs)
from orca_ext.random_weights import random_causal_lm, random_spec

from graph_driver import drive, eager_twin, written_slots

pytest.importorskip("orca_ext._C")


@pytest.fixture(autouse=True)
def default_modes():
    """The default kernel modes, whatever an earlier test of the process (a Server) left."""
    with modes.using(**dataclasses.asdict(modes.Modes())):
        yield


class FailingBackend:
    def __init__(self, fail_at: int):
        self.fail_at = fail_at
        self.calls = 0

    def capture(self, fn):
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("operation not permitted when stream is capturing")
        return EagerReplayBackend().capture(fn)


def small_model(seed=0, **overrides):
    return random_causal_lm(random_spec(**overrides), "cpu", torch.float32, seed=seed)


def test_bucket_for():
    expected = {1: 1, 2: 2, 3: 4, 4: 4, 5: 8, 9: 16, 17: 32, 33: 64, 65: 128, 129: 256, 200: 256, 256: 256}
    assert {b: bucket_for(b) for b in expected} == expected
    assert bucket_for(257) is None and bucket_for(0) is None
    assert bucket_for(3, (6, 3, 12)) == 3 and bucket_for(7, (6, 3, 12)) == 12 and bucket_for(13, (6, 3, 12)) is None


def test_is_decode_only():
    decode = ForwardBatch.build([([5], 3, 0), ([7], 10, 40)])
    mixed = ForwardBatch.build([([5], 3, 0), ([1, 2, 3], 0, 40)])
    one_token_prompt = ForwardBatch.build([([5], 3, 0), ([9], 0, 40)])  # a prefill of one token
    chunk = ForwardBatch.build([([5, 6], 3, 0)])                        # a prefill chunk over a cache
    assert is_decode_only(decode)
    assert not any(is_decode_only(b) for b in (mixed, one_token_prompt, chunk))


@pytest.mark.parametrize("max_batch_size,captured", [(1, (1,)), (5, (1, 2, 4, 8)), (32, DECODE_BUCKETS[:6]),
                                                     (256, DECODE_BUCKETS), (1000, DECODE_BUCKETS)])
def test_buckets_captured_up_to_max_batch_size(max_batch_size, captured):
    backend = EagerReplayBackend()
    runner = DecodeGraphRunner(small_model(num_layers=1), max_batch_size, backend=backend)
    runner.allocate_kv_cache(64)
    assert tuple(sorted(runner.graphs)) == captured
    assert backend.captured == sorted(captured, reverse=True)  # largest first: the others reuse its pool


@pytest.mark.parametrize("seed,overrides", [
    (0, {}),
    (1, dict(num_heads=6, num_kv_heads=1, head_dim=16)),
    (2, dict(qk_norm=True, qkv_bias=True, num_heads=4, num_kv_heads=4, head_dim=24)),
])
def test_replay_equals_eager_under_changing_membership(seed, overrides):
    """Greedy tokens equal the eager model's request by request, batch after batch, while requests
    join, leave, and reuse each other's slabs; KV pools end up equal; padding writes no real slot."""
    model = small_model(seed, **overrides)
    eager = eager_twin(model)
    backend = EagerReplayBackend()
    runner = DecodeGraphRunner(model, max_batch_size=12, backend=backend)
    n_slots = 700
    runner.allocate_kv_cache(n_slots)
    eager.allocate_kv_cache(n_slots)
    report = drive(runner, eager, n_slots=n_slots, steps=120, seed=seed, max_batch=12)

    assert not report.token_mismatches
    assert report.max_logit_diff < 1e-3
    assert runner.replayed_iterations == backend.replays > 50
    assert runner.eager_iterations == report.mixed_steps > 5
    assert len(report.decode_batch_sizes) >= 6, report.decode_batch_sizes  # many bucket/padding shapes
    assert {bucket_for(b, runner.buckets) for b in report.decode_batch_sizes} >= {1, 2, 4, 8, 16}
    # The padding rows wrote only the scratch slot: exactly the slots the eager model wrote hold data.
    assert torch.equal(written_slots(runner.model, n_slots), written_slots(eager, n_slots))
    for ours, ref in zip(runner.model.k_cache + runner.model.v_cache, eager.k_cache + eager.v_cache):
        torch.testing.assert_close(ours[:n_slots], ref, atol=1e-4, rtol=1e-4)


def test_padding_rows_are_restored_after_a_larger_batch():
    inputs = DecodeInputs(max_rows=16, scratch_slot=99, device=torch.device("cpu"))
    pad_long, pad_int = inputs.long.clone(), inputs.int.clone()
    big = ForwardBatch.build([([10 + i], 3 + i, 20 * i) for i in range(7)])
    inputs.load(big)
    assert inputs.long[0, :7].tolist() == list(range(10, 17))
    assert inputs.long[1, :7].tolist() == [3 + i for i in range(7)]
    assert inputs.long[2, :7].tolist() == [20 * i + 3 + i for i in range(7)]
    assert inputs.int[2, :7].tolist() == [20 * i for i in range(7)]
    assert inputs.int[3, :7].tolist() == [4 + i for i in range(7)]
    assert torch.equal(inputs.long[:, 7:], pad_long[:, 7:]) and torch.equal(inputs.int[:, 7:], pad_int[:, 7:])

    small = ForwardBatch.build([([50], 8, 300), ([51], 2, 400), ([52], 5, 500)])
    inputs.load(small)
    assert inputs.long[0, :3].tolist() == [50, 51, 52] and inputs.long[2, :3].tolist() == [308, 402, 505]
    assert torch.equal(inputs.long[:, 3:], pad_long[:, 3:]) and torch.equal(inputs.int[:, 3:], pad_int[:, 3:])
    # What padding means: token 0 at position 0 in the scratch slot, one key of context; and the
    # per-row constants (q_start = logits_index = row, q_len = 1) hold for real rows too.
    assert set(inputs.long[2, 3:].tolist()) == {99} and set(inputs.int[2, 3:].tolist()) == {99}
    assert set(inputs.int[3, 3:].tolist()) == {1} and set(inputs.long[0, 3:].tolist()) == {0}
    assert inputs.long[3].tolist() == list(range(16)) == inputs.int[0].tolist()
    assert set(inputs.int[1].tolist()) == {1}


def test_fields_that_are_not_one_block_are_copied_one_by_one():
    """A ForwardBatch whose fields are separate tensors (not ForwardBatch.build's two blocks)."""
    built = ForwardBatch.build([([10 + i], 3 + i, 20 * i) for i in range(5)])
    loose = ForwardBatch(**{f: (v.clone() if isinstance(v, torch.Tensor) else v)
                            for f, v in vars(built).items()})
    a = DecodeInputs(8, 99, torch.device("cpu"))
    b = DecodeInputs(8, 99, torch.device("cpu"))
    a.load(built)
    b.load(loose)
    assert torch.equal(a.long, b.long) and torch.equal(a.int, b.int)
    assert a.long[0, :5].tolist() == list(range(10, 15))


def test_batches_that_do_not_fit_run_eagerly():
    model = small_model(num_layers=1)
    eager = eager_twin(model)
    runner = DecodeGraphRunner(model, max_batch_size=4, backend=EagerReplayBackend())
    runner.allocate_kv_cache(200)
    eager.allocate_kv_cache(200)
    prefill = ForwardBatch.build([([1, 2, 3], 0, 10 * i) for i in range(6)])
    torch.testing.assert_close(runner.forward(prefill), eager.forward(prefill))
    six = ForwardBatch.build([([4], 3, 10 * i) for i in range(6)])  # above the largest bucket (4)
    torch.testing.assert_close(runner.forward(six), eager.forward(six))
    assert runner.eager_iterations == 2 and runner.replayed_iterations == 0
    three = ForwardBatch.build([([5], 4, 10 * i) for i in range(3)])
    torch.testing.assert_close(runner.forward(three), eager.forward(three), atol=1e-4, rtol=1e-4)
    assert runner.replayed_iterations == 1


def test_the_scratch_slot_is_not_the_callers():
    runner = DecodeGraphRunner(small_model(num_layers=1), 4, backend=EagerReplayBackend())
    k, v = runner.allocate_kv_cache(50)
    assert len(k) == 1 and k[0].shape[0] == 50 and runner.model.n_slots == 51 and runner.n_slots == 50
    with pytest.raises(ValueError, match="n_slots=50"):
        runner.forward(ForwardBatch.build([([1], 3, 47)]))  # writes slot 50, the scratch slot


def test_a_failed_capture_leaves_every_iteration_eager(caplog):
    backend = FailingBackend(fail_at=3)
    model = small_model(num_layers=1)
    eager = eager_twin(model)
    runner = DecodeGraphRunner(model, 8, backend=backend)
    with caplog.at_level(logging.ERROR, logger="orca_ext.cuda_graphs"):
        runner.allocate_kv_cache(100)
    assert runner.graphs == {} and "capturing the decode graph of batch size 2 failed" in caplog.text
    eager.allocate_kv_cache(100)
    batch = ForwardBatch.build([([1, 2], 0, 0), ([3], 0, 50)])
    torch.testing.assert_close(runner.forward(batch), eager.forward(batch))
    decode = ForwardBatch.build([([4], 2, 0), ([5], 1, 50)])
    torch.testing.assert_close(runner.forward(decode), eager.forward(decode))
    assert runner.eager_iterations == 2 and runner.replayed_iterations == 0


def test_a_new_cache_is_captured_again():
    backend = EagerReplayBackend()
    model = small_model(num_layers=2)
    eager = eager_twin(model)
    runner = DecodeGraphRunner(model, 2, backend=backend)
    runner.allocate_kv_cache(40)
    runner.allocate_kv_cache(300)
    eager.allocate_kv_cache(300)
    assert backend.captured == [2, 1, 2, 1]
    prefill = ForwardBatch.build([([1, 2, 3], 0, 0), ([4, 5], 0, 250)])
    runner.forward(prefill), eager.forward(prefill)
    decode = ForwardBatch.build([([6], 3, 0), ([7], 2, 250)])  # slot 252: only in the new cache
    torch.testing.assert_close(runner.forward(decode), eager.forward(decode), atol=1e-4, rtol=1e-4)
    assert runner.replayed_iterations == 1


@pytest.mark.parametrize("change", [dict(batch_invariant=True), dict(fused_rope_on_cpu=False)])
def test_graphs_replay_only_in_the_modes_they_were_captured_in(caplog, change):
    """After a mode change the decode iterations run eagerly, in the new modes (a graph would run
    the kernels of the old ones); once the modes are back, the graphs replay again."""
    backend = EagerReplayBackend()
    model = small_model(num_layers=2)
    eager = eager_twin(model)
    runner = DecodeGraphRunner(model, 4, backend=backend)
    runner.allocate_kv_cache(200)
    eager.allocate_kv_cache(200)
    assert runner.capture_modes == modes.current()
    prefill = ForwardBatch.build([([1, 2, 3], 0, 0), ([4, 5], 0, 100)])
    runner.forward(prefill), eager.forward(prefill)
    decodes = [ForwardBatch.build([([6 + i], 3 + i, 0), ([9 + i], 2 + i, 100)]) for i in range(4)]

    def step(batch):
        ours, ref = runner.forward(batch), eager.forward(batch)
        assert torch.equal(ours, ref), modes.current()

    step(decodes[0])
    assert (runner.replayed_iterations, runner.eager_iterations) == (1, 1)
    with caplog.at_level(logging.WARNING, logger="orca_ext.cuda_graphs"), modes.using(**change):
        step(decodes[1])
        step(decodes[2])
    assert (runner.replayed_iterations, runner.eager_iterations) == (1, 3)
    assert caplog.text.count("kernel modes changed since the decode graphs were captured") == 1
    step(decodes[3])
    assert (runner.replayed_iterations, runner.eager_iterations) == (2, 3) and backend.replays == 2


def test_a_capture_takes_the_modes_in_force():
    runner = DecodeGraphRunner(small_model(num_layers=1), 2, backend=EagerReplayBackend())
    with modes.using(batch_invariant=True):
        runner.allocate_kv_cache(40)
        assert runner.capture_modes.batch_invariant
        runner.forward(ForwardBatch.build([([1], 3, 0)]))
    assert runner.replayed_iterations == 1
    runner.forward(ForwardBatch.build([([1], 4, 0)]))  # default modes: not those of the capture
    assert (runner.replayed_iterations, runner.eager_iterations) == (1, 1)
    runner.allocate_kv_cache(40)  # a capture in the default modes
    runner.forward(ForwardBatch.build([([1], 3, 0)]))
    assert runner.replayed_iterations == 2 and not runner.capture_modes.batch_invariant


def test_with_decode_graphs_wraps_only_a_cuda_causal_lm():
    model = small_model(num_layers=1)
    assert with_decode_graphs(model, 8) is model                     # CPU: eager
    assert with_decode_graphs(model, 8, enforce_eager=True) is model
    other = object()
    assert with_decode_graphs(other, 8) is other                     # not a CausalLM: as it is


def test_runner_rejects_bad_arguments():
    model = small_model(num_layers=1)
    with pytest.raises(ValueError, match="max_batch_size"):
        DecodeGraphRunner(model, 0, backend=EagerReplayBackend())
    with pytest.raises(ValueError, match="buckets"):
        DecodeGraphRunner(model, 4, buckets=(0, 4), backend=EagerReplayBackend())
    runner = DecodeGraphRunner(model, 4, backend=EagerReplayBackend())
    with pytest.raises(ValueError, match="n_slots"):
        runner.allocate_kv_cache(0)


def test_server_takes_enforce_eager():
    from orca_ext import SamplingParams, Server

    model = small_model(num_layers=1)
    with pytest.raises(ValueError, match="enforce_eager must be True or False, got 'yes'"):
        Server(model, n_slots=64, enforce_eager="yes")
    with Server(model, n_slots=64, max_batch_size=4) as server:  # CPU: the engine drives the model itself
        assert server.executor.model is model
        out = server.generate([[1, 2, 3]], SamplingParams(max_tokens=3))[0]
        assert len(out.token_ids) == 3
