"""`kvsession perplexity`: a model's perplexity on a text, chunked exactly as llama-perplexity does.

People check a model and a quantization with llama.cpp's perplexity tool;
the same figure from this engine, on the same file and context, says
whether the two agree. llama-perplexity (tools/perplexity, its default
mode):

- tokenizes the whole text once, with BOS when the vocabulary asks for one;
- cuts it into n = len(tokens) // ctx chunks of ctx tokens (at least two
  chunks of text are required);
- evaluates each chunk from an empty cache, its first token replaced by
  BOS (when the vocabulary adds one);
- scores only the second half of each chunk: the logits at positions
  ctx/2 .. ctx-2 predicting the tokens after them, so every scored token
  sees at least ctx/2 tokens of context;
- reports exp(mean negative log-likelihood) after each chunk, and at the
  end PPL +/- the standard error of the mean NLL times PPL.

perplexity_peer.py does the same through llama-cpp-python in the peer's
Python, for the comparison (`--peer-python`).
"""
from __future__ import annotations

import json
import math
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from ..errors import KvsessionError

SCORE_BATCH = 256  # positions scored per forward: [256, vocab] float32 logits at most (155 MB for Qwen's vocab)


@dataclass
class Perplexity:
    n_tokens: int  # of the whole text
    n_ctx: int
    running: list[float] = field(default_factory=list)  # the estimate after each chunk
    nll: float = 0.0  # sums over every scored token
    nll2: float = 0.0
    count: int = 0
    seconds: float = 0.0

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def error(self) -> float:
        """llama-perplexity's +/-: the standard error of the mean NLL, times PPL."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        return math.sqrt(var / (self.count - 1)) * self.ppl if var > 0 and self.count > 1 else 0.0

    def add(self, nll: torch.Tensor) -> None:
        """One chunk's scored tokens' negative log-likelihoods (float64 [n])."""
        self.nll += float(nll.sum())
        self.nll2 += float((nll * nll).sum())
        self.count += nll.numel()
        self.running.append(self.ppl)


def chunks_of(tokens: list[int], n_ctx: int, bos: int | None, limit: int | None = None) -> list[list[int]]:
    """llama-perplexity's chunks: whole ctx-token slices, each starting with BOS when the model uses one."""
    if n_ctx < 4:
        raise KvsessionError(f"--ctx {n_ctx}: perplexity needs a context of at least 4 tokens")
    if len(tokens) < 2 * n_ctx:
        raise KvsessionError(f"the text has {len(tokens)} tokens; perplexity with --ctx {n_ctx} needs at least "
                             f"{2 * n_ctx} (two chunks): use a longer text or a smaller --ctx")
    n = len(tokens) // n_ctx if limit is None else min(limit, len(tokens) // n_ctx)
    out = []
    for i in range(n):
        chunk = tokens[i * n_ctx : (i + 1) * n_ctx]
        if bos is not None:
            chunk[0] = bos
        out.append(chunk)
    return out


def chunk_nll(engine, chunk: list[int], kv_dtype: str) -> torch.Tensor:
    """Negative log-likelihoods of the second half of a chunk, each token given everything before it."""
    n_ctx, first = len(chunk), len(chunk) // 2
    scratch = engine.session(max_tokens=n_ctx, kv_dtype=kv_dtype)
    scratch.prefill(chunk[:first])  # context only: no logits kept
    out = []
    for start in range(first, n_ctx - 1, SCORE_BATCH):
        part = chunk[start : min(start + SCORE_BATCH, n_ctx - 1)]
        logits = scratch.score(part)
        lp = torch.log_softmax(logits.double(), dim=-1)  # [T, vocab]
        targets = torch.tensor(chunk[start + 1 : start + 1 + len(part)], device=lp.device)
        out.append(-lp.gather(1, targets[:, None])[:, 0].cpu())
    return torch.cat(out)


def perplexity(engine, text: str, n_ctx: int, *, kv_dtype: str = "f16", limit: int | None = None,
               on_chunk: Callable[[Perplexity], None] | None = None) -> Perplexity:
    tk = engine.tokenizer
    tokens = tk.encode(text, special=False)  # llama-perplexity: text, BOS as the vocabulary says
    bos = tk.bos_id if tk.add_bos else None
    result = Perplexity(len(tokens), n_ctx)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for chunk in chunks_of(tokens, n_ctx, bos, limit):
            result.add(chunk_nll(engine, chunk, kv_dtype))
            if on_chunk:
                on_chunk(result)
    result.seconds = time.perf_counter() - t0
    return result


def peer_perplexity(python: str, model: Path, text_file: Path, n_ctx: int, threads: int,
                    limit: int | None) -> dict:
    """llama.cpp's figure on the same file and context, from perplexity_peer.py run by `python`."""
    script = Path(__file__).parents[1] / "bench" / "perplexity_peer.py"
    cmd = [python, str(script), str(model), str(text_file), str(n_ctx), str(threads), str(limit or 0)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    except OSError as e:
        raise KvsessionError(f"--peer-python {python}: cannot run it: {e.strerror or e}") from None
    if out.returncode != 0:
        raise KvsessionError(f"llama.cpp peer failed ({python}): {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
