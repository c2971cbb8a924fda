"""RopeTables: on the CPU the tables grow in blocks as positions are asked for, and every row is
the float32 angle's cos/sin whatever order the blocks came in."""
from __future__ import annotations

import random

import pytest
import torch

from orca_ext.models.config import RopeConfig
from orca_ext.models.rope import ROPE_BLOCK, RopeTables, inv_freq

LLAMA3 = RopeConfig(theta=500000.0, rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position_embeddings=8192)
PLAIN = RopeConfig(theta=10000.0)


def _reference(rope: RopeConfig, head_dim: int, positions: torch.Tensor):
    """cos/sin in float64 of the float32 angle position * inv_freq, as transformers computes it."""
    angles = (positions.to(torch.float32)[:, None] * inv_freq(rope, head_dim)[None, :]).double()
    return angles.cos(), angles.sin()


@pytest.mark.parametrize("rope,head_dim,max_positions", [(LLAMA3, 64, 131072), (PLAIN, 48, 3 * ROPE_BLOCK + 17)])
def test_rows_match_the_reference_in_any_order_of_growth(rope, head_dim, max_positions):
    rng = random.Random(7)
    asked = [rng.randrange(max_positions) for _ in range(6)] + [max_positions - 1, 0]
    stepwise = RopeTables(rope, head_dim, max_positions, torch.device("cpu"))
    for p in asked:  # grown a block range at a time, out of order
        stepwise.gather(torch.tensor([p, p // 2]))
    at_once = RopeTables(rope, head_dim, max_positions, torch.device("cpu"))
    positions = torch.tensor(sorted(set(asked + [p // 2 for p in asked])))
    cos1, sin1 = stepwise.gather(positions)
    cos2, sin2 = at_once.gather(positions, int(positions.max()))
    assert torch.equal(cos1, cos2) and torch.equal(sin1, sin2)  # rows do not depend on growth order
    ref_cos, ref_sin = _reference(rope, head_dim, positions)
    torch.testing.assert_close(cos1.double(), ref_cos, rtol=0, atol=2e-7)
    torch.testing.assert_close(sin1.double(), ref_sin, rtol=0, atol=2e-7)
    assert cos1.dtype == torch.float32 and cos1.shape == (len(positions), head_dim // 2) and cos1.is_contiguous()


def test_cpu_tables_hold_only_the_blocks_asked_for():
    t = RopeTables(LLAMA3, 64, 131072, torch.device("cpu"))
    assert t.cos.shape[0] == ROPE_BLOCK
    t.gather(torch.tensor([5, 2 * ROPE_BLOCK + 3]))
    assert t.cos.shape[0] == t.sin.shape[0] == 3 * ROPE_BLOCK
    t.gather(torch.tensor([ROPE_BLOCK]))  # already covered: nothing grows
    assert t.cos.shape[0] == 3 * ROPE_BLOCK
    t.gather(torch.tensor([131071]))
    assert t.cos.shape[0] == 131072  # the last block stops at max_positions
