"""Resident memory of a GGUF's weights as we serve them, against the file's tensor bytes.

Each file loads in a process of its own (`load_gguf_model`, quantization "auto": blocks kept),
and the RSS growth over the load (after a garbage collection and malloc_trim on both sides) is
compared with the sum of the file's tensor sizes. The growth includes everything the load leaves:
the weights' huge-page region, the rope tables, and what parsing the metadata leaves in Python's
allocator.

    python bench/weight_rss.py FILE.gguf [FILE.gguf ...]
"""
from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _settle() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure(path: str) -> dict:
    """In this process: tensor bytes of `path` and the RSS growth over loading it."""
    sys.path.insert(0, str(ROOT))
    from gguf import GGUFReader

    from orca_ext.models.gguf_loader import load_gguf_model

    tensor_bytes = sum(int(t.n_bytes) for t in GGUFReader(path).tensors)
    _settle()
    before = _rss_bytes()
    model = load_gguf_model(path, quantization="auto")
    _settle()
    growth = _rss_bytes() - before
    del model
    return {"file": Path(path).name, "tensor_bytes": tensor_bytes, "rss_growth": growth}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # child mode: measure this file, print JSON
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one)))
        return 0
    print("| file | tensor bytes | RSS growth over the load | ratio |")
    print("|---|---|---|---|")
    for path in args.files:
        out = subprocess.run([sys.executable, __file__, "--one", path, "x"], check=True,
                             capture_output=True, text=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        print(f"| {r['file']} | {r['tensor_bytes'] / 1e6:.1f} MB | {r['rss_growth'] / 1e6:.1f} MB | "
              f"{r['rss_growth'] / r['tensor_bytes']:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
