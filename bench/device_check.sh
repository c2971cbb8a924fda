#!/usr/bin/env bash
# The GPU check of the CUDA path, on one machine with an NVIDIA GPU (written for an H200): build _C,
# run the CUDA tests, the microbenchmarks, compute-sanitizer, the torch references, CUDA-graph
# replay and the engine benchmark, then write one summary.
#
# Time: the whole check fits in BUDGET_S seconds (default 360). The step estimates below add up to
# 360 s, and a hard deadline enforces the budget: every step after preflight runs under `timeout`
# with the lesser of its cap and the time left before BUDGET_S - 15 s (15 s are kept for the
# summary); a step that would start with under 10 s left is skipped. Preflight's probes each run
# under their own timeout.
# Output: at most 8 files in $OUT, always these names: device_check.log, steps.tsv, preflight.txt,
# pytest.xml, microbench.jsonl, gpu_reference.json, gpu_engine.json, summary.json. Results of the
# other steps (CUDA graphs, tensor/pipeline parallelism) go into summary.json, not files of their own.
#
#   OUT=/some/dir bash bench/device_check.sh           all steps
#   STEPS=tests,micro bash bench/device_check.sh       only these (build runs first if _C is missing)
#   DRY_RUN=1 OUT=/tmp/x bash bench/device_check.sh    stubs instead of GPU tools: checks the control
#                                                      flow on a CPU (tests/test_device_check.py)
#
# Steps, in this order (the estimate in seconds, then the cap):
#   preflight  15   -  nvcc, GPU, torch, free disk; does compute-sanitizer work on a 10-line program?
#   build      75 180  _C only (CMake target _C) against this machine's torch, into orca_ext/
#   tests      60 120  pytest tests/cuda: kernels vs float64 references, the engine vs transformers
#                      (random weights, token-id prompts, no tokenizer files)
#   micro      60 120  the CUDA microbenchmarks: built after _C, so a failing one never costs _C;
#                      each validates against bench/common/reference.h, then times with CUDA graphs
#   memcheck   30  60  compute-sanitizer memcheck of the small cases (skipped if preflight says the
#                      sanitizer does not work on this machine's runtime)
#   reference  20  60  bench/gpu_reference.py: torch references and ours, graph-timed, vs targets
#   graphs     15  60  bench/cuda_graphs.py: host time per decode iteration, eager vs CUDA-graph
#                      replay, at batch 1, 32, 256 (target < 100 us at 256); into summary.json
#   multigpu    - 240  only with more than one GPU visible: bench/parallel_gpu.py (tensor/pipeline
#                      parallelism over NCCL); into summary.json
#   engine     85 rest bench/gpu_engine.py: ours first, transformers baselines last, its own deadline
#   summary            always: a table of steps and metrics, summary.json
# The script goes on after a failed step, and each step appends its results to $OUT as soon as it
# ends, so a run cut short keeps what finished. Exit status 0 only if every step run passed.
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
BUDGET_S="${BUDGET_S:-360}"
RESERVE_S=15                                  # kept for the summary
ALL_STEPS="preflight,build,tests,micro,memcheck,reference,graphs,multigpu,engine"
STEPS="${STEPS:-$ALL_STEPS}"
DRY_RUN="${DRY_RUN:-0}"
START=$(date +%s)
DEADLINE=$((START + BUDGET_S - RESERVE_S))
LOG="$OUT/device_check.log"
STEPS_TSV="$OUT/steps.tsv"
MICRO="$OUT/microbench.jsonl"
PREFLIGHT="$OUT/preflight.txt"
: > "$LOG"; : > "$STEPS_TSV"; : > "$MICRO"

# Tools. DRY_RUN replaces each with a stub (see make_stubs).
PY="${PYTHON:-python3}"                       # the machine's python, with its CUDA torch
SUMMARY_PY="$PY"
NVCC="${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}"
SANITIZER="${SANITIZER:-$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)}"
SMI="${SMI:-nvidia-smi}"
CMAKE="${CMAKE:-cmake}"
BUILD_DIR="${BUILD_DIR:-$ROOT/build/device}"
WORK="$(mktemp -d)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }
want() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$STEPS_TSV"; }  # step, status, seconds
left() { echo $((DEADLINE - $(date +%s))); }

