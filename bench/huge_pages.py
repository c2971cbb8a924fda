"""A/B of CPU weights in transparent huge pages against torch's own allocation, in one run.

For each dtype the default model is loaded twice, with the kernel mode `huge_pages`
(orca_ext/modes.py) False and True (the same weights, bit for bit: the logits are checked to be equal first); each copy
allocates its KV cache the same way as its weights. One T=1
decode forward (a request with a `--context`-token prompt already in the cache) is then timed on
the two models taking turns step by step (the first of each pair alternates), `--steps` timed
steps each after a warm-up. Printed per dtype: best and median per mode, the weights' effective
read rate (weight bytes / median step) next to the streaming-read ceiling measured in the same
process, and how much of the process's anonymous memory the kernel really backed with huge pages
(`AnonHugePages` of /proc/self/smaps_rollup; 0 means the system declined, e.g. THP "never").
Run it on a quiet machine, serialised with other benchmarks:

    flock /tmp/orca_bench.lock .venv/bin/python bench/huge_pages.py [--dtypes float32 bfloat16]
        [--steps 60] [--context 191]
"""
from __future__ import annotations

import gc
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout without an install

from decode_ab import ab, decode_batch, parse_args, summary, weight_bytes  # noqa: E402
from orca_ext import modes  # noqa: E402
from orca_ext.models import load_model  # noqa: E402
from peer_cpu import read_bandwidth_gbs  # noqa: E402


def anon_huge_mib() -> float:
    """AnonHugePages of this process in MiB (0 where the file does not exist)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def load(path, dtype: str, huge: bool, context: int):
    """The model, its KV cache allocated, with huge pages on or off for both."""
    with modes.using(huge_pages=huge):
        model = load_model(path, dtype=dtype)
        model.allocate_kv_cache(context + 8)
        return model


def decode_step(model, context: int):
    decode = decode_batch(model, context)
    return lambda: model.forward(decode)


def main(argv=None) -> int:
    args, path = parse_args(__doc__.split("\n\n")[0], default_context=191, argv=argv)
    for dtype in args.dtypes:
        small = load(path, dtype, huge=False, context=args.context)
        huge_before = anon_huge_mib()
        huge = load(path, dtype, huge=True, context=args.context)
        backed = anon_huge_mib() - huge_before
        with torch.inference_mode():
            step_small, step_huge = decode_step(small, args.context), decode_step(huge, args.context)
            assert torch.equal(step_small(), step_huge()), "the two copies of the weights give different logits"
            ceiling = read_bandwidth_gbs()
            t_huge, t_small = ab(step_huge, step_small, args.steps)
        gb = weight_bytes(huge) / 1e9
        print(f"\n{dtype}: one decode forward, {gb * 1e3:.0f} MB of weights; {backed:.0f} MiB now backed "
              f"by huge pages; streaming-read ceiling {ceiling:.1f} GB/s")
        for name, ms in (("huge", t_huge), ("4 KiB", t_small)):
            rate = gb / (statistics.median(ms) / 1e3)
            print(f"{summary(name, ms)}  weights at {rate:5.1f} GB/s = {100 * rate / ceiling:.0f}% of the ceiling")
        gain = statistics.median(t_small) - statistics.median(t_huge)
        print(f"{'saved':>10}: median {gain:.3f} ms ({100 * gain / statistics.median(t_small):.1f}%), "
              f"best {min(t_small) - min(t_huge):.3f} ms")
        del small, huge, step_small, step_huge
        gc.collect()  # the next dtype's count of huge pages starts from this one's release
    return 0


if __name__ == "__main__":
    sys.exit(main())
