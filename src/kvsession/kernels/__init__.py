"""The CPU kernels of `csrc/`, built when kvsession is installed (`pip install -e .`, which
`make setup` runs): GGUF weights multiplied where they lie, and attention over the KV cache's rows.
They are built once per instruction set (portable C, AVX2, AVX-512 with VNNI, and with BF16) and the best
one the CPU runs is used (`isa()`; the environment's KVSESSION_ISA=generic|avx2|avx512|avx512bf16, on
AArch64 generic|neon|neon_dotprod, forces one, `use_isa` switches).

`BlockLinear` holds a view of a tensor's blocks in the memory-mapped file and
multiplies them, so that no dense copy of any weight exists:

- a few tokens (decode, short turns): `matmul` reads each weight once at
  its GGUF size (2.6 to 8.5 bits) -- decode at batch 1 is bound by those
  bytes. Q8_0, Q4_0, Q5_0, Q4_1, Q4_K, Q6_K, IQ4_NL, IQ4_XS and MXFP4 on a CPU
  with AVX512-VNNI, AVX2 or NEON (AArch64) do what llama.cpp does: the
  activations rounded to 8 bits (one scale a 32 values; a 256 for Q4_K, and
  for Q6_K on AVX2 and NEON, as llama.cpp's Q8_K) and multiplied with the weights' integer codes
  (`rounds`; IQ4_XS with one scale a 32, where llama.cpp takes a 256); the
  other types, and every type elsewhere, dequantize one block at a time
  into L1 and multiply it with float32 activations;
- more tokens (prefill), for Q8_0, Q4_0, Q5_0, Q4_K and Q6_K on a CPU with
  AVX512-VNNI or AVX2 and without AMX (`INT8_PREFILL`): an int8 GEMM (`int8_gemm`, `_kernels.gemm`) that
  repacks 16 rows at a time in L2 and multiplies them with every token's
  activations rounded to 8 bits (one scale a 32 values): 1.2x-1.7x the
  bfloat16 GEMM below on AVX-512, which that CPU runs at its bfloat16 peak;
  1.3x-1.9x a float32 one with the AVX2 build (BENCHMARKS.md);
- more tokens otherwise: a slab of rows at a time (a whole fused projection
  where it fits in 64 MB) is dequantized into one scratch buffer the model
  shares, and multiplied there by PyTorch's GEMM; no second copy of the
  model exists. The slab is bfloat16 where the CPU multiplies bfloat16
  natively (AVX512-BF16, AMX, Arm's BF16), float32 elsewhere (`GEMM_DTYPE`);
  with AMX, PyTorch runs it on the tile unit, faster than the int8 GEMM.
  Where it would be float32 and the int8 products unpack a block once for
  several tokens (the AVX2 and NEON builds), those take prompts of the other types
  with `rounds` (Q4_1) too, up to `TILED_TOKENS`.

Dequantized weights are bit for bit what ggml's dequantization gives. Where
the extension is missing (a source tree nobody installed) or a type has no
kernel, the model falls back to dense weights (model/weights.py) and says so once.

`attend` is flash attention read straight from the cache's float16/bfloat16
rows, token-major, ring or not, for a prompt's chunk and for decode alike: no
float32 copy of the cache is made for it, no score matrix is ever written out.
On a CPU with AVX512-BF16 it multiplies in bfloat16; against a q8_0 cache,
on every AVX-512 build, K.Q is an int8 product (VNNI), P.V bfloat16 where the
CPU has it; else it multiplies in float32 (`attend_products`).

`Stack` runs a few tokens through every layer in one call (decode): the
same blocks, the same rows, without the ~30 PyTorch operations a layer that
cost a small model's decode step as much as its weights.
"""
from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

try:
    from . import _kernels
except ImportError as e:  # pragma: no cover - an installed kvsession always has it
    _kernels = None
    _IMPORT_ERROR = str(e)

# Tokens at or below which a product (and attention) runs in these kernels; above, through a slab and PyTorch's
# GEMM. Measured in BENCHMARKS.md ("Kernels", the crossover).
KERNEL_TOKENS = 8

