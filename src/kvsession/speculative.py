"""Speculative decoding by prompt lookup: drafts from the conversation's own tokens (the verification is
generate.Decoding.accept).

Code edits, quotes and summaries repeat their context. After each sampled
token the sequence's last tokens are looked up among its earlier ones
(the prompt and the reply so far); where they occurred, the tokens that
followed them there are the draft (up to `k`). The sampled token and the
draft go through the model in one pass (session.advance, every position's
logits kept), and the draft is accepted as far as plain decoding would have
written it: at each position the decoder samples from that position's
logits, exactly as it would have one token at a time -- the same logits (on
the CPU's decode stack bit for bit), the same rules, the same generator
draws -- and the first token that differs from the draft is the next token,
already drawn (Decoding.drawn). So the output is plain
decoding's own, greedy or sampled, token for token; a draft is a guess about
it that costs one pass when it is right and the rejected positions'
arithmetic when it is not. For a deterministic draft this is the standard
speculative rule: a draft token d is kept with probability p(d), and a
rejection draws from p without d.

Rejected tokens never stay in the session: it is cut back to the accepted
ones before the step ends, so nothing saved or checkpointed holds them.

On these CPUs a decode step at one token is bound by reading the weights,
and each further token in the same pass costs its arithmetic only (about a
third of a step on Qwen2.5-Coder-0.5B at four tokens, BENCHMARKS.md), so a
draft pays where it is mostly right, and prose, where lookups rarely find
anything, barely pays for the lookups.
"""
from __future__ import annotations

from typing import Sequence

NGRAMS = (6, 3)  # lengths of the n-grams matched at the end of the sequence, the longest first
DRAFT = 12  # tokens drafted at most
# A refused draft token costs its arithmetic (about a third of a step at Qwen 0.5B's size on two cores), so the
# draft's length follows what was kept: one more than the last draft kept, growing by two while drafts are kept
# whole; and while fewer than GATE of the drafted tokens are kept, a sequence drafts only every PROBE-th step.
GATE = 0.3
PROBE = 8


class NgramDraft:
    """Where each n-gram of a sequence last ended, for the n of NGRAMS, kept as the sequence grows: a draft
    follows the longest n-gram that ends the sequence and occurred before (a longer match is a surer guess
    where short ones repeat: `settings[key] =` on every other line of a function)."""

    def __init__(self, tokens: Sequence[int], ngrams: Sequence[int] = NGRAMS, k: int = DRAFT,
                 eog: frozenset[int] = frozenset()):
        self.ngrams, self.k, self.eog = sorted(ngrams, reverse=True), k, eog
        self.length = 2  # the next draft's length at most (observe)
        self.kept = 0.5  # the share of drafted tokens kept, a moving average
        self.idle = 0  # steps without a draft while the share is below GATE
        self.tokens: list[int] = []
        self.seen: dict[tuple[int, ...], int] = {}  # n-gram -> the index just past its last occurrence
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens) - 1  # the n-grams before the newest token, not those ending with it
            for n in self.ngrams:
                if end >= n:
                    self.seen[tuple(self.tokens[end - n : end])] = end

    def propose(self, last: int, k: int | None = None) -> list[int]:
        """The draft after the sequence and its next token `last` (sampled, not yet in the sequence)."""
        k = min(self.length, self.k if k is None else k)
        if k <= 0:
            return []
        if self.kept < GATE:
            self.idle += 1
            if self.idle < PROBE:
                return []
        for n in self.ngrams:
            if len(self.tokens) + 1 < n:
                continue
            at = self.seen.get(tuple(self.tokens[len(self.tokens) - n + 1 :]) + (last,))
            if at is not None and at <= len(self.tokens):
                break
        else:
            return []
        draft = []
        for t in self.tokens[at : at + k]:
            if t in self.eog:
                break
            draft.append(t)
        return draft

    def observe(self, drafted: int, kept: int) -> None:
        """How the last draft went: its tokens, and how many of them were kept."""
        if drafted:
            self.idle = 0
            self.kept = 0.7 * self.kept + 0.3 * kept / drafted
            self.length = min(self.k, self.length + 2) if kept == drafted else kept + 1

    def sync(self, tokens: Sequence[int]) -> None:
        """Follow the sequence: it grew, or was cut back (n-grams past its end point nowhere: see propose)."""
        common = min(len(self.tokens), len(tokens))
        del self.tokens[common:]
        self.extend(tokens[common:])
