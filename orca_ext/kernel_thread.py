"""The one thread that runs a Server's CPU kernels: model loading, the KV cache, then the engine loop.

Our CPU kernels are OpenMP parallel regions, and libgomp keeps a pool of worker threads per
thread that starts regions. Once two threads have started regions (the caller loading the model,
then the engine loop running it), the workers stop spinning between regions and every region
pays a wake-up: a decode forward of the default model took 13-14 ms from the loop's thread
against 7.7-8.0 ms when one thread did everything (bench/RESULTS.md, "Where a single-stream
decode step goes"). So the Server loads the model and sizes the cache on the thread that later
runs its loop.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
from typing import Callable, TypeVar

T = TypeVar("T")


class KernelThread:
    """A thread that runs the calls it is given, one at a time, until it is handed its loop."""

    def __init__(self, name: str) -> None:
        self._calls: "queue.Queue[tuple]" = queue.Queue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def call(self, fn: Callable[[], T]) -> T:
        """fn() on the thread; its result, or its exception raised here."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.put((fn, done))
        return done.result()

    def run_forever(self, loop: Callable[[], None]) -> None:
        """Hand the thread to `loop`; it ends when loop returns. No call() after this."""
        self._calls.put((loop, None))

    def stop(self) -> None:
        """End the thread without a loop (a Server whose start-up failed)."""
        self.run_forever(lambda: None)

    def _run(self) -> None:
        while True:
            fn, done = self._calls.get()
            if done is None:
                fn()
                return
            try:
                done.set_result(fn())
            except BaseException as exc:  # handed back to the caller of call()
                done.set_exception(exc)
