"""The publisher's pause on a real stack: a worker whose soketi stalls once still gets every
job's result out live.

One delivery that times out pauses the worker's live view for BACKOFF_S; in the pause a
stage or a result goes as a probe, one at a time. Another job's result that comes while the
probe is out must wait for its answer and go, not be dropped: it is the last event of its
job, so its follower would see no later seq to notice the loss by (commits 8b9ff41 and
a50e7b9; test_publisher.py proves it over a fake soketi). Here a real worker publishes over
soketi's HTTP API through a loopback proxy the test drives: it stalls one request past
PUSHER_TIMEOUT_MS, holds the pause's probe until the second job has ended, and records what
went through, so the test can tell that the scenario really happened.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.conftest import StackFactory
from tests.helpers import Api, Realtime, py_job
from worker.messaging.publisher import BACKOFF_S

pytestmark = [pytest.mark.stack, pytest.mark.sandbox]

# The worker's delivery timeout. The stalled request costs the test this long; the probe is
# held for at most PROBE_HOLD_MAX_S of it, so it is answered in time.
PUSHER_TIMEOUT_MS = 3000
PROBE_HOLD_MAX_S = 2.0
# How long the probe stays held after the second job has ended: ample for that job's lane to
# hand its result to the publisher (a Redis look at most; no other delivery is under way).
SETTLE_S = 0.3

_TALLY = re.compile(r"live events: (\d+) delivered \(\d+ through Redis\), (\d+) refused or unreachable, (\d+) dropped")


@dataclass
class _Request:
    """One request the worker sent soketi's HTTP API, as the proxy saw it (monotonic times)."""

    arrived: float
    events: list[tuple[str, str, str]]  # (name, channel, data)
    verdict: str = "forward"  # "stall": never answered; "hold": the probe, answered late
    released: float | None = None  # (held) forwarded to soketi
    answered: float | None = None  # soketi's answer handed back to the worker
    hung_up: float | None = None  # (stalled) the worker gave up and closed the connection
    status: int | None = None

    def has(self, name: str, channel: str, text: str = "") -> bool:
        return any(n == name and c == channel and text in d for n, c, d in self.events)

    def __repr__(self) -> str:
        times = {
            k: round(v, 3)
            for k in ("arrived", "released", "answered", "hung_up")
            if (v := getattr(self, k)) is not None
        }
        names = [f"{n}@{c[-6:]}" for n, c, _ in self.events]
        return f"<{self.verdict} {names} {times} {self.status}>"


