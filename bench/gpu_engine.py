"""GPU engine benchmark: our Server(device="cuda") against transformers continuous
batching and static `generate`, on one Qwen3-0.6B-shaped model with random bf16 weights, in one run.

    python bench/gpu_engine.py --out engine.json [--hf-output-scale 4] [--skip-hf] [--deadline-s 200]

Needs no files: the model is random, prompts are token ids and no tokenizer is involved (the model
folder has none; our Server then accepts token-id prompts only, which is all this uses).
Order: ours first (64 requests, then 256 with the host-time measurement), the transformers
baselines last, so a slow baseline can never cost our numbers. Every run stops at the deadline
(`--deadline-s`, the whole script): ours aborts what is left, transformers' continuous batching
stops its loop, static generate stops through `max_time`; a run cut short says so ("partial").

Workload: 64 requests, prompt lengths U[100, 1024], output lengths U[100, 1024], EOS ignored,
fixed seed; also a 256-request version for ours. Reported per system: output tokens/s (static
generate counts only each request's own output tokens, not the padding steps of finished rows),
our speed-up over each baseline, and the memory-bandwidth floor of our run:

    floor = sum over iterations of (weight bytes + KV bytes read) / measured copy bandwidth

(iterations from record_iterations=True, each request's context length reconstructed from the
workload), with the % of that floor achieved. At batch 256 the host time per iteration is
measured as (wall time of Engine.step) - (GPU time of model.forward from CUDA events).

transformers is slow (~400 tok/s on an H200 with this model), so `--hf-output-scale K` divides every
output length by K for the comparison runs (ours is then also run on that scaled workload, so the
ratios compare the same work); ours is always run on the full workloads as well.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger("gpu_engine")

QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                 max_position_embeddings=40960, rms_norm_eps=1e-6, use_sliding_window=False,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})
# --smoke: a tiny model of the same family, for checking this script on a machine without a GPU.
TINY = dict(QWEN3_06B, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, vocab_size=49152, max_position_embeddings=4096)


@dataclass
class Workload:
    prompts: list[list[int]]
    outputs: list[int]

    @property
    def output_tokens(self) -> int:
        return sum(self.outputs)

    def scaled(self, k: int) -> "Workload":
        return Workload(self.prompts, [max(1, o // k) for o in self.outputs])


def make_workload(n: int, seed: int, token_range: int) -> Workload:
    rng = random.Random(seed)
    prompts = [[rng.randrange(token_range) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    outputs = [rng.randint(100, 1024) for _ in range(n)]
    return Workload(prompts, outputs)


class Deadline:
    """Seconds left of the script's budget; every loop below checks it."""

    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


# ---- model ---------------------------------------------------------------------------------------
def hf_config(cfg: dict):
    """The transformers Qwen3Config of `cfg` (QWEN3_06B or TINY)."""
    import transformers

    # Token ids only: bos/eos/pad are ordinary ids here (EOS is ignored by every run).
    config = transformers.Qwen3Config(**cfg, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    config.architectures = ["Qwen3ForCausalLM"]
    return config


def make_model_dir(directory: Path, seed: int, cfg: dict, device: str) -> Path:
    """Save a Qwen3-shaped model (`cfg`) with random bf16 weights and no tokenizer into `directory`."""
    import transformers

    config = hf_config(cfg)
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return directory


def weight_bytes_per_iteration(cfg: dict, elem: int = 2) -> int:
    """Bytes of weights every iteration reads: all layers, final norm and the (tied) LM head."""
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nq, nkv, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    per_layer = h * (nq + 2 * nkv) * d + nq * d * h + 3 * h * i + 2 * h + 2 * d
    return elem * (cfg["num_hidden_layers"] * per_layer + h + v * h)


def kv_bytes_per_token(cfg: dict, elem: int = 2) -> int:
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * elem


def copy_gbps() -> float:
    if not torch.cuda.is_available():  # --smoke on a CPU: a rough host copy figure
        src = torch.empty(1 << 26, dtype=torch.uint8)
        t0 = time.perf_counter()
        src.clone()
        return 2 * (1 << 26) / (time.perf_counter() - t0) / 1e9
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e-3)
    del src, dst
    return 2 * (1 << 30) / statistics.median(times) / 1e9


# ---- ours ----------------------------------------------------------------------------------------
def floor_seconds(records, lengths: dict, cfg: dict, copy: float) -> tuple[float, int]:
    """Memory floor of a run from its iteration records; `lengths[request_id] = prompt length`."""
    w = weight_bytes_per_iteration(cfg)
    kv = kv_bytes_per_token(cfg)
    seen: dict[str, int] = {}
    total = 0
    for rec in records:
        ctx = 0
        for rid in rec.request_ids:
            n = seen.get(rid, 0)          # iterations this request already ran
            ctx += lengths[rid] + n       # prefill: the prompt; decode n: prompt + n tokens
            seen[rid] = n + 1
        total += w + ctx * kv
    return total / (copy * 1e9), total


