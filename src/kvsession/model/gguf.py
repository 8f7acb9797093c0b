"""GGUF files: the reader, checked metadata and tensors, dequantization.

The `gguf` package (llama.cpp's own Python reader) memory maps the file and
reads its tensor table; the metadata is read here, in one pass (_Reader).
This module validates what it found before anyone uses it, names the file
and the field in every error, and turns tensors into numpy arrays:

- `dequantize(tensor)`: any type `gguf.quants` can dequantize, as float32
  (Q8_0 and Q5_0 by a faster path with the same values);
- (the model multiplies most weights without it, straight from their
  blocks: kernels/__init__.py).

What the metadata means, architecture by architecture, is archs.py's; the
fingerprint built from the config and the weights' digest, fingerprint.py's.
"""
from __future__ import annotations

import logging
import os
import struct
import sys
from functools import cached_property
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import xxhash

from ..errors import (
    CorruptModelFile,
    MissingTensor,
    ModelNotFound,
    NotGGUF,
    UnsupportedTensorType,
)
from .archs import check_arch, model_config
from .fingerprint import Fingerprint, cached_digest

log = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType

def supported_tensor_types() -> set[Q]:
    """Every type `dequantize` accepts: the float types plus gguf.quants' table."""
    return {Q.F32, Q.F16} | set(gguf.quants._type_traits)


class GGUFFile:
    """A parsed, validated GGUF file. Tensor data stays memory-mapped."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.reader = _open_reader(self.path)
        self.arch = self._arch()
        self.tensors: dict[str, gguf.ReaderTensor] = {t.name: t for t in self.reader.tensors}
        self._check_tensors()
        self.config = model_config(self)

    # --- metadata ----------------------------------------------------------

    def meta(self, key: str, default: Any = None) -> Any:
        value = self.reader.values.get(key)
        if value is None:
            return default
        if isinstance(value, _Unreadable):
            raise CorruptModelFile(f"{self.path}: metadata field {key!r} is unreadable ({value.error})")
        return value

    def require(self, key: str) -> Any:
        value = self.meta(key)
        if value is None:
            raise CorruptModelFile(f"{self.path}: required metadata field {key!r} is missing")
        return value

    def _arch(self) -> str:
        arch = self.require("general.architecture")
        check_arch(arch, str(self.path))
        return arch

    # --- tensors -----------------------------------------------------------

    def _check_tensors(self) -> None:
        size = self.path.stat().st_size
        ok = supported_tensor_types()
        for t in self.reader.tensors:
            end = t.data_offset + t.n_bytes
            if end > size:
                raise CorruptModelFile(f"{self.path}: truncated: tensor {t.name} ends at byte {end}, file has {size}")
            if t.tensor_type not in ok:
                raise UnsupportedTensorType(
                    f"{self.path}: tensor {t.name} has type {t.tensor_type.name}, which cannot be dequantized"
                )

    def tensor(self, name: str) -> gguf.ReaderTensor:
        t = self.tensors.get(name)
        if t is None:
            raise MissingTensor(f"{self.path}: tensor {name!r} is missing")
        return t

    @cached_property
    def fingerprint(self) -> Fingerprint:
        return Fingerprint(kv_shape=self.config.kv_shape(), weights=cached_digest(self.path, self.weights_digest))

    def weights_digest(self) -> str:
        """xxh3-128 over every tensor's name, type, shape and bytes, in file order."""
        h = xxhash.xxh3_128()
        for t in self.reader.tensors:
            h.update(f"{t.name}:{t.tensor_type.value}:{list(map(int, t.shape))};".encode())
            h.update(memoryview(np.ascontiguousarray(t.data)).cast("B"))
        return h.hexdigest()


def dequantize(t: gguf.ReaderTensor) -> np.ndarray:
    """A tensor as float32, shaped [ne1, ne0] (a Linear weight: [out, in])."""
    return dequantize_rows(t.data, t.tensor_type)


def dequantize_rows(data: np.ndarray, qtype: Q) -> np.ndarray:
    """Rows of a tensor's data (as GGUFReader shapes it) as float32 [rows, values]: bit for bit what
    gguf.quants.dequantize gives, through a whole-array path for Q8_0 and Q5_0 (gguf.quants cuts its work
    into groups of a few rows; on Qwen2.5-Coder-0.5B, mostly Q5_0 and Q8_0, that was 2 s of a 4.5 s load)."""
    fast = _FAST_DEQUANT.get(qtype)
    if fast is None:
        return np.asarray(gguf.quants.dequantize(data, qtype), dtype=np.float32)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    shape = (*data.shape[:-1], data.shape[-1] // size * block)
    return fast(np.ascontiguousarray(data).reshape(-1, size)).reshape(shape)


def _q8_0(blocks: np.ndarray) -> np.ndarray:
    out = blocks[:, 2:].view(np.int8).astype(np.float32)
    out *= blocks[:, :2].copy().view(np.float16).astype(np.float32)
    return out


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    """22-byte blocks: an f16 scale, 32 high bits, 16 bytes of low nibbles; value j = d * (q_j - 16)."""
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)
    qh = blocks[:, 2:6].copy().view("<u4")  # [n, 1]
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4  # [n, 32]
    qs = blocks[:, 6:]
    high |= np.concatenate([qs & 0x0F, qs >> 4], axis=1)
    out = high.view(np.int8).astype(np.float32)
    out -= 16
    out *= d
    return out


