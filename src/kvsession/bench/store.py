"""`kvsession bench --store`: the disk KV cache's figures.

1. ten sessions sharing a 2,048-token prefix: the bytes the store holds
   against the rows themselves and against ten whole session files;
2. a checkpoint of a session that grew by 64 tokens: the new chunks' bytes
   and time against a full session file;
3. longest_prefix over a thousand manifests, after the index is rebuilt;
4. exact against 8-bit rows on a real 2,048-token session: bytes, put and
   restore times, logit drift, a server's turn 2 from disk against the live
   session, greedy continuations and agreement with llama.cpp after a round
   trip, and what general compressors gain on the chunk files.

The shared tier's figures are bench/shared.py's.
"""
from __future__ import annotations

import importlib.util
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ..engine import Engine
from ..kv.cache import KV_DTYPES
from ..kv.rows import encoded_row_bytes, numpy_dtype
from ..sampling import GREEDY
from ..session import Session
from .corpus import corpus_tokens


def synthetic_session(engine: Engine, tokens: list[int], kv_dtype: str, rng: np.random.Generator) -> Session:
    """A session holding `tokens` with random KV rows and logits, built without running the model.

    The store's costs depend on row sizes and token ids, not on the rows'
    values, so its benchmark can fill a thousand checkpoints in seconds.
    """
    s = engine.session(kv_dtype=kv_dtype, initial_tokens=max(1, len(tokens)))
    n = len(tokens)
    rows = {}
    state = s.state()
    for layer in state.layers:
        start = max(0, n - layer.window) if layer.ring else 0
        shape = (n - start, *state.row_shape)
        dtype = numpy_dtype(state.dtype)
        k, v = (rng.integers(0, 1 << 14, shape).astype(dtype) for _ in range(2))
        rows[layer.index] = [(start, k, v)]
    logits = torch.from_numpy(rng.standard_normal(engine.config.vocab_size).astype(np.float32))
    s.restore_rows(tokens, rows, logits, keep=0)
    return s


def store_bench(engine: Engine, args) -> int:
    """The disk KV cache's figures: prefix sharing, incremental checkpoints, lookup time."""
    from ..store import Store, StoreOptions

    kv = args.kv_dtype
    rng = np.random.default_rng(0)
    c = engine.config
    row_bytes = c.n_layers * 2 * encoded_row_bytes((c.n_kv_heads, c.head_dim), KV_DTYPES[kv], "exact")
    print(f"model   {engine.path.name}, KV {kv}, {row_bytes:,} bytes of KV rows per token")
    corpus = corpus_tokens(engine, 2048 + 10 * 256 + 64)
    prefix, suffixes = corpus[:2048], [rng.integers(100, 20000, 256).tolist() for _ in range(10)]
    with tempfile.TemporaryDirectory() as d:
        store = Store(Path(d) / "kv", StoreOptions())
        whole = 0
        for i, suffix in enumerate(suffixes):
            s = synthetic_session(engine, prefix + suffix, kv, rng)
            store.put(s, "continued")
            whole += s.save(Path(d) / f"whole{i}.kvs", durable=False).bytes
        minimal = row_bytes * (2048 + 10 * 256)
        print("\n1. ten sessions sharing a 2,048-token prefix, each with its own 256-token suffix")
        print(f"   store holds         {store.total_bytes():>14,} bytes")
        print(f"   prefix + 10 suffixes{minimal:>14,} bytes of KV rows  -> store / that = "
              f"{store.total_bytes() / minimal:.3f}x (target <= 1.3x)")
        print(f"   10 whole files      {whole:>14,} bytes           -> {whole / minimal:.2f}x")

        s = synthetic_session(engine, corpus[: 2048 + 100], kv, rng)
        store.put(s, "continued")
        before = _folder_bytes(Path(d) / "kv")
        # the same session 64 tokens later (chunks are named by tokens: the rows' values do not matter)
        grown = synthetic_session(engine, corpus[: 2048 + 164], kv, rng)
        t0 = time.perf_counter()
        store.put(grown, "continued")
        put_ms = (time.perf_counter() - t0) * 1e3
        written = _folder_bytes(Path(d) / "kv") - before
        t0 = time.perf_counter()
        full = grown.save(Path(d) / "full.kvs", durable=False)
        save_ms = (time.perf_counter() - t0) * 1e3
        print("\n2. a checkpoint of a 2,148-token session that grew by 64 tokens")
        print(f"   put (new chunks + manifest) {written:>12,} bytes in {put_ms:6.1f} ms")
        print(f"   full session file           {full.bytes:>12,} bytes in {save_ms:6.1f} ms   -> "
              f"{written / full.bytes:.3f}x the bytes, {put_ms / save_ms:.2f}x the time")

        small = StoreOptions(chunk_tokens=16, min_tokens=16, budget_bytes=1 << 40)
        many = Store(Path(d) / "many", small)
        system = rng.integers(100, 20000, 32).tolist()
        stored = []
        t0 = time.perf_counter()
        for i in range(1000):
            toks = system + rng.integers(100, 20000, int(rng.integers(1, 40))).tolist()
            many.put(synthetic_session(engine, toks, kv, rng), "continued")
            stored.append(toks)
        fill_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        reopened = Store(Path(d) / "many", small)
        open_ms = (time.perf_counter() - t0) * 1e3
        queries = [q + [7, 8, 9] for q in stored[:200]] + [system + rng.integers(100, 20000, 30).tolist()
                                                             for _ in range(200)]
        times = []
        for q in queries:
            t0 = time.perf_counter()
            hit = reopened.longest_prefix(q, engine, kv_dtype=kv)
            times.append((time.perf_counter() - t0) * 1e3)
            assert hit is not None
        times.sort()
        print(f"\n3. longest_prefix over {len(reopened.entries)} manifests (filled in {fill_s:.1f} s; "
              f"reopening rebuilt the index in {open_ms:.0f} ms)")
        print(f"   {len(queries)} queries: median {times[len(times) // 2]:.3f} ms, p99 {times[int(len(times) * 0.99)]:.3f} ms, "
              f"max {times[-1]:.3f} ms (target < 2 ms)")
    store_rows_bench(engine, args)
    return 0


