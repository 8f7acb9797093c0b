"""`kvsession serve`: an OpenAI-, Anthropic- and llama-server-compatible server that resumes from the disk KV cache.

Each module imports only modules below it in this list: an API's router
uses the serving object, which submits jobs to the worker, which owns the
model and the store.

    app.py                  the app: its routers, the guard, the error handlers, the worker's lifetime; serve()
    openai.py               router: /v1/chat/completions, /v1/completions
    anthropic.py            router: /v1/messages, /v1/messages/count_tokens
    responses/router.py     router: /v1/responses, GET and DELETE /v1/responses/{id}
    embeddings.py           router: /v1/embeddings, and llama-server's /embedding and /embeddings
    llama/                  llama-server's own API: /completion, /infill, /tokenize, /props, /slots, /metrics, ...
    routes.py               the server's own routes: /api/hello, /health, /v1/models, named sessions (/v1/sessions)
    responses/tool_types.py the Responses API's tool types, and the items its calls become
    serving.py              Frontend, the serving object: prompts, tool plans, generations, jobs and their events
    responses/stored.py     the Responses API's stored responses, on disk within a budget
    http/sse.py             SSE framing, and the one loop that streams a job's events for every API
    http/guard.py           the ASGI guard: Host, Origin, content type, API keys, body size; a bug's 500
    webui/                  the web UI at / (a chat page over /v1/chat/completions): its files, public
    http/connection.py      uvicorn's h11 protocol with a deadline for a request's headers
    http/bodies.py          a request's JSON body: read within a size and a time, parsed off the loop; BodyRouter
    request_fields.py       what the APIs' requests ask for alike: tool choice, JSON formats, stops, sampling, ...
    replies.py              a request's ToolPlan, and one choice's Reply: reasoning, text, tool calls with ids
    grammar.py              constrained decoding (llguidance): forced and lazy tool calls, JSON, GBNF
    tool_formats/           each template family's reasoning and tool calls: parsers and grammar pieces
    reply_events.py         what a reply is made of: events, parsed results, tool calls
    call_memory.py          the memory of sampled tool-call turns, so a rendered history matches its session
    worker.py               the one thread that owns the model, the live sessions and the store
    prefixes.py             where a request's prefix comes from (live session, disk, fork), and checkpoints
    sessions.py             the live sessions, under a byte budget, routed by prefix or key
    stats.py                what the worker counts for /metrics
    events.py               the Job, and the typed events the worker sends back
    limits.py               what a body, a schema and a tool call may hold, checked before they cost
    protocol.py             request base classes, ApiError and the two error shapes
    options.py              ServerOptions, the server's settings
"""
from .app import create_app, serve
from .options import ServerOptions

__all__ = ["ServerOptions", "create_app", "serve"]
