"""llama.cpp's side of `kvsession bench`, run as a script by a Python that has llama-cpp-python.

usage: PEER_PYTHON bench/peer.py MODEL.gguf THREADS N_DECODE REPEAT IDS_JSON

IDS_JSON holds {"contexts": [[token ids], ...]}: the exact tokens kvsession
measured, so both sides prefill the same sequences. For each context it
prints the medians over REPEAT runs as `ctx=N prefill_tps=... decode_tps=...
file_bytes=... save_ms=... load_ms=...` (the last three for llama.cpp's state
files after the decode), then `load_s=...` (the model's load) and `peak_rss_mb=...`. It
imports nothing from kvsession: the peer's environment need not have it.
"""
import ctypes
import json
import os
import statistics
import sys
import tempfile
import time

import llama_cpp
from llama_cpp import Llama


def save_load(llm: Llama, path: str) -> dict:
    """llama.cpp's own session files: llama_state_save_file / llama_state_load_file (no fsync, no checksum)."""
    ids = llm._input_ids.tolist()
    arr = (llama_cpp.llama_token * len(ids))(*ids)
    t0 = time.perf_counter()
    llama_cpp.llama_state_save_file(llm._ctx.ctx, path.encode(), arr, len(ids))
    save = time.perf_counter() - t0
    out = (llama_cpp.llama_token * (len(ids) + 1))()
    count = ctypes.c_size_t(0)
    t0 = time.perf_counter()
    llama_cpp.llama_state_load_file(llm._ctx.ctx, path.encode(), out, len(ids) + 1, ctypes.byref(count))
    load = time.perf_counter() - t0
    return {"file_bytes": os.path.getsize(path), "save_ms": save * 1e3, "load_ms": load * 1e3}


def main() -> None:
    model, threads, n_decode, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    ids_file = sys.argv[5]
    contexts = json.load(open(ids_file))["contexts"]
    longest = max(len(c) for c in contexts)
    t0 = time.perf_counter()
    llm = Llama(model_path=model, n_ctx=longest + n_decode + 64, n_threads=threads, n_batch=512, verbose=False)
    load_s = time.perf_counter() - t0
    llm.eval(contexts[0][:8])  # warm-up, as kvsession's side does
    state = os.path.join(tempfile.mkdtemp(), "state.bin")
    for ids in contexts:
        runs = []
        for _ in range(repeat):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            prefill = len(ids) / (time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(n_decode):
                llm.eval([llm.sample(temp=0.0)])
            decode = n_decode / (time.perf_counter() - t0)
            runs.append({"prefill_tps": prefill, "decode_tps": decode, **save_load(llm, state)})
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"ctx={len(ids)} " + " ".join(f"{k}={v:.1f}" for k, v in med.items()), flush=True)
    # VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork and exec
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(f"load_s={load_s:.3f}")
    print(f"peak_rss_mb={hwm / 1024:.0f}")


if __name__ == "__main__":
    main()
