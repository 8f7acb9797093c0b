"""A model's weights: GGUF tensors turned into Linears on one device at one precision.

Where the block kernels run (the CPU at precision bf16), a weight stays in
its GGUF blocks in the memory-mapped file (kernels.BlockLinear); elsewhere it
is dequantized to a dense matrix, a few hundred rows at a time. Fused
projections (q|k|v, gate|up) and experts come out as one Linear each, their
parts side by side. The transformer (transformer.py) asks for tensors by
name; how they are held is decided here.
"""
from __future__ import annotations

import logging
from typing import Sequence

import gguf
import numpy as np
import torch
import torch.nn.functional as F

from .. import kernels
from ..errors import CorruptModelFile
from ..kernels import BlockLinear, BlockLinears, Scratch
from .gguf import GGUFFile, dequantize, dequantize_rows

log = logging.getLogger(__name__)


class DenseLinear:
    """y = x @ W^T + b with W dense in its own dtype (bfloat16 on the fast path)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight  # [out, in]
        self.bias = bias  # [out] float32 or None
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # x: [T, in] f32 -> [T, out] f32
        y = F.linear(x.to(self.weight.dtype), self.weight).float()
        return y if self.bias is None else y + self.bias


class StackedLinear:
    """Several Linears side by side: the output of a fused projection whose parts are dense and in blocks."""

    def __init__(self, parts: list):
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


Linear = DenseLinear | BlockLinear | BlockLinears | StackedLinear

# Rows dequantized at a time: a 262k-row embedding never exists in float32 all at once, and a piece this
# size stays in the CPU's cache between the dequantization and the copy (8,192 rows: Qwen 0.5B loads 15% slower).
DEQUANT_ROWS = 512

PRECISIONS = ("bf16", "f32")

class WeightBuilder:
    """Turns GGUF tensors into Linears on one device at one precision.

    - "bf16" on the CPU: every weight stays in its GGUF blocks, in the
      memory-mapped file (BlockLinear): decode multiplies the blocks through
      the C kernels, prefill a slab at a time in bfloat16 (float32 on a CPU
      without bfloat16 arithmetic, kernels.GEMM_DTYPE). Fast; logits within
      bfloat16 rounding of the reference.
    - "bf16" elsewhere (or without the block kernels): dense bfloat16.
    - "f32": every weight dense float32. Slow; the reference for tests.
    """

    def __init__(self, f: GGUFFile, device: torch.device, precision: str):
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: choose one of {', '.join(PRECISIONS)}")
        self.f = f
        self.device = device
        self.precision = precision
        self.in_blocks = device.type == "cpu" and precision == "bf16" and kernels.available()
        if device.type == "cpu" and precision == "bf16" and not kernels.available():
            log.warning("weights dequantized to dense bfloat16, slowly: %s", kernels.unavailable_reason())
        if self.in_blocks:
            kernels.keep_freed_buffers()
        self.scratch = Scratch()  # shared by every BlockLinear's prefill

    def vector(self, name: str) -> torch.Tensor:
        return torch.from_numpy(dequantize(self.f.tensor(name)).copy()).to(self.device)

    def present(self, names: Sequence[str]) -> list[str]:
        """The names, if the file has every one of them (a projection's optional biases); else none."""
        return list(names) if all(n in self.f.tensors for n in names) else []

    def _kind(self, t: gguf.ReaderTensor) -> str:
        return "blocks" if self.in_blocks and kernels.supports(t.tensor_type) else "dense"

    def blocks(self, name: str, bias: torch.Tensor | None = None) -> BlockLinear | None:
        """The tensor as a BlockLinear, or None where its weights are dense on this device and precision."""
        t = self.f.tensor(name)
        if self._kind(t) != "blocks":
            return None
        return self._block_linear(t, t.data, bias)

    def _block_linear(self, t: gguf.ReaderTensor, rows: np.ndarray, bias: torch.Tensor | None) -> BlockLinear:
        data = rows if rows.dtype == np.uint8 else rows.view(np.uint8).reshape(rows.shape[0], -1)
        return BlockLinear(data, t.tensor_type, int(t.shape[0]), bias, self.scratch)

    def split(self, name: str, sizes: Sequence[int], order: np.ndarray | None = None) -> Linear:
        """One tensor whose rows are several projections side by side (phi3's fused q|k|v and gate|up): in
        blocks, one BlockLinear per part on its rows of the memory map (what the decode stack takes); dense,
        the whole matrix. order: the tensor's rows taken in this order first (a copy), where the file interleaves
        the parts (Qwen3-Next's each key head's q, k, v and z side by side)."""
        t = self.f.tensor(name)
        if sum(sizes) != t.data.shape[0] or (order is not None and sorted(order) != list(range(sum(sizes)))):
            raise CorruptModelFile(f"{self.f.path}: {name} has {t.data.shape[0]} rows, expected {sum(sizes)}")
        data = t.data if order is None else t.data[np.asarray(order)]
        if self._kind(t) != "blocks":
            return self._dense([(t, data)], None, torch.bfloat16)
        bounds = np.cumsum([0, *sizes])
        return BlockLinears([self._block_linear(t, data[a:b], None) for a, b in zip(bounds, bounds[1:])])

    @staticmethod
    def side_by_side(parts: Sequence[Linear]) -> Linear:
        """Linears of one input as one projection, their outputs side by side: BlockLinears where every part is in
        blocks (the decode stack takes each), else a StackedLinear."""
        flat = [q for p in parts for q in (p.parts if isinstance(p, BlockLinears) else [p])]
        if all(isinstance(p, BlockLinear) for p in flat):
            return BlockLinears(flat)
        return StackedLinear(list(parts))

    def experts(self, names: Sequence[str], biases: Sequence[str] = ()) -> list[Linear]:
        """One Linear an expert of 3-D expert tensors (GGUF [cols, rows, n_experts]): that expert's rows of the
        named tensors, stacked as linear() stacks them (gate and up fused), with its row of each bias ([rows,
        n_experts]) where given. In blocks, each expert's rows are its slice of the memory map; dense, each is
        dequantized."""
        tensors = [self.f.tensor(n) for n in names]
        n = int(tensors[0].shape[2])
        if any(len(t.shape) != 3 or t.shape[2] != n for t in tensors):
            raise CorruptModelFile(f"{self.f.path}: {', '.join(names)} are not expert tensors of one count")
        bias = [self.vector(b) for b in biases]  # [n_experts, rows] each
        if any(b.shape != (n, t.shape[1]) for b, t in zip(bias, tensors)):
            raise CorruptModelFile(f"{self.f.path}: {', '.join(biases)} do not match {', '.join(names)}")
        out: list[Linear] = []
        for e in range(n):
            rows = [b[e] for b in bias] or [None] * len(tensors)
            if all(self._kind(t) == "blocks" for t in tensors):
                parts = [self._block_linear(t, t.data[e], b) for t, b in zip(tensors, rows)]
                out.append(parts[0] if len(parts) == 1 else BlockLinears(parts))
            else:
                out.append(self._dense([(t, t.data[e]) for t in tensors], torch.cat(rows) if bias else None,
                                       torch.bfloat16))
        return out

    def linear(self, names: Sequence[str], biases: Sequence[str] = (), *, half: torch.dtype = torch.bfloat16) -> Linear:
        """One Linear whose output rows are the named weights' rows, stacked (a fused projection).

        Dense weights are concatenated into one matrix; weights in blocks stay
        where they are, one BlockLinear each, side by side (BlockLinears; a
        StackedLinear where dense and block weights mix).
        """
        tensors = [self.f.tensor(n) for n in names]
        bias_parts = [self.vector(b) for b in biases] if biases else [None] * len(tensors)
        groups: list[tuple[str, list, list]] = []
        for n, t, b in zip(names, tensors, bias_parts):
            kind = self._kind(t)
            if kind == "dense" and groups and groups[-1][0] == "dense":
                groups[-1][1].append(t)
                groups[-1][2].append(b)
            else:
                groups.append((kind, [n if kind == "blocks" else t], [b]))
        parts = [self._build(kind, ts, None if bs[0] is None else torch.cat(bs), half) for kind, ts, bs in groups]
        return parts[0] if len(parts) == 1 else self.side_by_side(parts)

    def _build(self, kind: str, tensors: list, bias: torch.Tensor | None, half: torch.dtype) -> Linear:
        if kind == "blocks":
            return self.blocks(tensors[0], bias)
        return self._dense([(t, t.data) for t in tensors], bias, half)

    def _dense(self, parts: list[tuple[gguf.ReaderTensor, np.ndarray]], bias: torch.Tensor | None,
               half: torch.dtype) -> Linear:
        """One dense matrix of the parts' rows (tensor, its rows as the file stores them), stacked."""
        dtype = half if self.precision == "bf16" else torch.float32
        rows = sum(data.shape[0] for _, data in parts)
        w = torch.empty(rows, int(parts[0][0].shape[0]), dtype=dtype, device=self.device)  # [out, in]
        at = 0
        for t, data in parts:
            for r0 in range(0, data.shape[0], DEQUANT_ROWS):
                block = dequantize_rows(data[r0 : r0 + DEQUANT_ROWS], t.tensor_type)
                w[at + r0 : at + r0 + block.shape[0]] = torch.from_numpy(np.require(block, np.float32, "W"))
            at += data.shape[0]
        return DenseLinear(w, bias)
