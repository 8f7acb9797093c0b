"""The figures of a GPU: session save/restore against the machine's limits, TTFT restored vs recomputed,
prefill and decode against Hugging Face transformers and against the memory-bandwidth bound, aggregate decode
tokens/s of 1, 4 and 16 concurrent streams (the server's batched decode).

    python tools/gpu_bench.py --out DIR                       # on the lent H200 (tools/gpu_check.sh runs it)
    python tools/gpu_bench.py --out DIR --device cpu --small  # a smoke run of the script itself, anywhere
    python tools/gpu_bench.py --out DIR --profile             # where the time goes: profile.txt (torch.profiler)

The device machine reaches no registry and the packaged models are far over
what a call may carry, so the model is written here: a GGUF of
Qwen2.5-Coder-1.5B's shape (qwen2, 28 layers, d_model 1536, 12 heads, 2 KV
heads of 128, d_ff 8960, 151,936 tokens, tied embeddings, f16 weights) with
random weights. Speeds and bytes depend on the shapes and dtypes only; the
tokens are random ids.

Limits, measured in the same run: pinned host<->device copies of 1 GiB
(CUDA events), the device memory's read bandwidth (a sum over 4 GiB), the
disk's write speed (2 GiB, fsynced, as a durable save is) and read speed
(after dropping the page cache where the kernel lets us, unless told not
to; else from it, and said so). Save targets the slower of device->host and disk write; restore
the slower of host->device and disk read.

transformers' model is built from the same configuration (Qwen2ForCausalLM,
bfloat16, SDPA) rather than loaded from the GGUF: its GGUF loader
dequantizes 1.5B weights in numpy, minutes of the device's time for no
difference in speed.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from tiny import TinySpec, write_tiny  # noqa: E402

from kvsession.engine import Engine  # noqa: E402
from kvsession.generate import generate_tokens  # noqa: E402
from kvsession.sampling import GREEDY  # noqa: E402
from kvsession.session import Session, advance  # noqa: E402

QWEN_1_5B = TinySpec(arch="qwen2", n_layers=28, d_model=1536, n_heads=12, n_kv_heads=2, d_ff=8960, context=40960,
                     rope_base=1e6, weight_type="F16", vocab=151936, weight_scale=0.02, seed=13)
SMALL = TinySpec(arch="qwen2", n_layers=4, d_model=256, n_heads=4, n_kv_heads=2, d_ff=512, context=4096,
                 rope_base=1e6, weight_type="F16", vocab=2048, seed=13)
GiB = 1 << 30


def log(*a) -> None:
    print(*a, flush=True)


class Clock:
    """Wall time of a block, the device's queued work included."""

    def __init__(self, device: torch.device):
        self.device = device

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time(self, fn, reps: int = 3, before=None) -> float:
        """Median seconds of fn() over reps runs (before() runs first each time, untimed)."""
        times = []
        for _ in range(reps):
            if before:
                before()
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)


