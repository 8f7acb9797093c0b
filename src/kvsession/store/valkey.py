"""The shared tier: the store's chunks and manifests in Valkey, for a fleet of servers.

One machine's disk holds one machine's conversations. With a shared tier a
conversation checkpointed by one server restores on any other: the local
folder stays the first tier (every restore reads local files), Valkey the
second. This module is the connector, one tier (tier.py); what goes
through it and when -- write-through after a checkpoint, a read on a local
miss -- is tiering.py's.

    kvsession:ROOT:c:KEY    a chunk file, byte for byte as on disk
    kvsession:ROOT:m:KEY    a manifest file
    kvsession:ROOT:t:BASE   a hash: tail token ids (int32, little-endian) -> manifest key;
                            BASE is the chain key the manifests hang from (layout.py)

ROOT namespaces everything by model fingerprint, KV dtype, chunk size and
row format, so servers of other models or formats never meet.

Every call is one pipelined round trip, whatever the batch: a lookup asks
in one which of the query's chain keys Valkey holds and which manifests
hang from them (listing); a write-through asks in one which chunks it
lacks while renewing the others' lifetimes (touch), and sends in one the
missing files and the manifest's tail (put).

A Valkey Cluster: named by the URL (valkey+cluster://HOST:PORT,HOST:PORT,
any of its nodes as seeds) or found on the one node a plain URL names
(INFO cluster says cluster_enabled:1). The keys are the same; each lands
on its slot's primary. Every command names one key (a multi-key EXISTS or
DEL would cross slots); a call's commands go in one pipeline per primary
(the client follows MOVED and ASK within it), so a primary that fails
costs the keys it holds and nothing else. Its primaries answer in no
common order, so a put is two rounds there: the chunks first, then -- once
every chunk is stored -- the manifests and their tails; on one server the
one pipeline runs in order. Either way a manifest is never held without
its chunks, whatever fails in between, and a retried put writes the same
bytes again. A primary that cannot be reached is skipped, by a breaker of
its own, until `retry_seconds` have passed, and meanwhile the slot map is
read again once a second: when its replica takes over, its slots are served
again at once. A node that answers an error (CLUSTERDOWN while the cluster
agrees on a failover) costs that call's keys, and is asked again at the
next.

Budget: each key expires `ttl_seconds` after its last write-through (0:
never), and Valkey's own eviction (maxmemory with allkeys-lru) may drop
any key at any time -- a reader treats a missing key as a miss.

Failures: a connection refused, a timeout (short: `timeout_seconds`), any
error of the server, or of a cluster no node of which answers -- the tier's
breaker (breaker.py) opens, logged once, and the tier is skipped until
`retry_seconds` have passed; requests are served from the local tier or
cold, never failed.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence

import numpy as np

from .breaker import Breaker
from .layout import is_key
from .tier import CHUNK, MANIFEST, FileKey, Listing, Tail

if TYPE_CHECKING:
    from .policy import StoreOptions

log = logging.getLogger("kvsession.store")

NAMESPACE = "kvsession"
LETTERS = {CHUNK: "c", MANIFEST: "m"}  # a file kind as its keys spell it
SLOTS = 16384  # a cluster's hash slots

Command = tuple  # (method, key, *args): one command on one key, as the redis client's pipeline spells it


URL_FORMS = "redis://HOST:PORT, valkey://HOST:PORT or valkey+cluster://HOST:PORT,HOST:PORT"
SCHEMES = {"valkey": "redis", "valkeys": "rediss", "redis": "redis", "rediss": "rediss", "unix": "unix"}


def redis_url(url: str) -> str:
    """valkey:// and valkeys:// as the redis client spells them."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"shared tier URL {url!r}: {URL_FORMS}")
    return f"{SCHEMES[scheme]}://{rest}"


def without_credentials(url: str) -> str:
    """The URL with any USER:PASSWORD@ taken out, for a log line or /health."""
    scheme, sep, rest = url.partition("://")
    auth, at, where = rest.rpartition("@")
    return f"{scheme}{sep}{where}" if at else url


