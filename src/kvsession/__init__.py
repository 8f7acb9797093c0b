"""kvsession: local LLM inference whose KV cache is a first-class disk citizen.

    from kvsession import Engine, Session
    engine = Engine.load("smollm2-135m")
    s = engine.session(); s.prefill(tokens); s.save("chat.kvs")
    s2 = Session.load("chat.kvs", engine)      # checked whole, then resumed with no token recomputed

The map. Each part imports only from its own layer and the layers below it
(LAYERS, bottom first; tests/test_layers.py holds every module to it; an
import under `if TYPE_CHECKING:` names a type and may point up):

    errors config sampling   the ground floor: typed errors, ModelConfig, logits -> token
    testing                  what tests and benchmarks start for real: a local Valkey, a Valkey Cluster
    kernels/                 the Python face of the C kernels (csrc/: shared headers, x86/, arm/, generic/)
    kv/                      the caches (full, ring), rows on the host and in files (exact, q8), transfers
    model/                   the transformer, its weights, the architecture table, the GGUF reader, MoE,
                             RoPE, the fingerprint, the CUDA-graph decoder
    text/ catalog/           tokenizer and chat template; the packaged models and the Hugging Face Hub
    files/                   the bytes on disk: framing (sections, checksums, crash-safe writes), the
                             session file, the raw export, named sessions, the JSON field checks
    speculative              n-gram drafts for speculative decoding
    session                  one conversation's timeline, and its state as one snapshot (SessionState)
    engine                   a loaded model: weights, tokenizer, template; makes sessions
    generate embedding       prefill / decode loops, streaming, stop rules; embeddings, pooled
    store/                   the disk KV cache: chunks, manifests, tiers (folder, Valkey), its breaker
    server/                  `kvsession serve`: the APIs, the worker, the live sessions
    bench/                   the benchmark programs and the peers they drive
    cli/                     one module per command: run, chat, inspect, cache, perplexity (serve and
                             bench are main.py's flags over server/ and bench/)

docs/architecture.md tells the design: who owns what, the formats, a request's and a checkpoint's way.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

LAYERS = (
    ("errors", "config", "sampling", "testing"),
    ("kernels",),
    ("kv",),
    ("model",),
    ("text", "catalog"),
    ("files",),
    ("speculative",),
    ("session",),
    ("engine",),
    ("generate", "embedding"),
    ("store",),
    ("server",),
    ("bench",),
    ("cli",),
)

__all__ = ["Engine", "Session"]

if TYPE_CHECKING:
    from .engine import Engine
    from .session import Session


def __getattr__(name: str):
    """Engine and Session on first use: `import kvsession.errors` does not load torch and a model's code."""
    if name == "Engine":
        from .engine import Engine
        return Engine
    if name == "Session":
        from .session import Session
        return Session
    raise AttributeError(f"module 'kvsession' has no attribute {name!r}")
