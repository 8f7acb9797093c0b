"""What tests and benchmarks start for real: a local valkey-server and a Valkey Cluster (valkey.py); and
wait_until, how they wait for a state (never for a time: a loaded machine makes every time longer)."""
from __future__ import annotations

import time


def wait_until(check, timeout: float, what: str) -> None:
    """Poll check() until it is true; RuntimeError(what) after timeout seconds (a bound, never a timing)."""
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} after {timeout:.0f} s")
        time.sleep(0.02)
