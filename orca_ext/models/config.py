"""ModelSpec: the few numbers of a Hugging Face `config.json` that our forward needs.

We read `config.json` ourselves first (so an unsupported architecture or a missing file gives a
clear error before transformers is involved), then let `transformers.AutoConfig` fill in the
per-family defaults (e.g. Qwen3's head_dim of 128 when the file omits it). Rope settings are
read from either spelling: transformers >= 5 writes `rope_parameters` (with `rope_theta` inside),
older files have a top-level `rope_theta` plus an optional `rope_scaling` dict.

Sliding-window attention (Mistral `sliding_window`, Qwen2/Qwen3 `use_sliding_window`): we always
run full causal attention, which equals windowed attention as long as a request's whole context
fits in the window. So when a config enables a window, the usable context is limited to it:
`max_position_embeddings` of the spec is `min(config value, window)` (logged as a warning), and
the server's `max_model_len` can never exceed it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

# Architecture name in config.json -> transformers model_type.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
_ARCH_BY_MODEL_TYPE = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding settings; `rope_type` is "default" (plain theta) or "llama3"."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int          # usable context (already capped by a sliding window)
    rms_norm_eps: float
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool                        # q/k/v projections carry a bias (Qwen2; attention_bias)
    o_bias: bool                          # o_proj carries a bias (Llama/Qwen3 attention_bias)
    mlp_bias: bool                        # gate/up/down carry a bias (Llama mlp_bias)
    qk_norm: bool                         # per-head RMSNorm of q and k before rope (Qwen3)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    sliding_window: int | None = None     # the window the config enables, if any (informational)
    # (ggml type id, bytes) of the matrices a GGUF file stores in served block formats; () for a
    # float checkpoint (what quant_activations='auto' is resolved from: resolve_quant_activations)
    block_bytes: tuple[tuple[int, int], ...] = ()

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ModelSpec":
        """Parse `<path>/config.json` (+ `generation_config.json` for extra EOS ids), or the
        metadata of a GGUF file (from_gguf)."""
        from .gguf_file import GGUFFile, is_gguf

        if is_gguf(path):
            return cls.from_gguf(GGUFFile(path))
        path = Path(path)
        raw = read_config_json(path)
        architecture = check_architecture(raw, path)
        import transformers  # heavy import, only when a model is actually loaded

        try:
            cfg = transformers.AutoConfig.from_pretrained(str(path))
        except Exception as exc:  # transformers raises many types; keep the cause
            raise ValueError(f"{path / 'config.json'}: transformers could not parse it: {exc}") from exc
        gen = _read_optional_json(path / "generation_config.json")
        return cls.from_configs(architecture, raw, cfg, gen, source=str(path / "config.json"))

    @classmethod
    def from_configs(cls, architecture: str, raw: dict, cfg: Any, gen: dict | None,
                     source: str = "config.json") -> "ModelSpec":
        hidden_act = getattr(cfg, "hidden_act", "silu")
        if hidden_act not in ("silu", "swish"):
            raise ValueError(f"{source}: hidden_act={hidden_act!r} is unsupported (only 'silu')")
        num_heads = int(cfg.num_attention_heads)
        num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"{source}: num_attention_heads={num_heads} is not a multiple of "
                             f"num_key_value_heads={num_kv_heads}")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        if int(head_dim) % 2:
            raise ValueError(f"{source}: head_dim={head_dim} must be even for rotary embeddings")

        model_type = SUPPORTED_ARCHITECTURES[architecture]
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        qkv_bias = True if model_type == "qwen2" else attention_bias
        o_bias = False if model_type == "qwen2" else attention_bias

        max_pos = int(cfg.max_position_embeddings)
        window = sliding_window_of(raw, model_type)
        if window is not None and window < max_pos:
            log.warning("%s enables a sliding window of %d tokens; orca_ext runs full attention, "
                        "so contexts are limited to %d tokens (max_position_embeddings was %d)",
                        source, window, window, max_pos)
            max_pos = window

        eos = _as_id_tuple(raw.get("eos_token_id", getattr(cfg, "eos_token_id", None)))
        if gen:
            eos = tuple(dict.fromkeys(eos + _as_id_tuple(gen.get("eos_token_id"))))
        bos = raw.get("bos_token_id", getattr(cfg, "bos_token_id", None))

        return cls(
            architecture=architecture,
            vocab_size=int(cfg.vocab_size),
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_layers=int(cfg.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=int(head_dim),
            max_position_embeddings=max_pos,
            rms_norm_eps=float(cfg.rms_norm_eps),
            rope=parse_rope(raw, cfg, source),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings",
                                             getattr(cfg, "tie_word_embeddings", False))),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos,
            bos_token_id=None if bos is None else int(bos),
            sliding_window=window,
        )


    @classmethod
    def from_gguf(cls, g: Any) -> "ModelSpec":
        """The spec of an opened GGUFFile (gguf_file.py), from llama.cpp's metadata keys
        (`<arch>.block_count`, `<arch>.attention.head_count`, ...) and which tensors exist
        (output.weight absent: tied; attn_q.bias: qkv bias; attn_q_norm: Qwen3's q/k norm)."""
        source = str(g.path)
        model_type = g.architecture
        if model_type not in GGUF_ARCHITECTURES:
            raise ValueError(f"{source}: GGUF architecture {model_type!r} is unsupported; supported: "
                             f"{', '.join(GGUF_ARCHITECTURES)}")

        def num(key: str, default: Any = _REQUIRED) -> Any:
            value = g.arch_field(key) if default is _REQUIRED else g.arch_field(key, default)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{source}: metadata {model_type}.{key} must be a number, got {value!r}")
            return value

        hidden = int(num("embedding_length"))
        num_heads = int(num("attention.head_count"))
        num_kv_heads = int(num("attention.head_count_kv", num_heads))
        for key, value in (("embedding_length", hidden), ("attention.head_count", num_heads),
                           ("attention.head_count_kv", num_kv_heads)):
            if value < 1:
                raise ValueError(f"{source}: metadata {model_type}.{key}={value} must be >= 1")
        if num_heads % num_kv_heads:
            raise ValueError(f"{source}: head_count={num_heads} is not a multiple of head_count_kv={num_kv_heads}")
        head_dim = int(num("attention.key_length", hidden // num_heads))
        if head_dim < 2 or head_dim % 2:
            raise ValueError(f"{source}: head_dim={head_dim} must be even for rotary embeddings")
        if int(num("attention.value_length", head_dim)) != head_dim:
            raise ValueError(f"{source}: attention.value_length differs from key_length; unsupported")
        if int(num("rope.dimension_count", head_dim)) != head_dim:
            raise ValueError(f"{source}: rope.dimension_count != head_dim (partial rotary) is unsupported")
        scaling = g.arch_field("rope.scaling.type", "none")
        if scaling not in ("none", None):
            raise ValueError(f"{source}: rope scaling {scaling!r} is unsupported")
        rope = RopeConfig(theta=float(num("rope.freq_base", 10000.0)))
        if "rope_freqs.weight" in g:
            rope = llama3_rope_from_freqs(g, rope.theta, head_dim, source)
        tokens = g.field("tokenizer.ggml.tokens", None)
        vocab = int(num("vocab_size", len(tokens) if tokens is not None else 0))
        if vocab < 1:
            raise ValueError(f"{source}: the vocabulary size is missing ({model_type}.vocab_size, tokenizer.ggml.tokens)")
        eos = _as_id_tuple(g.field("tokenizer.ggml.eos_token_id", None))
        eot = g.field("tokenizer.ggml.eot_token_id", None)
        if eot is not None:
            eos = tuple(dict.fromkeys(eos + _as_id_tuple(eot)))
        bos = g.field("tokenizer.ggml.bos_token_id", None)
        return cls(
            architecture=_ARCH_BY_MODEL_TYPE[model_type],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(num("feed_forward_length")),
            num_layers=int(num("block_count")),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(num("context_length")),
            rms_norm_eps=float(num("attention.layer_norm_rms_epsilon")),
            rope=rope,
            tie_word_embeddings="output.weight" not in g,
            qkv_bias="blk.0.attn_q.bias" in g,
            o_bias="blk.0.attn_output.bias" in g,
            mlp_bias="blk.0.ffn_gate.bias" in g,
            qk_norm="blk.0.attn_q_norm.weight" in g,
            eos_token_ids=eos,
            bos_token_id=None if bos is None else int(bos),
            block_bytes=tuple(sorted(g.block_bytes().items())),
        )


# GGUF general.architecture values we load (Mistral GGUFs say "llama").
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")
_REQUIRED = object()


def llama3_rope_from_freqs(g: Any, theta: float, head_dim: int, source: str) -> RopeConfig:
    """Llama 3 GGUFs store their rope scaling as a `rope_freqs` tensor [D/2] of per-frequency
    divisors instead of its parameters. We recognise it as the llama3 scaling with the
    parameters every Llama 3.x release uses (low 1, high 4, original context 8192) and the
    tensor's largest divisor as the factor, and check that this reproduces the tensor."""
    _, stored = g.raw("rope_freqs.weight", (head_dim // 2,))
    stored = np.array(stored, dtype=np.float64)
    rope = RopeConfig(theta=theta, rope_type="llama3", factor=float(stored.max()), low_freq_factor=1.0,
                      high_freq_factor=4.0, original_max_position_embeddings=8192)
    if not np.allclose(_llama3_divisors(rope, head_dim), stored, rtol=1e-4, atol=1e-6):
        raise ValueError(f"{source}: rope_freqs.weight is not a llama3 rope scaling we recognise; unsupported")
    return rope


def _llama3_divisors(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """[D/2] divisors of the plain rope frequencies under llama3 scaling (convert_hf_to_gguf.py's
    rope_freqs)."""
    freqs = 1.0 / rope.theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / freqs
    orig = rope.original_max_position_embeddings
    smooth = (orig / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    mid = 1.0 / ((1 - smooth) / rope.factor + smooth)
    return np.where(wavelen < orig / rope.high_freq_factor, 1.0,
                    np.where(wavelen > orig / rope.low_freq_factor, rope.factor, mid))


def read_config_json(path: Path) -> dict:
    if not path.is_dir():
        raise FileNotFoundError(f"model folder {path} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} is missing: a model folder needs config.json")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{cfg_file} is not valid JSON: {exc}") from exc


def check_architecture(raw: dict, path: Path) -> str:
    """The single supported architecture named by config.json, else ValueError."""
    archs = raw.get("architectures") or []
    if not archs and raw.get("model_type") in _ARCH_BY_MODEL_TYPE:
        archs = [_ARCH_BY_MODEL_TYPE[raw["model_type"]]]
    supported = [a for a in archs if a in SUPPORTED_ARCHITECTURES]
    if not supported:
        named = archs or raw.get("model_type") or "nothing"
        raise ValueError(f"{path / 'config.json'}: architecture {named} is unsupported; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return supported[0]


def sliding_window_of(raw: dict, model_type: str) -> int | None:
    """The attention window the config actually enables, or None."""
    window = raw.get("sliding_window")
    if window is None:
        return None
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return None  # Qwen configs carry a window value but only use it with use_sliding_window
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    # Without layer_types, Qwen windows only the layers from max_window_layers on.
    n_layers, first = raw.get("num_hidden_layers"), raw.get("max_window_layers")
    if model_type in ("qwen2", "qwen3") and first is not None and n_layers is not None and first >= n_layers:
        return None
    return int(window)


def parse_rope(raw: dict, cfg: Any, source: str = "config.json") -> RopeConfig:
    """Rope settings from `rope_parameters` (transformers >= 5) or `rope_theta` + `rope_scaling`.

    The raw file decides (it is the spelling the checkpoint was written with); the parsed config
    object only supplies the family's default theta when the file names none.
    """
    params: dict = {}
    rp = raw.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        if "rope_theta" not in rp and "rope_type" not in rp and all(isinstance(v, dict) for v in rp.values()):
            raise ValueError(f"{source}: per-layer-type rope_parameters {sorted(rp)} are unsupported")
        params.update(rp)
    if raw.get("rope_theta") is not None:
        params.setdefault("rope_theta", raw["rope_theta"])
    rs = raw.get("rope_scaling")
    if isinstance(rs, dict) and rs:
        params.update({k: v for k, v in rs.items() if k not in params})
    if params.get("rope_theta") is None:
        parsed = getattr(cfg, "rope_parameters", None)
        theta = parsed.get("rope_theta") if isinstance(parsed, dict) else None
        params["rope_theta"] = theta if theta is not None else getattr(cfg, "rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"{source}: rope_type={rope_type!r} is unsupported; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = float(params.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor={partial} is unsupported (only 1.0)")
    theta = float(params["rope_theta"])
    if rope_type == "default":
        return RopeConfig(theta=theta)
    missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in params]
    if missing:
        raise ValueError(f"{source}: llama3 rope scaling lacks {', '.join(missing)}")
    # transformers falls back to max_position_embeddings when the original length is absent
    orig = params.get("original_max_position_embeddings") or getattr(cfg, "max_position_embeddings", None)
    if orig is None:
        raise ValueError(f"{source}: llama3 rope scaling needs original_max_position_embeddings")
    return RopeConfig(
        theta=theta, rope_type="llama3", factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(orig),
    )


def _as_id_tuple(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _read_optional_json(path: Path) -> dict | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        log.warning("ignoring %s: not valid JSON", path)
        return None
