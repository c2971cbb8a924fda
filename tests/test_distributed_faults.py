"""Faults of the parallel worker group: start-up death, a stopped worker, driver death, a batch
that cannot be packed, and torchrun's SIGTERM.

Every test runs real worker processes (tiny llama, CPU, gloo) and breaks them for real (SIGKILL,
SIGSTOP, a script whose workers fail on import, a killed driver). Waits are bounded hang guards,
generous for a loaded machine; no assertion is about speed beyond "seconds, not the 600 s
start-up or batch timeouts".
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from orca_ext.distributed import DistributedExecutor
from orca_ext.distributed import startup as dist_startup
from orca_ext.distributed.heartbeat import check_heartbeat_options
from orca_ext.errors import EngineDeadError
from orca_ext.models import ModelSpec
from orca_ext.sampling import SamplingParams
from orca_ext.server import Server
from test_distributed import children_of, gone, resolved_after, start_server

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}


def wait_until(condition, timeout: float, what: str) -> float:
    """Seconds until condition() held (a hang guard, not a speed check)."""
    t0 = time.monotonic()
    while not condition():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def health(server: Server) -> httpx.Response:
    from orca_ext.http.app import create_app

    async def ask():
        app = create_app(server, model_name="tiny")
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app") as c:
            return await c.get("/health")

    return asyncio.run(ask())


# -- options ------------------------------------------------------------------------------------------
def test_heartbeat_options_are_checked_before_any_process(tiny_model_dir):
    assert check_heartbeat_options(1, 10) == (1.0, 10.0)
    for interval, timeout, field in ((0, 10, "heartbeat_interval"), (-1, 10, "heartbeat_interval"),
                                     (2, 2, "heartbeat_timeout"), (1, float("nan"), "heartbeat_timeout")):
        with pytest.raises(ValueError, match=field):
            check_heartbeat_options(interval, timeout)
    spec = ModelSpec.from_pretrained(tiny_model_dir("llama"))
    before = {pid for pid, _ in children_of(os.getpid())}
    with pytest.raises(ValueError, match="heartbeat_timeout must be greater than heartbeat_interval=5 s"):
        DistributedExecutor(str(tiny_model_dir("llama")), spec, tensor_parallel_size=2, heartbeat_interval=5,
                            heartbeat_timeout=1)
    assert {pid for pid, _ in children_of(os.getpid())} <= before


# -- start-up -----------------------------------------------------------------------------------------
def test_a_worker_killed_at_spawn_fails_the_server_within_seconds(tiny_model_dir, monkeypatch):
    """SIGKILL worker 0 right after it is spawned: Server() raises within seconds (not after the
    600 s start-up timeout), naming the worker and how it ended, and leaves no process behind."""
    spawned = []
    real = dist_startup.spawn_workers

    def spawn_and_kill(workers, port):
        real(workers, port)
        spawned.extend(w.pid for w in workers)
        os.kill(workers[0].pid, signal.SIGKILL)

    monkeypatch.setattr(dist_startup, "spawn_workers", spawn_and_kill)
    result: dict = {}

    def start():
        try:
            start_server(tiny_model_dir("llama"), 2, 1)
        except Exception as exc:
            result["error"] = exc

    t = threading.Thread(target=start, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(120)
    assert not t.is_alive(), "Server() still blocked 120 s after its worker died"
    assert time.monotonic() - t0 < 120
    error = str(result["error"])
    assert "worker 0 (pipeline stage 0 of 1, tensor rank 0 of 2" in error and "was killed by SIGKILL" in error
    assert "connecting" in error
    wait_until(lambda: all(gone(pid) for pid in spawned), 30, "every worker gone")


NO_MAIN_GUARD = """
import sys
from orca_ext.server import Server

