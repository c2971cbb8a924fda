"""Validate the simulator against the engine on this machine: for each configuration and arrival
rate, replay one seeded Poisson trace on a real Server (in process, default model) and simulate
the same trace (the arrival times the engine saw). Prints and saves predicted next to measured:
output throughput, median normalised latency (E2E latency / output tokens) and p99 TTFT, with the
relative error, and the run-to-run spread of the engine over --repeats runs. The markdown table
(in-sample fit checks and validation rows) goes to --table-out, ready for bench/RESULTS.md.

Fit and validation use different workloads. Each single-process configuration's server first
serves the fit workload (orca_ext.sim.fit.fit_trace: half the requests one every 0.5 s, half at
once, so iterations span 1 to 16 rows; record_iterations), and the cost model is fitted to those
iterations just before the validation runs, so that a machine whose load drifts is measured at
about the load it is predicted for. The fit is checked in sample (the fit run simulated), then
used out of sample on the validation workload: Poisson arrivals, prompts U[8, 128], outputs
U[1, 128] (bench/plot_latency_throughput.py's). Configurations: `orca` (chunked prefill, the
CPU's default budget of 128), `static`, and `orca-pp2` (-pp 2; two worker processes, n_workers
= 2). pp2 starts from the last single-process fit (or --hardware), each stage priced on its half
of the layers, and corrects it on its own fit-workload run with the workers' own batch timings
(ORCA_EXT_WORKER_TRACE): a line per stage (scale, offset) on the model's stage time, then the
hand-off latency on the run's throughput and the median latencies of its trickle and its burst
(orca_ext/sim/stages.py).

"Forward time err" is the cost model alone on the engine's own iterations of each run (a
pipeline: on the stages' logged times), in total and split into pure decodes and iterations with
prompt tokens. --iterations-out keeps every run's iterations for offline checks of the model.

The lead's run, about 10 minutes on a quiet 2-core machine:

    python bench/sim_validate.py --configs orca static orca-pp2 --rates 0.3 inf --requests 16 \
        --repeats 2 --fit-requests 32 --out bench/sim_validation_max.json --table-out bench/sim_validation_max.md
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from orca_ext import EngineConfig, Server  # noqa: E402
from orca_ext.distributed.batch_trace import TRACE_ENV, read_traces  # noqa: E402
from orca_ext.sim.cost import Roofline  # noqa: E402
from orca_ext.sim.fit import calibration_from_records, fit_hardware, fit_trace  # noqa: E402
from orca_ext.sim.stages import fit_handoff, fit_stages, stage_times  # noqa: E402
from orca_ext.sim.loop import simulate  # noqa: E402
from orca_ext.sim.measure import observed_trace, replay  # noqa: E402
from orca_ext.sim.presets import load_hardware, load_shape  # noqa: E402
from orca_ext.sim.trace import synthetic  # noqa: E402

METRICS = ("output_tokens_per_s", "median_normalized_latency_s", "p99_ttft_s")
# Prefix caching off: every repeat replays the same prompts, which the engine's cache would serve
# from the repeat before (the simulator's cache sees only the shared prefixes a trace declares).
CONFIGS = {"orca": dict(scheduler="orca", prefix_caching=False), "static": dict(scheduler="static", prefix_caching=False),
           "orca-pp2": dict(scheduler="orca", pipeline_parallel_size=2, prefix_caching=False)}


def worker_spans(folder: Path, n_stages: int) -> list[dict]:
    """Per stage (worker rank = stage with tp 1): batch index -> (start, end), monotonic seconds."""
    traces = read_traces(folder)
    return [{i: (a, b) for i, a, b in traces.get(rank, [])} for rank in range(n_stages)]


def stage_errors(times, cost) -> dict:
    """A pipeline's stage model against the workers' own timings: per stage the summed and the
    median per-batch error (a later stage's measured time holds the activations' wait, which
    its fitted offset covers; the model's hand-off latency is not added to it)."""
    n = cost.n_stages
    pred = np.array([[cost.stage_time(w, j) for j in range(n)] for w in times.works])
    return {"batches": len(times.works), "stage_total_err": (pred.sum(0) / times.stage_s.sum(0) - 1).tolist(),
            "stage_median_abs_err": np.median(np.abs(pred / times.stage_s - 1), axis=0).tolist(),
            **forward_errors(times.works, pred.sum(1), times.stage_s.sum(1))}


def fit_pipeline(server, shape, hw, config, name: str, n_requests: int, seed: int, trace_dir: Path,
                 log: IterationLog):
    """A pipeline's cost model: each stage priced by the single-process fit `hw` (its share of the
    layers), corrected by a line per stage fitted to the workers' own timings of the pipeline
    server's fit-workload run, then the hand-off latency fitted on that run's throughput and the
    median latencies of its trickle and its burst (orca_ext/sim/stages.py). Returns the cost model and the in-sample check: the
    fit run simulated, and the stage errors before and after the correction."""
    trace = fit_trace(n_requests, seed)
    skip = len(server.iterations())
    measured = replay(server, trace, seed=seed, prefix="ppfit-")
    times = stage_times(server.iterations()[skip:], {f"ppfit-{i}": r.prompt_len for i, r in enumerate(trace)},
                        worker_spans(trace_dir, config.pipeline_parallel_size))
    log.add(f"{name} fit", times.works, times.stage_s)
    single = Roofline(shape, dataclasses.replace(hw, link_latency_s=0.0), pp=config.pipeline_parallel_size)
    stages = fit_stages(times, single)
    corrected = dataclasses.replace(single, stage_scale=stages.scales, stage_offset_s=stages.offsets_s)
    sim_trace = observed_trace(measured)
    halves = (range(n_requests // 2), range(n_requests // 2, n_requests))  # fit_trace: a trickle, a burst
    handoff = fit_handoff(sim_trace, config, corrected, server.n_slots, measured, halves, shape.kv_bytes_per_token)
    cost = dataclasses.replace(corrected, hw=dataclasses.replace(
        hw, link_latency_s=handoff, source=hw.source + "; stage lines and hand-off latency fitted on the pipeline "
        "server's fit-workload run"))
    sim = simulate(sim_trace, config, cost, server.n_slots, shape.kv_bytes_per_token, "cpu")
    check = {"config": name, "measured": measured.summary(), "predicted": sim.summary(),
             "stage_scales": list(stages.scales), "stage_offsets_s": list(stages.offsets_s),
             "handoff_latency_s": handoff, "single_process": stage_errors(times, single),
             "fitted": stage_errors(times, cost)}
    print("fit", json.dumps(check), flush=True)
    return cost, check


def forward_errors(works, pred, meas) -> dict:
    """The cost model's summed time against the measured sum, over all iterations, over pure
    decodes and over iterations with prompt tokens (chunks or whole prompts, most beside decodes)."""
    pred, meas = np.asarray(pred, float), np.asarray(meas, float)
    decode = np.array([w.new_tokens == w.rows for w in works], bool)

    def err(sel) -> float:
        return float(pred[sel].sum() / meas[sel].sum() - 1) if sel.any() else float("nan")

    return {"forward_total_err": err(np.ones_like(decode)), "forward_decode_err": err(decode),
            "forward_prompt_err": err(~decode), "prompt_time_share": float(meas[~decode].sum() / meas.sum())}


class IterationLog:
    """--iterations-out: per run one JSON line, each iteration's Work and measured times (a
    single process: the forward, launch to complete; a pipeline: each stage's logged time), so
    the cost model can be refitted and checked offline on held-out iterations."""

    def __init__(self, path) -> None:
        self.path = Path(path) if path else None
        if self.path:
            self.path.write_text("")

    def add(self, label: str, works, times) -> None:
        if self.path:
            line = {"run": label, "works": [dataclasses.astuple(w) for w in works],
                    "work_fields": [f.name for f in dataclasses.fields(works[0])] if works else [],
                    "seconds": np.asarray(times, float).tolist()}
            with self.path.open("a") as f:
                f.write(json.dumps(line) + "\n")


def forward_error(records, prompt_lens, cost) -> dict:
    """The cost model's summed forward time over the engine's own iterations of a run, against
    the measured sum: the cost model's error apart from the schedule's."""
    cal = calibration_from_records(records, prompt_lens)
    return forward_errors(cal.works, [cost.stage_time(w) for w in cal.works], cal.forward_s), cal


def fit_here(server, shape, name: str, n_requests: int, seed: int, log: IterationLog):
    """Serve the fit workload on `server` (record_iterations=True) and fit a Hardware to it;
    returns it and the in-sample check (the fit run simulated with the fitted model)."""
    trace = fit_trace(n_requests, seed)
    skip = len(server.iterations())
    measured = replay(server, trace, seed=seed, prefix="fit-")
    cal = calibration_from_records(server.iterations()[skip:], {f"fit-{i}": r.prompt_len for i, r in enumerate(trace)})
    log.add(f"{name} fit", cal.works, cal.forward_s)
    hw = fit_hardware(shape, cal, name="cpu", source=f"fitted on {len(cal.works)} iterations of the fit workload, "
                      "this machine, just before the validation runs")
    model = Roofline(shape, hw)
    pred = np.array([model.stage_time(w) for w in cal.works])
    meas = np.array(cal.forward_s)
    sim = simulate(observed_trace(measured), server.config, model, server.n_slots, shape.kv_bytes_per_token, "cpu")
    rows = sorted({w.rows for w in cal.works})
    check = {"config": name, "measured": measured.summary(), "predicted": sim.summary(),
             "iterations": len(cal.works), "rows_seen": [rows[0], rows[-1]],
             **forward_errors(cal.works, pred, meas),
             "forward_median_abs_err": float(np.median(np.abs(pred / meas - 1))),
             "host_gap_median_s": float(np.median(cal.host_s)) if cal.host_s else 0.0}
    print("fit", json.dumps(check), flush=True)
    return hw, check


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hardware", default=str(REPO / "bench" / "sim_cpu_hardware.json"))
    p.add_argument("--shape", default=str(REPO / "bench" / "sim_cpu_shape.json"))
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--rates", nargs="+", type=float, default=[0.3, float("inf")])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--fit-requests", type=int, default=32)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=str(REPO / "bench" / "sim_validation_max.json"))
    p.add_argument("--table-out", default=str(REPO / "bench" / "sim_validation_max.md"))
    p.add_argument("--iterations-out", default=None,
                   help="JSONL: every run's iterations (Work, measured seconds), for offline checks of the cost model")
    args = p.parse_args()
    log = IterationLog(args.iterations_out)
    hw, shape = load_hardware(args.hardware), load_shape(args.shape)
    rows, checks = [], []
    for name in args.configs:
        config = EngineConfig(max_batch_size=args.max_batch_size, **CONFIGS[name])
        trace_dir = Path(tempfile.mkdtemp(prefix="sim-validate-"))
        if config.pipeline_parallel_size > 1:  # the workers log each batch's start and end there
            os.environ[TRACE_ENV] = str(trace_dir)
        with Server(config=dataclasses.replace(config, record_iterations=True)) as server:
            os.environ.pop(TRACE_ENV, None)
            replay(server, synthetic(2, float("inf"), (8, 16), (2, 4), seed=99), prefix="warmup-")
            if config.pipeline_parallel_size > 1:
                cost, check = fit_pipeline(server, shape, hw, config, name, args.fit_requests, args.seed + 1000,
                                           trace_dir, log)
            else:
                hw, check = fit_here(server, shape, name, args.fit_requests, args.seed + 1000, log)
                cost = Roofline(shape, hw)
            checks.append(check)
            for rate in args.rates:
                trace = synthetic(args.requests, rate, (8, 128), (1, 128), seed=args.seed)
                runs = []
                for rep in range(args.repeats):
                    t = time.perf_counter()
                    skip = len(server.iterations())
                    prefix = f"{name}-{rate}-{rep}-"
                    measured = replay(server, trace, seed=args.seed, prefix=prefix)
                    sim = simulate(observed_trace(measured), config, cost, server.n_slots,
                                   shape.kv_bytes_per_token, "cpu")
                    runs.append({"measured": measured.summary(), "predicted": sim.summary(),
                                 "wall_s": time.perf_counter() - t})
                    # The cost model alone, out of sample, on the engine's own iterations.
                    records = server.iterations()[skip:]
                    prompt_lens = {f"{prefix}{i}": r.prompt_len for i, r in enumerate(trace)}
                    if config.pipeline_parallel_size == 1:
                        errors, cal = forward_error(records, prompt_lens, cost)
                        runs[-1] |= errors
                        log.add(f"{name} {rate:g} {rep}", cal.works, cal.forward_s)
                    else:
                        times = stage_times(records, prompt_lens, worker_spans(trace_dir, cost.n_stages))
                        stages = stage_errors(times, cost)
                        runs[-1] |= {"stages": stages} | {k: v for k, v in stages.items()
                                                          if k.startswith(("forward", "prompt"))}
                        log.add(f"{name} {rate:g} {rep}", times.works, times.stage_s)
                    print(name, rate, rep, json.dumps(runs[-1]), flush=True)
                rows.append({"config": name, "rate": rate, "hardware": dataclasses.asdict(cost.hw),
                             "stage_scale": list(cost.stage_scale),
                             "n_slots": server.n_slots, "runs": runs})
                Path(args.out).write_text(json.dumps({"fit_checks": checks, "rows": rows},
                                                     indent=1, default=str) + "\n")
                Path(args.table_out).write_text(fit_table(checks) + "\n\n" + table(rows) + "\n")
        shutil.rmtree(trace_dir, ignore_errors=True)
    print(fit_table(checks))
    print(table(rows))
    return 0


def fit_table(checks) -> str:
    """Markdown: each fit run simulated with its own fit (in sample), per metric the error."""
    head = ("| config (fit run, in sample) | " + " | ".join(f"{m} meas | pred | err" for m in METRICS)
            + " | fitted |")
    out = [head, "|" + "---|" * (2 + 3 * len(METRICS))]
    for c in checks:
        cells = [c["config"]]
        for m in METRICS:
            mm, pm = c["measured"][m], c["predicted"][m]
            cells += [f"{mm:.3g}", f"{pm:.3g}", f"{(pm - mm) / mm:+.1%}"]
        if "stage_scales" in c:
            single, fitted = c["single_process"], c["fitted"]
            lines = ", ".join(f"{a:.2f} x model {b * 1e3:+.1f} ms"
                              for a, b in zip(c["stage_scales"], c["stage_offsets_s"]))
            cells.append(f"stages {lines}; hand-off {c['handoff_latency_s'] * 1e3:.1f} ms; workers' own "
                         f"timings of {single['batches']} batches, stage 0 / last stage: single-process "
                         f"model {single['stage_total_err'][0]:+.1%} / {single['stage_total_err'][-1]:+.1%}, fitted "
                         f"{fitted['stage_total_err'][0]:+.1%} / {fitted['stage_total_err'][-1]:+.1%} (median abs err "
                         f"{fitted['stage_median_abs_err'][0]:.0%} / {fitted['stage_median_abs_err'][-1]:.0%})")
        else:
            cells.append(f"{c['iterations']} iterations of {c['rows_seen'][0]}-{c['rows_seen'][1]} rows; "
                         f"forward total {c['forward_total_err']:+.1%} (decodes {c['forward_decode_err']:+.1%}, with "
                         f"prompt tokens {c['forward_prompt_err']:+.1%}), median abs err "
                         f"{c['forward_median_abs_err']:.0%}")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def table(rows) -> str:
    """Markdown: per config and rate, measured (mean of runs, spread = max-min over mean) vs
    predicted (mean), the error of the mean prediction, and the cost model's error on the sum of
    the engine's own forward times in those runs (a pipeline: of the stages' times as the workers
    logged them)."""
    head = ("| config | rate/s | " + " | ".join(f"{m} meas (spread) | pred | err" for m in METRICS)
            + " | forward time err | decodes / with prompt tokens (their time share) |")
    out = [head, "|" + "---|" * (4 + 3 * len(METRICS))]
    for row in rows:
        cells = [row["config"], f"{row['rate']:g}"]
        for m in METRICS:
            meas = [r["measured"][m] for r in row["runs"]]
            pred = [r["predicted"][m] for r in row["runs"]]
            mm, pm = sum(meas) / len(meas), sum(pred) / len(pred)
            spread = (max(meas) - min(meas)) / mm if mm else 0.0
            cells += [f"{mm:.3g} ({spread:.0%})", f"{pm:.3g}", f"{(pm - mm) / mm:+.1%}"]
        cells += forward_cells(row["runs"])
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def forward_cells(runs) -> list[str]:
    """The mean over runs of the cost model's forward time error: in total, and split."""
    def mean(key: str) -> float:
        return float(np.nanmean([r[key] for r in runs])) if all(key in r for r in runs) else float("nan")

    total, decode, prompt, share = (mean(k) for k in ("forward_total_err", "forward_decode_err",
                                                      "forward_prompt_err", "prompt_time_share"))
    if np.isnan(total):
        return ["-", "-"]
    return [f"{total:+.1%}", f"{decode:+.1%} / {prompt:+.1%} ({share:.0%})"]


if __name__ == "__main__":
    sys.exit(main())
