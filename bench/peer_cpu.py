"""Our engine against llama.cpp's `llama-server` on the CPU, on the same model and precision, in one
interleaved run.

Per dtype (float32 <-> GGUF F32, bfloat16 <-> GGUF BF16) and per round, each system runs:
  * one stream: one request, a 128-token prompt, 128 output tokens. Decode tok/s is measured the
    same way for both, over the tokens after the first (llama-server: its own `timings`, ours:
    first-token to finish time), next to the end-to-end rate;
  * one stream over a long context (--stream-contexts N ...): the same with a prompt of N random
    tokens, so that each decode step reads N tokens of K and V. llama-server gets a context of
    N + 256 and keeps K and V in our precision (-ctk/-ctv f32 or bf16; by default it keeps them in
    f16, which at short contexts makes no measurable difference);
  * batches: N requests with prompts and outputs U[16,128] (random ids, EOS ignored), all sent at
    t = 0, with the batch limit 16 and 32 (our max_batch_size; llama-server --parallel). Reports
    output tok/s and the cores the system kept busy (CPU seconds per wall second of the run).
  * prompt processing: prompts of N random tokens (--prompt-lengths, default 512 and 2048; the
    shapes of llama-bench's pp512 / pp2048) and one output token. Both sides first process one
    full-length prompt untimed (llama-bench's own warm-up), then --pp-reps timed ones. Ours: N /
    each request's wall time, through the engine's own chunked prefill, every prompt new (so the
    prefix cache never hits); llama.cpp: llama-bench -p N -n 0 -r REPS (its per-repetition
    prompt-processing tok/s on the same GGUF).
Systems alternate inside each round; the report keeps min and median over every run (each
prompt-processing repetition is a run). The streaming read bandwidth of this machine
(`_C.stream_read`, all threads, on huge pages like the engine's weights) is measured before every
round and right before each single-stream case; the single-stream bound is the median of those
readings (on a shared host one reading can be an outlier) divided by the bytes a decode step reads
(all weights + the lm_head + the KV cache at the mean context).

Our side runs in this process (orca_ext.Server, the engine without HTTP); llama.cpp runs as its
HTTP server, driven with token-id prompts on /completion. Everything runs with --threads threads.
Without a llama-server binary only our side runs.

Building llama.cpp (not a dependency of `make test`; the PyPI sdist of llama-cpp-python vendors
llama.cpp's source):
    pip download --no-deps --no-binary :all: llama-cpp-python -d /tmp/llamacpp
    tar xzf /tmp/llamacpp/llama_cpp_python-*.tar.gz -C /tmp/llamacpp
    cd /tmp/llamacpp/llama_cpp_python-*/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
    cmake --build build -j 2 --target llama-server llama-batched-bench
On a CPU with AMX, llama.cpp built this way with GCC 12 dies with SIGILL in its AMX-INT8 kernels
(quantized files): it builds its tile configuration on the stack, and GCC's _tile_loadconfig lets
the compiler drop those stores. Adding -DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
(and the same -DCMAKE_CXX_FLAGS) to the first cmake line gives its AVX-512 code instead.
The GGUFs are converted from our float32 checkpoint by that tree's convert_hf_to_gguf.py (cached).

    python bench/peer_cpu.py --llama-dir /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        [--dtypes float32 bfloat16] [--ggufs FILE.gguf ...] [--quant-activations auto float32 int8] [--rounds 2] \\
        [--out bench/out/peer_cpu.json]
--ggufs runs both engines on the same quantized file as shipped (the bytes per token of the read
bound are then the file's tensor bytes); --gguf-dtypes bfloat16 runs ours with bf16 activations and
KV on it too (llama.cpp's long-context streams then keep K and V in bf16).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import logging
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

log = logging.getLogger("bench.peer_cpu")

GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}


class Precision:
    """One row group of the comparison: what our engine loads (a folder in a dtype, or a GGUF
    served as its blocks with float32 or int8 activations) and the GGUF llama.cpp runs (None:
    ours only)."""

    def __init__(self, label: str, our_model: str, our_dtype: str, llama_gguf: Optional[Path],
                 weight_bytes: Optional[float] = None, quant_activations: str = "auto"):
        self.label, self.our_model, self.our_dtype, self.llama_gguf = label, our_model, our_dtype, llama_gguf
        self.weight_bytes = weight_bytes  # bytes of weights one decode step reads (None: from the dtype)
        self.quant_activations = quant_activations  # EngineConfig.quant_activations for our side


def resolve_gguf(name: Path, cache: Path) -> Path:
    """A --ggufs entry: a file here, the embedded default model's GGUF by its bare name, or else a
    file of the GGUF cache."""
    from orca_ext.default_model import GGUF_FILE, default_gguf_path
    if name.exists():
        return name
    if str(name) == GGUF_FILE:
        return default_gguf_path()
    return cache / name


def gguf_weight_bytes(path: Path) -> float:
    """Bytes one decode step reads from a GGUF served as its blocks: every tensor once except the
    token embedding, of which a step reads one row, unless it is also the (tied) lm_head."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    return float(sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight" or tied))


