"""llama.cpp's side of `kvsession bench`, run as a script by a Python that has llama-cpp-python.

usage: PEER_PYTHON bench_peer.py MODEL.gguf THREADS N_DECODE REPEAT IDS_JSON

IDS_JSON holds {"contexts": [[token ids], ...]}: the exact tokens kvsession
measured, so both sides prefill the same sequences. For each context it
prints the median over REPEAT runs as `ctx=N prefill_tps=... decode_tps=...`, then `peak_rss_mb=...`. It
imports nothing from kvsession: the peer's environment need not have it.
"""
import json
import statistics
import sys
import time

from llama_cpp import Llama


def main() -> None:
    model, threads, n_decode, repeat = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    ids_file = sys.argv[5]
    contexts = json.load(open(ids_file))["contexts"]
    longest = max(len(c) for c in contexts)
    llm = Llama(model_path=model, n_ctx=longest + n_decode + 64, n_threads=threads, n_batch=512, verbose=False)
    llm.eval(contexts[0][:8])  # warm-up, as kvsession's side does
    for ids in contexts:
        prefill, decode = [], []
        for _ in range(repeat):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(ids)
            prefill.append(len(ids) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for _ in range(n_decode):
                llm.eval([llm.sample(temp=0.0)])
            decode.append(n_decode / (time.perf_counter() - t0))
        print(f"ctx={len(ids)} prefill_tps={statistics.median(prefill):.1f} "
              f"decode_tps={statistics.median(decode):.1f}", flush=True)
    # VmHWM, not ru_maxrss: the latter keeps the parent's peak across fork and exec
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    print(f"peak_rss_mb={hwm / 1024:.0f}")


if __name__ == "__main__":
    main()
