"""A process that puts sessions into a store, for the crash and concurrency tests.

usage: python store_worker.py MODEL STORE_DIR SEED COUNT BUDGET [async]
Puts COUNT sessions (forever when COUNT is 0), each a shared prefix plus a
suffix drawn from SEED, printing "put N" after each. Prints "ready" first.

With "async": one session that grows by a suffix at a time, each step
checkpointed with checkpoint_async (the writer thread writes while the
session grows on); when a checkpoint is on disk it prints "saved N", N its
tokens.
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
if sys.argv[6:] == ["async"]:
    s = engine.session()
    s.prefill(prefix)
    while (count == 0 or i < count) and len(s) < 480:
        s.prefill(rng.integers(3, 250, size=int(rng.integers(1, 24))).tolist())
        future = store.checkpoint_async(s, "continued")
        future.add_done_callback(lambda f: f.result() is not None and print(f"saved {f.result().n_tokens}",
                                                                           flush=True))
        i += 1
    store.close()
    sys.exit(0)
while count == 0 or i < count:
    suffix = rng.integers(3, 250, size=int(rng.integers(1, 60))).tolist()
    s = engine.session()
    s.prefill(prefix + suffix)
    store.put(s, "continued")
    i += 1
    print(f"put {i}", flush=True)
