"""A `kvsession serve` subprocess for the server tests: started on a free port, stopped with SIGTERM."""
from __future__ import annotations

import functools
import signal
import socket
import subprocess
import sys
import time

import anthropic
import httpx
import openai


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model, tmp_path, *extra):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        extra = list(map(str, extra))
        if "--kv-disk-dir" not in extra:  # the server's default is the user's cache folder: never in a test
            extra.append("--no-kv-disk")
        self.model = model
        self.args = [sys.executable, "-m", "kvsession", "serve", "--model", str(model), "--port", str(self.port),
                     "--sessions-dir", str(tmp_path / "sessions"), *extra]
        self.log = open(tmp_path / f"server-{self.port}.log", "a")
        self.start()

    def start(self):
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {open(self.log.name).read()[-2000:]}")
        raise RuntimeError("server did not start")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=120)

    @functools.cached_property
    def whole_characters(self) -> dict[str, int]:
        """A logit_bias that bars every token whose bytes are not whole UTF-8 characters, for tests that send a
        random model's replies back as the next turn's history: a reply that ends a token inside a character is
        shown as U+FFFD, which comes back as another character than the model's bytes (the server rightly
        matches no further than it)."""
        from kvsession.model.gguf import GGUFFile
        from kvsession.text.tokenizer import Tokenizer

        def whole(b: bytes) -> bool:
            try:
                return bool(b.decode("utf-8"))
            except UnicodeDecodeError:
                return False

        pieces = Tokenizer(GGUFFile(self.model)).token_bytes
        return {str(t): -100 for t, b in enumerate(pieces) if b and not whole(b)}

    def health(self) -> dict:
        return httpx.get(self.url + "/health").json()

    def openai(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="any", max_retries=0, **kw)

    def anthropic(self, **kw):
        return anthropic.Anthropic(base_url=self.url, api_key="any", max_retries=0, **kw)

    def memory_mb(self, field: str = "VmRSS") -> float:
        """The server process's resident memory (VmRSS) or its peak (VmHWM), in MB."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
        raise RuntimeError(f"no {field} for the server")
