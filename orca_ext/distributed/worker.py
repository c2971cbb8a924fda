"""A worker process: the weights and KV pools of one pipeline stage's share for one tensor rank.

Start-up (every worker, whether torch.multiprocessing or torchrun started it):
    config    <- the store (JSON the driver wrote: model path, ModelSpec, dtype, tp, pp, ...)
    control group (gloo, with the driver), data group (gloo on CPU, NCCL on CUDA; workers only),
    one tensor-parallel subgroup per stage
    load this worker's shard, report its KV capacity -> store; n_slots <- store; allocate pools

Start-up also applies the driver's kernel modes (modes.py) to this process, before the weights
are loaded (huge pages decide where they go).

Loop, one control message at a time, in the order the driver sent them (messages.py):
    forward:  header <- driver; payload <- driver (ForwardBatch inputs + sampling rows)
              x = previous stage's activations (recv), unless the first stage
              x = model.forward(batch, x)          (tensor-parallel all-reduces inside)
              not last stage: isend x to the next stage (never waits for the next stage to take it)
              last stage, tensor rank 0: sample, send the token ids to the driver
    move:     ops.slab_move on this worker's KV pools (slab compaction, with no batch in
              flight; prefix cache copies, into a slab no batch has used yet); every forward
              sent before it has run here, and every later one sees the moved rows
    logits:   a forward whose sampling worker sends the logits instead of tokens (tests)
    stats / stop

A stage starts its next batch as soon as it has handed its activations on, so with n_workers =
pp batches in flight every stage is busy with a different batch. Any exception is reported to
the driver (with the batch it happened in) and the worker exits: its peers' collectives would
otherwise never complete, so the driver treats every failure as fatal for the whole group.

Once started, a thread of its own beats on the store every heartbeat interval (heartbeat.py), so
the driver notices within seconds when this process stops (SIGSTOP) or hangs.

Signals. SIGINT is ignored (Ctrl-C in a terminal reaches the whole process group; the driver
decides how workers stop). A worker that torchrun started ignores SIGTERM too: torchrun's agent
sends SIGTERM to every rank at once, and the driver drains its running requests first, then stops
the workers with OP_STOP. A worker still ends when the driver is gone: a spawned worker watches a
pipe whose write end only the driver holds; every worker's receive from the driver fails when the
driver's connection closes.
"""
from __future__ import annotations

import datetime
import json
import logging
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .. import modes, ops
from ..models.batch import ForwardBatch
from ..models.loader import load_model
from ..models.sharding import make_shard
from ..quant.formats import resolve_quant_activations
from ..sampling import Sampler
from .batch_trace import BatchTrace
from .batch_trace import now as trace_now
from .groups import (NAMESPACE, SendQueue, StageClock, TensorParallelComm, control_group, is_communication_error,
                     loopback_interface, store_client)
from .heartbeat import HeartbeatSender
from .messages import (HEADER_LEN, KIND_BYE, KIND_ERROR, KIND_LOGITS, KIND_RESULT, KIND_STATS, OP_FORWARD,
                       OP_LOGITS, OP_MOVE, OP_STATS, OP_STOP, TAG_DOWN, TAG_UP, header, pack_row_errors,
                       payload_len, spec_from_dict, unpack_forward, unpack_moves)
from .torchrun import TorchrunEnv, torchrun_env, torchrun_store

log = logging.getLogger(__name__)


@dataclass
class WorkerLaunch:
    """How one worker finds the others."""

    worker_rank: int                  # 0-based; control-group rank worker_rank + 1
    num_processes: int                # worker processes in the group (tp x pp)
    device_index: int                 # cuda:device_index when the config says cuda
    store_host: Optional[str] = None  # torch.multiprocessing launch: the driver's TCPStore
    store_port: Optional[int] = None  # (None: a torchrun launch, the store comes from its env)
    parent: object = None             # read end of a pipe whose write end only the driver holds


def spawn_main(launch: WorkerLaunch) -> None:
    """Entry point of a worker started by the driver with torch.multiprocessing (spawn)."""
    _exit(_main(launch))


