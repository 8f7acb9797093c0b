"""OpenAI's Responses API (what Codex CLI speaks): POST /v1/responses, GET and DELETE /v1/responses/{id}.

`input` is text or a list of items (messages, the calls of function,
custom and local shell tools and their outputs); `instructions` is the
system message of this response only, as OpenAI defines it. Tools of every
documented type are accepted (response_tools.py: the ones a local model
can call are offered to it, hosted ones dropped with a warning). `previous_response_id` continues a
stored response: each response keeps its conversation (every message, its
own output included) as a small JSON record (stored.py: under the disk KV
cache's folder, within --responses-space-mb, owned by the API key that made
it), and its KV as a checkpoint in the store, so a continuation after a
restart comes back from disk like any other prefix.

The model's reasoning (tool_formats.py) is a `reasoning` output item before
the message, its text as `reasoning_text` content (streamed as
`response.reasoning_text.delta`); sent back as an input item, it is the
next assistant turn's reasoning for the template. `reasoning.effort` is the
template's `reasoning_effort` (gpt-oss's reads it).

While a long prompt is prefilled the stream repeats `response.in_progress`
at each keepalive: Codex's idle timeout counts events, not SSE comments.
"""
from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from fastapi import FastAPI, Request
from pydantic import Field

from .protocol import ApiError, Body, Sampling, sse, sse_event
from .replies import Reply
from .response_tools import HOSTED_ITEMS, ToolSet, history_call, model_name
from .stored import StoredResponses

if TYPE_CHECKING:
    from .app import Frontend


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
    tools: list[dict] | None = Field(None, max_length=512)  # every documented type: response_tools.py
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


def register(app: FastAPI, fe: "Frontend") -> None:
    folder = Path(fe.options.kv_disk_dir).expanduser() / "responses" if fe.options.kv_disk_dir else None
    records = StoredResponses(folder, fe.options.responses_space_mb << 20)

    @app.post("/v1/responses", openapi_extra=fe.schema(ResponsesRequest))
    async def create(request: Request):
        req = await fe.body(request, ResponsesRequest)
        if req.background:
            raise ApiError(400, "background responses are not supported: stream instead", param="background")
        history: list[dict] = []
        if req.previous_response_id:
            record = await fe.off_loop(records.get, req.previous_response_id, fe.owner(request))
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
                          session_key=fe.session_key(request, req.prompt_cache_key, req.user))
        job = fe.job("generate", g)
        rid = f"resp_{uuid.uuid4().hex}"
        shell = _response(rid, req, fe.model_id, "in_progress", [], None)
        reply = Reply(plan, "call_")
        if req.stream:
            return sse(_stream(fe, fe.events(request, job), shell, reply, records, conversation, req, toolset,
                               fe.owner(request)))
        deltas, r = await fe.answer(request, job)
        for _, delta in deltas:
            reply.feed(delta.text)
        reply.finish()
        await fe.remember(reply, r["choices"][0]["tokens"])
        response, record = _finish(shell, reply, r, conversation, toolset)
        if req.store:
            await fe.off_loop(records.put, rid, record, fe.owner(request), req.previous_response_id)
        return response

    @app.get("/v1/responses/{rid}")
    async def retrieve(request: Request, rid: str):
        record = await fe.off_loop(records.get, rid, fe.owner(request))
        if record is None:
            raise ApiError(404, f"no stored response {rid!r}", "not_found_error")
        return record["response"]

    @app.delete("/v1/responses/{rid}")
    async def delete(request: Request, rid: str):
        if not await fe.off_loop(records.delete, rid, fe.owner(request)):
            raise ApiError(404, f"no stored response {rid!r}", "not_found_error")
        return {"id": rid, "object": "response", "deleted": True}


def _json_format(text: TextConfig | None):
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return None, False
    if fmt.schema_ is None:
        raise ApiError(400, "text.format json_schema needs a schema", param="text.format")
    return fmt.schema_, bool(fmt.strict)


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
            "function": {"name": model_name(item.name, item.namespace), "arguments": _arguments(item.arguments, where)}}


def _arguments(arguments: str | None, where: str) -> dict:
    try:
        value = json.loads(arguments or "{}")
    except (json.JSONDecodeError, RecursionError):
        raise ApiError(400, f"{where}: arguments are not JSON", param="input") from None
    if not isinstance(value, dict):
        raise ApiError(400, f"{where}: arguments must be a JSON object", param="input")
    return value


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


