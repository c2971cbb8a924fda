"""lm-evaluation-harness against our server and against its own `hf` backend, on one model.

Two custom tasks from local JSONL files (written here, offline): a multiple-choice set scored by
loglikelihood (lm-eval's `local-completions` sends each context + continuation as token ids with
`echo: true, logprobs: 1, max_tokens: 1` and sums the echoed prompt logprobs), and a small
`generate_until` set (greedy, stop at a newline). Both run twice: with `--model local-completions`
against `python -m orca_ext serve`, and with lm-eval's `hf` backend on the same folder in float32.
The check: equal accuracies and exact-match scores, every per-example loglikelihood within
--tol, and the same is_greedy flags and generations.

    python bench/lm_eval_check.py                       # a tiny random llama, 100 + 30 examples
    python bench/lm_eval_check.py --model DIR --n-mc 500 --n-gen 100

tests/test_lm_eval.py runs a short version.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
WORDS = ("river city light music under star old new small bright road window garden morning people "
         "tree house water little green stone bird cloud paper")
MC_TASK, GEN_TASK = "orca_check_mc", "orca_check_gen"


def write_tasks(folder: Path, n_mc: int, n_gen: int, seed: int = 0, context_words: int = 0) -> Path:
    """Two JSONL data sets and their lm-eval task YAMLs in `folder`; returns the folder.
    context_words: that many more words in front of each multiple-choice question (a long
    context shared by its choices, as in few-shot tasks)."""
    rng = random.Random(seed)
    words = WORDS.split()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "mc.jsonl", "w") as f:
        for _ in range(n_mc):
            question = " ".join(rng.choice(words) for _ in range(context_words + rng.randrange(3, 12)))
            # Awkward choice lengths: 1 to 5 words, so continuations span several tokens.
            choices = [" " + " ".join(rng.choice(words) for _ in range(rng.randrange(1, 6))) for _ in range(4)]
            f.write(json.dumps({"question": question, "choices": choices, "answer": rng.randrange(4)}) + "\n")
    with open(folder / "gen.jsonl", "w") as f:
        for _ in range(n_gen):
            question = " ".join(rng.choice(words) for _ in range(rng.randrange(3, 10)))
            f.write(json.dumps({"question": question, "answer": rng.choice(words)}) + "\n")
    (folder / "mc.yaml").write_text(f"""task: {MC_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
""")
    (folder / "gen.yaml").write_text(f"""task: {GEN_TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
""")
    return folder


def evaluate(task_dir: Path, model: Any, model_args: dict | None, batch_size: int = 1,
             tasks: tuple[str, ...] = (MC_TASK, GEN_TASK)) -> dict:
    """lm_eval.simple_evaluate of the tasks -> {"acc", "exact_match", "loglik": [[(ll, greedy)]
    per choice, per doc], "gens": [str per doc]} (a task not run: None and empty lists). `model`
    is a backend name with its model_args, or an lm-eval LM already built (model_args None).
    With local-completions, batch_size > 1 sends that many prompts per request (a completions
    batch)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(tasks),
                                  task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                                  batch_size=batch_size, device="cpu", log_samples=True, bootstrap_iters=0,
                                  random_seed=0, numpy_random_seed=0, torch_random_seed=0)
    mc = sorted(out["samples"].get(MC_TASK, []), key=lambda s: s["doc_id"])
    gen = sorted(out["samples"].get(GEN_TASK, []), key=lambda s: s["doc_id"])
    return {
        "acc": out["results"][MC_TASK]["acc,none"] if MC_TASK in tasks else None,
        "exact_match": out["results"][GEN_TASK]["exact_match,none"] if GEN_TASK in tasks else None,
        "loglik": [[(float(r[0][0]), bool(r[0][1])) for r in s["resps"]] for s in mc],
        "gens": [s["resps"][0][0] for s in gen],
    }


def compare(ours: dict, ref: dict, tol: float) -> list[str]:
    """What differs between two evaluate() results (empty: the check passes)."""
    problems = []
    if ours["acc"] != ref["acc"]:
        problems.append(f"accuracy {ours['acc']} != hf {ref['acc']}")
    if ours["exact_match"] != ref["exact_match"]:
        problems.append(f"exact_match {ours['exact_match']} != hf {ref['exact_match']}")
    worst = 0.0
    for d, (a, b) in enumerate(zip(ours["loglik"], ref["loglik"])):
        for c, ((la, ga), (lb, gb)) in enumerate(zip(a, b)):
            worst = max(worst, abs(la - lb))
            if abs(la - lb) > tol:
                problems.append(f"doc {d} choice {c}: loglikelihood {la!r} vs hf {lb!r}")
            if ga != gb:
                problems.append(f"doc {d} choice {c}: is_greedy {ga} vs hf {gb}")
    for d, (a, b) in enumerate(zip(ours["gens"], ref["gens"])):
        if a != b:
            problems.append(f"gen doc {d}: {a!r} vs hf {b!r}")
    ours["max_abs_loglik_diff"] = worst
    return problems


def run_check(model_dir: Path, base_url: str, served_name: str, work: Path, n_mc: int, n_gen: int,
              tol: float, batch_size: int = 1) -> tuple[dict, dict, list[str]]:
    """Both backends on the tasks; the server at `base_url` must serve `model_dir` in float32.
    batch_size: prompts per request to our server."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    task_dir = write_tasks(work / "tasks", n_mc, n_gen)
    ours = evaluate(task_dir, "local-completions", {
        "base_url": f"{base_url}/v1/completions", "model": served_name, "tokenizer_backend": "huggingface",
        "tokenizer": str(model_dir), "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1,
        "max_length": 512}, batch_size)
    ref = evaluate(task_dir, "hf", {"pretrained": str(model_dir), "dtype": "float32", "max_length": 512})
    return ours, ref, compare(ours, ref, tol)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model folder with a tokenizer (default: a tiny random llama)")
    ap.add_argument("--n-mc", type=int, default=100)
    ap.add_argument("--n-gen", type=int, default=30)
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--batch-size", type=int, default=1, help="prompts per request to our server")
    args = ap.parse_args()
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from http_utils import ServerProcess

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = Path(args.model) if args.model else make_tiny(work / "model")
        with ServerProcess("--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
                           "--served-model-name", "orca-check", "--n-slots", "2048") as sp:
            ours, ref, problems = run_check(model_dir, sp.base_url, "orca-check", work, args.n_mc, args.n_gen,
                                            args.tol, args.batch_size)
    print(json.dumps({"ours": {k: ours[k] for k in ("acc", "exact_match", "max_abs_loglik_diff")},
                      "hf": {k: ref[k] for k in ("acc", "exact_match")},
                      "problems": problems[:20]}, indent=2))
    return 1 if problems else 0


def make_tiny(folder: Path) -> Path:
    from orca_ext.default_model import default_model_path
    from tiny_models import make_tiny_model

    return make_tiny_model(folder, "llama", tokenizer_dir=default_model_path())


if __name__ == "__main__":
    sys.exit(main())
