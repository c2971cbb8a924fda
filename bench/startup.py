"""How long a model takes to open and serve: parsing its GGUF, and a whole Server start.

Per file and round, in alternating order: the `gguf` package's GGUFReader and our GGUFFile
(whose reader takes its views of the mapping as plain ndarrays) each open the file in this
process; then a fresh process times `Server(file)` from the call to a server ready for requests
(weights loaded, tokenizer read, KV cache allocated; the import of orca_ext is not counted).
No file is specified: the embedded default model's GGUF.

    python bench/startup.py [FILE.gguf ...] [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def open_seconds(path: str, ours: bool) -> float:
    """Seconds to parse `path`'s header and metadata with our reader or the gguf package's."""
    import gguf

    from orca_ext.models.gguf_file import GGUFFile

    t0 = time.perf_counter()
    reader = GGUFFile(path) if ours else gguf.GGUFReader(path, "r")
    seconds = time.perf_counter() - t0
    del reader
    return seconds


def server_start_seconds(path: str) -> float:
    """Seconds for a Server on `path` to start, in a process of its own (JSON on stdout)."""
    code = ("import json, time, sys; from orca_ext import Server; t = time.perf_counter(); "
            "s = Server(sys.argv[1], device='cpu', n_slots=1024); d = time.perf_counter() - t; s.shutdown(); "
            "print(json.dumps(d))")
    out = subprocess.run([sys.executable, "-c", code, path], check=True, capture_output=True, text=True,
                         cwd=ROOT).stdout
    return float(json.loads(out.strip().splitlines()[-1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from orca_ext.default_model import default_gguf_path

    files = args.files or [str(default_gguf_path())]
    print("| file | gguf.GGUFReader s (median) | GGUFFile s (median) | ratio | Server start s (median, min-max) |")
    print("|---|---|---|---|---|")
    for path in files:
        theirs, ours, starts = [], [], []
        for r in range(args.rounds):
            for use_ours in ((False, True) if r % 2 == 0 else (True, False)):
                (ours if use_ours else theirs).append(open_seconds(path, use_ours))
            starts.append(server_start_seconds(path))
        t, o = statistics.median(theirs), statistics.median(ours)
        print(f"| {Path(path).name} | {t:.2f} | {o:.2f} | {t / o:.2f}x | "
              f"{statistics.median(starts):.2f} ({min(starts):.2f}-{max(starts):.2f}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
