"""Load a GGUF file (llama.cpp's format) into a CausalLM, keeping quantized tensors as blocks.

    quantization="auto": each matrix in a served block format (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
                         Q4_K, Q5_K, Q6_K; orca_ext/quant) stays as its blocks, a
                         QuantizedWeight, with no float copy; the embedding too (its rows are
                         decoded per forward).
    quantization="none": every matrix is dequantized to `dtype` at load (the float path).

Either way F32/F16/BF16 tensors (norms, biases, float matrices) become `dtype` tensors, and a
matrix in any other ggml type (Q2_K, Q3_K, IQ4_XS, ...) is dequantized at load by the `gguf`
package, with one log line per type naming the tensors. A fused matrix (q/k/v, gate/up) whose
parts are all blocks stays blocks (a QuantizedStack when their formats differ); one with a float
part is dequantized whole, with a log line.

llama.cpp's converter permutes the rows of attn_q and attn_k of llama-architecture files (its
rope pairs neighbouring values, ours the two halves of a head); the loader undoes that by
reordering whole rows, which moves blocks and never re-encodes them.

Tensor parallelism: q/k/v, gate/up and the lm_head split by rows (whole rows of blocks).
o_proj and down split by columns; a split on block boundaries keeps the blocks, any other split
dequantizes that rank's share with a log line. Pipeline stages load only their layers.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from ..quant.formats import FORMATS, QUANTIZATION_MODES, QType
from ..quant.weight import QuantizedStack, QuantizedWeight, stack_rows
from ..resources import resolve_dtype
from . import huge_pages
from .causal_lm import CausalLM, LayerWeights
from .config import ModelSpec
from .gguf_file import GGUFFile
from .sharding import ShardSpec

log = logging.getLogger(__name__)

_FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16

Weight = torch.Tensor | QuantizedWeight | QuantizedStack


class _Reader:
    """Tensors of one GGUFFile as float tensors or QuantizedWeights, rows/columns selected."""

    def __init__(self, g: GGUFFile, dtype: torch.dtype, keep_blocks: bool):
        self.g = g
        self.dtype = dtype
        self.keep_blocks = keep_blocks
        self.dequantized: dict[str, list[str]] = defaultdict(list)  # ggml type name -> tensors

    def vector(self, name: str, n: int, rows: slice | None = None) -> torch.Tensor:
        return self.matrix(name, (n,), rows=rows, force_float=True)

    def matrix(self, name: str, shape: Sequence[int], rows: slice | np.ndarray | None = None,
               cols: slice | None = None, force_float: bool = False) -> Weight:
        """Tensor `name` of logical `shape` (rows first): a QuantizedWeight of its blocks when it
        is in a served format and blocks are kept, else a float tensor in `dtype`."""
        qtype, data = self.g.raw(name, tuple(shape))
        if qtype in _FLOAT_TYPES or qtype not in FORMATS:
            return self._float(name, qtype, data, shape, rows, cols)
        w = QuantizedWeight(QType(qtype), _mapped(data if rows is None else data[rows]),
                            _count(shape[0], rows), shape[-1])
        if cols is not None:
            try:
                w = w.columns(cols.start, cols.stop)
            except ValueError as exc:
                log.warning("%s: %s; this shard is dequantized to %s", name, exc, self.dtype)
                return w.dequantize(self.dtype)[:, cols].contiguous()
        if force_float or not self.keep_blocks:
            return w.dequantize(self.dtype)
        return w

    def _float(self, name, qtype, data, shape, rows, cols) -> torch.Tensor:
        import gguf

        if qtype not in _FLOAT_TYPES:
            self.dequantized[gguf.GGMLQuantizationType(qtype).name].append(name)
        part = data if rows is None else data[rows]
        try:
            values = gguf.quants.dequantize(np.asarray(part), gguf.GGMLQuantizationType(qtype))
        except (NotImplementedError, ValueError) as exc:
            raise ValueError(f"{self.g.path}: tensor {name!r} has ggml type {qtype}, which cannot be "
                             f"decoded ({exc})") from exc
        t = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(_count(shape[0], rows), *shape[1:])
        if cols is not None:
            t = t[:, cols]
        return t.to(self.dtype).contiguous()


def _count(n: int, rows: slice | np.ndarray | None) -> int:
    if rows is None:
        return n
    if isinstance(rows, slice):
        return len(range(*rows.indices(n)))
    return len(rows)


def _mapped(a: np.ndarray) -> torch.Tensor:
    """A tensor over `a`, which may be a read-only view of the file's mapping: _place copies it
    into the model's memory once, with no intermediate copy (freed temporaries the size of the
    model would stay in the allocator's heap and count as resident memory)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the mapping is not writable; it is only read
        return torch.from_numpy(np.ascontiguousarray(a))


