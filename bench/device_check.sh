#!/usr/bin/env bash
# The GPU check of the CUDA path, on one machine with an NVIDIA GPU (written for an H200): build _C,
# run the CUDA tests, the microbenchmarks, CUDA-graph replay, the engine benchmark, the torch
# references and compute-sanitizer, then write one summary.
#
# Time: the whole check fits in BUDGET_S seconds (default 540: one 10-minute call to a GPU machine,
# its start-up and transfers left out). The plan below (each step's estimate and cap) is printed at
# the start with the sum of the estimates, which fits BUDGET_S - 15 s. A hard deadline enforces the
# budget: every step after preflight runs under `timeout` with the lesser of its cap and the time
# left before BUDGET_S - 15 s (15 s are kept for the summary); a step that would start with under
# 10 s left is skipped. Preflight's probes each run under their own timeout.
# A failed build ends the run at once (after the summary): its compiler and CMake error lines go
# to the log and to build_errors.txt, so a fixed rerun still fits the machine's time.
# Output: at most 8 files in $OUT, these names: device_check.log, steps.tsv, tests.log (every CUDA
# test by name as it runs, pytest -v -rA, so a run cut short still names the test it was in),
# pytest.xml (the junit records of both pytest steps), microbench.jsonl, gpu_reference.json,
# gpu_engine.json, summary.json; after a failed build, build_errors.txt instead of the files of the
# steps that never ran. Preflight's facts go into the log and summary.json; the results of CUDA
# graphs and tensor/pipeline parallelism into summary.json, not files of their own.
#
#   OUT=/some/dir bash bench/device_check.sh           all steps
#   STEPS=kernels,micro bash bench/device_check.sh     only these (build runs first if _C is missing)
#   DRY_RUN=1 OUT=/tmp/x bash bench/device_check.sh    stubs instead of GPU tools: checks the control
#                                                      flow on a CPU (tests/test_device_check.py)
#
# Steps, in this order (most valuable first, so a run cut short loses the least):
#   preflight   versions (cmake, the C++ compiler, nvcc, Python, torch), GPU, free disk, Python.h
#               of the interpreter (none: stop here); does compute-sanitizer work on a 10-line program?
#   build       _C only (CMake target _C) against this machine's torch, into orca_ext/
#   kernels     pytest -v -rA of the kernel tests: test_kernels_cuda.py, test_attention_plan_cuda.py,
#               test_quant_cuda.py (float64 references, on every CPU core)
#   bench_build the CUDA microbenchmarks (after _C, so a failing one never costs _C)
#   micro       each microbenchmark: validates against bench/common/reference.h, then times with
#               CUDA graphs
#   tests       the other CUDA tests: CUDA graphs, the engine vs transformers (random weights,
#               token-id prompts, no tokenizer files), batch invariance, then any others
#   graphs      bench/cuda_graphs.py: host time per decode iteration, eager vs CUDA-graph replay, at
#               batch 1, 32, 256 (target < 100 us at 256); into summary.json
#   engine      bench/gpu_engine.py, short: ours first, transformers baselines last, its own deadline
#   reference   bench/gpu_reference.py: torch references and ours, graph-timed, vs targets
#   multigpu    only with more than one GPU visible: bench/parallel_gpu.py (tensor/pipeline
#               parallelism over NCCL); into summary.json
#   memcheck    compute-sanitizer memcheck of the small cases (skipped if preflight says the
#               sanitizer does not work on this machine's runtime)
#   summary     always: a table of steps and metrics, summary.json
# The script goes on after any other failed step, and each step appends its results to $OUT as
# soon as it ends, so a run cut short keeps what finished. Exit status 0 only if every step run passed.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
BUDGET_S="${BUDGET_S:-540}"
RESERVE_S=15                                  # kept for the summary
ALL_STEPS="preflight,build,kernels,micro,tests,graphs,engine,reference,multigpu,memcheck"
STEPS="${STEPS:-$ALL_STEPS}"
DRY_RUN="${DRY_RUN:-0}"
START=$(date +%s)
DEADLINE=$((START + BUDGET_S - RESERVE_S))
LOG="$OUT/device_check.log"
STEPS_TSV="$OUT/steps.tsv"
MICRO="$OUT/microbench.jsonl"
TESTS_LOG="$OUT/tests.log"
BUILD_ERRORS="$OUT/build_errors.txt"
: > "$LOG"; : > "$STEPS_TSV"; : > "$MICRO"

