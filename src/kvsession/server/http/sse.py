"""Server-sent events: the framing, and the one loop that relays a job's events to a streamed response.

Every streamed API answers the same way: the job's events come from
Frontend.events (which submits the job, adds a Keepalive after each quiet
--keepalive-seconds, and cancels the job when the stream is dropped: a
client that leaves makes Starlette cancel the response), and each becomes
lines of the stream. Only the lines differ from API to API, so each API
writes a StreamRenderer, and relay() is the loop they all run: its opening
lines, then one rendering per event, until the job is done, failed (an
error event in the API's shape ends the stream) or cancelled.
"""
from __future__ import annotations

import json
from typing import AsyncIterator

from fastapi.responses import StreamingResponse

from ..events import Done, Event, Failed, Keepalive, Output, Progress, Started
from ..protocol import ApiError


def sse_data(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def sse_event(name: str, obj: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(obj, separators=(',', ':'))}\n\n"


class StreamRenderer:
    """How one API writes a job's events as stream lines (each a whole `data:` or `event:` frame)."""

    def opening(self) -> list[str]:
        """The lines before the job is submitted."""
        return []

    def keepalive(self) -> list[str]:
        """The lines that show a quiet stream is alive (a prefill in progress, a request waiting its turn)."""
        raise NotImplementedError

    def started(self, e: Started) -> list[str]:
        return []

    def progress(self, e: Progress) -> list[str]:
        """A chunk of the prompt was prefilled (llama-server's return_progress shows it; others show nothing)."""
        return []

    def output(self, e: Output) -> list[str]:
        raise NotImplementedError

    async def done(self, e: Done) -> list[str]:
        """The last lines of a finished reply (async: an API may record the reply before it ends the stream)."""
        raise NotImplementedError

    def failed(self, e: ApiError) -> list[str]:
        """The error event that ends the stream."""
        raise NotImplementedError


async def relay(events: AsyncIterator[Event], renderer: StreamRenderer) -> AsyncIterator[str]:
    """The stream's lines: the renderer's opening, then its rendering of each event; the events end after the
    job's last one (Frontend.run_job)."""
    for line in renderer.opening():
        yield line
    async for event in events:
        match event:
            case Keepalive():
                lines = renderer.keepalive()
            case Started():
                lines = renderer.started(event)
            case Progress():
                lines = renderer.progress(event)
            case Output():
                lines = renderer.output(event)
            case Done():
                lines = await renderer.done(event)
            case Failed(error=error):
                lines = renderer.failed(error)
            case _:  # Cancelled: the client left, or the server stops
                lines = []
        for line in lines:
            yield line


def stream(events: AsyncIterator[Event], renderer: StreamRenderer) -> StreamingResponse:
    return StreamingResponse(relay(events, renderer), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
