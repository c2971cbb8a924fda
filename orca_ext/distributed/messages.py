"""The control-plane messages between the driver and the workers, as torch tensors.

Everything goes through torch.distributed point-to-point send/recv on the gloo control group
(driver = rank 0, worker w = rank w + 1). A message is a fixed-size int64 header of HEADER_LEN
ints (unused ones 0) followed by the payload tensors whose sizes the header gives, all on one tag
per direction, so the messages between one pair arrive in the order they were sent. A worker
handles the driver's messages one at a time in that order.

Driver -> every worker (TAG_DOWN):
    [OP_FORWARD, batch index, T, B, n_free]    one per iteration
        + int64 [T + 10*B + n_free]:
        token ids [T] | q_len [B] | start_pos [B] | slab_start [B]             (the ForwardBatch inputs)
        seq_id [B] | seed [B] | flags [B] | top_k [B] | logit_rows [B] | temperature [B] | top_p [B]
            (sampling; flags: bit 0 the row has a seed, bit 1 the row emits no token (a prompt
            chunk that is not the last), bit 2 the row is sampled on the driver; logit_rows: the
            logits rows the forward returns for the row (ForwardBatch.logit_rows: 1, or every
            token of a prompt chunk for prompt logprobs); floats travel as the bits of a float64,
            seeds as the two's complement of seed mod 2^64)
        free seq ids [n_free]   (finished requests: the sampler may drop their generators)
    [OP_MOVE, M]                               slab compaction (no batch in flight), n > 1 forks
                                               and prefix cache copies (into a slab no batch has
                                               used yet)
        + int64 [M * 3]: rows (src, dst, n) of ops.slab_move, applied to every layer's K and V
          pool before any later message
    [OP_LOGITS, batch index, T, B, 0]          a forward whose sampling worker returns the
        + the payload of OP_FORWARD            float32 logits instead of tokens (tests and
                                               benchmarks compare them with one process)
    [OP_STATS, reset] / [OP_STOP]              no payload

Worker -> driver (TAG_UP):
    [KIND_RESULT, batch index, B, n_err, R, V] + tokens int64 [B] (-1: the row failed; 0 for a
                                                 row that draws nothing here)
        (+ the failed rows' messages, utf-8, NUL-separated, uint8 [n_err], when n_err > 0)
        (+ float32 [R, V] when R > 0: the logits rows of the rows sampled on the driver, in row
           order, each row's logit_rows of them)
        sent by the sampling worker (last stage, tensor rank 0) only
    [KIND_LOGITS, batch index, B, V]           + float32 [B, V] (answer to OP_LOGITS, sampling worker)
    [KIND_ERROR, batch index or -1, n_bytes, is_communication_error] + utf-8 text uint8 [n_bytes]
    [KIND_STATS, n]                            + float64 [n] (WorkerTimes.FIELDS)
    [KIND_BYE]                                 the worker stops after an OP_STOP

Rows sampled on the driver. A request that needs request-side state to be sampled (logprobs,
prompt logprobs, penalties / logit_bias / min_tokens with its token history, a grammar matcher)
is sampled by the driver with the same code as one process (executor.sample_logits); the
sampling worker draws nothing for it and sends its logits rows back instead. Plain rows cost what
they always did: one token id each. The logits part of a KIND_RESULT is bounded by the
iteration: R <= B + (prompt tokens of the chunks of prompt-logprobs requests) <= B + the
scheduler's token budget per iteration (chunked prefill splits longer prompts: the larger of
max_num_batched_tokens and prefill_only_tokens), so at most (max_batch_size + that budget) * V * 4
bytes, and exactly B' * V * 4 bytes for B' such rows when no prompt logprobs are asked for.
Without a token budget a prompt-logprobs request sends its whole prompt's rows in one message, as
one process holds them in one logits tensor.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Optional, Sequence

import torch

from ..sampling import GREEDY_TEMPERATURE

TAG_DOWN = 1
TAG_UP = 2
HEADER_LEN = 8

OP_FORWARD = 1
OP_STATS = 2
OP_STOP = 3
OP_MOVE = 4
OP_LOGITS = 5

KIND_RESULT = 1
KIND_ERROR = 2
KIND_STATS = 3
KIND_BYE = 4
KIND_LOGITS = 5

_U64 = 1 << 64
_FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def header(*values: int) -> torch.Tensor:
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    h[:len(values)] = torch.tensor(values, dtype=torch.int64)
    return h


@dataclasses.dataclass(frozen=True)
class SamplingRow:
    """What the sampling worker needs of one request's SamplingParams."""

    seq_id: int
    seed: Optional[int]
    temperature: float
    top_k: int
    top_p: float
    emits_token: bool = True  # False for a prompt chunk that is not the prompt's last: no draw
    on_driver: bool = False   # the driver samples this row: the worker sends its logits rows back
    logit_rows: int = 1       # logits rows the forward returns for it (ForwardBatch.logit_rows)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE  # the rule of SamplingParams.greedy

    # Not carried to the workers (a request that asks for them is sampled on the driver): the
    # workers' sampler reads them as off.
    @property
    def logprobs(self) -> None:
        return None

    @property
    def controls_logits(self) -> bool:
        return False


