"""Speculative decoding by prompt lookup: drafts from the conversation's own tokens (the verification is
generate.Decoding.accept).

Code edits, quotes and summaries repeat their context. After each sampled
token the sequence's last `n` tokens are looked up among its earlier ones
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

NGRAM = 3  # tokens matched at the end of the sequence
DRAFT = 6  # tokens drafted at most


class NgramDraft:
    """The positions where each n-gram of a sequence last ended, kept as the sequence grows."""

    def __init__(self, tokens: Sequence[int], n: int = NGRAM, k: int = DRAFT, eog: frozenset[int] = frozenset()):
        self.n, self.k, self.eog = n, k, eog
        self.tokens: list[int] = []
        self.seen: dict[tuple[int, ...], int] = {}  # n-gram -> the index just past its last occurrence
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.tokens.append(t)
            if len(self.tokens) > self.n:  # the n-gram before the newest token, not the newest one itself
                end = len(self.tokens) - 1
                self.seen[tuple(self.tokens[end - self.n : end])] = end

    def sync(self, tokens: Sequence[int]) -> None:
        """Follow the sequence: it grew, or was cut back (n-grams past its end point nowhere: see propose)."""
        common = min(len(self.tokens), len(tokens))
        del self.tokens[common:]
        self.extend(tokens[common:])

    def propose(self, last: int, k: int | None = None) -> list[int]:
        """The draft after the sequence and its next token `last` (sampled, not yet in the sequence)."""
        k = self.k if k is None else k
        if k <= 0 or len(self.tokens) < self.n:
            return []
        key = tuple(self.tokens[len(self.tokens) - self.n + 1 :]) + (last,)
        at = self.seen.get(key)
        if at is None or at > len(self.tokens):
            return []
        draft = []
        for t in self.tokens[at : at + k]:
            if t in self.eog:
                break
            draft.append(t)
        return draft
