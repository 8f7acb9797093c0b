"""GGUF files: metadata to a typed ModelConfig, tensors to arrays, a fingerprint.

The `gguf` package (llama.cpp's own Python reader) memory maps the file and
reads its tensor table; the metadata is read here, in one pass (_Reader).
This module validates what it found before anyone uses it, names the file
and the field in every error, and turns tensors into numpy arrays:

- `dequantize(tensor)`: any type `gguf.quants` can dequantize, as float32
  (Q8_0 and Q5_0 by a faster path with the same values);
- (the model multiplies most weights without it, straight from their
  blocks: kernels.py).

The fingerprint (architecture, every KV-shaping hyperparameter, a digest of
the weights) is what session files carry to refuse the wrong model. Hashing a
large file costs a full read, so the digest is cached per file, keyed by path,
size, inode and modification time.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import dataclasses
import struct
import sys
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import xxhash

from .config import LayerSpec, ModelConfig, RopeConfig, RopeKind, YarnConfig
from .errors import (
    CorruptModelFile,
    MissingTensor,
    ModelNotFound,
    NotGGUF,
    UnsupportedArchitecture,
    UnsupportedTensorType,
)

log = logging.getLogger(__name__)

Q = gguf.GGMLQuantizationType

# Architectures and how llama.cpp rotates their heads (llama_model_rope_type).
# Mistral's GGUF files are written with general.architecture = "llama", and so are Llama 3.1's and 3.2's,
# whose "llama3" rope scaling the converter writes as a rope_freqs tensor.
ROPE_KIND: dict[str, RopeKind] = {"llama": "norm", "qwen2": "neox", "qwen3": "neox", "qwen3moe": "neox",
                                  "gemma2": "neox", "gemma3": "neox", "smollm3": "norm", "granite": "norm",
                                  "olmo2": "neox", "phi3": "neox", "gpt-oss": "neox"}

# SmolLM3 leaves RoPE out of every fourth layer (llama.cpp: n_no_rope_layer_step, not in the file)
SMOLLM3_NO_ROPE_STEP = 4
SUPPORTED_ARCHS = tuple(ROPE_KIND)

def supported_tensor_types() -> set[Q]:
    """Every type `dequantize` accepts: the float types plus gguf.quants' table."""
    return {Q.F32, Q.F16} | set(gguf.quants._type_traits)


@dataclass(frozen=True)
class Fingerprint:
    """What a KV cache row depends on: the KV shape and the exact weights."""

    kv_shape: dict  # ModelConfig.kv_shape()
    weights: str  # xxh3-128 hex digest of the tensor infos and tensor data

    @cached_property
    def digest(self) -> str:
        blob = json.dumps({"kv_shape": self.kv_shape, "weights": self.weights}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:32]

    def to_dict(self) -> dict:
        return {"kv_shape": self.kv_shape, "weights": self.weights}

    @classmethod
    def from_dict(cls, d: dict) -> "Fingerprint":
        return cls(kv_shape=d["kv_shape"], weights=d["weights"])


