"""One client cannot take the API down for everyone.

- Event streams (`GET /v1/jobs/:id/events`) are bounded per job, per caller and per process;
  a refused stream is a 429/503 before any byte of it, and admitted streams never break.
- Hostile bodies (5,000-deep JSON) are a 403 or 400, never a 500, and log no error.
- Slow clients (headers or body a byte at a time, or never) are cut off by read timeouts
  while everyone else is served at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import select
import socket
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from api.server import MAX_HEAD_BYTES, MAX_PIPELINED
from launcher.stack import Stack
from shared.errors import ConfigError
from shared.settings import load_settings
from tests.conftest import StackFactory
from tests.helpers import Api, py_job

pytestmark = [pytest.mark.stack]


# ------------------------------------------------------------------ helpers


def _open_stream(client: httpx.Client, job: dict[str, Any], token: str) -> httpx.Response:
    request = client.build_request("GET", f"/v1/jobs/{job['jobId']}/events", headers={"Authorization": f"Bearer {token}"})
    return client.send(request, stream=True)


def _events_until_result(response: httpx.Response) -> list[tuple[str, dict[str, Any]]]:
    assert response.status_code == 200, response.read()
    events: list[tuple[str, dict[str, Any]]] = []
    name = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: ") and name is not None:
            events.append((name, json.loads(line[6:])))
            if name == "result":
                break
    return events


def _refusal(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.read()
    assert response.headers["content-type"] == "application/json"
    body = json.loads(response.read())
    assert body["error"] and body["details"] == []
    if status in (429, 503):
        assert body["retryAfterMs"] > 0 and int(response.headers["retry-after"]) >= 1
    return body  # type: ignore[no-any-return]


def _raw_request(stack: Stack, data: bytes, timeout_s: float = 10) -> tuple[int, bytes]:
    """Send `data` on a fresh connection and read until the server closes it."""
    with socket.create_connection((stack.api_host, stack.api_port), timeout=timeout_s) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    answer = b"".join(chunks)
    return int(answer.split(b" ", 2)[1]), answer


def _error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if " ERROR " in line or line.startswith(("ERROR", "Traceback"))]


def _kill(api: Api, job: dict[str, Any]) -> None:
    api.post(f"/v1/jobs/{job['jobId']}/kill", token=job["jobToken"])


# ------------------------------------------------------------------ event streams


def test_per_principal_bound_below_the_pool_is_required() -> None:
    assert load_settings({}).max_event_streams_per_job == 4
    assert load_settings({}).max_event_streams_per_principal == 32
    with pytest.raises(ConfigError, match="MAX_EVENT_STREAMS_PER_PRINCIPAL"):
        load_settings({"MAX_EVENT_STREAMS": "8", "MAX_EVENT_STREAMS_PER_PRINCIPAL": "8"})
    assert (load_settings({}).max_output_waits, load_settings({}).max_output_waits_per_principal) == (256, 64)
    with pytest.raises(ConfigError, match="MAX_OUTPUT_WAITS_PER_PRINCIPAL"):
        load_settings({"MAX_OUTPUT_WAITS": "8", "MAX_OUTPUT_WAITS_PER_PRINCIPAL": "9"})


def test_one_job_token_gets_four_streams_and_others_keep_theirs(api: Api) -> None:
    hog = api.execute(py_job("print('hog')"))
    other = api.execute(py_job("print('other')"))
    client = httpx.Client(base_url=api.url, timeout=30)
    held: list[httpx.Response] = []
    try:
        # The per-job maximum (4 on the shared stack) with one job token: all admitted.
        for _ in range(4):
            held.append(_open_stream(client, hog, hog["jobToken"]))
            assert held[-1].status_code == 200
        # The next is refused before the stream starts, with the job token or the API token,
        # and a HEAD answers what that GET would.
        body = _refusal(_open_stream(client, hog, hog["jobToken"]), 429)
        head = client.head(f"/v1/jobs/{hog['jobId']}/events", headers={"Authorization": f"Bearer {hog['jobToken']}"})
        assert head.status_code == 429 and head.headers["retry-after"] == "2"
        assert "this job" in body["error"] and "4" in body["error"]
        _refusal(_open_stream(client, hog, api.stack.api_token), 429)
        # Another job's stream is unaffected: it follows its job to the result.
        stream = _open_stream(client, other, other["jobToken"])
        api.start(other)
        events = _events_until_result(stream)
        stream.close()
        assert events[-1][0] == "result" and events[-1][1]["outcome"] == "completed"
        # How the text is cut into chunks depends on the pipe's timing; the text does not.
        assert "".join(p["chunk"] for n, p in events if n == "stdout") == "other\n"
        # A closed stream gives its slot back; the held ones still end with the result.
        held.pop().close()
        deadline = time.monotonic() + 5
        while (again := _open_stream(client, hog, hog["jobToken"])).status_code != 200:
            assert time.monotonic() < deadline, again.read()
            again.close()
            time.sleep(0.05)
        held.append(again)
        api.start(hog)
        for response in held:
            assert _events_until_result(response)[-1][1]["outcome"] == "completed"
    finally:
        for response in held:
            response.close()
        client.close()


async def test_a_stream_whose_seek_lands_past_the_result_ends_at_once() -> None:
    """The result lands between the 204 check (no result yet) and the seek of a client at or
    past its seq: the backlog after the cursor is empty and the job has ended. The stream
    ends there; it used to send keep-alives, holding its slot and a blocking connection,
    until the job's record expired."""
    import msgspec

    from api.events import _stream
    from api.store import StoredStatus
    from api.streams import EventPace
    from shared.messages import JobState, ResultEvent

    result = msgspec.json.decode(
        b'{"exitCode":0,"signal":null,"timedOut":false,"idleTimedOut":false,"truncated":false,"durationMs":1,'
        b'"cpuMs":1,"memoryKb":1,"outcome":"completed","compile":null,"seq":5}',
        type=ResultEvent,
    )
    ended = StoredStatus(
        job_id="a" * 32, state=JobState.DONE, updated_at_ms=0, language="python", version="3", owner="o",
        started=True, result=result,
    )

    class Store:
        reads = 0

        async def seek_events(self, job_id: str, after_seq: int) -> str:
            return "6-0"

        async def events(self, job_id: str, cursor: str, block_ms: int | None) -> list[Any]:
            self.reads += 1
            await asyncio.sleep(0)
            return []

        async def status(self, job_id: str) -> StoredStatus:
            return ended

    store = Store()
    sent = []
    async with asyncio.timeout(5):
        async for piece in _stream(store, ended.job_id, 7, EventPace(1000), "o"):  # type: ignore[arg-type]
            sent.append(piece)
            if len(sent) > 3:
                break
    assert sent == [] and store.reads == 1


