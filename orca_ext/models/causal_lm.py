"""CausalLM: the selective-batching forward of Llama / Mistral / Qwen2 / Qwen3 decoders.

One forward runs every scheduled request at once on a flat [T, hidden] tensor (T = all new
tokens of the iteration, no padding). Only attention needs per-request structure, and it gets
it from the ForwardBatch index tensors in a single `ragged_attention` call per layer:

    m = modes.current()                                       # the kernel modes; the ops read the same ones
    x = embed(tokens), or the previous pipeline stage's x     # [T, H]
    plan = ragged_attention_plan(per-request ranges)          # attention work list, shared by all layers
    per layer:  qkv = rmsnorm_qkv(x)                          # fused input norm + QKV, [T, Nq*D + 2*Nkv*D]
                if CPU, m.fused_rope_on_cpu, no q/k norm:     # one kernel, bit-identical to the steps below
                    q = rope_slab_write(qkv, cos, sin, K/V pools, slots)
                else:
                    (Qwen3) q, k = rms_norm per head
                    q, k = rope(q, k at each token's own position)
                    slab_write(K/V pools, k, v, slots)        # into each request's slab
                a = ragged_attention(q, pools, per-request ranges, plan)
                x = all_reduce(o_proj(a) + x)                 # residual added before the rounding
                n = rms_norm(x)
                act = silu(gate(n)) * up(n)                   # one fused gate_up call, [T, I]
                x = all_reduce(down(act) + x)
    not the last stage: return x                              # [T, H] for the next stage
    logits = gather(lm_head(rms_norm(x[last token of each request])))  # [B, V] float32, one fused call

Weights are plain tensors (no nn.Module): the loader fuses q/k/v into one matrix and gate/up
into another, so each layer does four matmuls on the flat tensor. On CPU all four (and the
lm_head) stream their weights through our kernels, whose results for a token do not depend on
the rest of the batch (unless `_C.set_cpu_stream_max_tokens` hands large T to ATen's GEMM).

The forward takes its switches from the process's kernel modes (orca_ext/modes.py), which change
only between forwards: `fused_rope_on_cpu` picks the rope path above, and `batch_invariant`, which
the ops read themselves, makes a request's logits independent of its batch-mates on every device:
every matmul (rmsnorm_qkv, the o/gate_up/down projections, the lm_head) takes one code path whose
arithmetic per token does not depend on T (CPU: our kernels even past a lowered crossover; CUDA:
cuBLAS on fixed-shape row chunks instead of the fused decode kernel), and the attention plan has
no decode splits (CPU: the tile path for every request), so nothing depends on the prompt chunk a
token is in either. The remaining operations (embedding, rope, norms, residual adds) are per
token already.

Tensor/pipeline parallelism (models/sharding.py): a worker's CausalLM holds only its stage's
layers and its rank's heads (Nq, Nkv and I above are then this rank's share), `embed` only on the
first stage, `final_norm`/`lm_head` (its vocabulary rows) only on the last. o_proj and down are
row-parallel: each rank's product is a partial sum, to which tensor rank 0 alone adds the
residual (and the bias), and `all_reduce` adds them up; `gather` joins the vocabulary slices of
the logits. In a single process both are identities and the forward is exactly the one above.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from .. import modes, ops
from ..quant.weight import bytes_by_type
from . import huge_pages
from .batch import ForwardBatch
from .config import ModelSpec
from .rope import RopeTables, apply_rope
from .sharding import ShardSpec

class SingleRank:
    """The tensor-parallel collectives of a one-rank group: nothing to add up or gather."""

    size = 1
    rank = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


@dataclasses.dataclass
class LayerWeights:
    input_norm: torch.Tensor             # [H]
    qkv_weight: torch.Tensor             # [Nq*D + 2*Nkv*D, H]  (q rows, then k rows, then v rows)
    qkv_bias: torch.Tensor | None        # [Nq*D + 2*Nkv*D]
    q_norm: torch.Tensor | None          # [D] (Qwen3)
    k_norm: torch.Tensor | None          # [D] (Qwen3)
    o_weight: torch.Tensor               # [H, Nq*D]
    o_bias: torch.Tensor | None          # [H]
    post_norm: torch.Tensor              # [H]
    gate_up_weight: torch.Tensor         # [2*I, H]  (gate rows, then up rows)
    gate_up_bias: torch.Tensor | None    # [2*I]
    down_weight: torch.Tensor            # [H, I]
    down_bias: torch.Tensor | None       # [H]


class CausalLM:
    def __init__(self, spec: ModelSpec, embed: torch.Tensor | None, layers: list[LayerWeights],
                 final_norm: torch.Tensor | None, lm_head: torch.Tensor | None, device: torch.device,
                 dtype: torch.dtype, shard: ShardSpec | None = None, tp_comm=None):
        self.spec = spec
        self.device = device
        self.dtype = dtype
        self.embed = embed                # [V, H]; None unless the first pipeline stage
        self.layers = layers              # this stage's layers
        self.final_norm = final_norm      # [H]; None unless the last pipeline stage
        self.lm_head = lm_head            # [V/tp, H] (the embedding itself when tied); last stage only
        self.shard = shard
        self.tp = tp_comm if tp_comm is not None else SingleRank()
        # This rank's share of the heads (all of them in a single process).
        self.num_heads = shard.num_q_heads if shard else spec.num_heads
        self.num_kv_heads = shard.num_kv_heads if shard else spec.num_kv_heads
        self.rope = RopeTables(spec.rope, spec.head_dim, spec.max_position_embeddings, device)
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        self.k_cache: list[torch.Tensor] = []   # per layer [n_slots, Hkv, D]
        self.v_cache: list[torch.Tensor] = []
        self.kv_pools: torch.Tensor | None = None  # [2 * layers, n_slots, Hkv, D]: all pools, one tensor
        self.n_slots = 0

    def __repr__(self) -> str:
        s = self.spec
        return (f"CausalLM({s.architecture}, layers={len(self.layers)}, hidden={s.hidden_size}, "
                f"heads={self.num_heads}/{self.num_kv_heads}x{s.head_dim}, vocab={s.vocab_size}, "
                f"device={self.device}, dtype={self.dtype}, n_slots={self.n_slots})")

    def block_bytes(self) -> dict[int, int]:
        """Bytes of this model's quantized matrices per ggml type id ({} for float weights)."""
        matrices = [self.embed, self.lm_head] + [m for layer in self.layers for m in (
            layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight)]
        return bytes_by_type(matrices)

    def kv_bytes_per_slot(self) -> int:
        """Bytes of one KV slot in this model's pools (its layers and KV heads only)."""
        s = self.spec
        return 2 * len(self.layers) * self.num_kv_heads * s.head_dim * torch.finfo(self.dtype).bits // 8

    def allocate_kv_cache(self, n_slots: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Allocate per-layer K and V pools [n_slots, Hkv, D] (zeroed); replaces any old cache."""
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        s = self.spec
        self.k_cache, self.v_cache, self.kv_pools = [], [], None  # free the old pools first
        # One allocation for all layers; each layer's pool is a contiguous view into it. On the
        # CPU it lives in huge pages, like the weights (huge_pages.py): a decode reads its context
        # rows from every layer's pool, which spans thousands of 4 KiB pages per step.
        shape = (2, len(self.layers), n_slots, self.num_kv_heads, s.head_dim)
        if self.device.type == "cpu" and huge_pages.active():
            pools = huge_pages.empty(shape, self.dtype).zero_()
        else:
            pools = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.k_cache = list(pools[0].unbind(0))
        self.v_cache = list(pools[1].unbind(0))
        self.kv_pools = pools.view(2 * len(self.layers), n_slots, self.num_kv_heads, s.head_dim)
        self.n_slots = n_slots
        return self.k_cache, self.v_cache

    def _check(self, batch: ForwardBatch) -> None:
        if not self.k_cache:
            raise RuntimeError("allocate_kv_cache(n_slots) must be called before forward")
        if batch.max_slot >= self.n_slots:
            raise ValueError(f"batch writes KV slot {batch.max_slot} but the cache has n_slots={self.n_slots}")
        if batch.max_position >= self.rope.max_positions:
            raise ValueError(f"batch has position {batch.max_position} but the model supports "
                             f"max_position_embeddings={self.rope.max_positions}")
        if batch.max_token_id >= self.spec.vocab_size:
            raise ValueError(f"batch has token id {batch.max_token_id} but vocab_size={self.spec.vocab_size}")

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, hidden: torch.Tensor | None = None) -> torch.Tensor | None:
        """One iteration over all requests of `batch` -> [B, vocab] float32 last-token logits.

        A later pipeline stage takes the previous stage's `hidden` [T, H] instead of embedding the
        tokens; a stage other than the last returns its [T, H] output. Under tensor parallelism
        only the gathering rank (tensor rank 0) gets the logits; the others return None.
        """
        self._check(batch)
        s = self.spec
        t = batch.num_tokens
        eps = s.rms_norm_eps
        nq, nkv, d = self.num_heads, self.num_kv_heads, s.head_dim
        q_end, k_end = nq * d, nq * d + nkv * d
        m = modes.current()  # batch_invariant is read by the ops themselves
        fused_rope = m.fused_rope_on_cpu and self.device.type == "cpu"
        cos, sin = self.rope.gather(batch.positions, batch.max_position)  # [T, D/2] each, once per forward
        x = ops.embedding(batch.token_ids, self.embed, self.dtype) if hidden is None else hidden  # [T, H]
        plan = ops.ragged_attention_plan(batch.q_start, batch.q_len, batch.kv_start, batch.kv_len,
                                         t, self.n_slots, nq, nkv, d, self.dtype)
        for layer, k_pool, v_pool in zip(self.layers, self.k_cache, self.v_cache):
            qkv = ops.rmsnorm_qkv(x, layer.input_norm, layer.qkv_weight, layer.qkv_bias, eps)
            if fused_rope and layer.q_norm is None:
                q = ops.rope_slab_write(qkv, cos, sin, k_pool, v_pool, batch.slots, nq, nkv)  # [T, Nq, D]
            else:
                q = qkv[:, :q_end].view(t, nq, d)
                k = qkv[:, q_end:k_end].view(t, nkv, d)
                v = qkv[:, k_end:].reshape(t, nkv, d).contiguous()
                if layer.q_norm is not None:
                    q = ops.rms_norm(q.reshape(t * nq, d), layer.q_norm, eps).view(t, nq, d)
                    k = ops.rms_norm(k.reshape(t * nkv, d), layer.k_norm, eps).view(t, nkv, d)
                q = apply_rope(q, cos, sin)                       # [T, Nq, D] contiguous
                k = apply_rope(k, cos, sin)                       # [T, Nkv, D] contiguous
                ops.slab_write(k_pool, v_pool, k, v, batch.slots)
            attn = ops.ragged_attention(q, k_pool, v_pool, batch.q_start, batch.q_len,
                                        batch.kv_start, batch.kv_len, self.scale, plan)  # [T, Nq, D]
            x = self._row_parallel(attn.reshape(t, q_end), layer.o_weight, layer.o_bias, x)
            n = ops.rms_norm(x, layer.post_norm, eps)
            act = ops.linear_silu_mul(n, layer.gate_up_weight, layer.gate_up_bias)  # [T, I]
            x = self._row_parallel(act, layer.down_weight, layer.down_bias, x)
        if self.lm_head is None:  # not the last pipeline stage
            return x
        # Final norm + lm_head is the same fused "norm then project" op as rmsnorm_qkv.
        logits = ops.rmsnorm_qkv(x[batch.logits_index], self.final_norm, self.lm_head, None, eps)  # [B, V/tp]
        return self.tp.gather(logits.float())                                                         # [B, V]

    def _row_parallel(self, a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      residual: torch.Tensor) -> torch.Tensor:
        """a W^T + bias + residual [T, H]. Under tensor parallelism `weight` holds this rank's
        input columns: the partial products are added up by one all-reduce, and only tensor
        rank 0 adds the residual (the loader gives the bias to rank 0 alone too)."""
        own = residual if self.tp.rank == 0 else None
        return self.tp.all_reduce(ops.linear(a, weight, bias, residual=own))

    __call__ = forward
