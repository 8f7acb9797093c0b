"""The server's settings, shared by the HTTP side (app.py) and the worker."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 8000
    ctx: int | None = None  # tokens per session (default: the model's context)
    kv_disk_dir: str | None = None  # the disk KV cache; None: no store
    kv_disk_space_mb: int = 4096
    kv_disk_min_tokens: int = 512
    api_key: str | None = None
    sessions_dir: str | None = None  # named sessions (/v1/sessions)
    kv_dtype: str = "f16"
    max_body_bytes: int = 16 << 20
    keepalive_seconds: float = 5.0