def test_a_head_of_the_event_stream_answers_at_once_and_holds_no_stream(api: Api) -> None:
    # Starlette answers HEAD on every GET route; run as a stream, it held a slot and its
    # keep-alive connection until the job ended (the next request on it waited as long).
    job = api.execute(py_job("print('parked')"))  # never started: its stream would not end
    with httpx.Client(base_url=api.url, timeout=3, limits=httpx.Limits(max_connections=1)) as client:
        headers = {"Authorization": f"Bearer {job['jobToken']}"}
        for _ in range(6):  # past the per-job bound of 4, were each a stream
            head = client.head(f"/v1/jobs/{job['jobId']}/events", headers=headers)
            assert head.status_code == 200 and head.headers["content-type"].startswith("text/event-stream")
        assert client.get(f"/v1/jobs/{job['jobId']}", headers=headers).json()["state"] == "parked"
        stream = _open_stream(client, job, job["jobToken"])
        assert stream.status_code == 200
        stream.close()
        assert client.head(f"/v1/jobs/{job['jobId']}/events").status_code == 401


def test_event_replays_are_paced_job_tokens_with_their_owner(make_stack: StackFactory) -> None:
    # A stream costs the API ~10 us an event: the streams of one owner's jobs together send
    # at most MAX_EVENT_RATE a second (after a burst of as many), job tokens included (keyed
    # by caller, every job token's own bucket multiplied the pace).
    stack = make_stack(MAX_EVENT_RATE="100")
    api = Api(stack)
    try:
        # Alternating one-byte writes: a few hundred events (the worker gathers the rest).
        code = "import os, time\nfor i in range(2000):\n    os.write(1 + i % 2, b'x')\n    time.sleep(0.0015)\n"
        job = api.execute(py_job(code, limits={"wallTimeMs": 20000}))
        api.start(job)
        assert api.wait_state(job, {"done"}, timeout_s=60)["result"]["outcome"] == "completed"
        began = time.monotonic()
        events = api.replay(job)
        took = time.monotonic() - began
        assert events[-1][0] == "result" and len(events) > 250, len(events)
        assert took >= (len(events) - 100) / 100 * 0.9, (len(events), took)
        # Its job token right after: the owner's bucket is empty, so its first page waits.
        with httpx.Client(base_url=stack.api_url, timeout=30) as client:
            began = time.monotonic()
            response = _open_stream(client, job, job["jobToken"])
            try:
                assert response.status_code == 200
                first = next(response.iter_lines())
            finally:
                response.close()
            assert first.startswith("id: ") and time.monotonic() - began >= 0.3
    finally:
        api.close()


def test_small_pool_is_503_before_any_byte_and_admitted_streams_never_break(make_stack: StackFactory) -> None:
    stack = make_stack(MAX_EVENT_STREAMS="4", MAX_EVENT_STREAMS_PER_JOB="2", MAX_EVENT_STREAMS_PER_PRINCIPAL="2")
    api = Api(stack)
    client = httpx.Client(base_url=api.url, timeout=30)
    a, b, c = (api.execute(py_job(f"print('{n}')")) for n in "abc")
    held: list[httpx.Response] = []
    try:
        # Streams dropped while they block in Redis give their pooled connection back:
        # three rounds of a full pool, each closed, leave the pool whole.
        for _ in range(3):
            round_ = [_open_stream(client, a, a["jobToken"]) for _ in range(2)]
            round_ += [_open_stream(client, b, api.stack.api_token) for _ in range(2)]
            assert [r.status_code for r in round_] == [200] * 4
            time.sleep(0.3)
            for r in round_:
                r.close()
            time.sleep(0.2)

        held += [_open_stream(client, a, a["jobToken"]) for _ in range(2)]
        held += [_open_stream(client, b, api.stack.api_token) for _ in range(2)]
        assert [r.status_code for r in held] == [200] * 4
        # Per-job and per-caller bounds first (429), then the process's pool (503).
        _refusal(_open_stream(client, a, a["jobToken"]), 429)
        assert "this token" in _refusal(_open_stream(client, c, api.stack.api_token), 429)["error"]
        # A third caller finds the pool full: a complete 503 answer, not a stream.
        head = (
            f"GET /v1/jobs/{c['jobId']}/events HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {c['jobToken']}\r\n"
            "Connection: close\r\n\r\n"
        )
        status, raw = _raw_request(stack, head.encode())
        assert status == 503, raw
        assert b"text/event-stream" not in raw and b"event:" not in raw
        answer = json.loads(raw.split(b"\r\n\r\n", 1)[1])
        assert "event streams" in answer["error"] and answer["retryAfterMs"] > 0

        # The admitted streams hold the whole pool past its 5 s wait for a connection, and
        # still end with their result.
        time.sleep(6)
        api.start(a)
        api.start(b)
        for response in held:
            assert _events_until_result(response)[-1][1]["outcome"] == "completed"
            response.close()
        held.clear()
        # With the pool free again, the third caller is admitted.
        stream = _open_stream(client, c, c["jobToken"])
        api.start(c)
        assert _events_until_result(stream)[-1][1]["outcome"] == "completed"
        stream.close()
    finally:
        for response in held:
            response.close()
        client.close()
        api.close()
    assert not _error_lines(stack.log("api"))


def test_output_waits_have_their_own_bounds_and_never_take_an_event_streams_connection(
    make_stack: StackFactory,
) -> None:
    # A pool of 4 for event streams; long-polls are bounded apart (3 in all, 2 per caller).
    # Before, every long-poll blocked on the event streams' pool without admission, so a
    # few of them left an admitted event stream without a connection.
    stack = make_stack(
        with_worker=False,  # nothing runs: every long-poll waits its full time
        MAX_EVENT_STREAMS="4", MAX_EVENT_STREAMS_PER_PRINCIPAL="2",
        MAX_OUTPUT_WAITS="3", MAX_OUTPUT_WAITS_PER_PRINCIPAL="2",
    )  # fmt: skip
    api = Api(stack)
    jobs = [api.execute(py_job("print(1)", collectOutput=True)) for _ in range(6)]
    answers: dict[int, httpx.Response] = {}

    def wait(index: int, token: str) -> None:
        with httpx.Client(base_url=api.url, timeout=30) as client:
            answers[index] = client.get(
                f"/v1/jobs/{jobs[index]['jobId']}/output",
                params={"waitMs": "6000"},
                headers={"Authorization": f"Bearer {token}"},
            )

    waiters = [
        threading.Thread(target=wait, args=(i, token), daemon=True)
        for i, token in enumerate([api.stack.api_token, api.stack.api_token, jobs[2]["jobToken"]])
    ]
    client = httpx.Client(base_url=api.url, timeout=30)
    try:
        for waiter in waiters:
            waiter.start()
        time.sleep(1.0)  # all three are waiting now
        assert answers == {}
        # The API token's third wait is over its caller's bound; another caller finds all in use.
        assert "waits for output" in _refusal(
            client.get(f"/v1/jobs/{jobs[3]['jobId']}/output", params={"waitMs": "1000"},
                       headers={"Authorization": f"Bearer {api.stack.api_token}"}), 429,
        )["error"]  # fmt: skip
        _refusal(
            client.get(f"/v1/jobs/{jobs[4]['jobId']}/output", params={"waitMs": "1000"},
                       headers={"Authorization": f"Bearer {jobs[4]['jobToken']}"}), 503,
        )  # fmt: skip
        # Meanwhile the event streams' whole pool is there for streams: four of them follow
        # their jobs to the result (a kill ends a queued job at once), past the pool's 5 s wait.
        streams = [_open_stream(client, jobs[5], jobs[5]["jobToken"]) for _ in range(2)]
        streams += [_open_stream(client, jobs[i], jobs[i]["jobToken"]) for i in (3, 4)]
        assert [r.status_code for r in streams] == [200] * 4
        time.sleep(5.5)
        for i in (5, 3, 4):
            _kill(api, jobs[i])
        for response in streams:
            assert _events_until_result(response)[-1][1]["outcome"] == "killed"
            response.close()
        for waiter in waiters:
            waiter.join(15)
        # The waits ended as waits do: nothing finished in time.
        assert [answers[i].status_code for i in range(3)] == [404] * 3
    finally:
        client.close()
        api.close()
    assert not _error_lines(stack.log("api"))


