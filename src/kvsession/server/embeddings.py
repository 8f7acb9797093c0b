"""Embeddings (`serve --embeddings`), as llama-server serves them: POST /v1/embeddings in OpenAI's shape, POST
/embedding and /embeddings in llama-server's own.

An input is what /completion takes as a prompt (a string, token ids and strings mixed, {"prompt_string": ...},
or {"content": [text parts]}), or a list of such; each runs through the model in a scratch session on the worker
(one input a turn of its loop, beside the running set's steps: a long list never stalls the generations; no live
session or cache is read or written), and its last
layer's outputs after the final norm are pooled (--pooling: the model file's choice where it makes one, else
"last", a causal model's summary of its whole input) and normalized (`embd_normalize`, Euclidean by default).
OpenAI's shape takes a pooled vector only; llama-server's gives "none" pooling's every token's vector, as
llama-server does, unnormalized.
"""
from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from fastapi import Request
from pydantic import Field

from .events import Answer, Embedding
from .http.bodies import BodyRouter
from .llama.completion import prompts
from .protocol import ApiError, Body
from .serving import Frontend, frontend

MAX_INPUTS = 2048  # OpenAI's limit of inputs in one request


class EmbeddingRequest(Body):
    input: Any = None
    content: Any = None  # llama-server's /embedding name for input
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    embd_normalize: int = Field(2, ge=-1)  # -1: none, 0: to int16's range, 1: taxicab, 2: Euclidean, p: p-norm
    user: str | None = None


router = BodyRouter()


async def _vectors(request: Request, oai: bool) -> tuple[Frontend, EmbeddingRequest, list[np.ndarray], list[int]]:
    fe = frontend(request)
    if not fe.options.embeddings:
        raise ApiError(501, "This server does not support embeddings. Start it with `--embeddings`",
                       "not_supported_error")
    req = await fe.body(request, EmbeddingRequest)
    value = req.input if req.input is not None else req.content
    if value is None or value == []:
        raise ApiError(400, "input: required (a string, token ids, or a list of those)", param="input")
    pooling = fe.options.pooling
    if oai and pooling == "none":
        raise ApiError(400, "Pooling type 'none' is not OAI compatible. Please use a different pooling type",
                       param="input")
    inputs = [p.tokens for p in await prompts(fe, value, "input", MAX_INPUTS)]
    too_long = max(len(t) for t in inputs)
    if too_long >= fe.worker.ctx:
        raise ApiError(400, f"input is too large to process: {too_long} tokens, more than this server's context "
                       f"of {fe.worker.ctx}", param="input")
    dim = fe.engine.config.d_model
    if req.dimensions is not None and req.dimensions != dim:
        raise ApiError(400, f"dimensions: this model's embeddings have {dim} (shortening them is not supported)",
                       param="dimensions")
    _, answer = await fe.answer(request, fe.job("embed", Embedding(inputs, pooling, req.embd_normalize)))
    assert isinstance(answer, Answer)
    return fe, req, answer.body["vectors"], [len(t) for t in inputs]


@router.body_post("/v1/embeddings", EmbeddingRequest)
async def openai_embeddings(request: Request):
    fe, req, vectors, counts = await _vectors(request, oai=True)
    data = [{"object": "embedding", "index": i,
             "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode("ascii")
             if req.encoding_format == "base64" else v.tolist()} for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": fe.model_id,
            "usage": {"prompt_tokens": sum(counts), "total_tokens": sum(counts)}}


async def _llama_embeddings(request: Request):
    _, _, vectors, _ = await _vectors(request, oai=False)
    return [{"index": i, "embedding": (v if v.ndim == 2 else v[None]).tolist()} for i, v in enumerate(vectors)]


router.body_post("/embedding", EmbeddingRequest)(_llama_embeddings)
router.body_post("/embeddings", EmbeddingRequest)(_llama_embeddings)
