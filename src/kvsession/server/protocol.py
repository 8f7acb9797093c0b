"""What every API module shares: the request base classes, ApiError and the two error shapes."""
from __future__ import annotations

from typing import Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field


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
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code


def is_anthropic(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(e: ApiError, anthropic: bool) -> JSONResponse:
    """An error in the shape of the API that was called (Anthropic's on /v1/messages, else OpenAI's)."""
    if anthropic:
        return JSONResponse({"type": "error", "error": {"type": e.kind, "message": e.message}}, status_code=e.status)
    return JSONResponse({"error": {"message": e.message, "type": e.kind, "param": e.param, "code": e.code}},
                        status_code=e.status)
