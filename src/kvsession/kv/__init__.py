"""The KV caches a session owns, and how their rows leave and reach the device.

    cache.py     LayerCache (full or ring) and KVCache: the raw row primitives, logical positions
    recurrent.py RecurrentCache: a hybrid's recurrent layer state (conv, Mamba2, DeltaNet), float32, per sequence
    rows.py      a row on the host (numpy, bf16 as bits) and in files: the exact and q8 row formats
    transfer.py  device <-> host copies for saves and restores: plain, pinned and double-buffered

Import order: transfer > cache > recurrent, rows.
"""
