"""Pure-torch references of the kernels in csrc/ (docs/DESIGN.md section 4).

They are written for clarity, not speed: tests run them in float64 as the ground truth, and
`orca_ext.ops` falls back to them when the compiled extension is missing.
"""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H], weight [H] -> [T, H]; the norm is computed in at least float32."""
    acc = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(acc)
    inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return ((xf * inv) * weight.to(acc)).to(x.dtype)


def rmsnorm_qkv(x, norm_weight, qkv_weight, qkv_bias, eps: float) -> torch.Tensor:
    """x [T, H] -> [T, Nq*D + 2*Nkv*D] = linear(rms_norm(x) * norm_weight, qkv_weight, qkv_bias)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    normed = rms_norm(x.to(acc), norm_weight.to(acc), eps)
    bias = None if qkv_bias is None else qkv_bias.to(acc)
    return torch.nn.functional.linear(normed, qkv_weight.to(acc), bias).to(x.dtype)


def slab_write(k_cache, v_cache, k, v, slots) -> None:
    """k_cache[slots[t]] = k[t]; v_cache[slots[t]] = v[t] (in place)."""
    idx = slots.long()
    k_cache[idx] = k
    v_cache[idx] = v


def ragged_attention(q, k_cache, v_cache, q_start, q_len, kv_start, kv_len, scale: float) -> torch.Tensor:
    """Causal attention per request over a ragged batch; q [T, Hq, D] -> [T, Hq, D].

    Request b's query rows are the last q_len[b] positions of its kv_len[b]-token context stored at
    k_cache[kv_start[b]:...]; row i sees context positions 0 .. kv_len[b] - q_len[b] + i.
    """
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.zeros_like(q)
    n_q_heads, n_kv_heads = q.shape[1], k_cache.shape[1]
    group = n_q_heads // n_kv_heads
    for b in range(q_start.numel()):
        qs, ql, ks, kl = (int(t[b]) for t in (q_start, q_len, kv_start, kv_len))
        if ql == 0:
            continue
        qb = q[qs:qs + ql].to(acc).transpose(0, 1)                       # [Hq, ql, D]
        kb = k_cache[ks:ks + kl].to(acc).repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, kl, D]
        vb = v_cache[ks:ks + kl].to(acc).repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qb @ kb.transpose(1, 2)) * scale                         # [Hq, ql, kl]
        rows = torch.arange(ql, device=q.device).unsqueeze(1) + (kl - ql)
        cols = torch.arange(kl, device=q.device).unsqueeze(0)
        scores = scores.masked_fill(cols > rows, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[qs:qs + ql] = (probs @ vb).transpose(0, 1).to(q.dtype)
    return out