def _median_ms(f, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        f()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def store_rows_bench(engine: Engine, args) -> None:
    """Figure 4 on a real 2,048-token session: exact vs 8-bit rows (bytes, put, restore, agreement, greedy
    continuations), and general compressors on both."""
    from ..store import Store, StoreOptions

    kv, n = args.kv_dtype, 2048
    ids = corpus_tokens(engine, n)
    live = engine.session(kv_dtype=kv, sampler=GREEDY)
    live.prefill(ids)
    print(f"\n4. exact vs 8-bit rows: a {n:,}-token session of {engine.path.name}, KV {kv}, median of 5")
    print(f"   {'rows':<6} {'bytes/token':>12} {'put ms':>8} {'restore ms':>11} {'(prefaulted)':>13} {'max |dlogit|':>13}")
    with tempfile.TemporaryDirectory() as d:
        folders = {}
        for fmt in ("exact", "q8"):
            folder = folders[fmt] = Path(d) / fmt
            opts = StoreOptions(row_format=fmt)

            def put(folder=folder, opts=opts):
                shutil.rmtree(folder, ignore_errors=True)
                Store(folder, opts).put(live, "continued")

            put_ms = _median_ms(put)

            def restore(prefault: bool, folder=folder, opts=opts) -> float:
                store = Store(folder, opts)  # a fresh process's view: index rebuilt, page cache warm
                s = engine.session(kv_dtype=kv, sampler=GREEDY)
                if prefault:
                    s.prefault(n)
                hit = store.longest_prefix(ids, engine, kv)
                t0 = time.perf_counter()
                assert store.restore(hit, s)
                return (time.perf_counter() - t0) * 1e3

            cold = statistics.median(restore(False) for _ in range(5))
            warm = statistics.median(restore(True) for _ in range(5))
            s = engine.session(kv_dtype=kv, sampler=GREEDY)
            store = Store(folder, opts)
            store.restore(store.longest_prefix(ids, engine, kv), s)
            probe = corpus_tokens(engine, n + 16)[n:]
            a, b = live.fork(), s
            a.prefill(probe)
            b.prefill(probe)
            dlogit = float((a.logits - b.logits).abs().max())
            print(f"   {fmt:<6} {_folder_bytes(folder) / n:>12,.0f} {put_ms:>8.1f} {cold:>11.1f} {warm:>13.1f} "
                  f"{dlogit:>13.3f}")
        _disk_against_live(engine, live, ids, folders["exact"], kv)
        _greedy_after_restore(engine, live, ids, folders["q8"], kv)
        _agreement_after_round_trip(engine, kv)
        _compressors(folders)


def _disk_against_live(engine: Engine, live: Session, ids: list[int], folder: Path, kv: str) -> None:
    """The server's turn 2 inside one process: 16 new tokens and a first token on the live session, against
    a lookup, a restore into a new session and the same 16 tokens (the target: at most 30 ms more)."""
    from ..store import Store, StoreOptions

    more = corpus_tokens(engine, len(ids) + 16)[len(ids):]

    def on_live() -> None:  # the live session itself, its memory warm, as a server's is
        logits = live.logits
        t0 = time.perf_counter()
        live.prefill(more)
        live.sample()
        times["live"].append((time.perf_counter() - t0) * 1e3)
        live.truncate(len(ids))
        live.logits = logits

    def from_disk(prefault: bool) -> None:
        store, s = Store(folder, StoreOptions()), engine.session(kv_dtype=kv, sampler=GREEDY)
        if prefault:
            s.prefault(len(ids) + 64)
        t0 = time.perf_counter()
        store.restore(store.longest_prefix(ids + more, engine, kv), s)
        s.prefill(more)
        s.sample()
        times["prefaulted" if prefault else "disk"].append((time.perf_counter() - t0) * 1e3)

    times = {"live": [], "disk": [], "prefaulted": []}
    for _ in range(5):
        on_live()
        from_disk(False)
        from_disk(True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"   turn 2 in one process (16 new tokens + first token): live {med['live']:.1f} ms; from disk "
          f"{med['disk']:.1f} ms (+{med['disk'] - med['live']:.1f}); into a prefaulted session "
          f"{med['prefaulted']:.1f} ms (+{med['prefaulted'] - med['live']:.1f}; target +30)")


def _greedy_after_restore(engine: Engine, live: Session, ids: list[int], folder: Path, kv: str) -> None:
    from ..generate import generate_tokens
    from ..store import Store, StoreOptions

    store = Store(folder, StoreOptions(row_format="q8"))
    print("   greedy continuations (64 tokens) after a q8 restore, against the session that never stopped:")
    for n in (512, 1024, 2048):
        s = engine.session(kv_dtype=kv, sampler=GREEDY)
        store.restore(store.longest_prefix(ids[:n], engine, kv), s)
        if s.logits is None:  # a chunk boundary: the last token's logits are computed again
            s.truncate(n - 1)
            s.prefill(ids[n - 1 : n])
        if n == len(ids):
            ref = live.fork()
        else:
            ref = engine.session(kv_dtype=kv, sampler=GREEDY)
            ref.prefill(ids[:n])
        a = list(generate_tokens(ref, 64, ignore_eos=True))
        b = list(generate_tokens(s, 64, ignore_eos=True))
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), 64)
        print(f"     after {n:>5} tokens: {sum(x == y for x, y in zip(a, b))}/64 equal, identical for the first {first}")


