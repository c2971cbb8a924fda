"""Incremental detokenization never shows half a UTF-8 character; the streaming stop-string matcher
agrees with a plain scan of the whole text."""
from __future__ import annotations

import random

import pytest

from orca_ext.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, StopAutomaton, StopMatcher


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


# -- stop strings: plain references over the whole text ------------------------------------------
def find_stop(text: str, stops, search_from: int = 0):
    """Earliest-starting occurrence of any stop string that ends after `search_from` (index or None)."""
    best = None
    for s in stops:
        idx = text.find(s, max(0, search_from - len(s) + 1))
        if idx != -1 and (best is None or idx < best):
            best = idx
    return best


def partial_stop_len(text: str, stops) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    return max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1)
                if text.endswith(s[:n])), default=0)


def run_matcher(chunks, stops):
    """Feed growing text chunk by chunk; (hit index or None, held-back length) after each chunk,
    stopping at the first hit as the engine does."""
    matcher, text, got = StopMatcher(StopAutomaton(stops)), "", []
    for chunk in chunks:
        text += chunk
        hit = matcher.feed(text)
        got.append((hit, matcher.held if hit is None else None))
        if hit is not None:
            break
    return got


def reference(chunks, stops):
    text, searched, got = "", 0, []
    for chunk in chunks:
        text += chunk
        hit = find_stop(text, stops, searched)
        searched = len(text)
        got.append((hit, partial_stop_len(text, stops) if hit is None else None))
        if hit is not None:
            break
    return got


def test_matcher_reports_the_earliest_stop_ending_in_the_new_text():
    assert run_matcher(["hello world"], ["wor", "lo"]) == [(3, None)]
    assert run_matcher(["hello world"], ["xyz"]) == [(None, 0)]
    # a stop straddling two feeds is found; one wholly in earlier text was already reported
    assert run_matcher(["abcST", "OPdef"], ["STOP"]) == [(None, 2), (3, None)]
    # one feed holding two stops: the earliest start wins even if it ends later
    assert run_matcher(["xabcd"], ["abcd", "c"]) == [(1, None)]


@pytest.mark.parametrize("text, stops, want", [
    ("hello wo", ["world"], 2),
    ("hello w", ["world", "w!"], 1),
    ("hello", ["world"], 0),
    ("abcab", ["abcabd"], 5),
])
def test_held_back_tail(text, stops, want):
    assert run_matcher([text], stops) == [(None, want)]


def test_matcher_equals_the_plain_scan_on_random_streams():
    """A small alphabet makes overlapping, nested and repeated stops common."""
    rng = random.Random(5)
    for _ in range(400):
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]
        chunks = ["".join(rng.choice("abcd") for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 12))]
        assert run_matcher(chunks, stops) == reference(chunks, stops), (stops, chunks)


def test_automaton_rejects_empty_stop_lists():
    with pytest.raises(ValueError):
        StopAutomaton([])
    with pytest.raises(ValueError):
        StopAutomaton(["ok", ""])
