"""bench/device_check.sh is meant for a GPU machine; its control flow is checked here, on a CPU, with
DRY_RUN=1: every GPU-side tool (nvcc, nvidia-smi, compute-sanitizer, cmake, the microbenchmarks, the
GPU python) is a stub. The tests steer the stubs (DRY_RUN_OUTPUTS: outputs with values drawn per
run; DRY_RUN_FAIL, DRY_RUN_SLEEP, DRY_RUN_GPUS) and check what the script makes of them: the
parsing of every step's output into summary.json, the verdicts against the targets, failed and
hung steps, a failed build that ends the run, the printed plan against the time budget and the
limit on the files in $OUT."""
from __future__ import annotations

import json
import os
import random
import re
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "device_check.sh"
MAX_FILES = 8  # files a GPU machine returns from $OUT
ALL_FILES = {"device_check.log", "steps.tsv", "tests.log", "pytest.xml", "microbench.jsonl",
             "gpu_reference.json", "gpu_engine.json", "summary.json"}
BENCHES = ("bench_ceiling", "bench_rms_norm", "bench_slab_write", "bench_slab_move", "bench_rmsnorm_qkv",
           "bench_ragged_attention", "quant_gemm_bench")
MEMCHECKED = ("bench_slab_write", "bench_slab_move", "bench_ragged_attention")
ALL_STEPS = ({"build", "kernels", "tests", "bench_build", "reference", "graphs", "engine"}
             | {f"micro_{b}" for b in BENCHES} | {f"memcheck_{b}" for b in MEMCHECKED})
# Most valuable first: the kernel tests right after the build, memcheck last.
ORDER = (["preflight", "build", "kernels", "bench_build"] + [f"micro_{b}" for b in BENCHES]
         + ["tests", "graphs", "engine", "reference"] + [f"memcheck_{b}" for b in MEMCHECKED])
RESERVE_S = 15  # kept for the summary
CALL_S = 540    # what one call to a GPU machine leaves for the script
CONTROL_VARS = ("STEPS", "BUDGET_S", "DRY_RUN_FAIL", "DRY_RUN_SLEEP", "DRY_RUN_GPUS", "DRY_RUN_OUTPUTS",
                "DRY_RUN_NO_MODULE")
SCRIPT_TEXT = SCRIPT.read_text()


def script_int(name: str) -> int:
    return int(re.search(rf"\b{name}=(\d+)", SCRIPT_TEXT).group(1))


def printed_plan(stdout: str) -> tuple[dict[str, tuple[int | None, int]], int, int]:
    """The plan the script prints first: {step: (estimate or None, cap)}, the printed total of the
    estimates and the printed deadline."""
    rows = {m[1]: (None if m[2] == "-" else int(m[2]), int(m[3]))
            for m in re.finditer(r"^plan: (\w+)\s+(\d+|-)\s+(\d+)$", stdout, re.M)}
    total = re.search(r"^plan total: (\d+) s estimated, deadline (\d+) s", stdout, re.M)
    return rows, int(total[1]), int(total[2])


def caps(plan: dict[str, tuple[int | None, int]]) -> dict[str, int]:
    """Each step's timeout cap: the plan's, and per benchmark for micro and memcheck."""
    out = {step: cap for step, (_, cap) in plan.items() if step not in ("micro", "memcheck")}
    out.update({f"micro_{b}": script_int("MICRO_CAP") for b in BENCHES})
    out["micro_bench_ragged_attention"] = script_int("MICRO_CAP_RAGGED")
    out.update({f"memcheck_{b}": script_int("MEMCHECK_CAP") for b in MEMCHECKED})
    return out


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, out: Path, seconds: float):
        self.proc, self.out, self.seconds = proc, out, seconds
        self.steps: dict[str, str] = {}  # in the order they ran
        if (out / "steps.tsv").exists():
            for line in (out / "steps.tsv").read_text().splitlines():
                name, status, _seconds = line.split("\t")
                self.steps[name] = status

    @property
    def files(self) -> set[str]:
        return {p.name for p in self.out.iterdir()}

    @property
    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    def metric(self, prefix: str) -> dict:
        """The summary's metric row whose label starts with `prefix` (exactly one)."""
        rows = [r for r in self.summary["metrics"] if r["metric"].startswith(prefix)]
        assert len(rows) == 1, (prefix, [r["metric"] for r in self.summary["metrics"]])
        return rows[0]

    def limits(self) -> dict[str, int]:
        """Each step's timeout, from the log's `START name (limit Ns)` lines."""
        text = (self.out / "device_check.log").read_text()
        return {m[1]: int(m[2]) for m in re.finditer(r"START (\S+) \(limit (\d+)s\)", text)}

    def explain(self) -> str:
        return self.proc.stdout[-4000:] + self.proc.stderr[-2000:]