def torchrun_main() -> None:
    """Entry point of a torchrun process other than rank 0 (which is the driver)."""
    # The agent signals every rank at once; the driver drains first, then stops this worker.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    env = TorchrunEnv()
    # The driver's node runs the driver as local rank 0, so its workers' GPUs start at 0 too.
    device_index = env.local_rank - 1 if env.node_rank == 0 else env.local_rank
    _exit(_main(WorkerLaunch(env.rank - 1, env.world_size - 1, device_index)))


def _exit(code: int) -> None:
    # os._exit: no interpreter teardown, which could block on process-group destructors whose
    # peers are gone.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _watch_parent(conn) -> None:
    """Exit as soon as the driver process is gone, however it ended (even SIGKILL): its end of
    the pipe closes, so recv() sees EOF."""
    try:
        conn.recv()
    except (EOFError, OSError):
        pass
    _exit(1)


def _main(launch: WorkerLaunch) -> int:
    # Ctrl-C in a terminal reaches the whole process group; the driver decides how workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if launch.parent is not None:
        threading.Thread(target=_watch_parent, args=(launch.parent,), name="parent-watch", daemon=True).start()
    if launch.store_host is not None:
        store = dist.TCPStore(launch.store_host, launch.store_port, is_master=False,
                              timeout=datetime.timedelta(seconds=600))
    else:
        store = torchrun_store(datetime.timedelta(seconds=600))
    cfg = json.loads(store.get(NAMESPACE + "config"))
    logging.basicConfig(level=cfg.get("log_level", "WARNING"),
                        format=f"%(asctime)s %(levelname)s worker{launch.worker_rank} %(name)s: %(message)s")
    worker = Worker(cfg, launch, store)
    try:
        worker.start()
    except BaseException as exc:
        log.exception("worker %d failed to start", launch.worker_rank)
        store.set(NAMESPACE + f"error/{launch.worker_rank}", f"{type(exc).__name__}: {exc}")
        return 1
    try:
        worker.loop()
    except BaseException as exc:
        log.exception("worker %d failed in iteration %s", launch.worker_rank, worker.batch_index)
        worker.report_error(exc)
        return 1
    worker.close()
    return 0


class _Row:
    """A batch row as the Sampler sees a request: its params, its generator, and whether this
    worker draws its next token: not for a prompt chunk other than the last, nor for a row the
    driver samples (it has the request's grammar matcher, token history and logprobs settings)."""

    __slots__ = ("params", "generator", "emits_token")
    guided = None  # a guided request is sampled on the driver

    def __init__(self, params, generator):
        self.params = params
        self.generator = generator
        self.emits_token = params.emits_token and not params.on_driver