# Where the int8 products unpack a block once for several tokens (`_kernels.token_tiles()`: the AVX2 and NEON
# builds), the GEMM would be float32 and the type has no int8 GEMM (Q4_1; on NEON, which has none, every int8
# type), they multiply prompts of up to this many tokens too: 2.7-5.1x a float32 slab and GEMM at 16 tokens,
# 1.0-1.5x at 128, 0.6-0.9x at 256 on the AVX2 Zen 3 (BENCHMARKS.md, "Zen 3", "Kernels"; no ARM CPU
# has measured it). The int8 GEMM types take the GEMM from KERNEL_TOKENS up: on
# AVX2 it runs 0.8x-1.3x the tiled products' speed at 9 tokens, 1.0x-1.8x at 16, 1.3x-3.3x at 128 (BENCHMARKS.md,
# "Prefill in int8 on AVX2").
TILED_TOKENS = 128

# Bytes dequantized at a time for the GEMM path (the widest fused projection of the packaged models in
# bfloat16: Qwen2.5-Coder-1.5B's gate and up, 27.5M weights): one GEMM a projection runs at speed, and no model
# keeps a second copy of itself. In float32 the parts of a wider projection are multiplied one by one.
SLAB_BYTES = 64 << 20

# bfloat16 GEMMs only where the CPU has bfloat16 arithmetic: elsewhere PyTorch converts every operand and an
# AVX2-only CPU multiplies bfloat16 at 18 GFLOPS against float32's 86-118 (BENCHMARKS.md, "Zen 3",
# "Kernels"). Where the CPU cannot be told (no /proc/cpuinfo), float32: never the slow one.
BF16_CPU_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    try:
        return set(cpuinfo.read_text(errors="replace").split())
    except OSError:
        return set()


def gemm_dtype(cpuinfo: Path = Path("/proc/cpuinfo")) -> torch.dtype:
    return torch.bfloat16 if cpu_flags(cpuinfo) & BF16_CPU_FLAGS else torch.float32


def int8_prefill(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether prompts go through the int8 GEMM (the types that have one): not on a CPU with AMX, where PyTorch's
    bfloat16 GEMM runs on the tile unit and outran it 1.6x-1.7x on whole prefills (Qwen2.5-Coder-0.5B, LFM2-1.2B;
    BENCHMARKS.md, "Kernels")."""
    return "amx_bf16" not in cpu_flags(cpuinfo)


GEMM_DTYPE = gemm_dtype()
INT8_PREFILL = int8_prefill()


# glibc serves every allocation above its mmap threshold (at most 32 MB when left to adjust itself) with a fresh
# mapping and unmaps it when freed, so each such buffer faults its pages in again: a 512-token prefill of
# Qwen2.5-Coder-1.5B allocates its [512, 2 x 8960] float32 gate-and-up output (37 MB) 28 times, and those faults
# were ~14% of the prefill (3.2 -> 2.75 s). Buffers up to this size come from the heap, and up to this much freed
# memory stays there for the next one (peak RSS: BENCHMARKS.md).
HEAP_BUFFERS = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


def keep_freed_buffers() -> bool:
    """Make glibc keep large freed buffers for reuse (process-wide; the CPU engine calls it). False where the C
    library has no mallopt (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_BUFFERS)) and bool(mallopt(_M_TRIM_THRESHOLD, HEAP_BUFFERS))


def available() -> bool:
    return _kernels is not None


def unavailable_reason() -> str:
    return "" if _kernels is not None else f"the block kernels are not built ({_IMPORT_ERROR}): run `pip install -e .`"


def isa() -> str:
    """The kernels' build in use: "avx512bf16", "avx512", "avx2", "neon_dotprod", "neon" or "generic" ("" without
    the kernels)."""
    return _kernels.isa() if _kernels is not None else ""


def isas() -> list[str]:
    """The builds this CPU runs, best first."""
    return _kernels.isas() if _kernels is not None else []


def use_isa(name: str) -> None:
    """Switch every kernel to one build (the tests run each one the CPU can); ValueError names those it runs. Takes
    effect for BlockLinears made after it: each reads how its type is multiplied when it is made."""
    _kernels.use(name)


def supports(qtype: int) -> bool:
    return _kernels is not None and _kernels.block_size(int(qtype)) is not None


def threads() -> int:
    return torch.get_num_threads()


class Scratch:
    """One buffer for the dequantized slabs of every BlockLinear of a model (prefill), in the GEMM's dtype."""

    def __init__(self, dtype: torch.dtype | None = None):
        self.dtype = dtype or GEMM_DTYPE
        self.weights = SLAB_BYTES // self.dtype.itemsize  # a slab's most weights
        self.buf = torch.empty(0, dtype=self.dtype)

    def get(self, n: int) -> torch.Tensor:
        if self.buf.numel() < n:
            self.buf = torch.empty(n, dtype=self.dtype)
        return self.buf[:n]


