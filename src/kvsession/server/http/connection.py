"""The HTTP connection under the app: uvicorn's h11 protocol, with a deadline for each request's headers.

uvicorn closes a keep-alive connection that stays idle, but not one that
has begun a request (a byte is enough) or has sent nothing at all since it
opened: a client that sends its headers a byte a minute holds a connection
for as long as it likes, and a few hundred such hold the process's file
descriptors. Here the deadline (--read-timeout) runs from the connection's
start, and from the end of each response, to the end of the next request's
headers; past it the connection is closed. The body's own time is the
app's to bound (Frontend.body answers 408).
"""
from __future__ import annotations

import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("kvsession.server")


class HeaderDeadline(H11Protocol):
    timeout = 30.0  # seconds; with_header_timeout makes the class of another

    def connection_made(self, transport) -> None:
        self._deadline = None
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # the headers are in: the request is the app's now
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # waiting for the next request
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(self.timeout, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.info("%s: no complete request headers within %g s: connection closed",
                     "%s:%d" % self.client if self.client else "a client", self.timeout)
            self.transport.close()


def with_header_timeout(seconds: float) -> type[H11Protocol]:
    """The protocol class for uvicorn.Config(http=...), with a deadline of `seconds`."""
    return type("HeaderDeadline", (HeaderDeadline,), {"timeout": seconds})
