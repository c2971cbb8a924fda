"""Rotary position embeddings on flat token tensors.

The cos/sin tables cover every position up to max_position_embeddings once, at load time; each
forward gathers the rows of its tokens' own positions (`batch.positions`), so requests at
different positions share one rope call. Tables are float32 (like transformers, which computes
`positions * inv_freq` in float32); rotation is done in float32 and cast back to the input dtype.
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


class RopeTables:
    """cos/sin tables [max_positions, head_dim/2] float32 on the model's device."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, device: torch.device):
        freq = inv_freq(rope, head_dim)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), freq)  # [P, D/2]
        self.cos = angles.cos().to(device)
        self.sin = angles.sin().to(device)
        self.max_positions = max_positions
        self.head_dim = head_dim

    def gather(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> cos, sin [T, D/2] (contiguous, as the fused CPU kernel takes them)."""
        return self.cos[positions], self.sin[positions]
