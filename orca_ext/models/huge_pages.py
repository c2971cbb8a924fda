"""CPU weights and KV pools in transparent huge pages (Linux).

A CPU decode step streams every weight byte from memory. With 4 KiB pages each page of weights
costs a TLB miss and a page walk, and the page tables of half a gigabyte of weights are too large
to stay cached between two steps; the same holds for the context rows a decode reads from every
layer's KV pool. Backing both with 2 MiB pages cuts the walks 512-fold: a decode forward of the
default model ran about 7% faster in float32 and in bfloat16 on a 2-core Zen 2
(bench/huge_pages.py; numbers in bench/RESULTS.md).

The kernel only hands out huge pages for memory that asks before it is first touched (THP mode
"madvise", the common default) and for 2 MiB-aligned ranges, so `place` copies a tensor into a
fresh anonymous mapping that is advised first and aligned by hand. Where the system cannot (not
Linux, THP "never"), the advice is a no-op or the tensor is returned as it is; results never change.
The `huge_pages` kernel mode (orca_ext/modes.py) off keeps torch's own allocation (bench/huge_pages.py
compares the two); it applies to tensors placed or pools allocated while it is in force.
"""
from __future__ import annotations

import mmap
from typing import Sequence

import torch

from .. import modes

HUGE_PAGE_BYTES = 2 << 20
_ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only

def supported() -> bool:
    """Whether this platform can advise huge pages (the system may still decline, e.g. with THP
    "never")."""
    return _ADVICE is not None


def active() -> bool:
    """Whether CPU weights and KV pools go into huge-page memory now: the huge_pages mode is on,
    on a platform that supports() it."""
    return modes.current().huge_pages and supported()


def empty(shape: torch.Size | tuple, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor whose memory was advised to use huge pages and
    starts on a 2 MiB boundary. The mapping lives as long as the tensor (and its views)."""
    if _ADVICE is None:
        raise RuntimeError("huge pages can only be advised on Linux")
    shape = torch.Size(shape)
    nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
    # Room to slide the start up to the next 2 MiB boundary; untouched pages cost no memory.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(_ADVICE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds a reference to the mapping
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[start:start + nbytes].view(dtype).view(shape)


def place_all(tensors: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Copies of contiguous CPU tensors packed into one huge-page region, each starting on a
    64-byte boundary (None entries stay None). Packing lets the small matrices of a layer share
    huge pages with the large ones. Returns the tensors themselves when together they are smaller
    than one huge page, any is not on the CPU, or huge pages are not active()."""
    present = [t for t in tensors if t is not None]
    total = sum(_padded(t) for t in present)
    if not active() or total < HUGE_PAGE_BYTES or any(t.device.type != "cpu" for t in present):
        return list(tensors)
    arena = empty((total,), torch.uint8)
    out: list[torch.Tensor | None] = []
    offset = 0
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        n = t.numel() * t.element_size()
        copy = arena[offset:offset + n].view(t.dtype).view(t.shape)
        copy.copy_(t)
        out.append(copy)
        offset += _padded(t)
    return out


def place(t: torch.Tensor) -> torch.Tensor:
    """place_all of one tensor."""
    return place_all([t])[0]


def _padded(t: torch.Tensor) -> int:
    """t's bytes rounded up to a 64-byte multiple (a cache line: vector loads stay aligned)."""
    return (t.numel() * t.element_size() + 63) // 64 * 64
