"""The IDE loop on real parts: stdin frames, EOF, kill in every phase, job tokens, /status.

Every stdin frame that got a 200 must reach the program once, in order, byte-exact; every
kill must end in exactly one result, with nothing of the job left running.
"""

from __future__ import annotations

import base64
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from launcher.stack import Stack
from tests.conftest import StackFactory
from tests.helpers import Api, Followed, Realtime, py_job

pytestmark = [pytest.mark.stack, pytest.mark.sandbox]

ECHO = """
import sys
while True:
    line = sys.stdin.readline()
    if not line:
        break
    sys.stdout.write("echo:" + line)
    sys.stdout.flush()
print("eof")
"""


def stdin(api: Api, job: dict[str, Any], chunk: str | None = None, data: bytes | None = None, token: str | None = None):  # type: ignore[no-untyped-def]
    body: dict[str, Any] = {"chunk": chunk} if data is None else {"data": base64.b64encode(data).decode(), "encoding": "base64"}
    return api.post(f"/v1/jobs/{job['jobId']}/stdin", token=token or job["jobToken"], json=body)


def close(api: Api, job: dict[str, Any], token: str | None = None):  # type: ignore[no-untyped-def]
    return api.post(f"/v1/jobs/{job['jobId']}/stdin/close", token=token or job["jobToken"])


def kill(api: Api, job: dict[str, Any], token: str | None = None):  # type: ignore[no-untyped-def]
    return api.post(f"/v1/jobs/{job['jobId']}/kill", token=token or job["jobToken"])


