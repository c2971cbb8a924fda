"""The Orca paper's end-to-end experiment, simulated: GPT-3-like 13B / 101B / 175B / 341B on
A100s in the paper's layouts (1 GPU; TP 8; TP 8 x PP 2; TP 8 x PP 4, pipeline stages across
nodes), orca against a request-level static baseline, on the paper's synthetic trace (Poisson
arrivals, prompts U[32, 512], outputs U[1, 512]); and the same on H200s.

For each model, system (orca and static at max_batch_size 8/16/32, orca with whole prompts as in
the paper) and arrival rate, one simulated run gives (output tokens/s, median normalised
latency). The table gives, at latency targets of 1.25x to 4x the lowest latency seen for the
model, the highest throughput each policy reaches within the target and their ratio.

    python bench/sim_paper.py [--hardware a100-40gb h200] [--requests 200]
Writes bench/sim_paper.json, bench/sim_paper.md and bench/sim_paper_<hardware>.png
(`--replot` redoes the last two from the JSON).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orca_ext import EngineConfig  # noqa: E402
from orca_ext.sim.cost import Roofline, kv_slots  # noqa: E402
from orca_ext.sim.loop import simulate  # noqa: E402
from orca_ext.sim.presets import HARDWARE, INTER_NODE_BYTES_PER_S, MODELS, PAPER_LAYOUTS  # noqa: E402
from orca_ext.sim.trace import synthetic  # noqa: E402

SYSTEMS = [("orca", b) for b in (8, 16, 32)] + [("static", b) for b in (8, 16, 32)]
TARGETS = (1.25, 1.5, 2.0, 3.0, 4.0)


def capacity_rate(cost, slots: int, kv_bytes_per_token: int) -> float:
    """Requests/s at which orca (batch 32) finishes 64 requests queued at t=0: the scale of the rate sweep."""
    trace = synthetic(64, float("inf"), (32, 512), (1, 512), seed=123)
    s = simulate(trace, EngineConfig(max_batch_size=32, max_num_batched_tokens=None), cost, slots,
                 kv_bytes_per_token)
    return len(trace) / s.duration


FRACTIONS = (0.05, 0.15, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)  # of capacity_rate


def run(hw_name: str, n_requests: int, fractions=FRACTIONS, policies=("orca", "static")) -> list[dict]:
    rows = []
    for model, (tp, pp) in PAPER_LAYOUTS.items():
        shape = MODELS[model]
        hw = HARDWARE[hw_name]
        if pp > 1:  # stages on different nodes
            hw = dataclasses.replace(hw, handoff_bytes_per_s=INTER_NODE_BYTES_PER_S)
        cost = Roofline(shape, hw, tp=tp, pp=pp)
        slots = kv_slots(shape, hw, tp, pp, cap=1 << 22)
        cap = capacity_rate(cost, slots, shape.kv_bytes_per_token)
        for policy, mbs in SYSTEMS:
            if policy not in policies:
                continue
            config = EngineConfig(scheduler=policy, max_batch_size=mbs, max_num_batched_tokens=None)
            for frac in fractions:
                rate = cap * frac
                t = time.perf_counter()
                trace = synthetic(n_requests, rate, (32, 512), (1, 512), seed=0)
                s = simulate(trace, config, cost, slots, shape.kv_bytes_per_token).summary()
                rows.append({"hardware": hw_name, "model": model, "tp": tp, "pp": pp, "n_slots": slots,
                             "policy": policy, "max_batch_size": mbs, "rate": rate, **s,
                             "sim_s": time.perf_counter() - t})
                print(json.dumps(rows[-1]), flush=True)
    return rows


def equal_latency_table(rows: list[dict]) -> str:
    out = ["| hardware | model | layout | target (x best) | latency target (ms/token) | orca tok/s | static tok/s | orca / static |",
           "|---|---|---|---|---|---|---|---|"]
    for (hw, model) in dict.fromkeys((r["hardware"], r["model"]) for r in rows):
        mine = [r for r in rows if r["hardware"] == hw and r["model"] == model]
        best = min(r["median_normalized_latency_s"] for r in mine)
        for k in TARGETS:
            target = k * best
            tput = {p: max([r["output_tokens_per_s"] for r in mine if r["policy"] == p
                            and r["median_normalized_latency_s"] <= target], default=0.0) for p in ("orca", "static")}
            ratio = f"{tput['orca'] / tput['static']:.1f}x" if tput["static"] else "static never meets it"
            out.append(f"| {hw} | {model} | TP{mine[0]['tp']} PP{mine[0]['pp']} | {k:g} | {target * 1e3:.1f} "
                       f"| {tput['orca']:.0f} | {tput['static']:.0f} | {ratio} |")
    return "\n".join(out)


def plot(rows: list[dict], hw: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(16, 4))
    for ax, model in zip(axes, PAPER_LAYOUTS):
        for policy, mbs in SYSTEMS:
            pts = sorted((r["output_tokens_per_s"], r["median_normalized_latency_s"] * 1e3) for r in rows
                         if r["hardware"] == hw and r["model"] == model and r["policy"] == policy
                         and r["max_batch_size"] == mbs)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                    ls="-" if policy == "orca" else "--", label=f"{policy} b{mbs}")
        ax.set_title(f"{model} on {hw}")
        ax.set_xlabel("output tokens/s")
        ax.set_yscale("log")
    axes[0].set_ylabel("median normalised latency (ms/token)")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hardware", nargs="+", default=["a100-40gb", "h200"], choices=list(HARDWARE))
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--out", default=str(REPO / "bench" / "sim_paper"))
    p.add_argument("--replot", action="store_true", help="redo the table and plots from the .json")
    p.add_argument("--fractions", type=float, nargs="+", default=list(FRACTIONS), help="rates, x capacity_rate")
    p.add_argument("--policies", nargs="+", default=["orca", "static"], choices=["orca", "static"])
    p.add_argument("--append", action="store_true", help="add the new runs to the .json's")
    args = p.parse_args()
    if args.replot:
        rows = json.loads(Path(args.out + ".json").read_text())
    else:
        rows = json.loads(Path(args.out + ".json").read_text()) if args.append else []
        rows += [r for hw in args.hardware for r in run(hw, args.requests, args.fractions, args.policies)]
        Path(args.out + ".json").write_text(json.dumps(rows, indent=1) + "\n")
    md = equal_latency_table(rows)
    Path(args.out + ".md").write_text(md + "\n")
    for hw in args.hardware:
        plot(rows, hw, Path(f"{args.out}_{hw}.png"))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
