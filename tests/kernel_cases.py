"""Random ragged batches for the kernel tests (shared by the CPU and CUDA kernel tests)."""
from __future__ import annotations

import dataclasses
import random

import torch


@dataclasses.dataclass
class RaggedCase:
    q: torch.Tensor          # [T, Hq, D]
    k_cache: torch.Tensor    # [S, Hkv, D]
    v_cache: torch.Tensor    # [S, Hkv, D]
    q_start: torch.Tensor    # [B]
    q_len: torch.Tensor
    kv_start: torch.Tensor
    kv_len: torch.Tensor
    kinds: list[str]         # "decode" | "prefill" | "prefix" per request

    def index_tensors(self):
        return self.q_start, self.q_len, self.kv_start, self.kv_len


def scattered_slabs(rng: random.Random, lengths: list[int], gap_max: int = 9) -> tuple[list[int], int]:
    """Start slots for slabs of the given lengths, in shuffled order with random gaps; returns
    (starts, total slots needed)."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    starts = [0] * len(lengths)
    cursor = rng.randint(0, gap_max)
    for i in order:
        starts[i] = cursor
        cursor += lengths[i] + rng.randint(0, gap_max)
    return starts, cursor + rng.randint(1, gap_max)


def make_ragged_case(seed: int, kinds: list[str], n_q_heads: int, n_kv_heads: int, head_dim: int,
                     dtype: torch.dtype, device: str = "cpu", index_dtype=torch.int32,
                     max_context: int = 90) -> RaggedCase:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    q_lens, kv_lens = [], []
    for kind in kinds:
        kv = rng.randint(1, max_context)
        if kind == "decode":
            ql = 1
        elif kind == "prefill":
            ql = kv
        else:  # prefill over a cached prefix
            kv = max(kv, 2)
            ql = rng.randint(1, kv - 1)
        q_lens.append(ql)
        kv_lens.append(kv)
    # Query rows of the requests in a shuffled order, so q_start is not monotone.
    q_starts, n_tokens = [0] * len(kinds), 0
    for i in rng.sample(range(len(kinds)), len(kinds)):
        q_starts[i] = n_tokens
        n_tokens += q_lens[i]
    kv_starts, n_slots = scattered_slabs(rng, kv_lens)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).to(device)

    def idx(values):
        return torch.tensor(values, dtype=index_dtype, device=device)

    return RaggedCase(q=rand(n_tokens, n_q_heads, head_dim), k_cache=rand(n_slots, n_kv_heads, head_dim),
                      v_cache=rand(n_slots, n_kv_heads, head_dim), q_start=idx(q_starts), q_len=idx(q_lens),
                      kv_start=idx(kv_starts), kv_len=idx(kv_lens), kinds=list(kinds))


def random_kinds(seed: int, n: int) -> list[str]:
    rng = random.Random(seed)
    kinds = [rng.choice(["decode", "decode", "prefill", "prefix"]) for _ in range(n)]
    kinds[:3] = ["decode", "prefill", "prefix"][: len(kinds)]  # every batch mixes all three kinds
    return kinds
