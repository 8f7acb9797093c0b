"""Per-layer KV caches and the raw row primitives.

Each layer owns a K and a V tensor on the compute device, shaped
[capacity, n_kv_heads, head_dim]: one row per token, so that one token's keys
are one contiguous row (ds4's layout). A full-attention layer keeps every
position (row = position) and grows up to its maximum; a sliding-window
layer is a ring (row = position % capacity) that keeps only the last
`capacity` positions.

The primitives follow ds4's `store_raw_kv` / `store_raw_kv_batch`
(store_row, store_rows) and its row reads and writes (read_rows,
write_rows). Every one bounds-checks first and raises
`KVBoundsError` before touching a byte, so a bad position can never land in
another token's row.

Persistence (session files, the store) only ever sees logical positions:
`read_rows` / `write_rows` resolve ring order here, so a file never depends
on a ring's capacity. Both cache kinds share that one interface (mlx-lm's
`_BaseCache` habit); save and load are written once, on top of it. How a
row looks on the host and in a file is rows.py's.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from .. import kernels
from ..config import LayerSpec, ModelConfig
from ..errors import ContextFull, KVBoundsError
from .recurrent import RecurrentCache
from .rows import Q8_0, dequantize_q8_0, from_numpy, numpy_dtype, runs_to_host, storage_row_shape, to_numpy

# q8_0: llama.cpp's 8-bit blocks (rows.py), half an f16 cache's bytes; the C kernels read and write them (CPU only)
KV_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "q8_0": Q8_0}

# Full caches start small and grow by at least this many rows at a time, so a
# short chat does not allocate the model's whole context up front.
GROW_ROWS = 256

# Rows a ring keeps beyond its window. A batch of T tokens is stored before
# its queries attend, so the ring must still hold the window of the batch's
# first query: capacity >= window + T - 1. Prefill chunks are capped to this.
RING_MARGIN = 512


class LayerCache:
    """K and V of one layer: [capacity, n_kv_heads, head_dim] each (q8_0: uint8 [capacity, n_kv_heads,
    head_dim / 32 * 34], each head's blocks; rows stored as floats are quantized on the way in).

    `end` is one past the highest logical position stored: the rows of
    positions [start, end) are live, where start is 0 for a full cache and
    max(0, end - capacity) for a ring.
    """

    def __init__(
        self,
        spec: LayerSpec,
        n_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        capacity: int,
        max_capacity: int | None = None,
    ):
        self.kind = spec.kind
        self.window = spec.window
        self.ring = spec.kind == "sliding"
        self.max_capacity = capacity if self.ring else max(capacity, max_capacity or capacity)
        self.head_dim = head_dim
        self.q8 = dtype == Q8_0
        # rows past `end` are never read, so they need no zeroing
        self.k = torch.empty(capacity, *storage_row_shape((n_kv_heads, head_dim), dtype), dtype=dtype,
                             device=device)  # [cap, H, D]
        self.v = torch.empty_like(self.k)  # [cap, H, D]
        self.end = 0
        self.first = 0  # lowest position stored since the cache was empty (a loaded ring starts late)
        self._host: tuple[np.ndarray, np.ndarray] | None = None  # numpy views of k and v (CPU), for free_rows

    # --- shape ---------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.k.shape[0]

    @property
    def start(self) -> int:
        return max(self.first, self.end - self.capacity) if self.ring else 0

    @property
    def live_rows(self) -> int:
        return self.end - self.start

    @property
    def persist_start(self) -> int:
        """The first position a saved state needs: 0 for a full layer; for a ring, the
        last `window` positions only (older live rows are never attended to again)."""
        return max(self.start, self.end - self.window) if self.ring else 0

    def persisted_rows(self) -> tuple[int, np.ndarray, np.ndarray]:
        """(start, k, v): what a file keeps of this layer, in logical order."""
        start = self.persist_start
        k, v = self.read_rows(start, self.end - start)
        return start, k, v

    def reset(self) -> None:
        """Forget every row (a ring about to be refilled from a file)."""
        self.end = 0
        self.first = 0

    @property
    def row_shape(self) -> tuple[int, int]:
        """A row as the cache holds it: [H, D], or q8_0's [H, D / 32 * 34] bytes."""
        return tuple(self.k.shape[1:])

    @property
    def row_nbytes(self) -> int:
        """Bytes of one token's K (or V) row."""
        return self.k[0].numel() * self.k.element_size()

    @property
    def memory_bytes(self) -> int:
        """What this layer holds in memory: K and V at their capacity."""
        return self.k.nbytes + self.v.nbytes

    # --- bounds --------------------------------------------------------------

    def check_rows(self, pos0: int, n: int, what: str) -> None:
        if pos0 < 0 or n < 0:
            raise KVBoundsError(f"{what}: position {pos0}, count {n}: must be >= 0")
        if self.ring:
            if n > self.capacity:
                raise KVBoundsError(f"{what}: {n} rows into a ring of capacity {self.capacity}")
            if pos0 < self.end - self.capacity:
                # row pos0 % capacity now holds a newer position; writing would clobber it
                raise KVBoundsError(
                    f"{what}: position {pos0} has left the window (live: [{self.start}, {self.end}))"
                )
        elif pos0 + n > self.capacity:
            self._grow(pos0 + n, what)

    def _grow(self, rows: int, what: str) -> None:
        if rows > self.max_capacity:
            raise ContextFull(f"{what}: position {rows - 1} is past the context of {self.max_capacity} tokens")
        new_cap = min(self.max_capacity, max(rows, self.capacity + max(GROW_ROWS, self.capacity // 2)))
        # a cache grown inside a forward pass must not become an inference tensor, which nothing outside
        # one may write: a restore or a fork into a session that had grown failed so
        with torch.inference_mode(False):
            k = torch.empty(new_cap, *self.row_shape, dtype=self.k.dtype, device=self.k.device)
            v = torch.empty_like(k)
            k[: self.end] = self.k[: self.end]
            v[: self.end] = self.v[: self.end]
        self.k, self.v = k, v
        self._host = None

    def reserve(self, rows: int) -> None:
        """Make room for `rows` positions now, in one allocation, instead of growing step by step."""
        if not self.ring and rows > self.capacity:
            self._grow(min(rows, self.max_capacity), "reserve")

    def _check_live(self, start: int, n: int, what: str) -> None:
        if n < 0 or start < self.start or start + n > self.end:
            raise KVBoundsError(
                f"{what}: positions [{start}, {start + n}) are not all live (live: [{self.start}, {self.end}))"
            )

    def _check_values(self, k, v, n: int, what: str) -> None:
        want = (n, *self.row_shape)
        if tuple(k.shape) != want or tuple(v.shape) != want:
            raise KVBoundsError(f"{what}: k {tuple(k.shape)}, v {tuple(v.shape)}, expected {want}")

    # --- raw primitives ------------------------------------------------------

    def store_row(self, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """One token's K/V rows ([n_kv_heads, head_dim] each) at logical `pos`."""
        self.store_rows(pos, k.unsqueeze(0), v.unsqueeze(0))

    def store_rows(self, pos0: int, k: torch.Tensor, v: torch.Tensor, *, non_blocking: bool = False) -> None:
        """Rows of positions pos0 .. pos0+n-1 (k, v: [n, n_kv_heads, head_dim], converted to the cache's dtype;
        a q8_0 cache also takes rows of its own bytes).

        In a ring the batch wraps: capacity 5, pos0 3, four rows land in
        physical rows 3, 4, 0, 1. k and v may lie on another device than the
        cache: non_blocking copies from pinned host memory run on the current
        CUDA stream without waiting (transfer.py orders them).
        """
        n = k.shape[0]
        if self.q8 and k.is_floating_point():
            k, v = kernels.quantize_q8_0(k), kernels.quantize_q8_0(v)
        self._check_values(k, v, n, "store_rows")
        self.check_rows(pos0, n, "store_rows")
        for dst, src in self._spans(pos0, n):
            self.k[dst].copy_(k[src], non_blocking=non_blocking)
            self.v[dst].copy_(v[src], non_blocking=non_blocking)
        self._advance(pos0, n)

    def claim(self, pos0: int, n: int) -> int:
        """Positions pos0 .. pos0+n-1, to be written in place by a kernel (kernels.Stack): bounds-checked
        (a full cache grows), then live. Returns the first position the batch's queries may see."""
        self.check_rows(pos0, n, "claim")
        self._advance(pos0, n)
        return self.start

    def _advance(self, pos0: int, n: int) -> None:
        """Rows pos0 .. pos0+n-1 were written: the live range grows."""
        if n:
            self.first = pos0 if self.end == 0 else min(self.first, pos0)
            self.end = max(self.end, pos0 + n)

    def _spans(self, pos0: int, n: int) -> list[tuple[slice, slice]]:
        """(physical rows, batch rows) pairs covering positions pos0 .. pos0+n-1."""
        if not self.ring:
            return [(slice(pos0, pos0 + n), slice(0, n))]
        row = pos0 % self.capacity
        first = min(n, self.capacity - row)
        spans = [(slice(row, row + first), slice(0, first))]
        if first < n:
            spans.append((slice(0, n - first), slice(first, n)))
        return spans

    def row_runs(self, start: int, n: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Live positions start .. start+n-1 as runs of the cache's own rows (views, on its device), logical
        order: one run each for K and V, two where a ring wraps."""
        self._check_live(start, n, "row_runs")
        spans = self._spans(start, n)
        return [self.k[dst] for dst, _ in spans], [self.v[dst] for dst, _ in spans]

    def read_rows(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Live positions start .. start+n-1 as host arrays [n, H, D], logical order."""
        ks, vs = self.row_runs(start, n)
        return runs_to_host(ks), runs_to_host(vs)

    def host_rows(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """Empty host arrays [n, H, D] for n rows of this cache (what read_rows returns, write_rows takes)."""
        k = np.empty((n, *self.row_shape), dtype=numpy_dtype(self.k.dtype))
        return k, np.empty_like(k)

    def write_rows(self, start: int, k: np.ndarray, v: np.ndarray) -> None:
        """Host arrays [n, H, D] into positions start .. start+n-1 (ring order resolved here)."""
        want = numpy_dtype(self.k.dtype)
        if k.dtype != want or v.dtype != want:
            raise KVBoundsError(f"write_rows: arrays are {k.dtype}/{v.dtype}, the cache holds {want}")
        self.store_rows(start, from_numpy(k, self.k), from_numpy(v, self.v))

    def fill_rows(self, start: int, n: int, fill: Callable[[np.ndarray, np.ndarray], None]) -> None:
        """Positions start .. start+n-1, written by fill(k, v) into host arrays [n, H, D].

        On the CPU, when the positions are one run of physical rows, the
        arrays are views of the cache itself and a file is read straight into
        it: loading a session costs no copy beyond the read. Otherwise fill
        gets fresh arrays, which are then stored like write_rows does. If
        fill raises, those rows hold garbage: use this on a cache nobody
        reads yet (a session being loaded), never on a live one.
        """
        self.check_rows(start, n, "fill_rows")
        spans = self._spans(start, n)
        if self.k.device.type == "cpu" and len(spans) == 1:
            rows = spans[0][0]
            fill(to_numpy(self.k[rows]), to_numpy(self.v[rows]))
            self._advance(start, n)
            return
        k, v = self.host_rows(n)
        fill(k, v)
        self.write_rows(start, k, v)

    # --- restoring in place (the store's fast path) ----------------------------
    #
    # A restore of 2,000 tokens moves ~45 MB; copied through host arrays into
    # the cache it cost twice the read. These two let the store read a file
    # straight into rows nobody reads yet (those past `end`) and only then,
    # once every checksum holds, make them live.

    def can_fill_free(self, start: int, n: int) -> bool:
        """Whether positions start .. start+n-1 can be filled in place before they are live: a full layer,
        every one of those rows past `end` (no reader sees them) and inside the capacity (`reserve` first)."""
        return not self.ring and self.end <= start and start + n <= self.capacity and n >= 0

    def free_runs(self, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cache's own rows [n, H, D] that positions start .. start+n-1 will occupy (see can_fill_free),
        on its device. Until `adopt_rows`, filling them changes nothing."""
        if not self.can_fill_free(start, n):
            raise KVBoundsError(f"free_runs: positions [{start}, {start + n}) are not free rows "
                                f"(live end {self.end}, capacity {self.capacity})")
        return self.k[start : start + n], self.v[start : start + n]

    def free_rows(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray] | None:
        """Host views [n, H, D] of the rows free_runs gives, to be filled in place; None unless the cache is
        on the CPU and can_fill_free holds."""
        if self.k.device.type != "cpu" or not self.can_fill_free(start, n):
            return None
        if self._host is None or self._host[0].ctypes.data != self.k.data_ptr():  # views of the whole cache, made once
            self._host = (to_numpy(self.k), to_numpy(self.v))
        return self._host[0][start : start + n], self._host[1][start : start + n]

    def prefault(self, rows: int) -> None:
        """Room for `rows` positions, its memory written once now: the rows past `end`. A fresh process
        pays the kernel's first touch of new memory (~45 ms for 2,000 tokens of SmolLM2 on a 2-core VM,
        more than reading them from the page cache) where it calls this -- at start-up, say -- instead of
        in the first restore or prefill that needs the room."""
        if self.ring:
            return  # allocated whole, window + margin rows: small
        self.reserve(rows)
        with torch.inference_mode():
            self.k[self.end :].zero_()
            self.v[self.end :].zero_()

    def adopt_rows(self, start: int, n: int) -> None:
        """Rows start .. start+n-1, filled in place (free_rows), become live; `start` must be `end`."""
        if self.ring or start != self.end or start + n > self.capacity:
            raise KVBoundsError(f"adopt_rows: positions [{start}, {start + n}) do not follow end {self.end}")
        self._advance(start, n)

    def update_and_fetch(self, pos0: int, k: torch.Tensor, v: torch.Tensor):
        """Store a batch of positions pos0.., then return the keys its queries may attend to.

        Returns (keys [H, S, D], values [H, S, D], first): float32, head-major,
        holding positions first .. first+S-1 in logical order -- what
        PyTorch's attention kernels read fastest (they are slow on half types
        and on token-major strides). The copy is made fresh: this serves
        prefill, where it costs little beside the batch's matrix products;
        decode reads the rows where they are (kernels.attend). A ring returns
        exactly the window of the batch's first query onwards, gathered into
        logical order: a ring restored from a file holds other stale rows than
        the ring it was saved from, and attending to the same keys in the same
        order is what makes the two continue bit for bit alike.
        """
        n = k.shape[0]
        self.store_rows(pos0, k, v)
        first = max(self.start, pos0 - self.window + 1) if self.ring else 0
        spans = self._spans(first, pos0 + n - first)
        return _head_major(self.k, spans, self.head_dim), _head_major(self.v, spans, self.head_dim), first

    def shift(self, keep: int, discard: int, rotate: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """A context shift: forget positions [keep, keep + discard) and move the later rows down by `discard`,
        each key through `rotate` (float32 [n, H, D] -> the same, RoPE to its new position). Full caches only: a
        ring's row is not its position."""
        end = self.end
        if self.ring:
            raise KVBoundsError("shift: a sliding-window layer's rows cannot move")
        if keep < 0 or discard <= 0 or keep + discard > end:
            raise KVBoundsError(f"shift: keep {keep}, discard {discard} of positions [0, {end})")
        src, dst = slice(keep + discard, end), slice(keep, end - discard)
        if self.q8:  # the sources are read before any write
            self.k[dst] = kernels.quantize_q8_0(rotate(dequantize_q8_0(self.k[src])))
        else:
            self.k[dst] = rotate(self.k[src].float()).to(self.k.dtype)
        self.v[dst] = self.v[src].clone()
        self.end = end - discard

    def check_truncate(self, end: int) -> None:
        """Raise unless truncate(end) would leave a usable cache.

        A ring can go back only as far as it still holds the window before
        the new end: older rows have been overwritten by newer positions.
        """
        if end < 0 or end > self.end:
            raise KVBoundsError(f"truncate to {end}: live end is {self.end}")
        if self.ring and 0 < end < self.end and max(0, end - self.window) < self.start:
            raise KVBoundsError(
                f"truncate to {end}: this ring of {self.capacity} rows has wrapped past it (it holds "
                f"[{self.start}, {self.end}), position {end} needs [{max(0, end - self.window)}, {end}))"
            )

    def truncate(self, end: int) -> None:
        """Forget every position >= end."""
        self.check_truncate(end)
        if self.ring:  # rows below the old end - capacity stay gone
            self.first = max(self.first, self.end - self.capacity) if end else 0
        self.end = end


def _head_major(t: torch.Tensor, spans: list[tuple[slice, slice]], head_dim: int) -> torch.Tensor:
    """The rows of `spans` of a cache tensor [cap, H, D] (or q8_0's bytes), in order, as float32 [H, S, D]
    contiguous."""
    n = sum(src.stop - src.start for _, src in spans)
    out = torch.empty(t.shape[1], n, head_dim, device=t.device)
    for dst, src in spans:
        rows = dequantize_q8_0(t[dst]) if t.dtype == Q8_0 else t[dst]
        out[:, src] = rows.transpose(0, 1)
    return out


class KVCache:
    """Every layer's cache, indexable by layer, with the layer-addressed primitives.

    layers[i] is what layer i keeps as it reads: a LayerCache of K/V rows where
    the layer attends, else its recurrent state (recurrent.py: a hybrid's conv,
    Mamba2 and DeltaNet layers; Nemotron-H's feed-forward layers keep an empty
    one). states[i] is layer i's recurrent state, or None: the same object as
    layers[i] for a layer without attention, a second one beside the attention
    where a layer has both (Falcon-H1). A model without recurrent layers has
    only LayerCaches and no states.
    """

    def __init__(self, layers: Sequence[LayerCache | RecurrentCache],
                 states: Sequence[RecurrentCache | None] | None = None):
        self.layers = list(layers)
        self.states = list(states) if states is not None else [None] * len(self.layers)
        if len(self.states) != len(self.layers):
            raise ValueError(f"{len(self.states)} states for {len(self.layers)} layers")

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_tokens: int | None = None,
        initial_tokens: int = GROW_ROWS,
        ring_margin: int = RING_MARGIN,
    ) -> "KVCache":
        max_tokens = max_tokens or config.context_length
        layers, states = [], []
        for spec in config.layers:
            state = RecurrentCache(spec.recurrent, config.ssm, device=device) if spec.recurrent else None
            if spec.kind == "sliding":
                layer = LayerCache(spec, config.n_kv_heads, config.head_dim, dtype=dtype, device=device,
                                   capacity=spec.window + ring_margin, max_capacity=max_tokens)
            elif spec.kind == "full":
                layer = LayerCache(spec, config.n_kv_heads, config.head_dim, dtype=dtype, device=device,
                                   capacity=min(initial_tokens, max_tokens), max_capacity=max_tokens)
            else:  # no attention: the layer keeps its state, or an empty one that counts positions (an "mlp" layer)
                layer = state = state or RecurrentCache(spec.kind, None, device=device)
            layers.append(layer)
            states.append(state)
        return cls(layers, states)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, i: int) -> LayerCache | RecurrentCache:
        return self.layers[i]

    def __iter__(self):
        return iter(self.layers)

    @property
    def kv_layers(self) -> list[LayerCache]:
        """The layers' K/V caches, of the layers that attend (every layer but a hybrid's recurrent ones)."""
        return [layer for layer in self.layers if isinstance(layer, LayerCache)]

    @property
    def recurrent(self) -> bool:
        """Whether any layer keeps a recurrent state (then the cache cannot go back to an earlier position but 0)."""
        return any(state is not None for state in self.states)

    def _layer(self, layer: int) -> LayerCache:
        if not 0 <= layer < len(self.layers):
            raise KVBoundsError(f"layer {layer}: the cache has {len(self.layers)} layers")
        if not isinstance(self.layers[layer], LayerCache):
            raise KVBoundsError(f"layer {layer} keeps a {self.layers[layer].kind} state, no K/V rows")
        return self.layers[layer]

    def store_row(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._layer(layer).store_row(pos, k, v)

    def store_rows(self, layer: int, pos0: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._layer(layer).store_rows(pos0, k, v)

    def read_rows(self, layer: int, start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        return self._layer(layer).read_rows(start, n)

    def write_rows(self, layer: int, start: int, k: np.ndarray, v: np.ndarray) -> None:
        self._layer(layer).write_rows(start, k, v)

    @property
    def recurrent_states(self) -> list[RecurrentCache]:
        """Each recurrent state once (a layer without attention is its own state)."""
        return [s for s in self.states if s is not None]

    def mark(self) -> None:
        """A mark of every recurrent state at its end (RecurrentCache.mark): truncate can come back there."""
        for state in self.recurrent_states:
            state.mark()

    def unmark(self, end: int) -> None:
        for state in self.recurrent_states:
            state.unmark(end)

    def truncate(self, end: int) -> None:
        parts = self.layers + [s for s in self.recurrent_states if s not in self.layers]
        for part in parts:  # every layer and state is checked before any changes
            part.check_truncate(end)
        for part in parts:
            part.truncate(end)
