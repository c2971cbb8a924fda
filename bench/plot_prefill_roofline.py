"""Roofline of the CPU projections (float32, bf16 and quantized weights) from the printed results of
their microbenchmarks: each result line's GFLOP/s against its arithmetic intensity (FLOP per weight
byte, the ratio of the GFLOP/s and GB/s the line prints), under the machine's measured ceilings
(the pure-FMA peak and the streaming read, from the `ceilings` line). Points are labelled with
their token count T, so the climb from T = 1 (weight streaming, on the read line) to prefill
(T = 512, under the FMA line) reads off the plot. The int8-activation lines count 2 operations per
integer multiply-add, like the float ones; integer dot products are not bounded by the float FMA
peak, which still marks what a float kernel could reach.

    build/.../bench/cpu/bench_skinny_gemm > skinny.txt
    build/.../bench/cpu/bench_quant_gemm --tokens=1,16,64,512 --layers=1b > quant.txt
    python bench/plot_prefill_roofline.py skinny.txt quant.txt --title "2-core Zen 3" \\
        --out bench/roofline_prefill_cpu.png
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

CEILINGS = re.compile(r"^ceilings \((\d+) threads\): streaming read ([\d.]+) GB/s, memcpy ([\d.]+) GB/s "
                      r"\(read\+write\), FMA ([\d.]+) GFLOP/s")
RESULT = re.compile(r"^(?P<label>.+?)\s+median\s+[\d.]+ us \(best\s+[\d.]+\)\s+(?P<gflops>[\d.]+) GFLOP/s = .*?"
                    r"(?P<gbs>[\d.]+) GB/s = ")
# The 16-lane peak the AVX-512 benchmarks print next to the ceilings (CPUs with AVX-512F only).
ZMM_FMA = re.compile(r"^zmm FMA ([\d.]+) GFLOP/s")
TOKENS = re.compile(r"\bT=(\d+)\b")
# The series a line belongs to: its weight format and instruction path ("f32/avx2", "Q8_0 avx2-int8act").
FLOAT_SERIES = re.compile(r"\b((?:f32|bf16)/[\w-]+)")
QUANT_SERIES = re.compile(r"^(Q\d_\w+) .*?/([\w-]+) T=")


@dataclasses.dataclass(frozen=True)
class Point:
    series: str
    tokens: int
    gflops: float
    intensity: float  # FLOP per weight byte


@dataclasses.dataclass(frozen=True)
class Ceilings:
    threads: int
    read_gbs: float
    fma_gflops: float
    zmm_fma_gflops: float = 0.0  # 0: not printed (no AVX-512F)


def series_of(label: str) -> str | None:
    m = QUANT_SERIES.search(label)
    if m:
        return f"{m.group(1)} {m.group(2)}"
    m = FLOAT_SERIES.search(label)
    return m.group(1) if m else None


def parse(lines) -> tuple[list[Ceilings], list[Point]]:
    """The ceilings lines and the result lines that name T and a series; others are skipped."""
    ceilings, points = [], []
    for line in lines:
        if m := CEILINGS.match(line):
            ceilings.append(Ceilings(int(m.group(1)), float(m.group(2)), float(m.group(4))))
            continue
        if (m := ZMM_FMA.match(line)) and ceilings:
            ceilings[-1] = dataclasses.replace(ceilings[-1], zmm_fma_gflops=float(m.group(1)))
            continue
        m = RESULT.match(line)
        if not m:
            continue
        label, gflops, gbs = m.group("label"), float(m.group("gflops")), float(m.group("gbs"))
        tokens, series = TOKENS.search(label), series_of(label)
        if tokens is None or series is None or gbs <= 0:
            continue
        points.append(Point(series, int(tokens.group(1)), gflops, gflops / gbs))
    return ceilings, points


def plot(ceilings: list[Ceilings], points: list[Point], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fma = max(c.fma_gflops for c in ceilings)
    read = max(c.read_gbs for c in ceilings)
    fig, ax = plt.subplots(figsize=(8, 5))
    lo = min(p.intensity for p in points) / 2
    hi = max(p.intensity for p in points) * 2
    knee = fma / read
    ax.plot([lo, knee, hi], [read * lo, fma, fma], color="black", lw=1.5)
    ax.text(hi, fma * 1.04, f"FMA peak {fma:.0f} GFLOP/s", ha="right", va="bottom", fontsize=8)
    ax.text(lo * 1.1, read * lo * 1.3, f"read {read:.1f} GB/s", rotation=28, fontsize=8)
    zmm = max(c.zmm_fma_gflops for c in ceilings)
    if zmm > fma * 1.05:  # full-width 512-bit units: a second, higher roof for the avx512 paths
        ax.plot([zmm / read, hi], [zmm, zmm], color="black", lw=1.0, ls="--")
        ax.text(hi, zmm * 1.04, f"zmm FMA peak {zmm:.0f} GFLOP/s", ha="right", va="bottom", fontsize=8)
    for i, series in enumerate(sorted({p.series for p in points})):
        mine = sorted((p for p in points if p.series == series), key=lambda p: (p.tokens, p.intensity))
        ax.scatter([p.intensity for p in mine], [p.gflops for p in mine], s=18, color=f"C{i % 10}", label=series)
        for p in mine:
            ax.annotate(str(p.tokens), (p.intensity, p.gflops), fontsize=6, xytext=(3, 2), textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP per weight byte)")
    ax.set_ylabel("GFLOP/s (2 per multiply-add)")
    ax.set_title(title or f"CPU projections, {ceilings[0].threads} threads (labels: tokens T)")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=130)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("outputs", type=Path, nargs="+", help="saved output of bench/cpu microbenchmarks")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "roofline_prefill_cpu.png")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    ceilings, points = [], []
    for path in args.outputs:
        c, pts = parse(path.read_text().splitlines())
        ceilings += c
        points += pts
    if not ceilings or not points:
        print("no ceilings line or no result lines with T= in the given outputs", file=sys.stderr)
        return 1
    plot(ceilings, points, args.out, args.title)
    print(f"{len(points)} points in {len({p.series for p in points})} series -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
