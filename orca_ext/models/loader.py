"""Load a Hugging Face model folder into our own tensors (no transformers model is built).

A folder holds `config.json`, one or more `*.safetensors` (optionally listed by
`model.safetensors.index.json`) and tokenizer files. Tensors are read lazily with
`safetensors.safe_open`, fused per layer on the CPU (q/k/v into one matrix for `rmsnorm_qkv`,
gate/up into another), converted to the requested dtype and moved to the device one layer at a
time, so the host never holds more than one layer's extra copy. On the CPU each layer's tensors
then move into one region of transparent huge pages (huge_pages.py), as do the embedding and lm_head.

With a `ShardSpec` (tensor/pipeline parallelism, see sharding.py) only the worker's layers are
read, and of each sharded matrix only its rows or columns (safetensors slices, so a worker never
reads a whole tensor it only needs a part of).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from ..resources import resolve_dtype
from . import huge_pages
from .causal_lm import CausalLM, LayerWeights
from .config import ModelSpec
from .gguf_file import is_gguf
from .sharding import ShardSpec

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

    def get(self, name: str, shape: Sequence[int], rows: slice | None = None,
            cols: slice | None = None) -> torch.Tensor:
        """The tensor `name` (CPU, stored dtype), or only its `rows` / `cols` slice; ValueError if
        it is missing or its full shape is not `shape`."""
        handle = self._where.get(name)
        if handle is None:
            raise ValueError(f"{self.path}: tensor {name!r} is missing from {', '.join(self.files)}")
        part = handle.get_slice(name)
        stored = tuple(part.get_shape())
        if stored != tuple(shape):
            raise ValueError(f"{self.path}: tensor {name!r} has shape {stored}, "
                             f"expected {tuple(shape)} from config.json")
        if rows is None and cols is None:
            return handle.get_tensor(name)
        if cols is None:
            return part[rows]
        return part[rows if rows is not None else slice(None), cols]


def load_model(path: str | Path, device: torch.device | str = "cpu",
               dtype: torch.dtype | str | None = torch.float32, *, spec: ModelSpec | None = None,
               shard: ShardSpec | None = None, tp_comm=None, quantization: str = "auto") -> CausalLM:
    """Load a Llama/Mistral/Qwen2/Qwen3 folder -> CausalLM on `device` in `dtype`.

    `spec` skips parsing config.json (workers get it from the driver); `shard` loads only one
    worker's slice, and `tp_comm` is that worker's tensor-parallel group (all-reduce, gather).
    A `.gguf` file goes to gguf_loader, where `quantization` ('auto' | 'none') chooses whether
    quantized matrices stay blocks; a folder holds float weights and ignores it.
    """
    if is_gguf(path):
        from .gguf_loader import load_gguf_model

        return load_gguf_model(path, device, dtype, spec=spec, shard=shard, tp_comm=tp_comm,
                               quantization=quantization)
    t0 = time.perf_counter()
    path = Path(path)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = resolve_dtype(dtype, device)
    spec = spec if spec is not None else ModelSpec.from_pretrained(path)
    st = SafetensorsFolder(path)
    hid, inter, vocab = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    qs, kvs, d = spec.q_size, spec.kv_size, spec.head_dim
    if shard is None:  # the whole model: one stage, one rank
        layer_ids = range(spec.num_layers)
        q_rows = kv_rows = i_rows = vocab_rows = None  # whole tensors
        first = last = row_bias = True
    else:
        layer_ids = range(shard.layer_start, shard.layer_end)
        q_rows = slice(shard.q_head_start * d, (shard.q_head_start + shard.num_q_heads) * d)
        kv_rows = slice(shard.kv_head_start * d, (shard.kv_head_start + shard.num_kv_heads) * d)
        i_rows = slice(shard.inter_start, shard.inter_start + shard.inter_size)
        vocab_rows = slice(shard.vocab_start, shard.vocab_end)
        first, last, row_bias = shard.first_stage, shard.last_stage, shard.keeps_row_parallel_bias

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    def pack(layer: LayerWeights) -> LayerWeights:
        """The layer's tensors side by side in one huge-page region (CPU; huge_pages.py), so the
        small matrices share huge pages with the large ones."""
        names = [f.name for f in dataclasses.fields(layer)]
        placed = huge_pages.place_all([getattr(layer, n) for n in names])
        return dataclasses.replace(layer, **dict(zip(names, placed)))

    def fetch(name: str, shape: Sequence[int], rows: slice | None = None,
              cols: slice | None = None) -> torch.Tensor:
        return put(st.get(name, shape, rows, cols))

    def fuse(parts: Sequence[tuple[str, Sequence[int], slice]]) -> torch.Tensor:
        """Row slices of several tensors stacked into one: [(name, full shape, rows), ...]."""
        return put(torch.cat([st.get(n, s, rows) for n, s, rows in parts], dim=0))

    embed = huge_pages.place(fetch("model.embed_tokens.weight", (vocab, hid))) if first else None
    layers = []
    for i in layer_ids:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qkv = [(a + "q_proj.", qs, q_rows), (a + "k_proj.", kvs, kv_rows), (a + "v_proj.", kvs, kv_rows)]
        layers.append(pack(LayerWeights(
            input_norm=fetch(p + "input_layernorm.weight", (hid,)),
            # column-parallel: this rank's q heads, then its KV heads' k and v rows
            qkv_weight=fuse([(n + "weight", (r, hid), rows) for n, r, rows in qkv]),
            qkv_bias=fuse([(n + "bias", (r,), rows) for n, r, rows in qkv]) if spec.qkv_bias else None,
            q_norm=fetch(a + "q_norm.weight", (d,)) if spec.qk_norm else None,
            k_norm=fetch(a + "k_norm.weight", (d,)) if spec.qk_norm else None,
            # row-parallel: the input columns of this rank's heads; the bias is added once
            o_weight=fetch(a + "o_proj.weight", (hid, qs), cols=q_rows),
            o_bias=fetch(a + "o_proj.bias", (hid,)) if spec.o_bias and row_bias else None,
            post_norm=fetch(p + "post_attention_layernorm.weight", (hid,)),
            gate_up_weight=fuse([(m + "gate_proj.weight", (inter, hid), i_rows),
                                 (m + "up_proj.weight", (inter, hid), i_rows)]),
            gate_up_bias=(fuse([(m + "gate_proj.bias", (inter,), i_rows), (m + "up_proj.bias", (inter,), i_rows)])
                          if spec.mlp_bias else None),
            down_weight=fetch(m + "down_proj.weight", (hid, inter), cols=i_rows),
            down_bias=fetch(m + "down_proj.bias", (hid,)) if spec.mlp_bias and row_bias else None,
        )))
    final_norm = lm_head = None
    if last:
        final_norm = fetch("model.norm.weight", (hid,))
        # Tied models share the embedding (transformers ties even when lm_head.weight is stored);
        # a vocab shard of it is a row view, unless the embedding lives on another stage.
        if spec.tie_word_embeddings:
            if embed is None:
                lm_head = huge_pages.place(fetch("model.embed_tokens.weight", (vocab, hid), vocab_rows))
            else:
                lm_head = embed if vocab_rows is None else embed[vocab_rows]
        else:
            lm_head = huge_pages.place(fetch("lm_head.weight", (vocab, hid), vocab_rows))
    model = CausalLM(spec, embed, layers, final_norm, lm_head, device, dtype, shard=shard, tp_comm=tp_comm)
    where = "" if shard is None else (f" (stage {shard.stage} layers {shard.layer_start}-{shard.layer_end - 1}, "
                                      f"tensor rank {shard.tp_rank}/{shard.tp_size})")
    log.info("loaded %s from %s in %.1fs%s: %d layers, hidden %d, heads %d/%d x %d, vocab %d, %s on %s",
             spec.architecture, path, time.perf_counter() - t0, where, spec.num_layers, hid,
             spec.num_heads, spec.num_kv_heads, d, vocab, dtype, device)
    return model


def load_tokenizer(path: str | Path):
    """The folder's transformers tokenizer (AutoTokenizer), or the one stored in a GGUF file."""
    if is_gguf(path):
        from .gguf_loader import load_gguf_tokenizer

        return load_gguf_tokenizer(path)
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
