"""How much of each forced tool turn a server reuses: an OpenAI SDK tool loop, as agent frameworks send it.

    .venv/bin/kvsession serve -m qwen2.5-coder-0.5b --port 8091 --no-kv-disk &
    .venv/bin/python tools/tool_turns.py --url http://127.0.0.1:8091/v1

The OpenAI documentation's weather tool, `tool_choice: "required"`, `max_tokens` 64, four turns: each call
answered with a tool result and a new question, the whole conversation resent. Three ways a client sends it:
greedy and not streamed, greedy and streamed (the message put together from the deltas, as the SDK's users do),
and sampled (temperature 1, where the model makes parallel calls). For each later turn it prints the cached
prompt tokens against the previous turn's prompt plus reply: what a server that kept the conversation could
have reused.
"""
from __future__ import annotations

import argparse
import json

from openai import OpenAI

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a given location",
    "parameters": {"type": "object", "properties": {
        "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["location"]}}}]
FIRST = "What's the weather like in Paris today?"
NEXT = ["And in Tokyo?", "What about Boston, in fahrenheit?", "And Lima?"]


def streamed(client: OpenAI, **kw) -> tuple[dict, object]:
    """The assistant message put together from the stream's deltas, and the usage."""
    calls: dict[int, dict] = {}
    content, usage = "", None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": "", "type": "function",
                                                   "function": {"name": "", "arguments": ""}})
                call["id"] = tc.id or call["id"]
                if tc.function:
                    call["function"]["name"] += tc.function.name or ""
                    call["function"]["arguments"] += tc.function.arguments or ""
    return {"role": "assistant", "content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}, usage


def loop(client: OpenAI, how: str) -> list[float]:
    messages: list[dict] = [{"role": "user", "content": FIRST}]
    shares, before = [], 0
    for turn in range(len(NEXT) + 1):
        kw = dict(model="m", messages=messages, tools=TOOLS, tool_choice="required", max_tokens=64,
                  temperature=1.0 if how == "sampled" else 0.0)
        if how == "streamed":
            message, usage = streamed(client, **kw)
        else:
            r = client.chat.completions.create(**kw)
            message, usage = r.choices[0].message.model_dump(exclude_none=True), r.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        calls = [c["function"]["arguments"] for c in message.get("tool_calls") or []]
        line = f"{how:9} turn {turn}: prompt {usage.prompt_tokens:4}, cached {cached:4}"
        if turn:
            shares.append(cached / before)
            line += f" = {shares[-1]:6.1%} of the previous prompt and reply ({before})"
        print(line, f"{len(calls)} call(s)")
        before = usage.prompt_tokens + usage.completion_tokens
        messages.append(message)
        for call in message.get("tool_calls") or []:
            messages.append({"role": "tool", "tool_call_id": call["id"],
                             "content": json.dumps({"temperature": 14, "unit": "celsius"})})
        if turn < len(NEXT):
            messages.append({"role": "user", "content": NEXT[turn]})
    return shares


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080/v1", help="the server's OpenAI base URL")
    p.add_argument("--api-key", default="none")
    args = p.parse_args()
    client = OpenAI(base_url=args.url, api_key=args.api_key)
    least = min(min(loop(client, how)) for how in ("greedy", "streamed", "sampled"))
    print(f"least reused: {least:.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