def _agreement_after_round_trip(engine: Engine, kv: str) -> None:
    """Teacher-forced argmax agreement with llama.cpp (the committed vectors) after the first 128..512 tokens
    went through a row format: exact, q8 (blocks of 32), and one scale per row for the record."""
    from ..kv.rows import q8_decode, q8_encode

    vectors = Path(__file__).resolve().parents[3] / "tests" / "vectors" / "smollm2-135m-instruct-q4_1.json"
    if not vectors.exists() or engine.path.name != "SmolLM2-135M-Instruct.Q4_1.gguf":
        print("   (agreement with llama.cpp: needs SmolLM2 and tests/vectors from a checkout)")
        return
    ref = json.loads(vectors.read_text())
    ids, top1 = ref["teacher_forced"]["ids"], np.array(ref["teacher_forced"]["top5"])[:, 0]
    dtype = KV_DTYPES[kv]

    def round_trip(s: Session, block: int | None) -> Session:
        if block is None:
            return s
        rows = {}
        for layer in s.state().layers:
            out = []
            for a in layer.read():
                x = q8_decode(*q8_encode(a, dtype, block)).view(a.shape).to(dtype)
                out.append(x.view(torch.int16).numpy().view(np.uint16) if dtype == torch.bfloat16 else x.numpy())
            rows[layer.index] = [(layer.start, *out)]
        t = engine.session(kv_dtype=kv)
        t.restore_rows(s.tokens, rows, s.logits, keep=0)
        return t

    values = engine.config.n_kv_heads * engine.config.head_dim
    print(f"   teacher-forced argmax agreement with llama.cpp after a round trip (KV {kv}; llama.cpp f16 vs f32 "
          "KV: 95.3%):")
    for name, block in (("exact", None), ("q8, blocks of 32", 32), ("q8, one scale per row", values)):
        agree = total = 0
        for split in (128, 256, 384, 512):
            s = engine.session(kv_dtype=kv)
            s.prefill(ids[:split])
            s = round_trip(s, block)
            logits = s.score(ids[split:])
            agree += int((logits.float().argmax(-1).cpu().numpy() == top1[split:]).sum())
            total += len(ids) - split
        print(f"     {name:<22} {agree / total:.2%} of {total} positions")


def _compressors(folders: dict[str, Path]) -> None:
    """What a general compressor gains on chunk files of each row format: ratio, compress and decompress speed."""
    codecs = []
    if importlib.util.find_spec("zstandard"):
        import zstandard

        for level in (1, 3):
            codecs.append((f"zstd -{level}", zstandard.ZstdCompressor(level=level).compress,
                           zstandard.ZstdDecompressor().decompress))
    if importlib.util.find_spec("lz4"):
        import lz4.frame

        codecs.append(("lz4", lz4.frame.compress, lz4.frame.decompress))
    if not codecs:
        print("   (compressors: pip install zstandard lz4 to measure them)")
        return
    print("   general compressors on the chunk files (one 2,048-token session): size after / before, MB/s")
    for fmt, folder in folders.items():
        blobs = [p.read_bytes() for p in sorted((folder / "chunks").iterdir())]
        raw = sum(map(len, blobs))
        for name, compress, decompress in codecs:
            t0 = time.perf_counter()
            packed = [compress(b) for b in blobs]
            t1 = time.perf_counter()
            for b in packed:
                decompress(b)
            t2 = time.perf_counter()
            print(f"     {fmt:<6} {name:<8} {sum(map(len, packed)) / raw:.3f}   compress {raw / (t1 - t0) / 1e6:>6,.0f}"
                  f"   decompress {raw / (t2 - t1) / 1e6:>6,.0f}")


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
