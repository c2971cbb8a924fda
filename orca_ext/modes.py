"""Process-wide kernel modes: set once per process (a Server, or a parallel worker at start-up)
and read by the ops and the model's forward, instead of flags threaded through every layer.

    batch_invariant      a request's outputs do not depend on its batch-mates (docs/DESIGN.md
                         section 6): every op takes its one T-independent code path
    fused_rope_on_cpu    CPU layers without a q/k norm run rope and the KV write as one kernel
                         (bit-identical to the two steps; benchmarks compare the two)
    huge_pages           CPU weights and KV pools live in transparent huge pages (Linux)
    quant_activations    what the CPU products of quantized weights multiply: "float32"
                         activations, "int8" (each activation row rounded per 32-block, per
                         256-block for Q4_K/Q5_K/Q6_K, with integer dot products, as llama.cpp does),
                         or "auto" (int8 for Q4_K/Q5_K/Q6_K, float32 for Q8_0/Q4_0/Q4_1/Q5_0/Q5_1); a
                         Server resolves EngineConfig's "auto" per model first (int8 unless
                         its blocks are mostly Q4_0/Q4_1: resolve_quant_activations);
                         quant/formats.py, docs/DESIGN.md section 4. CUDA is unaffected

The defaults here are the kernels' plainest arithmetic; a Server sets the modes from its
EngineConfig, whose defaults differ (batch invariance on CPUs, quant_activations="auto").

`set_modes` replaces the process's modes; `using(**changes)` overrides some of them for a block
(benchmarks and tests that compare both settings in one process) and restores them after.
A forward reads the modes when it starts, so change them only between forwards.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import Iterator

from .checks import check_choice
from .quant.formats import QUANT_ACTIVATIONS

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Modes:
    batch_invariant: bool = False
    fused_rope_on_cpu: bool = True
    huge_pages: bool = True
    quant_activations: str = "float32"

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "quant_activations":
                check_choice(field.name, value, QUANT_ACTIVATIONS)
            elif not isinstance(value, bool):
                raise ValueError(f"{field.name} must be True or False, got {value!r}")


_lock = threading.Lock()
_current = Modes()


def current() -> Modes:
    """The modes in force in this process."""
    return _current


def set_modes(modes: Modes) -> None:
    """Replace the process's modes (a Server or a worker, once, before its first forward)."""
    global _current
    if not isinstance(modes, Modes):
        raise TypeError(f"modes must be a Modes, got {type(modes).__name__}")
    with _lock:
        if modes != _current:
            log.debug("kernel modes: %s", modes)
        _current = modes


def update(**changes) -> Modes:
    """set_modes(current() with `changes`); returns the new modes."""
    modes = dataclasses.replace(current(), **changes)
    set_modes(modes)
    return modes


@contextlib.contextmanager
def using(**changes) -> Iterator[Modes]:
    """Override some modes for the duration of a block, then restore the previous ones."""
    previous = current()
    try:
        yield update(**changes)
    finally:
        set_modes(previous)
