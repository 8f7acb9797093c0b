"""`kvsession serve`: an OpenAI- and Anthropic-compatible server that resumes from the disk KV cache.

    options.py     ServerOptions
    protocol.py    request base classes, ApiError and the error shapes, SSE framing
    app.py         the app: guard, errors, shared routes (health, models, named sessions), Frontend
    openai.py      /v1/chat/completions, /v1/completions
    anthropic.py   /v1/messages
    worker.py      the one thread that owns the model, the live session and the store
"""
from .app import create_app, serve
from .options import ServerOptions

__all__ = ["ServerOptions", "create_app", "serve"]