def run(tmp_path: Path, outputs: dict[str, str] | None = None, timeout: float = 120, **env) -> Run:
    """The script with DRY_RUN=1; `outputs` are the stubs' canned outputs (file name -> text)."""
    out = tmp_path / "out"
    full_env = {k: v for k, v in os.environ.items() if k not in CONTROL_VARS}
    full_env.update(DRY_RUN="1", OUT=str(out), **env)
    if outputs:
        canned = tmp_path / "canned"
        canned.mkdir()
        for name, text in outputs.items():
            (canned / name).write_text(text)
        full_env["DRY_RUN_OUTPUTS"] = str(canned)
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=full_env, timeout=timeout)
    return Run(proc, out, time.monotonic() - t0)


def result_line(**fields) -> str:
    return "RESULT " + json.dumps(fields)


def test_script_parses():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_every_step_runs_and_its_results_reach_the_summary(tmp_path):
    """Values drawn for this run go in through the stubs and must come out in summary.json, with
    the verdicts the targets give them; microbench.jsonl holds exactly the RESULT lines."""
    seed = random.randrange(2**32)
    rng = random.Random(seed)

    def draw(target: float) -> float:  # either side of a target, so both verdicts occur
        return round(target * rng.uniform(0.5, 1.5), 3)

    counts = {step: (rng.randrange(1, 500), rng.randrange(5), rng.randrange(5), rng.randrange(50))
              for step in ("kernels", "tests")}
    v = {"copy_micro": draw(4000), "copy_ref": draw(4000), "gemm": draw(800), "ragged_pct": draw(80),
         "ctx1024_ours": draw(100), "ctx1024_sdpa": draw(100), "prefill_pct": draw(50), "qkv64": draw(2),
         "qkv64_kernel": draw(2), "qkv8192": draw(1.1), "hf_cb": draw(30), "hf_static": draw(30),
         "tok64": draw(10000), "floor64": draw(60), "tok256": draw(30000), "host_ms": draw(1), "graph_us": draw(100)}
    micro = {
        "bench_ceiling": ["validated", result_line(bench="copy_memcpy", mib=1024, gbps=v["copy_micro"] / 2),
                          result_line(bench="copy_ceiling", gbps=v["copy_micro"], device="H200")],
        "bench_ragged_attention": ["validated 12 cases", "  a human-readable table line",
                                   result_line(bench="ragged_attention", case="decode_ctx1024", median_us=v["ctx1024_ours"]),
                                   result_line(bench="ragged_attention", case="decode_ragged_128_2048",
                                               pct_of_copy=v["ragged_pct"])],
        "bench_rmsnorm_qkv": [result_line(bench="rmsnorm_qkv_fused", T=8192, x_floor=v["qkv64_kernel"] + 7),
                              result_line(bench="rmsnorm_qkv_fused", T=64, x_floor=v["qkv64_kernel"])],
    }
    graphs = {"host_us_at_256_graph": v["graph_us"], "rows": [{"batch": 256, "host_speedup": rng.random()}]}
    junit = {step: f'<testsuites><testsuite name="pytest" tests="{n}" failures="{f}" errors="{e}" skipped="{s}"/>'
                   f'</testsuites>' for step, (n, f, e, s) in counts.items()}
    outputs = {
        "junit_kernels.xml": junit["kernels"],
        "junit_tests.xml": junit["tests"],
        **{f"{b}.out": "\n".join(lines) + "\n" for b, lines in micro.items()},
        "gpu_reference.json": json.dumps({"rows": [
            {"name": "copy", "gbps": v["copy_ref"]}, {"name": "gemm_bf16_8192", "tflops": v["gemm"]},
            {"name": "decode_sdpa_b64_ctx1024", "us": v["ctx1024_sdpa"]},
            {"name": "prefill_ours_4x2048", "pct_of_sdpa": v["prefill_pct"]},
            {"name": "rmsnorm_qkv_ours_T64", "x_floor": v["qkv64"]},
            {"name": "rmsnorm_qkv_ours_T8192", "x_eager": v["qkv8192"]}]}),
        "gpu_engine.json": json.dumps({
            "runs": {"ours_64": {"tok_per_s": v["tok64"], "pct_of_floor": v["floor64"]},
                     "ours_256": {"tok_per_s": v["tok256"], "host_time_at_batch": {"host_ms_median": v["host_ms"]}}},
            "ratios": {"ours_over_hf_cb": v["hf_cb"], "ours_over_hf_static": v["hf_static"]}}),
        "cuda_graphs.json": json.dumps(graphs),
    }
    r = run(tmp_path, outputs)
    context = f"seed {seed}\n" + r.explain()
    assert r.proc.returncode == 0, context
    assert set(r.steps) == ALL_STEPS | {"preflight"}, context
    assert set(r.steps.values()) == {"ok"}, context
    assert r.files == ALL_FILES and len(r.files) <= MAX_FILES, context
    order = list(r.steps)
    assert order == ORDER, context

    summary = r.summary
    assert summary["tests"] == {step: f"{n} run, {f} failed, {e} errors, {s} skipped"
                                for step, (n, f, e, s) in counts.items()}
    # tests.log names every test with its outcome, step by step.
    tests_log = (r.out / "tests.log").read_text()
    assert tests_log.index("test_kernels.py::test_first PASSED") < tests_log.index("test_tests.py::test_first PASSED")
    assert summary["preflight"]["compute-sanitizer works"] == "yes"
    assert summary["preflight"]["Python.h"].endswith("(found)")
    assert [s["step"] for s in summary["steps"]] == order
    assert summary["cuda_graphs"] == graphs
    assert "parallel_gpu" not in summary  # one GPU
    # label prefix -> (value, target): ">= t" or "<= t", None for a plain figure
    expected = {
        "copy bandwidth": (v["copy_micro"], None),  # the microbenchmark's ceiling wins over the reference's copy
        "bf16 GEMM": (v["gemm"], None),
        "decode ragged": (v["ragged_pct"], (">=", 80)),
        "decode ctx1024 us, ours": (v["ctx1024_ours"], None),
        "decode ctx1024 us, torch SDPA": (v["ctx1024_sdpa"], None),
        "prefill 4x2048": (v["prefill_pct"], (">=", 50)),
        "rmsnorm_qkv T=64 x floor": (v["qkv64"], ("<=", 2)),
        "rmsnorm_qkv T=64 kernel": (v["qkv64_kernel"], ("<=", 2)),
        "rmsnorm_qkv T=8192": (v["qkv8192"], ("<=", 1.1)),
        "engine ours / transformers CB": (v["hf_cb"], (">=", 30)),
        "engine ours / static": (v["hf_static"], (">=", 30)),
        "engine 64 req tok/s": (v["tok64"], None),
        "engine 64 req % of memory floor": (v["floor64"], None),
        "engine 256 req tok/s": (v["tok256"], None),
        "host ms per iteration": (v["host_ms"], None),
        "decode host us at batch 256": (v["graph_us"], ("<=", 100)),
    }
    assert len(summary["metrics"]) == len(expected)
    for prefix, (value, target) in expected.items():
        row = r.metric(prefix)
        verdict = None
        if target is not None:
            op, t = target
            verdict = "PASS" if (value >= t if op == ">=" else value <= t) else "MISS"
        assert (row["value"], row["verdict"]) == (value, verdict), f"seed {seed}: {row}"

    lines = [json.loads(x) for x in (r.out / "microbench.jsonl").read_text().splitlines()]
    wanted = []
    for b in BENCHES:  # the order the script runs them in; stubs without canned output print one line
        canned = micro.get(b, [result_line(bench=b.removeprefix("bench_"), median_us=1.0)])
        wanted += [json.loads(x.removeprefix("RESULT ")) for x in canned if x.startswith("RESULT ")]
    assert lines == wanted