# The plan: step, estimate (s), cap (s; for micro and memcheck the sum of their benchmarks' caps).
# multigpu runs only with several GPUs, so its estimate is not counted.
PLAN="preflight 20 60
build 75 180
kernels 60 120
bench_build 30 90
micro 45 240
tests 40 90
graphs 15 60
engine 100 150
reference 20 60
memcheck 30 90
multigpu - 240"
cap_of() { awk -v s="$1" '$1 == s {print $3}' <<< "$PLAN"; }
MICRO_BENCHES="bench_ceiling bench_rms_norm bench_slab_write bench_slab_move bench_rmsnorm_qkv bench_ragged_attention quant_gemm_bench"
MICRO_CAP=30; MICRO_CAP_RAGGED=60             # bench_ragged_attention sweeps items_per_sm x decode_stages
MEMCHECKED="bench_slab_write bench_slab_move bench_ragged_attention"
MEMCHECK_CAP=30
KERNEL_TESTS="tests/cuda/test_kernels_cuda.py tests/cuda/test_attention_plan_cuda.py tests/cuda/test_quant_cuda.py"
FIRST_TESTS="tests/cuda/test_cuda_graphs.py tests/cuda/test_engine_cuda.py tests/cuda/test_batch_invariance_cuda.py"

# Tools. DRY_RUN replaces each with a stub (see make_stubs).
PY="${PYTHON:-python3}"                       # the machine's python, with its CUDA torch
SUMMARY_PY="$PY"
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
SANITIZER="${SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
SMI="${SMI:-nvidia-smi}"
CMAKE="${CMAKE:-cmake}"
CXX_BIN="${CXX:-c++}"
BUILD_DIR="${BUILD_DIR:-$ROOT/build/device}"
WORK="$(mktemp -d)"
PREFLIGHT="$WORK/preflight.txt"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
CORES="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"  # nproc alone would follow OMP_NUM_THREADS
export MAX_JOBS="${MAX_JOBS:-$CORES}"
# The float64 references of the CUDA tests run on the host: give them every core.
export OMP_NUM_THREADS="$CORES"

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
want() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$STEPS_TSV"; }  # step, status, seconds
left() { echo $((DEADLINE - $(date +%s))); }

# run_step_to FILE NAME CAP CMD...: CMD under timeout min(CAP, time left), its output appended to FILE.
run_step_to() {
  local file="$1" name="$2" cap="$3"; shift 3
  local limit t0 rc status dt
  limit=$(left)
  if [ "$limit" -lt 10 ]; then
    log "SKIP $name: out of time"; record "$name" "skipped(time)" 0; return 124
  fi
  [ "$cap" -lt "$limit" ] && limit=$cap
  log "START $name (limit ${limit}s): $*"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >> "$file" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  status=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=timeout; elif [ "$rc" -ne 0 ]; then status="failed(rc=$rc)"; fi
  record "$name" "$status" "$dt"
  log "END $name: $status in ${dt}s"
  return "$rc"
}
run_step() { run_step_to "$LOG" "$@"; }

# DRY_RUN: stand-ins for every GPU-side tool. By default they act out a successful run with fixed
# numbers. A test steers them through the environment:
#   DRY_RUN_OUTPUTS=DIR       a tool's output comes from DIR when the file is there: junit_kernels.xml,
#                             junit_tests.xml, gpu_reference.json, cuda_graphs.json, gpu_engine.json,
#                             parallel_gpu.json (what the python scripts write to --out / --junitxml)
#                             and <bench>.out (the stdout of a CUDA microbenchmark, e.g. bench_ceiling.out)
#   DRY_RUN_FAIL=STEP         that step's command exits 1 (configure and build: CMake and nvcc error
#                             lines; import: _C does not import; python_h: the interpreter has no
#                             Python.h; kernels, tests, reference, graphs, multigpu, engine,
#                             micro_<bench>; "sanitizer": compute-sanitizer refuses the GPU)
#   DRY_RUN_SLEEP=STEP:S      that step's command sleeps S seconds first (a hang; a pytest step names
#                             the test it hangs in first)
#   DRY_RUN_GPUS=N            nvidia-smi lists N GPUs (default 1)
#   DRY_RUN_NO_MODULE=1       _C does not import until the build step has built it
make_stubs() {
  local s="$WORK/stubs"; mkdir -p "$s"
  cat > "$s/nvcc" <<'EOF'
#!/usr/bin/env bash
if [ "${1:-}" = "--version" ]; then echo "Cuda compilation tools, release 13.0 (dry run)"; exit 0; fi
out=""; while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
printf '#!/usr/bin/env bash\necho "probe ok"\n' > "$out"; chmod +x "$out"
EOF
  cat > "$s/nvidia-smi" <<'EOF'
#!/usr/bin/env bash
case "$*" in
  *compute_cap*) echo "9.0" ;;
  -L) for ((i = 0; i < ${DRY_RUN_GPUS:-1}; i++)); do echo "GPU $i: NVIDIA H200 (dry run)"; done ;;
  *) echo "NVIDIA H200 (dry run), 143771 MiB, 580.00" ;;
esac
EOF
  cat > "$s/compute-sanitizer" <<'EOF'
#!/usr/bin/env bash
echo "========= COMPUTE-SANITIZER (dry run)"
if [ "${DRY_RUN_FAIL:-}" = "sanitizer" ]; then echo "========= Error: Device not supported"; exit 1; fi
echo "========= ERROR SUMMARY: 0 errors"
EOF
  cat > "$s/bench" <<'EOF'
