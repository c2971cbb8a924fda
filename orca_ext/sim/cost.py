"""Cost models: the time of one iteration, given its `Work`.

`Roofline` is the model the simulator uses for real hardware. Per pipeline stage and iteration,
where a stage holds n_layers / pp layers and the last one also the output projection:

    compute  = (GEMM FLOPs / flops_per_s + attention FLOPs / attention_flops_per_s) / tp
    memory   = (weight bytes + KV bytes read and written) / bytes_per_s / tp
    stage    = stage_scale * (overhead_s + per_row_s * rows / (tp * pp)
               + (max(compute, memory) if overlap else compute + memory))   # roofline / serial
               + stage_offset_s
               + all-reduces: 2 per layer, ring volume 2 (tp-1)/tp * tokens * d * act_bytes
                 over link_bytes_per_s, plus link_latency_s each
    hand-off = tokens * d * act_bytes / handoff_bytes_per_s + link_latency_s    (between stages)
    host     = host_s + host_per_row_s * rows   (the driver: postprocess and schedule, serial)

per_row_s is work per row inside the layers (on a CPU, the projections' per-row cost beyond
their FLOPs at small batches), so it splits over ranks and stages like the layers do. A pipeline
stage runs the same kernels on its n_layers / pp layers: one fit of a single process prices
every stage; the last stage's output projection (on a small model with a large vocabulary, a
fifth of the weights) makes it the slowest. Where a pipeline's own run has been measured, each
stage's time is corrected by a line, `stage_scale` and `stage_offset_s` (fitted to the workers'
timings, stages.py): a single process cannot tell the output projection's rate from the layers',
nor which of its fixed cost every stage pays again. A batch crosses the pp stages one after the
other; a stage takes the next batch as soon as it has passed the last one on. `Hardware` holds
the rates: fitted on this machine (fit.py) or datasheet and measured GPU rates (presets.py),
each labelled by `source`.
`ConstantCost` gives every iteration the same time, for schedules that can be checked by hand.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional, Protocol

from .work import Work


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder-only transformer that its cost depends on."""

    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int
    mlp_matrices: int = 3      # 3: gated (SwiGLU) MLP; 2: GPT-3's plain MLP
    param_bytes: int = 2       # bytes per weight and per KV value (2: fp16/bf16, 4: float32)
    weight_bytes_per_param: Optional[float] = None  # stored weights if not param_bytes (Q4_1: 0.625)

    @property
    def layer_params(self) -> int:
        q_o = 2 * self.d_model * self.n_heads * self.head_dim
        k_v = 2 * self.d_model * self.n_kv_heads * self.head_dim
        return q_o + k_v + self.mlp_matrices * self.d_model * self.d_ff

    @property
    def weight_bytes(self) -> int:
        """The weights one iteration reads: every layer and the output projection."""
        return (self.n_layers * self.layer_params + self.d_model * self.vocab) * self.stored_bytes

    @property
    def stored_bytes(self) -> float:
        """Bytes per stored weight: param_bytes, or less for quantized blocks."""
        return self.param_bytes if self.weight_bytes_per_param is None else self.weight_bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.param_bytes

    @classmethod
    def from_spec(cls, spec, param_bytes: int, name: str = "model",
                  weight_bytes: Optional[float] = None) -> "ModelShape":
        """`weight_bytes`: the served weights' total size where it differs from param_bytes per
        weight (a quantized file); the shape keeps its bytes per weight."""
        shape = cls(name, spec.num_layers, spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                    spec.intermediate_size, spec.vocab_size, 3, param_bytes)
        if weight_bytes is None:
            return shape
        n_params = shape.n_layers * shape.layer_params + shape.d_model * shape.vocab
        return dataclasses.replace(shape, weight_bytes_per_param=weight_bytes / n_params)

    # -- what an iteration costs in operations and bytes ----------------------------------------
    # `layers` of the n_layers (a pipeline stage's share), `head`: with the output projection.
    def gemm_flops(self, w: Work, layers: Optional[float] = None, head: bool = True) -> float:
        layers = self.n_layers if layers is None else layers
        projection = self.d_model * self.vocab * w.emitting if head else 0
        return 2.0 * (layers * self.layer_params * w.new_tokens + projection)

    def attention_flops(self, w: Work, layers: Optional[float] = None) -> float:
        return 4.0 * (self.n_layers if layers is None else layers) * self.n_heads * self.head_dim * w.attended

    def memory_bytes(self, w: Work, layers: Optional[float] = None, head: bool = True) -> float:
        share = 1.0 if layers is None else layers / self.n_layers
        params = share * self.n_layers * self.layer_params + (self.d_model * self.vocab if head else 0)
        weights = params * self.stored_bytes
        return float(weights + share * self.kv_bytes_per_token * (w.context + w.new_tokens))


