"""What the server counts as it serves, for /metrics: plain numbers, kept by the worker's thread.

The worker and the prefixes add to ServerStats as they go (tokens prefilled
and reused, passes through the model, drafts, restores and their latency);
GET /metrics (llama/metrics.py) reads them, with the state of the moment
(the running set, the live sessions, the store), when it is scraped. Only
the worker's thread writes; a scrape reads ints and floats, which Python
reads whole, and may see one request's counts half-added.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

RESTORE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # seconds


@dataclass
class Histogram:
    """Observations counted into buckets by upper bound (`bounds`, ascending; the last bucket is unbounded)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)


@dataclass
class ServerStats:
    prompt_tokens: int = 0  # prompt tokens prefilled (computed)
    reused: dict[str, int] = field(default_factory=dict)  # prompt tokens whose KV was reused, by where: live, disk, shared
    prompt_seconds: float = 0.0  # from a request's admission to the end of its prefill, summed
    predicted_tokens: int = 0  # tokens generated, every choice's
    predicted_steps: int = 0  # decode steps they took: the first token of a choice comes with its prompt's logits
    predicted_seconds: float = 0.0  # from the end of the prefill to the last token, summed
    passes: int = 0  # passes through the model (prefill chunks and decode steps, batched or alone)
    max_pass_tokens: int = 0  # the most tokens one pass took
    busy_slots: int = 0  # requests running, summed over the decode passes
    decode_passes: int = 0
    drafts: int = 0  # speculative drafts fed, their tokens, and those kept
    draft_tokens: int = 0
    accepted_tokens: int = 0
    requests: int = 0  # generation requests finished (not cancelled or failed)
    restores: Histogram = field(default_factory=lambda: Histogram(RESTORE_BUCKETS))  # from the disk cache
    context_shifts: int = 0

    def reuse(self, source: str, tokens: int) -> None:
        self.reused[source] = self.reused.get(source, 0) + tokens

    def passed(self, tokens: int, decoding: int) -> None:
        """One pass through the model of `tokens` tokens, with `decoding` requests decoding in it."""
        self.passes += 1
        self.max_pass_tokens = max(self.max_pass_tokens, tokens)
        if decoding:
            self.decode_passes += 1
            self.busy_slots += decoding
