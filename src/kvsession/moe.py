"""A mixture of experts in place of a layer's feed-forward network (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B).

As llama.cpp's build_moe_ffn computes it with softmax gating: a router
gives each token one logit per expert, softmax makes them probabilities,
the `used` most probable experts are chosen (in that order), their
probabilities are the weights (divided by their sum where the model
normalises them), each chosen expert is a SwiGLU FFN of its own, and the
token's output is the weighted outputs added in the order chosen.

Only the chosen experts' weights are read: a decode step multiplies the
blocks of `used` experts a layer, not all of them; a prompt's chunk groups
its tokens by expert, so that each expert's weights are read once for all
the tokens that chose it. The experts add nothing to the KV cache: a
session of a mixture is as small as a dense model's of the same attention.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F

# ggml_clamp's floor under the chosen weights' sum (the smallest float16 normal), before dividing by it
MIN_WEIGHT_SUM = 6.103515625e-5

Linear = Callable[[torch.Tensor], torch.Tensor]


class Experts:
    """router: [T, d_model] -> [T, n_experts] logits; gate_up[e]: [T, d_model] -> [T, 2 * d_ff] (gate, then up);
    down[e]: [T, d_ff] -> [T, d_model]."""

    def __init__(self, router: Linear, gate_up: Sequence[Linear], down: Sequence[Linear], used: int, norm: bool):
        if len(gate_up) != len(down) or not 0 < used <= len(down):
            raise ValueError(f"{used} of {len(down)} experts ({len(gate_up)} gate/up projections)")
        self.router, self.gate_up, self.down, self.used, self.norm = router, list(gate_up), list(down), used, norm

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, used] f32, experts [T, used]) of the normed tokens h [T, d_model], most probable first."""
        probs = torch.softmax(self.router(h).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.used, dim=-1)
        if self.norm:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=MIN_WEIGHT_SUM)
        return weights, chosen

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Expert e's SwiGLU of the tokens h [T, d_model], unweighted."""
        gate, up = self.gate_up[e](h).chunk(2, dim=-1)
        return self.down[e](F.silu(gate) * up)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:  # h: [T, d_model] f32, normed -> [T, d_model]
        weights, chosen = self.route(h)
        if h.shape[0] == 1:  # a decode step: its experts one after another, no grouping to do
            out = None
            for w, e in zip(weights[0].tolist(), chosen[0].tolist()):
                y = self.expert(e, h) * w
                out = y if out is None else out + y
            return out
        outs = torch.empty(h.shape[0], self.used, h.shape[1], dtype=h.dtype, device=h.device)
        for e in torch.unique(chosen).tolist():
            tokens, slots = (chosen == e).nonzero(as_tuple=True)
            outs[tokens, slots] = self.expert(e, h[tokens]) * weights[tokens, slots, None]
        out = outs[:, 0]
        for i in range(1, self.used):  # in the order chosen, as ggml adds them
            out = out + outs[:, i]
        return out