#!/usr/bin/env bash
# A CUDA microbenchmark: its canned stdout, or one RESULT line.
name="$(basename "$0")"
if [ -n "${DRY_RUN_SLEEP:-}" ] && [ "${DRY_RUN_SLEEP%%:*}" = "micro_$name" ]; then sleep "${DRY_RUN_SLEEP#*:}"; fi
if [ -n "${DRY_RUN_OUTPUTS:-}" ] && [ -f "$DRY_RUN_OUTPUTS/$name.out" ]; then cat "$DRY_RUN_OUTPUTS/$name.out"
else echo "validated (dry run)"; echo "RESULT {\"bench\": \"${name#bench_}\", \"median_us\": 1.0}"; fi
if [ "${DRY_RUN_FAIL:-}" = "micro_$name" ]; then echo "dry run: $name fails"; exit 1; fi
exit 0
EOF
  cat > "$s/cmake" <<EOF
#!/usr/bin/env bash
MICRO_BENCHES="$MICRO_BENCHES"
EOF
  cat >> "$s/cmake" <<'EOF'
if [ "${1:-}" = "--version" ]; then echo "cmake version 3.31.6 (dry run)"; exit 0; fi
if [ "${1:-}" = "-S" ]; then
  echo "-- The CXX compiler identification is GNU 13.3.0 (dry run)"
  if [ "${DRY_RUN_FAIL:-}" = "configure" ]; then
    echo "CMake Error at CMakeLists.txt:66 (message):"
    echo "  ORCA_CUDA=ON but no CUDA compiler (nvcc) was found"
    echo "-- Configuring incomplete, errors occurred!"
    exit 1
  fi
  echo "-- Configuring done (dry run)"; exit 0
fi
# --build DIR --target _C | cuda_benchmarks
if [ "${1:-}" = "--build" ] && [[ " $* " == *" _C "* ]]; then
  if [ -n "${DRY_RUN_SLEEP:-}" ] && [ "${DRY_RUN_SLEEP%%:*}" = "build" ]; then sleep "${DRY_RUN_SLEEP#*:}"; fi
  echo "[1/40] Building CXX object CMakeFiles/orca_cpu_kernels.dir/csrc/cpu/rms_norm.cpp.o"
  if [ "${DRY_RUN_FAIL:-}" = "build" ]; then
    echo "[12/40] Building CUDA object CMakeFiles/orca_cuda_kernels.dir/csrc/cuda/slab_move.cu.o"
    echo "FAILED: CMakeFiles/orca_cuda_kernels.dir/csrc/cuda/slab_move.cu.o"
    echo "/root/orca/csrc/cuda/slab_move.cu(31): error: identifier \"copy_plan\" is undefined (dry run)"
    echo "      copy_plan(pools, n_pools);"
    echo "      ^"
    echo "1 error detected in the compilation of \"/root/orca/csrc/cuda/slab_move.cu\"."
    echo "ninja: build stopped: subcommand failed."
    exit 1
  fi
  touch "$(dirname "$0")/_C.built"
  echo "[40/40] Linking CXX shared module orca_ext/_C.so (dry run)"; exit 0
fi
if [ "${1:-}" = "--build" ] && [[ " $* " == *" cuda_benchmarks "* ]]; then
  mkdir -p "$2/bench/cuda"
  for b in $MICRO_BENCHES; do cp "$(dirname "$0")/bench" "$2/bench/cuda/$b"; done
fi
echo "cmake $* (dry run)"
EOF
  cat > "$s/python" <<'EOF'
#!/usr/bin/env bash
# Acts out pytest, the benchmark scripts and the inline checks.
step=other
case "$*" in
  *"-m pytest"*test_kernels_cuda*) step=kernels ;; *"-m pytest"*) step=tests ;;
  *gpu_reference.py*) step=reference ;; *gpu_engine.py*) step=engine ;;
  *cuda_graphs.py*) step=graphs ;; *parallel_gpu.py*) step=multigpu ;;
  *Python.h*) step=python_h ;; *orca_ext._C*) step=import ;;
  *"import torch; print"*) echo "2.11.0+cu130 cuda 13.0 NVIDIA H200 (dry run)"; exit 0 ;;
  *"import pytest_timeout"*) echo yes; exit 0 ;;
  *"--version"*) echo "Python 3.12.3 (dry run)"; exit 0 ;;
esac
if [ "$step" = python_h ]; then
  echo "/usr/include/python3.12/Python.h"
  [ "${DRY_RUN_FAIL:-}" = python_h ] && exit 1
  exit 0
fi
if [ "$step" = import ] && { [ "${DRY_RUN_FAIL:-}" = import ] ||
                              { [ -n "${DRY_RUN_NO_MODULE:-}" ] && [ ! -f "$(dirname "$0")/_C.built" ]; }; }; then
  echo "Traceback (most recent call last):"
  echo "  File \"<string>\", line 2, in <module>"
  echo "ImportError: orca_ext/_C.so: undefined symbol: _ZN3c104cuda20getCurrentCUDAStreamEa (dry run)"
  exit 1