def test_the_reference_copy_stands_in_when_the_microbenchmark_has_none(tmp_path):
    copy = round(random.uniform(1000, 5000), 2)
    r = run(tmp_path, {"bench_ceiling.out": "validated\n",
                       "gpu_reference.json": json.dumps({"rows": [{"name": "copy", "gbps": copy}]})},
            STEPS="micro,reference")
    assert r.proc.returncode == 0, r.explain()
    assert r.metric("copy bandwidth")["value"] == copy
    assert r.metric("bf16 GEMM")["value"] is None and r.metric("bf16 GEMM")["verdict"] is None


@pytest.mark.parametrize("gpus", [1, 2, 8])
def test_parallel_results_go_into_the_summary_only_with_several_gpus(tmp_path, gpus):
    tok = round(random.uniform(100, 9000), 1)
    parallel = {"gpus": gpus, "configs": {
        "tp2_pp1": {"n_workers_1": {"tokens_per_s": tok, "speedup_vs_1gpu": 1.5},
                    "greedy_tokens_same_as_1gpu": 0.984},
        "tp1_pp2": {"error": "Traceback (most recent call last):\nRuntimeError: NCCL stage 1 gone"}}}
    r = run(tmp_path, {"parallel_gpu.json": json.dumps(parallel)}, STEPS="multigpu", DRY_RUN_GPUS=str(gpus))
    assert r.proc.returncode == 0, r.explain()
    assert r.files <= ALL_FILES, "the parallel results take no file of their own"
    if gpus == 1:
        assert r.steps == {} and "parallel_gpu" not in r.summary
        return
    assert r.steps == {"multigpu": "ok"}
    assert r.limits()["multigpu"] == caps(printed_plan(r.proc.stdout)[0])["multigpu"]
    assert r.summary["parallel_gpu"] == parallel
    assert f"{tok:.0f} tok/s (1.50x)" in r.proc.stdout and "same greedy tokens 0.984" in r.proc.stdout
    assert "ERROR RuntimeError: NCCL stage 1 gone" in r.proc.stdout


