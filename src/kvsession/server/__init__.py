"""`kvsession serve`: an OpenAI- and Anthropic-compatible server that resumes from the disk KV cache.

    options.py     ServerOptions
    protocol.py    request base classes, ApiError and the error shapes, SSE framing
    app.py         the app: guard, errors, shared routes (health, models, named sessions), Frontend
    connection.py  uvicorn's h11 protocol with a deadline for a request's headers
    limits.py      what a body, a schema and a tool call may hold, checked before they cost
    openai.py      /v1/chat/completions, /v1/completions
    anthropic.py   /v1/messages
    responses.py   /v1/responses; stored.py keeps its stored responses
    worker.py      the one thread that owns the model, the live session and the store
"""
from .app import create_app, serve
from .options import ServerOptions

__all__ = ["ServerOptions", "create_app", "serve"]