# No `if __name__ == "__main__":` guard: every spawned worker re-runs this and fails on import.
Server(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2, n_slots=800)
print("unreachable")
"""


def test_a_worker_that_fails_on_import_fails_the_server_naming_it(tiny_model_dir, tmp_path):
    """The classic mistake, a script without a __main__ guard: its workers die while importing
    it. The driver fails within seconds of their exit, naming a worker and its exit status, and
    the process exits cleanly with that error (no hang, no abort at exit)."""
    script = tmp_path / "no_guard.py"
    script.write_text(NO_MAIN_GUARD)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), str(tiny_model_dir("llama"))], cwd=tmp_path, env=ENV,
                          capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "unreachable" not in proc.stdout
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: worker ") and "exited with code 1 while connecting" in last, last
    assert "terminate called" not in proc.stderr and "core dumped" not in proc.stderr
    assert elapsed < 300


# -- a stopped worker ---------------------------------------------------------------------------------
def test_a_stopped_worker_fails_its_batch_naming_it(tiny_model_dir):
    """SIGSTOP a worker while a request runs: its peers wait forever in a collective and nothing
    closes, but its heartbeats stop; within seconds the request fails naming the worker, health
    turns false and submit raises EngineDeadError."""
    server = start_server(tiny_model_dir("llama"), 2, 1)
    pid = server.stats()["workers"][1]["pid"]
    pids = [w["pid"] for w in server.stats()["workers"]]
    try:
        rid = server.submit([7, 8, 9], SamplingParams(max_tokens=490, ignore_eos=True))
        wait_until(lambda: server.stats()["generated_tokens"] >= 3, 60, "the request is decoding")
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        out = server.result(rid, timeout=120)
        assert time.monotonic() - t0 < 60  # heartbeat_timeout (10 s), not worker_timeout (600 s)
        assert out.finish_reason == "error", out
        assert "worker 1 (pipeline stage 0 of 1, tensor rank 1 of 2" in out.error
        assert "no heartbeat for" in out.error and "its process is stopped" in out.error
        st = server.stats()
        assert not st["healthy"] and "worker 1" in st["error"]
        with pytest.raises(EngineDeadError, match="worker 1"):
            server.submit([1, 2])
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGCONT)
        server.shutdown()
    assert all(gone(p) for p in pids)


def test_a_stopped_worker_turns_health_503_while_idle(tiny_model_dir):
    """No batch is running, so no timeout could ever notice: the heartbeats do."""
    server = start_server(tiny_model_dir("llama"), 1, 2)
    pids = [w["pid"] for w in server.stats()["workers"]]
    try:
        assert server.generate([5, 6], SamplingParams(max_tokens=3))[0].finish_reason in ("length", "stop")
        assert health(server).status_code == 200
        os.kill(pids[0], signal.SIGSTOP)
        wait_until(lambda: not server.stats()["healthy"], 60, "health turns false")
        answer = health(server)
        assert answer.status_code == 503 and "worker 0 (pipeline stage 0 of 2" in answer.json()["detail"]
        assert "no heartbeat" in answer.json()["detail"]
    finally:
        if not gone(pids[0]):
            os.kill(pids[0], signal.SIGCONT)
        server.shutdown()
    assert all(gone(p) for p in pids)


# -- driver death -------------------------------------------------------------------------------------
DRIVER = """
import json, sys, time
from orca_ext.server import Server

if __name__ == "__main__":
    server = Server(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2, n_slots=800)
    print(json.dumps([w["pid"] for w in server.stats()["workers"]]), flush=True)
    time.sleep(600)
