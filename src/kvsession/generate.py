"""Generation in three layers (mlx-lm's split):

- `generate_tokens(session, max_tokens)`: the decode loop; sample, feed, repeat.
- `stream(session, prompt, ...)`: prefill the prompt, then yield text deltas that
  never split a UTF-8 character, honour stop strings, and keep timing.
- `generate(session, prompt, ...)`: the whole reply as one string.

A sampled end-of-generation token ends the loop without being fed to the
model: the session then holds the prompt and the visible reply, and its
logits still predict the position the EOS token was drawn for. Every other
sampled token is fed, so the session always ends with valid logits.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

from .session import DEFAULT_CHUNK, Session


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


@dataclass
class Delta:
    text: str
    tokens: list[int] = field(default_factory=list)


def generate_tokens(session: Session, max_tokens: int, stats: Stats | None = None, *,
                    ignore_eos: bool = False) -> Iterator[int]:
    """Sample up to max_tokens tokens, feeding each to the session; stop at an EOG token unless ignore_eos."""
    eog = frozenset() if ignore_eos else session.engine.tokenizer.eog_ids
    stats = stats if stats is not None else Stats()
    for _ in range(max_tokens):
        t0 = time.perf_counter()
        token = session.sample()
        if token in eog:
            stats.finish_reason = "stop"
            stats.decode_seconds += time.perf_counter() - t0
            return
        session.append(token)
        stats.generated_tokens += 1
        stats.decode_seconds += time.perf_counter() - t0
        yield token
    stats.finish_reason = "length"


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
    pending, pending_tokens = "", []
    for token in generate_tokens(session, max_tokens, stats, ignore_eos=ignore_eos):
        pending += detok.step(token)
        pending_tokens.append(token)
        if stops:
            found = [(i, s) for s in stops if (i := pending.find(s)) >= 0]
            if found:
                cut, stats.stop_sequence = min(found)
                stats.finish_reason = "stop"
                if cut:
                    yield Delta(pending[:cut], pending_tokens)
                return
        # hold back what could still be the start of a stop string
        safe = len(pending) - (hold - 1 if hold else 0)
        if safe > 0:
            yield Delta(pending[:safe], pending_tokens)
            pending, pending_tokens = pending[safe:], []
    pending += detok.finish()
    if pending:
        yield Delta(pending, pending_tokens)


def generate(session: Session, prompt: Sequence[int], **kw) -> str:
    return "".join(d.text for d in stream(session, prompt, **kw))
