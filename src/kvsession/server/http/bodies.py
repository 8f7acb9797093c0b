"""A request's JSON body: read within a size and a time, then parsed off the loop, every fault a 4xx naming it.

Routes read their bodies themselves, not through FastAPI's parameters:
FastAPI would read any body whole, for as long as it takes, and hand
pydantic anything the JSON decoder makes, where here a body over
--max-body-bytes is a 413 as soon as it is, a body that trickles in past
--read-timeout a 408, and what pydantic would hold the GIL over (a million
entries, nesting thousands deep, a lone surrogate) a 400 before it gets it.
Such a route declares the model it reads (BodyRouter.body_post), for the
OpenAPI document (and the fuzzer that reads it) to show the body anyway.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re

from fastapi import APIRouter, Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from ..limits import MAX_ITEMS, loads
from ..protocol import ApiError

log = logging.getLogger("kvsession.server")

SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


class BodyRouter(APIRouter):
    """An API's routes, with the models of the bodies its routes read themselves."""

    def __init__(self):
        super().__init__()
        self.body_models: dict[str, type[BaseModel]] = {}

    def body_post(self, path: str, model: type[BaseModel]):
        """A POST route that reads a `model` from its JSON body (read_body, parse_body)."""
        self.body_models[model.__name__] = model
        return self.post(path, openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}})


async def read_body(request: Request, max_bytes: int, timeout: float) -> bytes:
    """The body's bytes. It has `timeout` seconds to arrive (a client sending a byte a minute would hold its
    connection and its buffer for ever); a client that leaves halfway is a log line."""
    raw = bytearray()
    try:
        async with asyncio.timeout(timeout):
            async for part in request.stream():
                raw += part
                if len(raw) > max_bytes:
                    raise ApiError(413, f"request body over {max_bytes} bytes", "request_too_large")
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s ({len(raw):,} bytes came)") \
            from None
    except ClientDisconnect:
        log.info("%s %s: the client left during its upload, after %d bytes", request.method, request.url.path,
                 len(raw))
        raise ApiError(499, "the client left during its upload") from None
    return bytes(raw)


def parse_body(raw: bytes, model: type[BaseModel]):
    """A JSON body as `model`; any fault is an ApiError 400 naming it (never a 500)."""
    try:
        data = loads(raw)
    except RecursionError:
        raise ApiError(400, "malformed JSON: nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of thousands of digits
        raise ApiError(400, f"malformed JSON: {e}") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object")
    for key, value in data.items():  # before pydantic, which holds the GIL 0.5 s over a million entries
        if isinstance(value, (dict, list)) and len(value) > MAX_ITEMS:
            raise ApiError(400, f"{key[:64]}: {len(value):,} entries; at most {MAX_ITEMS:,}", param=key[:64])
    if SURROGATE_ESCAPE.search(raw):  # only an escape can make one; then look whether it was paired
        try:
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(400, f"the body holds a lone surrogate ({e.object[e.start:e.end]!r}): "
                           "not valid Unicode") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ApiError(400, f"{where}: {first['msg']}", param=where) from None
    except RecursionError:
        raise ApiError(400, "the body is nested too deeply") from None

