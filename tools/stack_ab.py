"""A decode step through the C decode stack against the same step layer by layer, in one process.

usage: .venv/bin/python tools/stack_ab.py MODEL [CONTEXT] [STEPS] [ROUNDS]

Prefills CONTEXT tokens (512) of the bench corpus, decodes two steps to warm
up, then times STEPS steps (12) with the stack and without it (the model's
layers one by one, as a model the stack cannot take decodes), alternating,
ROUNDS times (2). Prints the milliseconds a step of each round. Both run on
the same weights in the same process, so the host's drift between two runs
of a bench does not enter the comparison.
"""
from __future__ import annotations

import sys
import time

from kvsession.bench.corpus import corpus_tokens
from kvsession.engine import Engine


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    model = sys.argv[1]
    context, steps, rounds = (int(a) for a in (sys.argv[2:] + ["512", "12", "2"][len(sys.argv) - 2 :])[:3])
    engine = Engine.load(model)
    stack = engine.model.stack
    if stack is None:
        raise SystemExit(f"{model}: the decode stack does not take this model")
    times: dict[str, list[float]] = {"stack": [], "layer by layer": []}
    for _ in range(rounds):
        for name in times:
            engine.model.stack = stack if name == "stack" else None
            session = engine.session()
            session.prefill(corpus_tokens(engine, context))
            for _ in range(2):
                session.append(session.sample())
            t0 = time.perf_counter()
            for _ in range(steps):
                session.append(session.sample())
            times[name].append((time.perf_counter() - t0) / steps * 1000)
    engine.model.stack = stack
    for name, ms in times.items():
        print(f"{name:>15}: {', '.join(f'{x:.1f}' for x in ms)} ms a step")


if __name__ == "__main__":
    main()
