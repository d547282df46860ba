"""Test clients for a real stack: httpx for the API, pysher (a real Pusher client) for events."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pysher
from pysher.channel import Channel

from launcher.stack import Stack
from shared.manifest import compiled_shim_name
from shared.paths import REPO_ROOT
from shared.pusher import channel_auth
from worker.runtimes import load_manifests

__all__ = ["Api", "Followed", "Realtime", "compiled_shims", "host_processes", "pids_with_cmdline", "py_job", "run_job"]


def host_processes() -> Iterator[tuple[int, bytes, dict[str, str]]]:
    """Every host process still there when looked at: pid, command line, /proc status fields."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes()
                status = (entry / "status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            yield int(entry.name), cmdline, {k: v.strip() for k, v in fields.items()}


def pids_with_cmdline(*fragments: bytes) -> list[int]:
    """Host processes whose command line contains every one of `fragments`."""
    return [pid for pid, cmdline, _ in host_processes() if all(f in cmdline for f in fragments)]


def compiled_shims() -> dict[str, str]:
    """Language -> the name a compiled prestart shim is started by (Java: its class), from
    the manifests: the worker compiles such a shim and names it as `run` names a class."""
    manifests = load_manifests(REPO_ROOT / "sandbox-profiles")
    return {m.language: name for m in manifests if (name := compiled_shim_name(m)) is not None}


def self_signed_certificate(folder: Path, alt_name: str) -> tuple[Path, Path]:
    """A one-day self-signed certificate and its key (files in `folder`) for `alt_name`,
    as openssl's subjectAltName says it ("IP:127.0.0.1", "DNS:hooks.test")."""
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", f"/CN={alt_name.partition(':')[2]}", "-addext", f"subjectAltName={alt_name}"],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


def alive(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def dies_with_the_tests(signal_number: int = signal.SIGTERM) -> Callable[[], None]:
    """A preexec_fn: the child gets `signal_number` once the test process is gone (a run
    cut short with no teardown: `timeout make test`), so no stack or server it started
    outlives the run."""
    # The signal comes when the thread that forked the child ends, not the process: only the
    # main thread's children can rely on it.
    assert threading.current_thread() is threading.main_thread(), "start it from the main thread"
    parent = os.getpid()
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # (looked up here: no dlopen after fork)

    def arrange() -> None:
        if prctl(1, signal_number, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:
            os.kill(os.getpid(), signal_number)  # the parent went before the signal was set

    return arrange


def py_job(code: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"language": "python", "files": [{"name": "main.py", "content": code}]}
    body.update(extra)
    return body


class Api:
    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.url = stack.api_url
        self.client = httpx.Client(base_url=self.url, timeout=10)

    def headers(self, token: str | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {token or self.stack.api_token}"}

    def post(self, path: str, token: str | None = None, headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
        return self.client.post(path, headers={**self.headers(token), **(headers or {})}, **kwargs)

    def get(self, path: str, token: str | None = None, **kwargs: Any) -> httpx.Response:
        return self.client.get(path, headers=self.headers(token), **kwargs)

    def execute(self, body: dict[str, Any]) -> dict[str, Any]:
        response = self.post("/v1/execute", json=body)
        assert response.status_code == 202, response.text
        return response.json()  # type: ignore[no-any-return]

    def start(self, job: dict[str, Any], token: str | None = None) -> httpx.Response:
        return self.post(f"/v1/jobs/{job['jobId']}/start", token=token or job["jobToken"])

    def status(self, job: dict[str, Any]) -> dict[str, Any]:
        response = self.get(f"/v1/jobs/{job['jobId']}")
        assert response.status_code == 200, response.text
        return response.json()  # type: ignore[no-any-return]

    def replay(self, job: dict[str, Any], after: int | None = None, timeout_s: float = 30) -> list[tuple[str, dict[str, Any]]]:
        """Every event of the job from the durable log (SSE), until the result."""
        params = {} if after is None else {"after": str(after)}
        events: list[tuple[str, dict[str, Any]]] = []
        with self.client.stream("GET", f"/v1/jobs/{job['jobId']}/events", headers=self.headers(), params=params,
                                timeout=timeout_s) as response:  # fmt: skip
            assert response.status_code == 200, response.read()
            assert response.headers["content-type"].startswith("text/event-stream")
            name = data = None
            for line in response.iter_lines():
                if line.startswith("event: "):
                    name = line[7:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                elif line == "" and name is not None:
                    events.append((name, data))  # type: ignore[arg-type]
                    name = data = None
        return events

    def wait_state(self, job: dict[str, Any], states: set[str], timeout_s: float = 20) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.status(job)
            if status["state"] in states:
                return status
            if time.monotonic() > deadline:
                raise AssertionError(f"job stayed {status['state']!r}, wanted {states}")
            time.sleep(0.05)

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> Api:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class Followed:
    """Every event received on one job's channel, in arrival order."""

    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.subscribed = threading.Event()
        self.finished = threading.Event()
        self._lock = threading.Lock()

    def add(self, name: str, raw: str) -> None:
        payload = json.loads(raw)
        with self._lock:
            self.events.append((name, payload))
        if name == "result":
            self.finished.set()

    def wait_result(self, timeout_s: float = 20) -> dict[str, Any]:
        if not self.finished.wait(timeout_s):
            raise AssertionError(f"no result within {timeout_s}s; got {self.summary()}")
        results = self.results()
        # Exactly one: Realtime.close() checks again once more events had time to arrive.
        assert len(results) == 1, f"{len(results)} results: {self.summary()}"
        return results[0]

    def summary(self, limit: int = 300) -> str:
        """The events so far, each cut short (huge outputs must not flood a failure report)."""
        with self._lock:
            events = list(self.events)
        shown = [f"{n} {str(p)[:limit]}" for n, p in events[:20]]
        more = f" … and {len(events) - 20} more" if len(events) > 20 else ""
        return f"{len(events)} events: " + "; ".join(shown) + more

    def results(self) -> list[dict[str, Any]]:
        with self._lock:
            return [p for n, p in self.events if n == "result"]

    def text(self, stream: str) -> str:
        with self._lock:
            ordered = sorted((p["seq"], p["chunk"]) for n, p in self.events if n == stream)
        return "".join(chunk for _, chunk in ordered)


class Realtime:
    """One pysher connection; subscribe to many job channels on it."""

    EVENTS = ("stage", "compile_output", "stdout", "stderr", "result", "artifact", "test_result")

    def __init__(self, stack: Stack, auth_token: str | None = None) -> None:
        info = httpx.get(f"{stack.api_url}/v1/realtime").json()
        self._connected = threading.Event()
        self.pusher = pysher.Pusher(
            info["key"],
            custom_host=info["wsHost"],
            port=info["wsPort"],
            secure=info["forceTLS"],
            auth_endpoint=f"{stack.api_url}/v1/channel-auth",
            auth_endpoint_headers={"Authorization": f"Bearer {auth_token or stack.api_token}"},
            reconnect_interval=1,
        )
        self.pusher.connection.bind("pusher:connection_established", lambda _data: self._connected.set())
        self._followed: list[Followed] = []
        self.pusher.connect()
        if not self._connected.wait(10):
            raise AssertionError("pysher could not connect to soketi")

    def follow(self, job: dict[str, Any], timeout_s: float = 10, signed_here: str | None = None) -> Followed:
        """Subscribe to the job's channel, signed by the API's channel-auth route, or with
        `signed_here` (the Pusher secret) by the caller, as a backend that signs its own
        subscriptions does: only soketi's webhook then tells the API of the follower."""
        followed = Followed(job)
        self._followed.append(followed)
        name = job["channel"]
        # pysher's subscribe() sends the request before it registers the channel, so a fast
        # server's answer can be dropped. Register first, then send the same request.
        channel = Channel(name, self.pusher.connection)
        channel.bind("pusher_internal:subscription_succeeded", lambda _data: followed.subscribed.set())
        for event in self.EVENTS:
            channel.bind(event, lambda data, event=event: followed.add(event, data))
        self.pusher.channels[name] = channel
        if signed_here is not None:
            auth = channel_auth(self.pusher.key, signed_here, self.pusher.connection.socket_id, name)
        else:
            auth = self.pusher._generate_auth_token(name)  # POSTs to /v1/channel-auth like pusher-js
        self.pusher.connection.send_event("pusher:subscribe", {"channel": name, "auth": auth})
        if not followed.subscribed.wait(timeout_s):
            raise AssertionError(f"subscription to {job['channel']} did not succeed")
        return followed

    def _shut_down_socket(self) -> None:
        connection = self.pusher.connection
        connection.needs_reconnect, connection.disconnect_called = False, True  # (no reconnect)
        app = connection.socket
        if app is None:
            return
        app.keep_running = False  # (the reader, woken, stops rather than reads)
        websocket = app.sock
        raw = getattr(websocket, "sock", None)
        if websocket is None or raw is None:
            return
        with contextlib.suppress(Exception):
            websocket.send_close()
        with contextlib.suppress(OSError):
            raw.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """Disconnect; fails if any job followed here got more than one result live."""
        # websocket-client's close() (1.9) marks the connection closed before it sends its
        # close frame, so the send fails, the socket is closed without a shutdown, and the
        # reader thread stays in its select on the closed descriptor: pysher's disconnect then
        # waited out its whole join timeout (a second a close, about 200 s of the suite) for a
        # thread that never ended. Said goodbye to and shut down here first, the socket wakes
        # that select, the reader sees it is to stop, and the thread ends at once.
        self._shut_down_socket()
        self.pusher.disconnect(timeout=1)
        doubled = {f.job["jobId"]: len(f.results()) for f in self._followed if len(f.results()) > 1}
        if doubled:
            raise AssertionError(f"jobs with more than one live result event: {doubled}")


def run_job(api: Api, realtime: Realtime, body: dict[str, Any], timeout_s: float = 20) -> tuple[dict[str, Any], Followed]:
    """Submit `body`, follow it live, start it, and wait for its one result."""
    job = api.execute(body)
    followed = realtime.follow(job)
    api.start(job)
    return followed.wait_result(timeout_s=timeout_s), followed


@contextlib.contextmanager
def watched_commands(stack: Stack, scripted: list[str] | None = None) -> Iterator[list[str]]:
    """Every command the stack's Redis runs meanwhile (MONITOR), as text; those a Lua script
    ran are also added to `scripted`."""
    seen: list[str] = []
    with stack.redis() as redis, redis.monitor() as monitor:

        def listen() -> None:
            try:
                for command in monitor.listen():
                    seen.append(command["command"])
                    if scripted is not None and command.get("client_type") == "lua":
                        scripted.append(command["command"])
            except Exception:
                pass  # leaving the block disconnects the monitor: the watch is over

        thread = threading.Thread(target=listen, daemon=True)
        thread.start()
        yield seen
        time.sleep(0.2)  # what was sent last reaches the monitor
    thread.join(5)
