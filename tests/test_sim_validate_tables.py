"""bench/sim_validate.py's tables and forward-time errors, on made-up checks: every column the
results page reads is there (the in-sample checks, the pipeline's per-stage check, the forward
time error and its split), so a long validation run does not fail at its last step."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from orca_ext.sim.work import Work

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "sim_validate.py"


@pytest.fixture(scope="module")
def sim_validate():
    spec = importlib.util.spec_from_file_location("sim_validate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def summary(tps, lat, ttft):
    return {"output_tokens_per_s": tps, "median_normalized_latency_s": lat, "p99_ttft_s": ttft}


def test_forward_errors_split_decodes_from_iterations_with_prompt_tokens(sim_validate):
    works = [Work.of([(1, 10, True)] * 4), Work.of([(1, 10, True), (50, 0, True)]), Work.of([(1, 30, True)])]
    meas = np.array([0.02, 0.2, 0.01])
    pred = np.array([0.022, 0.18, 0.011])
    e = sim_validate.forward_errors(works, pred, meas)
    assert e["forward_total_err"] == pytest.approx(pred.sum() / meas.sum() - 1)
    assert e["forward_decode_err"] == pytest.approx(0.033 / 0.03 - 1)
    assert e["forward_prompt_err"] == pytest.approx(-0.1)
    assert e["prompt_time_share"] == pytest.approx(0.2 / 0.23)


def test_the_tables_carry_the_in_sample_checks_the_stage_check_and_the_forward_error(sim_validate):
    split = {"forward_total_err": 0.01, "forward_decode_err": 0.02, "forward_prompt_err": -0.03,
             "prompt_time_share": 0.4}
    single = {"config": "orca", "measured": summary(60, 0.2, 9), "predicted": summary(61, 0.21, 9.1),
              "iterations": 400, "rows_seen": [1, 16], "forward_median_abs_err": 0.05, **split}
    stages = {"batches": 500, "stage_total_err": [0.1, 0.3], "stage_median_abs_err": [0.2, 0.25], **split}
    pipeline = {"config": "orca-pp2", "measured": summary(80, 0.12, 4.5), "predicted": summary(80, 0.12, 4.6),
                "stage_scales": [0.9, 0.7], "stage_offsets_s": [-1e-3, 2e-3], "handoff_latency_s": 8e-3,
                "single_process": stages, "fitted": dict(stages, stage_total_err=[0.0, -0.01])}
    fit = sim_validate.fit_table([single, pipeline])
    assert "400 iterations of 1-16 rows; forward total +1.0% (decodes +2.0%, with prompt tokens -3.0%)" in fit
    assert "stages 0.90 x model -1.0 ms, 0.70 x model +2.0 ms; hand-off 8.0 ms" in fit
    assert "single-process model +10.0% / +30.0%, fitted +0.0% / -1.0%" in fit
    run = {"measured": summary(20, 0.02, 0.6), "predicted": summary(20.2, 0.021, 0.62), **split}
    rows = [{"config": "orca", "rate": 0.3, "runs": [run, run]},
            {"config": "orca-pp2", "rate": float("inf"), "runs": [dict(run, stages=stages)]},
            {"config": "static", "rate": 0.3, "runs": [{k: run[k] for k in ("measured", "predicted")}]}]
    table = sim_validate.table(rows).splitlines()
    assert "forward time err | decodes / with prompt tokens (their time share) |" in table[0]
    assert table[2].endswith("| +1.0% | +2.0% / -3.0% (40%) |")
    assert table[3].startswith("| orca-pp2 | inf |")
    assert table[4].endswith("| - | - |")  # a run without the errors
    assert all(line.count("|") == table[0].count("|") for line in table)
