"""The ggml block formats we serve as they are: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K.

A quantized matrix [N, K] is stored row by row; each row is K / block_size blocks of
bytes_per_block bytes, so the data is uint8 [N, K / block_size * bytes_per_block]. The layouts
(ggml-common.h; all multi-byte fields little-endian, scales float16):

    Q8_0 (32 values, 34 bytes):  d f16 | q int8[32]                  x = d * q
    Q4_0 (32 values, 18 bytes):  d f16 | q uint8[16]                 x = d * (q - 8)
    Q4_1 (32 values, 20 bytes):  d f16 | m f16 | q uint8[16]         x = d * q + m
        4-bit values: byte j holds value j in its low nibble and value j + 16 in its high one.
    Q5_0 (32 values, 22 bytes):  d f16 | qh uint32 | q uint8[16]     x = d * (q - 16)
    Q5_1 (32 values, 24 bytes):  d f16 | m f16 | qh uint32 | q uint8[16]   x = d * q + m
        5-bit values: the low 4 bits as Q4_0's nibbles, bit 4 of value j is bit j of qh.
    Q4_K (256 values, 144 bytes): d f16 | dmin f16 | scales uint8[12] | q uint8[128]
        8 sub-blocks of 32 with 6-bit scale sc and 6-bit min mn packed in `scales`;
        x = (d * sc) * q - (dmin * mn). Bytes 32c..32c+31 of q hold sub-block 2c in their low
        nibbles and sub-block 2c+1 in their high ones.
    Q5_K (256 values, 176 bytes): d f16 | dmin f16 | scales uint8[12] | qh uint8[32] | q uint8[128]
        Q4_K's sub-blocks, scales and nibbles, with bit 4 of value l of sub-block s in bit s of
        qh[l]; x = (d * sc) * q - (dmin * mn), q in 0..31.
    Q6_K (256 values, 210 bytes): ql uint8[128] | qh uint8[64] | scales int8[16] | d f16
        16 sub-blocks of 16 with an int8 scale each; a 6-bit value is 4 low bits from ql and 2
        high bits from qh; x = (d * sc) * (q - 32).

`dequantize` is the torch reference of these definitions (vectorized over all blocks), in the
same float32 operation order as ggml's own dequantize_row_*, so it is bit-identical to it.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Mapping

import torch

from ..checks import check_choice


# EngineConfig.quantization: "auto" serves quantized GGUF matrices as their blocks, "none"
# dequantizes them to the activation dtype at load.
QUANTIZATION_MODES = ("auto", "none")


class QType(enum.IntEnum):
    """ggml type ids (GGMLQuantizationType) of the fast formats."""

    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14


# What the CPU products of the blocks multiply:
#   "float32": float32 activations, so the products are the float path's numbers on the
#              dequantized weights;
#   "int8":    activations rounded to int8 (per 32-block for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1, per 256-block for
#              Q4_K/Q5_K/Q6_K) with integer dot products, as llama.cpp computes every one of these
#              formats (faster; moves perplexity by 0.06-0.6%);
#   "auto":    int8 for the K-quant super-blocks, float32 for the 32-element blocks. Widening a
#              Q4_K or Q6_K block to float32 is compute-bound on a CPU (a Q4_K_M stream decodes at
#              about half of llama.cpp's speed that way) and int8 costs those files +0.06%
#              perplexity, while the 4-bit 32-element blocks widen near the read bound and keep
#              the float path's exact numbers (the embedded Q4_1 model's).
# A server resolves "auto" once per model (resolve_quant_activations): a model whose blocks are
# mostly Q4_0 or Q4_1 keeps the per-format rule above; any other model (Q8_0, Q4_K_M, ...) takes
# "int8" for all its blocks. Widening Q8_0 to float32 costs 4 vector instructions per 16 weights
# and leaves a stream level with llama.cpp; int8 runs it 1.1-1.7x as fast at llama.cpp's own
# perplexity (bench/RESULTS.md).
QUANT_ACTIVATIONS = ("auto", "float32", "int8")
AUTO_INT8_TYPES = frozenset({QType.Q4_K, QType.Q5_K, QType.Q6_K})
# The main formats of the models that keep "auto" as the per-format rule.
FLOAT_ACTIVATION_MODEL_TYPES = frozenset({QType.Q4_0, QType.Q4_1})


def resolve_quant_activations(mode: str, block_bytes: Mapping[int, int]) -> str:
    """The mode a model is served in whose quantized matrices hold `block_bytes` (bytes per ggml
    type id): `mode` itself unless it is "auto"; for "auto", "int8" when the type holding most
    bytes is not Q4_0 or Q4_1, else "auto" (the per-format rule). A model without blocks keeps
    `mode` (nothing reads it)."""
    check_choice("quant_activations", mode, QUANT_ACTIVATIONS)
    if mode != "auto" or not block_bytes:
        return mode
    main = max(block_bytes, key=lambda t: (block_bytes[t], int(t)))
    return "auto" if int(main) in FLOAT_ACTIVATION_MODEL_TYPES else "int8"


def int8_activations(quant_activations: str, qtype: int) -> bool:
    """Whether the CPU products of `qtype` blocks take int8 activations under `quant_activations`
    (one of QUANT_ACTIVATIONS). The choice depends on the format only, never on the tokens in a
    call, so a row's outputs stay independent of its batch-mates."""
    if quant_activations == "auto":
        return int(qtype) in AUTO_INT8_TYPES
    return quant_activations == "int8"


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    qtype: QType
    block_size: int        # values per block
    bytes_per_block: int

    def row_bytes(self, k: int) -> int:
        """Bytes of one row of k values; ValueError unless k is a multiple of the block size."""
        if k <= 0 or k % self.block_size:
            raise ValueError(f"{self.qtype.name} rows hold a multiple of {self.block_size} values, got {k}")
        return k // self.block_size * self.bytes_per_block


