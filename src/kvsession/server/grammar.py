"""Constrained decoding: JSON (any object, or a JSON schema) and tool calls, as generate.Constraint objects.

The grammar engine is llguidance (Rust, from the Guidance project; llama.cpp
and vLLM ship it too), chosen by measurement against xgrammar 0.2.9 on
Qwen2.5-Coder's 151,936-token vocabulary, on this shared two-core CPU (one
torch thread), both fed token by token the 71 tokens of an instance of a
five-property schema (nested object, array, enum, integer range) and both
right on every token:

                          llguidance 1.9.1     xgrammar 0.2.9
    tokenizer build       0.6-1.0 s            0.06-0.12 s
    compile, schema       0.7-1.3 ms           16-47 ms (0.1 ms once cached)
    compile, any object   0.4-0.7 ms           0.9-1.3 ms (built-in JSON: 25-55 ms)
    mask, median          0.03 ms              0.02 ms
    mask, worst           0.2-0.4 ms           0.1-0.3 ms

(mask: computing the bitmask and turning it into a bool [vocab] tensor).
Both are far inside the budget; llguidance won on what the server needs
beyond speed: it names what it cannot honour in a schema (`Unimplemented
keys: ["not"]`, `minimum (5) is greater than maximum (1)`) where xgrammar
ignores `not` and constrains to something else; it tells a grammar that is
complete but may go on (is_accepting: allow EOS) from one that cannot
(is_stopped: `done`); and Lark rules with inline `%json {schema}` make the
tool-call grammars a few lines. Inside the decode loop the mask costs more
than in isolation, since a forward pass has just evicted llguidance's tables
from the caches: `grammar_bench` (bench/grammar.py) measures 0.3-0.4 ms a token
(p99 under 5 ms) against a Qwen 0.5B decode step of ~100 ms, 0.3-0.4%.

Tool calls follow llama.cpp's lazy grammars: with tool_choice "auto" the
reply is free text, at no cost, until the format's trigger (`<tool_call>`)
appears, or until the reply opens with `{` or a ```json fence (how
Qwen2.5-Coder really writes its calls, see tool_formats/calls.py); from there the call
must be one of the tools, its arguments must match the tool's parameters
schema, and after the call comes another call (parallel) or the end. While
the reply is still empty (or whitespace), a token that opens it with `{`
must be one the call grammar takes: Qwen2.5-Coder-1.5B opened a reply
with the token `{{` and wrote `{{"name": ...}}}`, which no grammar could
take over from, so the call reached Claude Code as text.
"required" and a named function force a call from the first token; "none"
forbids the trigger token. JSON is written with the separators ", " and
": ", no other whitespace, and no \\u escapes for printable characters
(llguidance's default), so that a constrained call reads exactly as the
chat template renders it back (tojson), and prefix reuse holds. A tool's
parameters that list properties get additionalProperties false unless they
say otherwise: a call's arguments are the declared ones.

Each format writes the syntax around a call (tool_formats/): the JSON
object under "arguments" or "parameters" (Llama 3, a bare object), in tags
or a list (Granite), after a harmony header (gpt-oss: no text opens a call
inside free text there, so "auto" is free and only forced calls are
constrained), or Qwen3-Coder's XML, a parameter at a time: text values run
to the first `\n</parameter>\n` (a lazy rule), typed ones are `%json`.
"""
from __future__ import annotations

import asyncio
import threading
import weakref
from functools import cached_property
from typing import Callable, Sequence, TypeVar

import numpy as np
import torch

from ..errors import KvsessionError
from .protocol import ApiError
from .tool_formats import ToolFormat

try:
    import llguidance
    import llguidance.torch as llguidance_torch
except ImportError:  # the server answers 400 for grammar requests, everything else works
    llguidance = None

JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
# llguidance's own limits; its verbose errors quote the whole grammar and the parser's state (kilobytes a line)
LIMITS = llguidance.LLParserLimits(verbose_errors=False) if llguidance is not None else None


