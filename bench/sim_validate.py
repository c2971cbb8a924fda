"""Validate the simulator against the engine on this machine: for each configuration and arrival
rate, replay one seeded Poisson trace on a real Server (in process, default model) and simulate
the same trace (the arrival times the engine saw). Prints and saves predicted next to measured:
output throughput, median normalised latency (E2E latency / output tokens) and p99 TTFT, with the
relative error, and the run-to-run spread of the engine over --repeats runs.

Fit and validation use different workloads. Each single-process configuration's server first
serves the fit workload (--fit-requests queued at t=0, prompts U[4, 256], outputs U[4, 64];
record_iterations), and the cost model is fitted to those iterations just before the validation
runs, so that a machine whose load drifts is measured at about the load it is predicted for.
Validation workload: Poisson arrivals, prompts U[8, 128], outputs U[1, 128]
(bench/plot_latency_throughput.py's). Configurations: `orca` (chunked prefill, the CPU's default
budget of 128), `static`, and `orca-pp2` (-pp 2; two worker processes, n_workers = 2). pp2 takes
the last single-process fit (or --hardware) and fits two numbers on its own fit-workload run
(fit_pipeline): a factor on every time term and the stage hand-off latency.

    python bench/sim_validate.py --configs orca static orca-pp2 --rates 0.1 0.2 --requests 16
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orca_ext import EngineConfig, Server  # noqa: E402
from orca_ext.sim.cost import Roofline  # noqa: E402
from orca_ext.sim.fit import calibration_from_records, fit_hardware  # noqa: E402
from orca_ext.sim.loop import simulate  # noqa: E402
from orca_ext.sim.measure import observed_trace, replay  # noqa: E402
from orca_ext.sim.presets import load_hardware, load_shape  # noqa: E402
from orca_ext.sim.trace import synthetic  # noqa: E402

METRICS = ("output_tokens_per_s", "median_normalized_latency_s", "p99_ttft_s")
CONFIGS = {"orca": dict(scheduler="orca"), "static": dict(scheduler="static"),
           "orca-pp2": dict(scheduler="orca", pipeline_parallel_size=2)}


def slowed(hw, factor: float):
    """`hw` with every time term multiplied by `factor` (rates divided by it)."""
    return dataclasses.replace(hw, flops_per_s=hw.flops_per_s / factor, bytes_per_s=hw.bytes_per_s / factor,
                               attention_flops_per_s=hw.attention_flops_per_s / factor,
                               overhead_s=hw.overhead_s * factor, per_row_s=hw.per_row_s * factor,
                               host_s=hw.host_s * factor, host_per_row_s=hw.host_per_row_s * factor)


def fit_pipeline(server, shape, hw, config, n_requests: int, seed: int):
    """pp2 on this CPU: the worker processes get a different share of a loaded machine than one
    process does, and the stage hand-off costs what a single process never shows. So two numbers
    are fitted on the pp2 server's own fit-workload run: a factor on every time term of the
    single-process fit, and the hand-off latency, minimising the squared log errors of the
    throughput and the median normalised latency (grid search)."""
    trace = fit_workload(n_requests, seed)
    measured = replay(server, trace, seed=seed, prefix="ppfit-")
    target = measured.summary()
    sim_trace = observed_trace(measured)
    best = None
    for factor in np.geomspace(0.2, 3.0, 16):
        for latency in [0.0, *np.geomspace(1e-3, 0.5, 12)]:
            cand = dataclasses.replace(slowed(hw, factor), link_latency_s=float(latency))
            got = simulate(sim_trace, config, Roofline(shape, cand, pp=config.pipeline_parallel_size),
                           server.n_slots, shape.kv_bytes_per_token, "cpu").summary()
            err = sum(np.log(got[m] / target[m]) ** 2 for m in ("output_tokens_per_s", "median_normalized_latency_s"))
            if best is None or err < best[0]:
                best = (err, cand, got)
    print("fit", json.dumps({"measured": target, "predicted": best[2]}), flush=True)
    return dataclasses.replace(best[1], source=best[1].source + "; pipeline: time factor and hand-off latency "
                               "fitted on the pp2 server's fit-workload run")


def fit_workload(n_requests: int, seed: int):
    return synthetic(n_requests, float("inf"), (4, 256), (4, 64), seed=seed)


def fit_here(server, shape, n_requests: int, seed: int):
    """Serve the fit workload on `server` (record_iterations=True) and fit a Hardware to it."""
    trace = fit_workload(n_requests, seed)
    skip = len(server.iterations())
    measured = replay(server, trace, seed=seed, prefix="fit-")
    cal = calibration_from_records(server.iterations()[skip:], {f"fit-{i}": r.prompt_len for i, r in enumerate(trace)})
    hw = fit_hardware(shape, cal, name="cpu", source=f"fitted on {len(cal.works)} iterations of the fit workload, "
                      "this machine, just before the validation runs")
    # In-sample check: the fitted model on the run it was fitted to.
    sim = simulate(observed_trace(measured), server.config, Roofline(shape, hw), server.n_slots,
                   shape.kv_bytes_per_token, "cpu")
    print("fit", json.dumps({"measured": measured.summary(), "predicted": sim.summary()}), flush=True)
    return hw


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hardware", default=str(REPO / "bench" / "sim_cpu_hardware.json"))
    p.add_argument("--shape", default=str(REPO / "bench" / "sim_cpu_shape.json"))
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--rates", nargs="+", type=float, default=[0.1, 0.2, 0.3])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--fit-requests", type=int, default=24)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=str(REPO / "bench" / "sim_validation.json"))
    args = p.parse_args()
    hw, shape = load_hardware(args.hardware), load_shape(args.shape)
    rows = []
    for name in args.configs:
        config = EngineConfig(max_batch_size=args.max_batch_size, **CONFIGS[name])
        with Server(config=dataclasses.replace(config, record_iterations=True)) as server:
            replay(server, synthetic(2, float("inf"), (8, 16), (2, 4), seed=99), prefix="warmup-")
            if config.pipeline_parallel_size > 1:
                hw_run = fit_pipeline(server, shape, hw, config, args.fit_requests, args.seed + 1000)
            else:
                hw = hw_run = fit_here(server, shape, args.fit_requests, args.seed + 1000)
            cost = Roofline(shape, hw_run, pp=config.pipeline_parallel_size)
            for rate in args.rates:
                trace = synthetic(args.requests, rate, (8, 128), (1, 128), seed=args.seed)
                runs = []
                for rep in range(args.repeats):
                    t = time.perf_counter()
                    measured = replay(server, trace, seed=args.seed, prefix=f"{name}-{rate}-{rep}-")
                    sim = simulate(observed_trace(measured), config, cost, server.n_slots,
                                   shape.kv_bytes_per_token, "cpu")
                    runs.append({"measured": measured.summary(), "predicted": sim.summary(),
                                 "wall_s": time.perf_counter() - t})
                    print(name, rate, rep, json.dumps(runs[-1]), flush=True)
                rows.append({"config": name, "rate": rate, "hardware": dataclasses.asdict(hw_run),
                             "n_slots": server.n_slots, "runs": runs})
                Path(args.out).write_text(json.dumps({"rows": rows},
                                                     indent=1, default=str) + "\n")
    print(table(rows))
    return 0


def table(rows) -> str:
    """Markdown: per config and rate, measured (mean of runs, spread = max-min over mean) vs
    predicted (mean), and the error of the mean prediction."""
    head = "| config | rate/s | " + " | ".join(f"{m} meas (spread) | pred | err" for m in METRICS) + " |"
    out = [head, "|" + "---|" * (2 + 3 * len(METRICS))]
    for row in rows:
        cells = [row["config"], f"{row['rate']:g}"]
        for m in METRICS:
            meas = [r["measured"][m] for r in row["runs"]]
            pred = [r["predicted"][m] for r in row["runs"]]
            mm, pm = sum(meas) / len(meas), sum(pred) / len(pred)
            spread = (max(meas) - min(meas)) / mm if mm else 0.0
            cells += [f"{mm:.3g} ({spread:.0%})", f"{pm:.3g}", f"{(pm - mm) / mm:+.1%}"]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
