"""The recurrent layers' state: what a hybrid keeps instead of a KV cache in its conv, Mamba2 and DeltaNet layers.

A recurrent layer folds every token it reads into a state of fixed size,
float32 as llama.cpp keeps it (llama-memory-recurrent: one r_l and one s_l
row a layer and sequence), in llama.cpp's layout:

    conv   the last `conv - 1` inputs of the layer's causal convolution, [channels, conv - 1]
    ssm    the scan's state: mamba2 [heads, head_dim, d_state], deltanet [heads, value_dim, key_dim]
           (LFM2's short convolution has none)

Unlike KV rows, a state cannot be cut back: once the layer has read position
p, the state before p is gone. A RecurrentCache therefore continues only from
its end (`check_next`) and goes back only to its end, to 0, or to a mark
(`check_truncate` raises KVBoundsError otherwise, as a ring that has wrapped
does): `mark()` keeps a copy of the state at its end, on the device, so that a
later truncate to that position copies it back (llama.cpp's context
checkpoints; the session decides which to keep, Session.mark). Marks past a
truncate's end belong to the timeline it dropped and go with it. One cache
holds one sequence's state: a session owns its caches, and batched decode
hands each sequence its own.

Persistence: `read_state` / `write_state` move the arrays to and from the
host (what a snapshot of the session carries, and a fork). Nemotron-H's
feed-forward layers hold no state at all: their cache (kind "mlp") has no
arrays and truncates anywhere.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..config import RECURRENT_KINDS, SSMConfig
from ..errors import KVBoundsError

if TYPE_CHECKING:
    from ..config import ModelConfig

STATE_DTYPE = torch.float32


def state_shapes(ssm: SSMConfig) -> dict[str, tuple[int, ...]]:
    """The arrays of one recurrent layer's state and their shapes: conv [channels, conv - 1], and ssm where the
    kind has a scan (what a session file's header must say for the model's recurrent layers)."""
    shapes = {"conv": (ssm.channels, ssm.conv - 1)}
    if ssm.state_shape():
        shapes["ssm"] = tuple(ssm.state_shape())
    return shapes


def sequence_state_bytes(config: "ModelConfig") -> int:
    """Bytes of one sequence's recurrent states: every recurrent layer's arrays, float32 (0: not a hybrid)."""
    if config.ssm is None:
        return 0
    one = sum(math.prod(shape) for shape in state_shapes(config.ssm).values()) * STATE_DTYPE.itemsize
    return one * sum(bool(spec.recurrent) for spec in config.layers)


class RecurrentCache:
    """One layer's recurrent state for one sequence: `conv` and `ssm` (float32, or None where the kind has none),
    and `end`, the positions it has read (0 .. end-1)."""

    ring = False  # what a KV layer's readers ask (KVCache's layers are of both classes)
    window = 0

    def __init__(self, kind: str, ssm: SSMConfig | None, *, device: torch.device | str = "cpu"):
        if kind not in (*RECURRENT_KINDS, "mlp") or (kind != "mlp" and ssm is None):
            raise ValueError(f"recurrent cache of kind {kind!r}{' without sizes' if ssm is None else ''}")
        self.kind = kind
        self.conv = self.ssm = None
        # never inference tensors (a session made inside a forward pass): those could not be written outside one
        with torch.inference_mode(False):
            if kind != "mlp":
                shapes = state_shapes(ssm)
                self.conv = torch.zeros(shapes["conv"], dtype=STATE_DTYPE, device=device)  # [C, K-1]
                self.ssm = torch.zeros(shapes["ssm"], dtype=STATE_DTYPE, device=device) if "ssm" in shapes else None
        self.end = 0
        self.marks: dict[int, dict[str, torch.Tensor]] = {}  # position -> copies of the arrays after position - 1

    @property
    def arrays(self) -> dict[str, torch.Tensor]:
        """The state's tensors by name ("conv", "ssm"), those the kind has."""
        return {name: t for name, t in (("conv", self.conv), ("ssm", self.ssm)) if t is not None}

    @property
    def memory_bytes(self) -> int:
        """The state's bytes (what a file of it holds); the marks are marks_bytes."""
        return sum(t.nbytes for t in self.arrays.values())

    @property
    def marks_bytes(self) -> int:
        return sum(t.nbytes for saved in self.marks.values() for t in saved.values())

    def mark(self) -> None:
        """Keep a copy of the state as it is now, at its end: truncate(end) can come back to it."""
        with torch.inference_mode(False):
            self.marks[self.end] = {name: t.clone() for name, t in self.arrays.items()}

    def unmark(self, end: int) -> None:
        self.marks.pop(end, None)

    def check_next(self, pos0: int, what: str) -> None:
        """Refuse tokens at pos0 unless they follow the state's last position: a state reads its positions once,
        in order, and nothing can be written before its end."""
        if pos0 != self.end and self.arrays:
            raise KVBoundsError(f"{what}: position {pos0} does not follow this {self.kind} layer's state, which has "
                                f"read positions [0, {self.end})")

    def advance(self, n: int) -> None:
        """n more positions were folded into the state."""
        self.end += n

    def check_truncate(self, end: int) -> None:
        """Raise unless truncate(end) would leave a usable state: its own end, 0 (the state before any token), or
        a mark."""
        if end < 0 or end > self.end:
            raise KVBoundsError(f"truncate to {end}: live end is {self.end}")
        if 0 < end < self.end and self.arrays and end not in self.marks:
            raise KVBoundsError(f"truncate to {end}: this {self.kind} layer's state holds position {self.end - 1} "
                                f"folded in; it cannot go back to an earlier position other than 0 or a mark "
                                f"({sorted(self.marks) or 'none'})")

    def truncate(self, end: int) -> None:
        self.check_truncate(end)
        if end == 0:
            self.reset()
        elif end < self.end:
            for name, t in self.arrays.items():
                t.copy_(self.marks[end][name])
        self.marks = {p: saved for p, saved in self.marks.items() if p <= end}
        self.end = end

    def reset(self) -> None:
        """The state before any token: zeros (llama.cpp clears a sequence's cells so), and no marks."""
        for t in self.arrays.values():
            t.zero_()
        self.end = 0
        self.marks = {}

    def read_state(self, end: int | None = None) -> dict[str, np.ndarray]:
        """The state as host arrays (float32, llama.cpp's layout), by name: at its end, or at a mark's end."""
        arrays = self.arrays if end is None or end == self.end else self.marks[end]
        return {name: t.detach().cpu().numpy().copy() for name, t in arrays.items()}

    def write_state(self, arrays: dict[str, np.ndarray], end: int) -> None:
        """Host arrays (read_state's) into this cache, as the state after position end - 1; checked whole first."""
        want = {name: tuple(t.shape) for name, t in self.arrays.items()}
        got = {name: tuple(a.shape) for name, a in arrays.items()}
        if got != want or any(a.dtype != np.float32 for a in arrays.values()):
            raise KVBoundsError(f"write_state: arrays {got} ({', '.join(str(a.dtype) for a in arrays.values())}), "
                                f"this {self.kind} layer holds {want} float32")
        if end < 0:
            raise KVBoundsError(f"write_state: end {end} must be >= 0")
        for name, t in self.arrays.items():
            a = arrays[name]
            if t.device.type != "cpu" or a.ctypes.data != t.data_ptr():  # else read in place already
                t.copy_(torch.from_numpy(a))
        self.end = end
        self.marks = {}  # another timeline's
