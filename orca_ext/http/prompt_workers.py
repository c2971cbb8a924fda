"""The threads that render chat templates and encode prompts for the HTTP layer, shared fairly.

Rendering (pure Python, holding the GIL) and encoding cost CPU in proportion to what a client
sends, so they run neither on the event loop nor on the engine's thread nor under its lock, but on
`threads` threads of their own (default: one per private tokenizer copy of the server's
PromptEncoder, encoding.DEFAULT_POOL_SIZE). asyncio's default executor, which /health and
submits use, never waits behind them.

Each client (its key: client_key in service.py) may run at most `per_client` jobs at a time; its
further jobs wait on the event loop, holding no thread. So one client occupies at most its share
of the threads, and a job of any other client waits for at most one job of each client ahead of
it. A job keeps its client's share until it has really finished, even when its caller has gone.

`nice` lowers the threads' CPU priority (Linux: a thread's nice value is its own). Work that a
client can make expensive at will, such as compiling a grammar, then runs on the cycles the
engine's forward leaves: on a machine whose cores the forward fills, a compile at the default
priority takes its CPU time out of every running request's next token.
"""
from __future__ import annotations

import asyncio
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from ..encoding import DEFAULT_POOL_SIZE

T = TypeVar("T")

DEFAULT_PROMPT_THREADS = DEFAULT_POOL_SIZE
DEFAULT_PROMPT_JOBS_PER_CLIENT = 1
MAX_NICE = 19

logger = logging.getLogger(__name__)


def lower_thread_priority(nice: int) -> None:
    """Raise the calling thread's nice value by `nice` (capped at MAX_NICE). Only where the nice
    value is per thread (Linux); elsewhere setpriority would lower the whole process, engine included."""
    if nice == 0 or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(MAX_NICE, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError as exc:  # a sandbox may forbid it: the threads still work, at normal priority
        logger.warning("could not lower the priority of thread %d: %s", tid, exc)


class _Share:
    """One client's jobs: a semaphore of `per_client`, and how many jobs hold or wait for it."""

    def __init__(self, per_client: int) -> None:
        self.slots = asyncio.Semaphore(per_client)
        self.users = 0


class PromptWorkers:
    def __init__(self, threads: int = DEFAULT_PROMPT_THREADS,
                 per_client: int = DEFAULT_PROMPT_JOBS_PER_CLIENT, *, nice: int = 0,
                 name: str = "orca-prompts") -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"prompt threads must be an integer >= 1 (got {threads!r})")
        if not isinstance(per_client, int) or not 1 <= per_client <= threads:
            raise ValueError(f"prompt jobs per client must be an integer in [1, {threads}] (got {per_client!r})")
        if not isinstance(nice, int) or not 0 <= nice <= MAX_NICE:
            raise ValueError(f"nice must be an integer in [0, {MAX_NICE}] (got {nice!r})")
        self.threads = threads
        self.per_client = per_client
        self.nice = nice
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name,
                                        initializer=lower_thread_priority, initargs=(nice,))
        self._shares: dict[str, _Share] = {}

    @property
    def clients(self) -> int:
        """Clients with a job running or waiting."""
        return len(self._shares)

    async def run(self, client: str, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on a prompt thread, once `client` has fewer than per_client jobs running."""
        share = self._shares.get(client)
        if share is None:
            share = self._shares[client] = _Share(self.per_client)
        share.users += 1
        try:
            await share.slots.acquire()
        except BaseException:
            self._leave(client, share)
            raise
        try:
            job = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except BaseException:
            share.slots.release()
            self._leave(client, share)
            raise

        def finished(done: asyncio.Future) -> None:
            if not done.cancelled():
                done.exception()  # retrieved: a caller that left does not leave it unobserved
            share.slots.release()
            self._leave(client, share)

        job.add_done_callback(finished)
        # shield: a caller that is cancelled (its client hung up) leaves the job running, and the
        # job keeps the client's share until it ends.
        return await asyncio.shield(job)

    def _leave(self, client: str, share: _Share) -> None:
        share.users -= 1
        if share.users == 0 and self._shares.get(client) is share:
            del self._shares[client]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
