"""A Llama-3.2-1B-shaped checkpoint with random weights, and its GGUFs made by llama.cpp's own tools.

The folder has Llama-3.2-1B's shape: hidden 2048, 16 layers, 32 query heads and 8 KV heads of 64,
intermediate 8192, tied embeddings, rope theta 500000 with the llama3 scaling (factor 32, original
context 8192), RMSNorm eps 1e-5, bfloat16 safetensors, a vocabulary of 128,256 rows. The tokenizer
is the embedded default model's (SmolLM2, 49,152 tokens, works offline): the ids it never produces
are rows of the embedding like any other, and llama.cpp's converter names them `[PAD<id>]`. So the
embedding / lm_head has Llama-3.2's 262.7 M parameters (21% of the weights), which is what a decode
step reads in the lm_head; only the text the ids decode to differs from Llama-3.2.

Weights: N(0, 0.02) for every matrix, the two that write into the residual stream (o_proj,
down_proj) scaled by 1/sqrt(2 * layers) so the residual stays O(1) through the layers; norms are
ones. Each tensor draws from its own generator seeded by (--seed, its index), so the files are
the same on every run with the same torch. After writing, transformers runs a few greedy tokens on
the folder: the logits must be finite and the prompts must not all produce one id.

Then, with llama.cpp's tree (--llama-dir: convert_hf_to_gguf.py and build/bin/llama-quantize):
    convert_hf_to_gguf.py --outtype bf16 | q8_0 | f32        -> <name>-BF16.gguf, -Q8_0.gguf, -F32.gguf
    llama-quantize <name>-BF16.gguf <name>-Q4_1.gguf Q4_1    (and Q4_K_M, ...; lossless source: the
                                                              safetensors are bfloat16)
Every output is written under a temporary name and renamed when complete, and kept: a rerun only
makes what is missing.

    python bench/make_random_llama.py --llama-dir /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp \\
        [--formats BF16 Q8_0 Q4_1 Q4_K_M [F32]] [--out ~/.cache/orca_ext/gguf] [--seed 0]
prints the folder and the GGUF paths (one per line, last lines) for bench/peer_cpu.py --model/--ggufs.
--agree then runs both engines on each GGUF (ours in process, llama-server) on the same token-id
prompts and writes where their greedy tokens part, with our top-2 gap there, to
<out>/<name>-agreement.json: random weights make near ties, which 8-bit activations can flip.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a source checkout

log = logging.getLogger("bench.make_random_llama")

# Llama-3.2-1B's config.json, less what names the real checkpoint.
LLAMA_3_2_1B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
    num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, hidden_act="silu",
    max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling=dict(factor=32.0, high_freq_factor=4.0, low_freq_factor=1.0,
                      original_max_position_embeddings=8192, rope_type="llama3"),
    tie_word_embeddings=True, vocab_size=128256, attention_bias=False, mlp_bias=False,
    initializer_range=0.02, torch_dtype="bfloat16",
)
CONVERT_TYPES = {"F32": "f32", "BF16": "bf16", "Q8_0": "q8_0"}  # made by convert_hf_to_gguf.py
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def tensor_shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """HF Llama parameter names and shapes, in a fixed order (the order seeds the generators)."""
    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d
    shapes = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (h,)), (p + "self_attn.q_proj.weight", (q, h)),
                   (p + "self_attn.k_proj.weight", (kv, h)), (p + "self_attn.v_proj.weight", (kv, h)),
                   (p + "self_attn.o_proj.weight", (h, q)), (p + "post_attention_layernorm.weight", (h,)),
                   (p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                   (p + "mlp.down_proj.weight", (h, inter))]
    return shapes + [("model.norm.weight", (h,))]


def random_tensor(name: str, shape: tuple[int, ...], index: int, seed: int, layers: int) -> torch.Tensor:
    if len(shape) == 1:  # RMSNorm weights
        return torch.ones(shape, dtype=torch.bfloat16)
    std = 0.02 / (math.sqrt(2 * layers) if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return (torch.randn(shape, generator=gen, dtype=torch.float32) * std).to(torch.bfloat16)


def write_checkpoint(folder: Path, cfg: dict, seed: int, tokenizer_src: Path) -> None:
    from safetensors.torch import save_file
    from tqdm import tqdm

    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    src_cfg = json.loads((tokenizer_src / "config.json").read_text())
    cfg = dict(cfg, bos_token_id=src_cfg.get("bos_token_id"), eos_token_id=src_cfg.get("eos_token_id"))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in TOKENIZER_FILES:
        if (tokenizer_src / f).is_file():
            shutil.copy(tokenizer_src / f, tmp / f)
    shapes = tensor_shapes(cfg)
    tensors = {name: random_tensor(name, shape, i, seed, cfg["num_hidden_layers"])
               for i, (name, shape) in enumerate(tqdm(shapes, desc="random weights", unit="tensor"))}
    log.info("writing %d tensors, %.2f G parameters", len(tensors), sum(t.numel() for t in tensors.values()) / 1e9)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(folder)


def check_outputs(folder: Path, n_tokens: int = 6) -> dict:
    """transformers' greedy tokens on a few prompts: finite logits, and not one id everywhere."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
    out = {}
    with torch.no_grad():
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids
            gen = []
            for _ in range(n_tokens):
                logits = model(ids).logits[0, -1]
                if not torch.isfinite(logits).all():
                    raise RuntimeError(f"non-finite logits on prompt {p!r}")
                nxt = int(logits.argmax())
                gen.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            top2 = logits.topk(2).values
            out[p] = dict(tokens=gen, logit_std=float(logits.std()), last_margin=float(top2[0] - top2[1]))
            log.info("greedy %r -> %s (logit std %.3f)", p, gen, out[p]["logit_std"])
    ids = {t for r in out.values() for t in r["tokens"]}
    if len(ids) <= 1:
        raise RuntimeError(f"degenerate outputs: every greedy token is {ids}")
    return out


