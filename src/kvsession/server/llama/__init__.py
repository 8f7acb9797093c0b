"""llama-server's native API (llama.cpp's tools/server), so that its clients find kvsession a drop-in.

    router.py      the routes: /completion, /completions, /infill, /tokenize, /detokenize, /apply-template,
                   /props, /slots, /slots/{id}, /metrics
    completion.py  a native request's prompts and Generation; its answer, whole or streamed
    infill.py      fill-in-the-middle prompts, laid out as llama-server lays them
    metrics.py     Prometheus' text format of what the worker counts (prometheus_client)
    protocol.py    the requests' shapes and llama-server's sampler names
    telemetry.py   timings and prompt_progress, which the OpenAI-style routes carry too when asked

Each imports only those below it in this list, and the server's modules under serving.py (server/__init__.py).
"""