def rows_of(x: torch.Tensor) -> torch.Tensor:
    """x [T, n] as float32 whose rows are contiguous (x itself where they are: the gate half of a fused FFN output
    is multiplied where it lies)."""
    x = x.float()
    return x if x.stride(1) == 1 and x.stride(0) >= x.shape[1] else x.contiguous()


class BlockLinear:
    """y = x @ W^T + b, W a GGUF tensor's blocks [rows, row_bytes] as the file stores them (CPU)."""

    def __init__(self, data: np.ndarray, qtype: int, cols: int, bias: torch.Tensor | None, scratch: Scratch):
        # rounds: decode rounds the activations to 8 bits, one scale a `rounds` values (0: float32 products)
        values, nbytes, self.rounds, int8_gemm = _kernels.block_size(int(qtype))
        self.int8_gemm = bool(int8_gemm) and INT8_PREFILL
        if data.dtype != np.uint8 or data.ndim != 2 or cols % values or data.shape[1] != cols // values * nbytes:
            raise ValueError(f"{data.dtype} {data.shape} is not {cols} values a row of type {qtype}")
        self.data = np.require(data, requirements="C")  # the memory map itself: GGUF rows are contiguous
        self.address = self.data.ctypes.data
        self.qtype = int(qtype)
        self.out_features = data.shape[0]
        self.in_features = cols
        self.bias = bias  # [out] float32 or None
        self.scratch = scratch
        self.slab_rows = max(16, scratch.weights // cols // 16 * 16)
        # the most tokens multiplied by the int8 products (beyond, the int8 GEMM, or a slab and PyTorch's GEMM)
        self.kernel_tokens = KERNEL_TOKENS
        if self.rounds and not self.int8_gemm and _kernels.token_tiles() and scratch.dtype == torch.float32:
            self.kernel_tokens = TILED_TOKENS

    def __call__(self, x: torch.Tensor, *, per_token: bool = False) -> torch.Tensor:  # x: [T, in] f32 -> [T, out] f32
        """per_token: through the products whatever T is, so that each token's result is what it gets alone
        (several sequences decoded at once); else the GEMM takes many tokens."""
        T = x.shape[0]
        if T <= self.kernel_tokens or per_token:
            x = x.float().contiguous()
            y = torch.empty(T, self.out_features)
            _kernels.matmul(self.qtype, self.address, self.out_features, self.in_features,
                           x.data_ptr(), T, y.data_ptr(), threads())
        elif self.int8_gemm:
            y = torch.empty(T, self.out_features)
            self.gemm_into(rows_of(x), y)
        else:
            y = self._gemm(x.to(self.scratch.dtype))
        return y if self.bias is None else y + self.bias

    def gemm_into(self, x: torch.Tensor, y: torch.Tensor, col: int = 0) -> None:
        """y[:, col : col + out] = x @ W^T by the int8 GEMM (`int8_gemm` types); x [T, in] float32 with contiguous
        rows (a view of wider rows too: `rows_of`), y [T, *] float32, contiguous."""
        assert x.dtype == y.dtype == torch.float32 and x.stride(1) == 1 and y.is_contiguous()
        assert x.shape[1] == self.in_features and 0 <= col and col + self.out_features <= y.shape[1]
        _kernels.gemm(self.qtype, self.address, self.out_features, self.in_features, x.data_ptr(), x.stride(0),
                      x.shape[0], y.data_ptr() + 4 * col, y.shape[1], threads())

    def _gemm(self, xb: torch.Tensor) -> torch.Tensor:  # xb: [T, in] in the slab's dtype -> [T, out] f32
        rows, cols = self.out_features, self.in_features
        if rows <= self.slab_rows:
            return F.linear(xb, self.dequant_into(self.scratch.get(rows * cols).view(rows, cols))).float()
        y = torch.empty(xb.shape[0], rows)
        for r0 in range(0, rows, self.slab_rows):
            n = min(self.slab_rows, rows - r0)
            y[:, r0 : r0 + n] = F.linear(xb, self.dequant_into(self.scratch.get(n * cols).view(n, cols), r0))
        return y

    def dequant_into(self, w: torch.Tensor, r0: int = 0) -> torch.Tensor:
        """Rows r0 .. r0+len(w)-1 into w [n, cols] (contiguous, bfloat16 or float32); returns w."""
        n = w.shape[0]
        assert w.dtype in (torch.bfloat16, torch.float32) and w.is_contiguous() and w.shape[1] == self.in_features
        assert 0 <= r0 and r0 + n <= self.out_features
        _kernels.dequant(self.qtype, self.address + r0 * self.data.shape[1], n, self.in_features, w.data_ptr(),
                         w.dtype == torch.bfloat16, threads())
        return w

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Rows `ids` (int64, in range: the caller checks) dequantized exactly, float32 [n, cols]."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        out = np.empty((ids.size, self.in_features), np.float32)
        _kernels.gather(self.qtype, self.address, self.in_features, ids.ctypes.data, ids.size, out.ctypes.data)
        return out


class BlockLinears:
    """BlockLinears side by side, one output (a fused projection: q, k, v; gate, up).

    Prefill dequantizes every part into one slab and multiplies once, a GEMM as wide as the projection (three
    narrow GEMMs and a concatenation cost Qwen2.5-Coder-0.5B's prefill ~15%); decode multiplies each part
    where it lies."""

    def __init__(self, parts: list[BlockLinear]):
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("parts of one projection read one input")
        self.parts = parts
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)
        biases = [p.bias for p in parts]
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [torch.zeros(p.out_features) if b is None else b for p, b in zip(parts, biases)])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] f32 -> [T, out] f32
        rows, cols = self.out_features, self.in_features
        scratch = self.parts[0].scratch
        if x.shape[0] <= min(p.kernel_tokens for p in self.parts):
            return torch.cat([p(x) for p in self.parts], dim=-1)
        if all(p.int8_gemm for p in self.parts):
            x = rows_of(x)
            y = torch.empty(x.shape[0], rows)
            at = 0
            for p in self.parts:
                p.gemm_into(x, y, at)
                at += p.out_features
            return y if self.bias is None else y + self.bias
        if rows * cols > scratch.weights:
            return torch.cat([p(x) for p in self.parts], dim=-1)
        w = scratch.get(rows * cols).view(rows, cols)
        at = 0
        for p in self.parts:
            p.dequant_into(w[at : at + p.out_features])
            at += p.out_features
        y = F.linear(x.to(scratch.dtype), w).float()
        return y if self.bias is None else y + self.bias