def unpermute_rows(n_heads: int, head_dim: int) -> np.ndarray:
    """Row order that undoes convert_hf_to_gguf's q/k permutation: Hugging Face row
    h*D + j*D/2 + i is GGUF row h*D + 2*i + j."""
    return np.arange(n_heads * head_dim).reshape(n_heads, head_dim // 2, 2).transpose(0, 2, 1).reshape(-1)


def _fuse(parts: list[Weight], name: str, dtype: torch.dtype) -> Weight:
    """Row blocks of one fused matrix -> one weight (blocks when every part is blocks)."""
    if all(isinstance(p, QuantizedWeight) for p in parts):
        return stack_rows(parts)
    if any(isinstance(p, QuantizedWeight) for p in parts):
        kinds = ", ".join(p.qtype.name if isinstance(p, QuantizedWeight) else "float" for p in parts)
        log.info("%s mixes served blocks with dequantized parts (%s); the fused matrix is dequantized to %s",
                 name, kinds, dtype)
    return torch.cat([p.dequantize(dtype) if isinstance(p, QuantizedWeight) else p for p in parts], dim=0)


def _place(weights: list[Weight | None], device: torch.device) -> list[Weight | None]:
    """Move to `device`; on the CPU pack every tensor (block data included) into one huge-page
    region. The loader places the whole model at once: a 4-bit layer is a few MB, and one region
    per layer would round each up to whole 2 MiB pages (a third more memory for a 135M model)."""
    flat: list[torch.Tensor | None] = []
    for w in weights:
        if isinstance(w, QuantizedStack):
            flat.extend(p.data for p in w.parts)
        elif isinstance(w, QuantizedWeight):
            flat.append(w.data)
        else:
            flat.append(w)
    moved = [None if t is None else t.to(device) for t in flat]
    if device.type == "cpu":
        moved = huge_pages.place_all(moved)
    # Whatever was neither moved nor placed may still be a view of the file: copy it.
    flat = [m if m is None or m is not t else m.clone() for m, t in zip(moved, flat)]
    out, i = [], 0
    for w in weights:
        if isinstance(w, QuantizedStack):
            parts = []
            for p in w.parts:
                parts.append(QuantizedWeight(p.qtype, flat[i], p.n, p.k))
                i += 1
            out.append(QuantizedStack(tuple(parts)))
        elif isinstance(w, QuantizedWeight):
            out.append(QuantizedWeight(w.qtype, flat[i], w.n, w.k))
            i += 1
        else:
            out.append(flat[i])
            i += 1
    return out


def _place_model(embed, layers: list[LayerWeights], final_norm, lm_head, device: torch.device):
    """Every weight of the model placed by one _place call (a tied lm_head stays the embedding)."""
    names = [f.name for f in dataclasses.fields(LayerWeights)]
    tied = lm_head is embed and embed is not None
    flat = [embed, final_norm, None if tied else lm_head] + [getattr(layer, n) for layer in layers for n in names]
    placed = _place(flat, device)
    embed, final_norm, lm_head = placed[0], placed[1], placed[0] if tied else placed[2]
    it = iter(placed[3:])
    layers = [LayerWeights(**{n: next(it) for n in names}) for _ in layers]
    return embed, layers, final_norm, lm_head


def load_gguf_model(path: str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype | str | None = torch.float32, *, spec: ModelSpec | None = None,
                    shard: ShardSpec | None = None, tp_comm=None, quantization: str = "auto") -> CausalLM:
    """A Llama/Mistral/Qwen2/Qwen3 GGUF -> CausalLM on `device`, activations and KV in `dtype`."""
    if quantization not in QUANTIZATION_MODES:
        raise ValueError(f"quantization must be one of {QUANTIZATION_MODES}, got {quantization!r}")
    t0 = time.perf_counter()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = resolve_dtype(dtype, device)
    g = GGUFFile(path)
    spec = spec if spec is not None else ModelSpec.from_gguf(g)
    r = _Reader(g, dtype, keep_blocks=quantization == "auto")
    hid, inter, vocab = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    qs, kvs, d = spec.q_size, spec.kv_size, spec.head_dim
    q_order = unpermute_rows(spec.num_heads, d) if g.architecture == "llama" else np.arange(qs)
    k_order = unpermute_rows(spec.num_kv_heads, d) if g.architecture == "llama" else np.arange(kvs)
    if shard is None:
        layer_ids = range(spec.num_layers)
        q_rows, kv_rows, i_rows, vocab_rows, o_cols, down_cols = q_order, k_order, None, None, None, None
        v_rows = None
        first = last = row_bias = True
    else:
        layer_ids = range(shard.layer_start, shard.layer_end)
        q_sl = slice(shard.q_head_start * d, (shard.q_head_start + shard.num_q_heads) * d)
        kv_sl = slice(shard.kv_head_start * d, (shard.kv_head_start + shard.num_kv_heads) * d)
        q_rows, kv_rows, v_rows = q_order[q_sl], k_order[kv_sl], kv_sl
        i_rows = slice(shard.inter_start, shard.inter_start + shard.inter_size)
        vocab_rows = slice(shard.vocab_start, shard.vocab_end)
        o_cols, down_cols = q_sl, i_rows
        first, last, row_bias = shard.first_stage, shard.last_stage, shard.keeps_row_parallel_bias

    embed = None
    if first:
        embed = r.matrix("token_embd.weight", (vocab, hid))
    layers = []
    for i in layer_ids:
        b = f"blk.{i}."
        qkv_parts = [(b + "attn_q.", qs, q_rows), (b + "attn_k.", kvs, kv_rows), (b + "attn_v.", kvs, v_rows)]
        fields = dict(
            input_norm=r.vector(b + "attn_norm.weight", hid),
            qkv_weight=_fuse([r.matrix(n + "weight", (rows, hid), sel) for n, rows, sel in qkv_parts],
                             b + "attn_qkv", dtype),
            qkv_bias=torch.cat([r.vector(n + "bias", rows, sel) for n, rows, sel in qkv_parts])
            if spec.qkv_bias else None,
            q_norm=r.vector(b + "attn_q_norm.weight", d) if spec.qk_norm else None,
            k_norm=r.vector(b + "attn_k_norm.weight", d) if spec.qk_norm else None,
            o_weight=r.matrix(b + "attn_output.weight", (hid, qs), cols=o_cols),
            o_bias=r.vector(b + "attn_output.bias", hid) if spec.o_bias and row_bias else None,
            post_norm=r.vector(b + "ffn_norm.weight", hid),
            gate_up_weight=_fuse([r.matrix(b + "ffn_gate.weight", (inter, hid), i_rows),
                                  r.matrix(b + "ffn_up.weight", (inter, hid), i_rows)], b + "ffn_gate_up", dtype),
            gate_up_bias=torch.cat([r.vector(b + "ffn_gate.bias", inter, i_rows),
                                    r.vector(b + "ffn_up.bias", inter, i_rows)]) if spec.mlp_bias else None,
            down_weight=r.matrix(b + "ffn_down.weight", (hid, inter), cols=down_cols),
            down_bias=r.vector(b + "ffn_down.bias", hid) if spec.mlp_bias and row_bias else None,
        )
        layers.append(LayerWeights(**fields))

    final_norm = lm_head = None
    if last:
        final_norm = r.vector("output_norm.weight", hid)
        if spec.tie_word_embeddings and embed is not None:  # a vocab shard of it is a row slice
            if vocab_rows is None:
                lm_head = embed
            elif isinstance(embed, QuantizedWeight):
                lm_head = embed.rows(vocab_rows.start, min(vocab_rows.stop, vocab))
            else:
                lm_head = embed[vocab_rows]
        else:
            name = "token_embd.weight" if spec.tie_word_embeddings else "output.weight"
            lm_head = r.matrix(name, (vocab, hid), vocab_rows)
    embed, layers, final_norm, lm_head = _place_model(embed, layers, final_norm, lm_head, device)
    for type_name, names in r.dequantized.items():
        log.info("%s: %d tensors in %s are dequantized to %s at load (not a served block format): %s",
                 g.path.name, len(names), type_name, dtype, ", ".join(names))
    g.close()
    _release_freed_heap()
    model = CausalLM(spec, embed, layers, final_norm, lm_head, device, dtype, shard=shard, tp_comm=tp_comm)
    block_bytes = sum(model.block_bytes().values())
    where = "" if shard is None else (f" (stage {shard.stage} layers {shard.layer_start}-{shard.layer_end - 1}, "
                                      f"tensor rank {shard.tp_rank}/{shard.tp_size})")
    log.info("loaded %s GGUF %s in %.1fs%s: %d layers, hidden %d, %.1f MB of weights as blocks "
             "(quantization=%s), activations %s on %s", spec.architecture, g.path.name,
             time.perf_counter() - t0, where, spec.num_layers, hid, block_bytes / 1e6, quantization, dtype, device)
    return model


def _release_freed_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's malloc_trim). GGUFReader parses
    every metadata array into its own small numpy objects (a 50k-token vocabulary and its merges
    are hundreds of thousands), which once freed stay resident in the heap: over 60 MB for
    SmolLM2, most of what its 4-bit weights take."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        trim = None
    if trim is not None:
        trim(0)


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer and chat template stored in the GGUF. transformers builds the tokenizer from
    the tokenizer.ggml.* metadata, which takes seconds for a 50k vocabulary, so the result is
    kept as an ordinary tokenizer folder in the cache (tokenizer_cache_folder) and read from there
    next time."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    from transformers import AutoTokenizer

    # A cache entry exists only for this very file (name, size, mtime) and only once its tokenizer
    # was built, so it is read first, without parsing the file's metadata again.
    cached = tokenizer_cache_folder(path)
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception as exc:  # a damaged cache entry is rebuilt
            log.warning("rebuilding the cached tokenizer %s: %s", cached, exc)
    metadata = GGUFFile(path)
    if metadata.field("tokenizer.ggml.model", None) is None:
        raise FileNotFoundError(f"{path} has no tokenizer (no tokenizer.ggml.* metadata)")
    tokenizer = _build_gguf_tokenizer(path, metadata.field("tokenizer.chat_template", None))
    _save_atomically(tokenizer, cached)
    return tokenizer


def tokenizer_cache_folder(path: Path) -> Path:
    """`<cache>/gguf_tokenizers/<file name>-<bytes>-<mtime ns>`: a changed file gets a new entry."""
    from ..default_model import cache_root

    st = path.stat()
    return cache_root() / "gguf_tokenizers" / f"{path.name}-{st.st_size}-{st.st_mtime_ns}"


def _save_atomically(tokenizer, folder: Path) -> None:
    """Write into a temporary sibling and rename it into place (a concurrent writer's copy wins);
    a cache that cannot be written only costs the next start the build again."""
    import shutil
    import tempfile

    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    except OSError as exc:
        log.warning("cannot cache the GGUF tokenizer under %s: %s", folder.parent, exc)
        return
    try:
        tokenizer.save_pretrained(str(tmp))
        tmp.chmod(0o755)
        tmp.rename(folder)
    except OSError as exc:
        if not folder.is_dir():
            log.warning("cannot cache the GGUF tokenizer at %s: %s", folder, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _build_gguf_tokenizer(path: Path, chat_template):
    """transformers' tokenizer of the file, with the file's `chat_template` (its metadata value,
    or None) when transformers kept none."""
    from transformers import AutoTokenizer

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # transformers raises many types for a tokenizer it cannot build
        raise ValueError(f"{path}: the tokenizer could not be built from the file: {exc}") from exc
    if not getattr(tokenizer, "chat_template", None) and isinstance(chat_template, str) and chat_template:
        tokenizer.chat_template = chat_template
    return tokenizer
