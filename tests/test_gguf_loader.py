"""Serving GGUF files: the loader against transformers, its errors, and the quantized forward.

Tiny random Llama / Qwen2 / Qwen3 models are written as GGUF (tests/gguf_models.py: llama.cpp's
names, metadata and q/k permutation) in Q8_0, Q4_0, Q4_1 and a Q4_K_M-like mix (Q4_K with
attn_v and ffn_down in Q6_K); our logits must equal transformers' on the numbers the file
encodes. Broken files must fail with a ValueError naming the tensor. The quantized forward must
give a request the same logits alone as in a ragged batch, bit for bit. The embedded default
model's GGUF must give the spec and the greedy text of its float32 conversion.
"""
from __future__ import annotations

import dataclasses
import logging
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from orca_ext import EngineConfig, modes
from orca_ext.models import ModelSpec, load_model
from orca_ext.models.batch import ForwardBatch
from orca_ext.quant import QuantizedStack, QuantizedWeight

from gguf_models import LARGE, VOCAB, write_gguf


def k_mix(name: str, main: T = T.Q4_K) -> T:
    """Q4_K_M's (Q5_K_M's) pattern: attn_v and ffn_down in Q6_K, the other matrices in Q4_K (Q5_K)."""
    return T.Q6_K if "attn_v" in name or "ffn_down" in name else main


def narrow_k_mix(name: str) -> T:
    """What llama.cpp writes for Q4_K_M when rows are not whole 256-value super-blocks (SmolLM2's
    576, Qwen2.5-0.5B's 896): Q5_0 in place of Q4_K, Q8_0 in place of Q6_K."""
    return T.Q8_0 if "attn_v" in name or "ffn_down" in name else T.Q5_0


FORMATS = {"Q8_0": lambda n: T.Q8_0, "Q4_0": lambda n: T.Q4_0, "Q4_1": lambda n: T.Q4_1, "Q5_1": lambda n: T.Q5_1,
           "Q4_K_M": k_mix, "Q5_K_M": lambda n: k_mix(n, T.Q5_K), "narrow_Q4_K_M": narrow_k_mix}
MIXED = ("Q4_K_M", "Q5_K_M", "narrow_Q4_K_M")  # q/k/v of two formats: a QuantizedStack


def sizes(family: str, fmt: str) -> dict:
    if fmt in ("Q4_K_M", "Q5_K_M"):
        return dict(LARGE)
    return dict(head_dim=32) if family == "qwen3" else {}   # q rows of whole 32-value blocks


def all_logits(model, ids: list[int]) -> torch.Tensor:
    model.allocate_kv_cache(64)
    batch = ForwardBatch.build([(ids, 0, 0)])
    return model(dataclasses.replace(batch, logits_index=torch.arange(len(ids))))