# run_step NAME CAP CMD...: CMD under timeout min(CAP, time left), output into the log.
run_step() {
  local name="$1" cap="$2"; shift 2
  local limit t0 rc status dt
  limit=$(left)
  if [ "$limit" -lt 10 ]; then
    log "SKIP $name: out of time"; record "$name" "skipped(time)" 0; return 124
  fi
  [ "$cap" -lt "$limit" ] && limit=$cap
  log "START $name (limit ${limit}s): $*"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
  rc=$?
  dt=$(( $(date +%s) - t0 ))
  status=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=timeout; elif [ "$rc" -ne 0 ]; then status="failed(rc=$rc)"; fi
  record "$name" "$status" "$dt"
  log "END $name: $status in ${dt}s"
  return "$rc"
}

# DRY_RUN: stand-ins for every GPU-side tool. By default they act out a successful run with fixed
# numbers. A test steers them through the environment:
#   DRY_RUN_OUTPUTS=DIR       a tool's output comes from DIR when the file is there: pytest.xml,
#                             gpu_reference.json, cuda_graphs.json, gpu_engine.json, parallel_gpu.json
#                             (what the python scripts write to --out / --junitxml) and <bench>.out
#                             (the stdout of a CUDA microbenchmark, e.g. bench_ceiling.out)
#   DRY_RUN_FAIL=STEP         that step's command exits 1 (build, tests, reference, graphs, multigpu,
#                             engine, micro_<bench>; "sanitizer": compute-sanitizer refuses the GPU)
#   DRY_RUN_SLEEP=STEP:S      that step's command sleeps S seconds first (a hang)
#   DRY_RUN_GPUS=N            nvidia-smi lists N GPUs (default 1)
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
  cat > "$s/cmake" <<'EOF'
#!/usr/bin/env bash
# --build DIR --target cuda_benchmarks: one copy of the benchmark stub per benchmark.
if [ "${1:-}" = "--build" ] && [[ " $* " == *" cuda_benchmarks "* ]]; then
  mkdir -p "$2/bench/cuda"
  for b in bench_ceiling bench_rms_norm bench_slab_write bench_slab_move bench_rmsnorm_qkv bench_ragged_attention quant_gemm_bench; do
    cp "$(dirname "$0")/bench" "$2/bench/cuda/$b"
  done
fi
echo "cmake $* (dry run)"
EOF
  cat > "$s/python" <<'EOF'
#!/usr/bin/env bash
# Acts out pytest, the benchmark scripts and the inline checks (the import of _C counts as build).
step=other
case "$*" in
  *"-m pytest"*) step=tests ;; *gpu_reference.py*) step=reference ;; *gpu_engine.py*) step=engine ;;
  *cuda_graphs.py*) step=graphs ;; *parallel_gpu.py*) step=multigpu ;;
  *orca_ext._C*) step=build ;;
esac
if [ -n "${DRY_RUN_SLEEP:-}" ] && [ "${DRY_RUN_SLEEP%%:*}" = "$step" ]; then sleep "${DRY_RUN_SLEEP#*:}"; fi
if [ "${DRY_RUN_FAIL:-}" = "$step" ]; then echo "dry run: $step fails"; exit 1; fi
out=""; junit=""
for a in "$@"; do case "$a" in --junitxml=*) junit="${a#--junitxml=}" ;; esac; done
while [ $# -gt 0 ]; do [ "$1" = "--out" ] && out="$2"; shift; done
emit() {  # emit FILE DEFAULT DEST: the canned FILE if the test gave one, else DEFAULT
  if [ -n "${DRY_RUN_OUTPUTS:-}" ] && [ -f "$DRY_RUN_OUTPUTS/$1" ]; then cp "$DRY_RUN_OUTPUTS/$1" "$3"; else echo "$2" > "$3"; fi
}
case "$step" in
  tests) emit pytest.xml '<testsuites><testsuite name="pytest" tests="3" failures="0" errors="0" skipped="0"/></testsuites>' "$junit" ;;
  reference) emit gpu_reference.json '{"rows": [{"name": "copy", "gbps": 4200.0}]}' "$out" ;;
  engine) emit gpu_engine.json '{"runs": {"ours_64": {"tok_per_s": 1000.0}}, "ratios": {}}' "$out" ;;
  graphs) emit cuda_graphs.json '{"host_us_at_256_graph": 50.0, "rows": []}' "$out" ;;
  multigpu) emit parallel_gpu.json '{"gpus": 2, "configs": {}}' "$out" ;;