def drop_page_cache() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def machine_limits(device: torch.device, folder: Path, clock: Clock, small: bool, drop: bool) -> dict:
    out = {}
    n = (64 << 20) if small else GiB
    if device.type == "cuda":
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(n, dtype=torch.uint8, device=device)
        out["h2d_pinned_GBps"] = n / clock.time(lambda: dev.copy_(host, non_blocking=True), 5) / 1e9
        out["d2h_pinned_GBps"] = n / clock.time(lambda: host.copy_(dev, non_blocking=True), 5) / 1e9
        pageable = torch.empty(n, dtype=torch.uint8)
        out["h2d_pageable_GBps"] = n / clock.time(lambda: dev.copy_(pageable), 3) / 1e9
        big = torch.empty(4 * GiB // 2, dtype=torch.bfloat16, device=device).fill_(1)
        out["hbm_read_GBps"] = big.numel() * 2 / clock.time(lambda: big.sum(), 5) / 1e9
        del host, dev, pageable, big
        torch.cuda.empty_cache()
    size = (256 << 20) if small else 2 * GiB
    block = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
    path = folder / "disk.probe"

    def write() -> None:
        with open(path, "wb") as f:
            for _ in range(size // block.nbytes):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())

    out["disk_write_GBps"] = size / clock.time(write, 2) / 1e9
    buf = bytearray(64 << 20)

    def read() -> None:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass

    out["page_cache_dropped"] = drop and drop_page_cache()
    t0 = time.perf_counter()
    read()
    out["disk_read_GBps"] = size / (time.perf_counter() - t0) / 1e9
    out["page_cache_read_GBps"] = size / clock.time(read, 3) / 1e9
    path.unlink()
    return out


def session_figures(engine: Engine, contexts: list[int], folder: Path, limits: dict, clock: Clock) -> list[dict]:
    rng = np.random.default_rng(1)
    vocab = engine.config.vocab_size
    rows = []
    for ctx in contexts:
        ids = rng.integers(0, vocab, ctx + 32).tolist()
        s = engine.session(max_tokens=ctx + 64, sampler=GREEDY)
        t0 = time.perf_counter()
        s.prefill(ids[:ctx])
        clock.sync()
        prefill_s = time.perf_counter() - t0
        row = {"context": ctx, "prefill_s": prefill_s}
        path = folder / f"s{ctx}.kvs"
        for mode in ("auto", "sync"):
            row[f"save_{mode}_s"] = clock.time(lambda: s.save(path, transfer=mode))
        row["bytes"] = path.stat().st_size

        cold = drop_page_cache if limits.get("page_cache_dropped") else None
        for mode in ("auto", "sync"):
            row[f"restore_{mode}_s"] = clock.time(lambda: Session.load(path, engine, max_tokens=ctx + 64,
                                                                       transfer=mode))
            if cold:
                row[f"restore_{mode}_cold_s"] = clock.time(lambda: Session.load(path, engine, max_tokens=ctx + 64,
                                                                                transfer=mode), before=cold)

        # the next turn: 32 new tokens after the context, restored from disk (cold where we can) vs recomputed
        def restored() -> None:
            t = Session.load(path, engine, max_tokens=ctx + 64)
            t.prefill(ids[ctx:])
            t.sample()

        def recomputed() -> None:
            t = engine.session(max_tokens=ctx + 64)
            t.prefill(ids)
            t.sample()

        row["ttft_restored_s"] = clock.time(restored, before=cold)
        row["ttft_recomputed_s"] = clock.time(recomputed, 1)
        gb = row["bytes"] / 1e9
        save_limit = min(limits.get("d2h_pinned_GBps", float("inf")), limits["disk_write_GBps"])
        read = limits["disk_read_GBps"] if limits.get("page_cache_dropped") else limits["page_cache_read_GBps"]
        restore_limit = min(limits.get("h2d_pinned_GBps", float("inf")), read)
        row["save_GBps"] = gb / row["save_auto_s"]
        row["save_vs_limit"] = row["save_auto_s"] / (gb / save_limit)
        key = "restore_auto_cold_s" if limits.get("page_cache_dropped") else "restore_auto_s"
        row["restore_GBps"] = gb / row[key]
        row["restore_vs_limit"] = row[key] / (gb / restore_limit)
        row["ttft_speedup"] = row["ttft_recomputed_s"] / row["ttft_restored_s"]
        log(json.dumps(row))
        rows.append(row)
        path.unlink()
        s = None  # its cache goes back to the allocator before the next context
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def weight_bytes(engine: Engine) -> int:
    """Bytes of the dense matrices one decode step reads (every layer's, and the output head)."""
    seen = 0
    for b in engine.model.blocks:
        for lin in (b.wqkv, b.wo, b.wgu, b.wdown):
            seen += lin.weight.numel() * lin.weight.element_size()
    head = engine.model.output.weight
    return seen + head.numel() * head.element_size()


def ours_speed(engine: Engine, prompt: list[int], decode: int, clock: Clock) -> dict:
    out = {}
    for graphs in (False, True):
        engine.graphs = graphs
        s = engine.session(max_tokens=len(prompt) + decode + 8, sampler=GREEDY)
        t0 = time.perf_counter()
        s.prefill(prompt)
        clock.sync()
        out["prefill_tok_s"] = len(prompt) / (time.perf_counter() - t0)
        list(generate_tokens(s, 4, ignore_eos=True))  # graphs captured
        clock.sync()
        t0 = time.perf_counter()
        list(generate_tokens(s, decode, ignore_eos=True))
        clock.sync()
        out["decode_graphs_tok_s" if graphs else "decode_eager_tok_s"] = decode / (time.perf_counter() - t0)
    engine.graphs = engine.device.type == "cuda"
    return out


def streams_speed(engine: Engine, counts: list[int], context: int, steps: int, clock: Clock) -> dict:
    """Aggregate decode tokens/s of n sessions stepped together (session.advance: one pass through the model
    for all of them, as the server's running set goes), each at `context` tokens, greedy."""
    rng = np.random.default_rng(3)
    out = {}
    for n in counts:
        sessions = []
        for _ in range(n):
            s = engine.session(max_tokens=context + steps + 8, sampler=GREEDY)
            s.prefill(rng.integers(0, engine.config.vocab_size, context).tolist())
            sessions.append(s)

        def step() -> None:
            nxt = torch.stack([s.logits for s in sessions]).argmax(-1).tolist()
            advance([(s, [t]) for s, t in zip(sessions, nxt)])

        for _ in range(2):
            step()
        clock.sync()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        clock.sync()
        out[str(n)] = n * steps / (time.perf_counter() - t0)
        log(f"{n} streams at {context} tokens: {out[str(n)]:,.1f} tok/s together")
        sessions = None
        if engine.device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def profile(engine: Engine, out: Path, clock: Clock, small: bool) -> None:
    """Where prefill and decode spend their time: prefill speed by chunk size, then torch.profiler's top
    operators (device and host time) for a prefill, eager and graph decode steps and a 4-stream step."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprofile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    n = 1024 if small else 8192
    ids = np.random.default_rng(4).integers(0, engine.config.vocab_size, n).tolist()
    report = []

    def tables(p, what: str) -> None:
        ka = p.key_averages()
        for key in (("cuda_time_total", "self_cpu_time_total") if engine.device.type == "cuda"
                    else ("self_cpu_time_total",)):
            report.append(f"## {what}, by {key}\n{ka.table(sort_by=key, row_limit=22)}")

    for chunk in (256, 512, 2048, n):
        engine.session(max_tokens=n + 8).prefill(ids[:chunk], chunk_size=chunk)  # warm this shape
        s = engine.session(max_tokens=n + 8)
        clock.sync()
        t0 = time.perf_counter()
        s.prefill(ids, chunk_size=chunk)
        clock.sync()
        report.append(f"prefill {n} tokens, chunks of {chunk}: {n / (time.perf_counter() - t0):,.0f} tok/s")
        log(report[-1])
    with tprofile(activities=acts) as p:
        engine.session(max_tokens=n + 8).prefill(ids[:2048])
        clock.sync()
    tables(p, "prefill 2048 tokens, chunks of 512")
    for graphs in (False, True):
        engine.graphs = graphs
        s = engine.session(max_tokens=n + 64, sampler=GREEDY)
        s.prefill(ids[:1024])
        list(generate_tokens(s, 4, ignore_eos=True))
        with tprofile(activities=acts) as p:
            list(generate_tokens(s, 16, ignore_eos=True))
            clock.sync()
        tables(p, f"16 decode steps at 1k, {'CUDA graphs' if graphs else 'eager'}")
    engine.graphs = engine.device.type == "cuda"
    sessions = [engine.session(max_tokens=n + 64, sampler=GREEDY) for _ in range(4)]
    for s in sessions:
        s.prefill(ids[:1024])
    advance([(s, [1]) for s in sessions])
    with tprofile(activities=acts) as p:
        for _ in range(8):
            advance([(s, [1]) for s in sessions])
        clock.sync()
    tables(p, "8 batched decode steps of 4 streams at 1k")
    (out / "profile.txt").write_text("\n\n".join(report) + "\n")
    log(f"profile written: {out / 'profile.txt'}")


def transformers_speed(spec: TinySpec, prompt: list[int], decode: int, device: torch.device, clock: Clock) -> dict:
    try:
        from transformers import Qwen2Config, Qwen2ForCausalLM
    except ImportError as e:
        return {"error": f"transformers: {e}"}
    cfg = Qwen2Config(vocab_size=spec.vocab, hidden_size=spec.d_model, intermediate_size=spec.d_ff,
                      num_hidden_layers=spec.n_layers, num_attention_heads=spec.n_heads,
                      num_key_value_heads=spec.n_kv_heads, max_position_embeddings=spec.context,
                      rope_theta=spec.rope_base, tie_word_embeddings=True)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.tensor([prompt], device=device)
    out = {}
    with torch.inference_mode():
        model(ids[:, :16])  # warm-up
        out["prefill_tok_s"] = len(prompt) / clock.time(lambda: model(ids, use_cache=True), 3)
        prefill_s = len(prompt) / out["prefill_tok_s"]
        total = clock.time(lambda: model.generate(ids, max_new_tokens=decode, min_new_tokens=decode,
                                                  do_sample=False), 1)
        out["decode_tok_s"] = decode / max(total - prefill_s, 1e-9)
    model = None
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_bench.json and gpu_bench.md")
    ap.add_argument("--work", type=Path, default=Path("/tmp/kvsession-gpu-bench"),
                    help="folder for the session files and the disk probe (on the disk to measure)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--small", action="store_true", help="a small model and short contexts: checks the script")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--profile", action="store_true", help="profile prefill and decode (profile.txt) instead "
                    "of the figures, on a model of the same shapes with 8 layers")
    ap.add_argument("--keep-page-cache", action="store_true",
                    help="never drop the page cache (the whole machine's) for cold reads: restores read it warm")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    # the model in a folder of this run's own: two runs at once (two test suites on one machine) must not write
    # one file under each other
    with tempfile.TemporaryDirectory(prefix="kvsession-gpu-bench-") as models:
        return run(args, Path(models))


def run(args: argparse.Namespace, models: Path) -> int:
    device = torch.device(args.device)
    clock = Clock(device)
    spec = SMALL if args.small else QWEN_1_5B
    if args.profile and not args.small:
        spec = dataclasses.replace(spec, n_layers=8)  # the same per-layer work, a quarter of the file to write
    contexts = [256, 1024] if args.small else [int(c) for c in args.contexts.split(",")]
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"torch": torch.__version__, "device": str(device),
                    "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "spec": str(spec)}
    log("versions:", result)
    t0 = time.perf_counter()
    model_path = write_tiny(models / f"gpu_bench_{'small' if args.small else 'qwen1.5b'}_{spec.n_layers}.gguf", spec)
    result["model_write_s"] = time.perf_counter() - t0
    log(f"model written in {result['model_write_s']:.1f} s: {model_path.stat().st_size / 1e9:.2f} GB")
    if args.profile:
        profile(Engine.load(model_path, device=device, precision="bf16" if device.type == "cuda" else "f32"),
                args.out, clock, args.small)
        return 0
    result["limits"] = machine_limits(device, work, clock, args.small, not args.keep_page_cache)
    log("limits:", json.dumps(result["limits"]))
    t0 = time.perf_counter()
    engine = Engine.load(model_path, device=device, precision="bf16" if device.type == "cuda" else "f32")
    result["engine_load_s"] = time.perf_counter() - t0
    log(f"engine loaded in {result['engine_load_s']:.1f} s")
    result["sessions"] = session_figures(engine, contexts, work, result["limits"], clock)
    prompt = np.random.default_rng(2).integers(0, spec.vocab, 2048 if not args.small else 256).tolist()
    decode = 128 if not args.small else 16
    result["ours"] = ours_speed(engine, prompt, decode, clock)
    result["weight_bytes_per_token"] = weight_bytes(engine)
    hbm = result["limits"].get("hbm_read_GBps")
    if hbm:
        result["decode_bound_tok_s"] = hbm * 1e9 / result["weight_bytes_per_token"]
    log("ours:", json.dumps(result["ours"]))
    try:
        result["streams_tok_s"] = streams_speed(engine, [1, 4] if args.small else [1, 4, 16], len(prompt),
                                                16 if args.small else 64, clock)
    except Exception as e:  # the figures above still come back
        result["streams_error"] = repr(e)
        log("streams failed:", repr(e))
    del engine
    if not args.skip_transformers:
        try:
            result["transformers"] = transformers_speed(spec, prompt, decode, device, clock)
        except Exception as e:
            result["transformers"] = {"error": repr(e)}
        log("transformers:", json.dumps(result["transformers"]))
    (args.out / "gpu_bench.json").write_text(json.dumps(result, indent=1))
    (args.out / "gpu_bench.md").write_text(report(result))
    log(report(result))
    return 0


def report(r: dict) -> str:
    lim = r["limits"]
    lines = [f"# GPU bench: {r.get('gpu') or r['device']}, torch {r['torch']}", "",
             "Limits: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in lim.items()),
             "", "| context | bytes | save s (overlapped / sync) | save GB/s, x limit | restore s (overlapped / sync) "
             "| restore GB/s, x limit | TTFT restored / recomputed s | speedup |", "|" + "---|" * 8]
    for s in r["sessions"]:
        lines.append(f"| {s['context']:,} | {s['bytes'] / 1e6:,.0f} MB "
                     f"| {s['save_auto_s']:.3f} / {s['save_sync_s']:.3f} "
                     f"| {s['save_GBps']:.2f}, {s['save_vs_limit']:.2f}x | {s['restore_auto_s']:.3f} / "
                     f"{s['restore_sync_s']:.3f} | {s['restore_GBps']:.2f}, {s['restore_vs_limit']:.2f}x "
                     f"| {s['ttft_restored_s']:.3f} / {s['ttft_recomputed_s']:.3f} | {s['ttft_speedup']:.1f}x |")
    o, t = r["ours"], r.get("transformers", {})
    lines += ["", f"Prefill tok/s: ours {o['prefill_tok_s']:,.0f}, transformers {t.get('prefill_tok_s', 0):,.0f}",
              f"Decode tok/s: ours {o['decode_graphs_tok_s']:,.1f} with CUDA graphs ({o['decode_eager_tok_s']:,.1f} "
              f"eager), transformers {t.get('decode_tok_s', 0):,.1f}, bound "
              f"{r.get('decode_bound_tok_s', 0):,.0f} ({r['weight_bytes_per_token'] / 1e9:.2f} GB a token)",
              "Concurrent streams, aggregate decode tok/s: "
              + ", ".join(f"{n}: {v:,.1f}" for n, v in r.get("streams_tok_s", {}).items())]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
