"""`kvsession bench --long`: agent-scale conversations through each server's streamed chat completions.

Agents live at 10,000-30,000 tokens, where attention, not the weights,
costs most. At each depth (--contexts; 4,096,8,192,16,384,28,672 when it is
left at its default) one conversation of that many prompt tokens -- the
bench corpus, repeated, as a system prompt, and a question -- goes to every
server, one after the other, each a fresh process:

- cold: the time to the first token of the first turn, the whole prompt
  prefilled (prefill tokens/s = prompt tokens / that time);
- decode: tokens/s over 128 tokens generated at that depth (end of text
  ignored), from the first token to the last;
- next turn: the time to the first token of the next turn: the reply sent
  back and about 1,000 new tokens after it. With --restart, each server is
  stopped after the first turn and started again on the same folders before
  the next one: kvsession restores the conversation from its disk KV cache
  (recurrent states too, for a hybrid), llama-server's prompt cache and
  context checkpoints live in its memory only.
- with --sides N, after the next turn: N side conversations of ~6,000
  tokens each (an agent's sub-agents, its title requests), then the main
  conversation's turn after them (+~1,000 tokens), against the next turn
  that came back live. kvsession keeps its default `--live-kv-mb` (1024
  MB) there, so the sides compete with the main conversation for it, as
  they do for a user; the server's trace says whether that turn came back
  live, from disk or cold (the `from` column).

The servers: `kvsession serve` with each of --kv-dtypes; llama-server
(--llama-server; tools/llama_server.sh) and ik_llama.cpp's llama-server
(--ik-llama-server; tools/ik_llama_server.sh, run with -rtr), each with its
defaults (flash attention on) and with `-ctk q8_0 -ctv q8_0`. Every server
gets the same text, 2 threads unless --threads says otherwise, and a
context of the depth plus room for the next turn. A program that prints
figures: measure on a quiet machine.
"""
from __future__ import annotations

import functools
import json
import tempfile
import time
from pathlib import Path
from typing import Callable, Sequence

from ..engine import Engine
from ..errors import KvsessionError
from .concurrency import Peer
from .corpus import CORPUS
from .server import Server, ServerProcess

DEPTHS = (4096, 8192, 16384, 28672)  # the last: 32k models' whole context, less the room below
DECODE = 128
NEXT_TURN = 1000  # new tokens of the next turn
SIDE = 6000  # tokens of a side conversation (--sides)
ROOM = 4096  # context past the depth: the reply and the next turn (a random-weight model's reply re-tokenizes longer)


def _text_of(engine: Engine, n_tokens: int, start: int = 0) -> str:
    """About n_tokens of the corpus from its token `start` on, repeated as needed, cut on a token boundary."""
    text = CORPUS.read_text(encoding="utf-8")
    ids = engine.tokenizer.encode(text, add_bos=False)
    start %= len(ids)
    ids = ids[start:] + ids[:start]
    reps = n_tokens // len(ids) + 1
    ids = (ids * reps)[:n_tokens]
    return engine.tokenizer.decode(ids)