@pytest.mark.parametrize("failing", ["kernels", "tests", "micro_bench_slab_move", "reference", "graphs", "engine"])
def test_a_failing_step_is_reported_and_the_others_still_run(tmp_path, failing):
    r = run(tmp_path, DRY_RUN_FAIL=failing)
    assert r.proc.returncode == 1, r.explain()
    assert r.steps[failing] == "failed(rc=1)"
    assert list(r.steps) == ORDER
    assert all(status == "ok" for step, status in r.steps.items() if step != failing), r.steps
    log = (r.out / "device_check.log").read_text()
    assert f"dry run: {failing.removeprefix('micro_')} fails" in log + (r.out / "tests.log").read_text()
    assert r.files <= ALL_FILES
    summary = r.summary
    assert {s["step"]: s["status"] for s in summary["steps"]} == r.steps
    for step in ("kernels", "tests"):  # a pytest step that failed before writing its junit has no record
        assert (step in summary["tests"]) == (failing != step)
        if failing != step:
            assert summary["tests"][step].startswith("3 run")
    assert ("cuda_graphs" in summary) == (failing != "graphs")
    assert (r.metric("engine 64 req tok/s")["value"] is None) == (failing == "engine")
    assert ("gpu_reference.json" in r.files) == (failing != "reference")


def test_a_sanitizer_that_refuses_the_gpu_skips_memcheck_without_failing_the_run(tmp_path):
    r = run(tmp_path, DRY_RUN_FAIL="sanitizer")
    assert r.proc.returncode == 0, r.explain()
    assert r.steps["memcheck"] == "skipped(sanitizer)"
    assert list(r.steps)[-1] == "memcheck"
    assert not any(step.startswith("memcheck_") for step in r.steps)
    assert "compute-sanitizer works: no" in (r.out / "device_check.log").read_text()
    assert r.summary["preflight"]["compute-sanitizer works"].startswith("no")