# -- machine --------------------------------------------------------------------------------------
def read_bandwidth_gbs(mib: int = 512, reps: int = 5) -> float:
    """Streaming-read ceiling of this process, measured on a short-lived thread: OpenMP keeps a
    worker pool per thread that runs parallel regions, and a second live pool beside the Server's
    loop thread makes its kernels' workers sleep between regions (orca_ext/kernel_thread.py)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(_read_bandwidth_gbs, mib, reps).result()


def _read_bandwidth_gbs(mib: int, reps: int) -> float:
    """The best of `reps` reads of a `mib` MiB buffer, in huge pages where the platform allows (as
    the engine's CPU weights are)."""
    from orca_ext import _C
    from orca_ext.models import huge_pages

    n = mib << 17
    words = huge_pages.empty((n,), torch.int64) if huge_pages.active() else torch.empty(n, dtype=torch.int64)
    words.copy_(torch.arange(n, dtype=torch.int64))
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        _C.stream_read(words)
        best = min(best, time.perf_counter() - t0)
    return words.numel() * 8 / best * 1e-9


def decode_bytes_per_token(model_dir: str, dtype: str, context: int, weight_bytes: Optional[float] = None) -> float:
    """Bytes one decode step reads: every weight matrix once (the tied lm_head counts once, the
    embedding row gather is negligible; `weight_bytes` when given) plus the KV cache of `context`
    tokens (in `dtype`)."""
    from orca_ext.models.config import ModelSpec

    s = ModelSpec.from_pretrained(model_dir)
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    inter = cfg["intermediate_size"]
    h, d = s.hidden_size, s.head_dim
    per_layer = (s.num_heads + 2 * s.num_kv_heads) * d * h + h * s.num_heads * d + 2 * inter * h + h * inter
    elems = s.num_layers * per_layer + s.vocab_size * h
    kv = 2 * s.num_layers * s.num_kv_heads * d * context
    size = 4 if dtype == "float32" else 2
    return float((elems * size if weight_bytes is None else weight_bytes) + kv * size)


class CpuMeter:
    """CPU seconds per wall second of a process (this one, or a pid via /proc)."""

    def __init__(self, pid: Optional[int] = None):
        self.pid = pid

    def _cpu(self) -> float:
        if self.pid is None:
            return time.process_time()
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def __enter__(self):
        self.cpu0, self.wall0 = self._cpu(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall0
        self.cores = (self._cpu() - self.cpu0) / self.wall


# -- workload -------------------------------------------------------------------------------------
def batch_workload(n: int, seed: int, vocab: int, special: set[int]) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    normal = [t for t in range(vocab) if t not in special]
    return [([rng.choice(normal) for _ in range(rng.randint(16, 128))], rng.randint(16, 128)) for _ in range(n)]


def stream_prompt(seed: int, vocab: int, special: set[int]) -> list[int]:
    rng = random.Random(seed + 1)
    normal = [t for t in range(vocab) if t not in special]
    return [rng.choice(normal) for _ in range(128)]


# -- our engine -----------------------------------------------------------------------------------
def ours(model_dir: str, dtype: str, batch: int, jobs, stream: bool, quant_activations: str = "auto") -> dict:
    from orca_ext import SamplingParams, Server

    with Server(model_dir, device="cpu", dtype=dtype, max_batch_size=batch,
                quant_activations=quant_activations) as server:
        server.generate([jobs[0][0][:8]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        with CpuMeter() as meter:
            ids = [server.submit(p, SamplingParams(max_tokens=o, ignore_eos=True)) for p, o in jobs]
            outs = [server.result(i) for i in ids]
    n_out = sum(len(o.token_ids) for o in outs)
    if any(len(o.token_ids) != n for o, (_, n) in zip(outs, jobs)):
        raise RuntimeError("our engine returned a request short of its output length")
    r = dict(output_tokens=n_out, wall_s=meter.wall, tok_s=n_out / meter.wall, cores_busy=meter.cores)
    if stream:
        o = outs[0]
        r["decode_tok_s"] = (len(o.token_ids) - 1) / (o.finish_time - o.first_token_time)
    return r


def ours_prompt(model_dir: str, dtype: str, prompts: list[list[int]], quant_activations: str = "auto") -> list[dict]:
    """Prompt processing: the first prompt untimed (warm-up at full length), then each further one
    timed alone, as one request with a single output token."""
    from orca_ext import SamplingParams, Server

    one_token = SamplingParams(max_tokens=1, ignore_eos=True)
    runs = []
    with Server(model_dir, device="cpu", dtype=dtype, max_batch_size=1,
                quant_activations=quant_activations) as server:
        server.generate([prompts[0]], one_token)
        for prompt in prompts[1:]:
            with CpuMeter() as meter:
                server.generate([prompt], one_token)
            runs.append(dict(tok_s=len(prompt) / meter.wall, wall_s=meter.wall, cores_busy=meter.cores))
    return runs


def prompt_ids(n: int, seed: int, vocab: int, special: set[int]) -> list[int]:
    rng = random.Random(seed)
    normal = [i for i in range(vocab) if i not in special]
    return [rng.choice(normal) for _ in range(n)]


# -- llama.cpp ------------------------------------------------------------------------------------
def llama_bench_prompt(binary: Path, gguf: Path, threads: int, n: int, reps: int) -> list[dict]:
    """llama-bench's pp<n>: prompt-processing tok/s of each of `reps` repetitions (after its own
    full-length warm-up)."""
    import resource

    def children_cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    cpu0, t0 = children_cpu(), time.perf_counter()
    out = subprocess.run([str(binary), "-m", str(gguf), "-p", str(n), "-n", "0", "-t", str(threads), "-r", str(reps),
                          "-o", "json"], check=True, capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    samples = [float(ts) for ts in json.loads(out.stdout)[0]["samples_ts"]]
    cores = (children_cpu() - cpu0) / wall  # the whole call's, model load and warm-up included
    return [dict(tok_s=ts, wall_s=n / ts, cores_busy=cores) for ts in samples]


def convert_gguf(llama_dir: Path, model_dir: str, dtype: str, cache: Path) -> Path:
    out = cache / f"{Path(model_dir).name}-{GGUF_TYPES[dtype]}.gguf"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    env = dict(os.environ, PYTHONPATH=str(llama_dir / "gguf-py"))
    subprocess.run([sys.executable, str(llama_dir / "convert_hf_to_gguf.py"), model_dir, "--outtype",
                    GGUF_TYPES[dtype], "--outfile", str(tmp)], check=True, env=env)
    tmp.rename(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    def __init__(self, binary: Path, gguf: Path, parallel: int, threads: int, ctx_per_slot: int = 512,
                 kv_type: Optional[str] = None):
        self.port = free_port()
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-t", str(threads),
               "-tb", str(threads), "--parallel", str(parallel), "-c", str(parallel * ctx_per_slot),
               "--cont-batching", "--no-webui", "--log-disable"]
        if kv_type is not None:
            cmd += ["-ctk", kv_type, "-ctv", kv_type]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.3)
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {cmd}")
        self.close()
        raise RuntimeError("llama-server did not become healthy in 120 s")

    def complete(self, prompt: list[int], n: int) -> dict:
        body = json.dumps(dict(prompt=prompt, n_predict=n, ignore_eos=True, cache_prompt=False, temperature=0.0,
                               top_k=1, stream=False)).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def llama(binary: Path, gguf: Path, threads: int, batch: int, jobs, stream: bool, ctx_per_slot: int = 512,
          kv_type: Optional[str] = None) -> dict:
    with LlamaServer(binary, gguf, batch, threads, ctx_per_slot, kv_type) as server:
        server.complete(jobs[0][0][:8], 4)  # warm-up
        with CpuMeter(server.proc.pid) as meter:
            with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs)) as pool:
                outs = list(pool.map(lambda j: server.complete(*j), jobs))
    n_out = sum(o["tokens_predicted"] for o in outs)
    if any(o["tokens_predicted"] != n for o, (_, n) in zip(outs, jobs)):
        raise RuntimeError("llama-server returned a request short of its output length")
    r = dict(output_tokens=n_out, wall_s=meter.wall, tok_s=n_out / meter.wall, cores_busy=meter.cores)
    if stream:
        t = outs[0]["timings"]
        r["decode_tok_s"] = t["predicted_per_second"]
    return r


# -- main -----------------------------------------------------------------------------------------
def summarize(values: list[float]) -> dict:
    return dict(min=min(values), median=statistics.median(values), runs=values)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--llama-dir", type=Path, default=None,
                   help="llama.cpp source tree with build/bin/llama-server (none: our engine only)")
    p.add_argument("--model", default=None, help="checkpoint folder (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"], choices=list(GGUF_TYPES))
    p.add_argument("--ggufs", nargs="*", type=Path, default=[],
                   help="GGUF files both engines serve as they are (ours: blocks, --quant-activations), "
                        "e.g. the embedded SmolLM2-135M-Instruct.Q4_1.gguf; a name that is not a file here "
                        "is read from --gguf-cache")
    p.add_argument("--gguf-dtypes", nargs="+", default=["float32"], choices=list(GGUF_TYPES),
                   help="our activation and KV precision for each --ggufs file (one row group each)")
    p.add_argument("--quant-activations", nargs="+", default=["auto"], choices=["auto", "float32", "int8"],
                   help="our products of each --ggufs file (EngineConfig.quant_activations; one row group "
                        "each; llama.cpp runs once per file, beside the first)")
    p.add_argument("--batch-limits", type=int, nargs="*", default=[16, 32], help="none: single streams only")
    p.add_argument("--stream-contexts", type=int, nargs="*", default=[],
                   help="prompt lengths of extra single streams over a long context (none by default)")
    p.add_argument("--prompt-lengths", type=int, nargs="*", default=[512, 2048],
                   help="prompt-processing rows (llama-bench -p N); none: skip them")
    p.add_argument("--pp-reps", type=int, default=3,
                   help="timed prompts per prompt length, system and round (after one untimed warm-up)")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", os.cpu_count() or 1)))
    p.add_argument("--gguf-cache", type=Path, default=Path.home() / ".cache" / "orca_ext" / "gguf")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)

    from orca_ext.models import load_tokenizer
    from orca_ext.models.config import ModelSpec

    if args.model is None:
        from orca_ext.default_model import default_model_path
        args.model = str(default_model_path())
    spec = ModelSpec.from_pretrained(args.model)
    special = set(load_tokenizer(args.model).all_special_ids)
    jobs = batch_workload(args.requests, 0, spec.vocab_size, special)
    single = [(stream_prompt(0, spec.vocab_size, special), 128)]
    long_streams = {n: [(prompt_ids(n, 7 * n, spec.vocab_size, special), 128)] for n in args.stream_contexts}

    binary = args.llama_dir / "build" / "bin" / "llama-server" if args.llama_dir else None
    if binary is not None and not binary.exists():
        log.warning("no llama-server at %s: running our engine only", binary)
        binary = None
    bench_binary = binary.parent / "llama-bench" if binary is not None else None
    if bench_binary is not None and not bench_binary.exists():
        log.warning("no llama-bench next to llama-server: prompt-processing rows for our engine only")
        bench_binary = None
    precisions = [Precision(d, args.model, d, convert_gguf(args.llama_dir, args.model, d, args.gguf_cache)
                            if binary else None) for d in args.dtypes]
    ggufs = [resolve_gguf(g, args.gguf_cache) for g in args.ggufs]
    precisions += [Precision(g.name + ("" if dt == "float32" else f"@{dt}") + ("" if acts == "auto" else f"+{acts}"),
                             str(g), dt, g if binary and i == 0 else None, gguf_weight_bytes(g), acts)
                   for g in ggufs for dt in args.gguf_dtypes for i, acts in enumerate(args.quant_activations)]

    # (name, batch limit, requests, context per llama.cpp slot, whether llama.cpp keeps K and V in our precision)
    cases = [("stream", 1, single, 512, False)]
    cases += [(f"stream{n}", 1, work, n + 256, True) for n, work in long_streams.items()]
    cases += [(f"batch{b}", b, jobs, 512, False) for b in args.batch_limits]
    runs: dict[str, list[dict]] = {}
    ceilings = []
    for rnd in range(args.rounds):
        ceilings.append(read_bandwidth_gbs())
        log.info("round %d: streaming read %.1f GB/s", rnd + 1, ceilings[-1])
        for prec in precisions:
            dtype = prec.label
            for case, limit, work, ctx_per_slot, same_kv in cases:
                stream = case.startswith("stream")
                if case == "stream":  # the ceiling right next to the runs it bounds
                    ceilings.append(read_bandwidth_gbs())
                systems = [("ours", lambda: ours(prec.our_model, prec.our_dtype, limit, work, stream,
                                                 prec.quant_activations))]
                if prec.llama_gguf is not None:
                    kv_type = GGUF_TYPES[prec.our_dtype] if same_kv else None
                    systems.append(("llama.cpp", lambda: llama(binary, prec.llama_gguf, args.threads, limit, work,
                                                               stream, ctx_per_slot, kv_type)))
                if rnd % 2:
                    systems.reverse()
                for name, fn in systems:
                    r = fn()
                    runs.setdefault(f"{dtype}/{case}/{name}", []).append(r)
                    log.info("  %-9s %-8s %-9s %7.1f tok/s%s, %.2f cores busy", dtype, case, name, r["tok_s"],
                             f" (decode {r['decode_tok_s']:.1f})" if "decode_tok_s" in r else "", r["cores_busy"])
            for n in args.prompt_lengths:
                # warm-up + reps prompts, new in every round so that our prefix cache never hits
                prompts = [prompt_ids(n, (rnd * 1000 + i) * 100_003 + n, spec.vocab_size, special)
                           for i in range(args.pp_reps + 1)]
                systems = [("ours", lambda: ours_prompt(prec.our_model, prec.our_dtype, prompts,
                                                        prec.quant_activations))]
                if prec.llama_gguf is not None and bench_binary is not None:
                    systems.append(("llama.cpp", lambda: llama_bench_prompt(bench_binary, prec.llama_gguf,
                                                                            args.threads, n, args.pp_reps)))
                if rnd % 2:
                    systems.reverse()
                for name, fn in systems:
                    reps = fn()
                    runs.setdefault(f"{dtype}/pp{n}/{name}", []).extend(reps)
                    log.info("  %-9s pp%-6d %-9s %s tok/s", dtype, n, name,
                             " ".join(f"{r['tok_s']:.1f}" for r in reps))

    report = dict(date=time.strftime("%Y-%m-%d %H:%M"), machine=platform.processor() or platform.machine(),
                  cpu_count=os.cpu_count(), threads=args.threads, torch=torch.__version__, model=args.model,
                  requests=args.requests, rounds=args.rounds, pp_reps=args.pp_reps,
                  read_gbs=summarize(ceilings), results={})
    by_label = {prec.label: prec for prec in precisions}
    for key, rs in runs.items():
        dtype, case, name = key.split("/")
        prec = by_label[dtype]
        entry = dict(tok_s=summarize([r["tok_s"] for r in rs]), cores_busy=summarize([r["cores_busy"] for r in rs]))
        if case.startswith("stream"):
            entry["decode_tok_s"] = summarize([r["decode_tok_s"] for r in rs])
            context = int(case[len("stream"):] or 128) + 64  # mean context of the stream's decode steps
            bytes_per_token = decode_bytes_per_token(args.model, prec.our_dtype, context, prec.weight_bytes)
            entry["bytes_per_token"] = bytes_per_token
            entry["bound_tok_s"] = statistics.median(ceilings) * 1e9 / bytes_per_token
        report["results"][key] = entry
    log.info("streaming read: min %.1f, median %.1f, max %.1f GB/s", min(ceilings), statistics.median(ceilings),
             max(ceilings))
    print("\n| dtype | case | system | tok/s (min-median) | decode tok/s | cores busy | of read bound |")
    print("|---|---|---|---|---|---|---|")
    for key, e in report["results"].items():
        dtype, case, name = key.split("/")
        dec = e.get("decode_tok_s")
        dec_text = f"{dec['min']:.1f}-{dec['median']:.1f}" if dec else ""
        bound = f"{100 * dec['median'] / e['bound_tok_s']:.0f}% of {e['bound_tok_s']:.1f}" if dec else ""
        print(f"| {dtype} | {case} | {name} | {e['tok_s']['min']:.1f}-{e['tok_s']['median']:.1f} | {dec_text} | "
              f"{e['cores_busy']['median']:.2f} | {bound} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        log.info("wrote %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
