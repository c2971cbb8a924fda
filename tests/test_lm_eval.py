"""lm-evaluation-harness scores our server exactly as it scores the model itself.

A short run of bench/lm_eval_check.py: a multiple-choice task scored by loglikelihood (lm-eval's
`local-completions` backend sends `echo: true, logprobs: 1, max_tokens: 1` with token-id prompts
and reads the echoed prompt logprobs) and a `generate_until` task, against `python -m orca_ext
serve` on a tiny random llama and against lm-eval's own `hf` backend on the same folder in
float32: equal accuracy and exact match, per-example loglikelihoods within 1e-3, the same
is_greedy flags and the same generations; with one prompt per request and with lm-eval's
batch_size prompts per request (a completions batch).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from http_utils import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from lm_eval_check import run_check  # noqa: E402


@pytest.mark.parametrize("batch_size", [1, 5])
def test_lm_eval_local_completions_equals_hf(tiny_model_dir, tmp_path, batch_size):
    """batch_size 5: lm-eval sends 5 prompts per request (a completions batch; 12 x 4 choices
    leave a last, partial batch)."""
    model_dir = tiny_model_dir("llama")
    with ServerProcess("--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
                       "--served-model-name", "tiny", "--n-slots", "1024", "--max-num-batched-tokens", "16",
                       "--max-batch-size", "4") as sp:
        ours, ref, problems = run_check(model_dir, sp.base_url, "tiny", tmp_path, n_mc=12, n_gen=4, tol=1e-3,
                                        batch_size=batch_size)
        requests = _completion_requests(sp.url("/metrics"))
    assert problems == [], problems
    # 12 x 4 scored continuations and 4 generations, batch_size to a request.
    assert requests == -(-48 // batch_size) - (-4 // batch_size)
    assert len(ours["loglik"]) == 12 and all(len(choices) == 4 for choices in ours["loglik"])
    assert len(ours["gens"]) == 4


def _completion_requests(metrics_url: str) -> int:
    """Completions requests the server answered, by its /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    return int(sum(sample.value for family in text_string_to_metric_families(httpx.get(metrics_url).text)
                   for sample in family.samples
                   if sample.name == "orca_http_requests_total" and sample.labels.get("endpoint") == "completions"))