COMPILE_STACK = 256 << 20  # bytes of stack for a compile: llguidance recurses natively (limits.py, references)
COMPILES_AT_ONCE = 4  # compiles running, those past their deadline included; more wait for a slot
T = TypeVar("T")


class GrammarError(KvsessionError):
    """A schema or tool choice that cannot be turned into a grammar, or a grammar that cannot go on while generating
    (the server answers 400, or ends the stream with an error event)."""


class Compiles:
    """Where a request's grammars are built: a thread of their own with a deep stack, within a deadline.

    llguidance cannot be interrupted, so a compile past its deadline is left to finish on its thread while the
    request is answered 400; it keeps its slot until it does, and so at most COMPILES_AT_ONCE of them ever run
    (the limits of limits.py keep the worst seen here near a second). A request that finds every slot taken
    waits for one, within the same deadline, and is answered 429 if none comes."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._slots = asyncio.Semaphore(COMPILES_AT_ONCE)  # bound to the loop that first waits on it
        self._stack = threading.Lock()  # threading.stack_size is process-wide: one thread made at a time

    async def run(self, build: Callable[[], T], field: str) -> T:
        loop = asyncio.get_running_loop()
        slots = self._slots
        deadline = loop.time() + self.seconds
        try:
            await asyncio.wait_for(slots.acquire(), self.seconds)
        except TimeoutError:
            raise ApiError(429, f"{field}: every grammar compile slot is busy; retry shortly", "rate_limit_error",
                           param=field) from None
        done = loop.create_future()

        def compile_it():
            try:
                result, error = build(), None
            except BaseException as e:  # handed to the request, which raises it
                result, error = None, e
            loop.call_soon_threadsafe(_settle, done, result, error, slots)

        with self._stack:
            threading.stack_size(COMPILE_STACK)
            try:
                threading.Thread(target=compile_it, name="grammar", daemon=True).start()
            except BaseException:
                slots.release()
                raise
            finally:
                threading.stack_size(0)
        try:
            return await asyncio.wait_for(asyncio.shield(done), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise ApiError(400, f"{field}: the grammar took more than {self.seconds:g} s to compile "
                           f"(--grammar-timeout)", param=field) from None
        finally:
            if not done.done():  # past the deadline, or the request cancelled: its result is nobody's
                done.cancel()


def _settle(done: asyncio.Future, result, error: BaseException | None, slots: asyncio.Semaphore) -> None:
    slots.release()
    if done.cancelled():
        return
    if error is not None:
        done.set_exception(error)
    else:
        done.set_result(result)


class Grammars:
    """The grammar side of one Engine: its tokenizer as llguidance sees it, built once per engine."""

    _built: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, engine):
        if llguidance is None:
            raise GrammarError("constrained decoding needs the llguidance package (pip install llguidance)")
        self.engine = engine
        tk = engine.tokenizer
        self.n_vocab = max(engine.config.vocab_size, tk.vocab_size)  # [n_vocab]: the model's output size
        self.device = engine.device
        if engine not in Grammars._built:
            Grammars._built[engine] = llguidance.LLTokenizer(
                llguidance.TokenizerWrapper(_TokenizerView(tk, self.n_vocab)),
                n_vocab=self.n_vocab, eos_token=sorted(tk.eog_ids))
            # llguidance sizes up the vocabulary on its first mask (~0.4 s for Qwen's): here, not in a request
            warm = llguidance.LLMatcher(Grammars._built[engine], llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}), log_level=0, limits=LIMITS)
            llguidance_torch.fill_next_token_bitmask(warm, llguidance_torch.allocate_token_bitmask(1, self.n_vocab))
        self.tokenizer = Grammars._built[engine]
        self.token_bytes = tk.token_bytes

    @cached_property
    def opens_object(self) -> torch.Tensor:
        """bool [n_vocab]: the tokens whose text, leading whitespace aside, begins with `{`."""
        tb = self.token_bytes
        flags = [i < len(tb) and tb[i].lstrip().startswith(b"{") for i in range(self.n_vocab)]
        return torch.tensor(flags, dtype=torch.bool, device=self.device)

    # --- factories ---

    def json(self, schema: dict | None, strict: bool = True) -> "GrammarFactory":
        """A JSON value matching `schema` (None: any JSON object). strict=False: keywords llguidance does not
        implement are ignored instead of refused."""
        if schema is None:
            schema = {"type": "object"}
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, got {schema!r}")
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(
                schema, overrides={**JSON_STYLE, "lenient": not strict})
        except ValueError as e:
            raise GrammarError(f"invalid JSON schema: {_short(str(e))}") from None
        return GrammarFactory(self, self._matcher(grammar, "JSON schema"))

    def gbnf(self, text: str) -> "GrammarFactory":
        """A reply matching llama.cpp's GBNF grammar (its server's `grammar` field; Lark is taken too), through
        llguidance's converter."""
        try:
            grammar = llguidance.grammar_from("gbnf", text)
        except ValueError as e:
            raise GrammarError(f"invalid grammar: {_short(str(e))}") from None
        return GrammarFactory(self, self._matcher(grammar, "grammar"))

    def tool_calls(self, fmt: ToolFormat, tools: Sequence[dict] | None, choice="auto",
                   parallel: bool = True) -> "GrammarFactory | None":
        """The grammar for OpenAI's tool_choice: "auto" (lazy, see the module's docstring), "required", "none",
        or {"type": "function", "function": {"name": ...}}. None where nothing needs constraining."""
        tools = list(tools or [])
        for k, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("function"), dict) \
                    or not isinstance(t["function"].get("name"), str):
                raise GrammarError(f"tools[{k}]: needs {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        if choice == "none":
            trigger = self.engine.tokenizer.encode(fmt.trigger, add_bos=False) if fmt.trigger else []
            return GrammarFactory(self, None, forbid=trigger[0]) if len(trigger) == 1 else None
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
            chosen = [t for t in tools if t["function"]["name"] == name]
            if not chosen:
                raise GrammarError(f"tool_choice names the function {name!r}, which is not among the tools "
                                   f"({', '.join(t['function']['name'] for t in tools) or 'none given'})")
            return GrammarFactory(self, self._matcher(self._calls_lark(fmt, chosen[:1], "forced", False),
                                                      f"tool {name}"))
        if choice not in ("auto", "required"):
            raise GrammarError(f"tool_choice must be \"auto\", \"required\", \"none\" or a named function, "
                               f"got {choice!r}")
        if not tools:
            if choice == "required":
                raise GrammarError("tool_choice is \"required\" but no tools were given")
            return None
        if choice == "required":
            return GrammarFactory(self, self._matcher(self._calls_lark(fmt, tools, "forced", parallel), "tools"))
        after_trigger, reply_start = (self._calls_lark(fmt, tools, start, parallel)
                                      for start in ("after_trigger", "reply_start"))
        if after_trigger is None and reply_start is None:  # no text says a call begins (harmony): auto is free
            return None
        return GrammarFactory(self, None, lazy=_LazyGrammars(
            fmt,
            self._matcher(after_trigger, "tools") if after_trigger is not None else None,
            self._matcher(reply_start, "tools") if reply_start is not None else None,
        ))

    # --- building ---

    def _calls_lark(self, fmt: ToolFormat, tools: list[dict], start: str, parallel: bool) -> str | None:
        """Lark for calls of `fmt` to `tools`. start: "forced" (from the first token), "after_trigger" (the rest
        once fmt.trigger has been written), "reply_start" (a reply made of bare or fenced call objects); None
        where the format has no such start. The format writes the call syntax around each tool's arguments."""
        bodies = []
        for k, t in enumerate(tools):
            fn = t["function"]
            params = fn.get("parameters") or {"type": "object"}
            if not isinstance(params, dict):
                raise GrammarError(f"tools[{k}] ({fn.get('name')}): parameters must be a JSON schema object")
            params = {"type": "object", **params, "x-guidance": {**JSON_STYLE, "lenient": not fn.get("strict", False)}}
            if "properties" in params:  # a call's arguments are the declared ones (xgrammar's strict_mode does so)
                params.setdefault("additionalProperties", False)
            self._check_schema(params, f"tools[{k}] ({fn.get('name')}) parameters")
            bodies.append(fmt.body_lark(k, fn["name"], params))
        top = {"forced": fmt.forced_lark, "after_trigger": fmt.after_trigger_lark,
               "reply_start": fmt.bare_lark}[start](parallel)
        if top is None:
            return None
        rules = [f"body: {' | '.join(f'body_{k}' for k in range(len(tools)))}", *bodies]
        return "%llguidance {}\n" + top + "\n" + "\n".join(rules) + "\n"

    def _check_schema(self, schema: dict, what: str) -> None:
        try:  # llguidance refuses some schemas by raising (an integer past 64 bits), others by an error string
            err = llguidance.LLMatcher.validate_grammar(
                llguidance.LLMatcher.grammar_from_json_schema(schema), self.tokenizer, limits=LIMITS)
        except ValueError as e:
            err = str(e)
        if err:
            raise GrammarError(f"{what}: {_short(err)}")

    def _matcher(self, grammar: str, what: str):
        """The compiled grammar, its forced start taken once on a copy: some grammars llguidance compiles it
        cannot follow (a required $ref recursion: "Too many items"; an object of 500 optional properties: "Current
        row has 2007 items"), and where that shows at the first tokens it is a 400 here, not an error after the
        response has started."""
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=LIMITS)
        if m.is_error():
            raise GrammarError(f"{what}: {_short(m.get_error())}")
        probe = m.deep_copy()
        for token in probe.compute_ff_tokens():
            if not probe.consume_token(token):
                break
        if probe.is_error():
            raise GrammarError(f"{what}: {_short(probe.get_error())}")
        return m

    def mask(self, matcher, bitmask: torch.Tensor) -> torch.Tensor:
        """The bool [n_vocab] mask of the matcher's next tokens, on the engine's device."""
        llguidance_torch.fill_next_token_bitmask(matcher, bitmask)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[: self.n_vocab]
        mask = torch.from_numpy(bits.view(np.bool_))
        return mask if self.device.type == "cpu" else mask.to(self.device, non_blocking=True)


