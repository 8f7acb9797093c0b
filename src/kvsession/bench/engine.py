"""`kvsession bench`: prefill and decode speed, and llama.cpp's on the same file in the same run.

A benchmark is a program that prints figures, never a test that passes or
fails on a noisy machine (STYLE.md rule 10). For each context size it
prefills that many tokens of the bundled corpus (bench/corpus.py), then
decodes greedily, `--repeat` times, and reports the median: this shared
two-core machine moves single runs by up to 2x. Where a Python with
llama-cpp-python is given (--peer-python, or llama_cpp importable here)
llama.cpp runs the same token ids in a subprocess (bench/peer.py) and the
ratios are printed.

`main` loads the model and runs the benchmark the flags name: this one, or
the disk KV cache's (--store, bench/store.py), its shared tier's (--shared,
bench/shared.py), the server's (--server, bench/server.py), constrained
decoding's (--grammar, bench/grammar.py) or attention's (--attention,
bench/attention.py).
"""
from __future__ import annotations

import csv
import importlib.util
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..engine import Engine
from ..errors import KvsessionError
from ..sampling import GREEDY
from ..session import Session
from .attention import attention_bench
from .corpus import corpus_tokens
from .grammar import grammar_bench
from .server import server_bench
from .shared import shared_bench
from .store import store_bench


def measure(engine: Engine, ids: list[int], n_decode: int, kv_dtype: str, repeat: int = 1) -> dict:
    """Median over `repeat` runs of prefilling ids, then decoding n_decode tokens greedily."""
    runs = [_measure_once(engine, ids, n_decode, kv_dtype) for _ in range(repeat)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def _measure_once(engine: Engine, ids: list[int], n_decode: int, kv_dtype: str) -> dict:
    s = engine.session(sampler=GREEDY, max_tokens=len(ids) + n_decode + 1, kv_dtype=kv_dtype)
    t0 = time.perf_counter()
    s.prefill(ids)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n_decode):
        s.append(s.sample())
    decode = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "bench.kvs"
        fast = s.save(path, durable=False)
        durable = s.save(path, durable=True)
        tokens = list(s.tokens)
        del s  # llama.cpp loads into its one context: the resumed session is the only one alive, here too
        t0 = time.perf_counter()
        loaded = Session.load(path, engine)
        load = time.perf_counter() - t0
    assert loaded.tokens == tokens
    return {"ctx": len(ids), "prefill_tps": len(ids) / prefill, "decode_tps": n_decode / decode,
            "file_bytes": fast.bytes, "save_ms": fast.seconds * 1e3, "save_fsync_ms": durable.seconds * 1e3,
            "load_ms": load * 1e3}


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM): unlike ru_maxrss it does not carry a parent's peak across exec."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def peer_python(arg: str | None) -> str | None:
    if arg:
        return arg
    if os.environ.get("KVSESSION_PEER_PYTHON"):
        return os.environ["KVSESSION_PEER_PYTHON"]
    return sys.executable if importlib.util.find_spec("llama_cpp") else None


def measure_peer(python: str, model: Path, contexts: list[list[int]], threads: int, n_decode: int,
                 repeat: int) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"contexts": contexts}, f)
    try:
        out = subprocess.run(
            [python, str(Path(__file__).parent / "peer.py"), str(model), str(threads), str(n_decode), str(repeat), f.name],
            capture_output=True, text=True, timeout=3600,
        )
    finally:
        os.unlink(f.name)
    if out.returncode != 0:
        raise KvsessionError(f"llama.cpp peer failed ({python}): {out.stderr.strip()[-500:]}")
    rows, rss, load = {}, None, None
    for line in out.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=([\d.]+)", line))
        if "ctx" in fields:
            rows[int(fields["ctx"])] = {k: float(v) for k, v in fields.items() if k != "ctx"}
        elif "peak_rss_mb" in fields:
            rss = float(fields["peak_rss_mb"])
        elif "load_s" in fields:
            load = float(fields["load_s"])
    return {"rows": rows, "peak_rss_mb": rss, "load_s": load}


def main(args) -> int:
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        raise KvsessionError(f"--contexts: expected numbers separated by commas, got {args.contexts!r}") from None
    if args.plot:
        check_plot_target(args.plot)  # before minutes of measuring, not after
    t0 = time.perf_counter()
    engine = Engine.load(args.model, device=args.device, precision=args.precision)
    load_s = time.perf_counter() - t0
    if args.store:
        return store_bench(engine, args)
    if args.shared:
        return shared_bench(engine, args)
    if args.server:
        return server_bench(engine, args)
    if args.grammar:
        return grammar_bench(engine, args)
    if args.attention:
        return attention_bench(engine, args, contexts, threads)
    print(f"model   {engine.path.name} ({engine.config.arch}, {engine.config.n_layers} layers)")
    print(f"engine  kvsession, {engine.device}, precision {args.precision}, {threads} threads, "
          f"KV {args.kv_dtype}, torch {torch.__version__}, load {load_s:.2f} s")
    measure(engine, corpus_tokens(engine, 64), 4, args.kv_dtype)  # warm-up: first calls allocate and pick kernels
    ids_by_ctx = {n: corpus_tokens(engine, n) for n in contexts}
    ours = {n: measure(engine, ids_by_ctx[n], args.decode_tokens, args.kv_dtype, args.repeat) for n in contexts}
    our_rss = peak_rss_mb()
    peer = None
    python = None if args.no_peer else peer_python(args.peer_python)
    if python:
        peer = measure_peer(python, engine.path, [ids_by_ctx[n] for n in contexts], threads, args.decode_tokens,
                            args.repeat)
    rows = []
    for n in contexts:
        row = dict(ours[n])
        if peer and n in peer["rows"]:
            p = peer["rows"][n]
            row |= {f"peer_{k}": v for k, v in p.items()}
            row |= {"prefill_ratio": row["prefill_tps"] / p["prefill_tps"],
                    "decode_ratio": row["decode_tps"] / p["decode_tps"],
                    "bytes_ratio": row["file_bytes"] / p["file_bytes"],
                    "save_ratio": row["save_ms"] / p["save_ms"], "load_ratio": row["load_ms"] / p["load_ms"]}
        rows.append(row)
    _print_table(rows, peer is not None)
    _print_session_table(rows, peer is not None)
    print(f"peak RSS: kvsession {our_rss:.0f} MB" + (f", llama.cpp {peer['peak_rss_mb']:.0f} MB "
                                                    f"({our_rss / peer['peak_rss_mb']:.2f}x)" if peer else ""))
    print(f"load: kvsession {load_s:.2f} s" + (f", llama.cpp {peer['load_s']:.2f} s" if peer and peer["load_s"] else ""))
    if not python and not args.no_peer:
        print("(llama.cpp not measured: pass --peer-python PYTHON with llama-cpp-python installed)")
    if args.plot:
        plot(rows, args.plot, f"{engine.path.name}, {threads} threads, KV {args.kv_dtype}")
        print(f"wrote {args.plot}")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}, key=list(rows[-1]).index))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")
    return 0


