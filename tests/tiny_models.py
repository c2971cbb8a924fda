"""Tiny random Hugging Face models and transformers references for the model tests.

`make_tiny_model` saves a randomly initialised transformers model (a few layers, hidden 96,
GQA 6/2 heads) with the default model's tokenizer, so every family of `orca_ext.models` can be
checked against transformers itself in seconds. `reference_greedy` / `reference_logits` run the
transformers implementation in float32 on the CPU: they are the independent ground truth.
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch

from orca_ext.models.loader import copy_tokenizer_files

FAMILIES = ("llama", "llama3_rope", "mistral", "qwen2", "qwen3")

_BASE = dict(
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    # Larger than transformers' default 0.02 so that random logits are well separated and a
    # greedy argmax is never decided by float rounding.
    initializer_range=0.1,
    tie_word_embeddings=False,
)

_FAMILY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    "llama3_rope": ("LlamaConfig", "LlamaForCausalLM",
                    dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          # small so that all three llama3 bands occur at head_dim 16
                                          "original_max_position_embeddings": 64})),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(use_sliding_window=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    # head_dim 24 != hidden/heads = 16: q/o projections are not square
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(head_dim=24, use_sliding_window=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}

def make_tiny_model(directory: str | Path, family: str, *, tokenizer_dir: str | Path,
                    seed: int = 0, **overrides) -> Path:
    """Save a tiny random `family` model (float32 safetensors + tokenizer) into `directory`.

    `overrides` go into the transformers config (e.g. tie_word_embeddings=True,
    num_hidden_layers=2). The vocabulary is the tokenizer's, copied from `tokenizer_dir`.
    """
    import transformers

    if family not in _FAMILY:
        raise ValueError(f"family={family!r} is unknown; choose one of {FAMILIES}")
    config_cls, model_cls, extra = _FAMILY[family]
    tokenizer_dir = Path(tokenizer_dir)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    kwargs = dict(_BASE, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    kwargs.update(extra)
    kwargs.update(overrides)
    config = getattr(transformers, config_cls)(**kwargs)
    config.architectures = [model_cls]
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).to(torch.float32).eval()
    with torch.no_grad():
        # Random norm weights and biases (they start at exactly 1 and 0, which would hide a
        # norm or bias applied in the wrong place).
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn_like(param))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory), safe_serialization=True)
    copy_tokenizer_files(tokenizer_dir, directory)
    return directory


@functools.lru_cache(maxsize=4)
def _hf_model(model_dir: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager")
    # Otherwise generate() falls back to the checkpoint's EOS and stops there.
    model.generation_config.eos_token_id = None
    return model.eval()


def reference_greedy(model_dir: str | Path, prompt_ids: list[int], max_new_tokens: int,
                     return_logits: bool = False):
    """transformers greedy decoding of one prompt, exactly `max_new_tokens` tokens (EOS ignored).

    With return_logits=True also returns the raw logits [max_new_tokens, V] of every step.
    """
    from transformers import GenerationConfig

    model = _hf_model(str(model_dir))
    # eos_token_id=None: EOS is an ordinary token here (neither stops nor is suppressed), so
    # the length is fixed and the argmax is the plain argmax.
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None,
                           pad_token_id=0, bos_token_id=None, return_dict_in_generate=True,
                           output_logits=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), generation_config=gen,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    assert len(tokens) == max_new_tokens, "transformers stopped early"
    if return_logits:
        return tokens, torch.cat([step.float() for step in out.logits], dim=0)
    return tokens


def reference_logits(model_dir: str | Path, ids: list[int]) -> torch.Tensor:
    """transformers last-token logits [V] (float32) of the sequence `ids`."""
    model = _hf_model(str(model_dir))
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def ragged_greedy(model, prompts: list[list[int]], max_new: list[int], *, arrivals=None,
                  prefill_chunks=None, slab_gap: int = 3, first_slab: int = 5,
                  poison_cache: bool = True):
    """Greedy-decode `prompts` with our model the way the engine does: every step is ONE
    ForwardBatch over all active requests (prefills and decodes mixed, no padding).

    arrivals[r]: the step at which request r joins (default 0 for all).
    prefill_chunks[r]: if set, request r's prompt is fed in chunks of that size, each later chunk
    over a cached prefix (q_len < kv_len). Slabs start at `first_slab` with `slab_gap` unused slots
    between them; with poison_cache the whole KV cache starts as NaN, so any read outside a
    request's own written slots shows up as NaN logits.
    Returns (tokens per request, [steps, V] logits per request).
    """
    from orca_ext.models import ForwardBatch

    n = len(prompts)
    arrivals = arrivals or [0] * n
    prefill_chunks = prefill_chunks or [None] * n
    slabs, cursor = [], first_slab
    for p, m in zip(prompts, max_new):
        slabs.append(cursor)
        cursor += len(p) + m + slab_gap
    model.allocate_kv_cache(cursor + 7)
    if poison_cache:
        for pool in model.k_cache + model.v_cache:
            pool.fill_(float("nan"))
    cached = [0] * n
    generated: list[list[int]] = [[] for _ in range(n)]
    logits: list[list[torch.Tensor]] = [[] for _ in range(n)]
    step = 0
    while any(len(generated[r]) < max_new[r] for r in range(n)):
        members, entries = [], []
        for r in range(n):
            if arrivals[r] > step or len(generated[r]) >= max_new[r]:
                continue
            if cached[r] < len(prompts[r]):
                size = prefill_chunks[r] or len(prompts[r])
                feed = prompts[r][cached[r]:cached[r] + size]
            else:
                feed = [generated[r][-1]]
            members.append((r, feed))
            entries.append((feed, cached[r], slabs[r]))
        if entries:
            out = model.forward(ForwardBatch.build(entries, model.device))
            for row, (r, feed) in enumerate(members):
                cached[r] += len(feed)
                if cached[r] == len(prompts[r]) + len(generated[r]):  # whole sequence is cached
                    generated[r].append(int(out[row].argmax()))
                    logits[r].append(out[row].cpu())
        step += 1
    return generated, [torch.stack(rows) for rows in logits]