@dataclass(frozen=True)
class Hardware:
    """Rates of one device (one tensor-parallel rank) and the costs around its kernels."""

    name: str
    source: str                          # where the numbers come from: 'fitted on ...', 'datasheet ...'
    flops_per_s: float                   # dense GEMM
    bytes_per_s: float                   # memory bandwidth
    attention_flops_per_s: float         # attention's arithmetic (slower than GEMM on a CPU)
    overhead_s: float = 0.0              # per iteration and stage: launches, framework
    per_row_s: float = 0.0               # per request row, all layers: per-row kernel cost
    host_s: float = 0.0                  # the driver between two iterations
    host_per_row_s: float = 0.0
    link_bytes_per_s: float = float("inf")   # tensor-parallel all-reduce and stage hand-off link
    link_latency_s: float = 0.0
    handoff_bytes_per_s: Optional[float] = None  # between pipeline stages (None: link_bytes_per_s)
    memory_bytes: float = float("inf")   # device memory (capacity planning)
    overlap: bool = True                 # True: max(compute, memory); False: their sum
    device_type: str = "cuda"            # 'cpu' | 'cuda': picks the engine's chunk budget default


class CostModel(Protocol):
    n_stages: int

    def stage_time(self, w: Work, stage: int = 0) -> float: ...
    def handoff_time(self, w: Work) -> float: ...
    def host_time(self, w: Work) -> float: ...
    def move_time(self, n_bytes: int) -> float: ...


@dataclass(frozen=True)
class Roofline:
    shape: ModelShape
    hw: Hardware
    tp: int = 1
    pp: int = 1
    # Per stage, a line on its time fitted on the pipeline's own run (stages.py): () is 1.0 and 0.
    stage_scale: tuple[float, ...] = ()
    stage_offset_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name in ("stage_scale", "stage_offset_s"):
            values = getattr(self, name)
            if values and len(values) != self.pp:
                raise ValueError(f"{name} has {len(values)} values for {self.pp} stages")

    @property
    def n_stages(self) -> int:
        return self.pp

    def _stage(self, stage: int) -> tuple[float, bool]:
        """(layers, holds the output projection) of pipeline stage `stage`."""
        return self.shape.n_layers / self.pp, stage == self.pp - 1

    def compute_time(self, w: Work, stage: int = 0) -> float:
        hw, s = self.hw, self.shape
        layers, head = self._stage(stage)
        return (s.gemm_flops(w, layers, head) / hw.flops_per_s
                + s.attention_flops(w, layers) / hw.attention_flops_per_s) / self.tp

    def memory_time(self, w: Work, stage: int = 0) -> float:
        return self.shape.memory_bytes(w, *self._stage(stage)) / self.hw.bytes_per_s / self.tp

    def allreduce_time(self, w: Work) -> float:
        if self.tp == 1:
            return 0.0
        volume = 2 * (self.tp - 1) / self.tp * w.new_tokens * self.shape.d_model * self.shape.param_bytes
        per_stage = 2 * self.shape.n_layers / self.pp  # after attention and after the MLP
        return per_stage * (volume / self.hw.link_bytes_per_s + self.hw.link_latency_s)

    def stage_time(self, w: Work, stage: int = 0) -> float:
        c, m = self.compute_time(w, stage), self.memory_time(w, stage)
        kernels = max(c, m) if self.hw.overlap else c + m
        rows = self.hw.per_row_s * w.rows / (self.tp * self.pp)
        scale = self.stage_scale[stage] if self.stage_scale else 1.0
        offset = self.stage_offset_s[stage] if self.stage_offset_s else 0.0
        return scale * (self.hw.overhead_s + rows + kernels) + offset + self.allreduce_time(w)

    def handoff_time(self, w: Work) -> float:
        if self.pp == 1:
            return 0.0
        rate = self.hw.handoff_bytes_per_s or self.hw.link_bytes_per_s
        return w.new_tokens * self.shape.d_model * self.shape.param_bytes / rate + self.hw.link_latency_s

    def host_time(self, w: Work) -> float:
        return self.hw.host_s + self.hw.host_per_row_s * w.rows

    def move_time(self, n_bytes: int) -> float:
        return 2.0 * n_bytes / self.hw.bytes_per_s / (self.tp * self.pp)  # read and write


@dataclass(frozen=True)
class ConstantCost:
    """Every iteration takes `iteration` seconds per stage and `host` on the driver."""

    iteration: float = 1.0
    host: float = 0.0
    n_stages: int = 1
    handoff: float = 0.0

    def stage_time(self, w: Work, stage: int = 0) -> float:
        return self.iteration

    def handoff_time(self, w: Work) -> float:
        return self.handoff if self.n_stages > 1 else 0.0

    def host_time(self, w: Work) -> float:
        return self.host

    def move_time(self, n_bytes: int) -> float:
        return 0.0


def kv_slots(shape: ModelShape, hw: Hardware, tp: int, pp: int, reserve: float = 0.1,
             cap: Optional[int] = None) -> int:
    """KV slots that fit in tp * pp devices after the weights, keeping `reserve` of memory free
    (a Hardware of unbounded memory, such as a fit on a CPU, gets `cap`)."""
    free = tp * pp * hw.memory_bytes * (1 - reserve) - shape.weight_bytes
    if math.isinf(free):
        if cap is None:
            raise ValueError(f"hardware {hw.name!r} has unbounded memory: give a cap on the KV slots")
        return cap
    slots = int(free // shape.kv_bytes_per_token) if free > 0 else 0
    return slots if cap is None else min(slots, cap)
