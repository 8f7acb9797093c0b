"""`kvsession bench --attention`: the attention kernel alone against the machine's arithmetic peak, then the
model's prefill and decode at the same contexts.

The kernel (kernels.attend, csrc/attend.h) on caches of the model's shape (its heads, KV heads, head size and
layers) in the KV dtype asked for, filled with random rows, at each context S of --contexts:

- chunk: the attention of one prompt chunk of session.DEFAULT_CHUNK queries at the end of S keys, as a prefill
  runs it, beside PyTorch's SDPA in float32 over the same keys gathered head-major as the cache's
  update_and_fetch hands them out, the gathering counted (the path a prompt's chunks took before the kernel, and
  the one off the CPU);
- decode: one query over S keys in every layer's cache in turn (a working set the size of the model's KV, so
  read from memory as a decode step reads it): milliseconds a token, and the cache's bytes read a second.

GFLOP/s count 4 H D operations a query-key pair a query sees (two products), the share of the peak is against
the bfloat16 and int8 products' peak measured on as many threads in the same run (kernels.peak). Then the model:
a prompt of S tokens (the bench corpus, repeated to length) prefilled, and --decode-tokens decoded at that depth.
Each figure is the best (kernel) or median (model) of --repeat runs.
"""
from __future__ import annotations

import statistics
import time

import torch

from .. import kernels
from ..engine import Engine
from ..errors import KvsessionError
from ..kv.cache import KV_DTYPES
from ..kv.rows import Q8_0, dequantize_q8_0
from ..model.transformer import attention
from ..sampling import GREEDY
from ..session import DEFAULT_CHUNK
from .corpus import corpus_tokens


def attention_bench(engine: Engine, args, contexts: list[int], threads: int) -> int:
    if not kernels.available() or engine.device.type != "cpu":
        raise KvsessionError("bench --attention measures the CPU kernels: " + (kernels.unavailable_reason() or
                                                                                "run on the CPU"))
    cfg = engine.config
    dtype = KV_DTYPES[args.kv_dtype]
    H, Hk, D, L = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_layers
    products = kernels.attend_products(dtype)
    products = {"int8": "int8 (K.Q) and float32 (P.V)", "int8-bf16": "int8 (K.Q) and bfloat16 (P.V)"}.get(products,
                                                                                                        products)
    peaks = {k: kernels.peak(k, threads) for k in ("bf16", "int8", "f32")}
    print(f"model   {engine.path.name}: {H} heads, {Hk} KV heads, head size {D}, {L} layers; KV {args.kv_dtype}")
    print(f"kernels {kernels.isa()}, {threads} threads, products in {products}; peak "
          + ", ".join(f"{k} {v / 1e9:.0f} G/s" for k, v in peaks.items() if v))
    print(f"\n{'context':>8} | {'chunk ms':>9} {'GFLOP/s':>8} {'%bf16':>6} {'%int8':>6} | {'SDPA ms':>9} "
          f"{'x SDPA':>7} | {'decode ms':>9} {'GB/s':>6}")
    for S in contexts:
        chunk = _chunk(S, H, Hk, D, dtype, args.repeat)
        step = _decode(S, H, Hk, D, L, dtype, args.repeat)
        gflops = chunk["flops"] / chunk["flash"] / 1e9
        share = "  ".join(f"{gflops * 1e9 / peaks[k]:6.1%}" if peaks[k] else f"{'-':>6}" for k in ("bf16", "int8"))
        print(f"{S:>8} | {chunk['flash'] * 1e3:9.1f} {gflops:8.1f} {share} | {chunk['sdpa'] * 1e3:9.1f} "
              f"{chunk['sdpa'] / chunk['flash']:7.2f} | {step['seconds'] * 1e3:9.2f} "
              f"{step['bytes'] / step['seconds'] / 1e9:6.1f}")
    print(f"\n{'context':>8} | {'prefill tok/s':>13} | {'decode tok/s':>12}   (the model, {args.decode_tokens} "
          f"tokens decoded at each depth)")
    for S in contexts:
        runs = [_model(engine, S, args.decode_tokens, args.kv_dtype) for _ in range(args.repeat)]
        print(f"{S:>8} | {statistics.median(r[0] for r in runs):13.1f} | {statistics.median(r[1] for r in runs):12.2f}")
    return 0


def _best(f, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best


def _chunk(S: int, H: int, Hk: int, D: int, dtype: torch.dtype, repeat: int) -> dict:
    """The last chunk of an S-token prompt: T queries at S - T.. over S keys, by the kernel and by SDPA."""
    T = min(DEFAULT_CHUNK, S)
    k, v = _rows(S, Hk, D, dtype), _rows(S, Hk, D, dtype)
    q = torch.randn(T, H, D)
    scale = D ** -0.5
    flash = _best(lambda: kernels.attend(k, v, False, q, S - T, 0, 0, scale), repeat)
    sdpa = _best(lambda: attention(q, _head_major(k), _head_major(v), range(S - T, S), 0, 0, scale), repeat)
    return {"flash": flash, "sdpa": sdpa, "flops": 4 * H * D * T * (S - T + (T + 1) / 2)}


def _rows(S: int, Hk: int, D: int, dtype: torch.dtype) -> torch.Tensor:
    """S random cache rows [S, Hk, D] of the dtype (q8_0: its blocks)."""
    x = torch.randn(S, Hk, D)
    return kernels.quantize_q8_0(x) if dtype == Q8_0 else x.to(dtype)


def _head_major(t: torch.Tensor) -> torch.Tensor:
    """Cache rows [S, Hk, D] as float32 [Hk, S, D], contiguous: update_and_fetch's copy, counted in SDPA's time."""
    t = dequantize_q8_0(t) if t.dtype == Q8_0 else t
    return torch.empty(t.shape[1], t.shape[0], t.shape[2]).copy_(t.transpose(0, 1))


def _decode(S: int, H: int, Hk: int, D: int, L: int, dtype: torch.dtype, repeat: int) -> dict:
    """One query at position S - 1 through every layer's cache."""
    caches = [(_rows(S, Hk, D, dtype), _rows(S, Hk, D, dtype)) for _ in range(L)]
    q = torch.randn(1, H, D)

    def step():
        for k, v in caches:
            kernels.attend(k, v, False, q, S - 1, 0, 0, D ** -0.5)

    return {"seconds": _best(step, repeat), "bytes": sum(k.nbytes + v.nbytes for k, v in caches)}


def _model(engine: Engine, S: int, n_decode: int, kv_dtype: str) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) of an S-token prompt, then n_decode tokens greedily."""
    corpus = corpus_tokens(engine, None)
    ids = (corpus * (S // len(corpus) + 1))[:S]
    s = engine.session(sampler=GREEDY, max_tokens=S + n_decode + 1, kv_dtype=kv_dtype)
    t0 = time.perf_counter()
    s.prefill(ids)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n_decode):
        s.append(s.sample())
    return S / prefill, n_decode / (time.perf_counter() - t0)
