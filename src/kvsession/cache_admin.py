"""`kvsession cache ls|show|gc|clear`: look after a disk KV cache folder.

ls lists its checkpoints (key, reason, tokens, the bytes only they hold,
decayed hits, age, the end of their text); show prints one, its checksums
verified; gc applies the store's budget and eviction now; clear deletes
every checkpoint, and only with --yes. Looking after a cache never creates
one: a missing folder is an error.
"""
from __future__ import annotations

import os
import time

from .errors import KvsessionError
from .store import Store, StoreError, default_store_dir


def run(args) -> int:
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
    elif args.action == "clear":
        if not args.yes:
            raise KvsessionError(f"this would delete {len(store.ls())} checkpoints from {folder}; "
                                 "add --yes to do it")
        print(f"removed {store.clear()} checkpoints from {folder}")
    return 0


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
