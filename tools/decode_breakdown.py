"""Where a decode step goes: the layer stack, the output head, and the rest (BENCHMARKS.md, "Kernels").

usage: .venv/bin/python tools/decode_breakdown.py MODEL [CONTEXT] [STEPS]

Prefills CONTEXT tokens (2048) of the bench corpus, decodes STEPS tokens (16)
with the default sampler, and prints the wall time a step spends in each C
kernel entry point (timed from Python around the calls) and in all.
"""
from __future__ import annotations

import collections
import sys
import time

from kvsession import kernels
from kvsession.bench.corpus import corpus_tokens
from kvsession.engine import Engine


def main() -> None:
    model = sys.argv[1]
    context = int(sys.argv[2]) if len(sys.argv) > 2 else 2048
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    engine = Engine.load(model)
    session = engine.session()
    session.prefill(corpus_tokens(engine, context))
    for _ in range(4):  # warm-up
        session.append(session.sample())
    spent: collections.Counter = collections.Counter()
    calls = kernels._kernels

    class Timed:  # the kernels module, each entry point timed
        def __getattr__(self, name):
            f = getattr(calls, name)

            def timed(*args):
                t0 = time.perf_counter()
                try:
                    return f(*args)
                finally:
                    spent[name] += time.perf_counter() - t0
            return timed

    kernels._kernels = Timed()
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            session.append(session.sample())
        total = (time.perf_counter() - t0) / steps
    finally:
        kernels._kernels = calls
    print(f"{model} after {context} tokens, ms a step: total {total * 1e3:.2f}, "
          f"layer stack (run) {spent['run'] / steps * 1e3:.2f}, output head (matmul) {spent['matmul'] / steps * 1e3:.2f}, "
          f"embedding (gather) {spent['gather'] / steps * 1e3:.2f}, rest "
          f"{(total - sum(spent.values()) / steps) * 1e3:.2f}")


if __name__ == "__main__":
    main()
