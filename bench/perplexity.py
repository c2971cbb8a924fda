"""Perplexity of a GGUF (or model folder) on a long real text: ours against llama.cpp's
`llama-perplexity` on the same file, text and context length, and our quantized path against
our float path on the dequantized weights.

The text defaults to /usr/share/common-licenses/GPL-3 (present on every Debian/Ubuntu machine).
The scoring is llama-perplexity's, so the two numbers measure the same thing: the token stream
is cut into non-overlapping windows of --ctx tokens (a trailing partial window is dropped), each
window runs as one fresh sequence, and the positions from ctx/2 on are scored (each scored token
sees at least ctx/2 tokens of context), PPL = exp(mean NLL). The mean over every position of
every window ("all positions") is printed as well.

Per model file, our side runs with --quantization auto (blocks) and, with --compare-none, none
(dequantized at load: the float path on the same numbers). --activations picks the products of
the blocks (the mode quant_activations): float32 (the default), int8 (activations rounded per
32-block, per 256-block for Q4_K/Q6_K, to int8, as llama.cpp's quantized dot products do), auto
(int8 for Q4_K/Q6_K only), or several (one column each). The llama.cpp side runs when
--llama-bin names a folder holding llama-perplexity.

Formats other than the embedded Q4_1: --make-formats Q8_0 Q4_0 Q4_K_M converts our float32
checkpoint with llama.cpp's convert_hf_to_gguf.py to F32 and quantizes it with llama-quantize
(cached in --cache).

    python bench/perplexity.py --llama-bin /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin \\
        --make-formats Q8_0 Q4_0 Q4_K_M --compare-none --out bench/out/perplexity.json
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"


def windows(ids: list[int], ctx: int) -> list[list[int]]:
    return [ids[i:i + ctx] for i in range(0, len(ids) - ctx + 1, ctx)]


def llama_tokens(llama_bin: Path, model_path: str, text: str) -> list[int]:
    """llama.cpp's tokenization of `text` (llama-server's /tokenize, on 127.0.0.1)."""
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(llama_bin / "llama-server"), "-m", model_path, "--host", "127.0.0.1", "--port",
                             str(port), "-t", "1", "-c", "512", "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while True:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/tokenize", headers={"Content-Type": "application/json"},
                                             data=json.dumps({"content": text}).encode())
                return json.loads(urllib.request.urlopen(req, timeout=60).read())["tokens"]
            except OSError:
                if time.time() > deadline:
                    raise
                time.sleep(1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@torch.inference_mode()
def our_perplexity(model_path: str, text: str, ctx: int, quantization: str, max_windows: int | None,
                   ids: list[int] | None = None, quant_activations: str = "float32") -> dict:
    """`ids`: the text's tokens from elsewhere (llama.cpp's), else our tokenizer's."""
    from orca_ext import modes

    with modes.using(quant_activations=quant_activations):
        return _our_perplexity(model_path, text, ctx, quantization, max_windows, ids)