class GGUFFile:
    """A parsed, validated GGUF file. Tensor data stays memory-mapped."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.reader = _open_reader(self.path)
        self.arch = self._arch()
        self.tensors: dict[str, gguf.ReaderTensor] = {t.name: t for t in self.reader.tensors}
        self._check_tensors()
        self.config = self._config()

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
        if arch not in ROPE_KIND:
            raise UnsupportedArchitecture(
                f"{self.path}: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHS)}"
            )
        return arch

    def _config(self) -> ModelConfig:
        a = self.arch
        d_model = int(self.require(f"{a}.embedding_length"))
        n_heads = int(self.require(f"{a}.attention.head_count"))
        n_kv_heads = self.meta(f"{a}.attention.head_count_kv", n_heads)
        if isinstance(n_kv_heads, list):  # per-layer counts; ours are uniform
            if len(set(n_kv_heads)) != 1:
                raise UnsupportedArchitecture(f"{self.path}: per-layer kv head counts {sorted(set(n_kv_heads))}")
            n_kv_heads = n_kv_heads[0]
        head_dim = int(self.meta(f"{a}.attention.key_length", d_model // n_heads))
        value_dim = int(self.meta(f"{a}.attention.value_length", head_dim))
        if value_dim != head_dim:
            raise UnsupportedArchitecture(f"{self.path}: key length {head_dim} != value length {value_dim}")
        context_length = int(self.meta(f"{a}.context_length", 2048))
        rope = RopeConfig(
            kind=ROPE_KIND[a],
            base=float(self.meta(f"{a}.rope.freq_base", 10000.0)),
            dim=int(self.meta(f"{a}.rope.dimension_count", head_dim)),
            **self._rope_scaling(context_length),
            has_freq_factors=self.rope_factors() is not None,
            attn_factor=float(self.meta(f"{a}.rope.scaling.attn_factor", 1.0)),
        )
        n_layers = int(self.require(f"{a}.block_count"))
        tokens = self.meta("tokenizer.ggml.tokens")
        vocab = int(self.meta(f"{a}.vocab_size", len(tokens) if tokens else 0))
        emb = self.tensor("token_embd.weight")
        if int(emb.shape[0]) != d_model or int(emb.shape[1]) != vocab:
            raise CorruptModelFile(
                f"{self.path}: token_embd.weight is {list(map(int, emb.shape))}, expected [{d_model}, {vocab}]"
            )
        common = dict(
            arch=a,
            n_layers=n_layers,
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(n_kv_heads),
            head_dim=head_dim,
            d_ff=int(self.require(f"{a}.feed_forward_length")),
            vocab_size=vocab,
            context_length=context_length,
            rms_eps=float(self.meta(f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
            tied_embeddings="output.weight" not in self.tensors,
            attn_bias="blk.0.attn_q.bias" in self.tensors,
        )
        if a in ("gemma2", "gemma3"):
            return ModelConfig(**common, **self._gemma(n_layers, d_model, n_heads, head_dim, rope))
        layers = tuple(LayerSpec("full", 0, rope) for _ in range(n_layers))
        if a == "qwen3":  # qwen2 without biases, each head of q and k RMS-normed before RoPE (models/qwen3.cpp)
            return ModelConfig(**common, layers=layers, qk_norm=True)
        if a == "qwen3moe":  # qwen3's attention; routed experts, softmax gating, top-k weights normalised
            n_experts, used = int(self.require(f"{a}.expert_count")), int(self.require(f"{a}.expert_used_count"))
            if not 0 < used <= n_experts:
                raise CorruptModelFile(f"{self.path}: {used} of {n_experts} experts used a token")
            # an expert's width is its tensors' (expert_feed_forward_length says it again)
            return ModelConfig(**common, layers=layers, qk_norm=True, n_experts=n_experts, n_experts_used=used,
                               expert_norm=True)
        if a == "smollm3":  # the layers (i + 1) % 4 == 0 attend without RoPE (models/smollm3.cpp)
            plain = dataclasses.replace(rope, base=0.0)
            layers = tuple(LayerSpec("full", 0, plain if (i + 1) % SMOLLM3_NO_ROPE_STEP == 0 else rope)
                           for i in range(n_layers))
            return ModelConfig(**common, layers=layers, attn_scale=float(self.meta("smollm3.attention.scale", 0.0)))
        if a == "olmo2":  # no norm before attention or the FFN, one after each; q and k normed across heads
            window = int(self.meta("olmo2.attention.sliding_window", 0) or 0)
            if window > 0:  # OLMo 3: three of four layers slide, with a plain RoPE of the global base (olmo2.cpp)
                layers = self._sliding(self.meta("olmo2.attention.sliding_window_pattern", 4), window,
                                       RopeConfig(rope.kind, rope.base, rope.dim), rope)
            return ModelConfig(**common, layers=layers, qk_norm=True, qk_norm_full=True, post_norms=True,
                               pre_norms=False)
        if a == "phi3":  # fused q|k|v and gate|up tensors (model.py splits them); partial RoPE where dim < head
            # llama.cpp ignores phi3's sliding window (llama-model.cpp: "Phi SWA is currently disabled"): so do we
            return ModelConfig(**common, layers=layers)
        if a == "gpt-oss":  # models/openai-moe.cpp: every other layer slides; sinks; biased, clamped experts
            layers = self._sliding(self.meta(f"{a}.attention.sliding_window_pattern", 2),
                                   int(self.require(f"{a}.attention.sliding_window")), rope, rope)
            n_experts, used = int(self.require(f"{a}.expert_count")), int(self.require(f"{a}.expert_used_count"))
            if not 0 < used <= n_experts:
                raise CorruptModelFile(f"{self.path}: {used} of {n_experts} experts used a token")
            return ModelConfig(**common, layers=layers, n_experts=n_experts, n_experts_used=used,
                               expert_gating="softmax_weight", activation="swiglu_oai", attn_sinks=True)
        if a == "granite":  # four multipliers on the llama graph (models/granite.cpp)
            return ModelConfig(**common, layers=layers,
                               embed_scale=float(self.meta("granite.embedding_scale", 0.0)) or 1.0,
                               attn_scale=float(self.meta("granite.attention.scale", 0.0)),
                               residual_scale=float(self.meta("granite.residual_scale", 0.0)),
                               logit_scale=float(self.require("granite.logit_scale")))
        return ModelConfig(**common, layers=layers)

    def _gemma(self, n_layers: int, d_model: int, n_heads: int, head_dim: int, rope: RopeConfig) -> dict:
        """What llama.cpp's gemma2 and gemma3 graphs do beyond the llama family (models/gemma2.cpp, gemma3.cpp):
        sliding-window layers (gemma2: every other one, a window of 4096 by default), post-norms, scaled
        embeddings, GELU; gemma3 norms q and k, gemma2 soft-caps the attention scores."""
        a = self.arch
        two = a == "gemma2"
        window = int(self.meta(f"{a}.attention.sliding_window", 4096 if two else 0) or 0)
        local_rope = RopeConfig("neox", float(self.meta(f"{a}.rope.freq_base_swa", rope.base if two else 10000.0)),
                                rope.dim)
        layers = self._sliding(self.meta(f"{a}.attention.sliding_window_pattern", 2 if two else 6), window,
                               local_rope, rope)
        # gemma_pytorch scales queries by 1/sqrt(d_model / n_heads) in the 27B models only
        attn_scale = (d_model / n_heads) ** -0.5 if n_layers == (46 if two else 62) else head_dim ** -0.5
        softcaps = dict(final_softcap=float(self.meta(f"{a}.final_logit_softcapping", 30.0 if two else 0.0) or 0.0),
                        attn_softcap=float(self.meta(f"{a}.attn_logit_softcapping", 50.0) or 0.0) if two else 0.0)
        return dict(layers=layers, attn_scale=attn_scale, embed_scale=float(np.sqrt(np.float32(d_model))),
                    qk_norm=not two, post_norms=True, activation="gelu_tanh", **softcaps)

    def _sliding(self, pattern: Any, window: int, local: RopeConfig, rope: RopeConfig) -> tuple[LayerSpec, ...]:
        """Layer specs where some layers attend to the last `window` tokens only (with their own RoPE): as
        llama.cpp's load_swa_pattern reads the file's pattern, a per-layer flag list or every n-th layer global."""
        n_layers = int(self.require(f"{self.arch}.block_count"))
        if isinstance(pattern, list):
            sliding = [bool(x) for x in pattern][:n_layers]
        else:  # every n-th layer is global, the others slide (set_swa_pattern)
            n = int(pattern)
            sliding = [n == 0 or i % n < n - 1 for i in range(n_layers)]
        return tuple(LayerSpec("sliding", window, local) if window > 0 and sliding[i] else LayerSpec("full", 0, rope)
                     for i in range(n_layers))

    def _rope_scaling(self, context_length: int) -> dict:
        """RopeConfig's linear_scale and yarn, as llama.cpp reads rope.scaling.* (llama-model.cpp, -context.cpp)."""
        a = self.arch
        kind = self.meta(f"{a}.rope.scaling.type", "none")
        if kind in ("none", ""):
            return dict(linear_scale=float(self.meta(f"{a}.rope.scale_linear", 1.0)))
        if kind == "linear":
            return dict(linear_scale=float(self.require(f"{a}.rope.scaling.factor")))
        if kind == "yarn":  # llama.cpp reads no beta or ext_factor from a file: its defaults are YarnConfig's
            if self.meta(f"{a}.rope.scaling.yarn_log_multiplier"):
                raise UnsupportedArchitecture(f"{self.path}: YaRN with a log multiplier (DeepSeek's) is not "
                                              "supported; plain YaRN is")
            yarn = YarnConfig(orig_context=int(self.meta(f"{a}.rope.scaling.original_context_length", context_length)))
            return dict(linear_scale=float(self.meta(f"{a}.rope.scaling.factor", 0.0) or 1.0), yarn=yarn)
        raise UnsupportedArchitecture(f"{self.path}: rope scaling {kind!r} is not supported; linear and yarn are")

    def rope_factors(self) -> str | None:
        """The tensor that divides each RoPE frequency, if the file has one: Llama 3's rope_freqs, or of LongRoPE's
        two (phi3) the long factors where the model's context passes the one they were trained for, as llama.cpp
        chooses them for a context of the model's full length (get_rope_factors), else the short ones."""
        if "rope_freqs.weight" in self.tensors:
            return "rope_freqs.weight"
        if "rope_factors_long.weight" not in self.tensors:
            return None
        a = self.arch
        context = int(self.meta(f"{a}.context_length", 2048))
        long = context > int(self.meta(f"{a}.rope.scaling.original_context_length", context))
        return "rope_factors_long.weight" if long else "rope_factors_short.weight"

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
        return Fingerprint(kv_shape=self.config.kv_shape(), weights=_cached_weights_digest(self))

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


# --- digest cache ------------------------------------------------------------


def cache_dir() -> Path:
    root = os.environ.get("KVSESSION_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvsession"
    )
    return Path(root)


_digests: dict[tuple, str] = {}


def _cached_weights_digest(f: GGUFFile) -> str:
    st = f.path.stat()
    real = os.path.realpath(f.path)
    key = (real, st.st_size, st.st_ino, st.st_mtime_ns)
    if key in _digests:
        return _digests[key]
    entry = cache_dir() / "digests" / (hashlib.sha256(real.encode()).hexdigest()[:24] + ".json")
    try:
        stored = json.loads(entry.read_text())
        if tuple(stored["key"]) == key:
            _digests[key] = stored["digest"]
            return stored["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = f.weights_digest()
    _digests[key] = digest
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"key": list(key), "digest": digest}))
        os.replace(tmp, entry)
    except OSError as e:  # a read-only home only costs a re-hash next time
        log.debug("cannot cache weights digest in %s: %s", entry, e)
    return digest
