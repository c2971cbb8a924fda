"""ForwardBatch: the flat inputs of one iteration (selective batching, no padding).

Every scheduled request contributes its new tokens to one flat token list; the model runs all
non-attention operations on the flat [T, hidden] tensor, and the ragged attention kernel uses the
per-request index tensors (q_start/q_len/kv_start/kv_len) to keep requests apart.

All index data is built with plain Python lists on the CPU and moved to the device in two
transfers (one int64 block, one int32 block), because a handful of small host->device copies per
iteration is far cheaper than per-request tensor ops.
"""
from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch


def is_decode(num_new_tokens: int, start_pos: int) -> bool:
    """One new token over a cached context is a decode; every other input is prefill (a whole
    prompt, or a chunk of one)."""
    return num_new_tokens == 1 and start_pos > 0


def count_tokens(requests: Sequence[tuple[Sequence[int], int, int]]) -> tuple[int, int]:
    """(num_prefill_tokens, num_decode_tokens) of `(new_token_ids, start_pos, slab_start)` inputs."""
    n_prefill = n_decode = 0
    for new_ids, start_pos, _ in requests:
        if is_decode(len(new_ids), start_pos):
            n_decode += 1
        else:
            n_prefill += len(new_ids)
    return n_prefill, n_decode


@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    token_ids: torch.Tensor      # [T] int64: new tokens of all requests, request after request
    positions: torch.Tensor      # [T] int64: position of each token inside its request
    slots: torch.Tensor          # [T] int64: KV slot of each token (= slab_start + position)
    q_start: torch.Tensor        # [B] int32: first row of request b in the flat tokens
    q_len: torch.Tensor          # [B] int32: number of new tokens of request b
    kv_start: torch.Tensor       # [B] int32: first KV slot of request b (its slab start)
    kv_len: torch.Tensor         # [B] int32: context length of request b after this iteration
    logits_index: torch.Tensor   # [R] int64: flat rows whose logits the forward returns (see logit_rows)
    num_prefill_tokens: int      # see count_tokens: tokens that are not one-token decodes
    num_decode_tokens: int       # requests decoding one token over a cached context
    max_position: int            # largest position in the batch (checked against the rope tables)
    max_slot: int                # largest KV slot written (checked against the pool size)
    max_token_id: int            # largest token id (checked against the vocabulary)
    # Logits rows per request: its last n tokens' (R = sum). None: one each, its last token's
    # (R = B), which is every batch whose requests want no prompt logprobs.
    logit_rows: Optional[tuple[int, ...]] = None

    @property
    def batch_size(self) -> int:
        return self.q_start.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @classmethod
    def build(cls, requests: Sequence[tuple[Sequence[int], int, int]],
              device: torch.device | str = "cpu",
              logit_rows: Optional[Sequence[int]] = None) -> "ForwardBatch":
        """requests: one `(new_token_ids, start_pos, slab_start)` per request.

        start_pos is the number of the request's tokens already in the KV cache; its new tokens
        take positions start_pos, start_pos+1, ... and slots slab_start + position.
        logit_rows: per request, how many of its last tokens' logits the forward returns (1 to
        its number of new tokens); None gives one each.
        """
        if logit_rows is not None:
            logit_rows = tuple(int(n) for n in logit_rows)
            if len(logit_rows) != len(requests):
                raise ValueError(f"ForwardBatch.build: {len(logit_rows)} logit_rows for {len(requests)} requests")
            if all(n == 1 for n in logit_rows):
                logit_rows = None
        if not requests:
            raise ValueError("ForwardBatch.build: requests is empty; a batch needs at least one request")
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_start: list[int] = []
        q_len: list[int] = []
        kv_start: list[int] = []
        kv_len: list[int] = []
        logits_index: list[int] = []
        max_position = max_slot = 0
        for i, (new_ids, start_pos, slab_start) in enumerate(requests):
            n = len(new_ids)
            if n == 0:
                raise ValueError(f"ForwardBatch.build: request {i} has no new tokens (need >= 1)")
            if start_pos < 0 or slab_start < 0:
                raise ValueError(f"ForwardBatch.build: request {i} has start_pos={start_pos}, "
                                 f"slab_start={slab_start}; both must be >= 0")
            end = start_pos + n
            q_start.append(len(tokens))
            tokens.extend(new_ids)
            positions.extend(range(start_pos, end))
            slots.extend(range(slab_start + start_pos, slab_start + end))
            q_len.append(n)
            kv_start.append(slab_start)
            kv_len.append(end)
            if logit_rows is None:
                logits_index.append(len(tokens) - 1)
            else:
                if not 1 <= logit_rows[i] <= n:
                    raise ValueError(f"ForwardBatch.build: request {i} asks for {logit_rows[i]} logits rows "
                                     f"of its {n} new tokens")
                logits_index.extend(range(len(tokens) - logit_rows[i], len(tokens)))
            max_position = max(max_position, end - 1)
            max_slot = max(max_slot, slab_start + end - 1)

        t, b, r = len(tokens), len(q_start), len(logits_index)
        n_prefill, n_decode = count_tokens(requests)
        if min(tokens) < 0:
            raise ValueError(f"ForwardBatch.build: token id {min(tokens)} is negative")
        device = torch.device(device)
        pin = device.type == "cuda"
        # One int64 block [tokens | positions | slots | logits_index], one int32 block
        # [q_start | q_len | kv_start | kv_len]; the fields are contiguous views into them.
        long_host = torch.tensor(tokens + positions + slots + logits_index, dtype=torch.int64)
        int_host = torch.tensor(q_start + q_len + kv_start + kv_len, dtype=torch.int32)
        if pin:
            long_host, int_host = long_host.pin_memory(), int_host.pin_memory()
        long_dev = long_host.to(device, non_blocking=True)
        int_dev = int_host.to(device, non_blocking=True)
        return cls(
            token_ids=long_dev[0:t], positions=long_dev[t:2 * t], slots=long_dev[2 * t:3 * t],
            logits_index=long_dev[3 * t:3 * t + r], logit_rows=logit_rows,
            q_start=int_dev[0:b], q_len=int_dev[b:2 * b], kv_start=int_dev[2 * b:3 * b],
            kv_len=int_dev[3 * b:4 * b],
            num_prefill_tokens=n_prefill, num_decode_tokens=n_decode,
            max_position=max_position, max_slot=max_slot, max_token_id=max(tokens),
        )