@pytest.mark.parametrize("failing,error_line", [
    ("build", 'slab_move.cu(31): error: identifier "copy_plan" is undefined'),
    ("configure", "CMake Error at CMakeLists.txt:66 (message):"),
    ("import", "ImportError: orca_ext/_C.so: undefined symbol"),
])
def test_a_failed_build_ends_the_run_at_once_with_its_error_lines(tmp_path, failing, error_line):
    """No step after the build can run without _C: the run stops there, in seconds, and the error
    lines are in the log, in build_errors.txt and in summary.json, for a fixed rerun."""
    env = {"DRY_RUN_FAIL": failing}
    if failing == "import":
        env = {"DRY_RUN_NO_MODULE": "1", "DRY_RUN_FAIL": "import"}
    r = run(tmp_path, **env)
    assert r.proc.returncode == 1, r.explain()
    assert r.seconds < 20, f"the run went on for {r.seconds:.0f} s after a failed build"
    assert r.steps == {"preflight": "ok", "build": "failed(rc=1)"}
    assert r.files == {"device_check.log", "steps.tsv", "microbench.jsonl", "build_errors.txt", "summary.json"}
    errors = (r.out / "build_errors.txt").read_text()
    assert error_line in errors, errors
    assert error_line in (r.out / "device_check.log").read_text()
    assert any(error_line in line for line in r.summary["build_errors"])
    if failing == "build":  # the source line and caret come with the error
        assert "copy_plan(pools, n_pools);" in errors and "[1/40] Building CXX" not in errors
    if failing == "configure":  # and the whole of a CMake message
        assert "ORCA_CUDA=ON but no CUDA compiler (nvcc) was found" in errors


def test_a_build_out_of_time_ends_the_run(tmp_path):
    budget = 30
    r = run(tmp_path, BUDGET_S=str(budget), DRY_RUN_SLEEP="build:300")
    assert r.proc.returncode == 1, r.explain()
    assert r.steps == {"preflight": "ok", "build": "timeout"}
    assert r.seconds < budget
    assert "ran out of time" in (r.out / "build_errors.txt").read_text()


def test_an_interpreter_without_python_h_stops_in_preflight(tmp_path):
    r = run(tmp_path, DRY_RUN_FAIL="python_h")
    assert r.proc.returncode == 1, r.explain()
    assert r.steps == {"preflight": "failed(no Python.h)"}
    assert r.seconds < 20
    log = (r.out / "device_check.log").read_text()
    assert "STOP: /usr/include/python3.12/Python.h is missing" in log
    assert r.summary["preflight"]["Python.h"].endswith("(MISSING)")


def test_a_hanging_step_is_cut_at_the_deadline_and_the_run_fits_its_budget(tmp_path):
    # The deadline is BUDGET_S - RESERVE_S = 15 s: engine hangs and is killed there, reference has
    # no time left, and what finished before (kernels) is kept.
    budget = 30
    n_tests = random.randrange(10, 100)
    junit = f'<testsuite name="pytest" tests="{n_tests}" failures="0" errors="0" skipped="0"/>'
    r = run(tmp_path, {"junit_kernels.xml": junit}, STEPS="kernels,engine,reference", BUDGET_S=str(budget),
            DRY_RUN_SLEEP="engine:120")
    assert r.proc.returncode == 1, r.explain()
    assert r.steps == {"kernels": "ok", "engine": "timeout", "reference": "skipped(time)"}
    assert r.seconds < budget, f"the run took {r.seconds:.1f} s of a {budget} s budget"
    assert r.summary["tests"] == {"kernels": f"{n_tests} run, 0 failed, 0 errors, 0 skipped"}
    assert "gpu_reference.json" not in r.files


def test_a_hanging_kernel_test_is_cut_and_tests_log_names_it(tmp_path):
    """pytest killed by its step's timeout writes no junit; tests.log still shows which test ran."""
    budget = 30
    r = run(tmp_path, STEPS="kernels,tests", BUDGET_S=str(budget), DRY_RUN_SLEEP="kernels:120")
    assert r.proc.returncode == 1, r.explain()
    assert r.steps == {"kernels": "timeout", "tests": "skipped(time)"}
    assert r.seconds < budget
    lines = (r.out / "tests.log").read_text().splitlines()
    assert lines[-1].strip() == "tests/cuda/test_kernels.py::test_that_hangs", lines[-3:]
    assert "tests/cuda/test_kernels.py::test_first PASSED" in lines
    assert r.summary["tests"] == {} and "pytest.xml" not in r.files


def test_a_hanging_microbenchmark_is_cut_at_its_cap_and_the_next_ones_run(tmp_path):
    r = run(tmp_path, STEPS="micro", DRY_RUN_SLEEP="micro_bench_ceiling:300", timeout=200)
    assert r.proc.returncode == 1, r.explain()
    assert r.steps["micro_bench_ceiling"] == "timeout"
    assert all(r.steps[f"micro_{b}"] == "ok" for b in BENCHES[1:])
    assert r.seconds < script_int("MICRO_CAP") + 20
    benches = [json.loads(x)["bench"] for x in (r.out / "microbench.jsonl").read_text().splitlines()]
    assert benches == [b.removeprefix("bench_") for b in BENCHES[1:]]