class StepTimer:
    """Wraps Engine.step (wall time) and model.forward (CUDA events) of a running server."""

    def __init__(self, server):
        self.engine = server._engine            # private seam; the benchmark only observes it
        self.model = server.executor.model      # (AttributeError if it moved: the caller skips timing)
        self.steps: list[tuple[float, int, object, object]] = []
        self._orig_step, self._orig_forward = self.engine.step, self.model.forward
        self._last = None

        def forward(batch):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            out = self._orig_forward(batch)
            b.record()
            self._last = (a, b, int(batch.q_len.numel()))
            return out

        def step(*args, **kwargs):
            self._last = None
            t0 = time.perf_counter()
            res = self._orig_step(*args, **kwargs)
            wall = time.perf_counter() - t0
            if self._last is not None:
                a, b, n = self._last
                self.steps.append((wall, n, a, b))
            return res

        self.model.forward = forward
        self.engine.step = step

    def restore(self) -> None:
        self.engine.step, self.model.forward = self._orig_step, self._orig_forward

    def host_ms(self, batch_size: int) -> dict:
        torch.cuda.synchronize()
        rows = [(wall * 1e3, a.elapsed_time(b)) for wall, n, a, b in self.steps if n == batch_size]
        if not rows:
            return {"steps": 0}
        host = [w - g for w, g in rows]
        return {"steps": len(rows), "step_wall_ms_median": statistics.median(w for w, _ in rows),
                "forward_gpu_ms_median": statistics.median(g for _, g in rows),
                "host_ms_median": statistics.median(host), "host_ms_p90": sorted(host)[int(0.9 * (len(host) - 1))]}


def run_ours(model_dir: Path, wl: Workload, cfg: dict, copy: float, deadline: Deadline, *, max_batch_size: int,
             kv_memory: str, time_steps_at: int | None = None, device: str = "cuda") -> dict:
    from orca_ext import SamplingParams, Server

    if device != "cuda":
        time_steps_at = None  # CUDA events only
    with Server(model=str(model_dir), device=device, dtype="bfloat16", max_batch_size=max_batch_size,
                record_iterations=True, kv_cache_memory=kv_memory) as server:
        # Warm-up (kernels, allocator, any graph capture) on a small batch, not counted.
        server.generate([p[:64] for p in wl.prompts[:8]], SamplingParams(max_tokens=8, ignore_eos=True))
        n_warm = len(server.iterations())
        timer = None
        if time_steps_at:
            try:
                timer = StepTimer(server)
            except AttributeError as exc:
                log.warning("host-time measurement skipped: %s", exc)
        t0 = time.perf_counter()
        ids = [server.submit(p, SamplingParams(max_tokens=o, ignore_eos=True)) for p, o in zip(wl.prompts, wl.outputs)]
        outs, partial = [], False
        for rid in ids:
            try:
                outs.append(server.result(rid, timeout=max(deadline.left(), 0.01)))
            except TimeoutError:
                partial = True
                break
        if partial:  # out of time: stop the rest, count what they produced
            for rid in ids[len(outs):]:
                server.abort(rid)
            outs += [server.result(rid) for rid in ids[len(outs):]]
        wall = time.perf_counter() - t0
        if timer is not None:
            timer.restore()
        records = server.iterations()[n_warm:]
        produced = sum(len(o.token_ids) for o in outs)
        errors = [o.error for o in outs if o.finish_reason == "error"]
        lengths = {o.request_id: len(o.prompt_token_ids) for o in outs}
        floor_s, floor_bytes = floor_seconds(records, lengths, cfg, copy)
        res = {"requests": len(outs), "output_tokens": produced, "expected_output_tokens": wl.output_tokens,
               "partial": partial, "wall_s": wall, "tok_per_s": produced / wall, "iterations": len(records),
               "max_batch": max((len(r.request_ids) for r in records), default=0),
               "floor_s": floor_s, "floor_bytes": floor_bytes, "pct_of_floor": 100 * floor_s / wall,
               "errors": errors[:3]}
        if timer is not None:
            res["host_time_at_batch"] = {"batch": time_steps_at, **timer.host_ms(time_steps_at)}
    torch.cuda.empty_cache()
    return res


# ---- transformers --------------------------------------------------------------------------------
def hf_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def load_hf(model_dir: Path, attn: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.bfloat16,
                                                             attn_implementation=attn).to(hf_device()).eval()


