"""Tensor and pipeline parallelism on several GPUs (NCCL): parity with one GPU and throughput.

Run by bench/device_check.sh when more than one GPU is visible; written on a machine without
GPUs, so it checks everything it relies on and reports instead of asserting.

For every configuration that fits the visible GPUs (tp2, pp2, tp2 x pp2, tp4, tp4 x pp2, ...):
  - parity: greedy tokens of 8 requests against the single-GPU engine (bfloat16: tensor ranks sum
    in another order, so the fraction of identical tokens is reported, and the largest logit
    difference of one ragged batch);
  - throughput of one workload through the engine, and with pp > 1 once with n_workers = 1 (one
    batch in flight) and once with n_workers = pp (Orca);
  - the workers' time split (compute vs NCCL all-reduce / gather / activation transfer, synced
    per span, so compute excludes communication).
Plus NCCL all-reduce and point-to-point times of [T, H] bfloat16 tensors between two GPUs.

The model is a random Llama-shaped checkpoint (no tokenizer needed): hidden 2048, 16 heads / 8 KV
heads, intermediate 5632, 8 layers, vocabulary 32000, bfloat16.

    python bench/parallel_gpu.py --gpus 8 --out parallel_gpu.json
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from parallel import breakdown, run_engine, time_transfers, workload  # noqa: E402

log = logging.getLogger("bench.parallel_gpu")

SHAPE = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, max_position_embeddings=4096, vocab_size=32000, rms_norm_eps=1e-5,
             tie_word_embeddings=False)


def hf_config():
    """The transformers LlamaConfig of SHAPE."""
    import transformers

    config = transformers.LlamaConfig(**SHAPE)
    config.architectures = ["LlamaForCausalLM"]
    return config


def build_model(folder: Path) -> Path:
    import transformers

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config()).to(torch.bfloat16)
    model.save_pretrained(str(folder), safe_serialization=True)
    return folder


def configurations(gpus: int) -> list[tuple[int, int]]:
    out = []
    for tp, pp in ((2, 1), (1, 2), (2, 2), (4, 1), (4, 2), (8, 1), (2, 4)):
        if tp * pp <= gpus:
            out.append((tp, pp))
    return out


def nccl_transfers(gpus: int) -> list[dict]:
    import torch.multiprocessing as mp

    if gpus < 2:
        return []
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = 29600 + os.getpid() % 1000
    procs = [ctx.Process(target=_nccl_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    rows = queue.get(timeout=300)
    for p in procs:
        p.join(60)
    return rows


def _nccl_worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    rows = []
    for t in (8, 64, 512, 4096):
        x = torch.randn(t, SHAPE["hidden_size"], device="cuda", dtype=torch.bfloat16)
        for _ in range(10):
            dist.all_reduce(x)
        p2p, ar = time_transfers(x, rank, 100, sync=torch.cuda.synchronize)
        rows.append({"tokens": t, "bytes": x.numel() * 2, "all_reduce_us": 1e6 * ar, "p2p_us": 1e6 * p2p,
                     "p2p_GBps": x.numel() * 2 / p2p / 1e9})
    if rank == 0:
        queue.put(rows)
    dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--out", default="parallel_gpu.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from orca_ext.distributed import DistributedExecutor
    from orca_ext.engine import Engine
    from orca_ext.models import ForwardBatch, ModelSpec, load_model
    from orca_ext.config import EngineConfig
    from orca_ext.executor import LocalExecutor
    from orca_ext.scheduler import make_scheduler

    result: dict = {"gpus": args.gpus, "device": torch.cuda.get_device_name(0), "model": SHAPE, "configs": {},
                    "date": time.strftime("%Y-%m-%d")}
    out = Path(args.out)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp) / "model")
        spec = ModelSpec.from_pretrained(model_dir)
        jobs = workload(args.requests, (64, 512), (64, 256))
        parity_jobs = jobs[:8]
        n_slots = sum(len(p) + n for p, n in jobs) + 256
        ragged = [(jobs[0][0][:37], 0, 0), (jobs[1][0][:5], 0, 1000), (jobs[2][0][:130], 0, 3000)]
        single = load_model(model_dir, "cuda:0", "bfloat16")
        config = EngineConfig(max_batch_size=args.max_batch_size, max_num_batched_tokens=None)
        local = Engine(LocalExecutor(single), make_scheduler(config, n_slots))
        run_engine(local, jobs[:4], "warm")
        base = run_engine(local, jobs, "base")
        ref_tokens = run_engine(local, parity_jobs, "ref")["outputs"]
        single.allocate_kv_cache(n_slots)
        ref_logits = single.forward(ForwardBatch.build(ragged, "cuda:0")).float().cpu()
        result["configs"]["tp1_pp1"] = {k: v for k, v in base.items() if k != "outputs"}
        del local, single
        torch.cuda.empty_cache()
        for tp, pp in configurations(args.gpus):
            name = f"tp{tp}_pp{pp}"
            entry: dict = {}
            executor = None
            try:
                executor = DistributedExecutor(str(model_dir), spec, tensor_parallel_size=tp,
                                               pipeline_parallel_size=pp, device="cuda", dtype="bfloat16",
                                               sync_timing=False)
                sched = make_scheduler(config, n_slots, n_workers=pp)
                engine = Engine(executor, sched)
                logits = executor.forward_logits(ragged).result(timeout=300)
                entry["max_logit_diff_vs_1gpu"] = float((logits - ref_logits).abs().max())
                got = run_engine(engine, parity_jobs, "p")["outputs"]
                same = sum(a == b for x, y in zip(got, ref_tokens) for a, b in zip(x, y))
                entry["greedy_tokens_same_as_1gpu"] = same / sum(len(x) for x in ref_tokens)
                run_engine(engine, jobs[:4], "w")
                for n_workers in sorted({1, pp}):
                    sched.n_workers = n_workers
                    executor.worker_stats(reset=True)
                    run = run_engine(engine, jobs, f"r{n_workers}")
                    run.pop("outputs")
                    run["workers"] = [breakdown(t, run["iterations"]) for t in executor.worker_stats()]
                    run["speedup_vs_1gpu"] = run["tokens_per_s"] / base["tokens_per_s"]
                    entry[f"n_workers_{n_workers}"] = run
            except Exception:
                entry["error"] = traceback.format_exc()[-3000:]
                log.exception("%s failed", name)
            finally:
                if executor is not None:
                    executor.shutdown()
            result["configs"][name] = entry
            out.write_text(json.dumps(result, indent=1))
    try:
        result["nccl_transfers"] = nccl_transfers(args.gpus)
    except Exception:
        result["nccl_transfers_error"] = traceback.format_exc()[-2000:]
    out.write_text(json.dumps(result, indent=1))
    for name, entry in result["configs"].items():
        if "error" in entry:
            print(f"{name:10s} ERROR {entry['error'].splitlines()[-1]}")
            continue
        runs = {k: v for k, v in entry.items() if k.startswith("n_workers") or k == "tokens_per_s"}
        print(f"{name:10s} " + " ".join(f"{k}={v['tokens_per_s']:.0f} tok/s" for k, v in runs.items()
                                        if isinstance(v, dict)) +
              (f"  same tokens {entry.get('greedy_tokens_same_as_1gpu', 0):.3f}"
               f"  max logit diff {entry.get('max_logit_diff_vs_1gpu', 0):.3g}" if "max_logit_diff_vs_1gpu" in entry else
               f"  {entry.get('tokens_per_s', 0):.0f} tok/s"))
    return 1 if any("error" in e for e in result["configs"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
