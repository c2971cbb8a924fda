"""CausalLM: the selective-batching forward of Llama / Mistral / Qwen2 / Qwen3 decoders.

One forward runs every scheduled request at once on a flat [T, hidden] tensor (T = all new
tokens of the iteration, no padding). Only attention needs per-request structure, and it gets
it from the ForwardBatch index tensors in a single `ragged_attention` call per layer:

    x = embed(tokens)                                         # [T, H]
    per layer:  qkv = rmsnorm_qkv(x)                          # fused input norm + QKV, [T, Nq*D + 2*Nkv*D]
                (Qwen3) q, k = rms_norm per head
                q, k = rope(q, k at each token's own position)
                slab_write(K/V pools, k, v, slots)            # into each request's slab
                a = ragged_attention(q, pools, per-request ranges)
                x += o_proj(a);  x += down(silu(gate(n)) * up(n)),  n = rms_norm(x)
    logits = lm_head(rms_norm(x[last token of each request]))  # [B, V] float32, one fused call

Weights are plain tensors (no nn.Module): the loader fuses q/k/v into one matrix and gate/up
into another, so each layer does four matmuls on the flat tensor.

`batch_invariant = True` makes a request's logits independent of its batch-mates: every matmul
(rmsnorm_qkv, the o/gate_up/down projections, the lm_head), the attention and silu * up take one
code path whose arithmetic per token does not depend on T, nor on the prompt chunk a token is in.
The remaining operations (embedding, rope, norms, residual adds) are per token already.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from .. import ops
from .batch import ForwardBatch
from .config import ModelSpec
from .rope import RopeTables, apply_rope


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
    def __init__(self, spec: ModelSpec, embed: torch.Tensor, layers: list[LayerWeights],
                 final_norm: torch.Tensor, lm_head: torch.Tensor, device: torch.device,
                 dtype: torch.dtype):
        self.spec = spec
        self.device = device
        self.dtype = dtype
        self.embed = embed                # [V, H]
        self.layers = layers
        self.final_norm = final_norm      # [H]
        self.lm_head = lm_head            # [V, H] (the embedding itself when tied)
        self.rope = RopeTables(spec.rope, spec.head_dim, spec.max_position_embeddings, device)
        self.scale = 1.0 / math.sqrt(spec.head_dim)
        self.k_cache: list[torch.Tensor] = []   # per layer [n_slots, Hkv, D]
        self.v_cache: list[torch.Tensor] = []
        self.kv_pools: torch.Tensor | None = None  # [2 * layers, n_slots, Hkv, D]: all pools, one tensor
        self.n_slots = 0
        self.batch_invariant = False  # see the module docstring

    def __repr__(self) -> str:
        s = self.spec
        return (f"CausalLM({s.architecture}, layers={s.num_layers}, hidden={s.hidden_size}, "
                f"heads={s.num_heads}/{s.num_kv_heads}x{s.head_dim}, vocab={s.vocab_size}, "
                f"device={self.device}, dtype={self.dtype}, n_slots={self.n_slots})")

    def kv_bytes_per_slot(self) -> int:
        s = self.spec
        return 2 * s.num_layers * s.num_kv_heads * s.head_dim * torch.finfo(self.dtype).bits // 8

    def allocate_kv_cache(self, n_slots: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Allocate per-layer K and V pools [n_slots, Hkv, D] (zeroed); replaces any old cache."""
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        s = self.spec
        self.k_cache, self.v_cache, self.kv_pools = [], [], None  # free the old pools first
        # One allocation for all layers; each layer's pool is a contiguous view into it.
        pools = torch.zeros(2, s.num_layers, n_slots, s.num_kv_heads, s.head_dim,
                            dtype=self.dtype, device=self.device)
        self.k_cache = list(pools[0].unbind(0))
        self.v_cache = list(pools[1].unbind(0))
        self.kv_pools = pools.view(2 * s.num_layers, n_slots, s.num_kv_heads, s.head_dim)
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
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One iteration over all requests of `batch` -> [B, vocab] float32 last-token logits."""
        self._check(batch)
        s = self.spec
        t = batch.num_tokens
        eps = s.rms_norm_eps
        nq, nkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        q_end, k_end = nq * d, nq * d + nkv * d
        inv = self.batch_invariant
        cos, sin = self.rope.gather(batch.positions)              # [T, 1, D/2] each, once per forward
        x = F.embedding(batch.token_ids, self.embed)              # [T, H]
        for layer, k_pool, v_pool in zip(self.layers, self.k_cache, self.v_cache):
            qkv = ops.rmsnorm_qkv(x, layer.input_norm, layer.qkv_weight, layer.qkv_bias, eps, inv)
            q = qkv[:, :q_end].view(t, nq, d)
            k = qkv[:, q_end:k_end].view(t, nkv, d)
            v = qkv[:, k_end:].reshape(t, nkv, d).contiguous()
            if layer.q_norm is not None:
                q = ops.rms_norm(q.reshape(t * nq, d), layer.q_norm, eps).view(t, nq, d)
                k = ops.rms_norm(k.reshape(t * nkv, d), layer.k_norm, eps).view(t, nkv, d)
            q = apply_rope(q, cos, sin)                           # [T, Nq, D] contiguous
            k = apply_rope(k, cos, sin)                           # [T, Nkv, D] contiguous
            ops.slab_write(k_pool, v_pool, k, v, batch.slots)
            attn = ops.ragged_attention(q, k_pool, v_pool, batch.q_start, batch.q_len,
                                        batch.kv_start, batch.kv_len, self.scale, inv)  # [T, Nq, D]
            x = x + ops.linear(attn.reshape(t, q_end), layer.o_weight, layer.o_bias, inv)
            h = ops.rms_norm(x, layer.post_norm, eps)
            gate_up = ops.linear(h, layer.gate_up_weight, layer.gate_up_bias, inv)  # [T, 2I]
            act = ops.silu_mul(gate_up, inv)                          # silu(gate) * up, [T, I]
            x = x + ops.linear(act, layer.down_weight, layer.down_bias, inv)
        # Final norm + lm_head is the same fused "norm then project" op as rmsnorm_qkv.
        last = x[batch.logits_index]
        return ops.rmsnorm_qkv(last, self.final_norm, self.lm_head, None, eps, inv).float()  # [B, V]

    __call__ = forward