def run_hf_cb(model_dir: Path, wl: Workload, deadline: Deadline) -> dict:
    """transformers continuous batching (ContinuousBatchingManager, paged SDPA attention)."""
    from transformers import GenerationConfig

    last_exc = None
    for attn in ("sdpa", "paged|sdpa", "sdpa_paged"):
        model = None
        try:
            model = load_hf(model_dir, attn)
            gen = GenerationConfig(do_sample=False, max_new_tokens=max(wl.outputs), eos_token_id=-1, pad_token_id=0)
            manager = model.init_continuous_batching(generation_config=gen)
            if hasattr(manager, "warmup"):
                manager.warmup()
            manager.start()
            try:
                t0 = time.perf_counter()
                for i, (p, o) in enumerate(zip(wl.prompts, wl.outputs)):
                    manager.add_request(p, request_id=f"r{i}", max_new_tokens=o)
                done: dict[str, int] = {}
                while len(done) < len(wl.prompts) and deadline.left() > 0:
                    r = manager.get_result(timeout=1)
                    if r is None:
                        if not manager.is_running():
                            raise RuntimeError("transformers CB generation thread stopped")
                        continue
                    if r.is_finished():
                        if getattr(r, "error", None):
                            raise RuntimeError(f"transformers CB request failed: {r.error}")
                        done[r.request_id] = len(r.generated_tokens)
                wall = time.perf_counter() - t0
            finally:
                manager.stop(block=True, timeout=10)
            # Out of time: finished requests only (the running ones' partial tokens are not counted).
            produced = sum(min(done[f"r{i}"], o) for i, o in enumerate(wl.outputs) if f"r{i}" in done)
            return {"attn_implementation": attn, "output_tokens": produced, "wall_s": wall,
                    "tok_per_s": produced / wall, "partial": len(done) < len(wl.prompts),
                    "finished_requests": len(done)}
        except Exception as exc:  # try the next attention spelling (it changed across 5.x)
            log.warning("transformers CB with attn_implementation=%r failed: %s", attn, exc)
            last_exc = exc
        finally:
            del model
            torch.cuda.empty_cache()
    raise RuntimeError(f"transformers continuous batching failed: {last_exc}")