def assert_close(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    scale = theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() <= 1e-5 * scale + 1e-6


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_logits_match_transformers_on_the_encoded_weights(tmp_path, family, fmt):
    path = tmp_path / "m.gguf"
    ref, _ = write_gguf(path, family, FORMATS[fmt], seed=3, **sizes(family, fmt))
    model = load_model(path)
    assert isinstance(model.layers[0].o_weight, QuantizedWeight)
    assert isinstance(model.layers[0].qkv_weight, QuantizedStack if fmt in MIXED else QuantizedWeight)
    ids = torch.randint(0, VOCAB, (13,)).tolist()
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    assert_close(all_logits(model, ids), theirs)


def test_tied_embedding_and_quantization_none(tmp_path):
    path = tmp_path / "tied.gguf"
    ref, _ = write_gguf(path, "llama", lambda n: T.Q8_0, tie=True, seed=5)
    ids = torch.randint(0, VOCAB, (9,)).tolist()
    with torch.no_grad():
        theirs = ref(torch.tensor([ids])).logits[0]
    blocks = load_model(path)
    assert blocks.lm_head is blocks.embed and isinstance(blocks.embed, QuantizedWeight)
    floats = load_model(path, quantization="none")
    assert isinstance(floats.embed, torch.Tensor) and isinstance(floats.layers[1].down_weight, torch.Tensor)
    assert_close(all_logits(blocks, ids), theirs)
    assert_close(all_logits(floats, ids), theirs)


def test_resident_blocks_are_the_files_tensor_bytes(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", k_mix, **LARGE)
    model = load_model(path)
    stored = sum(t.n_bytes for t in gguf.GGUFReader(str(path)).tensors if t.tensor_type not in (T.F32,))
    held = model.embed.nbytes + model.lm_head.nbytes + sum(
        getattr(layer, f).nbytes for layer in model.layers
        for f in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight"))
    assert held == stored


def test_other_quant_types_are_dequantized_with_one_log_line(tmp_path, caplog):
    path = tmp_path / "tq2.gguf"
    ref, _ = write_gguf(path, "qwen2", lambda n: T.TQ2_0 if "ffn_" in n else T.Q8_0, seed=7, **LARGE)
    with caplog.at_level(logging.INFO, logger="orca_ext.models.gguf_loader"):
        model = load_model(path)
    lines = [r.getMessage() for r in caplog.records if "TQ2_0" in r.getMessage()]
    assert len(lines) == 1 and "blk.0.ffn_down.weight" in lines[0] and "blk.1.ffn_up.weight" in lines[0]
    assert isinstance(model.layers[0].gate_up_weight, torch.Tensor)
    assert isinstance(model.layers[0].qkv_weight, QuantizedWeight)
    ids = torch.randint(0, VOCAB, (6,)).tolist()
    with torch.no_grad():
        assert_close(all_logits(model, ids), ref(torch.tensor([ids])).logits[0])


# -- broken files ---------------------------------------------------------------------------------

@pytest.fixture
def good_file(tmp_path) -> Path:
    path = tmp_path / "good.gguf"
    write_gguf(path, "llama", lambda n: T.Q4_1, seed=1)
    return path


def _tensor(path: Path, name: str):
    return next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)


def test_our_reader_reads_what_the_gguf_package_reads():
    """GGUFFile's reader (plain ndarray views over the mapping) gives every metadata field, part
    and tensor of the embedded model's file (a 49k vocabulary and its merges) exactly as the
    `gguf` package's own GGUFReader does."""
    from orca_ext.default_model import default_gguf_path
    from orca_ext.models.gguf_file import GGUFFile

    ours, theirs = GGUFFile(default_gguf_path()).reader, gguf.GGUFReader(default_gguf_path(), "r")
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.offset, mine.data, mine.types) == (field.offset, field.data, field.types), key
        assert len(mine.parts) == len(field.parts), key
        for a, b in zip(mine.parts, field.parts):
            assert a.dtype == b.dtype and np.array_equal(a, b), key
        assert mine.contents() == field.contents(), key
    assert len(ours.tensors) == len(theirs.tensors) > 0
    for a, b in zip(ours.tensors, theirs.tensors):
        assert (a.name, a.tensor_type, a.data_offset, a.n_bytes, a.data.shape, a.data.dtype) == \
               (b.name, b.tensor_type, b.data_offset, b.n_bytes, b.data.shape, b.data.dtype)
        assert np.array_equal(a.data, b.data), a.name


def test_truncated_file_names_the_tensor(good_file):
    last = max(gguf.GGUFReader(str(good_file)).tensors, key=lambda t: t.data_offset)
    data = good_file.read_bytes()
    good_file.write_bytes(data[:-100])
    with pytest.raises(ValueError, match=f"{last.name}.*truncated"):
        load_model(good_file)


def test_unknown_type_names_the_tensor(good_file):
    t = _tensor(good_file, "blk.1.attn_k.weight")
    type_at = t.field.offset + sum(int(p.nbytes) for p in t.field.parts[:4])
    data = bytearray(good_file.read_bytes())
    assert struct.unpack_from("<I", data, type_at)[0] == int(T.Q4_1)
    struct.pack_into("<I", data, type_at, 99)
    good_file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="blk.1.attn_k.weight.*unknown ggml type 99"):
        load_model(good_file)


def test_corrupt_scale_names_the_tensor(good_file):
    t = _tensor(good_file, "blk.0.ffn_up.weight")
    data = bytearray(good_file.read_bytes())
    data[t.data_offset + 20 * 7:t.data_offset + 20 * 7 + 2] = np.float16(np.inf).tobytes()
    good_file.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="blk.0.ffn_up.weight.*non-finite scale in row 2, block 1"):
        load_model(good_file)


def test_shape_mismatch_names_the_tensor(good_file):
    spec = ModelSpec.from_pretrained(good_file)
    with pytest.raises(ValueError, match="blk.0.ffn_gate.weight.*has shape"):
        load_model(good_file, spec=dataclasses.replace(spec, intermediate_size=spec.intermediate_size + 32))


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ValueError, match="junk.gguf"):
        load_model(path)
    with pytest.raises(FileNotFoundError):
        load_model(tmp_path / "missing.gguf")


def test_quantization_option_is_validated():
    assert EngineConfig(quantization="none").quantization == "none"
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")


# -- the quantized forward ------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["Q4_1", "Q4_K_M"])
def test_a_requests_logits_do_not_depend_on_its_batch_mates(tmp_path, fmt):
    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen3", FORMATS[fmt], seed=11, **sizes("qwen3", fmt))
    model = load_model(path)
    model.allocate_kv_cache(192)
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 12, 3))
    with modes.using(batch_invariant=True):
        alone = model(ForwardBatch.build([(a, 0, 0)]))[0]
        alone_next = model(ForwardBatch.build([([5], len(a), 0)]))[0]
        mixed = model(ForwardBatch.build([(b, 0, 0), (a, 0, 64), (c, 0, 128)]))[1]
        mixed_next = model(ForwardBatch.build([([9], len(b), 0), ([5], len(a), 64), ([1, 2], len(c), 128)]))[1]
    assert torch.equal(alone, mixed)
    assert torch.equal(alone_next, mixed_next)


# -- the embedded default model -------------------------------------------------------------------