def run(cmd: list[str], env: dict | None = None) -> None:
    log.info("$ %s", " ".join(cmd))
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    log.info("  done in %.0f s", time.perf_counter() - t0)


def make_gguf(fmt: str, folder: Path, out: Path, llama_dir: Path, threads: int, base: str) -> Path:
    path = out / f"{base}-{fmt}.gguf"
    if path.exists():
        return path
    tmp = path.with_name(path.name + ".tmp")
    if fmt in CONVERT_TYPES:
        env = dict(os.environ, PYTHONPATH=str(llama_dir / "gguf-py"))
        run([sys.executable, str(llama_dir / "convert_hf_to_gguf.py"), str(folder), "--outtype", CONVERT_TYPES[fmt],
             "--outfile", str(tmp)], env=env)
    else:
        src = make_gguf("BF16", folder, out, llama_dir, threads, base)
        run([str(llama_dir / "build" / "bin" / "llama-quantize"), str(src), str(tmp), fmt, str(threads)])
    tmp.rename(path)
    return path


def greedy_agreement(gguf: Path, folder: Path, llama_dir: Path, threads: int, n_prompts: int = 4,
                     prompt_len: int = 32, n_tokens: int = 16) -> dict:
    """Both engines load `gguf` and decode the same token-id prompts greedily (ours: the file's
    blocks, float32 activations; llama.cpp: llama-server). Per prompt: the first position where
    the two token streams differ (None: identical)."""
    import random
    import urllib.request

    from bench.peer_cpu import LlamaServer
    from orca_ext import SamplingParams, Server
    from orca_ext.models import load_tokenizer

    tok = load_tokenizer(str(folder))
    special = set(tok.all_special_ids)
    normal = [t for t in range(len(tok)) if t not in special]  # ids the tokenizer can produce
    rng = random.Random(1234)
    prompts = [[rng.choice(normal) for _ in range(prompt_len)] for _ in range(n_prompts)]
    with Server(str(gguf), device="cpu", dtype="float32", max_batch_size=n_prompts) as server:
        outs = server.generate(prompts, SamplingParams(max_tokens=n_tokens, temperature=0.0, ignore_eos=True,
                                                       logprobs=2))
    ours = [list(o.token_ids) for o in outs]
    theirs = []
    with LlamaServer(llama_dir / "build" / "bin" / "llama-server", gguf, 1, threads) as server:
        for prompt in prompts:
            body = json.dumps(dict(prompt=prompt, n_predict=n_tokens, ignore_eos=True, cache_prompt=False,
                                   temperature=0.0, top_k=1, return_tokens=True)).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{server.port}/completion", data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=600) as r:
                theirs.append(json.loads(r.read())["tokens"])
    first_diff = [next((i for i, (a, b) in enumerate(zip(o, t)) if a != b), None if len(o) == len(t) else
                       min(len(o), len(t))) for o, t in zip(ours, theirs)]
    # Where the streams part: our top-2 log-probability gap there, and whether llama.cpp's token is
    # our second choice (a near tie that 8-bit activations can flip, not a different model).
    at_split = []
    for o, t, i in zip(outs, theirs, first_diff):
        if i is None or i >= len(o.logprobs):
            at_split.append(None)
            continue
        top = o.logprobs[i].top
        at_split.append(dict(position=i, our_gap=top[0][1] - top[1][1], theirs_is_our_second=t[i] == top[1][0]))
    log.info("%s: first differing greedy position per prompt (None: all %d equal): %s; there: %s", gguf.name,
             n_tokens, first_diff, at_split)
    return dict(ours=ours, llama_cpp=theirs, first_difference=first_diff, at_split=at_split)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--llama-dir", type=Path, default=None,
                   help="llama.cpp source tree (convert_hf_to_gguf.py, build/bin/llama-quantize); none: folder only")
    p.add_argument("--out", type=Path, default=Path.home() / ".cache" / "orca_ext" / "gguf")
    p.add_argument("--formats", nargs="*", default=["BF16", "Q8_0", "Q4_1", "Q4_K_M"],
                   help="GGUF types: F32, BF16, Q8_0 (convert_hf_to_gguf.py) or any llama-quantize type")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=LLAMA_3_2_1B["num_hidden_layers"],
                   help="fewer layers for a quick check of the tool chain (the name says so)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--no-check", action="store_true", help="skip the transformers greedy check")
    p.add_argument("--agree", action="store_true",
                   help="then run both engines on each GGUF and compare greedy tokens (<name>-agreement.json)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)

    from orca_ext.default_model import default_model_path

    cfg = dict(LLAMA_3_2_1B, num_hidden_layers=args.layers)
    base = f"Llama-3.2-1B-random-s{args.seed}" + ("" if args.layers == 16 else f"-{args.layers}L")
    folder = args.out / base
    if not folder.exists():
        write_checkpoint(folder, cfg, args.seed, Path(default_model_path()))
    check_file = folder / "greedy_check.json"
    if not args.no_check and not check_file.exists():
        check_file.write_text(json.dumps(check_outputs(folder), indent=1))
    paths = []
    if args.llama_dir is not None:
        paths = [make_gguf(f, folder, args.out, args.llama_dir, args.threads, base) for f in args.formats]
    if args.agree and paths:
        result = {path.name: greedy_agreement(path, folder, args.llama_dir, args.threads) for path in paths}
        (args.out / f"{base}-agreement.json").write_text(json.dumps(result, indent=1))
    print(folder)
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