@dataclass
class _StallingProxy:
    """A loopback HTTP proxy in front of soketi's HTTP API, on an event loop of its own thread.

    It stalls the first request that carries a stdout event containing `stall_text` on
    `channel` (reads it, never answers), then holds the first request after that which
    carries `channel`'s result until `release` is set, and forwards everything else at once.
    """

    upstream_port: int
    channel: str = ""
    stall_text: str = ""
    port: int = 0
    requests: list[_Request] = field(default_factory=list)
    stalled: threading.Event = field(default_factory=threading.Event)  # the worker hung up on it
    probe_held: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="soketi-proxy", daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop
        ).result(5)
        self.port = self._server.sockets[0].getsockname()[1]

    def close(self) -> None:
        self.release.set()
        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _shutdown(self) -> None:
        """Stop listening and end every connection still open (dialled ahead, unused)."""
        self._server.close()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def seen(self) -> list[_Request]:
        with self._lock:
            return list(self.requests)

    def _judge(self, request: _Request) -> str:
        with self._lock:
            self.requests.append(request)
            verdicts = [r.verdict for r in self.requests]
        if "stall" not in verdicts and request.has("stdout", self.channel, self.stall_text):
            return "stall"
        if "stall" in verdicts and "hold" not in verdicts and request.has("result", self.channel):
            return "hold"
        return "forward"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # a connection the worker dialled ahead and closed unused
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            body = await reader.readexactly(int(length.group(1))) if length else b""
            request = _Request(time.monotonic(), _events(body))
            request.verdict = self._judge(request)
            if request.verdict == "stall":
                await reader.read()  # until the worker's timeout closes the connection
                request.hung_up = time.monotonic()
                self.stalled.set()
                return
            if request.verdict == "hold":
                self.probe_held.set()
                await asyncio.get_running_loop().run_in_executor(None, self.release.wait, 30)
                request.released = time.monotonic()
            answer = await self._forward(head + body)
            request.status = int(answer.split(b" ", 2)[1])
            writer.write(answer)
            await writer.drain()
            request.answered = time.monotonic()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def _forward(self, raw: bytes) -> bytes:
        """One request to soketi and its whole answer (soketi closes after each one)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        try:
            writer.write(raw)
            head = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
            return head + (await reader.readexactly(int(length.group(1))) if length else await reader.read())
        finally:
            writer.close()


def _events(body: bytes) -> list[tuple[str, str, str]]:
    """The events in a Pusher HTTP API body: one event, or a batch."""
    try:
        parsed = json.loads(body)
    except ValueError:
        return []
    if not isinstance(parsed, dict):
        return []
    listed = parsed.get("batch", [parsed])
    return [(e.get("name", ""), e.get("channel", ""), e.get("data", "")) for e in listed if isinstance(e, dict)]


def _wait(check, what: str, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout_s}s"
        time.sleep(0.01)


def _running(followed) -> bool:  # type: ignore[no-untyped-def]
    return any(n == "stage" and p.get("phase") == "running" for n, p in list(followed.events))


def _stdin(api: Api, job: dict[str, Any], chunk: str) -> None:
    response = api.post(f"/v1/jobs/{job['jobId']}/stdin", token=job["jobToken"], json={"chunk": chunk})
    assert response.status_code == 200, response.text


def test_a_result_that_comes_while_the_pause_probe_is_out_still_goes_live(make_stack: StackFactory) -> None:
    # Two interactive jobs, so the test says when each prints and ends. Job A's "tick" is
    # stalled: the worker times out and pauses. Job A then ends: its result is the pause's
    # probe, and the proxy holds it while job B ends. B's result, handed to the publisher
    # while the probe is out, must go once the probe is answered (1cf7a83 dropped it).
    stack = make_stack(with_worker=False, WORKER_MAX_SANDBOXES="2", LOG_LEVEL="INFO")
    proxy = _StallingProxy(upstream_port=stack.soketi_port)
    # Only the worker talks to soketi through the proxy, over HTTP (the stack's default is
    # soketi's Redis adapter, which has no request to stall); clients and the API go direct.
    stack.start_worker(
        extra_env={
            "PUSHER_PORT": str(proxy.port),
            "PUSHER_PUBLISH": "http",
            "PUSHER_TIMEOUT_MS": str(PUSHER_TIMEOUT_MS),
        }
    )
    api, rt_a, rt_b = Api(stack), Realtime(stack), Realtime(stack)
    try:
        job_a = api.execute(py_job('input()\nprint("tick", flush=True)\ninput()\nprint("A done")\n'))
        job_b = api.execute(py_job('input()\nprint("B done")\n'))
        followed_a, followed_b = rt_a.follow(job_a), rt_b.follow(job_b)
        proxy.channel, proxy.stall_text = job_a["channel"], "tick"
        for job in (job_a, job_b):
            assert api.start(job).status_code == 202
        # Both wait on their stdin, everything before delivered: nothing else is in flight.
        _wait(lambda: _running(followed_a) and _running(followed_b), "both jobs running live", 20)

        _stdin(api, job_a, "1\n")  # "tick": the request the proxy stalls
        assert proxy.stalled.wait(PUSHER_TIMEOUT_MS / 1000 + 10), f"the worker never gave up: {proxy.seen()}"
        _stdin(api, job_a, "2\n")  # A ends within the pause: its result is the probe
        assert proxy.probe_held.wait(BACKOFF_S), f"no probe in the pause: {proxy.seen()}"
        _stdin(api, job_b, "go\n")  # B ends while the probe is held
        api.wait_state(job_b, {"done"}, timeout_s=PROBE_HOLD_MAX_S - SETTLE_S)
        b_ended = time.monotonic()
        time.sleep(SETTLE_S)
        proxy.release.set()

        # The behaviour: each follower gets its job's one result, the one in the durable log.
        for label, job, followed in (("A", job_a, followed_a), ("B", job_b, followed_b)):
            got = followed.finished.wait(10)
            assert got, f"job {label}: no live result; got {followed.summary()}; soketi's API saw {proxy.seen()}"
            live = followed.wait_result(timeout_s=0)
            logged = [p for n, p in api.replay(job) if n == "result"]
            assert [live] == logged, followed.summary()
            assert (live["outcome"], live["exitCode"]) == ("completed", 0)
        time.sleep(0.5)  # a second result would have arrived by now (Realtime.close checks)
    finally:
        rt_a.close()
        rt_b.close()
        api.close()
        proxy.close()

    # The scenario really happened. Exactly one request timed out, A's "tick" ...
    seen = proxy.seen()
    (stalled,) = [r for r in seen if r.verdict == "stall"]
    assert stalled.hung_up is not None and stalled.answered is None, seen
    assert all(r.answered is not None for r in seen if r is not stalled), seen
    # ... the next stage or result was A's, in the pause, held, and answered within the
    # worker's timeout (a probe that got through) ...
    after = [r for r in seen if r.arrived > stalled.arrived and any(n != "stdout" for n, _, _ in r.events)]
    probe = after[0]
    assert probe.verdict == "hold" and probe.has("result", job_a["channel"]), seen
    assert probe.arrived - stalled.hung_up < BACKOFF_S - 0.5, seen
    assert probe.released is not None and probe.answered is not None and probe.status == 200, seen
    assert probe.answered - probe.arrived < PUSHER_TIMEOUT_MS / 1000 - 0.5, seen
    # ... and B's result, which the worker had well before the probe's answer, reached soketi
    # only after it: it waited for the probe (out of the pause it would have gone at once).
    (b_result,) = [r for r in seen if r.has("result", job_b["channel"])]
    assert b_ended < probe.released - SETTLE_S / 2, seen
    assert b_result.arrived >= probe.released and b_result.status == 200, seen
    # The worker's own word: one delivery timed out (logged once, counted once).
    stack.stop_process("worker", signal.SIGTERM)
    log = stack.log("worker")
    assert log.count("soketi unreachable (TimeoutError)") == 1, log[-3000:]
    tally = _TALLY.findall(log)
    assert tally and int(tally[-1][1]) == 1, log[-3000:]