"""


def test_workers_exit_when_the_driver_is_killed(tiny_model_dir, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(script), str(tiny_model_dir("llama"))], cwd=tmp_path, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = []
        reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(300)
        pids = json.loads(line[0])
        assert len(pids) == 2 and not any(gone(p) for p in pids)
        proc.kill()
        proc.wait(30)
        wait_until(lambda: all(gone(p) for p in pids), 30, "the workers exit after the driver's SIGKILL")
    finally:
        if proc.poll() is None:
            proc.kill()


# -- a batch that cannot be packed --------------------------------------------------------------------
def test_a_batch_that_cannot_be_packed_fails_alone_with_another_in_flight(tiny_model_dir, monkeypatch):
    """With one batch in the pipeline, the next cannot be packed: only its request fails, nothing
    is left in flight for the workers to answer, the running request ends with the tokens one
    process gives, and the server stays healthy."""
    from orca_ext.distributed import driver as dist_driver

    model_dir = tiny_model_dir("llama")
    real_pack = dist_driver.pack_forward

    def pack(index, inputs, rows, free, **kw):
        if inputs[0][0][0] == 4242:  # the marked request's prompt
            raise OverflowError("a value does not fit the message")
        return real_pack(index, inputs, rows, free, **kw)

    monkeypatch.setattr(dist_driver, "pack_forward", pack)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with Server(str(model_dir), device="cpu", dtype="float32", n_slots=800) as local:
        want = local.generate([3, 1, 4], params)[0].token_ids
        after = local.generate([2, 7], params)[0].token_ids
    with start_server(model_dir, 1, 2) as server:
        executor = server.executor
        launch = executor.execute
        release = threading.Event()
        launches: list = []

        def hold_first(batch):
            launches.append(batch.index)
            real = launch(batch)
            if len(launches) > 1:
                return real
            return resolved_after(release, real)  # its tokens stay "in the pipeline" until released

        executor.execute = hold_first
        try:
            running = server.submit([3, 1, 4], params)
            wait_until(lambda: launches, 60, "the first batch is launched")
            marked = server.submit([4242, 1], params)
            # Launched into the free stage while the first batch is still held; batches are
            # postprocessed in launch order, so its outcome is published after the first's.
            wait_until(lambda: len(launches) >= 2, 60, "the marked batch is launched")
            release.set()
            out = server.result(marked, timeout=60)
            assert out.finish_reason == "error" and "could not be packed" in out.error
            assert "OverflowError" in out.error
            done = server.result(running, timeout=60)
            assert done.finish_reason == "length" and done.token_ids == want
        finally:
            release.set()
            executor.execute = launch
        assert server.generate([2, 7], params)[0].token_ids == after
        st = server.stats()
        assert st["healthy"] and st["error"] is None and st["slots_allocated"] == 0


# -- torchrun ------------------------------------------------------------------------------------------
def test_torchrun_sigterm_drains_running_streams(tiny_model_dir, tmp_path):
    """torchrun's agent forwards SIGTERM to every rank at once. The workers ignore it, so the
    driver's drain lets the running streams finish; then every process exits."""
    from http_utils import free_port

    port = free_port()
    torchrun = Path(sys.executable).parent / "torchrun"
    log = open(tmp_path / "torchrun.log", "w")
    agent = subprocess.Popen(
        [str(torchrun), "--standalone", "--nproc-per-node", "3", "-m", "orca_ext", "serve",
         "--model", str(tiny_model_dir("llama")), "--device", "cpu", "--dtype", "float32", "-pp", "2",
         "--n-slots", "1600", "--max-batch-size", "4", "--host", "127.0.0.1", "--port", str(port),
         "--shutdown-grace", "25"],
        cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy():
            assert agent.poll() is None, (tmp_path / "torchrun.log").read_text()[-3000:]
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 300, "the torchrun server answers /health")
        ranks = [pid for pid, _ in children_of(agent.pid)]
        results: dict = {}
        started = threading.Semaphore(0)

        def stream(i):
            body = {"prompt": "Once upon a time", "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            events = []
            with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        if not events:
                            started.release()
                        events.append(line[len("data: "):])
            results[i] = events

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for _ in threads:
            assert started.acquire(timeout=120)  # every stream is producing
        agent.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(120)
        agent.wait(120)
    finally:
        if agent.poll() is None:
            agent.kill()
        log.close()
    text = (tmp_path / "torchrun.log").read_text()
    for i in range(3):
        events = results[i]
        assert events[-1] == "[DONE]", text[-3000:]
        final = json.loads(events[-2])
        assert "error" not in final and final["choices"][0]["finish_reason"] == "length", (final, text[-3000:])
        assert sum(len(json.loads(e)["choices"][0]["text"]) > 0 for e in events[:-1]) > 100
    wait_until(lambda: all(gone(pid) for pid in ranks), 30, "every rank exits")
