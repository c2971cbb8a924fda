"""A fake model with the models-seam interface, for engine/server tests that need no weights.

It is not a stub: its "KV cache" really stores each token id at its slot (like slab_write), and
the next token is a hash of the request's whole context read back from its slab (like attention).
So a request only reproduces `fake_reference(prompt)` if the engine passed the right tokens,
positions and slots and no other request ever overwrote its slab.

Failure injection: a context containing `nan_token` yields NaN logits for that row only; a batch
containing `fail_token` raises in forward. `gate` (threading.Event) holds forward until set and
`entered` is set whenever a forward starts, so tests can act while a batch is "running".
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Optional

import torch


@dataclasses.dataclass(frozen=True)
class FakeSpec:
    vocab_size: int = 101
    max_position_embeddings: int = 4096
    eos_token_ids: tuple = ()
    bos_token_id: Optional[int] = None
    architecture: str = "FakeForCausalLM"
    block_bytes: tuple = ()  # no quantized matrices


def fake_next_token(context: list[int], vocab_size: int) -> int:
    """The fake model's greedy next token for a whole context (order and length sensitive)."""
    h = len(context)
    for t in context:
        h = (h * 1_000_003 + t + 7) % 2_147_483_647
    return h % vocab_size


def fake_reference(prompt: list[int], max_tokens: int, vocab_size: int = 101,
                   stop_ids: frozenset = frozenset()) -> list[int]:
    """Greedy continuation of `prompt` run alone (what the engine must reproduce)."""
    ctx, out = list(prompt), []
    for _ in range(max_tokens):
        t = fake_next_token(ctx, vocab_size)
        out.append(t)
        ctx.append(t)
        if t in stop_ids:
            break
    return out


class FakeModel:
    def __init__(self, spec: FakeSpec = FakeSpec(), *, nan_token: Optional[int] = None,
                 fail_token: Optional[int] = None, gate: Optional[threading.Event] = None,
                 spread: float = 4.0):
        self.spec = spec
        self.device = torch.device("cpu")
        self.dtype = torch.float32
        self.nan_token = nan_token
        self.fail_token = fail_token
        self.gate = gate
        self.entered = threading.Event()
        self.spread = spread  # width of the logit bump around the greedy token (sampling tests)
        self.cache: Optional[torch.Tensor] = None
        self.batches: list[list[tuple[int, int, int, int]]] = []  # (kv_start, kv_len, q_len, q_start)

    def kv_bytes_per_slot(self) -> int:
        return 8

    def allocate_kv_cache(self, n_slots: int) -> torch.Tensor:
        self.cache = torch.full((n_slots,), -1, dtype=torch.int64)
        return self.cache

    @property
    def kv_pools(self) -> Optional[torch.Tensor]:
        """The cache as one [1, n_slots, 1] pool, for slab compaction."""
        return None if self.cache is None else self.cache.view(1, -1, 1)

    def forward(self, batch) -> torch.Tensor:
        self.entered.set()
        if self.gate is not None:
            self.gate.wait()
        assert self.cache is not None, "allocate_kv_cache first"
        self.cache[batch.slots] = batch.token_ids  # slab_write
        if self.fail_token is not None and bool((batch.token_ids == self.fail_token).any()):
            raise RuntimeError("injected forward failure")
        v = self.spec.vocab_size
        rows = []
        kv_start, kv_len = batch.kv_start.tolist(), batch.kv_len.tolist()
        self.batches.append(list(zip(kv_start, kv_len, batch.q_len.tolist(), batch.q_start.tolist())))
        ids = torch.arange(v, dtype=torch.float32)
        for s, n in zip(kv_start, kv_len):
            ctx = self.cache[s:s + n].tolist()
            assert -1 not in ctx, "read a KV slot that was never written"
            if self.nan_token is not None and self.nan_token in ctx:
                rows.append(torch.full((v,), float("nan")))
                continue
            # A smooth bump centred on the greedy token: argmax is exact, sampling has some spread.
            centre = fake_next_token(ctx, v)
            dist = torch.minimum((ids - centre).abs(), v - (ids - centre).abs())
            rows.append(-dist / self.spread * 3.0)
        return torch.stack(rows)


class FakeTokenizer:
    """Token id t <-> one character; `bad_token` makes decode raise (detokenizer failure)."""

    def __init__(self, vocab_size: int = 101, bad_token: Optional[int] = None,
                 eos_token_id: Optional[int] = None):
        self.vocab_size = vocab_size
        self.bad_token = bad_token
        self.eos_token_id = eos_token_id
        self.alphabet = [chr(0x41 + i) if i < 26 else chr(0x61 + i - 26) if i < 52 else chr(0x3b1 + i - 52)
                         for i in range(vocab_size)]
        self._index = {c: i for i, c in enumerate(self.alphabet)}

    def encode(self, text: str) -> list[int]:
        return [self._index[c] for c in text]

    def get_vocab(self) -> dict[str, int]:
        return dict(self._index)

    def decode(self, ids, skip_special_tokens: bool = True, **kwargs) -> str:
        if self.bad_token is not None and self.bad_token in ids:
            raise ValueError("injected detokenizer failure")
        return "".join(self.alphabet[i] for i in ids
                       if not (skip_special_tokens and i == self.eos_token_id))