def wait_for_text(followed: Followed, stream: str, text: str, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in followed.text(stream):
        assert time.monotonic() < deadline, f"{text!r} never appeared; got {followed.text(stream)!r}"
        time.sleep(0.01)


def wait_for_event(followed: Followed, name: str, payload: dict[str, Any], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(n == name and all(p.get(k) == v for k, v in payload.items()) for n, p in list(followed.events)):
        assert time.monotonic() < deadline, f"no {name} {payload}; got {followed.events}"
        time.sleep(0.01)


def assert_one_result_no_gaps(api: Api, job: dict[str, Any], followed: Followed) -> dict[str, Any]:
    time.sleep(0.3)  # a second result, if one existed, would arrive in this window
    results = followed.results()
    assert len(results) == 1, followed.events
    log = api.replay(job)
    assert [name for name, _ in log].count("result") == 1
    assert [p["seq"] for _, p in log] == list(range(len(log)))
    assert sorted(followed.events, key=lambda e: e[1]["seq"]) == log
    return results[0]


def marked_processes(mark: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if mark in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


# ------------------------------------------------------------------------ stdin


def test_stdin_lines_reach_the_program_in_order_once_and_eof_ends_it(api: Api, realtime: Realtime) -> None:
    job = api.execute(py_job(ECHO))
    followed = realtime.follow(job)
    api.start(job)
    lines = [f"line {i} ✓\n" for i in range(20)]
    for line in lines:
        assert stdin(api, job, line).json() == {"ok": True}
        time.sleep(0.04)  # stay under 30 frames/s
    wait_for_text(followed, "stdout", "echo:line 19 ✓\n")
    assert close(api, job).json() == {"ok": True}
    result = followed.wait_result()
    assert result["outcome"] == "completed" and result["exitCode"] == 0
    assert followed.text("stdout") == "".join("echo:" + line for line in lines) + "eof\n"
    assert_one_result_no_gaps(api, job, followed)
    # The job has ended: no more input, a clear 409.
    late = stdin(api, job, "too late\n")
    assert late.status_code == 409 and "ended" in late.json()["error"]


def test_a_stdin_retry_with_its_idempotency_key_stores_nothing_twice(api: Api, realtime: Realtime) -> None:
    # A browser whose answer was lost sends the frame again: with the same Idempotency-Key
    # and bytes it is the same frame; without a key, or with other bytes, it is another.
    job = api.execute(py_job(ECHO))
    followed = realtime.follow(job)
    url = f"/v1/jobs/{job['jobId']}/stdin"

    def send(chunk: str, key: str | None) -> None:
        headers = {"Idempotency-Key": key} if key else {}
        assert api.post(url, token=job["jobToken"], json={"chunk": chunk}, headers=headers).json() == {"ok": True}

    api.start(job)
    send("once\n", "frame-1")
    send("once\n", "frame-1")  # the retry
    send("twice\n", None)
    send("twice\n", None)  # no key: a frame of its own
    send("other\n", "frame-1")  # the key reused for other bytes: another frame
    for _ in range(2):
        closed = api.post(f"{url}/close", token=job["jobToken"], headers={"Idempotency-Key": "eof"})
        assert closed.json() == {"ok": True}, closed.text  # (the retry too: not "already closed")
    followed.wait_result()
    assert followed.text("stdout") == "echo:once\necho:twice\necho:twice\necho:other\neof\n"
    bad = api.post(url, token=job["jobToken"], json={"chunk": "x"}, headers={"Idempotency-Key": "has space"})
    assert bad.status_code == 400 and bad.json()["details"][0]["field"] == "Idempotency-Key", bad.text


def test_binary_stdin_is_byte_exact(api: Api, realtime: Realtime) -> None:
    job = api.execute(py_job("import sys\nsys.stdout.buffer.write(sys.stdin.buffer.read())\n", collectOutput=True))
    followed = realtime.follow(job)
    payload = bytes(range(256)) * 3
    assert stdin(api, job, data=payload[:300]).status_code == 200
    api.start(job)
    assert stdin(api, job, data=payload[300:]).status_code == 200
    assert close(api, job).status_code == 200
    followed.wait_result()
    out = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "5000"}).json()
    assert out["stdoutEncoding"] == "base64"
    assert base64.b64decode(out["stdout"]) == payload


def test_stdin_sent_before_start_follows_the_upfront_stdin(api: Api, realtime: Realtime) -> None:
    job = api.execute(py_job(ECHO, stdin="first\n", closeStdin=False))
    followed = realtime.follow(job)
    assert stdin(api, job, "second\n").status_code == 200
    assert stdin(api, job, "third\n").status_code == 200
    api.start(job)
    wait_for_text(followed, "stdout", "echo:third\n")
    close(api, job)
    followed.wait_result()
    assert followed.text("stdout") == "echo:first\necho:second\necho:third\neof\n"


def test_upfront_stdin_ends_with_eof_unless_asked_to_stay_open(api: Api, realtime: Realtime) -> None:
    job = api.execute(py_job("import sys\nprint(repr(sys.stdin.read()))\n", stdin="all of it"))
    followed = realtime.follow(job)
    # The input ends with the job's own: more can never reach the program, so it is refused.
    more = stdin(api, job, "more")
    assert more.status_code == 409 and "closed" in more.json()["error"], more.text
    assert close(api, job).status_code == 409
    api.start(job)
    assert followed.wait_result()["outcome"] == "completed"
    assert followed.text("stdout") == "'all of it'\n"
    explicit = api.execute(py_job("print(1)\n", closeStdin=True))  # EOF at once, no input given
    assert stdin(api, explicit, "x").status_code == 409
    kill(api, explicit)


def test_stdin_caps_answer_429_with_the_seed_fields(api: Api, realtime: Realtime) -> None:
    # Frame rate: a parked job takes 30 frames in a second, then says when to retry.
    job = api.execute(py_job(ECHO))
    codes = [stdin(api, job, "x\n") for _ in range(31)]
    assert [r.status_code for r in codes[:30]] == [200] * 30
    refused = codes[30]
    assert refused.status_code == 429, refused.text
    body = refused.json()
    assert 0 < body["retryAfterMs"] <= 1000 and body["error"] and "details" in body
    assert int(refused.headers["retry-after"]) >= 1
    kill(api, job)

    # Pending bytes: 64 KiB may wait for the program; one byte more may not.
    job = api.execute(py_job("import sys\nprint(len(sys.stdin.buffer.read()))\n"))
    followed = realtime.follow(job)
    block = b"a" * 32768
    assert stdin(api, job, data=block).status_code == 200
    assert stdin(api, job, data=block).status_code == 200
    over = stdin(api, job, "b")
    assert over.status_code == 429, over.text
    assert over.json()["capBytes"] == 65536
    # One frame larger than may ever wait: the seed product's 429 with the cap to split by
    # (its clients split on it), naming the field; no retry of it as it is could succeed.
    for frame in ({"data": block * 2 + b"c"}, {"chunk": "c" * 65537}):
        whole = stdin(api, job, **frame)  # type: ignore[arg-type]
        assert whole.status_code == 429, whole.text
        assert whole.json()["details"][0]["field"] == next(iter(frame)) and whole.json()["capBytes"] == 65536
        assert "retryAfterMs" not in whole.json() and "retry-after" not in whole.headers
    # Past what a stdin body may hold at all (512 KiB): the same answer.
    whole = stdin(api, job, chunk="c" * 600_000)
    assert whole.status_code == 429 and whole.json()["capBytes"] == 65536, whole.text
    assert whole.json()["details"][0]["field"] == "body" and "65536" in whole.json()["error"]
    # Bytes sent along with a close would be dropped: refused, and nothing is closed.
    refused = api.post(f"/v1/jobs/{job['jobId']}/stdin/close", token=job["jobToken"], json={"chunk": "last line\n"})
    assert refused.status_code == 400 and refused.json()["details"][0]["field"] == "chunk", refused.text
    # So would bytes in a body that cannot be read as an object (fuzzing: each was a 200).
    for body in (b'{"chunk": "x"} junk', b'[{"chunk": "x"}]', b'{"pad": ' + b"[" * 5000 + b"]" * 5000 + b', "chunk": "x"}'):
        refused = api.post(f"/v1/jobs/{job['jobId']}/stdin/close", token=job["jobToken"], content=body)
        assert refused.status_code == 400 and refused.json()["details"][0]["field"] == "body", refused.text
    # Once the program reads, the bytes are written and the cap frees up.
    api.start(job)
    deadline = time.monotonic() + 10
    while (r := stdin(api, job, "b")).status_code == 429:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.05)
    assert r.status_code == 200
    # A close with a placeholder body (no input in it) closes as one with none.
    closed = api.post(f"/v1/jobs/{job['jobId']}/stdin/close", token=job["jobToken"], json={"eof": True, "chunk": ""})
    assert closed.status_code == 200, closed.text
    followed.wait_result()
    assert followed.text("stdout") == "65537\n"