esac
echo "python $step (dry run)"
EOF
  chmod +x "$s"/*
  NVCC="$s/nvcc"; SMI="$s/nvidia-smi"; SANITIZER="$s/compute-sanitizer"; CMAKE="$s/cmake"; PY="$s/python"
  SUMMARY_PY="$(command -v python3)"
  BUILD_DIR="$WORK/build"
}
[ "$DRY_RUN" = "1" ] && make_stubs

module_ok() {  # _C imports with the CUDA dispatch compiled in
  "$PY" -c "import orca_ext._C as C, sys; sys.exit(0 if C.built_with_cuda() else 1)" >> "$LOG" 2>&1
}

for step in ${STEPS//,/ }; do
  case ",$ALL_STEPS," in *",$step,"*) ;; *) echo "unknown step '$step'; steps are $ALL_STEPS" >&2; exit 2 ;; esac
done
log "device check in $ROOT -> $OUT; steps: $STEPS; budget ${BUDGET_S}s (dry run: $DRY_RUN)"
log "estimate: preflight 15 + build 75 + tests 60 + micro 60 + memcheck 30 + reference 20 + graphs 15 + engine 85 = 360 s"

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
  {
    echo "date: $(date -u +%FT%TZ)"
    echo "commit: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "nvcc: $("$NVCC" --version 2>&1 | tail -n 1)"
    echo "gpu: $("$SMI" --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | head -n 1)"
    echo "torch: $(timeout 60 "$PY" -c 'import torch; print(torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else "NO GPU")' 2>&1 | tail -n 1)"
    echo "pytest-timeout: $(timeout 30 "$PY" -c 'import pytest_timeout; print("yes")' 2>/dev/null || echo no)"
    echo "cpus: $(nproc)"
    echo "free disk: $(df -h "$ROOT" | awk 'NR==2 {print $4 " on " $6}')"
  } > "$PREFLIGHT" 2>&1
  probe_sanitizer
  echo "compute-sanitizer works: $([ $SANITIZER_OK = 1 ] && echo yes || echo 'no (memcheck will be skipped)')" >> "$PREFLIGHT"
  tee -a "$LOG" < "$PREFLIGHT"
  record preflight ok $(( $(date +%s) - t0 ))
fi

# ---- build: _C only -----------------------------------------------------------------------------
# The architecture of this GPU only (sm_90a on Hopper): half the compile time of the default pair.
CC="$("$SMI" --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')"
case "$CC" in 90) ARCHS=90a ;; [0-9][0-9]|[0-9][0-9][0-9]) ARCHS="$CC" ;; *) ARCHS="90a;80" ;; esac
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
  run_step build 180 bash -c build_module
fi

# ---- tests --------------------------------------------------------------------------------------
if want tests; then
  TIMEOUT_ARG=""
  if [ "$DRY_RUN" = "1" ] || "$PY" -c "import pytest_timeout" 2>/dev/null; then TIMEOUT_ARG="--timeout=90"; fi
  run_step tests 120 "$PY" -m pytest -q -p no:cacheprovider $TIMEOUT_ARG --junitxml="$OUT/pytest.xml" tests/cuda
fi

# ---- micro: build the benchmark targets, then run each ------------------------------------------
bench_exe() { [ -x "$BUILD_DIR/bench/cuda/$1" ] && echo "$BUILD_DIR/bench/cuda/$1"; }
if want micro || want memcheck; then
  run_step bench_build 90 "$CMAKE" --build "$BUILD_DIR" --target cuda_benchmarks -j "$MAX_JOBS"
fi
if want micro; then
  for b in bench_ceiling bench_rms_norm bench_slab_write bench_slab_move bench_rmsnorm_qkv bench_ragged_attention quant_gemm_bench; do
    exe="$(bench_exe "$b")"
    if [ -z "$exe" ]; then log "missing $BUILD_DIR/bench/cuda/$b"; record "micro_$b" missing 0; continue; fi
    cap=30; [ "$b" = bench_ragged_attention ] && cap=60  # it sweeps items_per_sm x decode_stages
    run_step "micro_$b" "$cap" bash -c "set -o pipefail; '$exe' | tee -a '$WORK/micro.out'"
    grep '^RESULT ' "$WORK/micro.out" 2>/dev/null | sed 's/^RESULT //' >> "$MICRO"
    : > "$WORK/micro.out"
  done
fi

# ---- memcheck -----------------------------------------------------------------------------------
if want memcheck; then
  [ -z "$SANITIZER_OK" ] && probe_sanitizer
  if [ "$SANITIZER_OK" != 1 ]; then
    log "SKIP memcheck: compute-sanitizer does not work on this machine (see preflight)"
    record memcheck "skipped(sanitizer)" 0
  else
    for b in bench_slab_write bench_slab_move bench_ragged_attention; do
      exe="$(bench_exe "$b")"
      if [ -z "$exe" ]; then record "memcheck_$b" missing 0; continue; fi
      run_step "memcheck_$b" 30 "$SANITIZER" --tool memcheck --error-exitcode 3 --leak-check no "$exe" --small
    done
  fi
fi

# ---- reference and engine -----------------------------------------------------------------------
if want reference; then
  run_step reference 60 "$PY" bench/gpu_reference.py --out "$OUT/gpu_reference.json"
fi

# ---- graphs: CUDA-graph replay of decode iterations (its JSON goes into summary.json) -------------
GRAPHS_JSON="$WORK/cuda_graphs.json"
if want graphs; then
  run_step graphs 60 "$PY" bench/cuda_graphs.py --batches 1,32,256 --iters 15 --out "$GRAPHS_JSON"
fi

# ---- multigpu: tensor/pipeline parallelism over NCCL (only with more than one GPU) -------------
# bench/parallel_gpu.py: greedy parity of tp / pp / tp x pp against one GPU, throughput with 1 vs pp
# batches in flight, the workers' compute/communication split, NCCL transfer times. Its JSON lands
# in summary.json (key "parallel_gpu"), so $OUT keeps its 8 files. One GPU: nothing is recorded.
PARALLEL_JSON="$WORK/parallel_gpu.json"
if want multigpu; then
  NGPU=$("$SMI" -L 2>/dev/null | grep -c '^GPU ')
  if [ "${NGPU:-0}" -gt 1 ]; then
    run_step multigpu 240 "$PY" bench/parallel_gpu.py --gpus "$NGPU" --out "$PARALLEL_JSON"
  else
    log "multigpu: ${NGPU:-0} GPU(s) visible; the tensor/pipeline parallel checks need more than one"
  fi
fi
# ---- end of multigpu ----------------------------------------------------------------------------

if want engine; then
  ENGINE_CAP=600
  ENGINE_LEFT=$(left); [ "$ENGINE_CAP" -lt "$ENGINE_LEFT" ] && ENGINE_LEFT=$ENGINE_CAP
  ENGINE_LEFT=$(( ENGINE_LEFT - 10 ))  # the benchmark's own deadline, 10 s inside this step's timeout
  run_step engine "$ENGINE_CAP" "$PY" bench/gpu_engine.py --out "$OUT/gpu_engine.json" --hf-output-scale 4 \
    --deadline-s "$(( ENGINE_LEFT > 10 ? ENGINE_LEFT : 10 ))" ${ENGINE_ARGS:-}
fi

# ---- summary ------------------------------------------------------------------------------------
PARALLEL_JSON="$PARALLEL_JSON" GRAPHS_JSON="$GRAPHS_JSON" "$SUMMARY_PY" - "$OUT" <<'EOF' 2>&1 | tee -a "$LOG"
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

tests = "n/a"
try:
    suite = ET.parse(out / "pytest.xml").getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    a = suite.attrib
    tests = f"{a.get('tests')} run, {a.get('failures')} failed, {a.get('errors')} errors, {a.get('skipped')} skipped"
except Exception:
    pass
ref = {r["name"]: r for r in load("gpu_reference.json").get("rows", [])}
graphs_path = Path(os.environ.get("GRAPHS_JSON", "/nonexistent"))
graphs = json.loads(graphs_path.read_text()) if graphs_path.is_file() else {}
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
print(f"  tests/cuda: {tests}\n")
table = []
for label, value, target in rows:
    verdict = ""
    if value is not None and target is not None:
        verdict = "PASS" if (value >= target if target > 0 else value <= -target) else "MISS"
    shown = "n/a" if value is None else (f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}")
    print(f"  {label:46s} {shown:>10s}  {verdict}")
    table.append({"metric": label, "value": value, "verdict": verdict or None})
summary = {"steps": [{"step": s, "status": st, "seconds": int(t)} for s, st, t in steps], "tests": tests,
           "metrics": table}
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

rm -rf "$WORK"
failed=$(awk -F'\t' '$2 != "ok" && $2 !~ /^skipped\(sanitizer\)/' "$STEPS_TSV" | wc -l)
log "done in $(( $(date +%s) - START ))s; $failed step(s) not ok"
[ "$failed" -eq 0 ]
