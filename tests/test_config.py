"""EngineConfig: every option checked once at construction, resolved once per machine."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from fake_model import FakeModel
from orca_ext.config import CHUNK_BUDGET_BY_DEVICE, PREFILL_ONLY_BUDGET_BY_DEVICE, EngineConfig
from orca_ext.resources import KV_MEMORY_ENV
from orca_ext.server import Server


@pytest.mark.parametrize("options,message", [
    (dict(max_batch_size=0), "max_batch_size must be an integer >= 1, got 0"),
    (dict(max_batch_size=True), "max_batch_size must be an integer >= 1, got True"),
    (dict(n_slots=-3), "n_slots must be an integer >= 1, got -3"),
    (dict(max_model_len=2.5), "max_model_len must be an integer >= 1, got 2.5"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
    (dict(pipeline_parallel_size="2"), "pipeline_parallel_size must be an integer >= 1"),
    (dict(max_undelivered_outputs=0), "max_undelivered_outputs must be an integer >= 1"),
    (dict(scheduler="fifo"), "scheduler must be one of 'orca', 'static'; got 'fifo'"),
    (dict(enforce_eager="yes"), "enforce_eager must be True or False, got 'yes'"),
    (dict(record_iterations=1), "record_iterations must be True or False, got 1"),
    (dict(slab_compaction=None), "slab_compaction must be True or False, got None"),
    (dict(batch_invariant="on"), "batch_invariant must be True, False or None"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an integer >= 1, got 0"),
    (dict(max_num_batched_tokens=7, max_batch_size=8), r"max_num_batched_tokens \(7\) must be >= max_batch_size \(8\)"),
    (dict(prefill_only_tokens=0), "prefill_only_tokens must be an integer >= 1, got 0"),
    (dict(prefill_only_tokens="lots"), "prefill_only_tokens must be an integer >= 1, got 'lots'"),
    (dict(max_num_batched_tokens=256, prefill_only_tokens=255),
     r"prefill_only_tokens \(255\) must be >= max_num_batched_tokens \(256\)"),
    (dict(worker_timeout=0), "worker_timeout must be a number of seconds > 0, got 0"),
    (dict(worker_timeout=float("inf")), "worker_timeout must be a number of seconds > 0, got inf"),
    (dict(heartbeat_interval=-1), "heartbeat_interval must be a number of seconds > 0, got -1"),
    (dict(heartbeat_interval=5, heartbeat_timeout=5), r"heartbeat_interval \(5\) must be below heartbeat_timeout \(5\)"),
    (dict(kv_cache_memory="lots"), "kv_cache_memory: cannot parse a memory size from 'lots'"),
])
def test_bad_options_name_the_field_and_the_limit(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_resolve_decides_every_auto_for_the_device():
    config = EngineConfig(device="cpu", max_batch_size=5).resolve()
    assert config.is_resolved and not EngineConfig(device="cpu").is_resolved
    assert (config.device, config.dtype) == (torch.device("cpu"), torch.float32)
    assert config.max_num_batched_tokens == max(CHUNK_BUDGET_BY_DEVICE["cpu"], 5)
    assert config.batch_invariant is True  # the CPU default
    # Explicit values survive; the budget never drops below max_batch_size; static runs whole prompts.
    big = CHUNK_BUDGET_BY_DEVICE["cpu"] + 9
    assert EngineConfig(device="cpu", max_batch_size=big).resolve().max_num_batched_tokens == big
    assert EngineConfig(device="cpu", batch_invariant=False, dtype="bfloat16").resolve().dtype == torch.bfloat16
    assert EngineConfig(device="cpu", scheduler="static", max_num_batched_tokens=64).resolve().max_num_batched_tokens is None
    # Resolving twice changes nothing.
    assert config.resolve() == config


def test_the_prefill_only_budget_resolves_per_device_and_admission():
    def resolved(device_type, **options):
        return EngineConfig(**options).scheduling_for(device_type).prefill_only_tokens

    assert resolved("cpu") == PREFILL_ONLY_BUDGET_BY_DEVICE["cpu"] > CHUNK_BUDGET_BY_DEVICE["cpu"]
    assert resolved("cuda") == max(PREFILL_ONLY_BUDGET_BY_DEVICE["cuda"], CHUNK_BUDGET_BY_DEVICE["cuda"])
    # Never below the chunk budget; fair admission, None and whole prompts keep the chunk budget.
    assert resolved("cpu", max_num_batched_tokens=1000) == 1000
    assert resolved("cpu", max_batch_size=700) == 700
    assert resolved("cpu", admission="fair") == CHUNK_BUDGET_BY_DEVICE["cpu"]
    assert resolved("cpu", prefill_only_tokens=None) == CHUNK_BUDGET_BY_DEVICE["cpu"]
    assert resolved("cpu", prefill_only_tokens=300) == 300
    assert resolved("cpu", max_num_batched_tokens=None) is None
    assert resolved("cpu", scheduler="static") is None
    # An explicit value is checked against the budget it resolves beside.
    with pytest.raises(ValueError, match=r"prefill_only_tokens \(200\) must be >= max_num_batched_tokens \(2048\)"):
        EngineConfig(prefill_only_tokens=200).scheduling_for("cuda")
    assert not dataclasses.replace(EngineConfig(device="cpu").resolve(), prefill_only_tokens="auto").is_resolved


def test_a_model_object_decides_device_and_dtype():
    config = EngineConfig(device="cuda:7", dtype="float16").resolve(FakeModel())
    assert (config.device, config.dtype) == (torch.device("cpu"), torch.float32)


def test_kv_memory_comes_from_the_option_else_the_environment(monkeypatch):
    monkeypatch.delenv(KV_MEMORY_ENV, raising=False)
    assert EngineConfig(device="cpu").resolve().kv_cache_memory is None
    assert EngineConfig(device="cpu", kv_cache_memory="2KiB").resolve().kv_cache_memory == 2048
    monkeypatch.setenv(KV_MEMORY_ENV, "3KiB")
    assert EngineConfig(device="cpu").resolve().kv_cache_memory == 3072
    assert EngineConfig(device="cpu", kv_cache_memory=100).resolve().kv_cache_memory == 100
    monkeypatch.setenv(KV_MEMORY_ENV, "much")
    with pytest.raises(ValueError, match=r"\$ORCA_EXT_KV_CACHE_MEMORY: cannot parse"):
        EngineConfig(device="cpu").resolve()


def test_parallel_devices_are_whole_device_types():
    with pytest.raises(ValueError, match="with tensor or pipeline parallelism device must be"):
        EngineConfig(device="cuda:1", tensor_parallel_size=2).resolve()
    assert EngineConfig(device="cpu", pipeline_parallel_size=2).resolve().device == torch.device("cpu")


def test_server_takes_a_config_or_options_not_both():
    config = EngineConfig(n_slots=64, max_batch_size=4)
    with Server(FakeModel(), config=config) as server:
        assert server.config == config.resolve(FakeModel())
        assert (server.n_slots, server.max_batch_size) == (64, 4)
    with pytest.raises(TypeError, match="either config or options"):
        Server(FakeModel(), config=config, n_slots=64)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['n_slot'\]"):
        Server(FakeModel(), n_slot=64)
    with pytest.raises(TypeError, match="config must be an EngineConfig, got dict"):
        Server(FakeModel(), config=dataclasses.asdict(config))