FORMATS: dict[QType, BlockFormat] = {f.qtype: f for f in (
    BlockFormat(QType.Q8_0, 32, 34),
    BlockFormat(QType.Q4_0, 32, 18),
    BlockFormat(QType.Q4_1, 32, 20),
    BlockFormat(QType.Q5_0, 32, 22),
    BlockFormat(QType.Q5_1, 32, 24),
    BlockFormat(QType.Q4_K, 256, 144),
    BlockFormat(QType.Q5_K, 256, 176),
    BlockFormat(QType.Q6_K, 256, 210),
)}


def block_format(qtype: int) -> BlockFormat:
    """The BlockFormat of ggml type id `qtype`; ValueError for one that is not a fast format."""
    try:
        return FORMATS[QType(int(qtype))]
    except ValueError:
        names = ", ".join(f"{q.name} ({int(q)})" for q in FORMATS)
        raise ValueError(f"ggml type {qtype!r} is not a served block format; served: {names}") from None


def dequantize(data: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """uint8 [N, row_bytes] blocks -> float32 [N, k]."""
    fmt = block_format(qtype)
    if data.dtype != torch.uint8 or data.dim() != 2:
        raise ValueError(f"quantized data must be uint8 [N, row_bytes], got {data.dtype} {tuple(data.shape)}")
    if data.shape[1] != fmt.row_bytes(k):
        raise ValueError(f"{fmt.qtype.name} rows of {k} values take {fmt.row_bytes(k)} bytes, "
                         f"got {data.shape[1]}")
    n = data.shape[0]
    blocks = data.reshape(n, k // fmt.block_size, fmt.bytes_per_block)
    values = _DEQUANTIZE[fmt.qtype](blocks)               # [N, blocks, block_size]
    return values.reshape(n, k)


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 little-endian float16 -> [...] float32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """[..., 16] packed bytes -> [..., 32]: the low nibbles, then the high ones."""
    return torch.cat([q & 0x0F, q >> 4], dim=-1)


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[..., 0:2]).unsqueeze(-1)
    q = b[..., 2:34].contiguous().view(torch.int8).float()
    return d * q


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[..., 0:2]).unsqueeze(-1)
    q = _nibbles(b[..., 2:18]).float() - 8.0
    return d * q


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[..., 0:2]).unsqueeze(-1)
    m = _f16(b[..., 2:4]).unsqueeze(-1)
    q = _nibbles(b[..., 4:20]).float()
    return d * q + m


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """[..., 4] little-endian uint32 -> [..., 32]: bit j of the word as value j's bit 4 (0 or 16)."""
    bits = (qh.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1   # [..., 4 bytes, 8 bits]
    return bits.reshape(*qh.shape[:-1], 32) << 4


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[..., 0:2]).unsqueeze(-1)
    q = (_nibbles(b[..., 6:22]) | _high_bits(b[..., 2:6])).float() - 16.0
    return d * q


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    d = _f16(b[..., 0:2]).unsqueeze(-1)
    m = _f16(b[..., 2:4]).unsqueeze(-1)
    q = (_nibbles(b[..., 8:24]) | _high_bits(b[..., 4:8])).float()
    return d * q + m


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., 12] packed 6-bit scales and mins -> (sc [..., 8], mn [..., 8]) (get_scale_min_k4)."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], dim=-1)
    mn = torch.cat([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], dim=-1)
    return sc, mn


