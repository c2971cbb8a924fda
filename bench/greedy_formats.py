"""Greedy outputs of the default model served from each GGUF format against the float32 path.

16 fixed chat prompts x 32 greedy tokens (EOS ignored), one Server per model; a prompt counts
as changed when its 32 token ids differ from the float32 folder's anywhere, and the first
differing position is reported. --activations sets the Server's quant_activations for the files
(int8: activations rounded per 32-block, per 256-block for Q4_K/Q6_K, in the products; auto: int8
for Q4_K/Q6_K only); the float32 reference always runs with float32 activations.

    python bench/greedy_formats.py [--models a.gguf b.gguf ...] [--activations float32 auto int8]
        [--out bench/out/greedy_formats.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain photosynthesis in one sentence.",
    "List three prime numbers.", "What does a CPU do?", "Translate 'good morning' into Spanish.",
    "Give me a tip for learning to code.", "Why is the sky blue?", "Name a famous painter.",
    "What is 12 times 7?", "Describe a cat in five words.", "What is the GPL license?",
    "Suggest a name for a bakery.", "How do vaccines work?", "What is the boiling point of water?",
    "Write the first line of a story about a robot.",
]


def run(model: str, quantization: str, quant_activations: str = "float32") -> list[list[int]]:
    from orca_ext import SamplingParams, Server, modes

    params = SamplingParams(max_tokens=32, ignore_eos=True)
    with modes.using(), Server(model, device="cpu", dtype="float32", quantization=quantization,
                               quant_activations=quant_activations, n_slots=4096) as server:
        prompts = [server.tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                                        add_generation_prompt=True) for p in PROMPTS]
        return [list(o.token_ids) for o in server.generate(prompts, params)]


def main(argv: list[str] | None = None) -> None:
    from orca_ext.default_model import default_gguf_path, default_model_path

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=None)
    p.add_argument("--activations", nargs="+", default=["float32"], choices=["auto", "float32", "int8"])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    reference = run(str(default_model_path()), "none")
    rows = []
    for model in args.models or [str(default_gguf_path())]:
        for acts in args.activations:
            got = run(model, "auto", quant_activations=acts)
            first = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), None) for g, r in zip(got, reference)]
            changed = [i for i, f in enumerate(first) if f is not None]
            rows.append({"model": Path(model).name, "activations": acts, "changed": len(changed), "of": len(PROMPTS),
                         "first_difference": {PROMPTS[i]: first[i] for i in changed}})
            print(json.dumps(rows[-1]), flush=True)
    print("| file | activations | prompts whose 32 greedy tokens change vs float32 |\n|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['activations']} | {r['changed']} / {r['of']} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
