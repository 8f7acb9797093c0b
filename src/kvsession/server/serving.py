"""The serving object: what the API routers share, over the one worker.

Every API's route does the same few things in its own words: read its body
(bodies.py), turn its tools and output format into a ToolPlan (the
prompt's tools, the reply's parser, the grammar), render and tokenize the
conversation, make a Generation of it within the context and the request
limits, submit it as a Job, and relay the job's events (events.py): as a
stream (sse.py) or gathered into one answer. Frontend does each of these
once for all of them. The event loop never waits on work: rendering,
tokenizing, compiling a grammar and every file-system touch run in a
thread (off_loop), so no request can hold up another's stream or /health.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from functools import cached_property
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from pydantic import BaseModel

from ..errors import TemplateError
from ..text.template import ChatPrompt, check_variables
from .call_memory import ToolCallMemory
from .events import (
    FINAL,
    Answer,
    Cancelled,
    Done,
    Event,
    Failed,
    Generation,
    Job,
    Keepalive,
    Output,
    Progress,
)
from .grammar import Compiles, GrammarError, Grammars
from .http.bodies import parse_body, read_body
from .limits import (
    TRIM_AFTER_BYTES,
    check_calls,
    check_grammar,
    check_schema,
    check_tools,
    give_back_memory,
)
from .options import ServerOptions
from .protocol import ApiError, Sampling, context_exceeded
from .replies import Reply, ToolPlan
from .reply_events import ToolCall
from .request_fields import JsonFormat, sampler_params
from .responses.stored import StoredResponses
from .tool_formats import format_for
from .worker import Worker

log = logging.getLogger("kvsession.server")


def frontend(request: Request) -> "Frontend":
    """The serving object of the app that received `request` (create_app puts it there)."""
    return request.app.state.frontend


class Frontend:
    """What the API routers share: the worker, body parsing, prompt building, and relaying a job's events."""

    def __init__(self, engine, options: ServerOptions, worker: Worker):
        self.engine, self.options, self.worker = engine, options, worker
        # as llama-server: every alias is the model's name, and its id is the first in sorted order
        self.aliases = sorted(set(options.aliases))
        self.model_id = self.aliases[0] if self.aliases else engine.path.stem
        self.tool_format = format_for(engine.template.source)
        folder = Path(options.kv_disk_dir).expanduser() if options.kv_disk_dir else None
        memory = folder / "tool_calls.jsonl" if folder is not None else None
        self.tool_memory = ToolCallMemory(memory if memory is not None and memory.parent.is_dir() else None)
        # the Responses API's stored responses, under the disk KV cache's folder (in memory without one)
        self.stored = StoredResponses(folder / "responses" if folder is not None else None,
                                      options.responses_space_mb << 20)
        # no token is longer than this many characters: a longer text than ctx of them cannot fit
        self.max_token_chars = max(len(t) for t in engine.tokenizer.tokens)
        self.compiles = Compiles(options.grammar_timeout)
        # calls running off the loop now (parsing, rendering, tokenizing, files): /health's "preparing"; a
        # /health answered while it is above zero shows the loop was free meanwhile (the tests' check)
        self.preparing = 0

    async def off_loop(self, fn: Callable, *args) -> Any:
        self.preparing += 1  # changed on the loop's thread only
        try:
            return await asyncio.get_running_loop().run_in_executor(None, fn, *args)
        finally:
            self.preparing -= 1

    async def body(self, request: Request, model: type[BaseModel]):
        """The body as `model`: read within --max-body-bytes and --read-timeout, parsed off the loop."""
        raw = await read_body(request, self.options.max_body_bytes, self.options.read_timeout)
        size = len(raw)
        try:
            return await self.off_loop(parse_body, raw, model)
        except ApiError as e:
            raise e.with_traceback(None)  # parse_body's frames, and so the parsed body, go with its traceback
        finally:
            del raw
            if size > TRIM_AFTER_BYTES:
                await self.off_loop(give_back_memory)

    def check_length(self, chars: int, field: str = "prompt") -> None:
        """Refuse at once a text that cannot fit the context, before seconds or minutes of tokenizing it (15 MB
        over 250 messages took 23-42 s): more characters than the context's tokens times the longest token cannot
        fit, and more than --max-chars-per-token a token is refused too (prose and code take 3-5)."""
        most = self.worker.ctx * min(self.max_token_chars, self.options.max_chars_per_token)
        if chars > most:
            raise ApiError(400, f"{field}: {chars:,} characters, too large for a context of {self.worker.ctx} tokens "
                           f"(at most {most:,} here)", param=field, code="context_length_exceeded")

    async def tokens(self, text: str, add_bos: bool | None = None) -> list[int]:
        self.check_length(len(text))
        return await self.off_loop(lambda: self.engine.tokenizer.encode(text, add_bos=add_bos))

    async def chat(self, messages: list[dict], plan: ToolPlan, *, continue_final: bool = False,
                   variables: dict | None = None) -> ChatPrompt:
        """The rendered and tokenized conversation (the model's template, with the plan's tools, the request's
        template `variables` and the server's --reasoning), built off the loop. System messages before the first reply lead it (_preamble);
        later ones stay in place unless the template refuses them. Tells the plan whether the prompt leaves the
        reply inside the reasoning (DeepSeek-R1's template ends it with `<think>`)."""
        tools = plan.tools
        variables = self.reasoning_variables(variables)

        def render():
            check_tools(tools)  # again: count_tokens renders tools it never compiles
            check_calls(messages)
            self.check_length(_chars(messages, tools), "messages")
            ordered = _preamble(self.tool_format.history(messages))
            try:
                return self.engine.chat_prompt(ordered, tools=tools, continue_final=continue_final,
                                               variables=variables)
            except TemplateError as e:  # a template that refuses system turns in place: all of them first
                merged = _systems_first(ordered)
                if merged is None:
                    raise ApiError(400, str(e), param="messages") from None
            try:
                return self.engine.chat_prompt(merged, tools=tools, continue_final=continue_final,
                                               variables=variables)
            except TemplateError as e:
                raise ApiError(400, str(e), param="messages") from None

        def build():
            prompt = render()
            close = self.reasoning_close(prompt.text, variables)
            if not close:
                return prompt
            text = prompt.text + close
            return ChatPrompt(text, self.engine.tokenizer.encode_guarded(text, prompt.literals), prompt.literals)

        prompt = await self.off_loop(build)
        free = plan.constraint is None or not plan.constraint.from_start  # a grammar from token one leaves no thought
        plan.in_reasoning = free and plan.fmt is not None and plan.fmt.opens_reasoning(prompt.text)
        return prompt

    def reasoning_variables(self, variables: dict | None) -> dict | None:
        """The template's variables with the server's --reasoning where the request did not set enable_thinking:
        false for off, true for on and, as llama-server passes it, for auto where the template reads it (some,
        as llama.cpp's own edits of DeepSeek-R1's and QwQ's, close the think block when it is not true)."""
        if "enable_thinking" in (variables or {}):
            return variables
        if self.options.reasoning == "auto" and "enable_thinking" not in self.engine.template.source:
            return variables
        return {**(variables or {}), "enable_thinking": self.options.reasoning != "off"}

    def reasoning_close(self, text: str, variables: dict | None) -> str:
        """What closes a think block the template leaves open at the prompt's end (DeepSeek-R1's distills, QwQ:
        `<think>\n`) where the variables say enable_thinking false (--reasoning off, or the request's own), so
        that the reply starts with the answer, as llama-server writes it; else ""."""
        if (variables or {}).get("enable_thinking") is not False or not self.tool_format.opens_reasoning(text):
            return ""
        return self.tool_format.think[1]

    def template_variables(self, kwargs: dict | None, reasoning_effort: str | None = None) -> dict | None:
        """A request's own variables for the chat template: `chat_template_kwargs` (as llama.cpp's and vLLM's
        servers take it: {"enable_thinking": false} for Qwen3) and `reasoning_effort` (gpt-oss's template reads
        it). A name the server sets itself (messages, tools, ...) is a 400."""
        variables = dict(kwargs or {})
        if reasoning_effort is not None:
            variables["reasoning_effort"] = reasoning_effort
        self.check_length(len(json.dumps(variables)), "chat_template_kwargs")  # they are rendered into the prompt
        try:
            check_variables(variables)
        except TemplateError as e:
            raise ApiError(400, str(e), param="chat_template_kwargs") from None
        return variables or None

    def generation(self, prompt: ChatPrompt, req: Sampling, max_tokens: int | None, **kw) -> Generation:
        tokens = prompt.tokens
        if not tokens:
            raise ApiError(400, "the prompt is empty", param="prompt")
        if len(tokens) + 1 > self.worker.ctx:
            raise context_exceeded(len(tokens), self.worker.ctx)
        # a reply ends where the context does (a bigger max_tokens, as Claude Code's 32,000, is no error), unless
        # a context shift makes room
        max_tokens = self.options.max_tokens if max_tokens is None else max_tokens
        if not self.options.context_shift:
            max_tokens = min(max_tokens, self.worker.ctx - len(tokens) - 1)
        n = kw.get("n", 1)
        if n * max_tokens > self.options.max_request_tokens:
            raise ApiError(400, f"n: {n} choices of up to {max_tokens:,} tokens are {n * max_tokens:,} tokens, more "
                           f"than this server generates for one request ({self.options.max_request_tokens:,}); ask "
                           "for fewer choices or fewer tokens", param="n")
        return Generation(prompt, sampler_params(req, self.options.sampling), max_tokens, ignore_eos=req.ignore_eos,
                          **kw)

    # --- tools and grammars ---

    @cached_property
    def grammars(self) -> Grammars:
        """llguidance's view of the vocabulary: built once (about a second for a 150k vocabulary), off the loop."""
        return Grammars(self.engine)

    async def tool_plan(self, tools: list[dict], choice: str, parallel: bool, json_format: JsonFormat | None,
                        grammar: str | None = None) -> ToolPlan:
        """What a request's tools and response format make of its prompt, its parsing and its decoding.

        choice: "auto", "none", "required" or a function's name; json_format: None, or (schema or None,
        strict) for JSON output (request_fields.py reads both from each API's request); grammar: llama.cpp's
        GBNF for the whole reply, or None. Schemas over a limit (limits.py) and a grammar that cannot be built are
        a 400 naming the problem, before the response starts; the compile runs off the loop (llguidance lets go
        of the GIL: 0.9 s for 700 KB of schemas left this loop free), on grammar.Compiles' deep stack and within
        --grammar-timeout, bounded by those limits and by the context (the tools are part of the prompt)."""
        if json_format is not None and tools and choice != "none":
            raise ApiError(400, "a JSON response format together with tools is not supported; pass "
                           "tool_choice none, or no response format", param="response_format")
        if grammar is not None and (json_format is not None or tools and choice != "none"):
            raise ApiError(400, "grammar together with tools or a JSON response format is not supported",
                           param="grammar")
        field = "grammar" if grammar is not None else "response_format" if json_format is not None else "tools"

        def build() -> ToolPlan:
            check_tools(tools)
            if tools:
                self.check_length(len(json.dumps(tools)), "tools")
            if json_format is not None and json_format[0] is not None:
                check_schema(json_format[0], field)
            if grammar is not None:
                check_grammar(grammar)
            try:
                plan = self._plan(tools, choice, parallel, json_format, grammar)
            except GrammarError as e:
                raise ApiError(400, f"{field}: {e}", param=field) from None
            if plan.constraint is not None:
                plan.constraint.field = field
            return plan

        return await self.compiles.run(build, field)

    def _plan(self, tools: list[dict], choice: str, parallel: bool, json_format: JsonFormat | None,
              grammar: str | None) -> ToolPlan:
        fmt = self.tool_format  # every reply is read by it, for its reasoning; for calls where tools are offered
        if grammar is not None:
            return ToolPlan(tools or None, fmt, constraint=self.grammars.gbnf(grammar))
        if json_format is not None:
            return ToolPlan(tools or None, fmt, constraint=self.grammars.json(*json_format))
        if not tools:
            return ToolPlan(fmt=fmt)
        if choice == "none":
            return ToolPlan(tools, fmt, constraint=self.grammars.tool_calls(fmt, tools, "none"))
        named = {"type": "function", "function": {"name": choice}} if choice not in ("auto", "required") else choice
        return ToolPlan(tools, fmt, calls=True, constraint=self.grammars.tool_calls(fmt, tools, named, parallel),
                        forced=choice != "auto")

    async def remember(self, reply: Reply, tokens: list[int]) -> None:
        """Keep the text the model sampled for a reply with tool calls, so that its echo renders back to it.

        Only a reply that wrote its calls in the format's own syntax (Hermes' `<tool_call>` tags): one written as
        bare or fenced JSON renders back as the template writes calls, at the cost of prefilling that turn again
        (tens of tokens). Shown its own fenced call before a tool's result, Qwen2.5-Coder-1.5B calls the tool
        again, greedily, where the same history with the call in tags gets its answer (tool_formats/calls.py)."""
        if not reply.calls:
            return
        raw = self.engine.tokenizer.decode(tokens)
        if not self.tool_format.remembers(raw):
            return
        calls = [ToolCall(c.name, c.arguments) for c in reply.calls]
        try:
            await self.off_loop(self.tool_memory.remember, [c.id for c in reply.calls], raw, calls)
        except OSError as e:  # a failing folder costs reuse after a restart, not the answer
            log.warning("cannot record tool calls on disk: %s", e)

    # --- jobs and their events ---

    @staticmethod
    def job(kind: str, payload) -> Job:
        return Job(kind, payload, asyncio.get_running_loop())

    async def run_job(self, request: Request, job: Job, *, watch_disconnect: bool) -> AsyncIterator[Event]:
        """Submit a job and yield its events, plus a Keepalive after each quiet keepalive_seconds (Progress does
        not count: it is not something a client sees), until its final one.

        A consumer that stops early (a streaming client gone: Starlette cancels
        the response) cancels the job; so does, with watch_disconnect, the
        client of a plain answer hanging up: a task waits on the connection's
        next ASGI message, which after the body can only be its disconnect.
        """
        self.worker.submit(job)
        finished = False
        quiet_since = time.monotonic()
        poll = min(0.1, self.options.keepalive_seconds)
        watcher = asyncio.create_task(_cancel_on_disconnect(request, job)) if watch_disconnect else None
        try:
            while not job.cancelled.is_set():
                try:
                    event = await asyncio.wait_for(job.events.get(), timeout=poll)
                except asyncio.TimeoutError:
                    if time.monotonic() - quiet_since >= self.options.keepalive_seconds:
                        quiet_since = time.monotonic()
                        yield Keepalive()
                    continue
                finished = isinstance(event, FINAL)
                if not isinstance(event, Progress):
                    quiet_since = time.monotonic()
                yield event
                if finished:
                    return
        finally:
            if watcher is not None:
                watcher.cancel()
            if not finished:
                job.cancelled.set()

    async def answer(self, request: Request, job: Job) -> tuple[list[Output], Done | Answer]:
        """A job's outputs and its final event (Done for a generation, Answer for any other job), for a
        plain (not streamed) response; raises the job's ApiError (499 when the client left)."""
        outputs = []
        async for event in self.run_job(request, job, watch_disconnect=True):
            match event:
                case Output():
                    outputs.append(event)
                case Failed(error=error):
                    raise error
                case Cancelled():
                    raise ApiError(499, "cancelled")
                case Done() | Answer():
                    return outputs, event
        raise ApiError(499, "client disconnected")

    def events(self, request: Request, job: Job) -> AsyncIterator[Event]:
        """A job's events for a stream (sse.py): the stream's end cancels the job."""
        return self.run_job(request, job, watch_disconnect=False)