def test_stdin_a_program_does_not_read_stops_near_the_cap(api: Api, realtime: Realtime) -> None:
    # The cap counts what the worker has not written; what it has written sits in the
    # program's stdin pipe, which holds 16 KiB: about 80 KiB in all gets in, not 192.
    job = api.execute(py_job("import sys, time\ntime.sleep(20)\nprint(len(sys.stdin.buffer.read()))\n"))
    followed = realtime.follow(job)
    api.start(job)
    accepted, refused = 0, 0
    while refused < 3 and accepted < 64 * 8192:
        r = stdin(api, job, data=b"q" * 8192)
        if r.status_code == 200:
            accepted, refused = accepted + 8192, 0
        else:
            assert r.status_code == 429, r.text
            refused += 1
            time.sleep(0.3)  # (time for the worker to write what it can)
        time.sleep(0.04)  # (under the frame rate)
    assert 65536 <= accepted <= 65536 + 16384, accepted
    kill(api, job)
    followed.wait_result()


def test_input_the_program_has_read_does_not_pile_up_in_redis(api: Api, realtime: Realtime, stack: Stack) -> None:
    # A program that reads as fast as a client types: what it read is not kept, so a long
    # session cannot grow the job's stdin stream by its whole input.
    job = api.execute(py_job("import sys\nprint(len(sys.stdin.buffer.read()))\n"))
    followed = realtime.follow(job)
    api.start(job)
    block = b"z" * 16384
    for _ in range(20):
        while (r := stdin(api, job, data=block)).status_code == 429:  # frame rate or pending cap
            time.sleep(0.05)
        assert r.status_code == 200, r.text
    with stack.redis() as redis:
        deadline = time.monotonic() + 10
        while int(redis.hget(f"job:{job['jobId']}:status", "stdinWritten") or 0) < 20 * len(block):
            assert time.monotonic() < deadline, "the program did not read its input"
            time.sleep(0.05)
        assert redis.xlen(f"job:{job['jobId']}:stdin") <= 1  # the last frame written, at most
    close(api, job)
    followed.wait_result()
    assert followed.text("stdout") == f"{20 * len(block)}\n"