fi
if [ "$step" = kernels ] || [ "$step" = tests ]; then
  echo "threads: OMP_NUM_THREADS=${OMP_NUM_THREADS:-unset}"; echo "tests/cuda/test_$step.py::test_first PASSED"
fi
if [ -n "${DRY_RUN_SLEEP:-}" ] && [ "${DRY_RUN_SLEEP%%:*}" = "$step" ]; then
  [ "$step" = kernels ] || [ "$step" = tests ] && echo "tests/cuda/test_$step.py::test_that_hangs "
  sleep "${DRY_RUN_SLEEP#*:}"
fi
if [ "${DRY_RUN_FAIL:-}" = "$step" ]; then echo "dry run: $step fails"; exit 1; fi
out=""; junit=""
for a in "$@"; do case "$a" in --junitxml=*) junit="${a#--junitxml=}" ;; esac; done
while [ $# -gt 0 ]; do [ "$1" = "--out" ] && out="$2"; shift; done
emit() {  # emit FILE DEFAULT DEST: the canned FILE if the test gave one, else DEFAULT
  if [ -n "${DRY_RUN_OUTPUTS:-}" ] && [ -f "$DRY_RUN_OUTPUTS/$1" ]; then cp "$DRY_RUN_OUTPUTS/$1" "$3"; else echo "$2" > "$3"; fi
}
case "$step" in
  kernels|tests) echo "tests/cuda/test_$step.py::test_second PASSED"
                 emit "junit_$step.xml" '<testsuites><testsuite name="pytest" tests="3" failures="0" errors="0" skipped="0"/></testsuites>' "$junit" ;;
  reference) emit gpu_reference.json '{"rows": [{"name": "copy", "gbps": 4200.0}]}' "$out" ;;
  engine) emit gpu_engine.json '{"runs": {"ours_64": {"tok_per_s": 1000.0}}, "ratios": {}}' "$out" ;;
  graphs) emit cuda_graphs.json '{"host_us_at_256_graph": 50.0, "rows": []}' "$out" ;;
  multigpu) emit parallel_gpu.json '{"gpus": 2, "configs": {}}' "$out" ;;
esac
echo "python $step (dry run)"
EOF
  cat > "$s/c++" <<'EOF'