def gelu_mul(gu: torch.Tensor) -> torch.Tensor:
    """GELU(gate) * up of a fused gate-and-up output gu [T, 2 * d_ff] (float32, CPU), with ggml's GELU: a table of
    every float16 input, as the decode stack does. One pass, where PyTorch's emulation of the table took six."""
    gu = gu.contiguous()
    T, dff = gu.shape[0], gu.shape[1] // 2
    out = torch.empty(T, dff)
    _kernels.gelu_mul(gu.data_ptr(), T, dff, out.data_ptr(), threads())
    return out


_KV_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.uint8: 3}  # uint8: q8_0 blocks


def attend(k: torch.Tensor, v: torch.Tensor, ring: bool, q: torch.Tensor, pos0: int, key_lo: int, window: int,
           scale: float, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of T queries at positions pos0.. over a cache's rows (CPU): flash attention (csrc/attend.h).

    k, v: the cache, [capacity, Hk, D] contiguous (q8_0, as uint8: [capacity, Hk, D / 32 * 34]); position p is
    row p (row p % capacity in a ring). q: [T, H, D] float32. Query pos0 + t sees keys max(key_lo, p - window + 1 if window else 0) .. p, all of which the caller
    has stored; softcap > 0: each score is softcap * tanh(score / softcap) (Gemma 2); sinks [H] float32: a logit
    of each head's in its softmax, with no value (gpt-oss). Returns [T, H * D] float32."""
    T, H, D = q.shape
    cap, Hk = k.shape[0], k.shape[1]
    q = q.float().contiguous()
    if sinks is not None and (sinks.shape != (H,) or sinks.dtype != torch.float32 or not sinks.is_contiguous()):
        raise ValueError(f"sinks {tuple(sinks.shape)} {sinks.dtype}: want ({H},) float32, contiguous")
    out = torch.empty(T, H * D)
    _kernels.attend(_KV_DTYPES[k.dtype], k.data_ptr(), v.data_ptr(), cap, ring, Hk, D, q.data_ptr(), T, H, pos0,
                    key_lo, window, scale, softcap, 0 if sinks is None else sinks.data_ptr(), out.data_ptr(),
                    threads())
    return out


PEAK_KINDS = {"f32": 0, "bf16": 1, "int8": 2}  # csrc/peak.h PEAK_*


def peak(kind: str, n_threads: int | None = None, rounds: int = 5_000_000) -> float:
    """Operations a second of the build's float32 FMA, bfloat16 or int8 dot-product instruction ("f32", "bf16",
    "int8") on n_threads threads (default: threads()), with nothing waiting on memory or on another instruction:
    the best of three runs. 0.0 where the build has no such instruction. A yardstick for benchmarks."""
    best = 0.0
    for _ in range(3):
        t0 = time.perf_counter()
        ops = _kernels.peak(PEAK_KINDS[kind], rounds, n_threads or threads())
        best = max(best, ops / (time.perf_counter() - t0))
    return best


def attend_products(cache_dtype: torch.dtype) -> str:
    """How `attend` multiplies over caches of this dtype (uint8: q8_0) on the build in use: "bfloat16" (AVX512-BF16
    and a float16 or bfloat16 cache: K.Q and P.V with queries, keys, values and probabilities rounded to bfloat16,
    float32 sums), "int8-bf16" (AVX512-BF16 and a q8_0 cache: K.Q as int8 products, the queries quantized in blocks
    of 32 as llama.cpp quantizes activations; P.V in bfloat16), "int8" (AVX512-VNNI without BF16 and a q8_0 cache:
    the same K.Q, P.V in float32), else "float32"."""
    if _kernels is None:
        return "float32"
    int8 = _kernels.attend_int8() and cache_dtype == torch.uint8
    if _kernels.attend_bf16() and cache_dtype in (torch.float16, torch.bfloat16, torch.uint8):
        return "int8-bf16" if int8 else "bfloat16"
    return "int8" if int8 else "float32"


def attends(cache_dtype: torch.dtype, head_dim: int) -> bool:
    """Whether `attend` takes caches of this dtype (uint8: q8_0 blocks) and heads of this size."""
    whole = 32 if cache_dtype == torch.uint8 else 16  # q8_0's blocks; else whole 16-float registers
    return _kernels is not None and cache_dtype in _KV_DTYPES and head_dim % whole == 0 and head_dim <= 256


def attends_in_place(k: torch.Tensor, head_dim: int) -> bool:
    """Whether decode attention reads a cache's rows [cap, H, ...] of heads of head_dim numbers where they lie: a
    CPU tensor of a dtype and head size the kernels take (every caller's one test, so the stack and the
    layer-by-layer path agree)."""
    return k.device.type == "cpu" and attends(k.dtype, head_dim)


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] (n a multiple of 32) as llama.cpp's q8_0 blocks, uint8 [..., n / 32 * 34] on the CPU: each block
    of 32 numbers a float16 scale (its largest magnitude / 127) and 32 int8, rounded as ggml rounds them."""
    x = x.detach().to("cpu", torch.float32).contiguous()
    out = torch.empty(*x.shape[:-1], x.shape[-1] // 32 * 34, dtype=torch.uint8)
    _kernels.quantize_q8_0(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def _mat(lin: BlockLinear) -> tuple:
    """A BlockLinear as the C side's stacks take a matrix: (type, address, rows, cols, bias address or 0)."""
    return (lin.qtype, lin.address, lin.out_features, lin.in_features, 0 if lin.bias is None else lin.bias.data_ptr())