def _short(message: str, most: int = 500) -> str:
    """An error of llguidance's as a client and a log can take it: one line, cut short (some quote the grammar)."""
    message = " ".join(message.replace("<non-verbose/>", "").split())
    return message if len(message) <= most else message[:most] + f"... ({len(message):,} characters)"


class GrammarFactory:
    """A grammar compiled once per request; new() gives each generated choice its own Constraint."""

    def __init__(self, grammars: Grammars, matcher, *, lazy: "_LazyGrammars | None" = None,
                 forbid: int | None = None):
        self.grammars = grammars
        self.field = "the grammar"  # the request field it came from, for an error while generating (app.tool_plan)
        self._matcher = matcher
        self._lazy = lazy
        self._forbid = None
        if forbid is not None:
            self._forbid = torch.ones(grammars.n_vocab, dtype=torch.bool, device=grammars.device)
            self._forbid[forbid] = False

    @property
    def from_start(self) -> bool:
        """Whether it constrains a reply from the first token (JSON, forced calls), not once a call begins."""
        return self._matcher is not None

    def new(self):
        if self._forbid is not None:
            return Forbidden(self._forbid)
        if self._lazy is not None:
            return LazyCalls(self.grammars, self._lazy)
        return Matched(self.grammars, self._matcher.deep_copy())


