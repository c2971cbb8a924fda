"""The driver's view of one worker process: where it sits in the tp x pp grid, how to name it in
an error, how it ended, and stopping the processes this driver started."""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass
class WorkerInfo:
    rank: int
    stage: int
    tp_rank: int
    tp: int
    pp: int
    process: object = None            # multiprocessing.Process when this driver started it
    pipe: object = None               # the driver's end of the worker's parent-watch pipe
    pid: Optional[int] = None
    host: Optional[str] = None
    device: Optional[str] = None
    bytes_per_slot: int = 0
    max_slots: int = 0

    @classmethod
    def grid(cls, tp: int, pp: int) -> list["WorkerInfo"]:
        """Worker w is pipeline stage w // tp, tensor rank w % tp."""
        return [cls(w, w // tp, w % tp, tp, pp) for w in range(tp * pp)]

    def name(self) -> str:
        where = f", pid {self.pid}" if self.pid else ""
        if self.host and self.process is None:
            where += f" on {self.host}"
        return (f"worker {self.rank} (pipeline stage {self.stage} of {self.pp}, tensor rank {self.tp_rank} "
                f"of {self.tp}{where})")

    def exit_status(self) -> Optional[str]:
        """How the process this driver started ended ("exited with code 1", "was killed by
        SIGKILL"), or None while it runs or when another launcher started it."""
        p = self.process
        if p is None:
            return None
        p.join(2.0)
        code = p.exitcode
        if code is None:
            return None
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def is_stopped(self) -> bool:
        """True when the process this driver started is stopped (SIGSTOP, a debugger)."""
        if self.process is None or self.pid is None:
            return False
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
        except (OSError, IndexError):
            return False

    def describe(self) -> dict:
        return {"rank": self.rank, "stage": self.stage, "tp_rank": self.tp_rank, "pid": self.pid,
                "host": self.host, "device": self.device,
                "alive": (self.process.is_alive() if self.process is not None else None)}


def terminate_processes(workers: Sequence[WorkerInfo]) -> None:
    """SIGTERM the live worker processes this driver started, SIGKILL those still alive after 3 s."""
    procs = [w.process for w in workers if w.process is not None and w.process.is_alive()]
    for p in procs:
        p.terminate()
    deadline = time.monotonic() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(2.0)
