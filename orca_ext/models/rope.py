"""Rotary position embeddings on flat token tensors.

Each forward gathers the cos/sin rows of its tokens' own positions (`batch.positions`), so
requests at different positions share one rope call. On the CPU the tables grow on demand, in
blocks of ROPE_BLOCK positions, up to max_position_embeddings: a 128k-position model served with
short contexts does not keep 32 MiB of tables for positions it never reaches, and each block is
computed alone, so a position's values do not depend on the order the blocks were needed in. On
other devices the tables are built whole at load: a captured CUDA graph holds their addresses.
Tables are float32 (like transformers, which computes `positions * inv_freq` in float32);
rotation is done in float32 and cast back to the input dtype.
Layout follows the Hugging Face "rotate_half" convention: the head dim is split into two halves
[x1 | x2] and rotated as (x1*cos - x2*sin, x2*cos + x1*sin).
"""
from __future__ import annotations

import math

import torch

from ..reference import rope as apply_rope  # the rotation, for the unfused path: x [T, heads, D], cos/sin [T, D/2]
from .config import RopeConfig


def inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim/2] float32 inverse frequencies (plain theta or llama3 scaling)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    freq = 1.0 / (rope.theta ** exponents)
    if rope.rope_type == "default":
        return freq
    if rope.rope_type != "llama3":
        raise ValueError(f"rope_type={rope.rope_type!r} is unsupported")
    # llama3: long wavelengths are slowed down by `factor`, short ones kept, the band between
    # the two cut-offs interpolated smoothly.
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / rope.factor, freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


ROPE_BLOCK = 4096  # positions per table block on the CPU


class RopeTables:
    """cos/sin tables [positions, head_dim/2] float32 on the model's device, for positions below
    max_positions; `gather` grows the CPU tables to cover the positions it is given."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device):
        self.freq = inv_freq(rope, head_dim)  # [D/2]
        self.max_positions = max_positions
        self.head_dim = head_dim
        self.device = device
        self.grows = device.type == "cpu"
        empty = torch.empty(0, head_dim // 2, dtype=torch.float32)
        self.cos, self.sin = empty, empty.clone()
        self._cover(max_positions if not self.grows else min(ROPE_BLOCK, max_positions))

    def _cover(self, positions: int) -> None:
        """Extend the tables to at least `positions` rows (whole blocks, at most max_positions)."""
        have = self.cos.shape[0]
        if positions <= have:
            return
        target = min(self.max_positions, -(-positions // ROPE_BLOCK) * ROPE_BLOCK)
        cos, sin = [self.cos.cpu()], [self.sin.cpu()]
        for start in range(have, target, ROPE_BLOCK):
            rows = torch.arange(start, min(start + ROPE_BLOCK, target), dtype=torch.float32)
            angles = torch.outer(rows, self.freq)  # [block, D/2]
            cos.append(angles.cos())
            sin.append(angles.sin())
        self.cos = torch.cat(cos).to(self.device)
        self.sin = torch.cat(sin).to(self.device)

    def gather(self, positions: torch.Tensor, max_position: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 (each below max_positions; `max_position`: their largest, when the
        caller knows it) -> cos, sin [T, D/2] (contiguous, as the fused CPU kernel takes them)."""
        if self.grows and positions.numel():
            self._cover(1 + (int(positions.max()) if max_position is None else max_position))
        return self.cos[positions], self.sin[positions]
