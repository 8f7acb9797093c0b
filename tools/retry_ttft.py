"""Time to first token of a retried turn: one long prompt sent twice to `kvsession serve --no-kv-disk`.

    .venv/bin/python tools/random_model.py lfm2-1.2b /tmp/lfm2-1.2b.gguf
    .venv/bin/python tools/retry_ttft.py /tmp/lfm2-1.2b.gguf --tokens 8000

The prompt is the bench corpus, repeated to about --tokens, as a system
prompt, and a question; the same request goes again after the first one's
reply (a client's retry). With no disk cache, what the retry reuses comes
from the live session alone: for a hybrid, the mark it keeps at the prompt's
end (Session.mark). Prints each request's seconds to the first token, its
prompt tokens and the cached ones. A program that prints figures: measure
on a quiet machine.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import httpx

from kvsession.bench.long import _text_of
from kvsession.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--port", type=int, default=8093)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    text = _text_of(Engine.load(args.model), args.tokens)
    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen([sys.executable, "-m", "kvsession", "serve", "-m", args.model, "--port", str(args.port),
                               "--no-kv-disk", "--threads", str(args.threads), "--ctx", str(args.tokens + 4096)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        messages = [{"role": "system", "content": text}, {"role": "user", "content": "What is this about?"}]
        for name in ("first", "retry"):
            t0, first, usage = time.perf_counter(), None, {}
            body = {"messages": messages, "max_tokens": 16, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}
            with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=3600) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    d = json.loads(line[6:])
                    if first is None and d.get("choices") and d["choices"][0]["delta"].get("content"):
                        first = time.perf_counter() - t0
                    usage = d.get("usage") or usage
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            print(f"{name}: first token after {first:.3f} s, {usage.get('prompt_tokens')} prompt tokens, "
                  f"{cached} cached")
    finally:
        server.terminate()
        server.wait(120)


if __name__ == "__main__":
    main()
