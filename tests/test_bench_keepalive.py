"""The benchmarks' lean HTTP client (bench/keepalive.py) against a real HTTP/1.1 server on loopback."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from bench.keepalive import HttpError, KeepAliveHttp


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        self.timeout = self.server.idle_s  # read by setup(): an idle connection is dropped
        super().setup()
        self.server.connections += 1

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self._answer(200, {"path": self.path, "body": body.decode(), "type": self.headers.get("Content-Type"),
                           "auth": self.headers.get_all("Authorization")})  # fmt: skip

    def do_GET(self) -> None:
        if self.path.startswith("/chunked"):
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b'{"parts": ', b'"two"', b"}"):
                self.wfile.write(b"%x;ext=1\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\nX-Trailer: yes\r\n\r\n")
        elif self.path.startswith("/says-close"):  # says so, but leaves the socket open
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"{}")
        elif self.path.startswith("/extra"):  # bytes after the reply that nobody asked for
            self._answer(200, {"path": self.path})
            self.wfile.write(b"HTTP/1.1 408 Request Timeout\r\nContent-Length: 0\r\n\r\n")
        elif self.path.startswith("/bad-length"):
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: lots\r\n\r\n{}")
        elif self.path.startswith("/interim"):
            self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._answer(201, {"path": self.path})
        elif self.path.startswith("/unframed"):  # no length: the body ends with the connection
            self.wfile.write(b"HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{\"to\": \"close\"}")
            self.close_connection = True
        elif self.path.startswith("/close"):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(b"{}")
            self.close_connection = True
        else:
            self._answer(404 if self.path.startswith("/missing") else 200, {"path": self.path})

    def _answer(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_args: object) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    connections = 0
    idle_s: float | None = None


@pytest.fixture
def server() -> Iterator[_Server]:
    srv = _Server(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def _url(srv: _Server) -> str:
    return f"http://127.0.0.1:{srv.server_address[1]}"


def test_requests_share_one_connection_and_carry_bodies_and_headers(server: _Server) -> None:
    with KeepAliveHttp(_url(server), {"Authorization": "Bearer api"}) as client:
        answers = [client.post("/v1/execute", json={"n": n, "text": "é"}).json() for n in range(5)]
        form = client.post("/v1/channel-auth", data={"socket_id": "1.2", "channel_name": "private-run-x"}).json()
        query = client.get("/v1/jobs/x/output", params={"waitMs": "30000"}).json()
        other = client.post("/v1/jobs/x/start", headers={"Authorization": "Bearer job"}).json()
        missing = client.get("/missing")
    assert server.connections == 1
    assert [json.loads(a["body"]) for a in answers] == [{"n": n, "text": "é"} for n in range(5)]
    assert answers[0]["type"] == "application/json" and answers[0]["auth"] == ["Bearer api"]
    assert form["type"] == "application/x-www-form-urlencoded"
    assert form["body"] == "socket_id=1.2&channel_name=private-run-x"
    assert query["path"] == "/v1/jobs/x/output?waitMs=30000"
    assert other["auth"] == ["Bearer job"] and other["body"] == ""  # the caller's header replaces the fixed one
    assert missing.status_code == 404 and missing.json() == {"path": "/missing"}
    with pytest.raises(HttpError, match="HTTP 404"):
        missing.raise_for_status()


def test_chunked_replies_are_joined_and_the_connection_stays_usable(server: _Server) -> None:
    with KeepAliveHttp(_url(server)) as client:
        assert client.get("/chunked").json() == {"parts": "two"}
        assert client.get("/after").json() == {"path": "/after"}
    assert server.connections == 1


def test_a_connection_the_server_closed_is_replaced_before_the_next_request(server: _Server) -> None:
    server.idle_s = 0.2  # the server drops a connection idle this long, as uvicorn does after 5 s
    with KeepAliveHttp(_url(server)) as client:
        assert client.get("/one").status_code == 200
        time.sleep(0.6)
        assert client.post("/two", json={}).json()["path"] == "/two"
        assert client.get("/close").json() == {}  # "Connection: close" is honoured ...
        assert client.get("/three").status_code == 200  # ... and the next request reconnects
    assert server.connections == 3


def test_failures_say_what_failed(server: _Server) -> None:
    port = server.server_address[1]
    server.shutdown()
    server.server_close()
    with pytest.raises(HttpError, match=f"cannot connect to 127.0.0.1:{port}"):
        KeepAliveHttp(f"http://127.0.0.1:{port}").get("/")
    with pytest.raises(ValueError, match="plain http"):
        KeepAliveHttp("https://127.0.0.1:1")


def test_a_connection_out_of_step_is_never_reused(server: _Server) -> None:
    # Whatever could leave a reply's bytes on the connection, the next request gets a new one.
    with KeepAliveHttp(_url(server)) as client:
        assert client.get("/says-close").json() == {}
        assert client.get("/one").json() == {"path": "/one"}  # on a new connection
        assert server.connections == 2
        assert client.get("/extra").json() == {"path": "/extra"}
        time.sleep(0.1)
        assert client.get("/two").json() == {"path": "/two"}  # not the stray 408
        assert server.connections == 3
        with pytest.raises(HttpError, match="GET /bad-length"):
            client.get("/bad-length")
        assert client.get("/three").json() == {"path": "/three"}
        assert server.connections == 4
        interim = client.get("/interim")
        assert (interim.status_code, interim.json()) == (201, {"path": "/interim"})
        assert client.get("/unframed").json() == {"to": "close"}
        assert client.get("/four").json() == {"path": "/four"}
        assert server.connections == 5
