"""Roofline of single-stream decoding on the CPU, from a bench/peer_cpu.py report: for each dtype,
the bound (streaming-read bandwidth / bytes one decode step reads) next to the decode tok/s that
our engine (and llama.cpp, when it ran) reached, with the fraction of the bound.

    python bench/plot_roofline.py bench/out/peer_cpu.json [--out bench/roofline_cpu.png]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("report", type=Path)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "roofline_cpu.png")
    args = p.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    report = json.loads(args.report.read_text())
    results = report["results"]
    dtypes = [d for d in ("float32", "bfloat16") if f"{d}/stream/ours" in results]
    systems = [s for s in ("ours", "llama.cpp") if any(f"{d}/stream/{s}" in results for d in dtypes)]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    width = 0.8 / (len(systems) + 1)
    for i, dtype in enumerate(dtypes):
        bound = results[f"{dtype}/stream/ours"]["bound_tok_s"]
        mb = results[f"{dtype}/stream/ours"]["bytes_per_token"] / 1e6
        ax.bar(i, bound, width, color="0.8", edgecolor="0.4", label="bound: read GB/s / bytes per token" if i == 0 else None)
        ax.text(i, bound, f"{bound:.0f}\n({mb:.0f} MB/token)", ha="center", va="bottom", fontsize=8)
        for j, system in enumerate(systems, start=1):
            entry = results.get(f"{dtype}/stream/{system}")
            if entry is None:
                continue
            tok_s = entry["decode_tok_s"]["median"]
            ax.bar(i + j * width, tok_s, width, color=("C0" if system == "ours" else "C1"),
                   label=system if i == 0 else None)
            ax.text(i + j * width, tok_s, f"{tok_s:.0f}\n{100 * tok_s / bound:.0f}%", ha="center", va="bottom",
                    fontsize=8)
    ax.set_xticks([i + width * len(systems) / 2 for i in range(len(dtypes))], dtypes)
    ax.set_ylabel("single-stream decode tokens/s")
    read = report["read_gbs"]
    ax.set_title(f"CPU roofline, {report['threads']} threads, streaming read {read['min']:.1f}-{read['median']:.1f} "
                 f"GB/s ({report['date'][:10]})", fontsize=9)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
