"""Moving KV rows between the compute device, host memory and files, a layer at a time, overlapped.

ds4 copies each layer's tensor between the GPU and the host
(`ds4_gpu_tensor_read` / `_write`) and then to or from disk, one after the
other. Here two host slots take turns: a save copies layer i+1 off the
device -- asynchronously, on a side CUDA stream, into pinned memory --
while layer i is hashed and written; a load reads layer i+1 from disk (its
checksum computed as the bytes land) while layer i is copied on to the
device. A save or a load then costs about the slower of the PCIe transfer
and the disk, not their sum, and no full host copy of the cache is ever
made: two layers' worth of pinned memory, kept for the next call.

Modes (`TRANSFERS`):
- "auto", the default: the staging above on a device; on the CPU the cache
  already is host memory, so nothing is staged: a save writes the cache's
  rows where they lie and a load reads the file straight into them.
- "staged": the staging on any device. On the CPU its copies are plain
  synchronous ones: it is what a GPU runs, and the CPU tests run it.
- "sync": one synchronous copy a layer (`.cpu()`, `.to(device)`) before or
  after its disk I/O, nothing overlapped: the baseline the GPU benchmark
  (tools/gpu_bench.py) measures the staging against.
"""
from __future__ import annotations

import threading
from contextlib import nullcontext
from typing import Callable, Sequence

import numpy as np
import torch

from .cache import LayerCache
from .rows import host_tensor, runs_to_host, storage_row_shape, to_numpy

TRANSFERS = ("auto", "staged", "sync")


def check_transfer(mode: str) -> None:
    if mode not in TRANSFERS:
        raise ValueError(f"transfer {mode!r}: choose one of {', '.join(TRANSFERS)}")


def staged(device: torch.device, mode: str) -> bool:
    check_transfer(mode)
    return mode == "staged" or (mode == "auto" and device.type != "cpu")


