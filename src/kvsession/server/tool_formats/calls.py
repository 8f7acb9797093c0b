"""Call objects in a reply's JSON text: how the JSON-call families (Hermes, Llama 3, Granite) are read.

What Qwen2.5-Coder really emits. Eleven prompts (weather, read a file,
calculator, two tools, three parallel cities, a tool result to answer, a
haiku with tools present, an agent listing a folder, a web search, fixing a
bug after reading the file, running the tests), rendered by Engine.chat_prompt
with Qwen's own template, each greedy and twice at temperature 0.7:

- 0.5B (33 replies): never the `<tool_call>` tags its template asks for.
  12 bare JSON objects `{"name": ..., "arguments": {...}}` as the whole
  reply: 10 calls (one stopped a `}` short at EOS), 2 calls to a tool that
  does not exist (`add`, after reading add.py). 15 in a ```json fence: 12
  calls (most pretty-printed over several lines; one fence holding three
  calls, one per line), 3 not calls (the tool's definition echoed back,
  `{"type": "file", ...}`). 6 plain text: the haiku (right), and "run the
  tests" answered with a shell snippet instead of a run_shell call.
- 1.5B (33 replies): no tags either. 28 fenced calls (pretty-printed; the
  three-city prompt answered by one call whose string `city` is an array,
  which only the grammar prevents; one call with an extra "response" key),
  2 bare (one a `}` short at EOS, one `{{...}}}`, not JSON), 3 haiku.
- Both call the tool again after its result instead of answering (6/6),
  when the history shows the call as they wrote it. Shown the same call in
  the template's `<tool_call>` tags before the result, the 1.5B answers
  (greedy, a Write call and "File created successfully"); the 0.5B still
  calls again. So a call's echo renders as the template writes it unless
  the model wrote it in tags itself (call_memory.ToolCallMemory).

So the Hermes parser accepts, besides tagged calls anywhere in the reply
(closing tag optional at the end): a reply that is nothing but one or more
call objects, bare or in a ```json / ``` fence (inside a fence or the tags,
also a JSON list of them); arguments given as a JSON string holding an
object; up to three missing closing braces after a last `}` at the end (not
after other text: a reply cut by max_tokens is not a call). An untagged
object is a call only if it has "name" and "arguments" and, when the
request's tools are known, names one of them: a plain JSON answer stays
text. Text that looks like a call but is not one stays content, character
for character: nothing is ever dropped except the whitespace between
content and calls (which the template puts back when it renders the calls).
Llama 3's bare objects and Granite's lists are read by the same code.
"""
from __future__ import annotations

import json
import re

from ..reply_events import ToolCall

WS = " \t\r\n"
FENCE = re.compile(r"```(json)?[ \t]*\n")
_MAX_REPAIR = 3  # closing braces added to an object that ended short at EOS


def call_of(obj, names: frozenset[str] | None, keys: tuple[str, ...]) -> ToolCall | None:
    """A call from one decoded JSON value: {"name": str, KEY: object or JSON text of one}, KEY the first of
    `keys` the object has."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in keys if k in obj), None)
    if key is None:
        return None
    args = obj[key]
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict) or (names is not None and obj["name"] not in names):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def calls_in(body: str, names: frozenset[str] | None, keys: tuple[str, ...], *,
              complete: bool) -> list[ToolCall] | None:
    """The calls `body` consists of (objects or lists of them, separated by whitespace), or None if it holds
    anything else. complete=False: the body ended at EOS, so its last object may lack closing braces."""
    dec = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos, n = 0, len(body)
    while True:
        while pos < n and body[pos] in WS:
            pos += 1
        if pos == n:
            return calls or None
        try:
            value, pos = dec.raw_decode(body, pos)
        except json.JSONDecodeError:
            rest = body[pos:].rstrip()
            if complete or not rest.endswith("}"):  # repair only an object whose inner ones all closed
                return None
            for k in range(1, _MAX_REPAIR + 1):
                try:
                    value, end = dec.raw_decode(rest + "}" * k)
                except json.JSONDecodeError:
                    continue
                if end == len(rest) + k:
                    break
            else:
                return None
            pos = n
        for item in value if isinstance(value, list) else [value]:
            call = call_of(item, names, keys)
            if call is None:
                return None
            calls.append(call)
