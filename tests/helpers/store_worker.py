"""A process that puts sessions into a store, for the crash and concurrency tests.

usage: python store_worker.py MODEL STORE_DIR SEED COUNT BUDGET
Puts COUNT sessions (forever when COUNT is 0), each a shared prefix plus a
suffix drawn from SEED, printing "put N" after each. Prints "ready" first.
"""
import sys

import numpy as np

from kvsession.engine import Engine
from kvsession.store import Store, StoreOptions

model, folder, seed, count, budget = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
engine = Engine.load(model, device="cpu", precision="f32")
store = Store(folder, StoreOptions(chunk_tokens=16, min_tokens=16, budget_bytes=budget))
rng = np.random.default_rng(seed)
prefix = list(range(3, 3 + 40))
print("ready", flush=True)
i = 0
while count == 0 or i < count:
    suffix = rng.integers(3, 250, size=int(rng.integers(1, 60))).tolist()
    s = engine.session()
    s.prefill(prefix + suffix)
    store.put(s, "continued")
    i += 1
    print(f"put {i}", flush=True)
