"""Generation in three layers (mlx-lm's split):

- `steps(session, max_tokens)`: the decode loop; sample, feed, repeat (and
  `generate_tokens`, the same as bare token ids). `Steps` and `Decoding`
  are the same loop turned inside out, for a caller that feeds several
  sequences' tokens through the model at once (the server).
- `stream(session, prompt, ...)`: prefill the prompt, then yield text deltas that
  never split a UTF-8 character, honour stop strings, and keep timing.
- `generate(session, prompt, ...)`: the whole reply as one string.

A sampled end-of-generation token ends the loop without being fed to the
model: the session then holds the prompt and the visible reply, and its
logits still predict the position the EOS token was drawn for. Every other
sampled token is fed, so the session always ends with valid logits.

`TokenRules` shape each step beyond the sampler: a logit bias, a
constraint (a grammar that says which tokens may come next, see
server/grammar.py), and log-probabilities to report. Log-probabilities are
the model's own distribution (a log-softmax of its logits), before bias,
constraint and sampler settings, as OpenAI reports them.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from .errors import KvsessionError
from .sampling import SamplerParams, candidates
from .session import DEFAULT_CHUNK, Session, advance
from .speculative import NgramDraft

MAX_TOP_LOGPROBS = 20


@dataclass
class Stats:
    prompt_tokens: int = 0  # tokens prefilled for this request
    cached_tokens: int = 0  # tokens the session already held when it started
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    draft_tokens: int = 0  # tokens drafted for speculative decoding (speculative.py) ...
    accepted_tokens: int = 0  # ... and kept
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length"
    stop_sequence: str | None = None  # the stop string that ended the reply, if one did

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        return self.generated_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Constraint(Protocol):
    """Which tokens may come next: a grammar's state, one object per generated sequence."""

    def allowed(self) -> torch.Tensor | None:
        """bool [n_vocab] (True: may be sampled), or None when any token may come."""

    def advance(self, token: int) -> None:
        """The token was sampled (and fed): move past it."""

    @property
    def done(self) -> bool:
        """Complete, and nothing more may follow: generation stops here."""


@dataclass
class TokenRules:
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (-100: never, +100: always)
    constraint: Constraint | None = None
    top_logprobs: int | None = None  # None: no log-probabilities; 0..20: the chosen token's and this many more
    post_sampling: bool = False  # log-probabilities after the sampler's chain (llama-server's post_sampling_probs)


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens and their log-probabilities, best first


@dataclass
class Step:
    token: int
    logprob: TokenLogprob | None = None


@dataclass
class Delta:
    text: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked for


class Steps:
    """One sequence's tokens, for a caller that feeds them: choose() samples the next one from the session's
    logits (None: the sequence is over, `stats.finish_reason` says why), the caller appends it to the session
    (alone, or with other sequences in one pass through the model: server/worker.py), then fed() moves the
    rules past it. An EOG token ends the sequence unfed (unless ignore_eos), as does a finished constraint."""

    def __init__(self, session: Session, max_tokens: int, stats: Stats | None = None, *, ignore_eos: bool = False,
                 rules: TokenRules | None = None):
        self.session = session
        self.left = max_tokens
        self.stats = stats if stats is not None else Stats()
        self.rules = rules or TokenRules()
        self.eog = frozenset() if ignore_eos else session.engine.tokenizer.eog_ids
        self.bias = _bias_tensors(self.rules.logit_bias, session)
        self.over = False
        self.drawn: int | None = None  # the next token, already sampled (accept: where a draft was refused)
        self._t0 = 0.0
        self._logprob: TokenLogprob | None = None

    def choose(self) -> int | None:
        if self.over:
            return None
        if self.drawn is not None:
            token, self.drawn = self.drawn, None
            self._t0 = time.perf_counter()
            return token
        if self.left <= 0:
            return self._end("length")
        t0 = time.perf_counter()
        logits = _steered(self.session, self.bias, self.rules.constraint)
        token = self.session.sampler(logits)
        top = self.rules.top_logprobs
        if top is None:
            self._logprob = None
        elif self.rules.post_sampling:
            self._logprob = sampled_logprob_of(logits, self.session.sampler.params, token, top)
        else:
            self._logprob = logprob_of(self.session.logits, token, top)
        if token in self.eog:
            self.stats.decode_seconds += time.perf_counter() - t0
            return self._end("stop")
        self._t0 = t0
        return token

    def fed(self, token: int) -> Step:
        """The chosen token is in the session now (the step's time runs from choose() to here)."""
        self.left -= 1
        self.stats.generated_tokens += 1
        constraint = self.rules.constraint
        if constraint is not None:
            constraint.advance(token)
        self.stats.decode_seconds += time.perf_counter() - self._t0
        if constraint is not None and constraint.done:
            self._end("stop")
        return Step(token, self._logprob)

    def room(self) -> int:
        """How many tokens a draft after the next one may hold: what max_tokens, the context and a ring's margin
        leave (a ring is cut back over at most its margin)."""
        s = self.session
        return max(0, min(self.left - 1, s.max_tokens - len(s) - 1, s.ring_margin - 1))

    def _end(self, reason: str) -> None:
        self.over = True
        self.stats.finish_reason = reason
        return None