def _stalled_output_readers(stack: Stack, job: dict[str, Any], count: int) -> list[socket.socket]:
    """`count` connections that ask for the job's output and never read it."""
    path = f"/v1/jobs/{job['jobId']}/output"
    request = (f"GET {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {job['jobToken']}\r\n\r\n").encode()
    stalled = []
    for _ in range(count):
        conn = socket.socket()
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.connect(("127.0.0.1", stack.api_port))
        conn.sendall(request)
        stalled.append(conn)
    return stalled


def _output_once_the_slots_free(client: httpx.Client, job: dict[str, Any]) -> httpx.Response:
    deadline = time.monotonic() + 10
    while (answer := client.get(f"/v1/jobs/{job['jobId']}/output", headers={"Authorization": f"Bearer {job['jobToken']}"})).status_code != 200:
        assert answer.status_code == 429 and time.monotonic() < deadline, answer.text  # (until the stalled are let go)
        time.sleep(0.2)
    return answer


def _output_past_two_stalled_readers(stack: Stack, job: dict[str, Any]) -> dict[str, Any]:
    """Two connections ask for the job's output and never read it, holding its caller's two
    output slots: a third GET is refused (429) while they stay; once they close, the output."""
    stalled = _stalled_output_readers(stack, job, 2)
    try:
        time.sleep(1.0)
        with httpx.Client(base_url=stack.api_url, timeout=30) as client:
            refused = client.get(f"/v1/jobs/{job['jobId']}/output", headers={"Authorization": f"Bearer {job['jobToken']}"})
            assert "waits for output" in _refusal(refused, 429)["error"]
            for conn in stalled:
                conn.close()
            return _output_once_the_slots_free(client, job).json()  # type: ignore[no-any-return]
    finally:
        for conn in stalled:
            conn.close()


def test_a_streamed_output_holds_an_output_slot_until_it_is_sent(make_stack: StackFactory) -> None:
    # Amplification review: GET /output with no wait took no slot, so connections that never
    # read a 16 MiB job's output each held a slice of it and its encoded copies until the
    # send timeout: 500 of them took the API from 47 to 621 MB (with a job token alone),
    # and its loop stalled for seconds. A streamed body now holds an output slot.
    stack = make_stack(MAX_OUTPUT_WAITS="3", MAX_OUTPUT_WAITS_PER_PRINCIPAL="2", MAX_OUTPUT_KB="16384")
    api = Api(stack)
    code = "import os\nfor _ in range(2048):\n    os.write(1, b'a' * 8192)\n"
    job = api.execute(py_job(code, collectOutput=True, limits={"outputKb": 16384}))
    api.start(job)
    assert api.wait_state(job, {"done"}, timeout_s=60)["result"]["outcome"] == "completed"
    try:
        assert _output_past_two_stalled_readers(stack, job)["stdout"] == "a" * (16 << 20)
    finally:
        api.close()
    assert not _error_lines(stack.log("api"))


def test_a_big_output_built_whole_holds_an_output_slot_until_it_is_sent(make_stack: StackFactory) -> None:
    # Review: a body built whole was sent without a slot. A batch's result holds its cases'
    # output itself (up to outputKb), and streams under 64 KiB each can make a body six
    # times their size (control bytes): connections that never read one each held it until
    # the send timeout. Past 256 KiB such a body now holds an output slot.
    stack = make_stack(MAX_OUTPUT_WAITS="3", MAX_OUTPUT_WAITS_PER_PRINCIPAL="2", MAX_OUTPUT_KB="16384")
    api = Api(stack)
    code = "import os\nfor _ in range(1024):\n    os.write(1, b'c' * 8192)\n"
    job = api.execute(py_job(code, collectOutput=True, tests=[{"name": "big"}], limits={"outputKb": 16384}))
    api.start(job)
    assert api.wait_state(job, {"done"}, timeout_s=60)["result"]["outcome"] == "completed"
    stalled = []
    try:
        (case,) = _output_past_two_stalled_readers(stack, job)["tests"]
        assert case["stdout"] == "c" * (8 << 20) and not case.get("outputCut"), {k: v for k, v in case.items() if k != "stdout"}
        # One small enough is sent as it is, without a slot: all at once, never refused.
        small = api.execute(py_job("print(1)", collectOutput=True))
        api.start(small)
        assert api.wait_state(small, {"done"}, timeout_s=60)["result"]["outcome"] == "completed"
        stalled = _stalled_output_readers(stack, small, 3)
        with httpx.Client(base_url=api.url, timeout=30) as client:
            answer = client.get(f"/v1/jobs/{small['jobId']}/output", headers={"Authorization": f"Bearer {small['jobToken']}"})
            assert answer.status_code == 200 and answer.json()["stdout"] == "1\n", answer.text
    finally:
        for conn in stalled:
            conn.close()
        api.close()
    assert stack.procs["api"].poll() is None and not _error_lines(stack.log("api"))


def test_a_lost_jobs_output_is_streamed_from_its_log_holding_a_slot(make_stack: StackFactory) -> None:
    # A collecting job lost with its worker answers what its log holds: that body was built
    # whole from the log, with no slot taken, so 20 connections that never read 16 MiB of it
    # took the API from 84 to 591 MB. It is streamed from the log now, as a stored one is.
    from redis.asyncio import Redis

    from worker.messaging.queue import WorkerQueue

    stack = make_stack(with_worker=False, MAX_OUTPUT_WAITS="3", MAX_OUTPUT_WAITS_PER_PRINCIPAL="2", MAX_OUTPUT_KB="16384")
    api = Api(stack)
    job = api.execute(py_job("print(1)", collectOutput=True, limits={"outputKb": 16384}))
    chunk = b"b" * 8191 + b"\n"

    async def a_worker_logs_16_mib_and_dies() -> None:
        redis = Redis.from_url(stack.redis_url)
        queue = WorkerQueue(redis, "w-gone", 86400, 600)
        claim = await queue.claim(5.0, 0.0)
        assert claim is not None and claim.spec.job_id == job["jobId"]
        for at in range(0, 2048, 64):
            events = [(claim.next_seq + i, "stdout", "chunk", chunk) for i in range(at, at + 64)]
            await queue.advance(job["jobId"], claim.attempt, events, started=True)
        assert len(await queue.recover_claims("w-gone")) == 1  # lost
        await redis.aclose()

    asyncio.run(a_worker_logs_16_mib_and_dies())
    api_pid = stack.procs["api"].pid
    before = _rss_mb(api_pid)
    stalled = []
    try:
        stalled = _stalled_output_readers(stack, job, 2)
        time.sleep(1.0)
        with httpx.Client(base_url=api.url, timeout=30) as client:
            refused = client.get(f"/v1/jobs/{job['jobId']}/output", headers={"Authorization": f"Bearer {job['jobToken']}"})
            assert "waits for output" in _refusal(refused, 429)["error"]
            assert _rss_mb(api_pid) - before < 40, (before, _rss_mb(api_pid))  # (two slices, not two bodies)
            for conn in stalled:
                conn.close()
            stalled.clear()
            body = _output_once_the_slots_free(client, job).json()
            assert (body["outcome"], body["stdout"], body["stderr"]) == ("lost", (chunk * 2048).decode(), "")
    finally:
        for conn in stalled:
            conn.close()
        api.close()
    assert not _error_lines(stack.log("api"))


