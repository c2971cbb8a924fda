"""The command line (`orca-ext generate|bench|serve`) and the shared engine options."""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from setuptools import find_packages

from orca_ext.cli import build_parser, main
from orca_ext.config import EngineConfig
from orca_ext.options import add_engine_arguments
from orca_ext.sampling import SamplingParams
from orca_ext.server import Server

ROOT = Path(__file__).resolve().parent.parent


def test_engine_arguments_round_trip():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--dtype", "bfloat16", "--max-batch-size", "4",
                              "--n-slots", "512", "--max-model-len", "256", "--scheduler", "static",
                              "--kv-cache-memory", "1GiB", "--model", "/m", "--enforce-eager", "-tp", "2",
                              "--pipeline-parallel-size", "3"])
    assert args.model == "/m"
    assert EngineConfig.from_args(args) == EngineConfig(
        device="cpu", dtype="bfloat16", max_batch_size=4, n_slots=512, max_model_len=256, scheduler="static",
        kv_cache_memory="1GiB", enforce_eager=True, tensor_parallel_size=2, pipeline_parallel_size=3)
    # The command line's defaults are EngineConfig's, option by option.
    defaults = parser.parse_args([])
    assert defaults.model is None and EngineConfig.from_args(defaults) == EngineConfig()
    chosen = EngineConfig.from_args(parser.parse_args(["--max-num-batched-tokens", "96", "--no-batch-invariant",
                                                       "--no-slab-compaction", "--worker-timeout", "7.5",
                                                       "--prefill-only-tokens", "400"]))
    assert (chosen.max_num_batched_tokens, chosen.batch_invariant, chosen.slab_compaction,
            chosen.worker_timeout, chosen.prefill_only_tokens) == (96, False, False, 7.5, 400)
    assert EngineConfig.from_args(parser.parse_args(["--prefill-only-tokens", "none"])).prefill_only_tokens is None
    with pytest.raises(ValueError, match=r"prefill_only_tokens \(64\) must be >= max_num_batched_tokens \(96\)"):
        EngineConfig.from_args(parser.parse_args(["--max-num-batched-tokens", "96", "--prefill-only-tokens", "64"]))
    assert EngineConfig.from_args(parser.parse_args(["--max-num-batched-tokens", "none"])).max_num_batched_tokens is None
    # A value argparse accepts but the config refuses is named by the config.
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1, got 0"):
        EngineConfig.from_args(parser.parse_args(["--max-batch-size", "0"]))
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-num-batched-tokens", "0"])


def test_serve_takes_the_engine_options_and_its_own():
    args = build_parser().parse_args(["serve", "--model", "/m", "--scheduler", "static", "--port", "9",
                                      "--max-queue", "3", "--served-model-name", "x"])
    assert args.model == "/m" and EngineConfig.from_args(args).scheduler == "static"
    assert (args.port, args.max_queue, args.served_model_name) == (9, 3, "x")
    assert args.event_loop == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--event-loop", "trio"])


def test_serve_refuses_uvloop_when_it_is_not_installed(monkeypatch, caplog):
    """--event-loop uvloop without the package fails at once, before any model loads, naming
    the option and the way out."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "uvloop" else find_spec(name, *a))
    with caplog.at_level(logging.ERROR):
        assert main(["serve", "--model", "/nonexistent", "--event-loop", "uvloop"]) == 2
    assert "--event-loop uvloop needs the uvloop package" in caplog.text


def test_generate_streams_the_greedy_answer(default_model_dir, capsys):
    prompt = "The capital of France is"
    with Server(str(default_model_dir), device="cpu", n_slots=256) as server:
        want = server.generate([prompt], SamplingParams(max_tokens=8))[0].text
    assert main(["generate", prompt, "--no-chat", "--max-tokens", "8", "--device", "cpu",
                 "--n-slots", "256", "--model", str(default_model_dir)]) == 0
    assert capsys.readouterr().out == want + "\n"
    assert main(["generate", prompt, "--max-tokens", "0", "--n-slots", "256"]) == 2
    assert "max_tokens" in capsys.readouterr().err


def test_bench_compares_three_systems(tiny_model_dir, tmp_path):
    out = tmp_path / "new" / "bench.json"  # the benchmark creates the folder
    assert main(["bench", "--model", str(tiny_model_dir("llama")), "--requests", "5", "--prompt-len", "3", "9",
                 "--output-len", "2", "6", "--static-batch-size", "2", "--max-batch-size", "4",
                 "--device", "cpu", "--n-slots", "200", "--no-progress", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    res = report["results"]
    assert set(res) == {"orca", "static", "hf"} and set(report["ratios"]) == {"orca/static", "orca/hf", "static/hf"}
    useful = {r["output_tokens"] for r in res.values()}
    assert len(useful) == 1 and 10 <= useful.pop() <= 30  # each system counts only useful tokens
    assert res["orca"]["iterations"] < res["static"]["iterations"]
    assert main(["bench", "--systems", "orca,vllm"]) == 2


def test_bench_runs_outside_the_checkout(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "orca_ext", "bench", "--help"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: orca-ext bench" in proc.stdout and "--static-batch-size" in proc.stdout


def test_every_package_folder_ships_in_the_wheel():
    """Each folder of orca_ext that holds Python files is a package the wheel's discovery finds
    (a missing __init__.py would silently leave it out, as a missing orca_ext/benchmarks would
    break `orca-ext bench` from a wheel)."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = set(find_packages(where=str(ROOT), include=include))
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "orca_ext").rglob("*.py")}
    assert "orca_ext.benchmarks" in folders
    assert folders <= shipped, sorted(folders - shipped)


def test_parallel_flags_on_every_subcommand():
    from orca_ext.benchmarks.throughput import build_parser as bench_parser

    for args in (build_parser().parse_args(["generate", "hi", "-tp", "2", "-pp", "3"]),
                 build_parser().parse_args(["serve", "--tensor-parallel-size", "2", "--pipeline-parallel-size", "3"]),
                 bench_parser().parse_args(["-tp", "2", "-pp", "3"])):
        config = EngineConfig.from_args(args)
        assert (config.tensor_parallel_size, config.pipeline_parallel_size) == (2, 3)
