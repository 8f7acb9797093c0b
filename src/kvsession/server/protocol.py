"""What every API module shares: the request base classes, ApiError and the two error shapes."""
from __future__ import annotations

from typing import Literal

from .. import __version__

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field


# what names this build to a client: OpenAI's system_fingerprint, llama-server's build_info (its clients read a
# leading "b" and a build number there)
BUILD = f"b{__version__}-kvsession"


class Body(BaseModel):
    # unknown fields are ignored (clients send many); NaN and infinities are refused where a number is expected
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextPart(Body):
    type: Literal["text"]
    text: str


class Sampling(Body):
    """Fields every generation endpoint takes."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-1)  # -1: a random seed, as in llama.cpp
    stream: bool = False
    ignore_eos: bool = False  # llama.cpp server's extension: generate max_tokens whatever the model says


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.extra = extra or {}  # more fields of the error object (a context error's n_prompt_tokens and n_ctx)


def context_exceeded(n_prompt: int, n_ctx: int) -> ApiError:
    """A prompt longer than the context, in llama-server's words and type (its clients and tests read them), with
    OpenAI's code."""
    return ApiError(400, f"the request exceeds the available context size: the prompt has {n_prompt} tokens, the "
                    f"context {n_ctx}", "exceed_context_size_error", code="context_length_exceeded",
                    extra={"n_prompt_tokens": n_prompt, "n_ctx": n_ctx})


# llama-server's own API (server/llama/): its errors are {"error": {"code": <status>, "message", "type"}}
LLAMA_PATHS = ("/completion", "/completions", "/infill", "/tokenize", "/detokenize", "/apply-template", "/props",
               "/slots", "/metrics", "/health", "/v1/health", "/embedding", "/embeddings")


def error_shape(path: str) -> str:
    """Whose error shape a path answers in: "anthropic" (/v1/messages), "llama" (llama-server's own routes) or
    "openai" (every other)."""
    if path.startswith("/v1/messages"):
        return "anthropic"
    if path in LLAMA_PATHS or path.startswith("/slots/"):
        return "llama"
    return "openai"


def error_response(e: ApiError, path: str) -> JSONResponse:
    """An error in the shape of the API that was called (see error_shape)."""
    shape = error_shape(path)
    if shape == "anthropic":
        return JSONResponse({"type": "error", "error": {"type": e.kind, "message": e.message}}, status_code=e.status)
    if shape == "llama":
        return JSONResponse({"error": {"code": e.status, "message": e.message, "type": e.kind, **e.extra}},
                            status_code=e.status)
    return JSONResponse({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code,
                                   **e.extra}}, status_code=e.status)