def test_stdin_validation_and_closed_stdin(api: Api, stack: Stack) -> None:
    job = api.execute(py_job(ECHO))
    path = f"/v1/jobs/{job['jobId']}/stdin"
    cases = [
        ({}, "chunk"),
        ({"chunk": "a", "data": "YQ==", "encoding": "base64"}, "chunk"),
        ({"data": "YQ=="}, "encoding"),
        ({"data": "not base64!", "encoding": "base64"}, "data"),
        ({"chunk": 5}, "chunk"),
        ({"chunk": "a", "extra": 1}, "extra"),
    ]
    for body, field in cases:
        response = api.post(path, token=job["jobToken"], json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["details"][0]["field"] == field, (body, response.json())
    # An empty frame (the seed SDK sends one for sendStdin(id, "")) is a 200 that stores
    # nothing, and is answered like any frame once stdin is closed.
    for body in ({"chunk": ""}, {"data": "", "encoding": "base64"}):
        assert api.post(path, token=job["jobToken"], json=body).status_code == 200
    with stack.redis() as redis:
        assert redis.xlen(f"job:{job['jobId']}:stdin") == 0
    assert close(api, job).status_code == 200
    assert api.post(path, token=job["jobToken"], json={"chunk": ""}).status_code == 409
    again = stdin(api, job, "x")
    assert again.status_code == 409 and "closed" in again.json()["error"]
    assert close(api, job).status_code == 409
    kill(api, job)


def test_an_idle_program_waiting_for_input_times_out_and_input_resets_the_clock(api: Api, realtime: Realtime) -> None:
    waiting = api.execute(py_job("input()\n", limits={"idleMs": 1000}))
    f1 = realtime.follow(waiting)
    api.start(waiting)
    result = f1.wait_result()
    assert result["outcome"] == "idle_timed_out" and result["killedBy"] == "idle"
    assert 900 <= result["durationMs"] < 3000

    # Four lines, 600 ms apart: 2.4 s in all, never 1 s without input.
    typed = api.execute(py_job("for _ in range(4): input()\nprint('done')\n", limits={"idleMs": 1000}))
    f2 = realtime.follow(typed)
    api.start(typed)
    wait_for_event(f2, "stage", {"phase": "running"})
    for _ in range(4):
        time.sleep(0.6)
        assert stdin(api, typed, "go\n").status_code == 200
    result = f2.wait_result()
    assert result["outcome"] == "completed", result
    assert f2.text("stdout") == "done\n"


def test_frames_survive_the_workers_pubsub_connection_dropping(make_stack: StackFactory) -> None:
    stack = make_stack(WORKER_MAX_SANDBOXES="1")
    api, rt = Api(stack), Realtime(stack)
    try:
        job = api.execute(py_job(ECHO))
        followed = rt.follow(job)
        api.start(job)
        wait_for_event(followed, "stage", {"phase": "running"})
        sent = []
        for i in range(12):
            if i == 4:
                with stack.redis() as redis:
                    assert redis.client_kill_filter(_type="pubsub") >= 1
            line = f"frame {i}\n"
            assert stdin(api, job, line).status_code == 200
            sent.append(line)
            time.sleep(0.05)
        wait_for_text(followed, "stdout", "echo:frame 11\n", timeout_s=15)
        close(api, job)
        followed.wait_result()
        assert followed.text("stdout") == "".join("echo:" + line for line in sent) + "eof\n"
    finally:
        rt.close()
        api.close()


def test_a_kill_lost_with_the_pubsub_connection_still_ends_a_running_job_quickly(make_stack: StackFactory) -> None:
    # A running job's kill watch is its entry in the worker's flag sweep, which reads the
    # stored kill flag as soon as the connection that lost the message is replaced.
    stack = make_stack(WORKER_MAX_SANDBOXES="1")
    api, rt = Api(stack), Realtime(stack)
    try:
        job = api.execute(py_job("import time\nprint('up', flush=True)\ntime.sleep(30)\n"))
        followed = rt.follow(job)
        api.start(job)
        wait_for_text(followed, "stdout", "up\n")
        with stack.redis() as redis:
            redis.hset(f"job:{job['jobId']}:status", "kill", "1")  # stored; its message never sent
            assert redis.client_kill_filter(_type="pubsub") >= 1
        t0 = time.monotonic()
        result = followed.wait_result(timeout_s=8)
        assert result["outcome"] == "killed", result
        assert time.monotonic() - t0 < 4.0  # at the replacement, not at the 10 s sweep
    finally:
        rt.close()
        api.close()


# ------------------------------------------------------------------------ kill


def test_kill_a_running_program_ends_every_process_of_it(api: Api, realtime: Realtime) -> None:
    mark = f"{os.getpid()}.{time.monotonic_ns() % 1000000}"
    code = f"""
import os, subprocess, time
subprocess.Popen(["sleep", "3{mark}"], start_new_session=True)
if os.fork() == 0:
    os.setsid()
    while True: time.sleep(1)
print("ready", flush=True)
while True: pass
"""
    job = api.execute(py_job(code))
    followed = realtime.follow(job)
    api.start(job)
    wait_for_text(followed, "stdout", "ready\n")
    assert marked_processes("3" + mark), "the detached child should be running"
    response = kill(api, job)
    assert response.status_code == 202 and response.json() == {"ok": True}
    result = followed.wait_result()
    assert result["outcome"] == "killed"
    assert result["signal"] == "SIGKILL" and result["exitCode"] is None
    assert result["killedBy"] == "user"
    assert_one_result_no_gaps(api, job, followed)
    assert api.status(job)["state"] == "killed"
    assert "killRequested" not in api.status(job)
    assert marked_processes("3" + mark) == []
    assert kill(api, job).status_code == 409  # ended: nothing more to kill


def test_kill_a_parked_job_publishes_its_parked_events_then_the_result(api: Api, realtime: Realtime) -> None:
    job = api.execute(py_job("print('never')"))
    followed = realtime.follow(job)
    api.wait_state(job, {"parked"})
    assert kill(api, job).status_code == 202
    result = followed.wait_result()
    assert result["outcome"] == "killed" and result["signal"] == "SIGKILL" and result["killedBy"] == "user"
    events = assert_one_result_no_gaps(api, job, followed)
    assert followed.events[0] == ("stage", {"phase": "queued", "seq": 0})
    assert events["seq"] == 1
    assert api.start(job).status_code == 409


def test_kill_a_queued_job_that_no_worker_holds(make_stack: StackFactory) -> None:
    stack = make_stack(with_worker=False)
    api, rt = Api(stack), Realtime(stack)
    try:
        job = api.execute(py_job("print('never')"))
        followed = rt.follow(job)
        assert kill(api, job, token=api.stack.api_token).status_code == 202  # the API token works too
        result = followed.wait_result()  # published by the API itself
        assert result == {**result, "outcome": "killed", "signal": "SIGKILL", "killedBy": "user", "seq": 0}
        assert api.status(job)["state"] == "killed"
        assert api.replay(job) == [("result", result)]
        with stack.redis() as redis:
            assert redis.llen("jobs:queue") == 0
        # A worker that starts later has nothing to run.
        stack.start_worker()
        time.sleep(1.0)
        assert followed.results() == [result]
        assert api.status(job)["state"] == "killed"
    finally:
        rt.close()
        api.close()


def test_kill_while_compiling(api: Api, realtime: Realtime) -> None:
    # Enough functions to keep gcc -O2 busy for several seconds.
    source = "".join(f"int f{i}(int x) {{ return x * {i} + (x >> 3) ^ {i}; }}\n" for i in range(60000))
    source += "int main(void) { return f1(2) == 0; }\n"
    job = api.execute({"language": "c", "files": [{"name": "main.c", "content": source}]})
    followed = realtime.follow(job)
    api.start(job)
    wait_for_event(followed, "stage", {"phase": "compiling"}, timeout_s=20)
    time.sleep(0.3)
    assert kill(api, job).status_code == 202
    result = followed.wait_result(timeout_s=20)
    assert result["outcome"] == "killed" and result["signal"] == "SIGKILL" and result["killedBy"] == "user"
    assert result["compile"] is not None
    names = [n for n, _ in followed.events]
    assert "stage" in names and ("stage", {"phase": "running", "seq": 2}) not in followed.events
    assert_one_result_no_gaps(api, job, followed)


def test_kill_racing_a_natural_exit_or_a_timeout_gives_one_result(api: Api, realtime: Realtime) -> None:
    for i in range(6):
        quick = i % 2 == 0
        code = "print('bye')" if quick else "while True: pass"
        job = api.execute(py_job(code, limits={"wallTimeMs": 400}))
        followed = realtime.follow(job)
        api.start(job)
        time.sleep(0.03 if quick else 0.4)
        assert kill(api, job).status_code in (202, 409)
        result = followed.wait_result()
        allowed = {"completed", "killed"} if quick else {"timed_out", "killed"}
        assert result["outcome"] in allowed, result
        assert_one_result_no_gaps(api, job, followed)


def test_status_shows_the_kill_request_until_the_result(make_stack: StackFactory) -> None:
    stack = make_stack(WORKER_MAX_SANDBOXES="1")
    api, rt = Api(stack), Realtime(stack)
    worker = stack.procs["worker"]
    try:
        job = api.execute(py_job("print('never')"))
        followed = rt.follow(job)
        api.wait_state(job, {"parked"})
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            assert kill(api, job).status_code == 202
            status = api.get(f"/v1/jobs/{job['jobId']}/status", token=job["jobToken"]).json()
            assert status["state"] == "parked" and status["killRequested"] is True
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        result = followed.wait_result()
        assert result["outcome"] == "killed"
        status = api.status(job)
        assert status["state"] == "killed" and "killRequested" not in status
    finally:
        rt.close()
        api.close()


# ------------------------------------------------------------------------ who may


def test_job_tokens_and_the_uniform_404(api: Api) -> None:
    job = api.execute(py_job(ECHO))
    other = api.execute(py_job(ECHO))
    for path in ("stdin", "stdin/close", "kill"):
        url = f"/v1/jobs/{job['jobId']}/{path}"
        body = {"chunk": "x"} if path == "stdin" else None
        assert api.post(url, token=other["jobToken"], json=body).status_code == 404
        assert api.post(f"/v1/jobs/{'0' * 32}/{path}", json=body).status_code == 404
        assert api.client.post(url, json=body).status_code == 401
    # /status is the same body as the job itself, for either token.
    assert api.get(f"/v1/jobs/{job['jobId']}/status", token=job["jobToken"]).json() == api.status(job)
    assert api.get(f"/v1/jobs/{job['jobId']}/status", token=other["jobToken"]).status_code == 404
    for j in (job, other):
        kill(api, j)


def test_events_take_the_job_token_in_the_url_but_never_the_api_token(api: Api, realtime: Realtime) -> None:
    job = api.execute(py_job("print('sse')"))
    other = api.execute(py_job("print(0)"))
    followed = realtime.follow(job)
    api.start(job)
    followed.wait_result()
    url = f"/v1/jobs/{job['jobId']}/events"
    ok = api.client.get(url, params={"token": job["jobToken"]})
    assert ok.status_code == 200 and "event: result" in ok.text
    refused = api.client.get(url, params={"token": api.stack.api_token})
    assert refused.status_code == 401 and "URL" in refused.json()["error"]
    assert api.client.get(url, params={"token": other["jobToken"]}).status_code == 404
    kill(api, other)


# A program's lines, then what it wrote to stderr after them, each written with nothing
# between (print under -u writes the text and the newline apart).
_STDERR_AFTER_LINES = {
    "traceback": ("for i in range(6):\n    print('line', i)\n1 / 0\n", "line 5\n", "ZeroDivisionError"),
    "exit message": ("print('Result:', 42)\nraise SystemExit('fatal: bad input')\n", "Result: 42\n", "fatal: bad input"),
}


@pytest.mark.parametrize("case", list(_STDERR_AFTER_LINES))
def test_what_a_program_writes_to_stderr_after_its_lines_comes_after_them(api: Api, realtime: Realtime, case: str) -> None:
    """Through the event log, as an IDE shows it (by seq): stdout's lines gathered or half
    read when the program wrote to stderr went out after that stderr, splitting a line with a
    traceback in 4 runs of 15 (review)."""
    code, stdout_end, stderr_end = _STDERR_AFTER_LINES[case]
    for _ in range(8):
        job = api.execute(py_job(code))
        followed = realtime.follow(job)
        api.start(job)
        followed.wait_result()
        shown = "".join(
            payload["chunk"] if name == "stdout" else f"<E>{payload['chunk']}</E>"
            for name, payload in sorted(api.replay(job), key=lambda event: event[1]["seq"])
            if name in ("stdout", "stderr")
        )
        assert shown.count("<E>") >= 1 and stderr_end in shown, shown
        assert shown.index("<E>") == shown.index(stdout_end) + len(stdout_end), shown