def _stream(url: str, messages: list[dict], max_tokens: int, *, ignore_eos: bool) -> dict:
    """One streamed chat completion: seconds to the first content token and to the last, tokens generated,
    the reply's text, the prompt tokens the server counted and those it had cached."""
    import httpx

    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": ignore_eos, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    text, usage = [], {}
    with httpx.Client(timeout=7200) as client, client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                piece = c.get("delta", {}).get("content")
                if piece:
                    now = time.perf_counter() - t0
                    first = now if first is None else first
                    last = now
                    text.append(piece)
            usage = chunk.get("usage") or usage
    if first is None:
        raise KvsessionError(f"{url}: no token came back")
    return {"first": first, "last": last, "tokens": usage.get("completion_tokens", 0), "text": "".join(text),
            "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def _conversation(start: Callable[[], ServerProcess], system: str, follow: str, restart: bool,
                  sides: Sequence[str] = ()) -> dict:
    """The figures of one depth on one server (see the module's docstring)."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Summarise the text above."}]
    server = start()
    out = {}
    try:
        cold = _stream(server.url, messages, DECODE, ignore_eos=True)
        decode = (cold["tokens"] - 1) / (cold["last"] - cold["first"]) if cold["tokens"] > 1 else float("nan")
        messages += [{"role": "assistant", "content": cold["text"]}, {"role": "user", "content": follow}]
        if restart:
            server.stop()
            server = start()
        nxt = _stream(server.url, messages, 1, ignore_eos=True)
        if sides:
            for side in sides:
                _stream(server.url, [{"role": "system", "content": side},
                                     {"role": "user", "content": "Summarise the text above."}], 16, ignore_eos=True)
            messages += [{"role": "assistant", "content": nxt["text"]}, {"role": "user", "content": follow}]
            after = _stream(server.url, messages, 1, ignore_eos=True)
            out = {"after": after["first"], "after_prompt": after["prompt_tokens"],
                   "after_cached": after["cached_tokens"], "from": _source(server, after["cached_tokens"])}
    finally:
        server.stop()
    return {"prompt": cold["prompt_tokens"], "cold": cold["first"], "decode": decode, "next": nxt["first"], **out}


def _source(server: ServerProcess, cached: int) -> str:
    """Where the last request's prefix came from: kvsession's trace says (live, disk or cold); a peer's cache
    lives in its memory only."""
    trace = getattr(server, "trace", None)
    if trace is not None and trace.exists():
        lines = trace.read_text(encoding="utf-8").splitlines()
        if lines:
            return json.loads(lines[-1])["source"]
    return "live" if cached else "cold"


def run(args) -> int:
    contexts = DEPTHS if args.contexts == "512,2048" else tuple(int(c) for c in args.contexts.split(","))
    engine = Engine.load(args.model, device="cpu")
    threads = str(args.threads or 2)
    kv_dtypes = args.kv_dtypes.split(",")
    limit = engine.config.context_length
    deepest = max(*contexts, SIDE if args.sides else 0)
    if deepest + ROOM > limit:
        raise KvsessionError(f"a depth of {deepest} tokens leaves no room for the reply and the next turn in "
                             f"{engine.path.name}'s context of {limit} tokens: at most {limit - ROOM}")
    ctx = str(deepest + ROOM)
    servers: list[tuple[str, Callable[[Path], ServerProcess]]] = []

    def disk(folder: Path) -> tuple[str, ...]:  # a restarted or evicted conversation comes back from here
        return ("--kv-disk-dir", str(folder / "kv")) if args.restart or args.sides else ()

    budget = () if args.sides else ("--live-kv-mb", "8192")  # with sides, the default budget they compete for
    for kv in kv_dtypes:
        servers.append((f"kvsession {kv}", lambda d, kv=kv: Server(
            str(engine.path), d, "--kv-dtype", kv, "--ctx", ctx, "--threads", threads, *budget, "--spec", args.spec,
            *disk(d))))
    peers = (("llama-server", args.llama_server, (), True), ("ik_llama.cpp", args.ik_llama_server, ("-rtr",), False))
    for name, binary, extra, webui_flag in peers:
        if binary:
            for q8 in (False, True):
                kv = ("-ctk", "q8_0", "-ctv", "q8_0") if q8 else ()
                servers.append((f"{name}{' q8_0' if q8 else ''}", lambda d, b=binary, e=extra + kv, w=webui_flag: Peer(
                    b, engine.path, d, "-c", ctx, "-t", threads, "-np", "1", *e, webui_flag=w)))
    follow = "Now answer about this, too:\n" + _text_of(engine, NEXT_TURN)
    # each side its own text from its first token on: nothing shared with the main conversation's prompt
    sides = [f"Side task {k + 1}.\n" + _text_of(engine, SIDE, start=997 * (k + 1)) for k in range(args.sides)]
    print(f"model {engine.path.name}; {threads} threads; {DECODE} tokens decoded at each depth; next turn "
          f"+{NEXT_TURN} tokens{', after a restart' if args.restart else ''}"
          + (f"; then {args.sides} side conversations of {SIDE} tokens and the turn after them (+{NEXT_TURN}), "
             "kvsession with its default --live-kv-mb" if sides else ""))
    print(f"{'server':<22} {'depth':>6} {'prompt':>7} {'cold s':>8} {'prefill t/s':>11} {'decode t/s':>10} "
          f"{'next s':>7}" + (f" {'after sides s':>13} {'from':>5} {'ratio':>6}" if sides else ""))
    with tempfile.TemporaryDirectory() as tmp:
        for depth in contexts:
            system = _text_of(engine, depth)
            for name, start in servers:
                folder = Path(args.keep_logs or tmp) / f"{name.replace(' ', '-')}-{depth}"
                folder.mkdir(parents=True, exist_ok=True)
                f = _conversation(functools.partial(start, folder), system, follow, args.restart, sides)
                print(f"{name:<22} {depth:>6} {f['prompt']:>7} {f['cold']:>8.1f} {f['prompt'] / f['cold']:>11.1f} "
                      f"{f['decode']:>10.2f} {f['next']:>7.2f}"
                      + (f" {f['after']:>13.2f} {f['from']:>5} {f['after'] / f['next']:>6.2f}" if sides else ""),
                      flush=True)
    return 0