#!/usr/bin/env bash
echo "c++ (GCC) 13.3.0 (dry run)"
EOF
  chmod +x "$s"/*
  NVCC="$s/nvcc"; SMI="$s/nvidia-smi"; SANITIZER="$s/compute-sanitizer"; CMAKE="$s/cmake"; PY="$s/python"
  CXX_BIN="$s/c++"
  SUMMARY_PY="$(command -v python3)"
  BUILD_DIR="$WORK/build"
}
[ "$DRY_RUN" = "1" ] && make_stubs

module_ok() {  # _C imports with the CUDA dispatch compiled in
  "$PY" -c "import orca_ext._C as C, sys; sys.exit(0 if C.built_with_cuda() else 1)" >> "$LOG" 2>&1
}

# Python.h of the interpreter that builds _C (its include dir per sysconfig); prints the path.
PYTHON_H_OK=""
python_headers() {
  if [ -z "$PYTHON_H_OK" ]; then
    PYTHON_H_OK=0
    PYTHON_H="$(timeout 60 "$PY" -c "import os, sys, sysconfig
path = os.path.join(sysconfig.get_paths()['include'], 'Python.h')
print(path)
sys.exit(0 if os.path.isfile(path) else 1)" 2>/dev/null)" && PYTHON_H_OK=1
    [ -n "$PYTHON_H" ] || PYTHON_H="Python.h (sysconfig of $PY did not answer)"
  fi
  [ "$PYTHON_H_OK" = 1 ]
}

for step in ${STEPS//,/ }; do
  case ",$ALL_STEPS," in *",$step,"*) ;; *) echo "unknown step '$step'; steps are $ALL_STEPS" >&2; exit 2 ;; esac
done
log "device check in $ROOT -> $OUT; steps: $STEPS; budget ${BUDGET_S}s (dry run: $DRY_RUN)"
{
  echo "plan: step, estimate s, cap s"
  awk '{printf "plan: %-12s %4s %4s\n", $1, $2, $3}' <<< "$PLAN"
  echo "plan total: $(awk '$2 != "-" {s += $2} END {print s}' <<< "$PLAN") s estimated, deadline $((BUDGET_S - RESERVE_S)) s" \
       "(budget $BUDGET_S s, $RESERVE_S s kept for the summary)"
} | tee -a "$LOG"

# ---- summary (always; also when the run stops early) --------------------------------------------
GRAPHS_JSON="$WORK/cuda_graphs.json"
PARALLEL_JSON="$WORK/parallel_gpu.json"
write_summary() {
  PARALLEL_JSON="$PARALLEL_JSON" GRAPHS_JSON="$GRAPHS_JSON" PREFLIGHT="$PREFLIGHT" "$SUMMARY_PY" - "$OUT" <<'EOF' 2>&1 | tee -a "$LOG"
import json, os, sys, xml.etree.ElementTree as ET
from pathlib import Path

out = Path(sys.argv[1])
steps = [l.split("\t") for l in (out / "steps.tsv").read_text().splitlines() if l.strip()]
micro = [json.loads(l) for l in (out / "microbench.jsonl").read_text().splitlines() if l.strip()]

def load(name):
    try:
        return json.loads((out / name).read_text())
    except Exception:
        return {}

def g(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d

def micro_case(bench, **kw):
    return next((r for r in micro if r.get("bench") == bench and all(r.get(k) == v for k, v in kw.items())), {})

tests = {}  # pytest step -> counts, from the junit suites of pytest.xml (one per step, named after it)
try:
    for suite in ET.parse(out / "pytest.xml").getroot().iter("testsuite"):
        a = suite.attrib
        tests[a.get("name")] = (f"{a.get('tests')} run, {a.get('failures')} failed, {a.get('errors')} errors, "
                                f"{a.get('skipped')} skipped")
except Exception:
    pass
ref = {r["name"]: r for r in load("gpu_reference.json").get("rows", [])}
graphs_path = Path(os.environ.get("GRAPHS_JSON", "/nonexistent"))
graphs = json.loads(graphs_path.read_text()) if graphs_path.is_file() else {}
preflight_path = Path(os.environ.get("PREFLIGHT", "/nonexistent"))
preflight = {}
if preflight_path.is_file():
    for line in preflight_path.read_text().splitlines():
        key, _, value = line.partition(": ")
        preflight[key.strip()] = value.strip()
eng = load("gpu_engine.json")
runs = eng.get("runs", {})
big = next((v for k, v in runs.items() if k.startswith("ours_") and "host_time_at_batch" in v), {})
copy = g(micro_case("copy_ceiling"), "gbps") or g(ref.get("copy", {}), "gbps")
rows = [  # (label, value, target: >= if positive, <= if negative, None for a plain figure)
    ("copy bandwidth GB/s (earlier reading 4186)", copy, None),
    ("bf16 GEMM 8192^3 TFLOP/s (earlier 802)", g(ref.get("gemm_bf16_8192", {}), "tflops"), None),
    ("decode ragged U[128,2048] % of copy (>= 80)",
     g(micro_case("ragged_attention", case="decode_ragged_128_2048"), "pct_of_copy"), 80),
    ("decode ctx1024 us, ours", g(micro_case("ragged_attention", case="decode_ctx1024"), "median_us"), None),
    ("decode ctx1024 us, torch SDPA", g(ref.get("decode_sdpa_b64_ctx1024", {}), "us"), None),
    ("prefill 4x2048 ours % of SDPA (>= 50)", g(ref.get("prefill_ours_4x2048", {}), "pct_of_sdpa"), 50),
    ("rmsnorm_qkv T=64 x floor (<= 2)", g(ref.get("rmsnorm_qkv_ours_T64", {}), "x_floor"), -2),
    ("rmsnorm_qkv T=64 kernel x floor (<= 2)", g(micro_case("rmsnorm_qkv_fused", T=64), "x_floor"), -2),
    ("rmsnorm_qkv T=8192 x eager (<= 1.1)", g(ref.get("rmsnorm_qkv_ours_T8192", {}), "x_eager"), -1.1),
    ("engine ours / transformers CB (>= 30)", g(eng, "ratios", "ours_over_hf_cb"), 30),
    ("engine ours / static generate (>= 30)", g(eng, "ratios", "ours_over_hf_static"), 30),
    ("engine 64 req tok/s", g(runs, "ours_64", "tok_per_s"), None),
    ("engine 64 req % of memory floor", g(runs, "ours_64", "pct_of_floor"), None),
    ("engine 256 req tok/s", g(runs, "ours_256", "tok_per_s"), None),
    ("host ms per iteration at batch 256", g(big, "host_time_at_batch", "host_ms_median"), None),
    ("decode host us at batch 256, CUDA graphs (<= 100)", g(graphs, "host_us_at_256_graph"), -100),
]
print("\n==== device check summary ====")
for name, status, secs in steps:
    print(f"  step {name:34s} {status:18s} {secs:>5s}s")
for step in ("kernels", "tests"):
    print(f"  tests/cuda ({step}): {tests.get(step, 'n/a')}")
print()
table = []
for label, value, target in rows:
    verdict = ""
    if value is not None and target is not None:
        verdict = "PASS" if (value >= target if target > 0 else value <= -target) else "MISS"
    shown = "n/a" if value is None else (f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}")
    print(f"  {label:46s} {shown:>10s}  {verdict}")
    table.append({"metric": label, "value": value, "verdict": verdict or None})
summary = {"steps": [{"step": s, "status": st, "seconds": int(t)} for s, st, t in steps], "tests": tests,
           "preflight": preflight, "metrics": table}
if (out / "build_errors.txt").is_file():
    summary["build_errors"] = (out / "build_errors.txt").read_text().splitlines()
if graphs:
    summary["cuda_graphs"] = graphs
parallel = Path(os.environ.get("PARALLEL_JSON", "/nonexistent"))
if parallel.is_file():  # bench/parallel_gpu.py ran (more than one GPU)
    summary["parallel_gpu"] = json.loads(parallel.read_text())
    print("\n  tensor/pipeline parallelism (NCCL):")
    for name, entry in summary["parallel_gpu"].get("configs", {}).items():
        runs = {k: v for k, v in entry.items() if k.startswith("n_workers_") and isinstance(v, dict)}
        print(f"  {name:10s} " + ("ERROR " + entry["error"].splitlines()[-1] if "error" in entry else
              " ".join(f"{k}: {v['tokens_per_s']:.0f} tok/s ({v.get('speedup_vs_1gpu', 1):.2f}x)" for k, v in runs.items())
              + (f"  same greedy tokens {entry['greedy_tokens_same_as_1gpu']:.3f}" if "greedy_tokens_same_as_1gpu" in entry else "")
              + (f"  {entry['tokens_per_s']:.0f} tok/s" if "tokens_per_s" in entry else "")))
(out / "summary.json").write_text(json.dumps(summary, indent=2))
EOF
}

# finish: the summary, then the exit status (0 only if every step run passed).
finish() {
  write_summary
  rm -rf "$WORK"
  local failed
  failed=$(awk -F'\t' '$2 != "ok" && $2 !~ /^skipped\(sanitizer\)/' "$STEPS_TSV" | wc -l)
  log "done in $(( $(date +%s) - START ))s; $failed step(s) not ok"
  [ "$failed" -eq 0 ]
  exit
}

# compute-sanitizer refuses the GPU on some runtimes ("Device not supported", error 999): try it on
# a 10-line program first, and skip memcheck rather than fail the run where it cannot work.
SANITIZER_OK=""
probe_sanitizer() {
  SANITIZER_OK=0
  cat > "$WORK/probe.cu" <<'EOF'
#include <cstdio>
__global__ void fill(int* out, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) out[i] = i; }
int main() {
  int* d = nullptr;
  if (cudaMalloc(&d, 256 * sizeof(int)) != cudaSuccess) return 1;
  fill<<<2, 128>>>(d, 256);
  if (cudaDeviceSynchronize() != cudaSuccess) return 1;
  cudaFree(d);
  std::printf("probe ok\n");
  return 0;
}
EOF
  if timeout 60 "$NVCC" -O1 -o "$WORK/probe" "$WORK/probe.cu" >> "$LOG" 2>&1 &&
     timeout 60 "$SANITIZER" --tool memcheck --error-exitcode 3 "$WORK/probe" > "$WORK/probe.log" 2>&1 &&
     grep -q "ERROR SUMMARY: 0 errors" "$WORK/probe.log"; then
    SANITIZER_OK=1
  fi
  cat "$WORK/probe.log" >> "$LOG" 2>/dev/null
}

# ---- preflight ----------------------------------------------------------------------------------
if want preflight; then
  t0=$(date +%s)
  python_headers
  {
    echo "date: $(date -u +%FT%TZ)"
    echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "cmake: $(timeout 30 "$CMAKE" --version 2>&1 | head -n 1)"
    echo "c++: $(timeout 30 "$CXX_BIN" --version 2>&1 | head -n 1)"
    echo "nvcc: $(timeout 30 "$NVCC" --version 2>&1 | tail -n 1)"
    echo "python: $(timeout 30 "$PY" --version 2>&1 | tail -n 1) ($(command -v "$PY"))"
    echo "Python.h: $PYTHON_H ($([ "$PYTHON_H_OK" = 1 ] && echo found || echo MISSING))"
    echo "torch: $(timeout 60 "$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU")' 2>&1 | tail -n 1)"
    echo "gpu: $("$SMI" --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 1)"
    echo "pytest-timeout: $(timeout 30 "$PY" -c 'import pytest_timeout; print("yes")' 2>/dev/null || echo no)"
    echo "cpus: $CORES"
    echo "free disk: $(df -h "$ROOT" | awk 'NR==2 {print $4 " on " $6}')"
  } > "$PREFLIGHT" 2>&1
  if [ "$PYTHON_H_OK" = 1 ]; then probe_sanitizer; fi
  echo "compute-sanitizer works: $([ "$SANITIZER_OK" = 1 ] && echo yes || echo 'no (memcheck will be skipped)')" >> "$PREFLIGHT"
  tee -a "$LOG" < "$PREFLIGHT"
  if [ "$PYTHON_H_OK" != 1 ]; then
    record preflight "failed(no Python.h)" $(( $(date +%s) - t0 ))
    log "STOP: $PYTHON_H is missing, so _C cannot be built against $PY; install that interpreter's" \
        "development headers (e.g. apt-get install python3-dev) or run with PYTHON=<an interpreter that has them>"
    finish
  fi
  record preflight ok $(( $(date +%s) - t0 ))
fi

# ---- build: _C only -----------------------------------------------------------------------------
# The architecture of this GPU only (sm_90a on Hopper): half the compile time of the default pair.
GPU_CC="$("$SMI" --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')"
case "$GPU_CC" in 90) ARCHS=90a ;; [0-9][0-9]|[0-9][0-9][0-9]) ARCHS="$GPU_CC" ;; *) ARCHS="90a;80" ;; esac
build_module() {
  "$CMAKE" -S "$ROOT" -B "$BUILD_DIR" -G Ninja -DPython_EXECUTABLE="$(command -v "$PY")" -DORCA_CUDA=ON \
    "-DORCA_CUDA_ARCHS=$ARCHS" "-DCMAKE_CUDA_COMPILER=$NVCC" "-DORCA_OUTPUT_DIR=$ROOT/orca_ext" &&
    "$CMAKE" --build "$BUILD_DIR" --target _C -j "$MAX_JOBS" &&
    "$PY" -c "
import torch, orca_ext._C as C
assert C.built_with_cuda(), '_C was built without the CUDA dispatch'
x = torch.randn(3, 64, device='cuda', dtype=torch.bfloat16)
print('import orca_ext._C from', C.__file__, '- CUDA rms_norm:', tuple(C.rms_norm(x, torch.ones(64, device='cuda', dtype=torch.bfloat16), 1e-6).shape))"
}
export -f build_module 2>/dev/null
if want build || { [ "$STEPS" != "preflight" ] && ! module_ok; }; then
  export CMAKE BUILD_DIR PY ROOT ARCHS NVCC MAX_JOBS
  BUILD_LOG="$WORK/build.log"
  if ! python_headers; then
    record build "failed(no Python.h)" 0
    log "STOP: $PYTHON_H is missing, so _C cannot be built against $PY (see preflight)"
    finish
  fi
  run_step_to "$BUILD_LOG" build "$(cap_of build)" bash -c build_module
  build_rc=$?
  cat "$BUILD_LOG" >> "$LOG"
  if [ "$build_rc" -ne 0 ]; then
    # The CMake and compiler error lines, each with the lines after it (a compiler's source line
    # and caret: 2; a CMake message: 8), into the log and build_errors.txt; then stop, so a fixed
    # rerun still fits in the machine's time.
    awk '{ l = tolower($0) }
         l ~ /cmake error/ { n = 8 }
         l ~ /error|failed:|undefined reference|fatal|traceback/ { if (n < 2) n = 2; printf "%d: %s\n", NR, $0; next }
         n > 0 { printf "%d- %s\n", NR, $0; n-- }' "$BUILD_LOG" | head -n 200 > "$BUILD_ERRORS"
    [ -s "$BUILD_ERRORS" ] || tail -n 40 "$BUILD_LOG" > "$BUILD_ERRORS"  # no error line: the end of the log
    [ "$build_rc" -eq 124 ] || [ "$build_rc" -eq 137 ] && echo "(the build ran out of time: its cap or the deadline)" >> "$BUILD_ERRORS"
    { echo "==== build errors (also in build_errors.txt) ===="; cat "$BUILD_ERRORS"; echo "===="; } | tee -a "$LOG"
    log "STOP: the build failed; the steps after it need _C"
    finish
  fi
fi

# ---- pytest steps -------------------------------------------------------------------------------
# -v -rA into tests.log: every test by name as it starts and ends, so a step cut by its timeout still
# names the test it was in. Each step's junit goes to $WORK, and pytest.xml gathers the suites of
# the steps that finished (each suite named after its step).
TIMEOUT_ARG=""
if [ "$DRY_RUN" = "1" ] || "$PY" -c "import pytest_timeout" 2>/dev/null; then TIMEOUT_ARG="--timeout=90"; fi
merge_junit() {
  "$SUMMARY_PY" - "$WORK" "$OUT/pytest.xml" <<'EOF' >> "$LOG" 2>&1
import sys, xml.etree.ElementTree as ET
from pathlib import Path

root = ET.Element("testsuites")
for step in ("kernels", "tests"):
    path = Path(sys.argv[1]) / f"junit_{step}.xml"
    if not path.is_file():
        continue
    try:
        tree = ET.parse(path).getroot()
    except ET.ParseError as exc:
        print(f"junit of {step} unreadable: {exc}")
        continue
    for suite in tree.iter("testsuite"):
        suite.set("name", step)
        root.append(suite)
if len(root):
    ET.ElementTree(root).write(sys.argv[2], encoding="unicode")
EOF
}
run_pytest() {  # run_pytest STEP FILES...
  local step="$1"; shift
  [ "$(left)" -lt 10 ] || echo "==== $step: $* ====" >> "$TESTS_LOG"  # (a step out of time is skipped)
  local from
  from=$(wc -l < "$TESTS_LOG")
  run_step_to "$TESTS_LOG" "$step" "$(cap_of "$step")" "$PY" -m pytest -v -rA -p no:cacheprovider $TIMEOUT_ARG \
    --junitxml="$WORK/junit_$step.xml" "$@"
  local rc=$?
  merge_junit
  tail -n +"$((from + 1))" "$TESTS_LOG" | grep -E "^(FAILED|ERROR) |^=+ .*(passed|failed|error).* =+$" | tail -n 30 >> "$LOG"
  return "$rc"
}

# ---- kernels: the kernel tests, first -------------------------------------------------------------
if want kernels; then
  run_pytest kernels $KERNEL_TESTS
fi

# ---- micro: build the benchmark targets, then run each ------------------------------------------
bench_exe() { [ -x "$BUILD_DIR/bench/cuda/$1" ] && echo "$BUILD_DIR/bench/cuda/$1"; }
if want micro || want memcheck; then
  run_step bench_build "$(cap_of bench_build)" "$CMAKE" --build "$BUILD_DIR" --target cuda_benchmarks -j "$MAX_JOBS"
fi
if want micro; then
  for b in $MICRO_BENCHES; do
    exe="$(bench_exe "$b")"
    if [ -z "$exe" ]; then log "missing $BUILD_DIR/bench/cuda/$b"; record "micro_$b" missing 0; continue; fi
    cap=$MICRO_CAP; [ "$b" = bench_ragged_attention ] && cap=$MICRO_CAP_RAGGED
    run_step "micro_$b" "$cap" bash -c "set -o pipefail; '$exe' | tee -a '$WORK/micro.out'"
    grep '^RESULT ' "$WORK/micro.out" 2>/dev/null | sed 's/^RESULT //' >> "$MICRO"
    : > "$WORK/micro.out"
  done
fi

# ---- tests: the other CUDA tests (graphs and engine first) ----------------------------------------
if want tests; then
  rest=""
  for f in tests/cuda/test_*.py; do
    case " $KERNEL_TESTS $FIRST_TESTS " in *" $f "*) ;; *) rest="$rest $f" ;; esac
  done
  run_pytest tests $FIRST_TESTS $rest
fi

# ---- graphs: CUDA-graph replay of decode iterations (its JSON goes into summary.json) -------------
if want graphs; then
  run_step graphs "$(cap_of graphs)" "$PY" bench/cuda_graphs.py --batches 1,32,256 --iters 15 --out "$GRAPHS_JSON"
fi

# ---- engine: a short run of the engine benchmark, under its own deadline ---------------------------
if want engine; then
  ENGINE_CAP=$(cap_of engine)
  ENGINE_LEFT=$(left); [ "$ENGINE_CAP" -lt "$ENGINE_LEFT" ] && ENGINE_LEFT=$ENGINE_CAP
  ENGINE_LEFT=$(( ENGINE_LEFT - 10 ))  # the benchmark's own deadline, 10 s inside this step's timeout
  run_step engine "$ENGINE_CAP" "$PY" bench/gpu_engine.py --out "$OUT/gpu_engine.json" --hf-output-scale 4 \
    --deadline-s "$(( ENGINE_LEFT > 10 ? ENGINE_LEFT : 10 ))" ${ENGINE_ARGS:-}
fi

# ---- reference: torch references against ours --------------------------------------------------
if want reference; then
  run_step reference "$(cap_of reference)" "$PY" bench/gpu_reference.py --out "$OUT/gpu_reference.json"
fi

# ---- multigpu: tensor/pipeline parallelism over NCCL (only with more than one GPU) -------------
# bench/parallel_gpu.py: greedy parity of tp / pp / tp x pp against one GPU, throughput with 1 vs pp
# batches in flight, the workers' compute/communication split, NCCL transfer times. Its JSON lands
# in summary.json (key "parallel_gpu"), so $OUT keeps its 8 files. One GPU: nothing is recorded.
if want multigpu; then
  NGPU=$("$SMI" -L 2>/dev/null | grep -c '^GPU ')
  if [ "${NGPU:-0}" -gt 1 ]; then
    run_step multigpu "$(cap_of multigpu)" "$PY" bench/parallel_gpu.py --gpus "$NGPU" --out "$PARALLEL_JSON"
  else
    log "multigpu: ${NGPU:-0} GPU(s) visible; the tensor/pipeline parallel checks need more than one"
  fi
fi
# ---- end of multigpu ----------------------------------------------------------------------------

# ---- memcheck, last -------------------------------------------------------------------------------
if want memcheck; then
  [ -z "$SANITIZER_OK" ] && probe_sanitizer
  if [ "$SANITIZER_OK" != 1 ]; then
    log "SKIP memcheck: compute-sanitizer does not work on this machine (see preflight)"
    record memcheck "skipped(sanitizer)" 0
  else
    for b in $MEMCHECKED; do
      exe="$(bench_exe "$b")"
      if [ -z "$exe" ]; then record "memcheck_$b" missing 0; continue; fi
      run_step "memcheck_$b" "$MEMCHECK_CAP" "$SANITIZER" --tool memcheck --error-exitcode 3 --leak-check no "$exe" --small
    done
  fi
fi

finish