def _k_quant(b: torch.Tensor, qs: torch.Tensor, high: torch.Tensor | int) -> torch.Tensor:
    """Q4_K's (Q5_K's) super-blocks: d, dmin and the packed scales of b, the nibbles qs
    ([..., 128]) and the codes' bit 4 `high` ([..., 8, 32], or 0) -> [..., 256]."""
    lead = b.shape[:-1]
    d = _f16(b[..., 0:2]).unsqueeze(-1)                   # [..., 1]
    dmin = _f16(b[..., 2:4]).unsqueeze(-1)
    sc, mn = _k4_scales(b[..., 4:16])                     # [..., 8]
    scale = (d * sc.float()).unsqueeze(-1)                # [..., 8, 1]
    offset = (dmin * mn.float()).unsqueeze(-1)
    q = qs.reshape(*lead, 4, 32)                          # 4 chunks of 32 bytes, 2 sub-blocks each
    q = torch.stack([q & 0x0F, q >> 4], dim=-2)           # [..., 4, 2, 32]
    q = (q.reshape(*lead, 8, 32) | high).float()
    return (scale * q - offset).reshape(*lead, 256)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_quant(b, b[..., 16:144], 0)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    qh = b[..., 16:48].unsqueeze(-2)                      # [..., 1, 32]
    high = ((qh >> torch.arange(8, dtype=torch.uint8).reshape(8, 1)) & 1) << 4   # [..., 8, 32]: sub-block s's bit s
    return _k_quant(b, b[..., 48:176], high)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    lead = b.shape[:-1]
    ql = b[..., 0:128].reshape(*lead, 2, 2, 32)           # [half, ql[l] / ql[l+32], l]
    qh = b[..., 128:192].reshape(*lead, 2, 1, 32)         # [half, -, l]
    sc = b[..., 192:208].contiguous().view(torch.int8).float().reshape(*lead, 2, 8)
    d = _f16(b[..., 208:210]).reshape(*lead, 1, 1)
    low = torch.stack([ql & 0x0F, ql >> 4], dim=-3)       # [half, nibble, ql half, l]
    shifts = torch.tensor([[0, 2], [4, 6]], dtype=torch.uint8).reshape(2, 2, 1)  # [nibble, ql half]
    high = (qh.unsqueeze(-3) >> shifts) & 3               # [half, nibble, ql half, l]
    q = (low | (high << 4)).float() - 32.0                # value index 32*(2*nibble + ql half) + l
    q = q.reshape(*lead, 2, 8, 16)                        # 16-value sub-blocks, in order
    scale = (d * sc).unsqueeze(-1)                        # [half, 8, 1]
    return (scale * q).reshape(*lead, 256)


_DEQUANTIZE = {
    QType.Q8_0: _q8_0,
    QType.Q4_0: _q4_0,
    QType.Q4_1: _q4_1,
    QType.Q5_0: _q5_0,
    QType.Q5_1: _q5_1,
    QType.Q4_K: _q4_k,
    QType.Q5_K: _q5_k,
    QType.Q6_K: _q6_k,
}
