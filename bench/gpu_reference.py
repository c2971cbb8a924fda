"""Torch references of the GPU targets in bench/RESULTS.md, measured in the same run as our CUDA ops (through
`orca_ext._C`), so every ratio compares numbers from one machine at one moment.

    python bench/gpu_reference.py --out ref.json [--reps 50]

Measures: copy bandwidth (tensor copy, read+write), the bf16 GEMM 8192^3 ceiling, torch SDPA decode
(B=64, ctx 1024, Hq16/Hkv8, D128) and causal prefill (4 x 2048), eager RMSNorm+QKV (H=1024 -> 4096)
at T=64 and T=8192; and ours on the same shapes plus the ragged decode U[128, 2048]. Prints a
table and writes JSON. Timing: CUDA events around each call, median of `reps` after warm-up.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger("gpu_reference")

HQ, HKV, D = 16, 8, 128
EPS = 1e-6


def time_us(fn, reps: int, warmup: int = 5) -> float:
    """Median microseconds of fn() measured with CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times)


def copy_gbps(reps: int) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    us = time_us(lambda: dst.copy_(src), reps)
    return 2 * src.numel() / (us * 1e-6) / 1e9


def gemm_tflops(reps: int, n: int = 8192) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    us = time_us(lambda: a @ b, reps)
    return 2 * n ** 3 / (us * 1e-6) / 1e12


def ragged_inputs(q_lens, kv_lens, gen):
    """Flat q, caches and index tensors of a ragged batch (slabs contiguous, in request order)."""
    t = sum(q_lens)
    s = sum(kv_lens)
    q = torch.randn(t, HQ, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(s, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(s, HKV, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    qs = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)[:-1].tolist()), dtype=torch.int32, device="cuda")
    ks = torch.tensor([0] + list(torch.tensor(kv_lens).cumsum(0)[:-1].tolist()), dtype=torch.int32, device="cuda")
    ql = torch.tensor(q_lens, dtype=torch.int32, device="cuda")
    kl = torch.tensor(kv_lens, dtype=torch.int32, device="cuda")
    return q, k, v, qs, ql, ks, kl


def attention_rows(C, reps, gen, copy):
    rows = []
    scale = 1 / math.sqrt(D)
    kv_bytes_per_token = HKV * D * 2 * 2

    # torch SDPA decode: B=64, ctx 1024 (padded batch, the same bytes as the ragged one).
    b, ctx = 64, 1024
    q = torch.randn(b, HQ, 1, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(b, HKV, ctx, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    us = time_us(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), reps)
    gb = b * ctx * kv_bytes_per_token / 1e9
    rows.append(dict(name="decode_sdpa_b64_ctx1024", us=us, gbps=gb / (us * 1e-6), pct_of_copy=100 * gb / (us * 1e-6) / copy))

    if C is not None:
        for name, kv_lens in (("decode_ours_b64_ctx1024", [ctx] * b),
                              ("decode_ours_b64_ragged_128_2048",
                               torch.randint(128, 2049, (b,), generator=torch.Generator().manual_seed(1)).tolist())):
            qq, kk, vv, qs, ql, ks, kl = ragged_inputs([1] * b, kv_lens, gen)
            us = time_us(lambda: C.ragged_attention(qq, kk, vv, qs, ql, ks, kl, scale), reps)
            gb = sum(kv_lens) * kv_bytes_per_token / 1e9
            rows.append(dict(name=name, us=us, gbps=gb / (us * 1e-6), pct_of_copy=100 * gb / (us * 1e-6) / copy))

    # Causal prefill 4 x 2048.
    b, n = 4, 2048
    flops = 4 * b * HQ * D * n * (n + 1) / 2
    q = torch.randn(b, HQ, n, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(b, HKV, n, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn_like(k)
    us = time_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), reps)
    sdpa_tflops = flops / (us * 1e-6) / 1e12
    rows.append(dict(name="prefill_sdpa_4x2048", us=us, tflops=sdpa_tflops))
    if C is not None:
        qq, kk, vv, qs, ql, ks, kl = ragged_inputs([n] * b, [n] * b, gen)
        us = time_us(lambda: C.ragged_attention(qq, kk, vv, qs, ql, ks, kl, scale), reps)
        tf = flops / (us * 1e-6) / 1e12
        rows.append(dict(name="prefill_ours_4x2048", us=us, tflops=tf, pct_of_sdpa=100 * tf / sdpa_tflops))
    return rows


def eager_rmsnorm_linear(x, nw, w):
    """The transformers-style eager path: float32 norm, cast back, weight multiply, then linear."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return F.linear(nw * xf.to(x.dtype), w)


def rmsnorm_rows(C, reps, gen, copy):
    rows = []
    h, n = 1024, 4096
    nw = (1 + 0.1 * torch.randn(h, device="cuda", generator=gen)).to(torch.bfloat16)
    w = (torch.randn(n, h, device="cuda", generator=gen) / math.sqrt(h)).to(torch.bfloat16)
    for t in (64, 8192):
        x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
        eager = time_us(lambda: eager_rmsnorm_linear(x, nw, w), reps)
        floor = (n * h + 2 * t * h + t * n) * 2 / (copy * 1e9) * 1e6
        rows.append(dict(name=f"rmsnorm_qkv_eager_T{t}", us=eager, floor_us=floor))
        if C is not None:
            ours = time_us(lambda: C.rmsnorm_qkv(x, nw, w, None, EPS), reps)
            err = (C.rmsnorm_qkv(x, nw, w, None, EPS).float() - eager_rmsnorm_linear(x, nw, w).float()).abs().max().item()
            rows.append(dict(name=f"rmsnorm_qkv_ours_T{t}", us=ours, floor_us=floor, x_floor=ours / floor,
                             x_eager=ours / eager, max_abs_diff_vs_eager=err))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        log.error("no CUDA device")
        return 2
    try:
        from orca_ext import _C as C
        if not hasattr(C, "ragged_attention"):
            C = None
    except ImportError as exc:
        log.warning("orca_ext._C unavailable (%s): torch references only", exc)
        C = None
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy = copy_gbps(args.reps)
    gemm = gemm_tflops(min(args.reps, 20))
    rows = [dict(name="copy", gbps=copy), dict(name="gemm_bf16_8192", tflops=gemm)]
    for section in (attention_rows, rmsnorm_rows):
        try:
            rows += section(C, args.reps, gen, copy)
        except Exception as exc:  # one failing section must not hide the others
            log.exception("%s failed", section.__name__)
            rows.append(dict(name=section.__name__, error=f"{type(exc).__name__}: {exc}"))
    print(f"{'case':38s} {'us':>10s}  metrics")
    for r in rows:
        extra = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                          for k, v in r.items() if k not in ("name", "us"))
        us = f"{r['us']:10.2f}" if "us" in r else " " * 10
        print(f"{r['name']:38s} {us}  {extra}")
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
