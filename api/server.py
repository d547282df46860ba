"""uvicorn's httptools protocol with the read timeouts it lacks.

uvicorn (0.3x to 0.5x) has only a keep-alive timeout, armed after a response and cancelled by
the first byte of the next request: a client that opens a connection and sends nothing,
or sends its request head one byte a second, or its body never, holds the connection (and,
for the body, the handler waiting for it) for as long as it likes. This subclass adds:

- a head timeout: from the connection's opening, or from the first byte of a request, its
  headers must be complete within `API_HEADER_TIMEOUT_MS`; otherwise the connection gets a
  `408` (silence if the client never sent a byte) and is closed;
- a head size cap (`MAX_HEAD_BYTES`): httptools accepts headers of any size;
- a body timeout: from the end of the headers, the whole body must arrive within
  `API_BODY_TIMEOUT_MS`; otherwise the client gets a `408` if no response has started,
  the handler sees the client as gone (`http.disconnect`), and the connection is closed.
  A request answered before its body is in (a `413` or `503` on its head) keeps that one
  answer: the rest of its body is read and dropped under the same timeout, as uvicorn
  does, and never taken for the next request's head;
- a send timeout: a client that takes none of a response the server could not buffer for
  `API_SEND_TIMEOUT_MS` (the socket and the transport are full) has its connection dropped,
  and the handler sees it gone. Without it, a reader that stops reading holds its handler,
  and whatever admission slot that holds (an event stream, an artifact download), for ever.

Connections idle between requests stay under uvicorn's keep-alive timeout. Open
connections are capped per process (`API_MAX_CONNECTIONS`): one past the cap gets a `503`
and is closed before anything of it is read, so a client opening thousands of connections
(each may hold a head of up to 64 KiB for its head timeout) holds a bounded amount of
memory. A request answered before its body is in (a `401`, a `413`) drops the part of its
body uvicorn had buffered for the handler, rather than keeping it until the connection
ends. And pipelining is bounded: a connection with more than `MAX_PIPELINED` requests
waiting behind the one being answered is closed (uvicorn parses a whole read, up to
256 KiB, some 8,000 small requests, into its queue; nothing a browser or an SDK sends
comes near).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["MAX_HEAD_BYTES", "GuardedHttpToolsProtocol", "guarded_protocol"]

log = logging.getLogger(__name__)

# Request line plus headers. Browsers send a few KiB; nginx's default cap is 4 x 8 KiB.
MAX_HEAD_BYTES = 64 * 1024
# Requests of one connection waiting their turn behind the one being answered.
MAX_PIPELINED = 32


def _error_bytes(status: int, reason: str, message: str) -> bytes:
    body = msgspec.json.encode({"error": message, "details": []})
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode("ascii")
    return head + body


# What a request the HTTP parser refuses is told (a Content-Length that is not a number,
# two of them, chunked framing that is broken, ...): the parser does not say which.
_MALFORMED = (
    "The request is not valid HTTP/1.1: check its request line, Content-Length and Transfer-Encoding "
    "headers and, if chunked, its chunk sizes"
)

# The answer to a connection past API_MAX_CONNECTIONS, written before its request is read.
_BUSY = _error_bytes(503, "Service Unavailable", "This server has too many open connections; retry shortly").replace(
    b"connection: close\r\n", b"connection: close\r\nretry-after: 1\r\n"
)


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    send_timeout_s: float = 30.0
    max_connections: int = 2048

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._head_bytes = 0
        self._parsed_head_bytes = 0  # the URL's and headers' bytes the parser handed over
        self._request_bytes_seen = False
        # Between a message's first byte and its last: a response may complete before the
        # request does (a 413 or 503 on its head alone), and the rest of the body that still
        # arrives is that request's, not the head of the next one.
        self._in_message = False
        # Between a request's first byte and the end of its head.
        self._in_head = False
        # The requests of this connection still being answered, oldest first: with
        # pipelining, one that is streaming (SSE) while the next waits its turn. uvicorn
        # itself knows only the newest. (It answers them one at a time, in order.)
        self._cycles: deque[Any] = deque()

    # ------------------------------------------------------------ connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.server_state.connections) > self.max_connections:
            _log_refusal(self._peer(), self.max_connections)
            transport.write(_BUSY)
            transport.close()
            return
        self._arm_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head()
        self._cancel_body()
        self._cancel_send()
        # uvicorn tells only the newest request: an earlier one still streaming would go on
        # writing to nobody, holding its stream slot, until its job ended.
        self._disconnect_all()
        super().connection_lost(exc)

    def _disconnect_all(self) -> None:
        for cycle in self._cycles:
            if not cycle.response_complete:
                cycle.disconnected = True
                cycle.message_event.set()

    def pause_writing(self) -> None:
        # The transport holds more than its high-water mark: the client is not taking it.
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self.loop.call_later(self.send_timeout_s, self._send_expired)

    def resume_writing(self) -> None:
        self._cancel_send()
        super().resume_writing()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return  # (refused at the door, or closing: nothing more of it is read)
        idle = (self.cycle is None or self.cycle.response_complete) and not self._in_message
        if idle and self._head_timer is None:
            # Bytes between requests (even lone CRLFs, which start no message) start the clock.
            self._arm_head()
        if self._head_timer is not None:
            self._request_bytes_seen = True
        head = self._head_timer
        super().data_received(data)
        if self._head_timer is None or self.transport.is_closing():
            return
        # Counted against the head that was under way when this read began. A head that began
        # inside it (a pipelined request after a body) counts from the next read on: the
        # read's bytes before it are the previous request's, and one read is bounded anyway.
        if self._head_timer is head:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(
                431, "Request Header Fields Too Large", f"Request headers must be at most {MAX_HEAD_BYTES} bytes", head=True
            )

    def handle_websocket_upgrade(self) -> None:
        self._cancel_head()
        self._cancel_body()
        super().handle_websocket_upgrade()

    # ------------------------------------------------------------ parser callbacks

    def on_message_begin(self) -> None:
        self._in_message = True
        self._in_head = True
        self._parsed_head_bytes = 0
        super().on_message_begin()
        if self._head_timer is None:
            self._arm_head()
        self._request_bytes_seen = True

    # A head whose bytes all came in one read (up to 256 KiB on uvloop) is parsed whole
    # inside that read, before data_received can count it: its parts count as they come.
    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)  # (": " and CRLF)
        super().on_header(name, value)

    def _count_head(self, size: int) -> None:
        self._parsed_head_bytes += size
        if self._parsed_head_bytes > MAX_HEAD_BYTES:
            self._refuse(
                431, "Request Header Fields Too Large", f"Request headers must be at most {MAX_HEAD_BYTES} bytes", head=True
            )
            raise _StopParsing  # stops the parser (uvicorn's 400 for that is not sent: see below)

    def send_400_response(self, msg: str) -> None:
        if self.transport.is_closing():
            return  # refused already (a 431 from _count_head)
        # uvicorn's own answer is plain text; every error of the API has one JSON shape.
        # (Unless it is not this request's to give: see _may_answer.)
        if self._may_answer(head=self._in_head or not self._in_message):
            self.transport.write(_error_bytes(400, "Bad Request", _MALFORMED))
        self._disconnect_all()
        self.transport.close()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._cancel_head()
        self._head_bytes = 0
        self._request_bytes_seen = False
        super().on_headers_complete()
        if self.cycle is not None and (not self._cycles or self._cycles[-1] is not self.cycle):
            while self._cycles and self._cycles[0].response_complete:
                self._cycles.popleft()
            self._cycles.append(self.cycle)
            if len(self._cycles) > MAX_PIPELINED + 1:
                log.info("closed a connection from %s: more than %d requests pipelined", self._peer(), MAX_PIPELINED)
                self._disconnect_all()
                self.transport.close()
                raise _StopParsing  # the rest of this read is not parsed into more requests
        if not (self.parser.should_upgrade() and self._should_upgrade()):
            self._cancel_body()
            self._body_timer = self.loop.call_later(self.body_timeout_s, self._body_expired)

    def on_message_complete(self) -> None:
        self._in_message = False
        self._cancel_body()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        cycle = self.cycle
        if self._in_message and cycle is not None and cycle.response_complete:
            # Answered before its body was in: what uvicorn buffered of that body (up to its
            # 64 KiB high-water mark, and more from the read that passed it) would otherwise
            # stay until the connection closed; the rest of the body is dropped as it comes.
            cycle.body = bytearray()
        super().on_response_complete()

    # ------------------------------------------------------------ timers

    def _arm_head(self) -> None:
        self._cancel_head()
        self._head_bytes = 0
        self._request_bytes_seen = False
        self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_expired)

    def _cancel_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _cancel_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _cancel_send(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _send_expired(self) -> None:
        self._send_timer = None
        if self.transport.is_closing() and self.transport.get_write_buffer_size() == 0:
            return
        log.info("dropped a connection from %s: it took none of its response for %.1f s", self._peer(), self.send_timeout_s)
        # abort, not close: close() waits to flush a buffer this client will never take.
        self.transport.abort()

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if not self._request_bytes_seen:
            # Opened and never used: no request to answer.
            log.info("closed a connection from %s: no request within %.1f s", self._peer(), self.header_timeout_s)
            self.transport.close()
            return
        log.info("closed a connection from %s: request headers not complete within %.1f s", self._peer(), self.header_timeout_s)
        self._refuse(408, "Request Timeout", f"Request headers must arrive within {self.header_timeout_s:g} s", head=True)

    def _body_expired(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        log.info("closed a connection from %s: request body not complete within %.1f s", self._peer(), self.body_timeout_s)
        self._refuse(408, "Request Timeout", f"The request body must arrive within {self.body_timeout_s:g} s")

    def _refuse(self, status: int, reason: str, message: str, head: bool = False) -> None:
        """Answer `status` if it is the refused request's to get (_may_answer), tell a running
        handler the client is gone, close. `head`: what is refused is a request's head."""
        self._cancel_head()
        self._cancel_body()
        if self._may_answer(head):
            self.transport.write(_error_bytes(status, reason, message))
        self._disconnect_all()
        self.transport.close()

    def _may_answer(self, head: bool) -> bool:
        """Whether an error written now would be read as the answer to the request refused.

        Responses go out in the order of the requests. A head (its size, its time, its form)
        is a new request's, pipelined behind `self.cycle` until that one is answered, and the
        error would be read as that one's answer (an execute refused with a 431, whose job was
        queued all the same): it gets one only once every earlier request is answered. A
        body's trouble is the current request's: its answer, if none has started."""
        cycle = self.cycle
        # A pipelined request behind one still answering (an event stream): its error would
        # land inside that response's body.
        behind = any(c is not cycle and not c.response_complete for c in self._cycles)
        if behind:
            return False
        if head:
            return cycle is None or cycle.response_complete
        # A request answered before its body ended (the body still arriving) has had its one
        # response: this one would be a second.
        answered_early = cycle is not None and cycle.response_complete and self._in_message
        return not answered_early and (cycle is None or cycle.response_complete or not cycle.response_started)

    def _peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "?"


