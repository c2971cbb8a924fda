"""The work of one iteration, independent of any model: what the cost models price."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Work:
    rows: int            # requests in the batch
    emitting: int        # rows that sample a token (all but non-final prompt chunks)
    new_tokens: int      # tokens through the projections (prefill chunks + 1 per decode)
    attended: int        # sum over new tokens of the keys each attends to (attention FLOPs)
    context: int         # sum over rows of the keys read from the KV cache (attention bytes)

    @classmethod
    def of(cls, rows: Sequence[tuple[int, int, bool]]) -> "Work":
        """From [(new tokens n, start position s, emits a token)]: token s+i attends to s+i+1 keys."""
        return cls(rows=len(rows), emitting=sum(1 for _, _, e in rows if e),
                   new_tokens=sum(n for n, _, _ in rows),
                   attended=sum(n * s + n * (n + 1) // 2 for n, s, _ in rows),
                   context=sum(s + n for n, s, _ in rows))