def steps(session: Session, max_tokens: int, stats: Stats | None = None, *, ignore_eos: bool = False,
          rules: TokenRules | None = None) -> Iterator[Step]:
    """Sample up to max_tokens tokens, feeding each to the session; stop at an EOG token unless ignore_eos,
    and where the rules' constraint is done."""
    s = Steps(session, max_tokens, stats, ignore_eos=ignore_eos, rules=rules)
    while (token := s.choose()) is not None:
        session.append(token)
        yield s.fed(token)


def generate_tokens(session: Session, max_tokens: int, stats: Stats | None = None, *,
                    ignore_eos: bool = False, rules: TokenRules | None = None) -> Iterator[int]:
    """`steps`, as bare token ids."""
    return (s.token for s in steps(session, max_tokens, stats, ignore_eos=ignore_eos, rules=rules))


def _bias_tensors(bias: dict[int, float] | None, session: Session) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not bias:
        return None
    n = session.engine.config.vocab_size
    bad = [t for t in bias if not 0 <= t < n]
    if bad:
        raise KvsessionError(f"logit_bias: token {bad[0]} is outside the vocabulary of {n}")
    return torch.tensor(list(bias), dtype=torch.long), torch.tensor(list(bias.values()), dtype=torch.float32)


def _steered(session: Session, bias, constraint: Constraint | None) -> torch.Tensor:
    """The logits the sampler sees: the model's, plus the bias, minus what the constraint forbids."""
    if session.logits is None:
        raise KvsessionError("the session is empty: prefill a prompt before sampling")
    mask = constraint.allowed() if constraint is not None else None
    if bias is None and mask is None:
        return session.logits
    logits = session.logits.float().clone()  # [vocab]
    if bias is not None:
        logits.index_add_(0, bias[0], bias[1])
    if mask is not None:
        if not bool(mask.any()):
            raise KvsessionError("the constraint allows no token here (the grammar is stuck)")
        logits.masked_fill_(~mask[: logits.numel()], float("-inf"))
    return logits


def prompt_logprobs_of(engine, tokens: Sequence[int], top: int, chunk: int = 256) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the tokens before it (None for the first), as completions'
    echo reports them. A scratch session, a chunk of positions at a time: [chunk, vocab] logits at most."""
    scratch = engine.session(max_tokens=len(tokens) + 1)
    out: list[TokenLogprob | None] = [None]
    for i in range(0, len(tokens), chunk):
        part = tokens[i : i + chunk]
        logits = scratch.score(part)  # [T, vocab]
        for j in range(len(part)):
            if i + j + 1 < len(tokens):
                out.append(logprob_of(logits[j], tokens[i + j + 1], top))
    return out


def logprob_of(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    """The token's log-probability under the model's distribution, and the `top` most likely tokens'."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [vocab]
    best = torch.topk(lp, min(top, MAX_TOP_LOGPROBS)) if top else None
    alternatives = list(zip(best.indices.tolist(), best.values.tolist())) if best is not None else []
    return TokenLogprob(token, float(lp[token]), alternatives)


