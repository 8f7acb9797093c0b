"""A cache row off the device: host arrays, and the two row formats files and the store write.

A token's K (or V) row is [n_kv_heads, head_dim] in the cache's dtype; a
q8_0 cache keeps each head as llama.cpp's q8_0 blocks (uint8 [n_kv_heads,
head_dim / 32 * 34]: per 32 numbers an f16 scale, then 32 int8).
On the host it is a numpy array (bf16 as its raw uint16 bits, numpy having
no bfloat16); in a file it is either "exact" (those bytes, bit for bit) or
"q8" (llama.cpp's q8_0 blocks; a q8_0 cache's rows are those already, and
are kept as they are in either format). The caches (cache.py) and the transfers
(transfer.py) use the host helpers; the file formats and the store use the
codec. Nothing here knows a layer or a session.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


# numpy has no bfloat16: bf16 rows travel to the host as their raw uint16 bits.
def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return np.dtype(np.uint16) if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype


def runs_to_host(runs: Sequence[torch.Tensor]) -> np.ndarray:
    """Runs of cache rows (LayerCache.row_runs) as one host array, in order: a view of the cache where it is
    one run on the CPU, else a copy."""
    return to_numpy(torch.cat(list(runs)) if len(runs) > 1 else runs[0])


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
        return t.numpy().view(np.uint16)
    return t.numpy()


def from_numpy(a: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a))
    if like.dtype == torch.bfloat16:
        t = t.view(torch.int16).view(torch.bfloat16)
    return t.to(like.device)


# --- 8-bit rows (the store's and the session file's "q8" row format) ---------------
#
# llama.cpp's q8_0: blocks of 32 numbers, each kept as int8 times one f16
# scale (the block's largest magnitude / 127): 34 bytes per 32 numbers where
# f16 takes 64. A block runs along a token's flattened row [H * D], so it
# never mixes tokens; a row whose length 32 does not divide gets one scale
# for the whole row. On SmolLM2 one scale per row did as well (BENCHMARKS.md,
# "Sessions": agreement 95.9% vs 95.4%, max logit error 0.32 vs 0.34); blocks
# are kept because their error is bounded per 32 numbers, so an outlier
# channel (common in keys) coarsens its block, not every head of the row.

ROW_FORMATS = ("exact", "q8")  # exact: the cache's own dtype, bit for bit
Q8_BLOCK = 32


def q8_block(values: int) -> int:
    """Numbers per scale in a q8 row of `values` numbers."""
    return Q8_BLOCK if values % Q8_BLOCK == 0 else values


# A q8_0 cache (kv dtype "q8_0") holds its rows as uint8: [H, D / 32 * 34] bytes for a row of [H, D] numbers.
Q8_0 = torch.uint8
Q8_0_BYTES = 34  # a block: the f16 scale, then Q8_BLOCK int8


def storage_row_shape(row_shape: Sequence[int], dtype: torch.dtype) -> tuple[int, int]:
    """A row of [H, D] numbers as the cache holds it: the same, or for q8_0 [H, D / 32 * 34] bytes."""
    heads, dim = row_shape
    return (heads, dim // Q8_BLOCK * Q8_0_BYTES) if dtype == Q8_0 else (heads, dim)


def encoded_row_bytes(row_shape: Sequence[int], dtype: torch.dtype, row_format: str) -> int:
    """Bytes one token's K (or V) row of [H, D] numbers takes in `row_format`."""
    if dtype == Q8_0:
        return int(np.prod(storage_row_shape(row_shape, dtype)))
    values = int(np.prod(row_shape))
    if row_format == "q8":
        return values + 2 * (values // q8_block(values))
    return values * torch.empty(0, dtype=dtype).element_size()


def dequantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    """q8_0 rows, uint8 [..., n / 32 * 34], as float32 [..., n] (each int8 times its block's scale)."""
    blocks = b.reshape(*b.shape[:-1], -1, Q8_0_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).float()  # [..., blocks, 1]
    q = blocks[..., 2:].contiguous().view(torch.int8).float()  # [..., blocks, 32]
    return (q * d).reshape(*b.shape[:-1], -1)


def host_tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of `dtype` over a host array's memory (bf16 travels as uint16 bits): no copy."""
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if dtype == torch.bfloat16 else t


# Encoding runs in numpy, on the store's writer thread: single-threaded, it never
# waits on the OpenMP barrier that torch's two-thread kernels hit on a busy
# machine (~7 ms per small op with one core taken), and it drops the GIL.


def _host_f32(a: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Host rows of the cache `dtype` (bf16 as uint16 bits) as float32."""
    if dtype == torch.bfloat16:
        return (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float32, copy=False)


def q8_encode(rows: np.ndarray, dtype: torch.dtype, block: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Host rows [n, H, D] of the cache `dtype` -> (q int8 [n, H*D], scales f16 [n, H*D / block])."""
    n = rows.shape[0]
    values = int(np.prod(rows.shape[1:]))
    block = block or q8_block(values)
    x = _host_f32(rows, dtype).reshape(n, values // block, block)  # [n, blocks, block]
    d = (np.abs(x).max(axis=-1, initial=0.0) / np.float32(127)).astype(np.float16)  # the scale as stored
    scale = d.astype(np.float32)
    inv = np.divide(np.float32(1), scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.rint(x * inv[..., None]).clip(-127, 127).astype(np.int8)
    return q.reshape(n, values), d


def q8_decode(q: np.ndarray, d: np.ndarray) -> torch.Tensor:
    """(q int8 [n, values], scales f16 [n, blocks]) -> float32 [n, values]."""
    n, values = q.shape
    blocks = d.shape[1]
    x = torch.from_numpy(q).view(n, blocks, values // blocks).float()
    return (x * torch.from_numpy(d).float().unsqueeze(-1)).view(n, values)


def q8_decode_into(q: np.ndarray, d: np.ndarray, out: torch.Tensor) -> None:
    """Decode into a tensor [n, ...] of n * values numbers. An f16 target is computed in f16: an int8 times
    an f16 scale is exact in float32, so rounding it once to f16 gives what the float32 path gives."""
    n, values = q.shape
    blocks = d.shape[1]
    view = out.view(n, blocks, values // blocks)
    if out.dtype == torch.float16:
        view.copy_(torch.from_numpy(q).view(n, blocks, values // blocks))
        view.mul_(torch.from_numpy(d).unsqueeze(-1))
    else:
        view.copy_(q8_decode(q, d).view(n, blocks, values // blocks))


def encode_rows(k: np.ndarray, v: np.ndarray, dtype: torch.dtype, row_format: str) -> list[np.ndarray]:
    """A layer's K and V host rows [n, H, D] (of the cache `dtype`) as the buffers a section holds:
    [k, v] exact (and a q8_0 cache's rows in either format), [k_q, k_scales, v_q, v_scales] in q8."""
    if row_format == "exact" or dtype == Q8_0:
        return [k, v]
    if row_format != "q8":
        raise ValueError(f"row format {row_format!r}: one of {', '.join(ROW_FORMATS)}")
    return [*q8_encode(k, dtype), *q8_encode(v, dtype)]


def split_q8(buf, n: int, row_shape: Sequence[int]) -> tuple[np.ndarray, ...]:
    """A q8 section's bytes (n rows of K, then of V) as (k_q, k_scales, v_q, v_scales) views."""
    values = int(np.prod(row_shape))
    blocks = values // q8_block(values)
    raw = np.frombuffer(buf, dtype=np.uint8)
    parts, at = [], 0
    for _ in range(2):
        parts.append(raw[at : at + n * values].view(np.int8).reshape(n, values))
        at += n * values
        parts.append(raw[at : at + 2 * n * blocks].view("<f2").reshape(n, blocks))
        at += 2 * n * blocks
    return tuple(parts)


def decode_q8_into(buf, k: np.ndarray, v: np.ndarray, dtype: torch.dtype) -> None:
    """Decode a q8 section (see split_q8) into host rows k, v [n, H, D] of the cache `dtype`; a q8_0 cache's
    rows are the section's bytes as they are."""
    if dtype == Q8_0:
        raw = np.frombuffer(buf, dtype=np.uint8)  # its size checked against the header's rows by framing
        k.reshape(-1)[:] = raw[: k.nbytes]
        v.reshape(-1)[:] = raw[k.nbytes :]
        return
    n = k.shape[0]
    kq, kd, vq, vd = split_q8(buf, n, k.shape[1:])
    q8_decode_into(kq, kd, host_tensor(k, dtype))
    q8_decode_into(vq, vd, host_tensor(v, dtype))