# ------------------------------------------------------------------ hostile bodies


DEEP = b"[" * 5000 + b"]" * 5000
DEEP_OBJECT = b'{"a":' * 5000 + b"1" + b"}" * 5000


def test_deep_json_to_channel_auth_is_403_without_token_and_400_with_one(api: Api, stack: Stack) -> None:
    before = len(stack.log("api").splitlines())
    job = api.execute(py_job("print(1)"))
    json_type = {"content-type": "application/json"}
    # 5,000 levels in 10 KB (under the 16 KiB body cap): a RecursionError for json.loads.
    for body in (DEEP, b'{"socket_id": "1.2", "x": ' + DEEP + b"}", b'{"x":{"y":' + DEEP + b"}}"):
        # No token at all: a 403 (SPEC: "403 otherwise"), whatever the body.
        response = api.client.post("/v1/channel-auth", content=body, headers=json_type)
        assert response.status_code == 403, response.text
        # A bad bearer token: 403 before the body is read.
        bad = api.client.post("/v1/channel-auth", content=body, headers={**json_type, "Authorization": "Bearer nope"})
        assert bad.status_code == 403, bad.text
        # A valid one: a 400 that names the body.
        response = api.post("/v1/channel-auth", content=body, headers=json_type)
        assert response.status_code == 400, response.text
        assert response.json()["details"][0]["field"] == "body"
        assert response.json()["error"].startswith("body is nested more than")
    # The same depth with a token in the body: no token can be read from it, so a 403.
    body = b'{"jobToken": "' + job["jobToken"].encode() + b'", "x": ' + DEEP + b"}"
    assert api.client.post("/v1/channel-auth", content=body, headers=json_type).status_code == 403
    # Modest nesting is fine, and a job token in a JSON body still works.
    body = json.dumps({"socket_id": "1.2", "channel_name": job["channel"], "jobToken": job["jobToken"], "x": [[{"y": 1}]]})
    ok = api.client.post("/v1/channel-auth", content=body.encode(), headers=json_type)
    assert ok.status_code == 200, ok.text
    # The other JSON endpoints refuse it as 400 too.
    assert api.post("/v1/execute", content=DEEP_OBJECT, headers=json_type).status_code == 400
    stdin = api.post(f"/v1/jobs/{job['jobId']}/stdin", content=DEEP_OBJECT, headers=json_type)
    assert stdin.status_code == 400, stdin.text
    _kill(api, job)
    time.sleep(0.2)
    assert not _error_lines("\n".join(stack.log("api").splitlines()[before:]))


# ------------------------------------------------------------------ slow clients

HEADER_S = 2.0
BODY_S = 3.0


def _trickle(stack: Stack, data: bytes, interval_s: float) -> tuple[float, bytes]:
    """Send `data` a byte every `interval_s`; seconds from the first byte until the server
    answered or closed, and everything it said."""
    sock = socket.create_connection((stack.api_host, stack.api_port), timeout=30)
    try:
        started = time.monotonic()
        ended = None
        for i in range(len(data)):
            try:
                sock.sendall(data[i : i + 1])
            except OSError:
                ended = time.monotonic()
                break
            readable, _, _ = select.select([sock], [], [], interval_s)
            if readable:
                ended = time.monotonic()
                break
        assert ended is not None, "the server waited for the whole trickled request"
        answer = b""
        sock.settimeout(5)
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except OSError:
            pass
        return ended - started, answer
    finally:
        sock.close()


@pytest.fixture
def slow_stack(make_stack: StackFactory) -> Stack:
    return make_stack(with_worker=False, API_HEADER_TIMEOUT_MS=str(int(HEADER_S * 1000)), API_BODY_TIMEOUT_MS=str(int(BODY_S * 1000)))


def test_slow_headers_and_bodies_are_cut_off_while_others_are_served(slow_stack: Stack) -> None:
    stack = slow_stack
    results: dict[str, tuple[float, bytes]] = {}
    head = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"a" * 100 + b"\r\n\r\n"
    body_head = (
        f"POST /v1/execute HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {stack.api_token}\r\n"
        "Content-Type: application/json\r\nContent-Length: 200\r\n\r\n{"
    ).encode()

    def headers_byte_per_second() -> None:
        results["headers"] = _trickle(stack, head, 1.0)

    def body_stalls() -> None:
        with socket.create_connection((stack.api_host, stack.api_port), timeout=30) as sock:
            sock.sendall(body_head)
            started = time.monotonic()
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
            results["body"] = (time.monotonic() - started, answer)

    def silent() -> None:
        with socket.create_connection((stack.api_host, stack.api_port), timeout=30) as sock:
            started = time.monotonic()
            answer = sock.recv(65536)
            results["silent"] = (time.monotonic() - started, answer)

    threads = [threading.Thread(target=f) for f in (headers_byte_per_second, body_stalls, silent)]
    for t in threads:
        t.start()
    # Meanwhile a normal client is served at once, again and again.
    time.sleep(0.5)
    latencies = []
    with httpx.Client(base_url=stack.api_url, timeout=5) as client:
        for _ in range(10):
            t0 = time.monotonic()
            assert client.get("/health").status_code == 200
            latencies.append(time.monotonic() - t0)
            r = client.post("/v1/execute", json={"language": "nope", "files": []}, headers={"Authorization": f"Bearer {stack.api_token}"})
            assert r.status_code == 400
            time.sleep(0.1)
    for t in threads:
        t.join(30)
    assert max(latencies) < 0.5, latencies

    elapsed, answer = results["headers"]
    assert HEADER_S - 0.1 <= elapsed <= HEADER_S + 1.5, elapsed
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"headers must arrive within 2 s" in answer
    elapsed, answer = results["body"]
    assert BODY_S - 0.1 <= elapsed <= BODY_S + 1.0, elapsed
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"body must arrive within 3 s" in answer
    elapsed, answer = results["silent"]
    assert HEADER_S - 0.1 <= elapsed <= HEADER_S + 1.0 and answer == b"", (elapsed, answer)
    print(f"measured: headers cut at {results['headers'][0]:.2f}s, body at {results['body'][0]:.2f}s, "
          f"silent connection at {results['silent'][0]:.2f}s; normal requests max {max(latencies) * 1000:.1f} ms")
    # Nothing was queued by the cut-off POST, and the handler's disconnect is no server error.
    with stack.redis() as redis:
        assert redis.llen("jobs:queue") == 0
    time.sleep(0.2)
    assert not _error_lines(stack.log("api")), stack.log("api")