def _finish(shell: dict, reply: Reply, r: dict, conversation: list[dict], toolset: ToolSet) -> tuple[dict, dict]:
    """The completed response object, and the record that lets a later request continue it."""
    c = r["choices"][0]
    output = ([_reasoning_item(f"rs_{uuid.uuid4().hex}", reply.reasoning)] if reply.reasoning else [])
    output += ([_message_item(f"msg_{uuid.uuid4().hex}", reply.content)] if reply.content else [])
    output += [toolset.call_item(call) for call in reply.calls]
    usage = {"input_tokens": r["prompt_tokens"], "input_tokens_details": {"cached_tokens": r["cached_tokens"]},
             "output_tokens": r["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": r["prompt_tokens"] + r["completion_tokens"]}
    incomplete = c["finish_reason"] == "length" and not reply.calls
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


async def _stream(fe: "Frontend", events, shell: dict, reply: Reply, records: StoredResponses,
                  conversation: list[dict], req: ResponsesRequest, toolset: ToolSet, owner: str | None):
    """The Responses event stream: created, in_progress, then per output item (the reasoning's text, a message's
    text, or a function call's arguments) its added / delta / done events, then completed."""
    seq = 0
    item = None  # (kind, output_index, id) of the open item
    count = 0
    text = []

    def ev(name: str, **data) -> str:
        nonlocal seq
        seq += 1
        return sse_event(name, {"type": name, "sequence_number": seq - 1, **data})

    def close() -> list[str]:
        nonlocal item
        if item is None:
            return []
        kind, index, iid = item
        item = None
        if kind in _STREAMED_TEXT:
            _, make, empty, events_of = _STREAMED_TEXT[kind]
            full = "".join(text)
            text.clear()
            return [ev(f"{events_of}.done", item_id=iid, output_index=index, content_index=0, text=full),
                    ev("response.content_part.done", item_id=iid, output_index=index, content_index=0,
                       part={**empty, "text": full}),
                    ev("response.output_item.done", output_index=index, item=make(iid, full))]
        done = toolset.call_item(reply.calls[-1])
        if kind == "function_call":
            inner = [ev("response.function_call_arguments.done", item_id=iid, output_index=index,
                        arguments=done["arguments"])]
        elif kind == "custom_tool_call":  # its input is the whole of the call's one argument: known at the end
            inner = [ev("response.custom_tool_call_input.delta", item_id=iid, output_index=index,
                        delta=done["input"]),
                     ev("response.custom_tool_call_input.done", item_id=iid, output_index=index, input=done["input"])]
        else:
            inner = []
        return inner + [ev("response.output_item.done", output_index=index, item=done)]

    def render(parts) -> list[str]:
        nonlocal item, count
        out = []
        for e in parts:
            if e[0] == "reasoning" or (e[0] == "text" and e[1]):
                kind = "reasoning" if e[0] == "reasoning" else "message"
                prefix, make, empty, events_of = _STREAMED_TEXT[kind]
                if item is None or item[0] != kind:
                    out += close()
                    item = (kind, count, f"{prefix}_{uuid.uuid4().hex}")
                    count += 1
                    out.append(ev("response.output_item.added", output_index=item[1],
                                  item=make(item[2], "", "in_progress")))
                    out.append(ev("response.content_part.added", item_id=item[2], output_index=item[1],
                                  content_index=0, part=empty))
                text.append(e[1])
                out.append(ev(f"{events_of}.delta", item_id=item[2], output_index=item[1], content_index=0,
                              delta=e[1]))
            elif e[0] == "call":
                out += close()
                added = toolset.call_item(e[1], "in_progress")
                item = (added["type"], count, added["id"])
                count += 1
                out.append(ev("response.output_item.added", output_index=item[1], item=added))
            elif e[0] == "args" and item[0] == "function_call":
                out.append(ev("response.function_call_arguments.delta", item_id=item[2], output_index=item[1],
                              delta=e[2]))
        return out

    yield ev("response.created", response=shell)
    yield ev("response.in_progress", response=shell)
    async for event in events:
        kind = event[0]
        if kind == "keepalive":  # an event, not a comment: Codex's idle timeout counts only events
            yield ev("response.in_progress", response=shell)
        elif kind == "delta":
            for line in render(reply.feed(event[2].text)):
                yield line
        elif kind == "error":
            yield ev("error", code=event[1].code or event[1].kind, message=event[1].message, param=event[1].param)
            return
        elif kind == "done" and event[1] is not None:
            for line in render(reply.finish()) + close():
                yield line
            await fe.remember(reply, event[1]["choices"][0]["tokens"])
            response, record = _finish(shell, reply, event[1], conversation, toolset)
            if req.store:
                await fe.off_loop(records.put, shell["id"], record, owner, req.previous_response_id)
            yield ev("response.completed" if response["status"] == "completed" else "response.incomplete",
                     response=response)
