"""OpenAI's Responses API (what Codex CLI speaks): POST /v1/responses, GET and DELETE /v1/responses/{id}.

`input` is text or a list of items (messages, the calls of function,
custom and local shell tools and their outputs); `instructions` is the
system message of this response only, as OpenAI defines it. Tools of every
documented type are accepted (responses/tool_types.py: the ones a local model
can call are offered to it, hosted ones dropped with a warning). `previous_response_id` continues a
stored response: each response keeps its conversation (every message, its
own output included) as a small JSON record (stored.py: under the disk KV
cache's folder, within --responses-space-mb, owned by the API key that made
it), and its KV as a checkpoint in the store, so a continuation after a
restart comes back from disk like any other prefix.

The model's reasoning (tool_formats/) is a `reasoning` output item before
the message, its text as `reasoning_text` content (streamed as
`response.reasoning_text.delta`); sent back as an input item, it is the
next assistant turn's reasoning for the template. `reasoning.effort` is the
template's `reasoning_effort` (gpt-oss's reads it).

While a long prompt is prefilled the stream repeats `response.in_progress`
at each keepalive: Codex's idle timeout counts events, not SSE comments.
llama-server's telemetry, when asked: `return_progress` adds one with
`prompt_progress` per prefilled chunk, `timings_per_token` puts `timings`
on each text delta; `response.completed` carries `timings` whenever either is.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from fastapi import Request
from pydantic import Field

from ..events import Done, Output, Progress, Started
from ..http.bodies import BodyRouter
from ..http.guard import owner
from ..http.sse import StreamRenderer, sse_event, stream
from ..llama.telemetry import prompt_progress, timings
from ..protocol import ApiError, Body, Sampling
from ..replies import CallOpened, Reply, ReplyEvent
from ..reply_events import ContentDelta, ReasoningDelta, ToolCallDelta
from ..request_fields import JsonFormat, call_arguments, json_format, session_key
from ..serving import Frontend, frontend
from .tool_types import HOSTED_ITEMS, ToolSet, history_call, model_name


class ContentPart(Body):
    type: Literal["input_text", "output_text", "text", "input_image", "input_file", "refusal", "reasoning_text",
                  "summary_text"]
    text: str | None = None
    refusal: str | None = None


class InputItem(Body):
    type: str = "message"  # message, function_call(_output), custom_tool_call(_output), local_shell_call(_output), ...
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    namespace: str | None = None
    arguments: str | None = None
    input: str | None = None  # a custom tool call's
    action: dict | None = None  # a local shell call's
    output: str | list[ContentPart] | None = None


class TextFormat(Body):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | None = None


class ReasoningConfig(Body):
    effort: str | None = Field(None, max_length=32)
    summary: str | None = None


class ResponsesRequest(Sampling):
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[dict] | None = Field(None, max_length=512)  # every documented type: responses/tool_types.py
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    previous_response_id: str | None = None
    store: bool = True
    text: TextConfig | None = None
    metadata: dict[str, str] | None = None
    background: bool = False
    user: str | None = None  # these two route the request to the live session of that name
    prompt_cache_key: str | None = None
    reasoning: ReasoningConfig | None = None
    return_progress: bool = False  # llama-server's telemetry (a stream's): the prefill's progress
    timings_per_token: bool = False  # and the timings on each text delta


router = BodyRouter()


@router.body_post("/v1/responses", ResponsesRequest)
@router.body_post("/responses", ResponsesRequest)  # llama-server's path without /v1
async def create(request: Request):
    fe = frontend(request)
    req = await fe.body(request, ResponsesRequest)
    if req.background:
        raise ApiError(400, "background responses are not supported: stream instead", param="background")
    who = owner(request.headers, fe.options.api_keys)
    history: list[dict] = []
    if req.previous_response_id:
        record = await fe.off_loop(fe.stored.get, req.previous_response_id, who)
        if record is None:
            raise ApiError(404, f"no stored response {req.previous_response_id!r}", "not_found_error",
                           param="previous_response_id")
        history = record["messages"]
    toolset = ToolSet(req.tools)
    plan = await fe.tool_plan(toolset.functions, toolset.choice(req.tool_choice), req.parallel_tool_calls,
                              _json_format(req.text))
    items, skipped = _items(req.input)
    conversation = history + items
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    effort = req.reasoning.effort if req.reasoning else None
    prompt = await fe.chat(fe.tool_memory.substitute(system + conversation), plan,
                           variables=fe.template_variables(None, effort))
    g = fe.generation(prompt, req, req.max_output_tokens, constraint=plan.constraint,
                      checkpoint=req.store, endpoint="responses", warnings=toolset.warnings + skipped,
                      session_key=session_key(request.headers, req.prompt_cache_key, req.user))
    job = fe.job("generate", g)
    rid = f"resp_{uuid.uuid4().hex}"
    shell = _response(rid, req, fe.model_id, "in_progress", [], None)
    reply = Reply(plan, "call_")
    if req.stream:
        return stream(fe.events(request, job), ResponsesStream(fe, shell, reply, conversation, req, toolset, who))
    outputs, done = await fe.answer(request, job)
    for o in outputs:
        reply.feed(o.delta.text)
    reply.finish()
    await fe.remember(reply, done.choices[0].tokens)
    response, record = _finish(shell, reply, done, conversation, toolset)
    if req.store:
        await fe.off_loop(fe.stored.put, rid, record, who, req.previous_response_id)
    return response


@router.get("/v1/responses/{rid}")
async def retrieve(request: Request, rid: str):
    fe = frontend(request)
    record = await fe.off_loop(fe.stored.get, rid, owner(request.headers, fe.options.api_keys))
    if record is None:
        raise ApiError(404, f"no stored response {rid!r}", "not_found_error")
    return record["response"]


@router.delete("/v1/responses/{rid}")
async def delete(request: Request, rid: str):
    fe = frontend(request)
    if not await fe.off_loop(fe.stored.delete, rid, owner(request.headers, fe.options.api_keys)):
        raise ApiError(404, f"no stored response {rid!r}", "not_found_error")
    return {"id": rid, "object": "response", "deleted": True}


def _json_format(text: TextConfig | None) -> JsonFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None:
        return None
    return json_format(fmt.type, fmt.schema_, fmt.strict, field="text.format",
                       missing="text.format json_schema needs a schema")


def _content_text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for p in content:
        if p.type in ("input_image", "input_file"):
            raise ApiError(400, f"{where}: images and files are not supported by this model", param="input")
        parts.append(p.text or p.refusal or "")
    return "".join(parts)


def _items(items: str | list[InputItem]) -> tuple[list[dict], list[str]]:
    """Input items as template messages (consecutive calls become one assistant message's tool calls), and a
    warning for each item of a hosted tool, which is skipped."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], []
    out: list[dict[str, Any]] = []
    skipped: list[str] = []
    reasoning = ""  # a reasoning item's text, for the assistant turn it comes before
    for i, item in enumerate(items):
        where = f"input.{i}"
        if item.type == "reasoning":  # its content is the thinking (a summary is not, and OpenAI's is encrypted)
            reasoning += _content_text(item.content, where)
            continue
        if item.type in HOSTED_ITEMS:
            skipped.append(f"{where}: a {item.type} item of a hosted tool: skipped")
            continue
        call = _function_call(item, where) if item.type == "function_call" else history_call(item, where)
        if call is not None:
            if out and out[-1]["role"] == "assistant" and "tool_calls" in out[-1]:
                out[-1]["tool_calls"].append(call)
            elif out and out[-1]["role"] == "assistant" and out[-1].get("content"):
                out[-1]["tool_calls"] = [call]
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item.type in ("function_call_output", "custom_tool_call_output", "local_shell_call_output"):
            # Codex also sends outputs of no call (a goal's objective: name and namespace, no call_id)
            if not item.call_id and not item.name:
                raise ApiError(400, f"{where}: a {item.type} needs call_id", param="input")
            out.append({"role": "tool", "tool_call_id": item.call_id or model_name(item.name, item.namespace),
                        "content": _content_text(item.output, where)})
        elif item.type == "message":
            if item.role is None:
                raise ApiError(400, f"{where}: a message needs a role", param="input")
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _content_text(item.content, where)})
        else:
            raise ApiError(400, f"{where}.type: items of type {item.type!r} are not supported", param="input")
        if reasoning:  # the assistant turn the next item makes (or adds a call to) is the one it came before
            if out and out[-1]["role"] == "assistant":
                out[-1]["reasoning_content"] = reasoning
            reasoning = ""
    return out, skipped


