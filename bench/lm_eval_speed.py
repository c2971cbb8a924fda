"""How fast lm-evaluation-harness scores a model through our server, against lm-eval's own `hf`
backend (transformers in the evaluating process), at the same batch size on the same folder.

lm-eval's `local-completions` backend sends `batch_size` prompts per request (a completions batch:
each multiple-choice continuation is a token-id prompt with `echo: true, logprobs: 1,
max_tokens: 1`); with batch_size 1 it sends one request at a time. The `hf` backend runs
`batch_size` padded sequences per forward. Both score the same multiple-choice task (bench/
lm_eval_check.py's, written here offline) in float32 on the same model folder, and the scores are
checked equal (accuracy, every loglikelihood within --tol, is_greedy flags) before any time counts.
Each system's lm-eval model object is built once per batch size, outside the timing (loading the
weights or the tokenizer is not scoring).

Per round and batch size the two systems take turns (the order alternating by round); the server
runs with --max-batch-size equal to the largest batch size and --threads threads, lm-eval's client
shares the same cores. Reported: documents per second (each document is 4 scored continuations),
min and median over rounds, and ours / hf per round.

    python bench/lm_eval_speed.py                                 # the default model, 100 documents
    python bench/lm_eval_speed.py --n-mc 200 --batch-sizes 1 8 32 --rounds 3 --png bench/lm_eval_speed.png
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "bench")]

from lm_eval_check import MC_TASK, compare, evaluate, write_tasks  # noqa: E402

log = logging.getLogger("lm_eval_speed")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def build_lm(backend: str, model_args: dict, batch_size: int):
    """The lm-eval model object, built once per system and batch size: loading a model or a
    tokenizer is not part of the time measured."""
    import lm_eval.api.registry

    return lm_eval.api.registry.get_model(backend).create_from_arg_obj(
        model_args, {"batch_size": batch_size, "max_batch_size": None, "device": "cpu"})


def timed_evaluate(task_dir: Path, lm, batch_size: int) -> tuple[float, dict]:
    start = time.perf_counter()
    result = evaluate(task_dir, lm, None, batch_size, tasks=(MC_TASK,))
    return time.perf_counter() - start, result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF model folder with a tokenizer (default: the embedded default model)")
    ap.add_argument("--n-mc", type=int, default=100, help="multiple-choice documents (4 continuations each)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context-words", type=int, default=0,
                    help="words added in front of each question: a long context its 4 choices share")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tol", type=float, default=1e-3)
    ap.add_argument("--json", help="write the raw timings here")
    ap.add_argument("--png", help="draw documents/s against batch size here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import os

    import torch

    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from http_utils import ServerProcess

    from orca_ext.default_model import default_model_path

    model_dir = Path(args.model) if args.model else Path(default_model_path())
    times: dict[str, dict[int, list[float]]] = {"ours": {}, "hf": {}}
    with tempfile.TemporaryDirectory() as tmp, \
            ServerProcess("--model", str(model_dir), "--device", "cpu", "--dtype", "float32",
                          "--served-model-name", "speed", "--max-batch-size", str(max(args.batch_sizes)),
                          "--max-queue", "1024", env={"OMP_NUM_THREADS": str(args.threads)}) as server:
        task_dir = write_tasks(Path(tmp) / "tasks", args.n_mc, 0, context_words=args.context_words)
        ours_args = {"base_url": f"{server.base_url}/v1/completions", "model": "speed",
                     "tokenizer_backend": "huggingface", "tokenizer": str(model_dir), "tokenized_requests": True,
                     "num_concurrent": 1, "max_retries": 1, "max_length": 512}
        hf_args = {"pretrained": str(model_dir), "dtype": "float32", "max_length": 512}
        plan = [(r, b, system) for r in range(args.rounds) for b in args.batch_sizes
                for system in (("ours", "hf") if r % 2 == 0 else ("hf", "ours"))]
        lms = {("ours", b): build_lm("local-completions", ours_args, b) for b in args.batch_sizes}
        lms.update({("hf", b): build_lm("hf", hf_args, b) for b in args.batch_sizes})
        checked: dict[int, dict] = {}
        for r, b, system in tqdm(plan, desc="lm-eval runs"):
            seconds, result = timed_evaluate(task_dir, lms[system, b], b)
            times[system].setdefault(b, []).append(seconds)
            # Validate before the time counts: the same scores as the other system at this size.
            other = checked.setdefault(b, {}).get("hf" if system == "ours" else "ours")
            if other is not None:
                ours, ref = (result, other) if system == "ours" else (other, result)
                problems = compare(ours, ref, args.tol)
                if problems:
                    log.error("batch size %d: scores differ: %s", b, problems[:5])
                    return 1
            checked[b][system] = result
            log.info("round %d, batch size %d, %s: %.1f s (%.2f documents/s)", r, b, system, seconds,
                     args.n_mc / seconds)
    rows = []
    for b in args.batch_sizes:
        ours, hf = times["ours"][b], times["hf"][b]
        rows.append({"batch_size": b, "ours_docs_per_s": [args.n_mc / t for t in ours],
                     "hf_docs_per_s": [args.n_mc / t for t in hf],
                     "ours_over_hf": [h / o for o, h in zip(ours, hf)]})
    print(f"\n{cpu_model()}, {args.threads} threads, {model_dir.name} float32, {args.n_mc} documents "
          f"x 4 continuations, {args.context_words} context words more, {args.rounds} rounds")
    print("| batch size | ours docs/s (min-median) | lm-eval hf docs/s | ours / hf (per round) |")
    print("|---|---|---|---|")
    for row in rows:
        o, h = row["ours_docs_per_s"], row["hf_docs_per_s"]
        ratios = " / ".join(f"{x:.2f}" for x in row["ours_over_hf"])
        print(f"| {row['batch_size']} | {min(o):.2f}-{statistics.median(o):.2f} "
              f"| {min(h):.2f}-{statistics.median(h):.2f} | {ratios} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_model(), "threads": args.threads, "model": model_dir.name,
                                               "n_mc": args.n_mc, "context_words": args.context_words,
                                               "rows": rows}, indent=1))
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        sizes = [row["batch_size"] for row in rows]
        for key, label in (("ours_docs_per_s", "orca_ext server (local-completions)"),
                           ("hf_docs_per_s", "lm-eval hf backend")):
            ax.plot(sizes, [statistics.median(row[key]) for row in rows], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("lm-eval batch_size")
        ax.set_ylabel("documents / s (median)")
        context = f", contexts +{args.context_words} words" if args.context_words else ""
        ax.set_title(f"lm-eval multiple choice, {model_dir.name} float32{context}\n{cpu_model()}, "
                     f"{args.threads} threads", fontsize=9)
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.png, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
