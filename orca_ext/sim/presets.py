"""Named model shapes and hardware for the at-scale questions, every number with its source.

GPT-3-like models: the Orca paper's Table 1 (layers, hidden size; heads of 128 dimensions;
d_ff = 4 d; plain 2-matrix MLP; GPT-2's 50257-token vocabulary; fp16 weights and KV).

Hardware: datasheet peaks are what a kernel cannot exceed, so a simulation on them is a lower
bound on time. The H200's copy bandwidth and bf16 GEMM rate are the figures reported as measured on
one H200 (4.2 TB/s, ~790 TFLOP/s); this project's device microbenchmarks have not reproduced them
yet. Per-iteration overheads on GPUs are assumptions, stated here, until those microbenchmarks
give them.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Union

from .cost import Hardware, ModelShape


def gpt3(name: str, n_layers: int, d_model: int) -> ModelShape:
    heads = d_model // 128
    return ModelShape(name, n_layers, d_model, heads, heads, 128, 4 * d_model, 50257, mlp_matrices=2, param_bytes=2)


MODELS = {
    "gpt3-13b": gpt3("gpt3-13b", 40, 5120),
    "gpt3-101b": gpt3("gpt3-101b", 80, 10240),
    "gpt3-175b": gpt3("gpt3-175b", 96, 12288),
    "gpt3-341b": gpt3("gpt3-341b", 120, 15360),
}
# The paper's layouts (tensor parallel x pipeline parallel): 1 GPU, 8-way TP in one node, and
# 8-way TP x 2- and 4-way PP across nodes.
PAPER_LAYOUTS = {"gpt3-13b": (1, 1), "gpt3-101b": (8, 1), "gpt3-175b": (8, 2), "gpt3-341b": (8, 4)}

# Assumed, not measured: a GPU iteration's fixed cost (kernel launches of an eager forward and the
# scheduler's Python) and the driver's time between iterations.
GPU_OVERHEAD_S = 1e-3
GPU_HOST_S = 0.5e-3

HARDWARE = {
    # A100-SXM4-40GB datasheet: 312 TFLOP/s fp16 dense tensor core, 1,555 GB/s HBM2, NVLink 3
    # 300 GB/s per direction in a node; across nodes 200 Gb/s HDR InfiniBand per GPU (25 GB/s),
    # the Orca paper's Azure ND96asr A100 v4 machines. Link latency: 10 us (assumed).
    "a100-40gb": Hardware("a100-40gb", "datasheet peak rates (A100-SXM4-40GB); overheads assumed",
                          flops_per_s=312e12, bytes_per_s=1.555e12, attention_flops_per_s=312e12,
                          overhead_s=GPU_OVERHEAD_S, host_s=GPU_HOST_S, link_bytes_per_s=300e9,
                          link_latency_s=10e-6, memory_bytes=40e9, overlap=True, device_type="cuda"),
    # H200: 4.2 TB/s copy bandwidth and ~790 TFLOP/s bf16 GEMM as reported measured on one (not yet
    # by bench/device_check.sh); 141 GB and NVLink 4 450 GB/s per direction (datasheet); latency assumed.
    "h200": Hardware("h200", "reported H200 measurements (4.2 TB/s copy, 790 TFLOP/s bf16 GEMM), not yet "
                     "reproduced here; memory and NVLink datasheet; overheads assumed", flops_per_s=790e12, bytes_per_s=4.2e12, attention_flops_per_s=790e12,
                     overhead_s=GPU_OVERHEAD_S, host_s=GPU_HOST_S, link_bytes_per_s=450e9, link_latency_s=10e-6,
                     memory_bytes=141e9, overlap=True, device_type="cuda"),
}
# Across nodes (pipeline stages of the paper's 175B and 341B layouts): 25 GB/s per GPU.
INTER_NODE_BYTES_PER_S = 25e9


def load_hardware(name_or_path: Union[str, Path]) -> Hardware:
    """A preset by name, or a Hardware saved as JSON (save_hardware; e.g. a fit on this machine)."""
    if str(name_or_path) in HARDWARE:
        return HARDWARE[str(name_or_path)]
    with open(name_or_path, encoding="utf-8") as f:
        data = json.load(f)
    names = {f.name for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ValueError(f"{name_or_path}: unknown Hardware fields {unknown}")
    return Hardware(**data)


def save_hardware(hw: Hardware, path: Union[str, Path]) -> None:
    Path(path).write_text(json.dumps(dataclasses.asdict(hw), indent=1) + "\n", encoding="utf-8")


def load_shape(name_or_path: Union[str, Path]) -> ModelShape:
    """A preset by name, or a saved ModelShape JSON."""
    if str(name_or_path) in MODELS:
        return MODELS[str(name_or_path)]
    with open(name_or_path, encoding="utf-8") as f:
        return ModelShape(**json.load(f))


def save_shape(shape: ModelShape, path: Union[str, Path]) -> None:
    Path(path).write_text(json.dumps(dataclasses.asdict(shape), indent=1) + "\n", encoding="utf-8")