def test_default_gguf_spec_equals_its_float32_conversion(default_model_dir):
    from orca_ext.default_model import default_gguf_path

    ours = ModelSpec.from_pretrained(default_gguf_path())
    theirs = ModelSpec.from_pretrained(default_model_dir)
    assert dataclasses.replace(ours, eos_token_ids=theirs.eos_token_ids, block_bytes=()) == theirs
    assert set(theirs.eos_token_ids) <= set(ours.eos_token_ids)
    # the file's matrices: Q4_1, and its tied Q8_0 embedding (about 30 MB of 96)
    assert theirs.block_bytes == () and {t for t, _ in ours.block_bytes} == {3, 8}
    assert sum(n for _, n in ours.block_bytes) == sum(int(t.n_bytes) for t in gguf.GGUFReader(default_gguf_path()).tensors
                                                      if int(t.tensor_type) in (3, 8))


def test_default_model_as_q4_1_generates_the_float32_text(default_model_dir):
    from orca_ext import SamplingParams, Server
    from orca_ext.default_model import default_gguf_path

    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with Server(str(default_gguf_path()), device="cpu", n_slots=256) as server:
        assert server.tokenizer.chat_template
        blocks = [o.text for o in server.generate(prompts, params)]
    with Server(str(default_model_dir), device="cpu", n_slots=256) as server:
        floats = [o.text for o in server.generate(prompts, params)]
    assert blocks == floats


# -- parallel shards ------------------------------------------------------------------------------

def _shards(path, tp: int, pp: int = 1):
    from orca_ext.models.sharding import make_shard

    spec = ModelSpec.from_pretrained(path)
    return spec, [load_model(path, spec=spec, shard=make_shard(spec, tp, pp, rank, stage))
                  for stage in range(pp) for rank in range(tp)]


def test_tensor_parallel_shards_keep_blocks_on_block_boundaries(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", lambda n: T.Q4_0, hidden_size=128, intermediate_size=256,
               num_attention_heads=4, num_key_value_heads=2)
    whole = load_model(path)
    spec, ranks = _shards(path, tp=2)
    for rank, model in enumerate(ranks):
        for name, width in (("o_weight", spec.q_size // 2), ("down_weight", spec.intermediate_size // 2)):
            part, full = getattr(model.layers[1], name), getattr(whole.layers[1], name)
            assert isinstance(part, QuantizedWeight) and part.k == width
            assert torch.equal(part.dequantize(), full.dequantize()[:, rank * width:(rank + 1) * width])
        gate_up = model.layers[0].gate_up_weight.dequantize()
        inter, half = spec.intermediate_size, spec.intermediate_size // 2
        full = whole.layers[0].gate_up_weight.dequantize()
        want = torch.cat([full[rank * half:(rank + 1) * half], full[inter + rank * half:inter + (rank + 1) * half]])
        assert torch.equal(gate_up, want)


def test_tensor_parallel_split_inside_a_block_dequantizes_that_share(tmp_path, caplog):
    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", lambda n: T.Q8_0)    # q size 96, intermediate 160: halves of 48 and 80
    whole = load_model(path)
    with caplog.at_level(logging.WARNING, logger="orca_ext.models.gguf_loader"):
        _, ranks = _shards(path, tp=2)
    assert any("block boundaries" in r.getMessage() and "attn_output" in r.getMessage() for r in caplog.records)
    o = ranks[1].layers[0].o_weight
    assert isinstance(o, torch.Tensor) and torch.equal(o, whole.layers[0].o_weight.dequantize()[:, 48:])


def test_pipeline_stages_hold_their_layers_as_blocks(tmp_path):
    path = tmp_path / "m.gguf"
    write_gguf(path, "qwen2", lambda n: T.Q4_1, layers=3)
    _, (first, last) = _shards(path, tp=1, pp=2)
    assert isinstance(first.embed, QuantizedWeight) and first.lm_head is None
    assert last.embed is None and isinstance(last.lm_head, QuantizedWeight)
    assert len(first.layers) + len(last.layers) == 3


def test_a_gguf_served_by_two_pipeline_stages_gives_the_single_process_tokens(tmp_path):
    from orca_ext import SamplingParams, Server

    path = tmp_path / "m.gguf"
    write_gguf(path, "llama", k_mix, layers=3, **LARGE)
    prompts = [[5, 9, 200, 31, 7], [44, 3], list(range(40, 70))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with Server(str(path), device="cpu", max_batch_size=4, n_slots=256) as local:
        assert local.tokenizer is None  # no tokenizer.ggml.* metadata: token-id prompts only
        want = [o.token_ids for o in local.generate(prompts, params)]
    with Server(str(path), device="cpu", max_batch_size=4, n_slots=256, pipeline_parallel_size=2) as server:
        got = [o.token_ids for o in server.generate(prompts, params)]
    assert got == want


def test_quantization_command_line_option():
    import argparse

    from orca_ext.options import add_engine_arguments

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert EngineConfig.from_args(parser.parse_args(["--quantization", "none"])).quantization == "none"
    assert EngineConfig.from_args(parser.parse_args([])).quantization == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "q4"])
