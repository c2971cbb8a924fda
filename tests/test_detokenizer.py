"""Incremental detokenization never shows half a UTF-8 character; stop-string helpers."""
from __future__ import annotations

import random

import pytest

from orca_ext.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, find_stop, partial_stop_len


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level BPE tokenizer with a few merges: every non-ASCII character spans several
    tokens, so decoding a prefix of a token sequence often ends in U+FFFD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ã", "©")]  # "Ã©" is the byte pair of é
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


TEXTS = [
    "the café serves crème brûlée",
    "naïve 日本語のテキスト and the end",
    "emoji 🦙🚀 mixed with ascii, then ß and €",
    "👩‍👩‍👧 family, 𝕏 math, ok",
]


@pytest.mark.parametrize("text", TEXTS)
def test_stream_never_shows_half_a_character(byte_tokenizer, text):
    prompt = byte_tokenizer.encode("Q: ")
    ids = byte_tokenizer.encode(text)
    pieces = [byte_tokenizer.decode([i]) for i in ids]
    assert any(REPLACEMENT_CHAR in p for p in pieces), "the tokenizer must split a character"
    detok = IncrementalDetokenizer(byte_tokenizer, prompt)
    shown = []
    held = 0
    for i in ids:
        delta = detok.add(i)
        held += delta == ""
        assert REPLACEMENT_CHAR not in delta
        assert detok.text == "".join(shown) + delta
        shown.append(delta)
    assert held > 0  # some tokens completed no character and were held back
    assert detok.flush() == ""
    assert detok.text == text == byte_tokenizer.decode(ids)


def test_random_token_streams_match_full_decode(byte_tokenizer):
    rng = random.Random(5)
    text = "".join(rng.choice("aé日🦙 ß€x") for _ in range(200))
    ids = byte_tokenizer.encode(text)
    detok = IncrementalDetokenizer(byte_tokenizer, [])
    for i in ids:
        assert REPLACEMENT_CHAR not in detok.add(i)
        assert text.startswith(detok.text)
    assert detok.text == text


def test_flush_emits_an_incomplete_trailing_character(byte_tokenizer):
    ids = byte_tokenizer.encode("ok 🦙")
    detok = IncrementalDetokenizer(byte_tokenizer, [])
    for i in ids[:-2]:  # cut the 4-byte emoji in half
        detok.add(i)
    assert detok.text == "ok "
    assert detok.flush() == REPLACEMENT_CHAR  # the two stray bytes decode to one U+FFFD
    assert detok.text == "ok " + REPLACEMENT_CHAR


def test_prompt_context_keeps_the_first_tokens_leading_space(byte_tokenizer):
    prompt = byte_tokenizer.encode("say")
    gen = byte_tokenizer.encode(" the thing")
    detok = IncrementalDetokenizer(byte_tokenizer, prompt)
    for i in gen:
        detok.add(i)
    assert detok.text == byte_tokenizer.decode(prompt + gen)[len("say"):] == " the thing"


def test_real_tokenizer_splits_and_resolves(byte_tokenizer):
    """The SmolLM2 tokenizer (byte-level BPE) through the same path, when the default model exists."""
    try:
        from orca_ext.default_model import default_model_path
        from orca_ext.models import load_tokenizer

        tok = load_tokenizer(default_model_path())
    except Exception as exc:  # pragma: no cover - only without the default model
        pytest.skip(f"default model unavailable: {exc}")
    text = "Grüße 🦙 日本 — done"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    for i in ids:
        assert REPLACEMENT_CHAR not in detok.add(i)
    detok.flush()
    assert detok.text == tok.decode(ids)


def test_find_stop_reports_the_earliest_stop_after_the_searched_prefix():
    assert find_stop("hello world", ["wor", "lo"]) == (3, "lo")
    assert find_stop("hello world", ["xyz"]) is None
    # only matches that end after `search_from` count; a stop straddling it is found
    assert find_stop("abcSTOPdef", ["STOP"], search_from=5) == (3, "STOP")
    assert find_stop("STOPabcdefgh", ["STOP"], search_from=8) is None


@pytest.mark.parametrize("text, stops, want", [
    ("hello wo", ["world"], 2),
    ("hello w", ["world", "w!"], 1),
    ("hello", ["world"], 0),
    ("abcab", ["abcabd"], 5),
    ("xxab", ["abc", "b"], 2),  # "b" itself would be a full match, handled by find_stop
])
def test_partial_stop_len(text, stops, want):
    assert partial_stop_len(text, stops) == want