def _chars(messages: list[dict], tools: list[dict] | None) -> int:
    """About the characters a conversation renders to: its texts, its tool calls' arguments, its tools."""
    n = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    n += sum(len(json.dumps((c.get("function") or {}).get("arguments"))) for m in messages
             for c in m.get("tool_calls") or ())
    return n + (len(json.dumps(tools)) if tools else 0)


def _systems_first(messages: list[dict], upto: int | None = None) -> list[dict] | None:
    """The system messages among messages[:upto] (all of them when None) merged, in order, into one system
    message at the start; None if that changes nothing."""
    upto = len(messages) if upto is None else upto
    if not any(m.get("role") == "system" for m in messages[1:upto]):
        return None
    systems = [m.get("content") or "" for m in messages[:upto] if m.get("role") == "system"]
    return [{"role": "system", "content": "\n\n".join(systems)}] + \
        [m for m in messages[:upto] if m.get("role") != "system"] + list(messages[upto:])


def _preamble(messages: list[dict]) -> list[dict]:
    """System messages before the first assistant turn are the system prompt: Claude Code sends its environment
    as one after the user's first message, which a model reads as the last thing said and answers by echoing
    it (Qwen2.5-Coder-1.5B did). They never change within a conversation, so merging them keeps its prefix; later
    ones render in place, as the conversation had them."""
    first_reply = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return _systems_first(messages, first_reply) or list(messages)


async def _cancel_on_disconnect(request: Request, job: Job) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancelled.set()
