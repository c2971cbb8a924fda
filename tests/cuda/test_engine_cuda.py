"""The engine on the GPU in bfloat16 against transformers (float32, CPU) greedy decoding, on tiny
random models whose shapes cover both attention paths (tensor cores for head dims 64/80/128, the
CUDA-core fallback for 16/24), GQA, q/k norms (Qwen3) and QKV biases (Qwen2).

bf16 cannot reproduce float32 argmaxes exactly when two logits nearly tie, so the rule is
teacher-forced: at step k of the reference's greedy sequence our chosen token must be the
reference's token, or one whose reference logit is within MARGIN of the reference's top logit.
  * teacher-forced prefills: every prefix prompt + ref[:k] is its own request (all in one batch
    stream), each generating one token;
  * free-running decode: our own greedy run must follow the reference until its first deviation,
    and that deviation must itself satisfy the rule (after it, contexts differ).
"""
from __future__ import annotations

import random
import zlib

import pytest
import torch

from tiny_models import reference_greedy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEVICE = "cuda"
MARGIN = 0.25       # logits; tiny models use initializer_range 0.1, so real ties are rare
MIN_EXACT = 0.8     # and most steps must pick exactly the reference's token
N_NEW = 10

CASES = [
    ("llama", {}),  # head_dim 16: CUDA-core attention
    ("qwen3", {}),  # head_dim 24, q/k norms
    ("llama", dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                   intermediate_size=320)),  # tensor cores, GQA 2
    ("qwen3", dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=1, head_dim=128,
                   intermediate_size=320)),  # tensor cores, GQA 8
    ("qwen2", dict(hidden_size=320, num_attention_heads=4, num_key_value_heads=4,
                   intermediate_size=320)),  # head_dim 80, MHA, QKV bias
]


def check_step(ours: int, ref: int, logits: torch.Tensor, where: str) -> bool:
    """True on an exact match; otherwise asserts the margin rule and returns False."""
    if ours == ref:
        return True
    gap = float(logits[ref] - logits[ours])
    assert gap <= MARGIN, (f"{where}: chose token {ours}, whose reference logit is {gap:.3f} below the "
                           f"reference's choice {ref} (margin {MARGIN})")
    return False


@pytest.mark.parametrize("family,overrides", CASES, ids=[f"{f}-{o.get('head_dim', 'default')}" for f, o in CASES])
def test_greedy_parity_bf16(tiny_model_dir, family, overrides):
    from orca_ext import SamplingParams, Server

    model_dir = tiny_model_dir(family, **overrides)
    rng = random.Random(zlib.crc32(repr((family, sorted(overrides.items()))).encode()))
    with Server(model=str(model_dir), device=DEVICE, dtype="bfloat16", max_batch_size=16, n_slots=8192) as server:
        vocab = server.vocab_size
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 17, 64, 150)]
        refs = [reference_greedy(model_dir, p, N_NEW, return_logits=True) for p in prompts]

        # Teacher-forced prefills: prompt + ref[:k] -> one token, all requests in one generate().
        forced = [p + ref[:k] for p, (ref, _) in zip(prompts, refs) for k in range(N_NEW)]
        outs = server.generate(forced, SamplingParams(max_tokens=1, ignore_eos=True))
        exact = steps = 0
        for i, (p, (ref, logits)) in enumerate(zip(prompts, refs)):
            for k in range(N_NEW):
                out = outs[i * N_NEW + k]
                assert out.finish_reason == "length", out.error
                exact += check_step(out.token_ids[0], ref[k], logits[k], f"prompt {i} (len {len(p)}) step {k}")
                steps += 1

        # Free-running greedy decode (the decode path of the kernels).
        outs = server.generate(prompts, SamplingParams(max_tokens=N_NEW, ignore_eos=True))
        for i, (out, (ref, logits)) in enumerate(zip(outs, refs)):
            assert len(out.token_ids) == N_NEW and out.finish_reason == "length", out.error
            for k, tok in enumerate(out.token_ids):
                steps += 1
                if check_step(tok, ref[k], logits[k], f"decode of prompt {i} step {k}"):
                    exact += 1
                else:
                    break  # the contexts differ from here on
    assert exact >= MIN_EXACT * steps, f"only {exact} of {steps} steps matched the reference exactly"
