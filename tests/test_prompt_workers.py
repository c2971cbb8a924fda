"""PromptWorkers: the CPU priority of its threads, and its argument checks."""
from __future__ import annotations

import asyncio
import os
import sys
import threading

import pytest

from orca_ext.http.prompt_workers import MAX_NICE, PromptWorkers
from orca_ext.http.service import GRAMMAR_NICE

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")


def _thread_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def _nice_seen_by_jobs(workers: PromptWorkers, jobs: int = 4) -> set[int]:
    async def main():
        return await asyncio.gather(*(workers.run(f"client{i}", _thread_nice) for i in range(jobs)))
    try:
        return set(asyncio.run(main()))
    finally:
        workers.shutdown()


@linux_only
@pytest.mark.parametrize("nice", [0, 3, MAX_NICE])
def test_every_thread_runs_at_the_callers_priority_lowered_by_nice(nice):
    base = _thread_nice()
    assert _nice_seen_by_jobs(PromptWorkers(2, 1, nice=nice)) == {min(MAX_NICE, base + nice)}
    assert _thread_nice() == base  # the calling thread (the event loop's) keeps its priority


@linux_only
def test_the_servers_grammar_threads_run_at_the_lowest_priority(make_server):
    from orca_ext.http import create_app

    service = create_app(make_server(), model_name="fake").state.service
    assert service.grammar_workers.nice == GRAMMAR_NICE == MAX_NICE
    assert _nice_seen_by_jobs(service.grammar_workers) == {MAX_NICE}
    assert service.prompt_workers.nice == 0


@pytest.mark.parametrize("nice", [-1, MAX_NICE + 1, 1.5, "19"])
def test_nice_out_of_range_is_refused(nice):
    with pytest.raises(ValueError, match=r"nice must be an integer in \[0, 19\]"):
        PromptWorkers(1, 1, nice=nice)