def _function_call(item: InputItem, where: str) -> dict:
    if not item.call_id or not item.name:
        raise ApiError(400, f"{where}: a function_call needs call_id and name", param="input")
    return {"id": item.call_id, "type": "function",
            "function": {"name": model_name(item.name, item.namespace),
                         "arguments": call_arguments(item.arguments, f"{where}: arguments", "input")}}


def _response(rid: str, req: ResponsesRequest, model: str, status: str, output: list, usage: dict | None) -> dict:
    return {"id": rid, "object": "response", "created_at": int(time.time()), "status": status, "model": model,
            "output": output, "usage": usage, "error": None, "incomplete_details": None,
            "instructions": req.instructions, "previous_response_id": req.previous_response_id,
            "max_output_tokens": req.max_output_tokens, "parallel_tool_calls": req.parallel_tool_calls,
            "temperature": req.temperature, "top_p": req.top_p, "store": req.store,
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
            "text": {"format": {"type": req.text.format.type if req.text and req.text.format else "text"}},
            "truncation": "disabled", "metadata": req.metadata or {},
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None}}


def _message_item(mid: str, text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


def _reasoning_item(rid: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": rid, "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def _finish(shell: dict, reply: Reply, done: Done, conversation: list[dict], toolset: ToolSet) -> tuple[dict, dict]:
    """The completed response object, and the record that lets a later request continue it."""
    c = done.choices[0]
    output = ([_reasoning_item(f"rs_{uuid.uuid4().hex}", reply.reasoning)] if reply.reasoning else [])
    output += ([_message_item(f"msg_{uuid.uuid4().hex}", reply.content)] if reply.content else [])
    output += [toolset.call_item(call) for call in reply.calls]
    usage = {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": done.cached_tokens},
             "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": done.prompt_tokens + done.completion_tokens}
    incomplete = c.finish_reason == "length" and not reply.calls
    response = {**shell, "status": "incomplete" if incomplete else "completed", "output": output, "usage": usage,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None}
    said = {"role": "assistant", "content": reply.content or None}
    if reply.reasoning:
        said["reasoning_content"] = reply.reasoning
    if reply.calls:
        said["tool_calls"] = [{"id": call.id, "type": "function",
                               "function": {"name": call.name, "arguments": json.loads(call.arguments)}}
                              for call in reply.calls]
    return response, {"messages": conversation + [said], "response": response}


# the output items whose text streams: (id prefix, item, empty content part, the prefix of their delta/done events)
_STREAMED_TEXT = {
    "reasoning": ("rs", _reasoning_item, {"type": "reasoning_text", "text": ""}, "response.reasoning_text"),
    "message": ("msg", _message_item, {"type": "output_text", "text": "", "annotations": []}, "response.output_text"),
}


class ResponsesStream(StreamRenderer):
    """The Responses event stream: created, in_progress, then per output item (the reasoning's text, a message's
    text, or a function call's arguments) its added / delta / done events, then completed."""

    def __init__(self, fe: Frontend, shell: dict, reply: Reply, conversation: list[dict], req: ResponsesRequest,
                 toolset: ToolSet, owner: str | None):
        self.fe, self.shell, self.reply, self.conversation = fe, shell, reply, conversation
        self.req, self.toolset, self.owner = req, toolset, owner
        self.seq = 0  # every event's sequence_number
        self.item: tuple[str, int, str] | None = None  # (kind, output_index, id) of the open item
        self.count = 0  # items opened
        self.text: list[str] = []  # the open text item's text so far
        self.start: Started | None = None  # llama-server's telemetry: the admission, when, the tokens generated
        self.started_at = time.perf_counter()
        self.predicted = 0

    def ev(self, name: str, **data) -> str:
        self.seq += 1
        return sse_event(name, {"type": name, "sequence_number": self.seq - 1, **data})

    def opening(self) -> list[str]:
        return [self.ev("response.created", response=self.shell), self.ev("response.in_progress", response=self.shell)]

    def keepalive(self) -> list[str]:  # an event, not a comment: Codex's idle timeout counts only events
        return [self.ev("response.in_progress", response=self.shell)]

    def started(self, e: Started) -> list[str]:
        self.start, self.started_at = e, time.perf_counter()
        return self._progress(0)

    def progress(self, e: Progress) -> list[str]:
        return self._progress(e.prefilled)

    def _progress(self, prefilled: int) -> list[str]:
        if not self.req.return_progress or self.start is None:
            return []
        seconds = time.perf_counter() - self.started_at if prefilled else 0.0
        return [self.ev("response.in_progress", response=self.shell,
                        prompt_progress=prompt_progress(self.start, prefilled, seconds))]

    def output(self, e: Output) -> list[str]:
        self.predicted += len(e.delta.tokens)
        return self._render(self.reply.feed(e.delta.text))

    async def done(self, e: Done) -> list[str]:
        out = self._render(self.reply.finish()) + self._close()
        await self.fe.remember(self.reply, e.choices[0].tokens)
        response, record = _finish(self.shell, self.reply, e, self.conversation, self.toolset)
        if self.req.store:
            await self.fe.off_loop(self.fe.stored.put, self.shell["id"], record, self.owner,
                                  self.req.previous_response_id)
        telemetry = {"timings": timings(e, self.start, e.choices[0].completion_tokens)} \
            if self.req.return_progress or self.req.timings_per_token else {}
        return out + [self.ev("response.completed" if response["status"] == "completed" else "response.incomplete",
                              response=response, **telemetry)]

    def failed(self, e: ApiError) -> list[str]:
        return [self.ev("error", code=e.code or e.kind, message=e.message, param=e.param)]

    def _close(self) -> list[str]:
        if self.item is None:
            return []
        kind, index, iid = self.item
        self.item = None
        if kind in _STREAMED_TEXT:
            _, make, empty, events_of = _STREAMED_TEXT[kind]
            full = "".join(self.text)
            self.text.clear()
            return [self.ev(f"{events_of}.done", item_id=iid, output_index=index, content_index=0, text=full),
                    self.ev("response.content_part.done", item_id=iid, output_index=index, content_index=0,
                            part={**empty, "text": full}),
                    self.ev("response.output_item.done", output_index=index, item=make(iid, full))]
        done = self.toolset.call_item(self.reply.calls[-1])
        if kind == "function_call":
            inner = [self.ev("response.function_call_arguments.done", item_id=iid, output_index=index,
                             arguments=done["arguments"])]
        elif kind == "custom_tool_call":  # its input is the whole of the call's one argument: known at the end
            inner = [self.ev("response.custom_tool_call_input.delta", item_id=iid, output_index=index,
                             delta=done["input"]),
                     self.ev("response.custom_tool_call_input.done", item_id=iid, output_index=index,
                             input=done["input"])]
        else:
            inner = []
        return inner + [self.ev("response.output_item.done", output_index=index, item=done)]

    def _text(self, kind: str, text: str) -> list[str]:
        """A piece of the reasoning's or the message's text, in its item (opened first unless it is open)."""
        prefix, make, empty, events_of = _STREAMED_TEXT[kind]
        out = []
        if self.item is None or self.item[0] != kind:
            out += self._close()
            self.item = (kind, self.count, f"{prefix}_{uuid.uuid4().hex}")
            self.count += 1
            out.append(self.ev("response.output_item.added", output_index=self.item[1],
                               item=make(self.item[2], "", "in_progress")))
            out.append(self.ev("response.content_part.added", item_id=self.item[2], output_index=self.item[1],
                               content_index=0, part=empty))
        self.text.append(text)
        telemetry = {"timings": timings(None, self.start, self.predicted)} \
            if self.req.timings_per_token and self.start is not None else {}
        out.append(self.ev(f"{events_of}.delta", item_id=self.item[2], output_index=self.item[1], content_index=0,
                           delta=text, **telemetry))
        return out

    def _render(self, events: list[ReplyEvent]) -> list[str]:
        out = []
        for e in events:
            match e:
                case ReasoningDelta(text=text):
                    out += self._text("reasoning", text)
                case ContentDelta(text=text) if text:
                    out += self._text("message", text)
                case CallOpened(call=call):
                    out += self._close()
                    added = self.toolset.call_item(call, "in_progress")
                    self.item = (added["type"], self.count, added["id"])
                    self.count += 1
                    out.append(self.ev("response.output_item.added", output_index=self.item[1], item=added))
                case ToolCallDelta(arguments=fragment) if self.item[0] == "function_call":
                    out.append(self.ev("response.function_call_arguments.delta", item_id=self.item[2],
                                       output_index=self.item[1], delta=fragment))
        return out
