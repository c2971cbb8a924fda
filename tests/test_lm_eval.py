"""lm-evaluation-harness scores our server exactly as it scores the model itself.

A short run of bench/lm_eval_check.py: a multiple-choice task scored by loglikelihood (lm-eval's
`local-completions` backend sends `echo: true, logprobs: 1, max_tokens: 1` with token-id prompts
and reads the echoed prompt logprobs) and a `generate_until` task, against `python -m orca_ext
serve` on a tiny random llama and against lm-eval's own `hf` backend on the same folder in
float32: equal accuracy and exact match, per-example loglikelihoods within 1e-3, the same
is_greedy flags and the same generations.
"""
from __future__ import annotations

import sys
from pathlib import Path

from http_utils import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from lm_eval_check import run_check  # noqa: E402


def test_lm_eval_local_completions_equals_hf(tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir("llama")
    with ServerProcess("--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
                       "--served-model-name", "tiny", "--n-slots", "1024", "--max-num-batched-tokens", "16",
                       "--max-batch-size", "4") as sp:
        ours, ref, problems = run_check(model_dir, sp.base_url, "tiny", tmp_path, n_mc=12, n_gen=4, tol=1e-3)
    assert problems == [], problems
    assert len(ours["loglik"]) == 12 and all(len(choices) == 4 for choices in ours["loglik"])
    assert len(ours["gens"]) == 4
