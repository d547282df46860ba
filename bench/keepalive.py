"""A lean HTTP/1.1 client for the benchmarks' load generators: one kept-open connection.

The load generator shares the machine's two cores with the stack it measures, and what it
spends is taken from the service's throughput and added to every latency it times. httpx
spends about 2 ms of CPU on a small JSON request here (its middleware, its models, its
header handling); this client spends about 0.35 ms, most of that in the socket calls. It
does only what the benchmarks need: JSON or form bodies, Content-Length or chunked replies,
and a reconnect when the server closed an idle connection before a request was sent.
"""

from __future__ import annotations

import json as jsonlib
import select
import socket
from typing import Any
from urllib.parse import urlencode, urlsplit

__all__ = ["HttpError", "KeepAliveHttp", "Reply"]

_READ = 65536


def _readable(sock: socket.socket) -> bool:
    poller = select.poll()  # (not select.select: it refuses descriptors past 1023)
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


class HttpError(Exception):
    """The connection failed or the server's answer was not HTTP this client understands."""


class Reply:
    """What a request got back: the status, the headers (names lower-cased) and the body."""

    __slots__ = ("content", "headers", "status_code")

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes) -> None:
        self.status_code = status_code
        self.headers = headers
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return jsonlib.loads(self.content)

    def raise_for_status(self) -> Reply:
        if self.status_code >= 400:
            raise HttpError(f"HTTP {self.status_code}: {self.text[:200]}")
        return self


class KeepAliveHttp:
    """Requests to one http:// origin over one connection, opened on first use.

    Not thread-safe: give each thread its own, as the load generators do.
    """

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, timeout_s: float = 60) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"KeepAliveHttp speaks plain http to a host: {base_url!r}")
        self._address = (parts.hostname, parts.port or 80)
        self._prefix = parts.path.rstrip("/")
        self._headers = {"Host": parts.netloc, **(headers or {})}
        self._timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._buffer = b""

    def __enter__(self) -> KeepAliveHttp:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._buffer = b""

    def get(self, path: str, params: dict[str, str] | None = None, headers: dict[str, str] | None = None) -> Reply:
        return self.request("GET", path, params=params, headers=headers)

    def post(
        self,
        path: str,
        json: Any = None,
        data: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        return self.request("POST", path, json=json, data=data, headers=headers)

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        data: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        target = self._prefix + path + (f"?{urlencode(params)}" if params else "")
        sent = {**self._headers, **headers} if headers else self._headers  # a caller's header wins
        head = f"{method} {target} HTTP/1.1\r\n" + "".join(f"{name}: {value}\r\n" for name, value in sent.items())
        body = b""
        if json is not None:
            body = jsonlib.dumps(json, separators=(",", ":")).encode()
            head += "Content-Type: application/json\r\n"
        elif data is not None:
            body = urlencode(data).encode()
            head += "Content-Type: application/x-www-form-urlencoded\r\n"
        message = f"{head}Content-Length: {len(body)}\r\n\r\n".encode("latin-1") + body
        sock = self._connected()
        try:
            sock.sendall(message)
            return self._read_reply(method)
        except Exception as exc:  # mid-reply, whatever it was: the connection is out of step
            self.close()
            raise HttpError(f"{method} {target}: {exc}") from exc

    def _connected(self) -> socket.socket:
        """The open connection, or a new one if there is none or it is not clean.

        A keep-alive server closes a connection that idled too long (uvicorn after 5 s); the
        close shows as the socket turning readable while no request is in flight. Anything
        readable then (EOF, or bytes no request asked for, such as a 408 before the close)
        means the connection cannot carry the next request in step.
        """
        if self._sock is not None and (self._buffer or _readable(self._sock)):
            self.close()
        if self._sock is None:
            try:
                sock = socket.create_connection(self._address, timeout=self._timeout_s)
            except OSError as exc:
                raise HttpError(f"cannot connect to {self._address[0]}:{self._address[1]}: {exc}") from exc
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sock = sock
        return self._sock

    def _read_reply(self, method: str) -> Reply:
        head = self._read_until(b"\r\n\r\n").decode("latin-1")
        status_line, *lines = head.split("\r\n")
        try:
            version, code = status_line.split(" ", 2)[:2]
            status = int(code)
        except ValueError:
            raise HttpError(f"not an HTTP status line: {status_line[:80]!r}") from None
        headers: dict[str, str] = {}
        for line in lines:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if 100 <= status < 200:
            return self._read_reply(method)  # an interim answer: the real one follows
        if method == "HEAD" or status in (204, 304):
            content = b""
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            content = self._read_chunked()
        elif "content-length" in headers:
            content = self._read_exactly(int(headers["content-length"]))
        else:
            content = self._read_to_close()
        if headers.get("connection", "").lower() == "close" or version == "HTTP/1.0":
            self.close()
        return Reply(status, headers, content)

    def _fill(self) -> None:
        assert self._sock is not None
        more = self._sock.recv(_READ)
        if not more:
            raise HttpError("the server closed the connection mid-reply")
        self._buffer += more

    def _read_until(self, marker: bytes) -> bytes:
        while (end := self._buffer.find(marker)) < 0:
            self._fill()
        found, self._buffer = self._buffer[:end], self._buffer[end + len(marker) :]
        return found

    def _read_exactly(self, size: int) -> bytes:
        while len(self._buffer) < size:
            self._fill()
        found, self._buffer = self._buffer[:size], self._buffer[size:]
        return found

    def _read_chunked(self) -> bytes:
        parts = []
        while True:
            size = int(self._read_until(b"\r\n").split(b";")[0], 16)
            if size == 0:
                while self._read_until(b"\r\n"):  # trailers, up to the empty line
                    pass
                return b"".join(parts)
            parts.append(self._read_exactly(size))
            self._read_until(b"\r\n")

    def _read_to_close(self) -> bytes:
        assert self._sock is not None
        while more := self._sock.recv(_READ):
            self._buffer += more
        found, self._buffer = self._buffer, b""
        self.close()
        return found