GLU_CODES = {"silu": 0, "swiglu_oai": 1}  # csrc/kernels.h GLU_*


class ExpertsStep:
    """A mixture's experts for one token in one call (decode): the chosen experts' gated FFNs and their weighted
    sum, where moe.Experts makes some twenty PyTorch calls an expert (gpt-oss-20b's shape: ~a third of a step).
    gate_up[e]: BlockLinears (gate, up); down[e]: a BlockLinear. Holds them, so the C side's addresses stay valid."""

    def __init__(self, gate_up: list[BlockLinears], down: list[BlockLinear], glu: str):
        self.keep = (gate_up, down)
        self.d_model = down[0].out_features
        self.handle = _kernels.experts(self.d_model, down[0].in_features, GLU_CODES[glu],
                                       [(_mat(gu.parts[0]), _mat(gu.parts[1]), _mat(d)) for gu, d in zip(gate_up, down)])

    @classmethod
    def of(cls, gate_up: list, down: list, glu: str) -> "ExpertsStep | None":
        """The step for these experts, or None where some are not BlockLinears of the kernels' shape."""
        if _kernels is None or glu not in GLU_CODES:
            return None
        if not all(isinstance(gu, BlockLinears) and len(gu.parts) == 2 and isinstance(d, BlockLinear)
                   for gu, d in zip(gate_up, down)):
            return None
        return cls(gate_up, down, glu)

    def __call__(self, x: torch.Tensor, chosen: np.ndarray, weights: np.ndarray) -> torch.Tensor:
        """x [1, d_model] float32 through the experts `chosen` (int64), weighted by `weights` (float32), added in
        that order: [1, d_model] float32."""
        x = x.float().contiguous()
        chosen = np.ascontiguousarray(chosen, np.int64)
        weights = np.ascontiguousarray(weights, np.float32)
        out = torch.empty(1, self.d_model)
        _kernels.experts_run(self.handle, chosen.ctypes.data, weights.ctypes.data, len(chosen), x.data_ptr(),
                             out.data_ptr(), threads())
        return out