class Worker:
    def __init__(self, cfg: dict, launch: WorkerLaunch, store):
        self.cfg = cfg
        self.store = store
        self.rank = launch.worker_rank
        self.num_processes = launch.num_processes
        self.tp, self.pp = int(cfg["tp"]), int(cfg["pp"])
        if self.tp * self.pp != self.num_processes:
            raise ValueError(f"{self.num_processes} workers were started for tp={self.tp} x pp={self.pp}")
        self.stage, self.tp_rank = divmod(self.rank, self.tp)
        self.device = (torch.device("cuda", launch.device_index) if cfg["device"] == "cuda"
                       else torch.device("cpu"))
        self.first = self.stage == 0
        self.last = self.stage == self.pp - 1
        self.samples = self.last and self.tp_rank == 0
        self.prev = self.rank - self.tp   # the same tensor rank one stage earlier / later
        self.next = self.rank + self.tp
        self.clock = StageClock(self.device, bool(cfg.get("sync_timing", False)))
        self.sampler = Sampler()
        self.generators: dict[int, torch.Generator] = {}   # seq id -> seeded request's generator
        self.batch_index: Optional[int] = None
        self.ctl = None
        self.model = None
        self.trace = BatchTrace.from_env(self.rank)

    # -- start-up --------------------------------------------------------------------------
    def start(self) -> None:
        cfg = self.cfg
        modes.set_modes(modes.Modes(**cfg["modes"]))  # the driver's, before any weight is placed
        if cfg.get("threads"):
            torch.set_num_threads(int(cfg["threads"]))
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.ctl = control_group(self.store, self.rank + 1, self.num_processes + 1, bool(cfg["loopback"]))
        if cfg["loopback"] and self.device.type == "cpu" and "GLOO_SOCKET_IFNAME" not in os.environ:
            lo = loopback_interface()
            if lo:
                os.environ["GLOO_SOCKET_IFNAME"] = lo
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        timeout = datetime.timedelta(seconds=float(cfg["data_timeout_s"]))
        kwargs = {"device_id": self.device} if backend == "nccl" else {}
        dist.init_process_group(backend, store=dist.PrefixStore(NAMESPACE + "data/", self.store),
                                rank=self.rank, world_size=self.num_processes, timeout=timeout, **kwargs)
        tp_comm = None
        spec = spec_from_dict(cfg["spec"])
        # quant_activations="auto" is decided per model, as the Server decides it for its process.
        modes.update(quant_activations=resolve_quant_activations(modes.current().quant_activations,
                                                                 dict(spec.block_bytes)))
        shard = make_shard(spec, self.tp, self.pp, self.tp_rank, self.stage)
        if self.tp > 1:
            for stage in range(self.pp):  # every worker creates every subgroup, in one order
                ranks = [stage * self.tp + r for r in range(self.tp)]
                group = dist.new_group(ranks)
                if stage == self.stage:
                    tp_comm = TensorParallelComm(group, ranks, self.tp_rank, spec.vocab_size,
                                                 shard.vocab_padded, self.clock)
        self.sends = SendQueue(f"worker{self.rank}-sends", threaded=backend == "gloo")
        self.up = SendQueue(f"worker{self.rank}-up")
        self.model = load_model(cfg["model_path"], self.device, cfg["dtype"], spec=spec, shard=shard,
                                tp_comm=tp_comm, quantization=cfg["quantization"])
        per_slot = self.model.kv_bytes_per_slot()
        budget = int(cfg["kv_cache_memory"]) if cfg.get("kv_cache_memory") else self._default_kv_budget()
        self.store.set(NAMESPACE + f"ready/{self.rank}", json.dumps({
            "pid": os.getpid(), "host": os.uname().nodename, "device": str(self.device),
            "bytes_per_slot": per_slot, "budget": budget, "max_slots": budget // per_slot}))
        n_slots = int(self.store.get(NAMESPACE + "n_slots"))
        self.model.allocate_kv_cache(n_slots)
        self.store.set(NAMESPACE + f"allocated/{self.rank}", "1")
        interval = float(cfg["heartbeat_interval_s"])
        HeartbeatSender(store_client(self.store, 60.0), self.rank, interval).start()
        self.clock.reset()

    def _default_kv_budget(self) -> int:
        from ..resources import default_kv_memory

        budget = default_kv_memory(self.device)
        if self.device.type == "cpu":  # workers on one host share its RAM
            env = torchrun_env()
            if env is not None:  # the driver's node runs the driver as one of its local ranks
                per_host = env.local_world_size - (1 if env.node_rank == 0 else 0)
            else:
                per_host = int(self.cfg.get("workers_per_host", 1))
            budget //= max(1, per_host)
        return budget

    # -- the loop ----------------------------------------------------------------------------
    def loop(self) -> None:
        hdr = torch.empty(HEADER_LEN, dtype=torch.int64)
        while True:
            with self.clock.measure("control_wait"):
                self.ctl.recv([hdr], 0, TAG_DOWN).wait()
            op = int(hdr[0])
            if op == OP_STOP:
                return
            if op == OP_STATS:
                self._send_stats(reset=bool(hdr[1]))
                continue
            if op not in (OP_FORWARD, OP_LOGITS, OP_MOVE):
                raise RuntimeError(f"unknown control op {op}")
            with self.clock.measure("control_recv"):
                payload = torch.empty(payload_len(hdr), dtype=torch.int64)
                self.ctl.recv([payload], 0, TAG_DOWN).wait()
                msg = unpack_moves(hdr, payload) if op == OP_MOVE else unpack_forward(hdr, payload)
            if op == OP_MOVE:
                self._move_slabs(msg)
            else:
                self._forward(msg, logits_only=op == OP_LOGITS)

    def _move_slabs(self, moves: torch.Tensor) -> None:
        """Slab compaction or prefix cache copies: KV rows go where the driver's slabs now are.
        Every batch sent before the move has finished its forward here (messages are handled
        in order), and every later one sees the rows at their new slots."""
        with self.clock.compute():
            try:
                ops.slab_move(self.model.kv_pools, moves)
            except Exception as exc:
                raise RuntimeError(f"moving KV slabs {moves.tolist()[:4]} failed: {type(exc).__name__}: {exc}") from exc

    def _forward(self, msg, logits_only: bool = False) -> None:
        self.batch_index = msg.index
        started = trace_now()
        for seq in msg.free:
            self.generators.pop(seq, None)
        with torch.inference_mode():
            with self.clock.compute():
                fb = ForwardBatch.build(msg.inputs, self.device, msg.logit_rows)
            hidden = None
            if not self.first:
                with self.clock.measure("data_recv"):
                    hidden = torch.empty(fb.num_tokens, self.model.spec.hidden_size, dtype=self.model.dtype,
                                         device=self.device)
                    dist.recv(hidden, src=self.prev)
            with self.clock.compute():
                out = self.model.forward(fb, hidden)
            self.clock.times.iterations += 1
            if not self.last:
                with self.clock.measure("data_send"):
                    self.sends.put(dist.isend(out, dst=self.next), out)
            elif self.samples and logits_only:
                self._send_up(header(KIND_LOGITS, msg.index, *out.shape), out.float().cpu().contiguous())
            elif self.samples:
                with self.clock.measure("sample"):
                    self._sample(msg, out)
        if self.trace is not None:
            self.trace.record(msg.index, started, trace_now())
        self.batch_index = None

    def _sample(self, msg, logits: torch.Tensor) -> None:
        """Draw the plain rows' tokens from logits [R, V] (R = sum of the rows' logit_rows) and
        send them up, with the logits rows of the rows the driver samples."""
        counts = [r.logit_rows for r in msg.rows]
        on_driver = [i for i, r in enumerate(msg.rows) if r.on_driver]
        driver_logits = torch.empty(0, logits.shape[1], dtype=torch.float32)
        if on_driver:
            ends = torch.tensor(counts).cumsum(0)
            picked = torch.cat([torch.arange(int(ends[i]) - counts[i], int(ends[i])) for i in on_driver])
            driver_logits = logits[picked.to(logits.device)].float().cpu().contiguous()
        if len(logits) != len(counts):  # some row returned more than its last row
            logits = logits[(torch.tensor(counts).cumsum(0) - 1).to(logits.device)]
        rows = [_Row(r, self.generators.get(r.seq_id)) for r in msg.rows]
        result = self.sampler(logits, rows)
        for row in rows:
            if row.generator is not None:
                self.generators[row.params.seq_id] = row.generator
        # A row without a token (a non-final prompt chunk, a row the driver samples) sends 0;
        # the driver drops or replaces that token.
        tokens = torch.tensor([-1 if e is not None else (0 if t is None else t)
                               for t, e in zip(result.tokens, result.errors)], dtype=torch.int64)
        errors = pack_row_errors(result.errors)
        self._send_up(header(KIND_RESULT, msg.index, len(rows), errors.numel(), *driver_logits.shape), tokens)
        if errors.numel():
            self._send_up(errors)
        if driver_logits.numel():
            self._send_up(driver_logits)

    def _send_stats(self, reset: bool) -> None:
        values = self.clock.snapshot().to_tensor()
        self._send_up(header(KIND_STATS, values.numel()), values)
        if reset:
            self.clock.reset()

    def _send_up(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            self.up.put(self.ctl.send([t], 0, TAG_UP), t)

    # -- the end -------------------------------------------------------------------------------
    def report_error(self, exc: BaseException) -> None:
        """Tell the driver what failed (best effort: the driver may be gone too)."""
        text = f"{type(exc).__name__}: {exc}"
        if self.ctl is None:
            return
        try:
            data = torch.tensor(list(text.encode("utf-8", "replace")[:4000]), dtype=torch.uint8)
            index = -1 if self.batch_index is None else self.batch_index
            self._send_up(header(KIND_ERROR, index, data.numel(), int(is_communication_error(exc))), data)
            self.up.close(5.0)
        except Exception:
            log.debug("could not report the error to the driver:\n%s", traceback.format_exc())

    def close(self) -> None:
        self.sends.close(30.0)
        self._send_up(header(KIND_BYE))
        self.up.close(30.0)
        dist.destroy_process_group()
