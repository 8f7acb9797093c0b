"""`kvsession bench --infill`: an editor's code completion, time to first token, against llama-server.

An editor plugin (llama.vscode, llama.vim) sends /infill on every pause in
typing: the same extra context (chunks of other files), and the file around
the cursor, which moves. Here: a file of about --infill-tokens tokens
(Python sources of this package, which are installed with it), chunks of
another file as input_extra, and --completions successive requests with the
cursor a few lines further down each time, each streamed, greedy, 16 tokens.
The time to first token of each, from our server and from llama-server
(--llama-server PATH, started the same way: one slot, the same context, the
same threads) on the same requests in the same run; the first request of
each server is cold, the others find the previous request's KV in memory.
"""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from .concurrency import Peer
from .server import Server, ServerProcess

SOURCES = Path(__file__).resolve().parent.parent  # the kvsession package's own sources
N_PREDICT = 16
CHARS_PER_TOKEN = 3.3  # of Python source, for Qwen2.5's tokenizer: enough to size the file before tokenizing it


def workload(tokens: int, completions: int) -> list[dict]:
    """The requests: a file of about `tokens` tokens, its cursor moving down; the same extra chunks each time."""
    files = sorted(SOURCES.rglob("*.py"), key=lambda p: p.stat().st_size, reverse=True)
    text = "\n".join(p.read_text(encoding="utf-8") for p in files[1:4])[: int(tokens * CHARS_PER_TOKEN)]
    other = files[0].read_text(encoding="utf-8").splitlines(keepends=True)
    extra = [{"filename": files[0].name, "text": "".join(other[i : i + 32])} for i in range(0, min(len(other), 256), 32)]
    lines = text.splitlines(keepends=True)
    start = len(lines) // 2
    step = max(1, len(lines) // (4 * max(completions, 1)))
    out = []
    for k in range(completions):
        at = min(start + k * step, len(lines) - 1)
        line = lines[at]
        cut = len(line) - len(line.lstrip()) + max(1, len(line.strip()) // 2)  # halfway into the line's code
        out.append({"input_extra": extra, "input_prefix": "".join(lines[:at]), "prompt": line[:cut],
                    "input_suffix": line[cut:] + "".join(lines[at + 1:]), "n_predict": N_PREDICT,
                    "temperature": 0, "stream": True, "cache_prompt": True})
    return out


def first_token(url: str, body: dict) -> float:
    """Seconds from sending a streamed /infill to its first chunk with text."""
    with httpx.Client(timeout=1200) as client:
        client.get(url + "/health")  # an open connection: the client's set-up is not the server's
        t0 = time.perf_counter()
        with client.stream("POST", url + "/infill", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: ") and json.loads(line[6:]).get("content"):
                    return time.perf_counter() - t0
    return float("nan")


def measure(server: ServerProcess, bodies: list[dict]) -> list[float]:
    try:
        return [first_token(server.url, b) for b in bodies]
    finally:
        server.stop()


def run(args) -> int:
    from ..engine import model_path

    model = model_path(args.model)
    threads = str(args.threads or 2)
    ctx = str(max(4096, 2 * args.infill_tokens + 4096))
    bodies = workload(args.infill_tokens, args.completions)
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d)
        ours = measure(Server(str(model), folder / "ours", "--parallel", "1", "--ctx", ctx, "-t", threads), bodies)
        peer = measure(Peer(args.llama_server, model, folder, "-np", "1", "-c", ctx, "-t", threads), bodies) \
            if args.llama_server else None
    print(f"infill: {model.name}, a file of ~{args.infill_tokens} tokens and {len(bodies[0]['input_extra'])} extra "
          f"chunks, {len(bodies)} completions at moving cursor positions, {N_PREDICT} tokens each, greedy; "
          f"time to first token (ms)")
    print(f"{'request':>7} {'ours':>9}" + (f" {'llama-server':>13} {'ratio':>6}" if peer else ""))
    for i, o in enumerate(ours):
        print(f"{i + 1:>7} {o * 1e3:>9.1f}" + (f" {peer[i] * 1e3:>13.1f} {o / peer[i]:>6.2f}" if peer else ""))
    warm = slice(1, None)
    o = statistics.median(ours[warm]) if len(ours) > 1 else ours[0]
    line = f"median of the warm requests (2 to {len(ours)}): ours {o * 1e3:.1f} ms"
    if peer:
        p = statistics.median(peer[warm]) if len(peer) > 1 else peer[0]
        line += f", llama-server {p * 1e3:.1f} ms, ours / llama-server = {o / p:.2f}"
    print(line)
    return 0
