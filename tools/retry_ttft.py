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
import tempfile
from pathlib import Path

from kvsession.bench.long import _stream, _text_of
from kvsession.bench.server import Server
from kvsession.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    text = _text_of(Engine.load(args.model), args.tokens)
    messages = [{"role": "system", "content": text}, {"role": "user", "content": "What is this about?"}]
    with tempfile.TemporaryDirectory(prefix="kvsession-retry-") as folder:
        server = Server(args.model, Path(folder), "--threads", args.threads, "--ctx", args.tokens + 4096)
        try:
            for name in ("first", "retry"):
                r = _stream(server.url, messages, 16, ignore_eos=True)
                print(f"{name}: first token after {r['first']:.3f} s, {r['prompt_tokens']} prompt tokens, "
                      f"{r['cached_tokens']} cached")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
