"""`kvsession cache ls|show|gc|verify|clear|stats`: look after a disk KV cache folder and its shared tier.

ls lists its checkpoints (key, reason, tokens, the bytes only they hold,
decayed hits, age, the end of their text); show prints one, its checksums
verified; gc applies the store's budget and eviction now; verify checks
every chunk's and manifest's checksums and references, removes what is
damaged or dangling (and a killed writer's litter), says each file it
removed and why, and exits 1 when something was damaged or dangling; clear deletes
every checkpoint, and only with --yes; stats sums the folder up, and with
--shared-url a shared tier's every node: its keys and their bytes, its
memory and eviction policy, its hit rate and errors. Looking after a cache
never creates one: a missing folder is an error.
"""
from __future__ import annotations

import os
import time
from collections import Counter

from ..errors import KvsessionError
from ..store import Store, StoreError, default_store_dir


def run(args) -> int:
    if args.shared_url:
        if args.action != "stats":
            raise KvsessionError(f"cache {args.action} looks after a folder; --shared-url is for cache stats")
        return shared_stats(args.shared_url)
    folder = args.dir or default_store_dir()
    if not os.path.lexists(folder):  # looking after a cache must not create one
        raise KvsessionError(f"{folder}: no such cache folder")
    store = Store(folder)  # a folder it cannot use: StoreUnavailable, one line
    if args.action == "ls":
        entries = store.ls()
        now = time.time()
        print(f"{'key':<12} {'reason':<9} {'tokens':>7} {'bytes':>11} {'hits':>5} {'age':>6}  text")
        for e in entries:
            preview = e.text[-48:].replace("\n", "\\n")
            print(f"{e.key[:12]:<12} {e.reason:<9} {e.n_tokens:>7} {store.exclusive_bytes(e):>11,} "
                  f"{store.decayed_hits(e, now):>5.1f} {_age(now - e.created):>6}  ...{preview}")
        print(f"{len(entries)} checkpoints, {store.total_bytes():,} bytes in {folder}")
    elif args.action == "show":
        if not args.key:
            raise KvsessionError("cache show needs a KEY (a unique prefix of one, from `cache ls`)")
        e = store.get(args.key)
        print(f"key          {e.key}")
        print(f"model        {e.model_file}")
        print(f"reason       {e.reason}")
        print(f"tokens       {e.n_tokens} ({len(e.chunks)} chunks of {store.options.chunk_tokens}, "
              f"tail {e.n_tokens - len(e.chunks) * store.options.chunk_tokens})")
        print(f"bytes        {e.nbytes + sum(e.chunk_bytes):,} ({store.exclusive_bytes(e):,} its own)")
        print(f"rows         {e.row_format}{' (8-bit blocks of 32, an f16 scale each)' if e.row_format == 'q8' else ''}")
        print(f"logits       {'yes' if e.has_logits else 'no (the next request prefills at least one token)'}")
        print(f"hits         {store.decayed_hits(e):.2f} (half-life {store.options.half_life_hours:g} h)")
        print(f"created      {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e.created))}")
        print(f"last used    {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(e.last_used))}")
        damage = store.find_damage(e)
        print(f"verified     {'all checksums ok' if damage is None else 'DAMAGED'}")
        print(f"text         {e.text[:300]!r}{' ...' if len(e.text) > 300 else ''}")
        if damage is not None:
            raise StoreError(f"checkpoint {e.key[:12]} is damaged: {damage}")
    elif args.action == "gc":
        r = store.gc()
        print(f"removed {r['removed']} checkpoints, freed {r['freed_bytes']:,} bytes; "
              f"{len(store.entries)} left, {store.total_bytes():,} bytes")
    elif args.action == "verify":
        removed = store.verify_all()
        for r in removed:
            print(f"removed {r}")
        kinds = Counter(r.kind for r in removed)
        chunks = {c for e in store.entries.values() for c in e.chunks}
        print(f"{len(store.entries)} checkpoints and {len(chunks)} chunks sound in {folder}; removed "
              + ", ".join(f"{kinds[k]} {k}" for k in ("damaged", "dangling", "orphan", "temporary")))
        return 1 if kinds["damaged"] or kinds["dangling"] else 0
    elif args.action == "clear":
        if not args.yes:
            raise KvsessionError(f"this would delete {len(store.ls())} checkpoints from {folder}; "
                                 "add --yes to do it")
        print(f"removed {store.clear()} checkpoints from {folder}")
    elif args.action == "stats":
        entries = store.ls()
        chunks = {c for e in entries for c in e.chunks}
        print(f"{folder}: {len(entries)} checkpoints of {sum(e.n_tokens for e in entries):,} tokens in all, "
              f"{len(chunks)} distinct chunks of {store.options.chunk_tokens} tokens, {store.total_bytes():,} bytes")
    return 0


def shared_stats(url: str) -> int:
    """Every node of the shared tier at `url`: what it holds of kvsession's, and how it has served. Exit
    status 1 when a primary does not answer."""
    from ..store.valkey import SLOTS, ValkeyTier

    try:
        tier = ValkeyTier(url)
    except (ValueError, ImportError) as e:
        raise KvsessionError(str(e)) from None
    try:
        rows = tier.node_stats()
        slots = tier.state()["slots"]
    except tier.errors as e:
        raise KvsessionError(f"the shared tier {tier.url} does not answer: {type(e).__name__}: {e}") from None
    finally:
        tier.close()
    covered = f", {slots:,} of {SLOTS:,} slots covered" if slots is not None else ""
    print(f"shared tier {tier.url} ({tier.mode}{covered})")
    print(f"{'node':<21} {'role':<7} {'chunks':>8} {'manifests':>9} {'bytes':>14} {'used / max memory':>22}  "
          f"{'policy':<14} {'hit rate':>8} {'evicted':>8} {'expired':>8} {'errors':>6}  state")
    for r in rows:
        if "error" in r:
            print(f"{r['node']:<21} {r['role']:<7} does not answer: {r['error']}")
            continue
        lookups = r["hits"] + r["misses"]
        rate = f"{r['hits'] / lookups:.1%}" if lookups else "-"
        nbytes = "-" if r["bytes"] is None else f"{r['bytes']:,}"
        memory = f"{_mb(r['used_memory'])} / {_mb(r['maxmemory']) if r['maxmemory'] else 'none'}"
        print(f"{r['node']:<21} {r['role']:<7} {r['keys']['chunk']:>8,} {r['keys']['manifest']:>9,} "
              f"{nbytes:>14} {memory:>22}  {r['policy'] or '-':<14} "
              f"{rate:>8} {r['evicted']:>8,} {r['expired']:>8,} {r['errors']:>6,}  {r['state']}")
    primaries = [r for r in rows if r["role"] == "primary"]
    up = [r for r in primaries if "error" not in r]
    roots = {root for r in up for root in r["roots"]}
    print(f"primaries: {sum(r['keys']['chunk'] for r in up):,} chunks and {sum(r['keys']['manifest'] for r in up):,} "
          f"manifests of {len(roots)} chain root{'s' * (len(roots) != 1)} (a model and format each), "
          f"{sum(r['bytes'] or 0 for r in up):,} bytes; {len(primaries) - len(up)} of {len(primaries)} not answering")
    if any(r["state"] != "ok" for r in up):
        print("a node says the cluster is down (state fail): it refuses every key until the lost slots are served "
              "again, unless its cluster-require-full-coverage is no")
    print("hit rate: a node's keyspace hits over its lookups, every client's since it started")
    return 0 if len(up) == len(primaries) and all(r["state"] == "ok" for r in up) else 1


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MB"


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