def run_hf_static(model_dir: Path, wl: Workload, batch: int, deadline: Deadline) -> dict:
    """transformers static `generate` in batches of `batch` (left padding); only each request's own
    output tokens count as useful."""
    from transformers import GenerationConfig

    model = load_hf(model_dir, "sdpa")
    try:
        useful, wall, steps, partial = 0, 0.0, 0, False
        for s in range(0, len(wl.prompts), batch):
            if deadline.left() <= 1:
                partial = True
                break
            prompts, outs = wl.prompts[s:s + batch], wl.outputs[s:s + batch]
            width = max(len(p) for p in prompts)
            ids = torch.zeros(len(prompts), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for r, p in enumerate(prompts):
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            new = max(outs)
            gen = GenerationConfig(do_sample=False, max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                                   pad_token_id=0, bos_token_id=None, max_time=deadline.left())
            sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
            sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                seq = model.generate(ids.to(hf_device()), attention_mask=mask.to(hf_device()), generation_config=gen)
            sync()
            wall += time.perf_counter() - t0
            steps += seq.shape[1] - width
            useful += sum(min(o, seq.shape[1] - width) for o in outs)
            partial = partial or seq.shape[1] - width < new  # max_time stopped it
        return {"batch": batch, "output_tokens_useful": useful, "steps": steps, "wall_s": wall,
                "useful_tok_per_s": useful / wall if wall else 0.0, "partial": partial}
    finally:
        del model
        torch.cuda.empty_cache()


# ---- main ----------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="GPU engine benchmark: ours against transformers")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here (after every run)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--big-requests", type=int, default=256, help="size of the second run of ours (0: skip)")
    ap.add_argument("--hf-output-scale", type=int, default=1,
                    help="divide output lengths by this for the transformers comparison (time budget)")
    ap.add_argument("--skip-hf", action="store_true", help="only run ours")
    ap.add_argument("--deadline-s", type=float, default=1800.0,
                    help="wall-clock budget of the whole script; runs still going then stop and report partial")
    ap.add_argument("--kv-cache-memory", default="48GiB", help="KV budget of our server")
    ap.add_argument("--model-dir", type=Path, default=None, help="reuse/keep the random model here")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model, 4 short requests, any device: checks this script, measures nothing")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    deadline = Deadline(args.deadline_s)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device != "cuda" and not args.smoke:
        log.error("no CUDA device (use --smoke to check the script on a CPU)")
        return 2
    cfg = TINY if args.smoke else QWEN3_06B

    tmp = None
    model_dir = args.model_dir
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="orca_qwen3_06b_")
        model_dir = Path(tmp.name)
    if not (model_dir / "config.json").is_file():
        log.info("writing a Qwen3-0.6B-shaped random bf16 model to %s", model_dir)
        make_model_dir(model_dir, args.seed, cfg, device)

    import transformers
    token_range = cfg["vocab_size"]
    copy = copy_gbps()
    result: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
                    "transformers": transformers.__version__, "copy_gbps": copy,
                    "weight_bytes_per_iteration": weight_bytes_per_iteration(cfg),
                    "kv_bytes_per_token": kv_bytes_per_token(cfg), "hf_output_scale": args.hf_output_scale,
                    "deadline_s": args.deadline_s}
    wl = make_workload(args.requests, args.seed, token_range)
    if args.smoke:
        wl = Workload([p[:20] for p in wl.prompts[:4]], [o // 50 for o in wl.outputs[:4]])
        args.requests, args.big_requests, args.kv_cache_memory = len(wl.prompts), 0, "64MiB"
    runs: dict = {}
    ratios: dict = {}
    result["runs"] = runs
    result["ratios"] = ratios

    def save() -> None:  # after every run, so a timeout keeps what was measured
        if args.out:
            args.out.write_text(json.dumps(result, indent=2, default=str))

    def attempt(name, fn):
        if deadline.left() <= 5:
            log.warning("skipping %s: the deadline has passed", name)
            runs[name] = {"error": "skipped: out of time"}
            save()
            return
        try:
            log.info("running %s (%.0f s left)", name, deadline.left())
            runs[name] = fn()
            log.info("%s: %s", name, {k: v for k, v in runs[name].items() if not isinstance(v, (dict, list))})
        except Exception as exc:  # report and continue with the other systems
            log.exception("%s failed", name)
            runs[name] = {"error": f"{type(exc).__name__}: {exc}"}
        save()

    def ours(workload, **kw):
        return lambda: run_ours(model_dir, workload, cfg, copy, deadline, max_batch_size=256,
                                kv_memory=args.kv_cache_memory, device=device, **kw)

    # Ours first: the full workloads, then the comparison workload; the baselines last.
    attempt(f"ours_{args.requests}", ours(wl))
    if args.big_requests:
        big = make_workload(args.big_requests, args.seed + 1, token_range)
        attempt(f"ours_{args.big_requests}", ours(big, time_steps_at=min(256, args.big_requests)))
    if not args.skip_hf:
        # The comparison runs (transformers is slow; see --hf-output-scale), ours on the same work.
        cmp_wl = wl.scaled(args.hf_output_scale) if args.hf_output_scale > 1 else wl
        ours_cmp = f"ours_{args.requests}"
        if args.hf_output_scale > 1:
            ours_cmp = f"ours_{args.requests}_outputs_div{args.hf_output_scale}"
            attempt(ours_cmp, ours(cmp_wl))
        attempt("hf_continuous_batching", lambda: run_hf_cb(model_dir, cmp_wl, deadline))
        attempt("hf_static_generate_b64", lambda: run_hf_static(model_dir, cmp_wl, 64, deadline))
        ours_run = runs.get(ours_cmp, {})
        cb, st = runs["hf_continuous_batching"], runs["hf_static_generate_b64"]
        # A ratio only compares complete runs of the same work.
        if ours_run.get("tok_per_s") and not ours_run.get("partial"):
            if cb.get("tok_per_s") and not cb.get("partial"):
                ratios["ours_over_hf_cb"] = ours_run["tok_per_s"] / cb["tok_per_s"]
            if st.get("useful_tok_per_s") and not st.get("partial"):
                ratios["ours_over_hf_static"] = ours_run["tok_per_s"] / st["useful_tok_per_s"]
        save()

    print(f"\n{'run':40s} {'tok/s':>10s} {'wall s':>8s} {'% floor':>8s}")
    for name, r in runs.items():
        tps = r.get("tok_per_s", r.get("useful_tok_per_s"))
        if tps is None:
            print(f"{name:40s} ERROR {r.get('error')}")
            continue
        pct = r.get("pct_of_floor")
        flag = "  (partial: deadline)" if r.get("partial") else ""
        print(f"{name:40s} {tps:10.1f} {r['wall_s']:8.2f} {'' if pct is None else f'{pct:7.1f}%':>8s}{flag}")
        if "host_time_at_batch" in r:
            print(f"    host time per iteration at batch {r['host_time_at_batch'].get('batch')}: "
                  f"{r['host_time_at_batch']}")
    for k, v in ratios.items():
        print(f"{k}: {v:.1f}x")
    save()
    if tmp is not None:
        tmp.cleanup()
    return 0 if all("error" not in r for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