def sampled_logprob_of(logits: torch.Tensor, params: SamplerParams, token: int, top: int) -> TokenLogprob:
    """The token's log-probability in the distribution the sampler drew it from (after bias, constraint, top-k,
    top-p, min-p and temperature), and the `top` most likely tokens' there: only tokens the chain left, so
    possibly fewer than `top`."""
    ids, probs = candidates(logits.detach().float().cpu().numpy(), params)
    where = np.flatnonzero(ids == token)
    chosen = math.log(probs[where[0]]) if where.size and probs[where[0]] > 0 else -math.inf
    best = [(int(i), math.log(p)) for i, p in zip(ids[:min(top, MAX_TOP_LOGPROBS)], probs) if p > 0]
    return TokenLogprob(token, chosen, best)


class Decoding(Steps):
    """Steps that also read as text: fed() returns the text a token settles (a Delta, or None while it may
    still begin a stop string or ends inside a character), finish() what is held back at the end.

    speculative: draft(token) guesses the tokens after the next one from the sequence's own (speculative.py); the
    caller feeds them all in one pass and settle() keeps what plain decoding would have written."""

    def __init__(self, session: Session, max_tokens: int, stats: Stats | None = None, *, stop: Sequence[str] = (),
                 ignore_eos: bool = False, rules: TokenRules | None = None, speculative: bool = False):
        super().__init__(session, max_tokens, stats, ignore_eos=ignore_eos, rules=rules)
        self.drafts = NgramDraft(session.tokens, eog=self.eog) if speculative else None
        # a hybrid's recurrent state cannot drop a refused draft token: draft() marks the point before the
        # verifying pass (Session.mark), accept() goes back to it and replays what it keeps
        self.recurrent = bool(session.engine.config.recurrent)
        self.trial: int | None = None  # the mark draft() made, where it made one
        self.detok = session.engine.tokenizer.stream()
        self.stops = [x for x in stop if x]
        self.hold = max((len(x) for x in self.stops), default=0)
        self.pending, self.pending_tokens, self.pending_lp = "", [], []
        self.stopped = False  # by a stop string: nothing is held back

    def fed(self, token: int) -> Delta | None:
        step = super().fed(token)
        self.pending += self.detok.step(token)
        self.pending_tokens.append(token)
        if step.logprob is not None:
            self.pending_lp.append(step.logprob)
        if self.stops:
            found = [(i, x) for x in self.stops if (i := self.pending.find(x)) >= 0]
            if found:
                cut, self.stats.stop_sequence = min(found)
                self.stopped = True
                self._end("stop")
                return Delta(self.pending[:cut], self.pending_tokens, self.pending_lp) if cut else None
        # hold back what could still be the start of a stop string
        safe = len(self.pending) - (self.hold - 1 if self.hold else 0)
        if safe <= 0:
            return None
        out = Delta(self.pending[:safe], self.pending_tokens, self.pending_lp)
        self.pending, self.pending_tokens, self.pending_lp = self.pending[safe:], [], []
        return out

    def accept(self, fed: list[int], rows: torch.Tensor) -> list[Delta]:
        """fed = [the token choose() gave] + a draft went through the model after the session (rows [len(fed),
        vocab]: the logits after each; speculative.py). Keeps what plain decoding would have written -- each position
        sampled from its own logits, as it would have been one token at a time -- cuts the session back past the
        rest, and returns the text it settles. The first token that differs from the draft is drawn already:
        choose() gives it next."""
        s = self.session
        out = [d for d in (self.fed(fed[0]),) if d is not None]
        kept = 1
        for j, d in enumerate(fed[1:]):
            s.logits = rows[j]
            x = self.choose()
            if x is None or x != d:
                self.drawn = x
                break
            kept += 1
            delta = self.fed(d)
            if delta is not None:
                out.append(delta)
            if self.over:  # a stop string, or the constraint is done
                break
        if kept < len(fed) and self.recurrent:
            s.truncate(len(s) - len(fed))  # the mark before the pass; the rows of what it keeps, again
            s.prefill(fed[:kept])
        elif kept < len(fed):
            s.truncate(len(s) - (len(fed) - kept))
        if self.trial is not None:
            s.unmark(self.trial)
            self.trial = None
        s.logits = rows[kept - 1]
        self.stats.draft_tokens += len(fed) - 1
        self.stats.accepted_tokens += kept - 1
        return out

    def shift(self, keep: int, discard: int) -> None:
        """A context shift of the session (Session.shift): the drafts follow its new tokens."""
        self.session.shift(keep, discard)
        if self.drafts is not None:
            self.drafts = NgramDraft(self.session.tokens, eog=self.eog)

    def draft(self, token: int) -> list[int]:
        """The draft after the chosen `token` (none when not speculative, or where nothing repeats); a hybrid's
        session is marked before it goes through the model."""
        out = self.drafts.propose(token, self.room()) if self.drafts is not None else []
        s = self.session
        if out and self.recurrent and len(s) not in s.marks:
            s.mark()
            self.trial = len(s)
        return out

    def settle(self, fed: list[int], rows: torch.Tensor | None) -> list[Delta]:
        """fed = [the chosen token] + its draft(), now in the session (rows: the logits after each, where a
        draft was fed); the text they settle, the draft's unkept tokens cut back (accept)."""
        if len(fed) > 1:
            kept = self.stats.accepted_tokens
            out = self.accept(fed, rows)
            self.drafts.observe(len(fed) - 1, self.stats.accepted_tokens - kept)
        else:
            out = [d for d in (self.fed(fed[0]),) if d is not None]
        if self.drafts is not None:
            self.drafts.sync(self.session.tokens)
        return out

    def finish(self) -> Delta | None:
        if self.stopped:
            return None
        self.pending += self.detok.finish()
        if not (self.pending or self.pending_tokens):
            return None
        out = Delta(self.pending, self.pending_tokens, self.pending_lp)
        self.pending, self.pending_tokens, self.pending_lp = "", [], []
        return out