PLOT_FORMATS = (".png", ".svg", ".pdf")


def check_plot_target(path: str) -> None:
    p = Path(path)
    if p.suffix.lower() not in PLOT_FORMATS:
        raise KvsessionError(f"--plot {path}: name a {', '.join(PLOT_FORMATS)} file")
    if p.is_dir():
        raise KvsessionError(f"--plot {path}: is a folder, not a file")
    if not p.absolute().parent.is_dir():
        raise KvsessionError(f"--plot {path}: no folder {p.absolute().parent}")


def plot(rows: list[dict], path: str, title: str) -> None:
    """Two panels against context length: (1) saving a session, restoring it, and recomputing it (prefilling
    the context again, what a restore saves), in ms on a log scale; (2) prefill and decode tokens/s.
    kvsession solid, llama.cpp dashed, where it was measured."""
    import matplotlib

    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt

    ctx = [r["ctx"] for r in rows]
    peer = all("peer_prefill_tps" in r for r in rows)
    fig, (times, speed) = plt.subplots(1, 2, figsize=(11, 4.2))
    series = [("save", "save_ms", "C0"), ("restore", "load_ms", "C1")]
    for label, key, color in series:
        times.plot(ctx, [r[key] for r in rows], "o-", color=color, label=f"kvsession {label}")
        if peer:
            times.plot(ctx, [r[f"peer_{key}"] for r in rows], "s--", color=color, label=f"llama.cpp {label}")
    times.plot(ctx, [r["ctx"] / r["prefill_tps"] * 1e3 for r in rows], "o-", color="C3", label="kvsession recompute")
    if peer:
        times.plot(ctx, [r["ctx"] / r["peer_prefill_tps"] * 1e3 for r in rows], "s--", color="C3",
                   label="llama.cpp recompute")
    times.set(xscale="log", yscale="log", xlabel="context (tokens)", ylabel="ms",
              title="session: save, restore, or recompute")
    for label, key, color in (("prefill", "prefill_tps", "C2"), ("decode", "decode_tps", "C4")):
        speed.plot(ctx, [r[key] for r in rows], "o-", color=color, label=f"kvsession {label}")
        if peer:
            speed.plot(ctx, [r[f"peer_{key}"] for r in rows], "s--", color=color, label=f"llama.cpp {label}")
    speed.set(xscale="log", xlabel="context (tokens)", ylabel="tokens/s", title="speed", ylim=(0, None))
    for ax in (times, speed):
        ax.set_xticks(ctx, [str(c) for c in ctx])
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _print_session_table(rows: list[dict], with_peer: bool) -> None:
    """Session files after context + decode: kvsession's (checksummed) against llama.cpp's state files."""
    print()
    head = f"{'tokens':>8} {'file MB':>8} {'save ms':>8} {'save+fsync':>11} {'load ms':>8}"
    if with_peer:
        head += f" {'llama.cpp MB':>13} {'save ms':>8} {'load ms':>8} {'bytes':>7} {'save':>7} {'load':>7}"
    print(head)
    for r in rows:
        line = (f"{r['ctx']:>8} {r['file_bytes'] / 1e6:>8.2f} {r['save_ms']:>8.1f} {r['save_fsync_ms']:>11.1f}"
                f" {r['load_ms']:>8.1f}")
        if "bytes_ratio" in r:
            line += (f" {r['peer_file_bytes'] / 1e6:>13.2f} {r['peer_save_ms']:>8.1f} {r['peer_load_ms']:>8.1f}"
                     f" {r['bytes_ratio']:>6.2f}x {r['save_ratio']:>6.2f}x {r['load_ratio']:>6.2f}x")
        print(line)


def _print_table(rows: list[dict], with_peer: bool) -> None:
    head = f"{'context':>8} {'prefill tok/s':>14} {'decode tok/s':>13}"
    if with_peer:
        head += f" {'llama.cpp prefill':>18} {'llama.cpp decode':>17} {'prefill ratio':>14} {'decode ratio':>13}"
    print(head)
    for r in rows:
        line = f"{r['ctx']:>8} {r['prefill_tps']:>14.1f} {r['decode_tps']:>13.1f}"
        if "prefill_ratio" in r:
            line += (f" {r['peer_prefill_tps']:>18.1f} {r['peer_decode_tps']:>17.1f}"
                     f" {r['prefill_ratio']:>13.2f}x {r['decode_ratio']:>12.2f}x")
        print(line)
