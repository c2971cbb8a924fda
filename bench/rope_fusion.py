"""A/B of the fused CPU rope + KV write (rope_slab_write) against the unfused path, in one run.

One T=1 decode forward of the default model (a request with a `--context`-token prompt already
in the cache) is timed with the kernel mode `fused_rope_on_cpu` (orca_ext/modes.py) True and
False, the two taking turns step by step (the first of each pair alternates), `--steps` timed steps per mode
after a warm-up; best and median per mode, per dtype. The logits of the two modes are checked to
be bit-identical first. A second table times the op alone on one layer's shapes (T=1): the
kernel against apply_rope + slab_write. Run it on a quiet machine, serialised with other
benchmarks:

    flock /tmp/orca_bench.lock .venv/bin/python bench/rope_fusion.py [--dtypes float32 bfloat16]
        [--steps 60] [--context 128]
"""
from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # a checkout without an install

from decode_ab import ab, decode_batch, parse_args, summary  # noqa: E402
from orca_ext import modes, ops  # noqa: E402
from orca_ext.models import load_model  # noqa: E402
from orca_ext.models.rope import apply_rope  # noqa: E402


def decode_ab(model, context: int, steps: int) -> tuple[list[float], list[float]]:
    model.allocate_kv_cache(context + 8)
    decode = decode_batch(model, context)

    def step(fused: bool):
        with modes.using(fused_rope_on_cpu=fused):
            return model.forward(decode)

    assert torch.equal(step(True), step(False)), "fused and unfused logits differ"
    return ab(lambda: step(True), lambda: step(False), steps)


def op_ab(model, steps: int) -> tuple[list[float], list[float]]:
    """One layer's step at T=1 on the model's shapes, called 30 times per timing (one forward's worth)."""
    nq, nkv, d = model.num_heads, model.num_kv_heads, model.spec.head_dim
    qkv = torch.randn(1, (nq + 2 * nkv) * d).to(model.dtype)
    cos, sin = model.rope.gather(torch.tensor([77]))
    k_pool, v_pool = model.k_cache[0], model.v_cache[0]
    slots = torch.tensor([3])
    reps = len(model.layers)

    def fused():
        for _ in range(reps):
            ops.rope_slab_write(qkv, cos, sin, k_pool, v_pool, slots, nq, nkv)

    def unfused():
        for _ in range(reps):
            q = apply_rope(qkv[:, :nq * d].view(1, nq, d), cos, sin)
            k = apply_rope(qkv[:, nq * d:(nq + nkv) * d].view(1, nkv, d), cos, sin)
            v = qkv[:, (nq + nkv) * d:].reshape(1, nkv, d).contiguous()
            ops.slab_write(k_pool, v_pool, k, v, slots)
            del q

    return ab(fused, unfused, steps)


def main(argv=None) -> int:
    args, path = parse_args(__doc__.split("\n\n")[0], default_context=128, argv=argv)
    for dtype in args.dtypes:
        model = load_model(path, dtype=dtype)
        with torch.inference_mode():
            fused, unfused = decode_ab(model, args.context, args.steps)
            op_fused, op_unfused = op_ab(model, args.steps)
        gain = statistics.median(unfused) - statistics.median(fused)
        print(f"\n{dtype}: one decode forward ({len(model.layers)} layers)")
        print(summary("fused", fused))
        print(summary("unfused", unfused))
        print(f"{'saved':>10}: median {gain:.3f} ms ({100 * gain / statistics.median(unfused):.1f}%), "
              f"best {min(unfused) - min(fused):.3f} ms")
        print(f"{dtype}: the op alone, T=1, x{len(model.layers)} calls (one forward's worth)")
        print(summary("fused", op_fused))
        print(summary("unfused", op_unfused))
    return 0


if __name__ == "__main__":
    sys.exit(main())