def test_slow_but_steady_requests_and_long_streams_are_not_cut(slow_stack: Stack) -> None:
    stack = slow_stack
    api = Api(stack)
    try:
        # A body that arrives in pieces within the body timeout is served.
        body = json.dumps(py_job("print(1)")).encode()
        head = (
            f"POST /v1/execute HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {stack.api_token}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        with socket.create_connection((stack.api_host, stack.api_port), timeout=10) as sock:
            sock.sendall(head)
            for i in range(0, len(body), len(body) // 4 + 1):
                time.sleep(0.4)
                sock.sendall(body[i : i + len(body) // 4 + 1])
            answer = b""
            while chunk := sock.recv(65536):
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 202 "), answer
        job = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        # An event stream open longer than both timeouts keeps going (no worker here: the
        # kill of a queued job writes its result).
        client = httpx.Client(base_url=api.url, timeout=30)
        stream = _open_stream(client, job, job["jobToken"])
        assert stream.status_code == 200
        time.sleep(HEADER_S + BODY_S + 0.5)
        _kill(api, job)
        assert _events_until_result(stream)[-1][1]["outcome"] == "killed"
        stream.close()
        # Keep-alive connections serve request after request past the header timeout.
        with httpx.Client(base_url=stack.api_url, timeout=5) as keep:
            for _ in range(3):
                assert keep.get("/health").status_code == 200
                time.sleep(HEADER_S / 2)
            assert keep.get("/health").status_code == 200
        # Oversized request heads are refused outright (exactly one byte over the cap, so the
        # server has read everything when it answers, and the close is clean).
        start = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: "
        status, raw = _raw_request(stack, start + b"a" * (MAX_HEAD_BYTES + 1 - len(start)))
        assert status == 431, raw
        # So is a whole head sent in one write (parsed inside one read, where the read's own
        # count never saw it): many headers, together just over the cap (a little over, so
        # the server has read it all when it answers; then the close is clean).
        many = b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 1000) for i in range(66))
        status, raw = _raw_request(stack, b"GET /health HTTP/1.1\r\nHost: t\r\n" + many + b"\r\n")
        assert status == 431, raw
        client.close()
    finally:
        api.close()
    assert not _error_lines(stack.log("api")), stack.log("api")


@pytest.mark.stack
def test_a_wait_for_output_whose_client_left_gives_its_slot_back(make_stack: StackFactory) -> None:
    # A grader whose HTTP timeout is shorter than its waitMs gives up and asks again. The
    # waits it left must not go on holding its slots (and Redis connections) to waitMs.
    stack = make_stack(with_worker=False, MAX_OUTPUT_WAITS_PER_PRINCIPAL="2")
    api = Api(stack)
    job = api.execute(py_job("print(1)", collectOutput=True))
    path = f"/v1/jobs/{job['jobId']}/output"
    try:
        for _ in range(4):
            with httpx.Client(base_url=api.url, timeout=0.3) as impatient, pytest.raises(httpx.ReadTimeout):
                impatient.get(path, params={"waitMs": "60000"}, headers=api.headers())
        time.sleep(0.3)
        started = time.monotonic()
        answer = api.get(path, params={"waitMs": "1000"})
        assert answer.status_code == 404, answer.text  # waited its second, then nothing yet
        assert time.monotonic() - started >= 0.9
        # A job that does not collect output has nothing to wait for: 404 at once.
        plain = api.execute(py_job("print(1)"))
        started = time.monotonic()
        assert api.get(f"/v1/jobs/{plain['jobId']}/output", params={"waitMs": "5000"}).status_code == 404
        assert time.monotonic() - started < 0.5
    finally:
        api.close()


def test_output_has_one_uniform_404(make_stack: StackFactory) -> None:
    # The same bytes whether the job collects nothing, is unknown, or is another caller's:
    # job ids cannot be probed through /output.
    stack = make_stack(with_worker=False)
    api = Api(stack)
    try:
        plain = api.execute(py_job("print(1)"))
        not_collected = api.get(f"/v1/jobs/{plain['jobId']}/output")
        unknown = api.get(f"/v1/jobs/{'0' * 32}/output")
        other = api.get(f"/v1/jobs/{plain['jobId']}/output", token=api.execute(py_job("print(2)"))["jobToken"])
        assert not_collected.status_code == unknown.status_code == other.status_code == 404
        assert unknown.content == other.content == not_collected.content
    finally:
        api.close()


def test_a_pipelined_request_after_a_large_body_is_not_taken_for_a_large_head(make_stack: StackFactory) -> None:
    # One write holds a POST with a 400 KB body and the next request: the head guard
    # counted the whole read, body included, against the second request's head (431, and
    # the POST's own answer lost).
    stack = make_stack(with_worker=False)
    body = json.dumps(py_job("x = 1\n" + "#" * 400_000)).encode()
    post = (
        f"POST /v1/execute HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {stack.api_token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    get = b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    with socket.create_connection((stack.api_host, stack.api_port), timeout=10) as sock:
        sock.sendall(post + get[:20])  # the next head starts in the same read as the body ends
        time.sleep(0.3)
        sock.sendall(get[20:])
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)
    assert statuses == [b"202", b"200"], answer[:400]


def test_a_connection_pipelining_thousands_of_requests_is_closed_and_stalls_no_one(make_stack: StackFactory) -> None:
    # Every parsed request rescanned the connection's unanswered ones: 2 MiB of pipelined
    # GET /health (some 64,000) froze the API's loop for over a minute and took ~160 MB.
    stack = make_stack(with_worker=False)
    flood = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" * (2 * 1024 * 1024 // 33)
    answers: list[bytes] = []

    def send_and_drain(sock: socket.socket) -> None:
        def drain() -> None:
            try:
                while chunk := sock.recv(65536):
                    answers.append(chunk)
            except OSError:
                pass

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        try:
            sock.sendall(flood)
        except OSError:
            pass  # closed on us: what is expected
        reader.join(30)

    sock = socket.create_connection((stack.api_host, stack.api_port), timeout=30)
    flooder = threading.Thread(target=send_and_drain, args=(sock,), daemon=True)
    slowest = 0.0
    with httpx.Client(base_url=stack.api_url, timeout=30) as client:
        client.get("/health")
        flooder.start()
        began = time.monotonic()
        while flooder.is_alive() and time.monotonic() - began < 30:
            asked = time.monotonic()
            assert client.get("/health").status_code == 200
            slowest = max(slowest, time.monotonic() - asked)
            time.sleep(0.1)
    sock.close()
    assert not flooder.is_alive(), "the flooding connection was never closed"
    assert slowest < 0.5, slowest
    # Closed once past the bound: never more answers than that.
    assert b"".join(answers).count(b"HTTP/1.1 200") <= MAX_PIPELINED + 1


@pytest.mark.sandbox
def test_a_reader_that_stops_reading_is_dropped_and_frees_its_stream_slot(make_stack: StackFactory) -> None:
    # A job with 12 MB in its log; one event stream per job. A client opens the stream and
    # never reads past the first bytes: once the socket and the transport are full, the API
    # drops it after API_SEND_TIMEOUT_MS, and the job's stream slot is free again.
    stack = make_stack(API_SEND_TIMEOUT_MS="2000", MAX_EVENT_STREAMS_PER_JOB="1")
    api = Api(stack)
    code = "import sys\nfor i in range(1500):\n    sys.stdout.write('x' * 8000 + '\\n')\n"
    job = api.execute(py_job(code, limits={"outputKb": 16000}))
    api.start(job)
    assert api.wait_state(job, {"done"})["result"]["outcome"] == "completed"
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        stalled.connect((stack.api_host, stack.api_port))
        stalled.sendall(
            f"GET /v1/jobs/{job['jobId']}/events HTTP/1.1\r\nHost: t\r\n"
            f"Authorization: Bearer {stack.api_token}\r\n\r\n".encode()
        )
        assert stalled.recv(16).startswith(b"HTTP/1.1 200")
        time.sleep(0.5)
        with httpx.Client(base_url=stack.api_url, timeout=10) as client:
            response = _open_stream(client, job, stack.api_token)
            _refusal(response, 429)  # the stalled reader holds the job's one slot
            started = time.monotonic()
            while True:
                response = _open_stream(client, job, stack.api_token)
                if response.status_code == 200:
                    response.close()
                    break
                response.close()
                assert time.monotonic() - started < 15, "the stalled reader was never dropped"
                time.sleep(0.25)
        print(f"measured: the stalled stream's slot was free {time.monotonic() - started + 0.5:.1f} s after it stopped reading")
        assert "took none of its response for 2.0 s" in stack.log("api")
    finally:
        stalled.close()
        api.close()


def test_readiness_follows_redis_and_liveness_does_not(make_stack: StackFactory) -> None:
    # An instance that cannot reach Redis (a partition, a rotated password) answered every
    # health check 200 and stayed in the balancer, answering 503s after its retries.
    stack = make_stack(with_worker=False)
    with httpx.Client(base_url=stack.api_url, timeout=10) as client:
        assert client.get("/ready").json() == {"status": "ready"}
        stack.stop_process("redis")
        started = time.monotonic()
        answer = client.get("/ready")
        assert answer.status_code == 503 and "Redis" in answer.json()["error"], answer.text
        assert time.monotonic() - started < 3
        assert client.get("/health").json() == {"status": "ok"}


def test_a_full_redis_is_a_503_that_says_so(make_stack: StackFactory) -> None:
    """At its maxmemory Redis refuses writes until results expire: the execute says the
    service's storage is full (not a blip), and works again once there is room."""
    stack = make_stack(with_worker=False)
    with Api(stack) as api, stack.redis() as redis:
        redis.config_set("maxmemory", "1")
        try:
            refused = api.post("/v1/execute", json=py_job("print(1)"))
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"] == "The service's storage is full; retry later"
            assert refused.json()["retryAfterMs"] == 5000
        finally:
            redis.config_set("maxmemory", "0")
        assert api.post("/v1/execute", json=py_job("print(1)")).status_code == 202


def _big_execute_head(stack: Stack, length: int) -> bytes:
    return (
        f"POST /v1/execute HTTP/1.1\r\nHost: {stack.api_host}\r\nAuthorization: Bearer {stack.api_token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def _reply(sock: socket.socket) -> tuple[int, bytes]:
    """One HTTP response on `sock`: its status and body (by its Content-Length)."""
    answer = b""
    while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
        answer += chunk
    head, body = answer.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?im)^content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length and (chunk := sock.recv(65536)):
        body += chunk
    return int(head.split(b" ", 2)[1]), body


def test_big_bodies_in_flight_are_bounded_small_ones_always_get_in(make_stack: StackFactory) -> None:
    """MAX_BODIES_IN_FLIGHT_MB: a client trickling many big executes at once cannot make the
    API hold their bodies without bound; the next big one is a 503, small ones still pass."""
    stack = make_stack(with_worker=False, MAX_REQUEST_BYTES=str(1 << 20), MAX_BODIES_IN_FLIGHT_MB="2")
    body = json.dumps(py_job("print(1)", files=[
        {"name": "main.py", "content": "print(1)"}, {"name": "d.txt", "content": "q" * 900_000},
    ])).encode()  # fmt: skip
    with Api(stack) as api:
        job = api.execute(py_job("print(input())"))
    held = [socket.create_connection((stack.api_host, stack.api_port), timeout=30) for _ in range(2)]
    try:
        for sock in held:  # two bodies of 0.9 MB under way: the 2 MiB budget is (nearly) spent
            sock.sendall(_big_execute_head(stack, len(body)) + body[:1000])
        time.sleep(0.3)
        with socket.create_connection((stack.api_host, stack.api_port), timeout=10) as third:
            third.sendall(_big_execute_head(stack, len(body)))
            status, answer = _reply(third)
        assert status == 503, answer
        refused = json.loads(answer)
        assert refused["error"] == "Too many large requests are being received at once; retry shortly"
        assert refused["retryAfterMs"] == 1000
        # A big stdin frame counts too: a job token's holder (a browser) could otherwise make
        # the API hold any number of them.
        frame = json.dumps({"chunk": "x" * 400_000}).encode()
        with socket.create_connection((stack.api_host, stack.api_port), timeout=10) as stdin:
            stdin.sendall(
                f"POST /v1/jobs/{job['jobId']}/stdin HTTP/1.1\r\nHost: {stack.api_host}\r\n"
                f"Authorization: Bearer {job['jobToken']}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(frame)}\r\n\r\n".encode()
            )
            status, answer = _reply(stdin)
        assert status == 503 and json.loads(answer)["retryAfterMs"] == 1000, answer
        # A client that sends its whole body before it reads (most do) gets that same 503,
        # and only it: the rest of the body is dropped, not taken for the next request's
        # head (which once got it a stray 431 and a closed connection), and the connection
        # serves its next request.
        with socket.create_connection((stack.api_host, stack.api_port), timeout=10) as eager:
            eager.sendall(_big_execute_head(stack, len(body)) + body)
            status, answer = _reply(eager)
            assert status == 503 and json.loads(answer)["retryAfterMs"] == 1000, answer
            eager.sendall(f"GET /health HTTP/1.1\r\nHost: {stack.api_host}\r\n\r\n".encode())
            status, answer = _reply(eager)
            assert status == 200, answer
        with Api(stack) as api:
            assert api.post("/v1/execute", json=py_job("print('small')")).status_code == 202
            for sock in held:  # the two finish, and are queued
                sock.sendall(body[1000:])
                status, answer = _reply(sock)
                assert status == 202, answer
            # Their bytes are let go with their answers: a big one gets in again.
            assert api.post("/v1/execute", content=body, headers={"Content-Type": "application/json"}).status_code == 202
    finally:
        for sock in held:
            sock.close()
    with pytest.raises(ConfigError, match="MAX_BODIES_IN_FLIGHT_MB"):
        load_settings({"PUSHER_SECRET": "x", "MAX_BODIES_IN_FLIGHT_MB": "8"})  # under one MAX_REQUEST_BYTES


def _rss_mb(pid: int, which: str = "VmRSS:") -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(which)) / 1024


def _answered(sock: socket.socket, wait_s: float) -> bool:
    return bool(select.select([sock], [], [], wait_s)[0])


def _connect_sending(stack: Stack, data: bytes, into: list[socket.socket], count: int, pause_s: float = 0.0) -> None:
    """`count` connections to the API, each sent `data` (a request's start) and added to `into`
    (the caller closes them)."""
    for _ in range(count):
        sock = socket.create_connection((stack.api_host, stack.api_port), timeout=10)
        sock.sendall(data)
        into.append(sock)
        time.sleep(pause_s)


def test_arrays_past_their_caps_are_refused_before_they_are_built(api: Api) -> None:
    """A 16 MiB execute of 5.6 million empty test cases: msgspec checks an array's length
    only once every element is built, so the API made 5.6 million cases (785 MB, about 3 s
    of its event loop) before their cap refused them. The caps are checked first now."""
    pid = api.stack.procs["api"].pid
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # (its peak is its size now)
    before = _rss_mb(pid)
    many = (16 * 1024 * 1024 - 200) // 3
    head = b'{"language": "python", "files": [{"name": "main.py", "content": "print(1)"}], '
    for body, field in (
        (head + b'"tests": [' + b",".join([b"{}"] * many) + b"]}", "tests"),
        (b'{"language": "python", "files": [' + b",".join([b'{"name": ""}'] * (many // 5)) + b"]}", "files"),
        (head + b'"tests": [{}, {"args": [' + b",".join([b'""'] * (many // 2)) + b"]}]}", "tests[1].args"),
    ):
        response = api.post("/v1/execute", content=body, headers={"Content-Type": "application/json"})
        assert response.status_code == 400 and response.json()["details"][0]["field"] == field, response.text[:300]
    grown = _rss_mb(pid, "VmHWM:") - before  # (at its peak: what was built is freed again)
    assert grown < 150, f"the API grew {grown:.0f} MB refusing them"


def test_bodies_trickled_in_over_many_connections_hold_bounded_memory(make_stack: StackFactory) -> None:
    """Small bodies (up to 256 KiB) trickled in over hundreds of connections: refused ones
    (a 401 on the head) let go of what uvicorn had buffered of them, and accepted ones count
    against MAX_SMALL_BODIES_IN_FLIGHT_MB, past which the next is a 503. (Before, 9,000
    connections each sending 64 KiB took the API from 48 MB to about 800.)"""
    stack = make_stack(with_worker=False, MAX_SMALL_BODIES_IN_FLIGHT_MB="1")
    part = b'{"language": "python", "files": [{"name": "main.py", "content": "' + b"a" * 60_000
    anonymous = (
        f"POST /v1/execute HTTP/1.1\r\nHost: {stack.api_host}\r\nContent-Type: application/json\r\n"
        "Content-Length: 200000\r\n\r\n"
    ).encode()
    pid = stack.procs["api"].pid
    before = _rss_mb(pid)
    socks: list[socket.socket] = []
    try:
        _connect_sending(stack, anonymous + part, socks, 600)
        time.sleep(1.5)
        grown = _rss_mb(pid) - before
        assert all(_reply(sock)[0] == 401 for sock in socks[:5])
        # 600 x 60 kB is 36 MB; what stays is the connections' own state.
        assert grown < 15, f"the API grew {grown:.1f} MB holding 600 refused bodies"
    finally:
        for sock in socks:
            sock.close()
    held: list[socket.socket] = []
    try:
        _connect_sending(stack, _big_execute_head(stack, 200_000) + part, held, 24, pause_s=0.02)  # (about 17 fill the pool)
        refused = [sock for sock in held if _answered(sock, 0.3)]
        assert 5 <= len(refused) <= 9, f"{len(refused)} of 24 refused"
        status, answer = _reply(refused[0])
        assert status == 503 and json.loads(answer) == {
            "error": "Too many requests are being received at once; retry shortly",
            "details": [],
            "retryAfterMs": 1000,
        }, answer
        # The rest are still being received, unanswered.
        assert not any(_answered(sock, 0) for sock in held if sock not in refused)
    finally:
        for sock in held:
            sock.close()
    time.sleep(0.3)
    # Their bytes were let go with their connections.
    with Api(stack) as api:
        job = py_job("print(1)", files=[{"name": "main.py", "content": "print(1)"}, {"name": "d.txt", "content": "q" * 200_000}])
        assert api.post("/v1/execute", json=job).status_code == 202


def test_connections_past_the_cap_are_answered_503_unread_and_the_cap_frees_up(make_stack: StackFactory) -> None:
    """API_MAX_CONNECTIONS: a client opening connections without end gets a 503 on each past
    the cap, read no further, and the server takes new ones again as old ones close."""
    stack = make_stack(
        with_worker=False, API_MAX_CONNECTIONS="40", MAX_EVENT_STREAMS="8", MAX_EVENT_STREAMS_PER_PRINCIPAL="4",
        MAX_OUTPUT_WAITS="8", MAX_OUTPUT_WAITS_PER_PRINCIPAL="4",
    )  # fmt: skip
    idle = [socket.create_connection((stack.api_host, stack.api_port), timeout=10) for _ in range(40)]
    try:
        time.sleep(0.3)
        with socket.create_connection((stack.api_host, stack.api_port), timeout=5) as extra:
            extra.sendall(f"GET /health HTTP/1.1\r\nHost: {stack.api_host}\r\n\r\n".encode())
            status, answer = _reply(extra)
            assert status == 503, answer
            assert json.loads(answer)["error"] == "This server has too many open connections; retry shortly"
            try:
                assert extra.recv(100) == b""  # closed
            except ConnectionResetError:
                pass  # (closed, with the request it sent unread)
        for sock in idle[:10]:
            sock.close()
        time.sleep(0.3)
        assert httpx.get(f"{stack.api_url}/health", timeout=5).status_code == 200
    finally:
        for sock in idle:
            sock.close()
    assert "past API_MAX_CONNECTIONS" in stack.log("api")
    with pytest.raises(ConfigError, match="API_MAX_CONNECTIONS"):
        load_settings({"PUSHER_SECRET": "x", "API_MAX_CONNECTIONS": "500"})  # under 256 streams + 256 waits


def test_the_api_raises_its_open_files_limit_to_what_its_caps_hold() -> None:
    """Review: under Debian's usual soft limit of 1024 open files, API_MAX_CONNECTIONS (2048
    by default) was never reached: accept() failed first, before the cap's 503 could be sent.
    The API raises its soft limit to the caps' need at start, and refuses to start when the
    hard limit is below it."""
    import resource
    import subprocess
    import sys

    from shared.paths import REPO_ROOT

    probe = (
        "import resource\nfrom api.__main__ import raise_open_files\nfrom shared.settings import load_settings\n"
        "print(raise_open_files(load_settings({})), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )

    def run(soft: int, hard: int, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)),
        )  # fmt: skip

    needed = 2048 + 256 + 256 + 256
    raised = run(1024, 4096, "-c", probe)
    assert raised.returncode == 0 and raised.stdout.split() == [str(needed)] * 2, raised.stderr
    kept = run(8192, 8192, "-c", probe)
    assert kept.stdout.split() == ["8192", "8192"], kept.stderr
    refused = run(1024, 2048, "-m", "api", "--port", "1")
    assert refused.returncode == 2, refused.stderr
    assert f"need {needed} open files, but this process may open at most 2048 (ulimit -Hn)" in refused.stderr
    assert "API_MAX_CONNECTIONS (2048)" in refused.stderr


def test_a_bad_language_manifest_stops_the_api_with_one_line_not_a_traceback(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from shared.paths import REPO_ROOT

    (tmp_path / "languages").mkdir()
    env = {
        **os.environ, "SANDBOX_PROFILES_DIR": str(tmp_path),
        "EXECUTOR_API_TOKEN": "t" * 32, "PUSHER_SECRET": "s" * 32, "PUSHER_KEY": "key",
    }  # fmt: skip
    for content in (b'language = "x"\nrun = [', b"\xff\xfe not text"):
        (tmp_path / "languages" / "bad.toml").write_bytes(content)
        refused = subprocess.run(
            [sys.executable, "-m", "api", "--port", "1"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
        )
        assert refused.returncode == 2 and "Traceback" not in refused.stderr, refused.stderr
        assert refused.stderr.startswith("coderunner api: ") and "bad.toml" in refused.stderr, refused.stderr


def test_a_request_pipelined_behind_an_event_stream_ends_both_cleanly(slow_stack: Stack) -> None:
    # An event stream, then on the same connection a request whose body never comes. Its
    # body timeout closes the connection: the stream's handler must hear of it (and give its
    # slot back), and no 408 may land inside the stream's body.
    stack = slow_stack
    api = Api(stack)
    job = api.execute(py_job("print(1)"))  # no worker: it stays queued, its stream stays open
    sock = socket.create_connection((stack.api_host, stack.api_port), timeout=BODY_S + 10)
    try:
        sock.sendall(
            f"GET /v1/jobs/{job['jobId']}/events HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {stack.api_token}\r\n\r\n"
            f"POST /v1/jobs/{job['jobId']}/stdin HTTP/1.1\r\nHost: t\r\nAuthorization: Bearer {stack.api_token}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode()
        )
        said = b""
        while chunk := sock.recv(65536):
            said += chunk
        assert said.startswith(b"HTTP/1.1 200") and said.count(b"HTTP/1.1 ") == 1, said
        with httpx.Client(base_url=stack.api_url, timeout=10) as client:
            deadline = time.monotonic() + 5
            while (open_now := _gauge(client, "coderunner_api_event_streams")) != 0 and time.monotonic() < deadline:
                time.sleep(0.1)
        assert open_now == 0, "the stream's handler never heard its client was gone"
    finally:
        sock.close()
        api.close()


@pytest.mark.parametrize("second", ["oversized", "malformed"])
def test_a_bad_head_pipelined_behind_a_request_still_waiting_is_not_sent_as_its_answer(
    slow_stack: Stack, second: str
) -> None:
    """A long-poll whose answer has not started, then on the same connection a second
    request whose head is refused (too big: 431; not HTTP: 400). Responses go in request
    order, so that error would be read as the long-poll's answer (for an execute: a refusal
    of a job that was queued all the same). The connection closes with no answer instead."""
    stack = slow_stack
    api = Api(stack)
    job = api.execute(py_job("print(1)", collectOutput=True))  # no worker: it stays queued
    bad = (
        b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (MAX_HEAD_BYTES + 10) + b"\r\n\r\n"
        if second == "oversized"
        else b"NOT HTTP AT ALL\r\n\r\n"
    )
    sock = socket.create_connection((stack.api_host, stack.api_port), timeout=15)
    try:
        sock.sendall(
            f"GET /v1/jobs/{job['jobId']}/output?waitMs=3000 HTTP/1.1\r\nHost: t\r\n"
            f"Authorization: Bearer {stack.api_token}\r\n\r\n".encode()
        )
        time.sleep(0.3)  # (its handler is waiting)
        with contextlib.suppress(OSError):
            sock.sendall(bad)
        said = b""
        with contextlib.suppress(OSError):
            while chunk := sock.recv(65536):
                said += chunk
        assert not said.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400")), said[:200]
    finally:
        sock.close()
        api.close()


def _gauge(client: httpx.Client, name: str) -> int:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return int(float(line.split()[1]))
    raise AssertionError(f"no {name} in /metrics")


def test_job_tokens_and_unsigned_bodies_cannot_take_the_body_pools_from_the_api_token(make_stack: StackFactory) -> None:
    """A red team: a browser's job token trickling stdin frames over a few hundred connections
    held the whole small-body pool (every execute a 503), its request heads alone (declaring
    512 KiB each) the whole big one, and unsigned webhook bodies (read before the signature
    can be checked) the small one again, with no token at all. Each now counts against a
    share of the pool (all job tokens half of it, one a sixteenth, bodies read before any
    token a sixteenth; each share at least one body of its route's largest size)."""
    stack = make_stack(
        with_worker=False, MAX_SMALL_BODIES_IN_FLIGHT_MB="4", MAX_BODIES_IN_FLIGHT_MB="8", MAX_REQUEST_BYTES=str(1 << 20)
    )
    with Api(stack) as api:
        jobs = [api.execute(py_job("print(input())")) for _ in range(10)]
    job = jobs[0]

    def head(path: str, length: int, token: str | None) -> bytes:
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        return (
            f"POST {path} HTTP/1.1\r\nHost: {stack.api_host}\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n"
        ).encode()

    def stdin(job: dict[str, str], length: int) -> bytes:
        return head(f"/v1/jobs/{job['jobId']}/stdin", length, job["jobToken"])

    frame = b'{"data":"' + b"a" * 150_000
    # Each: what 40 connections send (their requests' starts), and how many at least are refused.
    attacks = {
        "stdin trickled by a job token": ([stdin(job, 200_000) + frame] * 40, 30),
        # (Ten tokens, four connections each: each token's share lets three in, 4.5 MB in all,
        # past the 4 MiB pool; all job tokens' half of it refuses the rest.)
        "stdin trickled by ten job tokens": ([stdin(each, 200_000) + frame for each in jobs for _ in range(4)], 25),
        "unsigned webhooks": ([head("/v1/realtime/webhooks", 200_000, None) + b'{"events":[' + b" " * 150_000] * 40, 30),
        "a job token's big heads": ([stdin(job, 500_000)] * 40, 30),
    }
    small = json.dumps(py_job("print(1)", files=[{"name": "main.py", "content": "print(1)"}, {"name": "d.txt", "content": "q" * 150_000}]))
    big = json.dumps(py_job("print(1)", files=[{"name": "main.py", "content": "print(1)"}, {"name": "d.txt", "content": "q" * 900_000}]))
    for what, (starts, least) in attacks.items():
        held: list[socket.socket] = []
        try:
            for start in starts:
                _connect_sending(stack, start, held, 1)
            time.sleep(0.5)
            with Api(stack) as api:  # (the API token's executes, small and big, get in)
                for body in (small, big):
                    answer = api.post("/v1/execute", content=body, headers={"Content-Type": "application/json"})
                    assert answer.status_code == 202, (what, answer.text)
            refused = [sock for sock in held if _answered(sock, 0)]
            assert len(refused) >= least, f"{what}: only {len(refused)} of 40 refused"
            assert all(_reply(sock)[0] == 503 for sock in refused[:3])
        finally:
            for sock in held:
                sock.close()
        time.sleep(0.3)
