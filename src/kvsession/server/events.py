"""What travels between a request and the worker: the Generation a request asks for, the Job a handler submits,
and the events that come back.

The worker runs on its own thread; each event is put on the job's asyncio
queue through the request's event loop (call_soon_threadsafe), in order.
A generation job gets Started when the worker admits it, Progress while
its prompt is prefilled, Output for each settled piece of a choice, and
ends with Done, Failed or Cancelled (which may come first: a job can fail
or be cancelled before it is admitted); a named session's job ends with
Answer, Failed or Cancelled. Keepalive is not the worker's: Frontend.run_job
adds it after each quiet --keepalive-seconds, so that each API's stream can
show it is alive in its own way (sse.py).
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..generate import Delta
from ..sampling import SamplerParams
from ..text.template import ChatPrompt
from .protocol import ApiError


@dataclass
class Generation:
    """What the worker needs for one completion: the whole prompt, as text and tokens, and how to answer."""

    prompt: ChatPrompt  # the rendered prompt (chat template applied, or the raw prompt) and its tokens
    params: SamplerParams
    max_tokens: int
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1  # choices: the prompt is prefilled once, its rows copied into n - 1 forks
    logit_bias: dict[int, float] | None = None
    top_logprobs: int | None = None  # None: no log-probabilities
    constraint: Any = None  # a grammar factory (grammar.py): .new() gives each choice its Constraint
    prompt_logprobs: bool = False  # completions' echo with logprobs: the prompt tokens' own
    checkpoint: bool = False  # checkpoint the session when done (the Responses API's stored state)
    post_sampling: bool = False  # log-probabilities after the sampler's chain (llama-server's post_sampling_probs)
    slot: int | None = None  # the lane to run in (llama-server's id_slot); None: the first free one
    cache_prompt: bool = True  # False: reuse no prefix, prefill the whole prompt (llama-server's cache_prompt)
    n_keep: int = 0  # with --context-shift: the first tokens a shift keeps (llama-server's n_keep) ...
    n_discard: int = 0  # ... and how many after them it drops (0: half of the rest)
    endpoint: str = ""  # for the trace
    session_key: str | None = None  # the client's name for its conversation (X-Session-Id, user, ...)
    warnings: list[str] = field(default_factory=list)  # what the request asked for and does not get (the trace)

    @property
    def text(self) -> str:
        return self.prompt.text

    @property
    def tokens(self) -> list[int]:
        return self.prompt.tokens


@dataclass(frozen=True)
class Started:
    """The worker admitted the request: its prompt's tokens, those reused, and where they came from."""

    prompt_tokens: int
    cached_tokens: int
    source: str
    slot: int  # the lane of the running set it runs in (llama-server's slot id)


@dataclass(frozen=True)
class Progress:
    """A chunk of the prompt was prefilled: `prefilled` of the `total` tokens left after the reused prefix."""

    prefilled: int
    total: int


@dataclass(frozen=True)
class Output:
    """What one choice's decoding settled: text, its tokens and their log-probabilities."""

    index: int  # the choice
    delta: Delta


@dataclass(frozen=True)
class ChoiceEnd:
    """How one choice ended."""

    index: int
    finish_reason: str | None  # "stop" (EOS or a stop string) or "length"
    stop_sequence: str | None  # the stop string that ended it, if one did
    completion_tokens: int
    tokens: list[int]  # the reply's tokens, as the session holds them
    truncated: bool = False  # the context was shifted to make room for it (--context-shift)


@dataclass(frozen=True)
class Done:
    """A generation finished: each choice's end, and the request's token counts."""

    choices: list[ChoiceEnd]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # all choices together
    prompt_logprobs: list | None  # completions' echo with logprobs: per prompt token, TokenLogprob or None
    source: str  # where the reused prefix came from
    slot: int = 0  # the lane it ran in
    prompt_seconds: float = 0.0  # from its admission to the end of its prefill
    predicted_seconds: float = 0.0  # from the end of its prefill to its last token


@dataclass(frozen=True)
class Embedding:
    """An embedding job: each input's tokens, pooled and normalized so (embedding.py)."""

    inputs: list[list[int]]
    pooling: str
    normalize: int


@dataclass(frozen=True)
class Answer:
    """A job other than a generation finished (a named session's, an embedding): the response body."""

    body: dict


@dataclass(frozen=True)
class Failed:
    """The job failed: the error its client gets, in its API's shape."""

    error: ApiError


@dataclass(frozen=True)
class Cancelled:
    """The job ended unfinished: its client left, or the server is stopping."""


@dataclass(frozen=True)
class Keepalive:
    """Nothing came for --keepalive-seconds (Frontend.run_job's, not the worker's)."""


Event = Started | Progress | Output | Done | Answer | Failed | Cancelled | Keepalive
FINAL = (Done, Answer, Failed, Cancelled)  # the events a job ends with


class Job:
    """One request's trip through the worker: events come back on the request's event loop.

    kind: "generate" (payload: a worker.Generation), a named session's "save", "restore" or "delete" (payload:
    its name), a slot's "slot_save", "slot_restore" or "slot_erase" (payload: (slot, name or None)), or "embed"
    (payload: an Embedding)."""

    def __init__(self, kind: str, payload: Any, loop: asyncio.AbstractEventLoop):
        self.kind, self.payload, self.loop = kind, payload, loop
        self.arrived = time.perf_counter()  # the time it waited for a lane is the trace's queued_ms
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = threading.Event()

    def emit(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)
