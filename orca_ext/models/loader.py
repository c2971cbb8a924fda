"""Load a Hugging Face model folder into our own tensors (no transformers model is built).

A folder holds `config.json`, one or more `*.safetensors` (optionally listed by
`model.safetensors.index.json`) and tokenizer files. Tensors are read lazily with
`safetensors.safe_open`, fused per layer on the CPU (q/k/v into one matrix for `rmsnorm_qkv`,
gate/up into another), converted to the requested dtype and moved to the device one layer at a
time, so the host never holds more than one layer's extra copy.
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from ..resources import resolve_dtype
from .causal_lm import CausalLM, LayerWeights
from .config import ModelSpec

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # any one makes a tokenizer
# Everything a transformers tokenizer folder may hold (for copying one next to new weights).
TOKENIZER_FOLDER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                          "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> None:
    """Copy the tokenizer files of folder `src` (those that exist) into folder `dst`."""
    import shutil

    src, dst = Path(src), Path(dst)
    for name in TOKENIZER_FOLDER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


class SafetensorsFolder:
    """Name -> lazily readable tensor over every safetensors file of a folder."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        index_file = path / "model.safetensors.index.json"
        if index_file.is_file():
            try:
                weight_map = json.loads(index_file.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as exc:
                raise ValueError(f"{index_file}: not a valid safetensors index ({exc})") from exc
            files = sorted(set(weight_map.values()))
            for name in files:
                if not (path / name).is_file():
                    raise FileNotFoundError(f"{path / name} is missing (listed in {index_file.name})")
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{path} has no *.safetensors file; the model weights are missing")
        self.files = files
        self._handles: dict[str, Any] = {}
        self._where: dict[str, Any] = {}
        for name in files:
            handle = safe_open(str(path / name), framework="pt", device="cpu")
            self._handles[name] = handle
            for key in handle.keys():
                self._where[key] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, shape: Sequence[int]) -> torch.Tensor:
        """The tensor `name` (CPU, stored dtype); ValueError if it is missing or has another shape."""
        handle = self._where.get(name)
        if handle is None:
            raise ValueError(f"{self.path}: tensor {name!r} is missing from {', '.join(self.files)}")
        tensor = handle.get_tensor(name)
        if tuple(tensor.shape) != tuple(shape):
            raise ValueError(f"{self.path}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(shape)} from config.json")
        return tensor


def load_model(path: str | Path, device: torch.device | str = "cpu",
               dtype: torch.dtype | str | None = torch.float32) -> CausalLM:
    """Load a Llama/Mistral/Qwen2/Qwen3 folder -> CausalLM on `device` in `dtype`."""
    t0 = time.perf_counter()
    path = Path(path)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = resolve_dtype(dtype, device)
    spec = ModelSpec.from_pretrained(path)
    st = SafetensorsFolder(path)
    hid, inter, vocab = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    qs, kvs, d = spec.q_size, spec.kv_size, spec.head_dim

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    def fetch(name: str, shape: Sequence[int]) -> torch.Tensor:
        return put(st.get(name, shape))

    def fuse(names: Sequence[str], shapes: Sequence[Sequence[int]]) -> torch.Tensor:
        return put(torch.cat([st.get(n, s) for n, s in zip(names, shapes)], dim=0))

    embed = fetch("model.embed_tokens.weight", (vocab, hid))
    layers = []
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qkv_names = [a + "q_proj.", a + "k_proj.", a + "v_proj."]
        qkv_rows = [qs, kvs, kvs]
        layers.append(LayerWeights(
            input_norm=fetch(p + "input_layernorm.weight", (hid,)),
            qkv_weight=fuse([n + "weight" for n in qkv_names], [(r, hid) for r in qkv_rows]),
            qkv_bias=fuse([n + "bias" for n in qkv_names], [(r,) for r in qkv_rows]) if spec.qkv_bias else None,
            q_norm=fetch(a + "q_norm.weight", (d,)) if spec.qk_norm else None,
            k_norm=fetch(a + "k_norm.weight", (d,)) if spec.qk_norm else None,
            o_weight=fetch(a + "o_proj.weight", (hid, qs)),
            o_bias=fetch(a + "o_proj.bias", (hid,)) if spec.o_bias else None,
            post_norm=fetch(p + "post_attention_layernorm.weight", (hid,)),
            gate_up_weight=fuse([m + "gate_proj.weight", m + "up_proj.weight"], [(inter, hid)] * 2),
            gate_up_bias=(fuse([m + "gate_proj.bias", m + "up_proj.bias"], [(inter,)] * 2)
                          if spec.mlp_bias else None),
            down_weight=fetch(m + "down_proj.weight", (hid, inter)),
            down_bias=fetch(m + "down_proj.bias", (hid,)) if spec.mlp_bias else None,
        ))
    final_norm = fetch("model.norm.weight", (hid,))
    # Tied models share the embedding (transformers ties even when lm_head.weight is stored).
    lm_head = embed if spec.tie_word_embeddings else fetch("lm_head.weight", (vocab, hid))
    model = CausalLM(spec, embed, layers, final_norm, lm_head, device, dtype)
    log.info("loaded %s from %s in %.1fs: %d layers, hidden %d, heads %d/%d x %d, vocab %d, %s on %s",
             spec.architecture, path, time.perf_counter() - t0, spec.num_layers, hid,
             spec.num_heads, spec.num_kv_heads, d, vocab, dtype, device)
    return model


def load_tokenizer(path: str | Path):
    """The folder's transformers tokenizer (AutoTokenizer)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    if not any((path / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(f"{path} has no tokenizer: expected one of {', '.join(_TOKENIZER_FILES)}")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # transformers raises OSError/ValueError/... for broken files
        raise ValueError(f"{path}: the tokenizer could not be loaded: {exc}") from exc


def apply_chat_template(tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
    """Render chat `messages` ([{"role": ..., "content": ...}, ...]) to the prompt text.

    The text contains the template's special tokens literally (e.g. `<|im_start|>`); encoding it
    with the same tokenizer maps them back to their ids.
    """
    if not messages:
        raise ValueError("messages is empty; a chat needs at least one message")
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) \
                or not isinstance(msg.get("content"), str):
            raise ValueError(f"messages[{i}] must be a dict with string 'role' and 'content', got {msg!r}")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this tokenizer has no chat template; pass a plain prompt instead")
    return tokenizer.apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages],
                                         tokenize=False, add_generation_prompt=add_generation_prompt)
