"""orca_ext.resources: device and dtype names, memory sizes, and the pure KV-cache plan."""
from __future__ import annotations

import random

import pytest
import torch

from orca_ext.resources import (KV_MEMORY_ENV, DTYPES, kv_budget, parse_bytes, plan_kv_cache,
                                resolve_device, resolve_dtype)

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)  # a device object only: nothing runs on it here


def test_plan_with_explicit_n_slots_uses_it_as_is():
    plan = plan_kv_cache(model_context=4096, bytes_per_slot=46080, max_batch_size=8, n_slots=300)
    assert (plan.n_slots, plan.max_model_len) == (300, 300)  # context capped to the cache
    plan = plan_kv_cache(model_context=100, bytes_per_slot=8, max_batch_size=8, n_slots=300)
    assert (plan.n_slots, plan.max_model_len) == (300, 100)
    # An explicit max_model_len above n_slots is kept: submit names n_slots as the limit.
    plan = plan_kv_cache(model_context=4096, bytes_per_slot=8, max_batch_size=8, n_slots=50, max_model_len=100)
    assert (plan.n_slots, plan.max_model_len) == (50, 100)


def test_plan_from_a_budget_is_the_largest_cache_that_fits_and_can_be_used():
    rng = random.Random(7)
    for _ in range(500):
        context = rng.randint(1, 40_000)
        bps = rng.randint(1, 300_000)
        batch = rng.randint(1, 257)
        mml = rng.choice([None, rng.randint(1, context)])
        budget = rng.randint(bps, 2**34)
        plan = plan_kv_cache(model_context=context, bytes_per_slot=bps, max_batch_size=batch,
                             max_model_len=mml, budget_bytes=budget)
        usable = batch * (mml or context)  # max_batch_size requests of the longest allowed length
        assert 1 <= plan.n_slots <= usable
        assert plan.n_slots * bps <= budget
        assert plan.n_slots == usable or (plan.n_slots + 1) * bps > budget  # nothing left unused
        assert plan.max_model_len == (mml if mml is not None else min(context, plan.n_slots))


def test_plan_errors_name_the_limit():
    with pytest.raises(ValueError, match=r"max_model_len=5000 exceeds the model's max_position_embeddings=4096"):
        plan_kv_cache(model_context=4096, bytes_per_slot=8, max_batch_size=1, n_slots=10, max_model_len=5000)
    with pytest.raises(ValueError, match=r"kv_cache_memory=99 bytes holds no KV slot \(100 bytes per slot\)"):
        plan_kv_cache(model_context=4096, bytes_per_slot=100, max_batch_size=1, budget_bytes=99)
    with pytest.raises(ValueError, match="n_slots or budget_bytes"):
        plan_kv_cache(model_context=4096, bytes_per_slot=100, max_batch_size=1)


def test_kv_budget_sources(monkeypatch):
    monkeypatch.delenv(KV_MEMORY_ENV, raising=False)
    assert kv_budget("3MiB", CPU) == 3 << 20
    assert kv_budget(12345, CPU) == 12345
    assert 1 <= kv_budget(None, CPU) <= 2 << 30  # the CPU default: min(2 GiB, 25% of free RAM)
    monkeypatch.setenv(KV_MEMORY_ENV, "1KiB")
    assert kv_budget(None, CPU) == 1024
    assert kv_budget("2k", CPU) == 2048  # an explicit value wins over the environment
    monkeypatch.setenv(KV_MEMORY_ENV, "lots")
    with pytest.raises(ValueError, match=r"\$ORCA_EXT_KV_CACHE_MEMORY: cannot parse"):
        kv_budget(None, CPU)
    with pytest.raises(ValueError, match="kv_cache_memory: memory size must be positive"):
        kv_budget(0, CPU)


def test_parse_bytes():
    assert parse_bytes("2GiB") == 2 << 30 and parse_bytes("1.5k") == 1536
    assert parse_bytes("512M") == 512 << 20 and parse_bytes("1e9") == 10**9 and parse_bytes(7) == 7
    with pytest.raises(ValueError, match="memory"):
        parse_bytes("lots")


def test_one_dtype_vocabulary():
    for name, dt in DTYPES.items():
        assert resolve_dtype(name, CUDA) is dt and resolve_dtype(dt, CUDA) is dt
    assert resolve_dtype("auto", CPU) is torch.float32 and resolve_dtype(None, CPU) is torch.float32
    assert resolve_dtype("auto", CUDA) is torch.bfloat16
    assert resolve_dtype("bfloat16", CPU) is torch.bfloat16
    for bad in ("int8", "fp16", "half", "bf16", "Float32", torch.float64, 3):
        with pytest.raises(ValueError, match="dtype must be one of 'auto', 'float32', 'bfloat16', 'float16'"):
            resolve_dtype(bad, CPU)
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype("float16", CPU)
    with pytest.raises(ValueError, match="float16"):
        resolve_dtype(torch.float16, CPU)


def test_devices():
    assert resolve_device("cpu") == CPU
    assert str(resolve_dtype("auto", resolve_device("cpu"))) == "torch.float32"
    for bad in ("tpu", "cuda:x", 3.5):
        with pytest.raises(ValueError, match="device"):
            resolve_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