_SSM_KINDS = {"mamba2": 1, "deltanet": 2}  # kernels.h's SSM_MAMBA2, SSM_DELTA
_FORMS = {"both": 0, "mixer": 1, "ffn": 2}  # FORM_BOTH, FORM_MIXER, FORM_FFN
_GATINGS = {"softmax": 0, "softmax_weight": 1}  # GATE_SOFTMAX, GATE_SOFTMAX_WEIGHT


class Stack:
    """Every layer of a model whose weights are all BlockLinears, for a few tokens at a time (decode).

    shape: (n_layers, d_model, H, Hk, D, d_ff, gelu, neox, rope_dim, eps, scale, residual, softcap, ssm_inner,
    ssm_heads, ssm_groups, ssm_state, attn_gate, qk_tile) -- ssm_* Mamba2's or DeltaNet's sizes, zeros without
    them; attn_gate: q gives each head's query then its output's gate; qk_tile: DeltaNet's value head h reads key
    head h % groups. layers: per layer (q, k, v, o, gate, up, down, alpha, ssm_in, ssm_out) BlockLinears or None
    (ssm_in and ssm_out: a Mamba2 layer's beside the attention of q, k, v, o: Falcon-H1), the norm vectors
    (attn, ffn, q, k, post-attention, post-feed-forward; None where the architecture has none), the window (0:
    full), which RoPE table (0 or 1), conv: None for attention, else a recurrent layer's convolution kernel,
    float32 [channels, K] contiguous, with its in_proj as q, its out_proj as o (DeltaNet: q its qkv, k its z, v its
    beta, alpha its alpha); ssm: None, or (kind, vectors): "mamba2" with (conv bias, dt bias, a, d, norm) or
    "deltanet" with (None, dt bias, a, None, norm), float32 contiguous (Mamba2's bias and norm may be None); and
    form: "both" (a mixer, then the feed-forward network), "mixer" (gate, up, down and the ffn norm None) or
    "ffn" (the feed-forward network alone after the attn norm: q, k, v, o, conv and ssm None; its cache a
    state that only counts positions). A gate of None: relu(up)^2. Then sinks: the attention's sinks float32
    [H] or None; and moe: None, or a mixture of experts in place of gate, up and down (None there): (its
    ExpertsStep, its router BlockLinear, experts used a token, gating ("softmax" or "softmax_weight"), whether
    the chosen weights are normalised, its shared expert's (gate, up, down) BlockLinears or None, and the shared
    expert's gate vector float32 [d_model] or None). Holds them, so that the addresses the C side keeps stay
    valid."""

    def __init__(self, shape: tuple, layers: list[tuple]):
        self.keep = layers

        def addr(t: torch.Tensor | None) -> int:
            if t is not None and (t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu"):
                raise ValueError(f"the stack's vectors are float32 contiguous on the CPU, got {t.dtype} "
                                 f"{tuple(t.shape)}")
            return 0 if t is None else t.data_ptr()

        d_model, (inner, heads, groups, state) = shape[1], shape[13:17]
        for _, _, _, _, conv, ssm, *_ in layers:
            channels = d_model if ssm is None else inner + 2 * groups * state
            if conv is not None and (conv.dim() != 2 or conv.shape[0] != channels):
                raise ValueError(f"a recurrent layer's kernel is [{channels}, K], got {tuple(conv.shape)}")

        def mixture(moe: tuple | None) -> tuple | None:
            if moe is None:
                return None
            step, router, used, gating, norm, shared, inp = moe
            return (step.handle, _mat(router), used, _GATINGS[gating], int(norm),
                    *((None,) * 3 if shared is None else map(_mat, shared)), addr(inp))

        self.handle = _kernels.stack(shape, [(*(None if m is None else _mat(m) for m in mats), *map(addr, norms),
                                              window, rope, addr(conv), 0 if conv is None else conv.shape[1],
                                              None if ssm is None else (_SSM_KINDS[ssm[0]], *map(addr, ssm[1])),
                                              _FORMS[form], addr(sinks), mixture(moe))
                                             for mats, norms, window, rope, conv, ssm, form, sinks, moe in layers])
        self.n_layers = len(layers)
        # their caches are states: a recurrent layer's, and a feed-forward layer's that counts positions; a layer
        # of attention and Mamba2 side by side has both, its rows and its state
        self.states = [i for i, layer in enumerate(layers)
                       if (layer[4] is not None and layer[0][8] is None) or layer[6] == "ffn"]
        self.beside = [i for i, layer in enumerate(layers) if layer[0][8] is not None]

    def run(self, x: torch.Tensor, pos0: int, caches: list, tables: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """x [T, d_model] float32 contiguous, through every layer in place; the caches take rows pos0..
        (claimed here: bounds-checked and grown first). tables: (cos, sin) of each RoPE, covering pos0 + T."""
        self.run_many(x, [(pos0, x.shape[0], caches)], tables)

    def run_many(self, x: torch.Tensor, segments: list[tuple[int, int, list]],
                 tables: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Several sequences at once: x [T, d_model] holds their tokens one after another, and segments says
        whose they are, (pos0, n, caches) each in order, n tokens at pos0.. in that sequence's caches. Each
        weight is read once for all T tokens; each sequence's result is what it gets alone. The tables cover
        every sequence's last position; a recurrent layer's cache is its state (kv/recurrent.py), read and
        written in place and advanced here. A failure leaves every cache as it was; an interrupt
        that lands once the run went through leaves them moved on, as a step does."""
        segs = np.array([(n, pos0) for pos0, n, _ in segments], np.int64)
        table = np.zeros((len(segments), self.n_layers, 7), np.int64)
        recurrent = set(self.states)
        rows = [[c for i, c in enumerate(caches) if i not in recurrent] for _, _, caches in segments]
        held = sorted(self.states + self.beside)
        states = [[caches.states[i] for i in held] for _, _, caches in segments]
        saved = [[(c.end, c.first) for c in cs] for cs in rows]
        (c0, s0), (c1, s1) = tables[0], tables[-1]
        done = np.zeros(1, np.int64)  # set by the C side when the run went through
        try:
            for j, (pos0, n, caches) in enumerate(segments):
                for st in states[j]:
                    st.check_next(pos0, "decode")
                for i, (c, st) in enumerate(zip(caches, caches.states)):
                    if st is not None:
                        table[j, i, 5:] = (0 if st.conv is None else st.conv.data_ptr(),
                                           0 if st.ssm is None else st.ssm.data_ptr())
                    if i not in recurrent:
                        first = c.claim(pos0, n)  # may grow the cache: its addresses are read after
                        table[j, i, :5] = (c.k.data_ptr(), c.v.data_ptr(), c.capacity, c.ring, first)
            # the C side takes all its memory before it writes a state or a row: when it fails, nothing was written
            _kernels.run(self.handle, x.data_ptr(), x.shape[0], segs.ctypes.data, len(segments), table.ctypes.data,
                         _KV_DTYPES[rows[0][0].k.dtype], c0.data_ptr(), s0.data_ptr(), c1.data_ptr(),
                         s1.data_ptr(), threads(), done.ctypes.data)
        except BaseException:
            if not done[0]:  # a layer refused its rows, or the run wrote nothing
                for cs, before in zip(rows, saved):
                    for c, (end, first) in zip(cs, before):
                        c.end, c.first = end, first
                raise
            self._advance(segments, states)  # an interrupt after the run: its writes stand
            raise
        self._advance(segments, states)

    @staticmethod
    def _advance(segments: list, states: list) -> None:
        for (_, n, _), sts in zip(segments, states):
            for st in sts:
                st.advance(n)
