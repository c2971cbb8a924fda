"""A GGUF file opened for loading: its metadata and its tensors' raw bytes, checked.

Parsing is the `gguf` package's (GGUFReader, a read-only memory map). Everything the reader does
not check is checked here, so that a broken file gives a ValueError naming the file and the
tensor instead of a crash or garbage weights: the file must open and parse, every tensor's bytes
must lie inside the file and match its shape and type, and (for the served block formats) every
block's float16 scales must be finite.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from ..quant.formats import FORMATS, QType

log = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
_MISSING = object()

# Byte offsets of the float16 scale fields inside one block, per served format.
_SCALE_OFFSETS = {QType.Q8_0: (0,), QType.Q4_0: (0,), QType.Q4_1: (0, 2), QType.Q5_0: (0,), QType.Q5_1: (0, 2),
                  QType.Q4_K: (0, 2), QType.Q5_K: (0, 2), QType.Q6_K: (208,)}


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its suffix; the folder loader takes everything else)."""
    return str(path).lower().endswith(GGUF_SUFFIX)


def _checked_reader_class():
    """GGUFReader with each tensor's header checked before the reader maps it: the reader itself
    fails on an unknown type or a truncated file with an error that names no tensor. Its views
    of the file are plain ndarrays (see _get)."""
    import gguf

    class CheckedReader(gguf.GGUFReader):
        def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
            # GGUFReader._get's view, taken of a plain ndarray over the mapping: every view of
            # the np.memmap subclass runs memmap's Python __array_finalize__, and the reader
            # takes one per metadata value (two per token and merge string: millions for a
            # 128k vocabulary), which made opening a file take seconds (3.5x as long).
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

        def _build_tensors(self, start_offs: int, fields) -> None:
            size = len(self.data)
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                where = f"{Path(self.data.filename)}: tensor {name!r}"
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise ValueError(f"{where} has unknown ggml type {int(raw_dtype[0])}") from None
                block, type_size = gguf.GGML_QUANT_SIZES[qtype]
                if not len(dims) or int(dims[0]) % block:
                    raise ValueError(f"{where}: its rows of {dims.tolist()[:1]} values are not whole "
                                     f"{qtype.name} blocks of {block}")
                end = int(start_offs + offset[0]) + int(np.prod(dims.astype(np.int64))) // block * type_size
                if end > size:
                    raise ValueError(f"{where} needs bytes up to {end} but the file has {size}; it is truncated")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


class GGUFFile:
    """Metadata fields and named tensors of one GGUF file."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {self.path} does not exist")
        try:
            self.reader = _checked_reader_class()(str(self.path), "r")
        except ValueError as exc:
            if str(exc).startswith(str(self.path)):  # ours: names the tensor already
                raise
            raise ValueError(f"{self.path}: not a readable GGUF file ({exc})") from exc
        except Exception as exc:  # the reader raises ValueError/KeyError/IndexError/... on bad input
            raise ValueError(f"{self.path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        self.size = self.path.stat().st_size
        self.tensors: dict[str, Any] = {t.name: t for t in self.reader.tensors}
        arch = self.field("general.architecture", None)
        if not isinstance(arch, str):
            raise ValueError(f"{self.path}: general.architecture is missing")
        self.architecture = arch

    def field(self, key: str, default: Any = _MISSING) -> Any:
        """The metadata value `key` (a str, number or list), else `default` (ValueError without one)."""
        f = self.reader.fields.get(key)
        if f is None:
            if default is _MISSING:
                raise ValueError(f"{self.path}: metadata {key!r} is missing")
            return default
        try:
            return f.contents()
        except Exception as exc:
            raise ValueError(f"{self.path}: metadata {key!r} is unreadable ({exc})") from exc

    def arch_field(self, key: str, default: Any = _MISSING) -> Any:
        """The field `<architecture>.<key>`."""
        return self.field(f"{self.architecture}.{key}", default)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def block_bytes(self) -> dict[int, int]:
        """Bytes of the tensors in each served block format (ggml type id -> bytes), read from the
        headers alone: what a model loaded with quantization="auto" keeps as blocks."""
        total: dict[int, int] = {}
        for t in self.reader.tensors:
            if int(t.tensor_type) in FORMATS:
                total[int(t.tensor_type)] = total.get(int(t.tensor_type), 0) + int(t.n_bytes)
        return total

    def tensor_type(self, name: str) -> int:
        return int(self._tensor(name).tensor_type)

    def raw(self, name: str, shape: tuple[int, ...]) -> tuple[int, np.ndarray]:
        """(ggml type id, the stored array) of tensor `name`, whose logical shape (Hugging Face
        order: rows first) must be `shape`. Quantized types give uint8 [rows, row_bytes]; the
        array is a view of the file's mapping."""
        t = self._tensor(name)
        stored = tuple(int(d) for d in reversed(t.shape.tolist()))  # ggml lists ne0 (the row length) first
        if stored != tuple(shape):
            raise ValueError(f"{self.path}: tensor {name!r} has shape {stored}, expected {tuple(shape)} "
                             f"from the file's metadata")
        end = int(t.data_offset) + int(t.n_bytes)
        if end > self.size:
            raise ValueError(f"{self.path}: tensor {name!r} needs bytes up to {end} but the file has "
                             f"{self.size}; it is truncated")
        data = t.data
        qtype = int(t.tensor_type)
        try:
            fmt = FORMATS[QType(qtype)]
        except ValueError:
            fmt = None
        if fmt is not None:
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            want = (rows, fmt.row_bytes(shape[-1]) if shape[-1] % fmt.block_size == 0 else -1)
            if data.dtype != np.uint8 or want[1] < 0 or data.size != want[0] * want[1]:
                raise ValueError(f"{self.path}: tensor {name!r} ({fmt.qtype.name}) holds {data.nbytes} bytes, "
                                 f"which is not {shape} in {fmt.block_size}-value blocks")
            data = data.reshape(want)
            self._check_scales(name, data, fmt.qtype)
        return qtype, data

    def _check_scales(self, name: str, data: np.ndarray, qtype: QType) -> None:
        fmt = FORMATS[qtype]
        blocks = data.reshape(data.shape[0], -1, fmt.bytes_per_block)
        for off in _SCALE_OFFSETS[qtype]:
            scales = np.ascontiguousarray(blocks[..., off:off + 2]).view(np.float16)
            if not np.isfinite(scales).all():
                bad = np.argwhere(~np.isfinite(scales.reshape(data.shape[0], -1)))[0]
                raise ValueError(f"{self.path}: tensor {name!r} ({qtype.name}) has a non-finite scale in "
                                 f"row {int(bad[0])}, block {int(bad[1])}; the data is corrupt")

    def _tensor(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            raise ValueError(f"{self.path}: tensor {name!r} is missing")
        return t

    def close(self) -> None:
        """Drop the mapping (its pages stop counting towards this process's memory)."""
        self.tensors = {}
        self.reader = None