@pytest.mark.parametrize("budget_range", [(60, 200), (1000, 1400)], ids=["time-left-binds", "caps-bind"])
def test_each_step_runs_under_the_lesser_of_its_cap_and_the_time_left(tmp_path, budget_range):
    budget = random.randrange(*budget_range)
    r = run(tmp_path, BUDGET_S=str(budget))
    assert r.proc.returncode == 0, r.explain()
    limits = r.limits()
    assert set(limits) == ALL_STEPS
    cap = caps(printed_plan(r.proc.stdout)[0])
    deadline = budget - RESERVE_S
    slack = int(r.seconds) + 1  # the time left shrinks while the run goes on
    for step, limit in limits.items():
        assert min(cap[step], deadline - slack) <= limit <= min(cap[step], deadline), (budget, step, limit)
    # The engine benchmark gets its own deadline, 10 s inside its timeout.
    engine_deadline = int(re.search(r"START engine .* --deadline-s (\d+)",
                                    (r.out / "device_check.log").read_text()).group(1))
    assert limits["engine"] - 10 - slack <= engine_deadline <= limits["engine"] - 10 + 1, (budget, limits["engine"])


def test_the_printed_plan_fits_one_call(tmp_path):
    """The plan printed at the start names every step with its estimate and cap; its printed total is
    the sum of the estimates, which fits the deadline of the default budget, one GPU call."""
    default_budget = int(re.search(r'BUDGET_S="\$\{BUDGET_S:-(\d+)\}"', SCRIPT_TEXT).group(1))
    assert default_budget <= CALL_S
    r = run(tmp_path, STEPS="preflight")
    assert r.proc.returncode == 0, r.explain()
    plan, total, deadline = printed_plan(r.proc.stdout)
    assert list(plan) == ["preflight", "build", "kernels", "bench_build", "micro", "tests", "graphs", "engine",
                          "reference", "memcheck", "multigpu"]
    assert plan["multigpu"][0] is None  # one GPU: it does not run
    assert total == sum(e for e, _ in plan.values() if e is not None)
    assert deadline == default_budget - RESERVE_S
    assert total <= deadline, f"the plan's estimates add up to {total} s, past the {deadline} s deadline"
    assert all(e is None or e <= c for e, c in plan.values()), plan
    # micro and memcheck: the sum of their benchmarks' caps
    cap = caps(plan)
    assert plan["micro"][1] == sum(cap[f"micro_{b}"] for b in BENCHES)
    assert plan["memcheck"][1] == sum(cap[f"memcheck_{b}"] for b in MEMCHECKED)


def test_the_cuda_tests_use_every_core_for_their_float64_references(tmp_path):
    r = run(tmp_path, STEPS="kernels,tests", OMP_NUM_THREADS="1")
    assert r.proc.returncode == 0, r.explain()
    cores = len(os.sched_getaffinity(0))  # what nproc counts
    assert (r.out / "tests.log").read_text().count(f"threads: OMP_NUM_THREADS={cores}\n") == 2


def test_steps_selects_a_subset_and_skips_the_build_when_the_module_imports(tmp_path):
    r = run(tmp_path, STEPS="kernels,micro")
    assert r.proc.returncode == 0, r.explain()
    assert set(r.steps) == {"kernels", "bench_build"} | {f"micro_{b}" for b in BENCHES}


def test_a_missing_module_is_built_before_the_selected_steps(tmp_path):
    # The stub's import of orca_ext._C fails until the build has run, so the script builds first.
    r = run(tmp_path, STEPS="kernels", DRY_RUN_NO_MODULE="1")
    assert r.proc.returncode == 0, r.explain()
    assert r.steps == {"build": "ok", "kernels": "ok"} and list(r.steps) == ["build", "kernels"]


def test_unknown_step_is_refused(tmp_path):
    r = run(tmp_path, STEPS="tests,bogus")
    assert r.proc.returncode == 2 and "unknown step 'bogus'" in r.proc.stderr


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
