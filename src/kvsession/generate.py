"""Generation in three layers (mlx-lm's split):

- `steps(session, max_tokens)`: the decode loop; sample, feed, repeat (and
  `generate_tokens`, the same as bare token ids).
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

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

import torch

from .errors import KvsessionError
from .session import DEFAULT_CHUNK, Session

MAX_TOP_LOGPROBS = 20


@dataclass
class Stats:
    prompt_tokens: int = 0  # tokens prefilled for this request
    cached_tokens: int = 0  # tokens the session already held when it started
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
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


def steps(session: Session, max_tokens: int, stats: Stats | None = None, *, ignore_eos: bool = False,
          rules: TokenRules | None = None) -> Iterator[Step]:
    """Sample up to max_tokens tokens, feeding each to the session; stop at an EOG token unless ignore_eos,
    and where the rules' constraint is done."""
    eog = frozenset() if ignore_eos else session.engine.tokenizer.eog_ids
    stats = stats if stats is not None else Stats()
    rules = rules or TokenRules()
    bias = _bias_tensors(rules.logit_bias, session)
    for _ in range(max_tokens):
        t0 = time.perf_counter()
        logits = _steered(session, bias, rules.constraint)
        token = session.sampler(logits)
        logprob = logprob_of(session.logits, token, rules.top_logprobs) if rules.top_logprobs is not None else None
        if token in eog:
            stats.finish_reason = "stop"
            stats.decode_seconds += time.perf_counter() - t0
            return
        session.append(token)
        stats.generated_tokens += 1
        if rules.constraint is not None:
            rules.constraint.advance(token)
        stats.decode_seconds += time.perf_counter() - t0
        yield Step(token, logprob)
        if rules.constraint is not None and rules.constraint.done:
            stats.finish_reason = "stop"
            return
    stats.finish_reason = "length"


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
        logits = engine.model.forward(part, range(i, i + len(part)), scratch.cache, all_logits=True)  # [T, vocab]
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
) -> Iterator[Delta]:
    """Prefill `prompt` after what the session holds, then stream the reply as text deltas."""
    stats = stats if stats is not None else Stats()
    stats.cached_tokens = len(session)
    stats.prompt_tokens = len(prompt)
    t0 = time.perf_counter()
    session.prefill(prompt, chunk_size=chunk_size, progress=progress)
    stats.prefill_seconds = time.perf_counter() - t0
    detok = session.engine.tokenizer.stream()
    stops = [s for s in stop if s]
    hold = max((len(s) for s in stops), default=0)
    pending, pending_tokens, pending_lp = "", [], []
    for step in steps(session, max_tokens, stats, ignore_eos=ignore_eos, rules=rules):
        pending += detok.step(step.token)
        pending_tokens.append(step.token)
        if step.logprob is not None:
            pending_lp.append(step.logprob)
        if stops:
            found = [(i, s) for s in stops if (i := pending.find(s)) >= 0]
            if found:
                cut, stats.stop_sequence = min(found)
                stats.finish_reason = "stop"
                if cut:
                    yield Delta(pending[:cut], pending_tokens, pending_lp)
                return
        # hold back what could still be the start of a stop string
        safe = len(pending) - (hold - 1 if hold else 0)
        if safe > 0:
            yield Delta(pending[:safe], pending_tokens, pending_lp)
            pending, pending_tokens, pending_lp = pending[safe:], [], []
    pending += detok.finish()
    if pending or pending_tokens:
        yield Delta(pending, pending_tokens, pending_lp)


def generate(session: Session, prompt: Sequence[int], **kw) -> str:
    return "".join(d.text for d in stream(session, prompt, **kw))
