"""A mixture of experts in place of a layer's feed-forward network (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B, gpt-oss).

As llama.cpp's build_moe_ffn computes it: a router gives each token one
logit per expert; with softmax gating (qwen3moe) softmax makes them
probabilities, the `used` most probable experts are chosen (in that order)
and their probabilities are the weights (divided by their sum where the
model normalises them); with softmax-weight gating (gpt-oss) the `used`
largest logits choose, and a softmax over those gives the weights. Each
chosen expert is a gated FFN of its own (SwiGLU; gpt-oss's clamped
variant), and the token's output is the weighted outputs added in the order
chosen.

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

from ..kernels import ExpertsStep

# ggml_clamp's floor under the chosen weights' sum (the smallest float16 normal), before dividing by it
MIN_WEIGHT_SUM = 6.103515625e-5

Linear = Callable[[torch.Tensor], torch.Tensor]
Glu = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

GATINGS = ("softmax", "softmax_weight")

# gpt-oss's constants (llama-graph.cpp, LLM_FFN_SWIGLU_OAI_MOE)
OAI_ALPHA, OAI_LIMIT = 1.702, 7.0


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gate: the gate clamped from above, up clamped both ways and shifted by one (ggml_swiglu_oai)."""
    x = gate.clamp(max=OAI_LIMIT)
    return x / (1 + torch.exp(x * -OAI_ALPHA)) * (up.clamp(-OAI_LIMIT, OAI_LIMIT) + 1)


GLUS: dict[str, Glu] = {"silu": swiglu, "swiglu_oai": swiglu_oai}


class Experts:
    """router: [T, d_model] -> [T, n_experts] logits; gate_up[e]: [T, d_model] -> [T, 2 * d_ff] (gate, then up);
    down[e]: [T, d_ff] -> [T, d_model]."""

    def __init__(self, router: Linear, gate_up: Sequence[Linear], down: Sequence[Linear], used: int, *,
                 norm: bool = False, gating: str = "softmax", activation: str = "silu"):
        if len(gate_up) != len(down) or not 0 < used <= len(down):
            raise ValueError(f"{used} of {len(down)} experts ({len(gate_up)} gate/up projections)")
        if gating not in GATINGS:
            raise ValueError(f"expert gating {gating!r}: one of {', '.join(GATINGS)}")
        self.router, self.gate_up, self.down, self.used = router, list(gate_up), list(down), used
        self.norm, self.gating, self.glu = norm, gating, GLUS[activation]
        self.step = ExpertsStep.of(self.gate_up, self.down, activation)  # a decode step's experts in one C call

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, used] f32, experts [T, used]) of the normed tokens h [T, d_model], most probable first."""
        logits = self.router(h).float()
        if self.gating == "softmax_weight":
            top, chosen = torch.topk(logits, self.used, dim=-1)
            weights = torch.softmax(top, dim=-1)
        else:
            weights, chosen = torch.topk(torch.softmax(logits, dim=-1), self.used, dim=-1)
        if self.norm:
            weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=MIN_WEIGHT_SUM)
        return weights, chosen

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        """Expert e's gated FFN of the tokens h [T, d_model], unweighted."""
        gate, up = self.gate_up[e](h).chunk(2, dim=-1)
        return self.down[e](self.glu(gate, up))

    def __call__(self, h: torch.Tensor) -> torch.Tensor:  # h: [T, d_model] f32, normed -> [T, d_model]
        weights, chosen = self.route(h)
        if h.shape[0] == 1 and self.step is not None:  # a decode step's experts, in one call of the kernels
            return self.step(h, chosen[0].numpy(), weights[0].numpy())
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