_FAST_DEQUANT = {Q.Q8_0: _q8_0, Q.Q5_0: _q5_0}


V = gguf.GGUFValueType
_SCALAR_DTYPES = {V.UINT8: "<u1", V.INT8: "<i1", V.UINT16: "<u2", V.INT16: "<i2", V.UINT32: "<u4", V.INT32: "<i4",
                  V.FLOAT32: "<f4", V.UINT64: "<u8", V.INT64: "<i8", V.FLOAT64: "<f8", V.BOOL: "?"}


class _Unreadable:
    """A metadata value that could not be decoded: an error when it is asked for, not when the file opens."""

    def __init__(self, error: Exception):
        self.error = error


class _Reader(gguf.GGUFReader):
    """GGUFReader with the metadata read in one pass into plain values (`values`).

    The gguf reader builds a numpy view per value: three per string of a
    vocabulary, 1.5 million for Qwen2.5's 151k tokens and 151k merges, which
    took ~2 s of a 4.5 s load (Gemma's 262k tokens: ~3 s). Here a string is
    one slice of the header's bytes and a numeric array one frombuffer.
    Only scalar fields stay in `fields` (the reader checks general.alignment
    there); the tensors are the gguf reader's own. Big-endian files take the
    gguf reader's way.
    """

    @property
    def data(self) -> np.ndarray:
        return self._data

    @data.setter
    def data(self, value: np.ndarray) -> None:
        # a plain ndarray view of the mapping: on an np.memmap every slice pays memmap's bookkeeping
        self._data = value.view(np.ndarray)

    def _build_fields(self, offs: int, count: int) -> int:
        if self.byte_order != "I" or sys.byteorder != "little":
            offs = super()._build_fields(offs, count)
            self.values = {k: f.contents() for k, f in self.fields.items() if not k.startswith("GGUF.")}
            return offs
        self._mv = memoryview(self._data)
        self.values: dict[str, Any] = {}
        for _ in range(int(count)):
            start = offs
            key, offs = self._string(offs)
            if isinstance(key, _Unreadable):
                raise ValueError(f"a metadata key at byte {start} is not UTF-8")
            (kind,) = struct.unpack_from("<I", self._mv, offs)
            value, offs = self._value(offs + 4, kind)
            if key in self.values:
                raise KeyError(f"duplicate metadata key {key!r}")
            self.values[key] = value
            if kind in _SCALAR_DTYPES:
                self.fields[key] = gguf.ReaderField(start, key, [np.array([value], dtype=_SCALAR_DTYPES[kind])], [0],
                                                    [V(kind)])
        del self._mv
        return offs

    def _string(self, offs: int) -> tuple[str | _Unreadable, int]:
        (n,) = struct.unpack_from("<Q", self._mv, offs)
        end = offs + 8 + n
        if end > len(self._mv):
            raise ValueError(f"a string at byte {offs} runs past the end of the file")
        try:
            return str(self._mv[offs + 8 : end], "utf-8"), end
        except UnicodeDecodeError as e:
            return _Unreadable(e), end

    def _value(self, offs: int, kind: int) -> tuple[Any, int]:
        if kind == V.STRING:
            return self._string(offs)
        dtype = _SCALAR_DTYPES.get(kind)
        if dtype is not None:
            dtype = np.dtype(dtype)
            if offs + dtype.itemsize > len(self._mv):
                raise ValueError(f"a value at byte {offs} runs past the end of the file")
            return np.frombuffer(self._data, dtype, 1, offs)[0].item(), offs + dtype.itemsize
        if kind != V.ARRAY:
            raise ValueError(f"unknown metadata value type {kind} at byte {offs}")
        item, n = struct.unpack_from("<IQ", self._mv, offs)
        offs += 12
        dtype = _SCALAR_DTYPES.get(item)
        if dtype is not None:
            size = np.dtype(dtype).itemsize
            if offs + n * size > len(self._mv):
                raise ValueError(f"an array of {n} values at byte {offs} runs past the end of the file")
            return np.frombuffer(self._data, dtype, n, offs).tolist(), offs + n * size
        out = []
        for _ in range(n):
            value, offs = self._value(offs, item)
            if isinstance(value, _Unreadable):
                return value, self._skip(offs, item, n - len(out) - 1)
            out.append(value)
        return out, offs

    def _skip(self, offs: int, item: int, n: int) -> int:
        """The offset after n more values of an array whose values are not read (one was not UTF-8)."""
        for _ in range(n):
            offs = self._value(offs, item)[1]
        return offs


def _open_reader(path: Path) -> gguf.GGUFReader:
    if not path.exists():
        raise ModelNotFound(f"{path}: no such file")
    if path.is_dir():
        raise NotGGUF(f"{path}: is a folder, not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise NotGGUF(f"{path}: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        return _Reader(path)
    except (ValueError, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError, struct.error,
            RecursionError) as e:  # RecursionError: arrays of arrays nested thousands deep
        raise CorruptModelFile(f"{path}: truncated or corrupt GGUF header ({e})") from e


