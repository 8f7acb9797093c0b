"""The HTTP layer under every API: the guard, request deadlines, bodies, and SSE.

    guard.py       the ASGI guard: Host, Origin, content type, API keys, body size; a bug's 500
    connection.py  uvicorn's h11 protocol with a deadline for a request's headers
    bodies.py      a request's JSON body: read within a size and a time, parsed off the loop; BodyRouter
    sse.py         SSE framing, and the one loop that streams a job's events for every API
"""
