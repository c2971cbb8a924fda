"""A CausalLM with random weights of any shape, built directly on the device.

For tests and benchmarks that must run without a model folder (the GPU machine carries none).
Projections are drawn with std 1/sqrt(fan_in), so activations stay O(1) at any depth and width,
and logits are spread wide enough that a greedy argmax is not decided by float rounding.
"""
from __future__ import annotations

import dataclasses

import torch

from .models.causal_lm import CausalLM, LayerWeights
from .models.config import ModelSpec, RopeConfig

SMALL_LLAMA = dict(
    architecture="LlamaForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=3,
    num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=1024, rms_norm_eps=1e-6,
    rope=RopeConfig(theta=10000.0), tie_word_embeddings=False, qkv_bias=False, o_bias=False, mlp_bias=False,
    qk_norm=False, eos_token_ids=(), bos_token_id=None,
)


def random_spec(**overrides) -> ModelSpec:
    """A small Llama-shaped ModelSpec; any field can be overridden (e.g. num_layers=30)."""
    fields = {f.name for f in dataclasses.fields(ModelSpec)}
    unknown = set(overrides) - fields
    if unknown:
        raise ValueError(f"random_spec: unknown ModelSpec fields {sorted(unknown)}")
    return ModelSpec(**{**SMALL_LLAMA, **overrides})


def random_causal_lm(spec: ModelSpec, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                     seed: int = 0) -> CausalLM:
    """A CausalLM of `spec` with weights drawn from a generator seeded with `seed` on `device`
    (the same seed gives the same weights on the same device)."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + randn(n, std=0.1)

    def bias(n: int, present: bool) -> torch.Tensor | None:
        return randn(n, std=0.1) if present else None

    h, inter, d = spec.hidden_size, spec.intermediate_size, spec.head_dim
    q_size, kv_size = spec.num_heads * d, spec.num_kv_heads * d
    qkv_rows = q_size + 2 * kv_size
    layers = []
    for _ in range(spec.num_layers):
        layers.append(LayerWeights(
            input_norm=norm(h),
            qkv_weight=randn(qkv_rows, h, std=h ** -0.5),
            qkv_bias=bias(qkv_rows, spec.qkv_bias),
            q_norm=norm(d) if spec.qk_norm else None,
            k_norm=norm(d) if spec.qk_norm else None,
            o_weight=randn(h, q_size, std=q_size ** -0.5),
            o_bias=bias(h, spec.o_bias),
            post_norm=norm(h),
            gate_up_weight=randn(2 * inter, h, std=h ** -0.5),
            gate_up_bias=bias(2 * inter, spec.mlp_bias),
            down_weight=randn(h, inter, std=inter ** -0.5),
            down_bias=bias(h, spec.mlp_bias),
        ))
    embed = randn(spec.vocab_size, h)
    lm_head = embed if spec.tie_word_embeddings else randn(spec.vocab_size, h, std=2 * h ** -0.5)
    return CausalLM(spec, embed, layers, norm(h), lm_head, device, dtype)
