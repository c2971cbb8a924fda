"""Tiny random models written as GGUF files, with the float weights they encode.

`write_gguf(path, family, qtypes)` builds a random transformers model, writes it with
`gguf.GGUFWriter` the way llama.cpp's convert_hf_to_gguf.py does (its tensor names, metadata
keys and, for the llama architecture, its q/k row permutation), each matrix in the ggml type
`qtypes(name)` picks, and returns a transformers model holding exactly the numbers the file
encodes (dequantized by the `gguf` package): the independent reference for our loader.

Q8_0/Q4_0/Q4_1 blocks come from gguf's own quantizer; gguf cannot quantize Q4_K/Q6_K, so those
matrices are random blocks (random codes, scales chosen for weights of a sensible size).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

import gguf
from gguf import GGMLQuantizationType as T

VOCAB = 320
SMALL = dict(hidden_size=96, intermediate_size=160, num_attention_heads=6, num_key_value_heads=2)
# Q4_K/Q6_K rows hold multiples of 256 values: hidden, q size and intermediate are.
LARGE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)

_FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "llama", dict(rope_theta=10000.0)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "qwen2", dict(rope_theta=1e6, use_sliding_window=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "qwen3", dict(rope_theta=1e6, use_sliding_window=False)),
}

_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_NAMES[rest]}"


def hf_permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (rows of q/k for llama.cpp's rope)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(qtype: T, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n, row_bytes]: random codes, float16 scales giving weights of size ~0.1."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n, k // block, size), dtype=np.uint8)

    def put(offset: int, scale: float) -> None:
        values = (scale * rng.uniform(0.5, 1.5, size=raw.shape[:-1])).astype(np.float16)
        raw[..., offset:offset + 2] = values[..., None].view(np.uint8).reshape(*raw.shape[:-1], 2)

    if qtype == T.Q4_K:
        put(0, 4e-4)           # d: x = d*sc*q - dmin*mn, sc and mn 6-bit, q 4-bit
        put(2, 3e-3)           # dmin ~ d * 7.5 centres the values
    elif qtype == T.Q5_K:
        put(0, 2e-4)           # d: as Q4_K with q 5-bit
        put(2, 3e-3)
    elif qtype == T.Q6_K:
        put(208, 1e-4)         # d: x = d*sc*(q - 32), sc int8
    elif qtype in (T.Q4_1, T.Q5_1):
        put(0, 0.02 if qtype == T.Q4_1 else 0.01)
        put(2, -0.15)
    else:
        put(0, 0.01 if qtype == T.Q5_0 else 0.02)
    return raw.reshape(n, -1)


def encode(w: np.ndarray, qtype: T, rng: np.random.Generator) -> np.ndarray:
    """The stored array of float matrix `w` [n, k] in `qtype` (random blocks for K-quants)."""
    if qtype in (T.F32,):
        return w.astype(np.float32)
    if qtype in (T.Q4_K, T.Q5_K, T.Q6_K):
        return random_blocks(qtype, w.shape[0], w.shape[1], rng)
    return gguf.quants.quantize(w.astype(np.float32), qtype)


def write_gguf(path: str | Path, family: str, qtypes: Callable[[str], T], *, seed: int = 0,
               layers: int = 2, tie: bool = False, **config):
    """Write a tiny random `family` model to `path` -> (transformers reference model, hf config).
    `qtypes(gguf tensor name)` gives each matrix's type; vectors are always F32."""
    import transformers

    cfg_name, model_name, arch, extra = _FAMILIES[family]
    sizes = dict(SMALL, **config)
    kwargs = dict(vocab_size=VOCAB, num_hidden_layers=layers, max_position_embeddings=256, rms_norm_eps=1e-6,
                  initializer_range=0.1, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, **extra)
    kwargs.update(sizes)
    hf_cfg = getattr(transformers, cfg_name)(**kwargs)
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = getattr(transformers, model_name)(hf_cfg).float().eval()
    heads, kv_heads = hf_cfg.num_attention_heads, hf_cfg.num_key_value_heads
    head_dim = getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // heads
    state = {}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hf_cfg.hidden_size)
    writer.add_feed_forward_length(hf_cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(hf_cfg.rope_parameters["rope_theta"]) if hasattr(hf_cfg, "rope_parameters")
                              and hf_cfg.rope_parameters else float(hf_cfg.rope_theta))
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(VOCAB)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    with torch.no_grad():
        for name, param in model.state_dict().items():
            if tie and name == "lm_head.weight":
                continue
            w = param.numpy().astype(np.float32)
            if name.endswith("norm.weight"):
                w = (1.0 + 0.3 * rng.standard_normal(w.shape)).astype(np.float32)
            elif name.endswith(".bias"):
                w = (0.2 * rng.standard_normal(w.shape)).astype(np.float32)
            g_name = gguf_name(name)
            qtype = T.F32 if w.ndim == 1 else qtypes(g_name)
            stored = encode(w, qtype, rng) if w.ndim == 2 else w
            decoded = stored if qtype == T.F32 else gguf.quants.dequantize(stored, qtype)
            state[name] = torch.from_numpy(np.array(decoded, dtype=np.float32).reshape(w.shape))
            if arch == "llama" and (".q_proj." in name or ".k_proj." in name):
                rows = hf_permute(np.arange(w.shape[0]), heads, heads if ".q_proj." in name else kv_heads)
                stored = stored[rows]
            writer.add_tensor(g_name, np.ascontiguousarray(stored), raw_dtype=None if qtype == T.F32 else qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        model.load_state_dict(state, strict=not tie)
        if tie:
            model.tie_weights()
    return model, hf_cfg
