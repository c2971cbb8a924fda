"""Every model shape a GPU benchmark script builds is built here, on the CPU and without weights
(specs, transformers configs, and models on the meta device), so that a shape the benchmarks only
use on a GPU cannot fail there first: each preset of bench/cuda_graphs.py at the script's context
range, bench/gpu_engine.py's Qwen3 configs, and bench/parallel_gpu.py's Llama shape, each read
back through our own config parser as a served model folder would be."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orca_ext.models.config import ModelSpec

ROOT = Path(__file__).resolve().parent.parent


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_script_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


cuda_graphs = load_script("cuda_graphs")
gpu_engine = load_script("gpu_engine")
parallel_gpu = load_script("parallel_gpu")


@pytest.mark.parametrize("preset", sorted(cuda_graphs.PRESETS))
@pytest.mark.parametrize("context", [2, 1024, 8191, 8192, 20000])
def test_every_cuda_graphs_preset_builds_its_spec(preset, context):
    """--preset X --context N: the spec keeps the preset's shapes and holds context + 1 positions."""
    spec = cuda_graphs.preset_spec(preset, context)
    fields = cuda_graphs.PRESETS[preset]
    for name, value in fields.items():
        if name != "max_position_embeddings":
            assert getattr(spec, name) == value, name
    assert spec.max_position_embeddings == max(fields.get("max_position_embeddings", 8192), context + 1)
    assert spec.num_heads % spec.num_kv_heads == 0 and spec.head_dim % 2 == 0


def test_the_cuda_graphs_script_builds_its_default_preset():
    """The preset the device check runs (the --preset default) is one the test above builds."""
    ap_default = next(line for line in (ROOT / "bench" / "cuda_graphs.py").read_text().splitlines()
                      if '"--preset"' in line)
    default = ap_default.split('default="')[1].split('"')[0]
    assert default in cuda_graphs.PRESETS and default != "tiny"


@pytest.mark.parametrize("preset", sorted(set(cuda_graphs.PRESETS) - {"tiny"}))
def test_the_cuda_graphs_dry_run_builds_the_spec_of_the_requested_preset(tmp_path, preset):
    """--dry-run runs the tiny model on the CPU, but first builds the requested preset's spec."""
    out = tmp_path / "graphs.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cuda_graphs.py"), "--dry-run", "--preset", preset,
                           "--batches", "1,3", "--iters", "1", "--context", "40", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert [row["batch"] for row in json.loads(out.read_text())["rows"]] == [1, 3]


def served_spec(config, folder: Path) -> ModelSpec:
    """The config written as a model folder's config.json and parsed back by our loader."""
    config.save_pretrained(str(folder))
    return ModelSpec.from_pretrained(folder)


@pytest.mark.parametrize("name", ["QWEN3_06B", "TINY"])
def test_gpu_engine_configs_build_and_parse(tmp_path, name):
    cfg = getattr(gpu_engine, name)
    config = gpu_engine.hf_config(cfg)
    with torch.device("meta"):  # shapes only: no memory for the weights
        model = type_of(config, "Qwen3ForCausalLM")(config)
    assert sum(p.numel() for p in model.parameters()) > 0
    spec = served_spec(config, tmp_path)
    assert (spec.architecture, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        "Qwen3ForCausalLM", cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
        cfg["head_dim"])
    assert spec.vocab_size == cfg["vocab_size"] and spec.qk_norm and spec.tie_word_embeddings
    assert spec.sliding_window is None and spec.max_position_embeddings == cfg["max_position_embeddings"]
    # The bytes the benchmark's memory floor counts are the model's own parameter bytes in bf16.
    n_params = sum(p.numel() for p in model.parameters())
    assert gpu_engine.weight_bytes_per_iteration(cfg) == 2 * n_params


def test_parallel_gpu_shape_builds_and_parses(tmp_path):
    config = parallel_gpu.hf_config()
    with torch.device("meta"):
        type_of(config, "LlamaForCausalLM")(config)
    spec = served_spec(config, tmp_path)
    shape = parallel_gpu.SHAPE
    assert (spec.architecture, spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (
        "LlamaForCausalLM", shape["hidden_size"], shape["num_hidden_layers"], shape["num_attention_heads"],
        shape["num_key_value_heads"])
    # Every tensor/pipeline split the script tries divides the heads and the layers.
    for tp, pp in parallel_gpu.configurations(8):
        assert spec.num_kv_heads % tp == 0 and spec.num_layers % pp == 0, (tp, pp)


def type_of(config, name: str):
    import transformers

    assert config.architectures == [name]
    return getattr(transformers, name)
