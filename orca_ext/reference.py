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
    """x [T, H] -> [T, Nq*D + 2*Nkv*D] = linear(rms_norm(x) * norm_weight, qkv_weight, qkv_bias).

    The normalised rows are rounded to x's dtype (as a separate rms_norm would return them), then
    projected in at least float32."""
    return linear(rms_norm(x, norm_weight, eps), qkv_weight, qkv_bias)


def linear(x, weight, bias=None, residual=None) -> torch.Tensor:
    """x [T, K], weight [N, K] -> [T, N] = x W^T + bias (+ residual), in at least float32, rounded once."""
    acc = torch.promote_types(x.dtype, torch.float32)
    out = torch.nn.functional.linear(x.to(acc), weight.to(acc), None if bias is None else bias.to(acc))
    if residual is not None:
        out = out + residual.to(acc)
    return out.to(x.dtype)


def linear_silu_mul(x, gate_up_weight, gate_up_bias=None) -> torch.Tensor:
    """x [T, K], gate_up_weight [2I, K] (gate rows, then up rows) -> [T, I] = silu(gate) * up, in at
    least float32, rounded once."""
    acc = torch.promote_types(x.dtype, torch.float32)
    bias = None if gate_up_bias is None else gate_up_bias.to(acc)
    gate, up = torch.nn.functional.linear(x.to(acc), gate_up_weight.to(acc), bias).chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def slab_write(k_cache, v_cache, k, v, slots) -> None:
    """k_cache[slots[t]] = k[t]; v_cache[slots[t]] = v[t] (in place)."""
    idx = slots.long()
    k_cache[idx] = k
    v_cache[idx] = v


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], cos/sin [T, D/2] float32 -> [T, heads, D] in x's dtype: the half-split
    rotation [x1 | x2] -> [x1*cos - x2*sin | x2*cos + x1*sin] in float32 (float64 stays float64)."""
    half = x.shape[-1] // 2
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf, c, s = x.to(acc), cos.to(acc).unsqueeze(1), sin.to(acc).unsqueeze(1)
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


def rope_slab_write(qkv, cos, sin, k_cache, v_cache, slots, n_q_heads: int, n_kv_heads: int) -> torch.Tensor:
    """qkv [T, (Hq + 2*Hkv) * D], cos/sin [T, D/2] float32 -> rotated q [T, Hq, D]; rotated k
    and v are written to the caches at slots[t] (in place): rope, then slab_write."""
    t, d = qkv.shape[0], k_cache.shape[-1]
    q_end, k_end = n_q_heads * d, (n_q_heads + n_kv_heads) * d
    q = rope(qkv[:, :q_end].reshape(t, n_q_heads, d), cos, sin)
    k = rope(qkv[:, q_end:k_end].reshape(t, n_kv_heads, d), cos, sin)
    slab_write(k_cache, v_cache, k, qkv[:, k_end:].reshape(t, n_kv_heads, d), slots)
    return q


def row_argmax(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, V] -> (index [R] int64, value [R]): each row's maximum and the first column holding it;
    a row with a NaN gives NaN and the column of its first NaN."""
    nan = torch.isnan(x)
    has_nan = nan.any(dim=-1)
    value = torch.where(has_nan, torch.full_like(x[:, 0], float("nan")), x.amax(dim=-1))
    hit = torch.where(has_nan.unsqueeze(-1), nan, x == value.unsqueeze(-1))
    return hit.to(torch.int32).argmax(dim=-1), value  # argmax returns the first of equal maxima


def slab_move(pools: torch.Tensor, moves) -> None:
    """pools [P, S, ...]: for each (src, dst, n) of `moves` in order, rows [src, src+n) of every
    pool are copied to rows [dst, dst+n) as if through a temporary (the two ranges may overlap);
    a later move sees the result of the earlier ones. In place."""
    for src, dst, n in (tuple(int(v) for v in m) for m in moves):
        if n > 0 and src != dst:
            pools[:, dst:dst + n] = pools[:, src:src + n].clone()


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


class SlabAllocatorReference:
    """The slab allocator's policy slot by slot (`_C.SlabAllocator` is the real one): best fit,
    lowest start on ties, freed neighbours coalesce. O(n_slots) per call and obviously right, so
    tests use it as the oracle; the scheduler falls back to it only when `_C` is not built."""

    def __init__(self, n_slots: int) -> None:
        if not isinstance(n_slots, int) or n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots!r}")
        self.n_slots = n_slots
        self.used = bytearray(n_slots)    # 1 = slot belongs to an allocated slab
        self.slabs: dict[int, int] = {}   # start -> length

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, length) of every maximal free run, in address order."""
        runs, start = [], None
        for i, u in enumerate(self.used + b"\x01"):
            if not u and start is None:
                start = i
            elif u and start is not None:
                runs.append((start, i - start))
                start = None
        return runs

    def allocate(self, n: int) -> int:
        if n < 1:
            raise ValueError(f"allocate: n must be >= 1, got {n}")
        fits = [(length, start) for start, length in self.free_runs() if length >= n]
        if not fits:
            return -1
        _, start = min(fits)
        self.used[start:start + n] = b"\x01" * n
        self.slabs[start] = n
        return start

    def free(self, start: int) -> None:
        n = self.slabs.pop(start, None)
        if n is None:
            raise ValueError(f"free: slot {start} is not the start of an allocated slab")
        self.used[start:start + n] = bytes(n)

    def compact(self) -> list[tuple[int, int, int]]:
        """Slide every slab toward slot 0, keeping their order, so the free slots become one run
        at the end. Returns (old_start, new_start, length) of each slab that moved, in address
        order: copying their contents in that order never overwrites a slab yet to be copied."""
        moves, slabs, end = [], {}, 0
        for start in sorted(self.slabs):
            n = self.slabs[start]
            if start != end:
                moves.append((start, end, n))
            slabs[end] = n
            end += n
        self.slabs = slabs
        self.used = bytearray(b"\x01" * end) + bytearray(self.n_slots - end)
        return moves

    @property
    def n_used(self) -> int:
        return sum(self.slabs.values())

    @property
    def n_free(self) -> int:
        return self.n_slots - self.n_used

    @property
    def largest_free(self) -> int:
        return max((length for _, length in self.free_runs()), default=0)

    @property
    def n_free_runs(self) -> int:
        return len(self.free_runs())