def cluster_seeds(url: str) -> list[str] | None:
    """A cluster URL's seed nodes, each as a redis URL with the credentials and path they share; None for a
    URL that names one server (it may still be a cluster's node: the tier asks it)."""
    scheme, sep, rest = url.partition("://")
    base, plus, cluster = scheme.partition("+")
    if not plus:
        return None
    if cluster != "cluster" or base not in ("valkey", "valkeys", "redis", "rediss"):
        raise ValueError(f"shared tier URL {url!r}: {URL_FORMS}")
    auth, at, where = rest.rpartition("@")
    hosts, slash, path = where.partition("/")
    seeds = [h for h in hosts.split(",") if h]
    if not seeds:
        raise ValueError(f"shared tier URL {url!r}: no HOST:PORT")
    return [redis_url(f"{base}://{auth}{at}{h}{slash}{path}") for h in seeds]


class ValkeyTier:
    """A Valkey (or Redis) server as the store's second tier. Never raises into the store's callers."""

    def __init__(self, url: str, *, ttl_seconds: int = 7 * 24 * 3600, timeout_seconds: float = 0.5,
                 retry_seconds: float = 10.0, namespace: str = NAMESPACE):
        import redis
        from redis.exceptions import RedisClusterException

        self.url = without_credentials(url)  # what logs and /health show; the seeds keep the password
        self.ttl = ttl_seconds or None
        self.namespace = namespace
        from redis.connection import parse_url

        seeds = cluster_seeds(url)
        self._seeds = seeds or [redis_url(url)]
        try:  # a bad URL fails here, as a ValueError, not at the first call (that must never raise)
            self._parsed = [parse_url(u) for u in self._seeds]
        except ValueError as e:
            raise ValueError(f"shared tier URL {url!r}: {e}") from None
        self.mode: str | None = "cluster" if seeds else None  # "server" or "cluster"; None: not asked yet
        self._timeouts = dict(socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds)
        self.errors = (redis.RedisError, RedisClusterException, OSError)  # the cluster's are not RedisErrors
        self._unreachable = (redis.ConnectionError, redis.TimeoutError, OSError)
        # what the cluster client raises when, after a failure, it read the slot map again and no node answered
        self._no_node = RedisClusterException
        # the client is made by connect_soon or the first call, under the breaker: a cluster client reads
        # the slot map when it is made, and a down tier must cost misses, not the store's construction
        self.client: "redis.Redis | redis.RedisCluster | None" = None
        self._connecting = threading.Lock()
        self._nodes: dict[str, Breaker] = {}  # a cluster's primaries by HOST:PORT, each skipped while it fails
        self._refreshed = 0.0  # when the slot map was last read again after a failure
        self._pool = ThreadPoolExecutor(8, thread_name_prefix="kvsession-valkey")  # a cluster's primaries at once
        self._closed = False
        self.health = Breaker(f"the shared KV tier {self.url}", "serving from the local tier", retry_seconds, log,
                              describe=lambda e: f"{type(e).__name__}: {e}")

    @classmethod
    def from_options(cls, o: "StoreOptions") -> "ValkeyTier":
        """The store's tier, its client made at once off the caller's thread (connect_soon)."""
        tier = cls(o.shared_url, ttl_seconds=o.shared_ttl_seconds, timeout_seconds=o.shared_timeout_seconds,
                   retry_seconds=o.shared_retry_seconds)
        tier.connect_soon()
        return tier

    def connect_soon(self) -> None:
        """Make the client now on a thread of its own, so that a first lookup does not wait for it: a cluster
        client reads the slot map and meets every primary, some 100-300 ms (a server's first request waited
        that long). A call meanwhile waits for it; a tier that is down opens the breaker, as a call would."""
        def connect():
            try:
                self._connect()
            except self.errors as e:
                self.health.failed(e)

        threading.Thread(target=connect, name="kvsession-valkey-connect", daemon=True).start()

    @property
    def reason(self) -> str | None:
        """Why the tier, or some of a cluster's primaries, are skipped now; None while all work."""
        down = [f"{node}: {b.reason}" for node, b in sorted(self._nodes.items()) if b.reason]
        return self.health.reason or ("; ".join(down) if down else None)

    def usable(self) -> bool:
        return self.health.usable()

    def _connect(self):
        """The client: a cluster's when the URL names one or its one node is in one, else a server's."""
        import redis
        from redis.backoff import NoBackoff
        from redis.cluster import ClusterNode, RedisCluster
        from redis.retry import Retry

        with self._connecting:
            if self.client is not None:
                return self.client
            if self.mode is None:
                one = redis.Redis.from_url(self._seeds[0], retry_on_timeout=False, **self._timeouts)
                try:
                    enabled = one.info("cluster").get("cluster_enabled") == 1
                except redis.ResponseError:  # INFO refused (a managed server's ACL): a server of its own
                    enabled = False
                except self.errors:
                    one.close()
                    raise
                if not enabled:
                    self.mode, self.client = "server", one
                    return one
                one.close()
                self.mode = "cluster"
            others = [ClusterNode(o["host"], o.get("port", 6379)) for o in self._parsed[1:]]
            # one retry, at once, after the client has re-read the slot map: a failover is followed in
            # that call; a cluster still down waits for the breaker instead of the default ten tries
            self.client = RedisCluster.from_url(self._seeds[0], startup_nodes=others, retry=Retry(NoBackoff(), 1),
                                                **self._timeouts)
            return self.client

    def _run(self, *phases: Sequence[Command]) -> list | None:
        """Each phase's commands, in order, their results in one list (a failed command's None); None while
        the tier is down. One server: one round trip for all the phases, as its order holds. A cluster: a
        phase's commands in one round trip per primary, a phase sent only once every command before it has
        worked (see the module's docstring); a primary that fails costs its keys only."""
        if self._closed or not self.health.usable():
            return None
        try:
            client = self.client or self._connect()
            if self.mode == "server":
                pipe = client.pipeline(transaction=False)
                for name, key, *args in (c for phase in phases for c in phase):
                    getattr(pipe, name)(key, *args)
                result = pipe.execute()
            else:
                result = self._run_cluster(client, phases)
        except self.errors as e:
            self.health.failed(e)
            return None
        self.health.ok()
        return result

    def _run_cluster(self, client, phases: Sequence[Sequence[Command]]) -> list:
        """_run on a cluster: commands grouped by the primary their slot is on, each group its own pipeline
        (the client follows MOVED and ASK within it), each primary behind a breaker of its own. Raises when
        the cluster itself cannot be reached (its slot map cannot be read): the whole tier is down."""
        result: list = []
        failed: dict[str, BaseException] = {}  # a primary (or "slot N", one no primary serves): its error
        skipped = False  # commands for a primary whose breaker is open
        for n, phase in enumerate(phases):
            if failed or skipped:  # an earlier phase did not work whole: this one is not sent
                result += [None] * sum(len(p) for p in phases[n:])
                break
            out: list = [None] * len(phase)
            groups: dict[str, list[int]] = {}
            for i, (name, key, *args) in enumerate(phase):
                slot = client.keyslot(key)
                try:
                    groups.setdefault(client.nodes_manager.get_node_from_slot(slot).name, []).append(i)
                except self.errors as e:
                    failed[f"slot {slot}"] = e
            breakers = {node: self._node_breaker(node) for node in groups}
            sent = {node: members for node, members in groups.items() if breakers[node].usable()}
            skipped = len(sent) < len(groups)

            def send(members: list[int]) -> list:
                pipe = client.pipeline(transaction=False)
                for i in members:
                    name, key, *args = phase[i]
                    getattr(pipe, name)(key, *args)
                return pipe.execute()

            # the primaries at once, each on a thread of its own (a socket's wait lets go of the GIL)
            futures = {node: self._pool.submit(send, members) for node, members in sent.items()}
            for node, future in futures.items():
                try:
                    answers = future.result()
                except self.errors as e:
                    failed[node] = e
                    continue
                breakers[node].ok()
                for i, a in zip(sent[node], answers):
                    out[i] = a
            result += out
        for e in failed.values():
            # a primary's pipeline that failed this way found no node at all: the cluster is down, and this
            # must open the tier's breaker whether or not the slot map below is due to be read again (a call
            # 0.2 s after such a failure answered every key None and closed the breaker, "ok", before)
            if type(e) is self._no_node:
                raise e
        if failed or skipped:
            # a primary that failed, or is skipped, may have been replaced (its replica promoted): the slot
            # map is read again, once a second at most, and its slots go to the new primary at once; when no
            # node answers that, the cluster is down (the caller's breaker), else each primary that failed is
            # skipped for a while, by its own
            now = time.monotonic()
            if now >= self._refreshed + 1.0:
                self._refreshed = now
                client.nodes_manager.initialize()
                serving = {n.name for n in client.get_primaries()}
                with self._connecting:  # a primary gone from the map (replaced) is forgotten with its breaker
                    for node in [n for n in self._nodes if n not in serving]:
                        del self._nodes[node]
            for node, e in failed.items():
                # only a primary that cannot be reached is skipped: one that answers an error at once (the
                # cluster down for a moment while it agrees on a failover) costs this call's keys only
                if node in self._nodes and isinstance(e, self._unreachable):
                    self._nodes[node].failed(e)
        return result

    def _node_breaker(self, node: str) -> Breaker:
        with self._connecting:
            b = self._nodes.get(node)
            if b is None:
                b = self._nodes[node] = Breaker(f"the shared KV tier {self.url}'s node {node}",
                                                "its keys are misses", self.health.retry_seconds, log,
                                                describe=self.health.describe)
            return b

    def key(self, f: FileKey) -> str:
        return f"{self.namespace}:{f.root}:{LETTERS[f.kind]}:{f.key}"

    def _tails_key(self, root: str, base: str) -> str:
        return f"{self.namespace}:{root}:t:{base}"

    # --- the tier (tier.py) ---

    def contains(self, keys: Sequence[FileKey]) -> list[bool] | None:
        result = self._run([("exists", self.key(k)) for k in keys])
        return None if result is None else [bool(n) for n in result]

    def get(self, keys: Sequence[FileKey]) -> list[bytes | None] | None:
        return self._run([("get", self.key(k)) for k in keys])

    def put(self, files: Sequence[tuple[FileKey, bytes]], tails: Sequence[Tail] = ()) -> None:
        ttl = self.ttl
        chunks = [("set", self.key(f), data, ttl) for f, data in files if f.kind == CHUNK]
        manifests = [("set", self.key(f), data, ttl) for f, data in files if f.kind != CHUNK]
        for t in tails:
            hanging = self._tails_key(t.root, t.base)
            manifests.append(("hset", hanging, np.asarray(t.tokens, dtype="<i4").tobytes(), t.manifest))
            if ttl:
                manifests.append(("expire", hanging, ttl))
        self._run(chunks, manifests)  # a manifest only once its chunks are stored

    def remove(self, keys: Sequence[FileKey]) -> None:
        """Chunks and manifests that failed their checks somewhere; a manifest's tail entry goes when it
        expires (a lookup that finds its manifest gone counts a miss)."""
        self._run([("delete", self.key(k)) for k in keys])

    def listing(self, root: str, chunks: Sequence[str], bases: Sequence[str]) -> Listing | None:
        result = self._run([("exists", self.key(FileKey(root, CHUNK, k))) for k in chunks]
                           + [("hgetall", self._tails_key(root, b)) for b in bases])
        if result is None:
            return None
        listing = Listing({k for k, n in zip(chunks, result) if n})
        for base, fields in zip(bases, result[len(chunks):]):
            tails = {tuple(np.frombuffer(t, dtype="<i4").tolist()): m.decode("ascii", "replace")
                     for t, m in (fields or {}).items() if isinstance(t, bytes) and len(t) % 4 == 0}
            # a value that is not a manifest key is none of ours (nor a file name to write): a miss, not a
            # UnicodeDecodeError, nor a path out of the folder (both found by tools/fuzz.py)
            tails = {t: m for t, m in tails.items() if is_key(m)}
            if tails:
                listing.tails[base] = tails
        return listing

    def touch(self, keys: Sequence[FileKey]) -> list[bool] | None:
        ttl = self.ttl
        result = self._run([("expire", self.key(k), ttl) if ttl else ("exists", self.key(k)) for k in keys])
        return None if result is None else [bool(n) for n in result]

    def state(self) -> dict:
        """url; mode ("server", "cluster", None before the first call); the nodes the client knows (a
        cluster's from its slot map, "HOST:PORT primary|replica"); slots, how many of a cluster's 16,384 its
        slot map has a primary for; status: "ok", "degraded" (some primaries skipped: their keys are misses)
        or "down"; reason, why not ok; last_error, the latest failure, kept after the tier works again."""
        client = self.client
        slots = None
        if self.mode == "cluster" and client is not None:
            slots = sum(1 for held in client.nodes_manager.slots_cache.values() if held)
        nodes = [name if "/" in name else f"{name} {role}" for name, role, _ in self._known_nodes()]  # a socket: its path
        errors = [self.health.last_error] + [b.last_error for _, b in sorted(self._nodes.items())]
        return {"url": self.url, "mode": self.mode, "nodes": nodes, "slots": slots,
                "status": "down" if self.health.reason else "degraded" if self.reason else "ok",
                "reason": self.reason, "last_error": next((e for e in errors if e), None)}

    def _known_nodes(self) -> list:
        """(HOST:PORT or a socket's path, "primary" or "replica", a client of that node alone) for each node
        the client knows, sorted: a cluster's from its slot map; none before the client is made."""
        client = self.client
        if client is None:
            return []
        if self.mode == "cluster":
            return sorted((n.name, n.server_type, client.get_redis_connection(n)) for n in client.get_nodes())
        kw = client.connection_pool.connection_kwargs
        return [(kw["path"] if "path" in kw else f"{kw['host']}:{kw['port']}", "primary", client)]

    def node_stats(self, scan_batch: int = 1000) -> list[dict]:
        """What each node holds and has served, for `kvsession cache stats`: a cluster's every node (replicas
        too), or the one server. Each: node, role, and either error (it did not answer) or keys ({"chunk",
        "manifest", "tails": count} of this namespace's), bytes (their MEMORY USAGE; None when the node
        refuses keyed commands), state (a cluster node's cluster_state: "ok", "fail"), roots (the chain roots
        they are of: models and formats), used_memory, maxmemory, policy, hits, misses (keyspace lookups, every
        client's), evicted, expired, errors (error replies). Raises what the connection raises: an
        operator's command says it, unlike the store's calls."""
        if self.client is None:
            self._connect()
        kinds = {"c": "chunk", "m": "manifest", "t": "tails"}
        out = []
        for name, role, node in sorted(self._known_nodes(), key=lambda n: (n[1] != "primary", n[0])):
            row: dict = {"node": name, "role": role}
            try:
                keys = {k: 0 for k in kinds.values()}
                roots: set[str] = set()
                nbytes = 0
                batch = []
                for key in node.scan_iter(match=f"{self.namespace}:*", count=scan_batch):
                    parts = key.decode(errors="replace").split(":")
                    if len(parts) == 4 and parts[2] in kinds:
                        keys[kinds[parts[2]]] += 1
                        roots.add(parts[1])
                        batch.append(key)
                    if len(batch) >= scan_batch:
                        nbytes = None if nbytes is None else self._memory_usage(node, role, batch, nbytes)
                        batch = []
                nbytes = None if nbytes is None else self._memory_usage(node, role, batch, nbytes)
                info = node.info()
                state = node.execute_command("CLUSTER INFO")["cluster_state"] if self.mode == "cluster" else "ok"
                row.update(keys=keys, bytes=nbytes, roots=sorted(roots), state=state, used_memory=info.get("used_memory"),
                           maxmemory=info.get("maxmemory"), policy=info.get("maxmemory_policy"),
                           hits=info.get("keyspace_hits", 0), misses=info.get("keyspace_misses", 0),
                           evicted=info.get("evicted_keys", 0), expired=info.get("expired_keys", 0),
                           errors=info.get("total_error_replies", 0))
            except self.errors as e:
                row["error"] = f"{type(e).__name__}: {e}"
            out.append(row)
        return out

    def _memory_usage(self, node, role: str, keys: list, total: int) -> int | None:
        """total plus the keys' bytes; None when the node refuses keyed commands (a cluster that is down)."""
        if not keys:
            return total
        pipe = node.pipeline(transaction=False)
        if role == "replica":  # a cluster's replica answers keyed commands only after READONLY
            pipe.execute_command("READONLY")
        for k in keys:
            pipe.memory_usage(k)
        answers = pipe.execute(raise_on_error=False)[1 if role == "replica" else 0:]
        if any(isinstance(a, Exception) for a in answers):
            return None
        return total + sum(a or 0 for a in answers)  # a key gone since the scan: None

    def close(self) -> None:
        """Let go of the connections; a call after it answers as a tier that is down would."""
        self._closed = True
        self._pool.shutdown(wait=False)
        with self._connecting:  # a connect_soon under way first finishes
            if self.client is not None:
                self.client.close()