class Matched:
    """A grammar in force: each token must keep the text inside it; EOG tokens are allowed once it accepts."""

    def __init__(self, grammars: Grammars, matcher):
        self.grammars = grammars
        self.matcher = matcher
        self._bitmask = llguidance_torch.allocate_token_bitmask(1, grammars.n_vocab)

    def allowed(self) -> torch.Tensor:
        return self.grammars.mask(self.matcher, self._bitmask)

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {_short(self.matcher.get_error(), 200)}")

    @property
    def done(self) -> bool:
        return self.matcher.is_stopped()

    def feed(self, tokens: list[int]) -> bool:
        """Tokens written before the grammar took over; False if it does not accept them."""
        return self.matcher.try_consume_tokens(tokens) == len(tokens)


class Forbidden:
    """A fixed set of tokens never allowed (tool_choice "none": the call trigger)."""

    def __init__(self, mask: torch.Tensor):
        self._mask = mask

    def allowed(self) -> torch.Tensor:
        return self._mask

    def advance(self, token: int) -> None:
        pass

    @property
    def done(self) -> bool:
        return False


class _LazyGrammars:
    def __init__(self, fmt: ToolFormat, after_trigger, reply_start):
        self.fmt = fmt
        self.trigger = fmt.trigger.encode("utf-8")
        self.after_trigger = after_trigger  # None: the format has no trigger
        self.reply_start = reply_start  # None: a reply is never bare call objects


