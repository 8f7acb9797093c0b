"""`kvsession bench --grammar`: constrained decoding's cost, grammar compile time and the per-token mask
against a decode step, for JSON objects, a JSON schema and tool calls."""
from __future__ import annotations

import statistics
import time

import torch

from ..engine import Engine
from ..sampling import GREEDY


class _TimedConstraint:
    """A constraint whose allowed() and advance() calls are timed, one figure per generated token."""

    def __init__(self, inner):
        self.inner = inner
        self.seconds: list[float] = []

    def allowed(self):
        t0 = time.perf_counter()
        mask = self.inner.allowed()
        self.seconds.append(time.perf_counter() - t0)
        return mask

    def advance(self, token: int) -> None:
        t0 = time.perf_counter()
        self.inner.advance(token)
        self.seconds[-1] += time.perf_counter() - t0

    @property
    def done(self) -> bool:
        return self.inner.done


def grammar_bench(engine: Engine, args) -> int:
    """Constrained decoding's cost: grammar compile time and the per-token mask against a decode step."""
    from ..generate import Stats, TokenRules, stream
    from ..server.grammar import Grammars
    from ..server.tool_formats import format_for

    weather = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
               "parameters": {"type": "object", "properties": {
                   "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
    search = {"type": "function", "function": {"name": "web_search", "parameters": {"type": "object", "properties": {
        "query": {"type": "string"}, "max_results": {"type": "integer", "minimum": 1, "maximum": 20}},
        "required": ["query"]}}}
    schema = {"type": "object", "properties": {
        "title": {"type": "string"}, "year": {"type": "integer", "minimum": 1800, "maximum": 2100},
        "genres": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "rating": {"type": "number"}, "sequel": {"type": "boolean"}},
        "required": ["title", "year", "genres", "rating", "sequel"], "additionalProperties": False}
    film = [{"role": "user", "content": "Describe the film Alien (1979) as JSON with its title, year, genres, "
                                        "rating out of 10 and whether it has a sequel."}]
    call = [{"role": "user", "content": "What's the weather in Paris, and search the web for Louvre opening hours."}]
    fmt = format_for(engine.template.source)

    t0 = time.perf_counter()
    grammars = Grammars(engine)
    print(f"model   {engine.path.name}, vocabulary {grammars.n_vocab:,}, {engine.device}, "
          f"{torch.get_num_threads()} threads; grammar tokenizer built in {time.perf_counter() - t0:.2f} s")

    cases = [
        ("json object", lambda: grammars.json(None, strict=False), film, None),
        ("json schema", lambda: grammars.json(schema, strict=True), film, None),
        ("tools required", lambda: grammars.tool_calls(fmt, [weather, search], "required", True), call,
         [weather, search]),
        ("tools auto", lambda: grammars.tool_calls(fmt, [weather, search], "auto", True), call, [weather, search]),
    ]
    replies = []
    print(f"\n{'grammar':<16}{'compile ms':>11}{'first ms':>10}{'mask mean':>10}{'p50':>8}{'p99':>8}"
          f"{'tokens':>8}{'step ms':>9}{'mask/step':>10}")
    for name, make, messages, tools in cases:
        t0 = time.perf_counter()
        factory = make()
        compile_ms = (time.perf_counter() - t0) * 1e3
        prompt = engine.chat_prompt(messages, tools=tools)
        session = engine.session(sampler=GREEDY, kv_dtype=args.kv_dtype)
        constraint = _TimedConstraint(factory.new())
        stats = Stats()
        text = "".join(d.text for d in stream(session, prompt.tokens, max_tokens=args.decode_tokens, stats=stats,
                                              rules=TokenRules(constraint=constraint)))
        replies.append((name, text))
        masks = sorted(constraint.seconds[1:]) or [0.0]  # the first mask builds the lexer: shown on its own
        step = (stats.decode_seconds - sum(constraint.seconds)) / max(1, len(constraint.seconds))
        mean = statistics.mean(masks)
        print(f"{name:<16}{compile_ms:>11.2f}{constraint.seconds[0] * 1e3:>10.2f}{mean * 1e3:>10.3f}"
              f"{masks[len(masks) // 2] * 1e3:>8.3f}{masks[min(len(masks) - 1, int(len(masks) * 0.99))] * 1e3:>8.3f}"
              f"{stats.generated_tokens:>8}{step * 1e3:>9.1f}{mean / step if step else 0:>10.2%}")
    print("\nmask: allowed() + advance() per token, as bool [vocab] on the device; step: the rest of a decode step")
    for name, text in replies:
        print(f"{name:<16}{text[:100]!r}")
    return 0
