"""orca_ext.models against transformers on tiny random models of every supported family.

The ground truth is transformers' own implementation (greedy `generate` in float32 on the CPU,
one prompt at a time); ours runs several prompts of different lengths together in ragged
batches, the way the engine does.
"""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from orca_ext.models import ForwardBatch, ModelSpec, load_model, load_tokenizer
from orca_ext.models.rope import inv_freq
from tiny_models import FAMILIES, ragged_greedy, reference_greedy, reference_logits

CASES = [(family, tied) for family in FAMILIES for tied in (False, True)]
LOGITS_ATOL = 1e-4


def _random_prompts(lengths, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _check_against_reference(model_dir, prompts, max_new, tokens, logits):
    for r, prompt in enumerate(prompts):
        ref_tokens, ref_logits = reference_greedy(model_dir, prompt, max_new[r], return_logits=True)
        assert tokens[r] == ref_tokens, f"request {r} (prompt length {len(prompt)})"
        assert torch.isfinite(logits[r]).all()
        torch.testing.assert_close(logits[r], ref_logits, atol=LOGITS_ATOL, rtol=0)


@pytest.mark.parametrize("family,tied", CASES, ids=[f"{f}-{'tied' if t else 'untied'}" for f, t in CASES])
def test_ragged_batch_greedy_matches_transformers(tiny_model_dir, family, tied):
    """Prefill of all prompts in one batch, then one batch per decode step; the batch shrinks
    as requests with fewer tokens finish."""
    model_dir = tiny_model_dir(family, tie_word_embeddings=tied)
    model = load_model(model_dir)
    assert model.spec.tie_word_embeddings == tied
    assert (model.lm_head is model.embed) == tied
    prompts = _random_prompts([1, 7, 13, 4], model.spec.vocab_size, seed=len(family) + tied)
    max_new = [5, 7, 3, 6]
    tokens, logits = ragged_greedy(model, prompts, max_new)
    _check_against_reference(model_dir, prompts, max_new, tokens, logits)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_joins_running_decodes(tiny_model_dir, family):
    """Requests arrive while others decode: a step mixes a new prompt's prefill (or the second
    chunk of a prompt over its cached prefix, q_len < kv_len) with the others' decodes."""
    model_dir = tiny_model_dir(family, tie_word_embeddings=False)
    model = load_model(model_dir)
    prompts = _random_prompts([9, 5, 11, 2], model.spec.vocab_size, seed=100 + len(family))
    max_new = [6, 5, 4, 3]
    tokens, logits = ragged_greedy(model, prompts, max_new, arrivals=[0, 2, 3, 3],
                                   prefill_chunks=[None, None, 4, None], slab_gap=11, first_slab=17)
    _check_against_reference(model_dir, prompts, max_new, tokens, logits)


def test_single_forward_logits_match_transformers_for_each_request(tiny_model_dir):
    """One forward over 3 whole prompts: each row equals transformers on that prompt alone."""
    model_dir = tiny_model_dir("qwen3", tie_word_embeddings=False)
    model = load_model(model_dir)
    model.allocate_kv_cache(100)
    prompts = _random_prompts([3, 17, 8], model.spec.vocab_size, seed=7)
    starts = [60, 2, 31]  # slabs out of order, with gaps
    out = model.forward(ForwardBatch.build([(p, 0, s) for p, s in zip(prompts, starts)], "cpu"))
    assert out.shape == (3, model.spec.vocab_size) and out.dtype == torch.float32
    for row, prompt in enumerate(prompts):
        torch.testing.assert_close(out[row], reference_logits(model_dir, prompt), atol=LOGITS_ATOL, rtol=0)


def test_bfloat16_forward_tracks_float32(tiny_model_dir):
    """The same forward in bfloat16: logits close to transformers' float32 ones."""
    model_dir = tiny_model_dir("llama", tie_word_embeddings=False)
    model = load_model(model_dir, dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and model.embed.dtype == torch.bfloat16
    assert model.kv_bytes_per_slot() == 2 * 3 * 2 * 16 * 2
    model.allocate_kv_cache(64)
    assert model.k_cache[0].dtype == torch.bfloat16
    prompts = _random_prompts([6, 10], model.spec.vocab_size, seed=3)
    out = model.forward(ForwardBatch.build([(prompts[0], 0, 0), (prompts[1], 0, 20)], "cpu"))
    assert out.dtype == torch.float32
    for row, prompt in enumerate(prompts):
        ref = reference_logits(model_dir, prompt)
        # bfloat16 keeps ~3 significant digits; a real bug gives errors of the order of std(ref)
        err = (out[row] - ref).abs()
        assert err.max().item() < 0.25 * ref.std().item(), err.max().item()
        assert err.mean().item() < 0.04 * ref.std().item(), err.mean().item()


def test_llama3_inverse_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_parameters = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                         rope_parameters=rope_parameters)
    raw = {"rope_parameters": rope_parameters}
    from orca_ext.models.config import parse_rope

    ours = inv_freq(parse_rope(raw, config), 128)
    theirs, scaling = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert scaling == 1.0
    torch.testing.assert_close(ours, theirs.float(), rtol=1e-6, atol=0)
    plain = inv_freq(parse_rope({"rope_theta": 500000.0}, config), 128)
    assert not torch.allclose(plain, ours)  # the scaling actually changed the long wavelengths


@pytest.mark.parametrize("spelling", ["rope_scaling+rope_theta", "rope_scaling type key"])
def test_transformers4_rope_spelling_gives_the_same_model(tiny_model_dir, tmp_path, spelling):
    """config.json written before transformers 5 (rope_theta + rope_scaling) loads identically."""
    src = tiny_model_dir("llama3_rope")
    dst = tmp_path / "old_spelling"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    kind = params.pop("rope_type")
    params["type" if spelling.endswith("type key") else "rope_type"] = kind
    cfg["rope_scaling"] = params
    (dst / "config.json").write_text(json.dumps(cfg))

    new, old = load_model(src), load_model(dst)
    assert old.spec.rope == new.spec.rope and old.spec.rope.rope_type == "llama3"
    for m in (new, old):
        m.allocate_kv_cache(128)
    prompt = _random_prompts([100], new.spec.vocab_size, seed=5)[0]  # past the original 64 positions
    batch = ForwardBatch.build([(prompt, 0, 0)], "cpu")
    torch.testing.assert_close(old.forward(batch), new.forward(batch), atol=0, rtol=0)


def test_sharded_checkpoint_with_index_loads_the_same(tiny_model_dir, tmp_path):
    src = tiny_model_dir("qwen2", tie_word_embeddings=False)
    dst = tmp_path / "sharded"
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy2(src / name, dst / name)
    tensors = load_file(src / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, dst / shard)
        weight_map.update({k: shard for k in keys})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    a, b = load_model(src), load_model(dst)
    a.allocate_kv_cache(32)
    b.allocate_kv_cache(32)
    batch = ForwardBatch.build([([3, 1, 4, 1, 5], 0, 0), ([9, 2], 0, 10)], "cpu")
    torch.testing.assert_close(a.forward(batch), b.forward(batch), atol=0, rtol=0)

    (dst / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_model(dst)


# ---------------------------------------------------------------- loader errors


def _copy(src, tmp_path, name="m"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder, **changes):
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_missing_folder_and_config(tmp_path, tiny_model_dir):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nowhere")
    folder = _copy(tiny_model_dir("llama"), tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(folder)


@pytest.mark.parametrize("archs", [["GPT2LMHeadModel"], ["Gemma2ForCausalLM"], []])
def test_unsupported_architecture(tmp_path, tiny_model_dir, archs):
    folder = _copy(tiny_model_dir("llama"), tmp_path)
    _edit_config(folder, architectures=archs, model_type="gpt2" if not archs else "llama")
    with pytest.raises(ValueError, match="unsupported.*LlamaForCausalLM") as info:
        load_model(folder)
    assert (archs[0] if archs else "gpt2") in str(info.value)


def test_missing_safetensors(tmp_path, tiny_model_dir):
    folder = _copy(tiny_model_dir("llama"), tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"\*\.safetensors"):
        load_model(folder)


@pytest.mark.parametrize("family,drop", [
    ("llama", "model.layers.1.mlp.up_proj.weight"),
    ("qwen2", "model.layers.0.self_attn.k_proj.bias"),
    ("qwen3", "model.layers.2.self_attn.q_norm.weight"),
    ("mistral", "lm_head.weight"),
    ("llama", "model.norm.weight"),
])
def test_missing_tensor_is_named(tmp_path, tiny_model_dir, family, drop):
    folder = _copy(tiny_model_dir(family, tie_word_embeddings=False), tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors[drop]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=f"'{drop}' is missing"):
        load_model(folder)


def test_tensor_with_wrong_shape_is_named(tmp_path, tiny_model_dir):
    folder = _copy(tiny_model_dir("llama"), tmp_path)
    tensors = load_file(folder / "model.safetensors")
    name = "model.layers.0.self_attn.v_proj.weight"
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(ValueError, match=rf"'{name}' has shape \(31, 96\), expected \(32, 96\)"):
        load_model(folder)


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
                                  {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}])
def test_unsupported_rope_type(tmp_path, tiny_model_dir, rope):
    folder = _copy(tiny_model_dir("llama"), tmp_path)
    _edit_config(folder, rope_parameters=rope)
    with pytest.raises(ValueError, match=f"rope_type='{rope['rope_type']}' is unsupported"):
        ModelSpec.from_pretrained(folder)


def test_missing_tokenizer(tmp_path, tiny_model_dir):
    folder = _copy(tiny_model_dir("llama"), tmp_path)
    assert len(load_tokenizer(folder)) == 49152
    (folder / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_tokenizer(folder)


def test_sliding_window_limits_the_context(tmp_path, tiny_model_dir):
    """A config that enables a window smaller than max_position_embeddings limits contexts to
    the window (full attention equals windowed attention up to that length)."""
    folder = _copy(tiny_model_dir("mistral"), tmp_path)
    _edit_config(folder, sliding_window=16)
    model = load_model(folder)
    assert model.spec.sliding_window == 16 and model.spec.max_position_embeddings == 16
    model.allocate_kv_cache(64)
    ok = model.forward(ForwardBatch.build([(list(range(1, 17)), 0, 0)], "cpu"))
    assert torch.isfinite(ok).all()
    with pytest.raises(ValueError, match="max_position_embeddings=16"):
        model.forward(ForwardBatch.build([([5], 16, 0)], "cpu"))
    # Qwen configs carry a window that is off unless use_sliding_window is set.
    qwen = _copy(tiny_model_dir("qwen2"), tmp_path, "qwen")
    _edit_config(qwen, sliding_window=16, use_sliding_window=False)
    assert ModelSpec.from_pretrained(qwen).max_position_embeddings == 512
    _edit_config(qwen, use_sliding_window=True, max_window_layers=0, layer_types=None)
    assert ModelSpec.from_pretrained(qwen).max_position_embeddings == 16


# ---------------------------------------------------------------- ForwardBatch and guards


def test_forward_batch_build_fields():
    b = ForwardBatch.build([([10, 11, 12], 0, 4), ([20], 5, 30), ([30, 31], 2, 50)], "cpu")
    assert b.token_ids.tolist() == [10, 11, 12, 20, 30, 31]
    assert b.positions.tolist() == [0, 1, 2, 5, 2, 3]
    assert b.slots.tolist() == [4, 5, 6, 35, 52, 53]
    assert b.q_start.tolist() == [0, 3, 4]
    assert b.q_len.tolist() == [3, 1, 2]
    assert b.kv_start.tolist() == [4, 30, 50]
    assert b.kv_len.tolist() == [3, 6, 4]
    assert b.logits_index.tolist() == [2, 3, 5]
    assert (b.num_prefill_tokens, b.num_decode_tokens) == (5, 1)
    assert (b.batch_size, b.num_tokens, b.max_position, b.max_slot, b.max_token_id) == (3, 6, 5, 53, 31)
    for name in ("token_ids", "positions", "slots", "logits_index"):
        assert getattr(b, name).dtype == torch.int64 and getattr(b, name).is_contiguous()
    for name in ("q_start", "q_len", "kv_start", "kv_len"):
        assert getattr(b, name).dtype == torch.int32 and getattr(b, name).is_contiguous()


@pytest.mark.parametrize("requests,match", [
    ([], "requests is empty"),
    ([([1], 0, 0), ([], 3, 9)], "request 1 has no new tokens"),
    ([([1], -1, 0)], "start_pos=-1"),
    ([([1], 0, -2)], "slab_start=-2"),
    ([([1, -5], 0, 0)], "token id -5"),
])
def test_forward_batch_rejects_bad_requests(requests, match):
    with pytest.raises(ValueError, match=match):
        ForwardBatch.build(requests, "cpu")


def test_forward_guards(tiny_model_dir):
    model = load_model(tiny_model_dir("llama"))
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        model.forward(ForwardBatch.build([([1, 2], 0, 0)], "cpu"))
    model.allocate_kv_cache(8)
    assert len(model.k_cache) == 3 and model.k_cache[0].shape == (8, 2, 16)
    assert model.kv_bytes_per_slot() == 2 * 3 * 2 * 16 * 4
    with pytest.raises(ValueError, match="KV slot 9 .* n_slots=8"):
        model.forward(ForwardBatch.build([([1, 2], 0, 8)], "cpu"))
    with pytest.raises(ValueError, match="token id 49152 .* vocab_size=49152"):
        model.forward(ForwardBatch.build([([49152], 0, 0)], "cpu"))
    with pytest.raises(ValueError, match="n_slots must be >= 1"):
        model.allocate_kv_cache(0)
    assert math.isclose(model.scale, 16 ** -0.5)