class LazyCalls:
    """tool_choice "auto": free text until a call begins, then the call grammar (llama.cpp's lazy grammar)."""

    def __init__(self, grammars: Grammars, lazy: _LazyGrammars):
        self.grammars = grammars
        self.lazy = lazy
        self.inner: Matched | None = None
        self.text = b""  # what was generated while free
        self.tokens: list[int] = []
        self.start_open = lazy.reply_start is not None  # the reply may still turn out to be bare call objects
        self.gave_up = False  # the trigger came in a shape the grammar cannot take over from: stay free

    def allowed(self) -> torch.Tensor | None:
        if self.inner is not None:
            return self.inner.allowed()
        if self.start_open and not self.text.strip():  # a `{` that opens the reply must begin a call
            start = Matched(self.grammars, self.lazy.reply_start.deep_copy())
            if start.feed(self.tokens):
                return ~self.grammars.opens_object | start.allowed()
        return None

    def advance(self, token: int) -> None:
        if self.inner is not None:
            self.inner.advance(token)
            return
        if self.gave_up:
            return
        seen = len(self.text)
        self.text += self.grammars.token_bytes[token]
        self.tokens.append(token)
        if self.start_open:
            verdict = self.lazy.fmt.reply_start(self.text.decode("utf-8", "replace"))
            if verdict is True:
                inner = Matched(self.grammars, self.lazy.reply_start.deep_copy())
                if inner.feed(self.tokens):
                    self.inner = inner
                    return
            if verdict is not None:
                self.start_open = False
        i = self.text.find(self.lazy.trigger, max(0, seen - len(self.lazy.trigger) + 1)) \
            if self.lazy.after_trigger is not None else -1
        if i >= 0:
            tail = self.text[i + len(self.lazy.trigger):]
            inner = Matched(self.grammars, self.lazy.after_trigger.deep_copy())
            tk = self.grammars.engine.tokenizer
            if not tail or inner.feed(tk.encode(tail.decode("utf-8", "replace"), add_bos=False, special=False)):
                self.inner = inner
            else:
                self.gave_up = True

    @property
    def done(self) -> bool:
        return self.inner is not None and self.inner.done


class _TokenizerView:
    """What llguidance.TokenizerWrapper reads: every token's bytes, which ones are special, and an encoder."""

    def __init__(self, tk, n_vocab: int):
        tb = tk.token_bytes
        self.eos_token_id = tk.eos_id
        self.bos_token_id = tk.bos_id
        # control tokens stand for no text: llguidance keeps them out of its byte trie as special tokens,
        # named by their text (`<|im_end|>` in a Lark grammar); slots past the tokenizer get a made-up name
        self.tokens = [tb[i] if i < len(tb) and tb[i] else
                       (tk.tokens[i] if i < len(tk.tokens) else f"<[unused{i}]>").encode("utf-8")
                       for i in range(n_vocab)]
        self.special_token_ids = [i for i in range(n_vocab) if i >= len(tb) or not tb[i]]
        self._tk = tk

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text only")  # TokenizerWrapper probes with bytes, then falls back to str
        return self._tk.encode(text, add_bos=False, special=False)

