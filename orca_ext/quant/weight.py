"""Quantized weight matrices: ggml blocks kept as they are, one typed object per matrix.

`QuantizedWeight` is one matrix [n, k] in one block format (formats.py): `data` uint8
[n, row_bytes], row i holding row i's blocks. The ops (orca_ext/ops.py) dispatch on the type, so
a layer's weight is either a float tensor or one of these, and the forward does not change.

`QuantizedStack` is a fused matrix whose parts were stored in different formats: Q4_K_M files
keep attn_v (and some ffn_down) in Q6_K while attn_q and attn_k are Q4_K, so the fused q/k/v
matrix has two formats. Its product is the concatenation of its parts' products, each part run
by its own format's kernel; no bytes are added and no part is dequantized.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import torch

from .formats import QType, block_format, dequantize


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedWeight:
    qtype: QType
    data: torch.Tensor      # uint8 [n, row_bytes]
    n: int                  # output features (rows)
    k: int                  # input features (values per row)

    def __post_init__(self) -> None:
        fmt = block_format(self.qtype)
        object.__setattr__(self, "qtype", fmt.qtype)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != (self.n, fmt.row_bytes(self.k)):
            raise ValueError(f"{fmt.qtype.name} [{self.n}, {self.k}] needs uint8 data "
                             f"[{self.n}, {fmt.row_bytes(self.k)}], got {self.data.dtype} {tuple(self.data.shape)}")
        if not self.data.is_contiguous():
            raise ValueError("quantized data must be contiguous")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def block_size(self) -> int:
        return block_format(self.qtype).block_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float matrix [n, k] these blocks encode (float32 arithmetic, then `dtype`)."""
        return dequantize(self.data, self.qtype, self.k).to(dtype)

    def rows(self, start: int, end: int) -> "QuantizedWeight":
        """Rows [start, end) (a column-parallel shard): whole rows of blocks, no re-encoding."""
        return QuantizedWeight(self.qtype, self.data[start:end].contiguous(), end - start, self.k)

    def columns(self, start: int, end: int) -> "QuantizedWeight":
        """Columns [start, end) (a row-parallel shard); ValueError unless both ends fall on block
        boundaries, where a block would have to be split."""
        fmt = block_format(self.qtype)
        if start % fmt.block_size or end % fmt.block_size or not 0 <= start < end <= self.k:
            raise ValueError(f"columns [{start}, {end}) of a {fmt.qtype.name} matrix with k={self.k} do not "
                             f"fall on its {fmt.block_size}-value block boundaries")
        b0, b1 = start // fmt.block_size * fmt.bytes_per_block, end // fmt.block_size * fmt.bytes_per_block
        return QuantizedWeight(self.qtype, self.data[:, b0:b1].contiguous(), self.n, end - start)

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        return dataclasses.replace(self, data=self.data.to(device))

    def __repr__(self) -> str:
        return f"QuantizedWeight({self.qtype.name}, [{self.n}, {self.k}], {self.nbytes} bytes)"


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedStack:
    """Row blocks of one fused matrix in different formats; every part has the same k."""

    parts: tuple[QuantizedWeight, ...]

    def __post_init__(self) -> None:
        if len(self.parts) < 2:
            raise ValueError("a QuantizedStack has at least two parts")
        ks = {p.k for p in self.parts}
        if len(ks) != 1:
            raise ValueError(f"the parts of a fused matrix must share k, got {sorted(ks)}")

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts], dim=0)

    def to(self, device: torch.device | str) -> "QuantizedStack":
        return QuantizedStack(tuple(p.to(device) for p in self.parts))

    def __repr__(self) -> str:
        return f"QuantizedStack({', '.join(map(repr, self.parts))})"


Quantized = (QuantizedWeight, QuantizedStack)   # isinstance() target of the ops' dispatch


def bytes_by_type(weights: Iterable) -> dict[int, int]:
    """Bytes of blocks per ggml type id over `weights` (anything not quantized counts nothing; a
    matrix listed twice, as a tied embedding is, counts once)."""
    total: dict[int, int] = {}
    seen: set[int] = set()
    for w in weights:
        if id(w) in seen or not isinstance(w, Quantized):
            continue
        seen.add(id(w))
        for part in w.parts if isinstance(w, QuantizedStack) else (w,):
            total[int(part.qtype)] = total.get(int(part.qtype), 0) + part.nbytes
    return total


def stack_rows(parts: list[QuantizedWeight]) -> QuantizedWeight | QuantizedStack:
    """One fused matrix of row blocks: a single QuantizedWeight when all parts share a format
    (their rows concatenated), else a QuantizedStack of runs of equal format."""
    if len({p.k for p in parts}) != 1:
        raise ValueError(f"the parts of a fused matrix must share k, got {sorted({p.k for p in parts})}")
    runs: list[list[QuantizedWeight]] = []
    for p in parts:
        if runs and runs[-1][0].qtype == p.qtype:
            runs[-1].append(p)
        else:
            runs.append([p])
    merged = [r[0] if len(r) == 1 else QuantizedWeight(r[0].qtype, torch.cat([p.data for p in r], dim=0),
                                                       sum(p.n for p in r), r[0].k) for r in runs]
    return merged[0] if len(merged) == 1 else QuantizedStack(tuple(merged))