def sampling_row(seq_id: int, params, emits_token: bool, vocab_size: int, *, on_driver: bool = False,
                 logit_rows: int = 1) -> SamplingRow:
    """One request's SamplingRow, clamped once, before anything is packed, the way the
    single-process sampler clamps at use, so that any value SamplingParams accepts fits the
    message's int64/float64 fields and samples the same tokens: top_k to the vocabulary (any
    top_k >= vocab keeps every token), the temperature to float32's range, the seed to its
    residue mod 2**64 (the generator's seed). A row sampled on the driver carries neutral values
    (the worker draws nothing for it; the driver reads the request's own params)."""
    if on_driver:
        return SamplingRow(seq_id, None, 0.0, 0, 1.0, bool(emits_token), True, int(logit_rows))
    seed = None if params.seed is None else operator.index(params.seed) % _U64
    top_k = min(operator.index(params.top_k), vocab_size)
    return SamplingRow(seq_id, seed, min(float(params.temperature), _FLOAT32_MAX), top_k, float(params.top_p),
                       bool(emits_token), False, int(logit_rows))


def pack_row_errors(errors: Sequence[Optional[str]]) -> torch.Tensor:
    """The messages of the rows that failed (in row order) as one uint8 tensor."""
    failed = [e for e in errors if e is not None]
    data = "\0".join(failed).encode("utf-8", "replace") if failed else b""
    return torch.tensor(list(data), dtype=torch.uint8)


def unpack_row_errors(data: Optional[torch.Tensor], tokens: Sequence[int]) -> list[Optional[str]]:
    """Per-row error messages (None for rows with a token) from pack_row_errors' bytes."""
    messages = bytes(data.tolist()).decode("utf-8", "replace").split("\0") if data is not None else []
    out: list[Optional[str]] = []
    for t in tokens:
        if t >= 0:
            out.append(None)
        else:
            out.append(messages.pop(0) if messages else "sampling failed on the worker")
    return out


@dataclasses.dataclass(frozen=True)
class ForwardMessage:
    index: int
    inputs: list            # [(new_token_ids, start_pos, slab_start)] as ForwardBatch.build takes them
    rows: list              # [SamplingRow] in batch order
    free: list              # seq ids whose sampling state can be dropped

    @property
    def logit_rows(self) -> Optional[list[int]]:
        """ForwardBatch.build's logit_rows (None: one row each, the last token's)."""
        counts = [r.logit_rows for r in self.rows]
        return None if all(n == 1 for n in counts) else counts


def pack_forward(index: int, inputs: Sequence[tuple], rows: Sequence[SamplingRow],
                 free: Sequence[int], op: int = OP_FORWARD) -> tuple[torch.Tensor, torch.Tensor]:
    """The header and payload of an OP_FORWARD (or, with `op`, an OP_LOGITS) message."""
    if op not in (OP_FORWARD, OP_LOGITS):
        raise ValueError(f"op must be OP_FORWARD or OP_LOGITS, got {op}")
    tokens: list[int] = []
    for ids, _, _ in inputs:
        tokens.extend(ids)
    b = len(inputs)
    ints = [len(ids) for ids, _, _ in inputs] + [p for _, p, _ in inputs] + [s for _, _, s in inputs]
    seeds = []
    for r in rows:
        u = 0 if r.seed is None else r.seed % _U64
        seeds.append(u - _U64 if u >= 1 << 63 else u)
    # One flags int per row: bit 0 the row has a seed, bit 1 it emits no token, bit 2 the driver
    # samples it.
    flags = [int(r.seed is not None) | (0 if r.emits_token else 2) | (4 if r.on_driver else 0) for r in rows]
    ints += [r.seq_id for r in rows] + seeds + flags + [r.top_k for r in rows] + [r.logit_rows for r in rows]
    floats = torch.tensor([r.temperature for r in rows] + [r.top_p for r in rows], dtype=torch.float64)
    payload = torch.cat([torch.tensor(tokens + ints, dtype=torch.int64), floats.view(torch.int64),
                         torch.tensor(list(free), dtype=torch.int64)])
    return header(op, index, len(tokens), b, len(free)), payload


