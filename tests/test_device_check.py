"""bench/device_check.sh is run on a lent GPU once and must work the first time, so its control flow
is checked here, on a CPU, with DRY_RUN=1: every GPU-side tool (nvcc, nvidia-smi, compute-sanitizer,
cmake, the GPU python) is replaced by a stub that acts out a run, and a step can be made to fail
(DRY_RUN_FAIL=step) or hang (DRY_RUN_SLEEP=step:seconds)."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "device_check.sh"
ALL_FILES = {"device_check.log", "steps.tsv", "preflight.txt", "pytest.xml", "microbench.jsonl",
             "gpu_reference.json", "gpu_engine.json", "summary.json"}


def run(tmp_path: Path, timeout: float = 120, **env) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    out = tmp_path / "out"
    full_env = {k: v for k, v in os.environ.items() if k not in ("STEPS", "BUDGET_S", "DRY_RUN_FAIL", "DRY_RUN_SLEEP")}
    full_env.update(DRY_RUN="1", OUT=str(out), **env)
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=full_env, timeout=timeout)
    steps = {}
    if (out / "steps.tsv").exists():
        for line in (out / "steps.tsv").read_text().splitlines():
            name, status, _seconds = line.split("\t")
            steps[name] = status
    return proc, steps


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_dry_run_runs_every_step_within_budget_and_the_file_limit(tmp_path):
    proc, steps = run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(steps) == {"preflight", "build", "tests", "bench_build", "memcheck_bench_slab_write",
                          "memcheck_bench_slab_move", "memcheck_bench_ragged_attention", "reference", "graphs",
                          "engine"} | {
        f"micro_bench_{b}" for b in ("ceiling", "rms_norm", "slab_write", "slab_move", "rmsnorm_qkv",
                                     "ragged_attention")}
    assert set(steps.values()) == {"ok"}
    # The device tool returns at most 8 files from $OUT.
    assert {p.name for p in (tmp_path / "out").iterdir()} == ALL_FILES
    estimate = re.search(r"estimate: .* = (\d+) s", proc.stdout)
    assert estimate and int(estimate.group(1)) <= 360
    # Build (the module) strictly before the benchmark targets.
    order = list(steps)
    assert order.index("build") < order.index("bench_build")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["tests"].startswith("3 run, 0 failed")
    assert len(summary["steps"]) == len(steps)
    assert summary["cuda_graphs"]["host_us_at_256_graph"] == 50.0  # the graphs step lands in the summary
    micro = (tmp_path / "out" / "microbench.jsonl").read_text().splitlines()
    assert len(micro) == 6 and all(json.loads(line)["median_us"] == 1.0 for line in micro)


def test_a_failing_step_does_not_stop_the_later_ones(tmp_path):
    proc, steps = run(tmp_path, DRY_RUN_FAIL="tests")
    assert proc.returncode == 1
    assert steps["tests"].startswith("failed")
    assert steps["reference"] == "ok" and steps["engine"] == "ok" and steps["micro_bench_ragged_attention"] == "ok"
    assert (tmp_path / "out" / "summary.json").exists()


def test_steps_selects_a_subset(tmp_path):
    proc, steps = run(tmp_path, STEPS="tests,micro")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(steps) == {"tests", "bench_build"} | {
        f"micro_bench_{b}" for b in ("ceiling", "rms_norm", "slab_write", "slab_move", "rmsnorm_qkv",
                                     "ragged_attention")}


def test_a_missing_module_is_built_before_the_selected_steps(tmp_path):
    # The stub's import of orca_ext._C fails, so the script builds first, and says the build failed.
    proc, steps = run(tmp_path, STEPS="tests", DRY_RUN_FAIL="build")
    assert proc.returncode == 1
    assert list(steps) == ["build", "tests"]
    assert steps["build"].startswith("failed") and steps["tests"] == "ok"


def test_a_hanging_step_is_cut_at_the_deadline_and_the_rest_is_skipped(tmp_path):
    # Budget 30 s minus the 15 s kept for the summary: reference hangs, is killed at ~15 s, and
    # engine has no time left.
    proc, steps = run(tmp_path, STEPS="reference,engine", BUDGET_S="30", DRY_RUN_SLEEP="reference:120")
    assert proc.returncode == 1
    assert steps == {"reference": "timeout", "engine": "skipped(time)"}
    assert (tmp_path / "out" / "summary.json").exists()


def test_unknown_step_is_refused(tmp_path):
    proc, _ = run(tmp_path, STEPS="tests,bogus")
    assert proc.returncode == 2 and "unknown step 'bogus'" in proc.stderr


@pytest.mark.parametrize("script", ["gpu_reference.py", "gpu_engine.py"])
def test_gpu_scripts_refuse_to_run_without_a_gpu(script):
    """Without CUDA they exit 2 with a message, not a traceback (gpu_engine.py --smoke is the CPU check)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = subprocess.run([str(Path(os.sys.executable)), str(ROOT / "bench" / script)], capture_output=True,
                          text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr


def test_gpu_engine_smoke_on_cpu_needs_no_tokenizer(tmp_path):
    """The engine benchmark's whole path (random model without tokenizer files, ours first, then both
    transformers baselines, JSON after every run) on a tiny model on the CPU."""
    out = tmp_path / "engine.json"
    proc = subprocess.run([os.sys.executable, str(ROOT / "bench" / "gpu_engine.py"), "--smoke", "--deadline-s", "240",
                           "--out", str(out), "--model-dir", str(tmp_path / "model")],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env=dict(os.environ, OMP_NUM_THREADS="2"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert not any((tmp_path / "model" / name).exists() for name in ("tokenizer.json", "tokenizer_config.json"))
    result = json.loads(out.read_text())
    assert list(result["runs"]) == ["ours_4", "hf_continuous_batching", "hf_static_generate_b64"]
    assert all("error" not in r and not r.get("partial") for r in result["runs"].values())
    assert result["runs"]["ours_4"]["output_tokens"] == result["runs"]["ours_4"]["expected_output_tokens"]
    assert set(result["ratios"]) == {"ours_over_hf_cb", "ours_over_hf_static"}
