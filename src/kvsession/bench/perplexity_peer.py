"""llama.cpp's side of `kvsession perplexity --peer-python`, run by a Python that has llama-cpp-python.

usage: PEER_PYTHON perplexity_peer.py MODEL.gguf TEXT_FILE CTX THREADS CHUNKS

llama-perplexity's algorithm (see perplexity.py) through llama-cpp-python:
the text tokenized once with BOS as the vocabulary says, chunks of CTX
tokens each evaluated from an empty cache with its first token replaced by
BOS, the second half of each scored. CHUNKS > 0 stops after that many. It
prints one JSON line: {"ppl", "error", "running" (the estimate after each
chunk), "n_tokens", "seconds"}. It imports nothing from kvsession: the
peer's environment need not have it.
"""
import json
import math
import sys
import time

import numpy as np
from llama_cpp import Llama


def chunk_nll(llm: Llama, chunk: list) -> np.ndarray:
    llm.reset()
    llm.eval(chunk)
    n_ctx, first = len(chunk), len(chunk) // 2
    logits = np.asarray(llm.scores[first : n_ctx - 1], dtype=np.float64)  # [n_ctx - 1 - first, vocab]
    logits -= logits.max(axis=1, keepdims=True)
    lse = np.log(np.exp(logits).sum(axis=1))
    targets = np.asarray(chunk[first + 1 : n_ctx])
    return lse - logits[np.arange(len(targets)), targets]


def main() -> None:
    model, text_file, n_ctx, threads, limit = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
        int(sys.argv[5])
    llm = Llama(model_path=model, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads, n_threads_batch=threads,
                logits_all=True, verbose=False)
    with open(text_file, encoding="utf-8") as f:
        text = f.read()
    tokens = llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)
    add_bos = llm.tokenize(b"", add_bos=True, special=False) == [llm.token_bos()]
    n_chunks = len(tokens) // n_ctx if limit <= 0 else min(limit, len(tokens) // n_ctx)
    nll = nll2 = 0.0
    count = 0
    running = []
    t0 = time.perf_counter()
    for i in range(n_chunks):
        chunk = tokens[i * n_ctx : (i + 1) * n_ctx]
        if add_bos:
            chunk[0] = llm.token_bos()
        v = chunk_nll(llm, chunk)
        nll += float(v.sum())
        nll2 += float((v * v).sum())
        count += len(v)
        running.append(math.exp(nll / count))
    mean = nll / count
    ppl = math.exp(mean)
    var = nll2 / count - mean * mean
    error = math.sqrt(var / (count - 1)) * ppl if var > 0 and count > 1 else 0.0
    print(json.dumps({"ppl": ppl, "error": error, "running": running, "n_tokens": len(tokens),
                      "seconds": time.perf_counter() - t0}))


if __name__ == "__main__":
    main()