class Lane:
    """Where copies between the host slots and a device run: a side CUDA stream, or inline elsewhere."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self.stream is not None:  # the rows a save copies were written on the compute stream: after them
            self.stream.wait_stream(torch.cuda.current_stream(device))

    def on(self):
        return torch.cuda.stream(self.stream) if self.stream is not None else nullcontext()

    def mark(self) -> torch.cuda.Event | None:
        """An event after every copy issued so far (None off CUDA, where copies are done when issued)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record(self.stream)
        return event

    @staticmethod
    def wait(event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()

    def join(self) -> None:
        """Later work on the compute stream sees every copy issued here (a load's rows)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


class _Slots:
    """Pairs of host buffers, pinned where a CUDA device copies to or from them, kept between calls: pinning
    memory costs far more than reusing it. A pair is lent to one save or load at a time."""

    def __init__(self):
        self._lock = threading.Lock()
        self._free: list[list[torch.Tensor]] = []

    def take(self, nbytes: int, pinned: bool) -> list[torch.Tensor]:
        if pinned:
            with self._lock:
                for i, pair in enumerate(self._free):
                    if pair[0].numel() >= nbytes:
                        return self._free.pop(i)
                self._free.clear()  # too small for this cache: let them go rather than hold both sizes
        return [torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pinned) for _ in range(2)]

    def give(self, pair: list[torch.Tensor]) -> None:
        if pair[0].is_pinned():
            with self._lock:
                self._free.append(pair)


SLOTS = _Slots()


def _carve(slot: torch.Tensor, dtype: torch.dtype, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Host tensors of `dtype` and these shapes, back to back in `slot` (whole rows of one dtype each, so
    every offset keeps the element alignment)."""
    out, at = [], 0
    size = torch.empty(0, dtype=dtype).element_size()
    for shape in shapes:
        n = int(np.prod(shape)) * size
        out.append(slot[at : at + n].view(dtype).view(*shape))
        at += n
    return out


def _nbytes(ts: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class Downloads:
    """Layers' rows, off the device a layer ahead of the one being written.

    jobs[j] = (k runs, v runs): each a list of runs of cache rows (LayerCache.row_runs). take(j), called for
    j = 0, 1, ... in order, returns job j as host arrays (k, v) [n, H, D], valid until take(j + 1): by then
    the caller has written them, and their slot takes job j + 2. A context manager: leaving it waits for any
    copy still in flight (a failed save) before the slots go back.
    """

    def __init__(self, jobs: Sequence[tuple[list[torch.Tensor], list[torch.Tensor]]], device: torch.device,
                 mode: str = "auto"):
        self.jobs = list(jobs)
        self.staged = staged(device, mode)
        self.events: dict[int, torch.cuda.Event | None] = {}
        self.arrays: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if self.staged:
            self.lane = Lane(device)
            most = max((_nbytes(ks) + _nbytes(vs) for ks, vs in self.jobs), default=0)
            self.slots = SLOTS.take(most, pinned=device.type == "cuda")

    def __enter__(self) -> "Downloads":
        return self

    def __exit__(self, *exc) -> None:
        if self.staged:
            for event in self.events.values():
                Lane.wait(event)
            SLOTS.give(self.slots)

    def _start(self, j: int) -> None:
        ks, vs = self.jobs[j]
        shape = (sum(r.shape[0] for r in ks), *ks[0].shape[1:])
        k, v = _carve(self.slots[j % 2], ks[0].dtype, [shape, shape])
        with self.lane.on():
            for dst, runs in ((k, ks), (v, vs)):
                at = 0
                for r in runs:
                    dst[at : at + r.shape[0]].copy_(r, non_blocking=True)
                    at += r.shape[0]
        self.events[j] = self.lane.mark()
        self.arrays[j] = (to_numpy(k), to_numpy(v))

    def take(self, j: int) -> tuple[np.ndarray, np.ndarray]:
        ks, vs = self.jobs[j]
        if not self.staged:  # views of the cache on the CPU; one synchronous copy a run elsewhere
            return runs_to_host(ks), runs_to_host(vs)
        if j == 0:
            self._start(0)
        if j + 1 < len(self.jobs):
            self._start(j + 1)  # its slot held job j - 1, written by now
        Lane.wait(self.events.pop(j))
        return self.arrays.pop(j)


class Uploads:
    """Layers' rows, read from files into host slots and copied on to the device while the next is read.

    fill(layer, start, n, read) for one layer after another: read(k, v) fills host arrays [n, H, D] (a
    checked section), whose rows then become positions start .. start+n-1 (live: a session being loaded);
    fill_free does the same into rows past the layer's end that stay unseen until LayerCache.adopt_rows (a
    restore into a live session). A context manager: leaving it orders the compute stream after every copy.
    """

    def __init__(self, device: torch.device, row_shape: Sequence[int], dtype: torch.dtype, mode: str = "auto"):
        self.staged = staged(device, mode)
        self.device = device
        self.j = 0
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.row_shape, self.dtype = storage_row_shape(row_shape, dtype), dtype  # the cache's, not the numbers'
        self.row_bytes = int(np.prod(self.row_shape)) * torch.empty(0, dtype=dtype).element_size()
        self.slots: list[torch.Tensor] = []
        if self.staged:
            self.lane = Lane(device)

    def _drain(self) -> None:
        for event in self.events:
            Lane.wait(event)

    def __enter__(self) -> "Uploads":
        return self

    def __exit__(self, *exc) -> None:
        if self.staged:
            self._drain()
            self.lane.join()
            if self.slots:
                SLOTS.give(self.slots)

    def _stage(self, n: int, read: Callable[[np.ndarray, np.ndarray], None]) -> tuple[torch.Tensor, torch.Tensor]:
        """read(k, v) into the next slot, once the copy that last used it is done."""
        if not self.slots or self.slots[0].numel() < 2 * n * self.row_bytes:  # the first, or a larger section
            self._drain()
            if self.slots:
                SLOTS.give(self.slots)
            self.slots = SLOTS.take(2 * n * self.row_bytes, pinned=self.device.type == "cuda")
        slot = self.j % 2
        Lane.wait(self.events[slot])
        k, v = _carve(self.slots[slot], self.dtype, [(n, *self.row_shape)] * 2)
        read(to_numpy(k), to_numpy(v))
        return k, v

    def _sent(self) -> None:
        self.events[self.j % 2] = self.lane.mark()
        self.j += 1

    def fill(self, layer: LayerCache, start: int, n: int, read: Callable[[np.ndarray, np.ndarray], None]) -> None:
        if not self.staged:
            layer.fill_rows(start, n, read)
            return
        if not layer.ring and start + n > layer.capacity:  # growing moves the rows: no copy may be in flight
            self._drain()
        layer.check_rows(start, n, "fill")  # before a byte is read: a full layer grows here, not after
        k, v = self._stage(n, read)
        with self.lane.on():
            layer.store_rows(start, k, v, non_blocking=True)
        self._sent()

    def fill_free(self, layer: LayerCache, start: int, n: int,
                  read: Callable[[np.ndarray, np.ndarray], None]) -> None:
        """As fill, into rows past the layer's end that LayerCache.adopt_rows makes live later; the layer
        must be full and hold the room (`LayerCache.can_fill_free`)."""
        dst_k, dst_v = layer.free_runs(start, n)  # checked first, whatever the mode
        if not self.staged:
            views = layer.free_rows(start, n)
            if views is not None:  # the CPU: straight into the cache
                read(*views)
                return
            k, v = layer.host_rows(n)
            read(k, v)
            dst_k.copy_(host_tensor(k, self.dtype))
            dst_v.copy_(host_tensor(v, self.dtype))
            return
        k, v = self._stage(n, read)
        with self.lane.on():
            dst_k.copy_(k, non_blocking=True)
            dst_v.copy_(v, non_blocking=True)
        self._sent()