def stream(
    session: Session,
    prompt: Sequence[int],
    *,
    max_tokens: int = 256,
    stop: Sequence[str] = (),
    chunk_size: int = DEFAULT_CHUNK,
    stats: Stats | None = None,
    progress: Callable[[int, int], None] | None = None,
    ignore_eos: bool = False,
    rules: TokenRules | None = None,
    speculative: bool = False,
    stops: int = 0,
) -> Iterator[Delta]:
    """Prefill `prompt` after what the session holds, then stream the reply as text deltas. speculative: drafts
    from the conversation's own tokens verified in one pass each (speculative.py): the same reply, sooner where it
    repeats its context. stops: the prefill's chunks also end at multiples of it (Session.prefill)."""
    stats = stats if stats is not None else Stats()
    stats.cached_tokens = len(session)
    stats.prompt_tokens = len(prompt)
    t0 = time.perf_counter()
    session.prefill(prompt, chunk_size=chunk_size, progress=progress, stops=stops)
    stats.prefill_seconds = time.perf_counter() - t0
    d = Decoding(session, max_tokens, stats, stop=stop, ignore_eos=ignore_eos, rules=rules, speculative=speculative)
    while (token := d.choose()) is not None:
        fed = [token] + d.draft(token)
        if len(fed) > 1:
            (rows,) = advance([(session, fed)], keep=[True])
        else:
            session.append(token)
            rows = None
        yield from d.settle(fed, rows)
    tail = d.finish()
    if tail is not None:
        yield tail


def generate(session: Session, prompt: Sequence[int], **kw) -> str:
    return "".join(d.text for d in stream(session, prompt, **kw))
