"""Fit the simulator's cost model to this machine: one run of the engine on the fit workload
(orca_ext.sim.fit.fit_trace: half the requests one every 0.5 s, half at once, so iterations span
1 to 16 rows and prompt chunks; record_iterations=True) on the default model, fitted in the
roofline's max(compute, memory) form (orca_ext/sim/fit.py). Writes the fitted Hardware and the
model's shape as JSON, and prints the fit's error per row count.

The fit workload differs from the validation workload of bench/sim_validate.py (Poisson arrivals,
prompts U[8, 128], outputs U[1, 128]), so the validation never sees the data it was fitted on.

    python bench/sim_calibrate.py [--out bench/sim_cpu_hardware.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from orca_ext import Server  # noqa: E402
from orca_ext.sim.cost import ModelShape, Roofline  # noqa: E402
from orca_ext.sim.fit import calibration_from_records, fit_hardware, fit_trace  # noqa: E402
from orca_ext.sim.measure import replay  # noqa: E402
from orca_ext.sim.presets import save_hardware, save_shape  # noqa: E402
from orca_ext.sim.trace import synthetic  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-batch-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=str(REPO / "bench" / "sim_cpu_hardware.json"))
    p.add_argument("--shape-out", default=str(REPO / "bench" / "sim_cpu_shape.json"))
    args = p.parse_args()
    trace = fit_trace(args.requests, args.seed)
    with Server(max_batch_size=args.max_batch_size, record_iterations=True, prefix_caching=False) as server:
        replay(server, synthetic(2, float("inf"), (8, 16), (2, 4), seed=99), prefix="warmup-")  # not fitted
        skip = len(server.iterations())
        measured = replay(server, trace, seed=args.seed, prefix="fit-")
        records = server.iterations()[skip:]
        prompt_lens = {f"fit-{i}": r.prompt_len for i, r in enumerate(trace)}
        param_bytes = server.dtype.itemsize
        spec = server.executor.spec
    model_path = Path(str(server.model_path))
    # A single-file model (the default: its GGUF, Q4_1 matrices served as they are) streams its
    # stored blocks, not param_bytes per weight; the file's size is that weight stream.
    weight_bytes = model_path.stat().st_size if model_path.is_file() else None
    shape = ModelShape.from_spec(spec, param_bytes, name=model_path.name, weight_bytes=weight_bytes)
    cal = calibration_from_records(records, prompt_lens)
    hw = fit_hardware(shape, cal, name=f"cpu-{platform.node()}",
                      source=f"fitted on {len(records)} iterations of this machine ({platform.processor() or 'cpu'}, "
                             f"load average {os.getloadavg()[0]:.1f}), bench/sim_calibrate.py")
    pred = np.array([Roofline(shape, hw).stage_time(w) for w in cal.works])
    meas = np.array(cal.forward_s)
    err = (pred - meas) / meas
    by_rows = {}
    for w, e in zip(cal.works, err):
        by_rows.setdefault(w.rows, []).append(e)
    save_hardware(hw, args.out)
    save_shape(shape, args.shape_out)
    print(json.dumps({"hardware": args.out, "iterations": len(records), "measured_tokens_per_s":
                      measured.summary()["output_tokens_per_s"], "forward_fit_median_abs_err": float(np.median(np.abs(err))),
                      "forward_total_err": float(pred.sum() / meas.sum() - 1),
                      "median_err_by_rows": {k: round(float(np.median(v)), 3) for k, v in sorted(by_rows.items())},
                      "fitted": {k: v for k, v in vars(hw).items() if k not in ("name", "source")}}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
