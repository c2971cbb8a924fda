"""CUDA graphs for decode iterations: captured once per batch-size bucket, replayed with new indices.

A decode iteration launches about fifteen kernels per layer, and at batch 256 enqueueing them
costs the host more time than the GPU needs to run them. Every per-request value of an iteration
lives in the device tensors of its ForwardBatch, and the kernels take only sizes from the host, so
a forward captured once for a batch size replays for any requests of that size once their values
are copied into the captured input buffers:

    bucket  = smallest of DECODE_BUCKETS >= B      (decode-only iterations; the rest run eagerly)
    inputs rows [0, B)       <- the batch's tokens, positions, slots, kv_start, kv_len
    inputs rows [B, bucket)  <- padding: token 0 at position 0 in the scratch slot, a context of 1
    replay graph[bucket];  logits = captured logits[:B]

The scratch slot is one KV slot past the caller's n_slots. Padding rows write and read only that
slot, so they never touch a request's cache, and their logits are dropped. Mixed and prefill
iterations, and batches above the largest bucket, run the model eagerly.

A graph holds the kernels of the kernel modes (orca_ext/modes.py) in force when it was captured,
e.g. the batch-invariant or the default matmuls. The runner replays only while those modes are
still the process's; after a change every iteration runs eagerly (logged once), so no forward
runs in modes other than the current ones. A Server sets its modes before it captures.

`DecodeGraphRunner` wraps a CausalLM and implements the model seam (docs/INTERNALS.md), so the
engine drives it like the model itself; `with_decode_graphs` decides whether to wrap.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Optional, Protocol, Sequence

import torch

from . import modes
from .models.batch import ForwardBatch
from .models.causal_lm import CausalLM

log = logging.getLogger(__name__)

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# A captured forward: (replay, logits). replay() re-runs the capture on the current contents of the
# input buffers and leaves the result in `logits`, the tensor the capture returned.
Captured = tuple[Callable[[], None], torch.Tensor]


def bucket_for(batch_size: int, buckets: Sequence[int] = DECODE_BUCKETS) -> Optional[int]:
    """The smallest bucket that holds `batch_size` rows, or None when none does."""
    fitting = [b for b in buckets if b >= batch_size]
    return min(fitting) if fitting and batch_size >= 1 else None


def is_decode_only(batch: ForwardBatch) -> bool:
    """Every request adds one token over a cached context (so row i is request i)."""
    return batch.num_prefill_tokens == 0 and batch.num_tokens == batch.batch_size


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> Captured: ...


class CudaGraphBackend:
    """torch.cuda.CUDAGraph capture; all graphs share one memory pool (they never run at once)."""

    def __init__(self, device: torch.device, warmup: int = 2):
        self.device = torch.device(device)
        self.warmup = warmup
        self.pool = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> Captured:
        with torch.cuda.device(self.device):
            # Warm-up outside the capture (torch's recipe): allocator blocks, cuBLAS handles and
            # workspaces and the kernels' one-time attribute setup all happen here, not in the graph.
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(self.warmup):
                    fn()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread's CUDA calls (another server in the process) cannot
            # invalidate this capture.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                logits = fn()
            if self.pool is None:
                self.pool = graph.pool()
        return graph.replay, logits


class EagerReplayBackend:
    """A stand-in for CUDA graphs: replay re-runs the captured forward on the current contents of
    the input buffers, in the kernel modes of the capture, and writes into the captured output,
    which is the contract of a graph replay. Exercises everything around the graph on any device
    (the CPU tests, the benchmark's dry run); saves no host time."""

    def __init__(self):
        self.captured: list[int] = []  # rows of each capture, in capture order
        self.replays = 0

    def capture(self, fn: Callable[[], torch.Tensor]) -> Captured:
        captured_modes = modes.current()
        logits = fn()
        self.captured.append(logits.shape[0])

        def replay() -> None:
            self.replays += 1
            with modes.using(**dataclasses.asdict(captured_modes)):  # as a graph's recorded kernels
                logits.copy_(fn())

        return replay, logits


def _rows(fields: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """The [len(fields), n] view over 1-D fields that lie back to back in one block (as
    ForwardBatch.build lays them out), or None: then they are copied one by one."""
    first = fields[0]
    n = first.numel()
    step = n * first.element_size()
    for i, f in enumerate(fields):
        if (f.dim() != 1 or f.numel() != n or f.dtype != first.dtype or f.device != first.device
                or not f.is_contiguous() or f.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
                or f.data_ptr() != first.data_ptr() + i * step):
            return None
    return first.as_strided((len(fields), n), (n, 1))


class DecodeInputs:
    """The input buffers every bucket's graph reads, shared by all buckets, and their padding.

    long rows: token_ids, positions, slots, logits_index; int rows: q_start, q_len, kv_start,
    kv_len (the dtypes of ForwardBatch). A decode batch changes only token_ids, positions, slots,
    kv_start and kv_len; q_start = logits_index = row and q_len = 1 hold for every decode row, and
    for the padding rows too.
    """

    LONG_COPIED = 3   # token_ids, positions, slots
    INT_COPIED = (2, 4)  # kv_start, kv_len

    def __init__(self, max_rows: int, scratch_slot: int, device: torch.device):
        rows = torch.arange(max_rows, dtype=torch.int64)
        zeros = torch.zeros(max_rows, dtype=torch.int64)
        scratch = torch.full((max_rows,), scratch_slot, dtype=torch.int64)
        # What a padding row holds: token 0 at position 0 in the scratch slot, a context of one.
        self.pad_long = torch.stack([zeros, zeros, scratch, rows]).to(device)
        self.pad_int = torch.stack([rows, zeros + 1, scratch, zeros + 1]).to(torch.int32).to(device)
        self.long = self.pad_long.clone()
        self.int = self.pad_int.clone()
        self.max_rows = max_rows
        self.scratch_slot = scratch_slot
        self.real_rows = 0  # rows [0, real_rows) may hold a batch's values; the rest hold padding

    def batch(self, rows: int) -> ForwardBatch:
        """The ForwardBatch a bucket of `rows` rows is captured with: views into the buffers."""
        lg, it = self.long[:, :rows], self.int[:, :rows]
        return ForwardBatch(token_ids=lg[0], positions=lg[1], slots=lg[2], logits_index=lg[3],
                            q_start=it[0], q_len=it[1], kv_start=it[2], kv_len=it[3],
                            num_prefill_tokens=0, num_decode_tokens=rows, max_position=0,
                            max_slot=self.scratch_slot, max_token_id=0)

    def load(self, batch: ForwardBatch) -> None:
        """Copy a decode batch into rows [0, B) and restore the padding of rows the previous
        batch used beyond B (a stale row would write a request's slot)."""
        b = batch.batch_size
        lo, hi = self.INT_COPIED
        long_src = _rows([batch.token_ids, batch.positions, batch.slots])
        int_src = _rows([batch.kv_start, batch.kv_len])
        if long_src is not None:
            self.long[:self.LONG_COPIED, :b].copy_(long_src, non_blocking=True)
        else:
            for row, src in enumerate((batch.token_ids, batch.positions, batch.slots)):
                self.long[row, :b].copy_(src, non_blocking=True)
        if int_src is not None:
            self.int[lo:hi, :b].copy_(int_src, non_blocking=True)
        else:
            for row, src in zip(range(lo, hi), (batch.kv_start, batch.kv_len)):
                self.int[row, :b].copy_(src, non_blocking=True)
        if self.real_rows > b:
            stale = slice(b, self.real_rows)
            self.long[:self.LONG_COPIED, stale].copy_(self.pad_long[:self.LONG_COPIED, stale], non_blocking=True)
            self.int[lo:hi, stale].copy_(self.pad_int[lo:hi, stale], non_blocking=True)
        self.real_rows = b


class DecodeGraphRunner:
    """A CausalLM behind the model seam whose decode iterations replay CUDA graphs.

    Graphs are captured by allocate_kv_cache (they hold the KV pools' addresses), for every bucket
    up to the one that holds max_batch_size, in the kernel modes then in force (`capture_modes`);
    they replay only while the process's modes equal those. Logits returned by a replay are a
    view of the graph's output: valid until the next forward, which is all the engine needs (it
    samples at once). A capture that fails is logged and leaves every iteration eager: graphs are
    an optimisation.
    """

    def __init__(self, model: CausalLM, max_batch_size: int, *, buckets: Sequence[int] = DECODE_BUCKETS,
                 backend: Optional[GraphBackend] = None):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if not buckets or min(buckets) < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {tuple(buckets)}")
        self.model = model
        top = bucket_for(max_batch_size, buckets) or max(buckets)
        self.buckets = tuple(sorted(b for b in set(buckets) if b <= top))
        self.backend = backend if backend is not None else CudaGraphBackend(model.device)
        self.graphs: dict[int, Captured] = {}
        self.capture_modes: Optional[modes.Modes] = None  # the modes the graphs hold the kernels of
        self._stale_modes_logged: Optional[modes.Modes] = None
        self.inputs: Optional[DecodeInputs] = None
        self.n_slots = 0
        self.replayed_iterations = 0
        self.eager_iterations = 0

    # -- the model seam ---------------------------------------------------------------------------
    @property
    def spec(self):
        return self.model.spec

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def kv_bytes_per_slot(self) -> int:
        return self.model.kv_bytes_per_slot()

    @property
    def kv_pools(self):
        """The model's pools (slab compaction moves rows in place, so the captured graphs, which
        hold their addresses, stay valid; the scratch slot past n_slots never moves)."""
        return self.model.kv_pools

    def allocate_kv_cache(self, n_slots: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Pools of n_slots + 1 slots (the last is the padding rows' scratch), then one capture
        per bucket. Returns the caller's [n_slots, Hkv, D] views of the pools."""
        if n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, got {n_slots}")
        self.graphs = {}  # they refer to the old pools
        k_pools, v_pools = self.model.allocate_kv_cache(n_slots + 1)
        self.n_slots = n_slots
        with torch.inference_mode():
            self.inputs = DecodeInputs(max(self.buckets), scratch_slot=n_slots, device=self.device)
            self.capture_modes = modes.current()
            self._stale_modes_logged = None
            self._capture_all()
        return [k[:n_slots] for k in k_pools], [v[:n_slots] for v in v_pools]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """One iteration -> [B, vocab] float32 logits: a graph replay for a decode batch that fits a
        captured bucket while the kernel modes are those of the capture, the model's own forward
        otherwise."""
        if batch.max_slot >= self.n_slots:
            raise ValueError(f"batch writes KV slot {batch.max_slot} but the cache has n_slots={self.n_slots}")
        bucket = bucket_for(batch.batch_size, self.buckets) if is_decode_only(batch) else None
        captured = self.graphs.get(bucket) if bucket is not None else None
        if captured is not None and not self._modes_unchanged():
            captured = None
        if captured is None:
            self.eager_iterations += 1
            return self.model.forward(batch)
        self.model._check(batch)  # positions and token ids, before any of them reaches the device
        replay, logits = captured
        self.inputs.load(batch)
        replay()
        self.replayed_iterations += 1
        return logits[:batch.batch_size]

    __call__ = forward

    def __repr__(self) -> str:
        return f"DecodeGraphRunner({self.model!r}, buckets={list(self.graphs) or 'none captured'})"

    def _modes_unchanged(self) -> bool:
        """Whether the process's kernel modes are still those the graphs were captured in; if not,
        logs it once per new set of modes (the graphs would run the other modes' kernels)."""
        now = modes.current()
        if now == self.capture_modes:
            return True
        if now != self._stale_modes_logged:
            log.warning("kernel modes changed since the decode graphs were captured (%s, now %s); "
                        "decode iterations run eagerly until they are back", self.capture_modes, now)
            self._stale_modes_logged = now
        return False

    # -- capture ------------------------------------------------------------------------------------
    def _capture_all(self) -> None:
        # Largest first: the smaller graphs then fit in the memory the largest one reserved.
        for bucket in sorted(self.buckets, reverse=True):
            try:
                self.graphs[bucket] = self.backend.capture(self._forward_fn(bucket))
            except Exception:
                log.exception("capturing the decode graph of batch size %d failed; every iteration "
                              "runs eagerly", bucket)
                self.graphs = {}
                return
        log.info("captured decode graphs for batch sizes %s", sorted(self.graphs))

    def _forward_fn(self, bucket: int) -> Callable[[], torch.Tensor]:
        batch = self.inputs.batch(bucket)  # padding rows only while capturing: the scratch slot
        return lambda: self.model.forward(batch)


def with_decode_graphs(model, max_batch_size: int, *, enforce_eager: bool = False):
    """The model the engine should drive: a DecodeGraphRunner around a CausalLM on CUDA, unless
    enforce_eager; any other model as it is."""
    if enforce_eager or not isinstance(model, CausalLM) or torch.device(model.device).type != "cuda":
        return model
    return DecodeGraphRunner(model, max_batch_size)