def _our_perplexity(model_path: str, text: str, ctx: int, quantization: str, max_windows: int | None,
                    ids: list[int] | None) -> dict:
    from orca_ext.models import load_model, load_tokenizer
    from orca_ext.models.batch import ForwardBatch

    tokenizer = load_tokenizer(model_path)
    if ids is None:
        ids = tokenizer(text, add_special_tokens=False).input_ids
    add_bos = bool(getattr(tokenizer, "add_bos_token", False)) and tokenizer.bos_token_id is not None
    model = load_model(model_path, "cpu", torch.float32, quantization=quantization)
    model.allocate_kv_cache(ctx)
    chunks = windows(ids, ctx)[:max_windows]
    half_nll = half_n = all_nll = all_n = 0.0
    t0 = time.perf_counter()
    for chunk in chunks:
        tokens = list(chunk)
        if add_bos:
            tokens[0] = tokenizer.bos_token_id  # as llama-perplexity does
        batch = ForwardBatch.build([(tokens, 0, 0)])
        logits = model(dataclasses.replace(batch, logits_index=torch.arange(ctx)))  # [ctx, V]
        logp = torch.log_softmax(logits.double(), dim=-1)
        target = torch.tensor(chunk[1:])
        nll = -logp[:-1].gather(1, target[:, None]).squeeze(1)                       # [ctx-1]
        half_nll += nll[ctx // 2:].sum().item()
        half_n += nll[ctx // 2:].numel()
        all_nll += nll.sum().item()
        all_n += nll.numel()
    return {"ppl": math.exp(half_nll / half_n), "ppl_all_positions": math.exp(all_nll / all_n),
            "tokens": len(ids), "windows": len(chunks), "seconds": time.perf_counter() - t0}


def llama_perplexity(binary: Path, model_path: str, text_file: str, ctx: int, threads: int,
                     max_windows: int | None) -> dict:
    cmd = [str(binary), "-m", model_path, "-f", text_file, "-c", str(ctx), "-t", str(threads), "-b", str(ctx)]
    if max_windows:
        cmd += ["--chunks", str(max_windows)]
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    log = out.stdout + out.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
    if out.returncode != 0 or m is None:
        raise RuntimeError(f"llama-perplexity failed ({out.returncode}):\n{log[-2000:]}")
    tokens = re.search(r"tokenization took .*\n.*?(\d+) tokens", log)
    chunks = re.search(r"calculating perplexity over (\d+) chunks", log)
    return {"ppl": float(m.group(1)), "ppl_err": float(m.group(2)),
            "windows": int(chunks.group(1)) if chunks else None,
            "tokens": int(tokens.group(1)) if tokens else None, "seconds": time.perf_counter() - t0}


def make_formats(llama_bin: Path, formats: list[str], cache: Path) -> dict[str, str]:
    """Our float32 checkpoint -> F32 GGUF (convert_hf_to_gguf.py) -> each format (llama-quantize)."""
    from orca_ext.default_model import default_model_path

    llama_dir = llama_bin.parent.parent
    folder = default_model_path()
    cache.mkdir(parents=True, exist_ok=True)
    f32 = cache / f"{folder.name}-f32.gguf"
    if not f32.exists():
        env = dict(os.environ, PYTHONPATH=str(llama_dir / "gguf-py"))
        subprocess.run([sys.executable, str(llama_dir / "convert_hf_to_gguf.py"), str(folder), "--outtype", "f32",
                        "--outfile", str(f32.with_suffix(".tmp"))], check=True, env=env, capture_output=True)
        f32.with_suffix(".tmp").rename(f32)
    out = {}
    for fmt in formats:
        path = cache / f"{folder.name}-{fmt}.gguf"
        if not path.exists():
            subprocess.run([str(llama_bin / "llama-quantize"), str(f32), str(path.with_suffix(".tmp")), fmt],
                           check=True, capture_output=True)
            path.with_suffix(".tmp").rename(path)
        out[fmt] = str(path)
    return out


def main(argv: list[str] | None = None) -> None:
    from orca_ext.default_model import GGUF_FILE, cache_root, default_gguf_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=None, help="GGUF files or model folders "
                   f"(default: the embedded {GGUF_FILE})")
    p.add_argument("--make-formats", nargs="*", default=[], help="llama-quantize types to make and measure too")
    p.add_argument("--text", default=DEFAULT_TEXT)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--max-windows", type=int, default=None)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--llama-bin", type=Path, default=None, help="folder with llama-perplexity / llama-quantize")
    p.add_argument("--compare-none", action="store_true", help="also run each file with quantization='none'")
    p.add_argument("--ours-only", action="store_true", help="skip llama-perplexity (e.g. already measured)")
    p.add_argument("--llama-tokens", action="store_true",
                   help="score llama.cpp's tokenization of the text (llama-server /tokenize) instead of ours; "
                        "the tokenizers split some whitespace runs differently")
    p.add_argument("--activations", nargs="+", default=["float32"], choices=["float32", "int8", "auto"],
                   help="products of the blocks (the mode quant_activations): float32, int8, auto, or several")
    p.add_argument("--cache", type=Path, default=cache_root() / "perplexity")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    text = Path(args.text).read_text()
    models = {Path(m).name: m for m in (args.models or [str(default_gguf_path())])}
    binary = args.llama_bin / "llama-perplexity" if args.llama_bin else None
    if args.ours_only:
        binary = None
    elif binary is not None and not binary.exists():
        print(f"{binary} is missing: only our side runs")
        binary = None
    if args.make_formats and args.llama_bin:
        models.update({f"{k}.gguf": v for k, v in make_formats(args.llama_bin, args.make_formats, args.cache).items()})
    rows = []
    for name, path in models.items():
        ids = llama_tokens(args.llama_bin, path, text) if args.llama_tokens else None
        row = {"model": name, "path": path, "tokens": "llama.cpp" if ids else "ours"}
        for acts in args.activations:
            row["ours" if acts == "float32" else f"ours_{acts}"] = our_perplexity(
                path, text, args.ctx, "auto", args.max_windows, ids, quant_activations=acts)
        if args.compare_none:
            row["ours_dequantized"] = our_perplexity(path, text, args.ctx, "none", args.max_windows, ids)
        if binary is not None:
            row["llama_cpp"] = llama_perplexity(binary, path, args.text, args.ctx, args.threads, args.max_windows)
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{args.text}, ctx {args.ctx}, scored positions ctx/2..ctx-2 of each window (llama-perplexity's)")
    print("| file | activations | ours (blocks) | ours (dequantized) | llama.cpp | ours / llama.cpp | all positions (ours) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        d = r.get("ours_dequantized", {}).get("ppl")
        ll = r.get("llama_cpp", {}).get("ppl")
        for key, acts in (("ours", "float32"), ("ours_int8", "int8"), ("ours_auto", "auto")):
            if key not in r:
                continue
            o = r[key]["ppl"]
            print(f"| {r['model']} | {acts} | {o:.4f} | {'' if d is None else f'{d:.4f}'} | "
                  f"{'' if ll is None else f'{ll:.4f}'} | {'' if ll is None else f'{o / ll:.4f}'} | "
                  f"{r[key]['ppl_all_positions']:.4f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"text": args.text, "ctx": args.ctx, "machine": platform.processor() or
                                        platform.machine(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                        "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