_refusals = {"logged_at": 0.0, "since": 0}


def _log_refusal(peer: str, cap: int) -> None:
    """At most one line a second: refusals come in floods."""
    _refusals["since"] += 1
    now = time.monotonic()
    if now - _refusals["logged_at"] >= 1.0:
        log.warning(
            "refused %d connection(s) past API_MAX_CONNECTIONS (%d open), the latest from %s",
            _refusals["since"], cap, peer,
        )
        _refusals.update(logged_at=now, since=0)


class _StopParsing(Exception):
    """Raised in a parser callback to stop parsing a read (a head past MAX_HEAD_BYTES, a
    connection past MAX_PIPELINED): uvicorn then answers nothing more on a closing transport."""


def guarded_protocol(
    header_timeout_ms: int, body_timeout_ms: int, send_timeout_ms: int = 30000, max_connections: int = 2048
) -> type[GuardedHttpToolsProtocol]:
    """The protocol class to give uvicorn as `http=`, with these timeouts and this cap."""
    return type(
        "GuardedHttpToolsProtocol",
        (GuardedHttpToolsProtocol,),
        {
            "header_timeout_s": header_timeout_ms / 1000,
            "body_timeout_s": body_timeout_ms / 1000,
            "send_timeout_s": send_timeout_ms / 1000,
            "max_connections": max_connections,
        },
    )