def pack_logits_request(index: int, inputs: Sequence[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    """An OP_LOGITS message: the forward of `inputs`, answered with their last-token logits."""
    rows = [SamplingRow(-1, None, 0.0, 0, 1.0)] * len(inputs)  # not read: nothing is sampled
    return pack_forward(index, inputs, rows, [], op=OP_LOGITS)


def pack_moves(moves: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An OP_MOVE message from an int64 [M, 3] tensor of (src, dst, n) rows."""
    moves = moves.to(torch.int64).contiguous()
    return header(OP_MOVE, moves.shape[0]), moves.view(-1)


def unpack_moves(h: torch.Tensor, payload: torch.Tensor) -> torch.Tensor:
    """OP_MOVE's payload as the int64 [M, 3] tensor ops.slab_move takes."""
    return payload.view(int(h[1]), 3)


def payload_len(h: torch.Tensor) -> int:
    """int64 elements of the payload that follows a driver -> worker header (0: none)."""
    op = int(h[0])
    if op in (OP_FORWARD, OP_LOGITS):
        t, b, n_free = int(h[2]), int(h[3]), int(h[4])
        return t + 10 * b + n_free
    if op == OP_MOVE:
        return 3 * int(h[1])
    return 0


def unpack_forward(h: torch.Tensor, payload: torch.Tensor) -> ForwardMessage:
    t, b, n_free = int(h[2]), int(h[3]), int(h[4])
    tokens = payload[:t].tolist()
    ints = payload[t:t + 8 * b].tolist()
    floats = payload[t + 8 * b:t + 10 * b].view(torch.float64).tolist()
    free = payload[t + 10 * b:t + 10 * b + n_free].tolist()
    q_len, start, slab = ints[:b], ints[b:2 * b], ints[2 * b:3 * b]
    seq, seed, flags, top_k = ints[3 * b:4 * b], ints[4 * b:5 * b], ints[5 * b:6 * b], ints[6 * b:7 * b]
    logit_rows = ints[7 * b:8 * b]
    inputs, rows, pos = [], [], 0
    for i in range(b):
        inputs.append((tokens[pos:pos + q_len[i]], start[i], slab[i]))
        pos += q_len[i]
        rows.append(SamplingRow(seq[i], seed[i] % _U64 if flags[i] & 1 else None, floats[i], top_k[i],
                                floats[b + i], not flags[i] & 2, bool(flags[i] & 4), logit_rows[i]))
    return ForwardMessage(int(h[1]), inputs, rows, free)


@dataclasses.dataclass
class WorkerTimes:
    """Seconds one worker spent in each part of its loop (since start or the last reset)."""

    FIELDS = ("wall", "compute", "control_wait", "control_recv", "data_recv", "data_send",
              "all_reduce", "gather", "sample", "iterations")

    wall: float = 0.0          # seconds covered by these counters
    compute: float = 0.0       # forward pass minus its collectives, plus building the batch
    control_wait: float = 0.0  # idle, waiting for the driver's next header
    control_recv: float = 0.0  # receiving and unpacking the payload after its header
    data_recv: float = 0.0     # waiting for and receiving the previous stage's activations
    data_send: float = 0.0     # handing activations to the next stage (asynchronous send)
    all_reduce: float = 0.0    # tensor-parallel all-reduces (includes waiting for the slowest rank)
    gather: float = 0.0        # vocab-parallel gather of the logits
    sample: float = 0.0        # sampling and returning the tokens (sampling worker only)
    iterations: float = 0.0

    def to_tensor(self) -> torch.Tensor:
        return torch.tensor([getattr(self, f) for f in self.FIELDS], dtype=torch.float64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> "WorkerTimes":
        return cls(**dict(zip(cls.FIELDS, t.tolist())))


def spec_to_dict(spec) -> dict:
    """ModelSpec -> JSON-able dict (the driver parses config.json once; workers need no
    transformers import)."""
    return dataclasses.asdict(spec)


def spec_from_dict(d: dict):
    from ..models.config import ModelSpec, RopeConfig

    d = dict(d)
    d["rope"] = RopeConfig(**d["rope"])
    d["eos_token_ids"] = tuple(d["eos_token_ids"])
    d["block_bytes"] = tuple((int(t), int(n)) for t, n in d.get("block_bytes", ()))
    return ModelSpec(**d)
