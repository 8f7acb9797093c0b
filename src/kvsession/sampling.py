"""Logits -> token: pure functions, plus a seeded sampler whose state can be saved.

The chain is llama.cpp's default order: top-k, top-p, min-p, temperature,
then a draw. Temperature 0 is greedy (argmax, lowest id on ties). Every step
runs in numpy on the host, so the same logits and the same generator state
give the same token on any device, which is what lets a saved session go on
sampling exactly as the uninterrupted one would have.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplerParams:
    temperature: float = 0.8  # 0: greedy
    top_k: int = 40  # 0: off
    top_p: float = 0.95  # 1: off
    min_p: float = 0.05  # 0: off
    seed: int | None = None  # None: a fresh random seed

    def __post_init__(self) -> None:
        # every comparison with NaN is false, so each test is written to fail for NaN, and inf is refused
        # by name: a NaN temperature would make every probability NaN and the draw meaningless
        if not _number(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not _whole(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be a whole number >= 0, got {self.top_k}")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not _number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None and (not _whole(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be a whole number >= 0 or None, got {self.seed}")


def _number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def _whole(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


GREEDY = SamplerParams(temperature=0.0)


def sample(logits: np.ndarray, params: SamplerParams, rng: np.random.Generator) -> int:
    """One token id from float logits [vocab]. Greedy draws nothing from rng."""
    if params.temperature == 0:
        return int(np.argmax(logits))
    ids, probs = candidates(logits, params)
    i = int(np.searchsorted(np.cumsum(probs), rng.random() * probs.sum(), side="right"))
    return int(ids[min(i, ids.size - 1)])


def candidates(logits: np.ndarray, params: SamplerParams) -> tuple[np.ndarray, np.ndarray]:
    """The tokens the chain leaves and the probabilities the draw gives them (after temperature), most likely
    first: what llama-server reports as post-sampling probabilities. Greedy leaves the argmax alone, with 1."""
    if params.temperature == 0:
        return np.array([int(np.argmax(logits))]), np.ones(1)
    logits = np.asarray(logits, dtype=np.float64)
    k = params.top_k if 0 < params.top_k < logits.size else logits.size
    ids = np.argpartition(-logits, k - 1)[:k] if k < logits.size else np.arange(logits.size)
    # sort by logit descending, ties by id, so the order never depends on argpartition
    ids = ids[np.lexsort((ids, -logits[ids]))]
    cand = logits[ids]
    probs = _softmax(cand)
    if params.top_p < 1:
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p)) + 1
        cand, ids, probs = cand[:keep], ids[:keep], probs[:keep]
    if params.min_p > 0:
        keep = max(1, int(np.count_nonzero(probs >= params.min_p * probs[0])))
        cand, ids = cand[:keep], ids[:keep]
    return ids, _softmax(cand / params.temperature)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


class Sampler:
    """SamplerParams plus a PCG64 generator whose state travels in session files."""

    def __init__(self, params: SamplerParams = SamplerParams()):
        self.params = params
        self.rng = np.random.Generator(np.random.PCG64(params.seed))

    def __call__(self, logits: torch.Tensor) -> int:
        return sample(logits.detach().float().cpu().numpy(), self.params, self.rng)

    def state(self) -> dict:
        """JSON-able: the params and the generator's exact position."""
        return {"params": dataclasses.asdict(self.params), "rng": self.rng.bit_generator.state}

    @classmethod
    def from_state(cls, state: dict) -> "Sampler":
        s = cls(SamplerParams(**state["params"]))
        s.rng.bit_generator.state = state["rng"]
        return s
