"""The start-handshake end to end on real parts: pysher follows, the API starts, nsjail runs."""

from __future__ import annotations

import time

import pytest

from tests.helpers import Api, Realtime, py_job

pytestmark = [pytest.mark.stack, pytest.mark.sandbox]

RESULT_FIELDS = {
    "exitCode", "signal", "timedOut", "idleTimedOut", "truncated", "durationMs",
    "cpuMs", "memoryKb", "outcome", "compile", "seq",
}  # fmt: skip


def test_happy_path_events_order_and_seq(api: Api, realtime: Realtime) -> None:
    # The 4 MiB block is memory the program itself touches: a prestarted runtime's own (what
    # it held before start) is not the job's, so a bare print may well report 0 KiB.
    job = api.execute(py_job("import sys\nblock = b'x' * (4 << 20)\nprint('hello')\nprint('oops', file=sys.stderr)\nsys.exit(3)\n"))
    assert job["status"] == "queued"
    assert job["channel"] == f"private-run-{job['jobId']}"
    assert job["jobToken"].startswith(job["jobId"] + ".")

    followed = realtime.follow(job)
    assert api.start(job).json() == {"ok": True}
    result = followed.wait_result()
    time.sleep(0.3)  # a duplicate result, if one existed, would arrive in this window

    # The durable log (SSE) holds every event: seq 0..n-1, each once, in this order.
    log = api.replay(job)
    assert [p["seq"] for _, p in log] == list(range(len(log)))
    assert log[0] == ("stage", {"phase": "queued", "seq": 0})
    assert log[1] == ("stage", {"phase": "running", "seq": 1})
    assert log[-1] == ("result", result)
    assert {n for n, _ in log[2:-1]} == {"stdout", "stderr"}
    # Live, the client saw every event, stage{queued} included (nothing is published before
    # start), each once, identical to the log.
    live = sorted(followed.events, key=lambda e: e[1]["seq"])
    assert live == log
    names = [name for name, _ in followed.events]
    assert names.count("result") == 1
    assert followed.text("stdout") == "hello\n"
    assert followed.text("stderr") == "oops\n"

    assert set(result) == RESULT_FIELDS
    assert result["outcome"] == "completed"
    assert result["exitCode"] == 3
    assert result["signal"] is None
    assert result["timedOut"] is False and result["idleTimedOut"] is False and result["truncated"] is False
    assert result["compile"] is None
    assert 0 <= result["durationMs"] < 5000
    # (Less a little: the block may reuse heap the runtime had touched before start, which is
    # not the job's. 4,008 KiB was seen after a run of batches.)
    assert result["memoryKb"] >= 4 * 1024 - 256
    # stage{running} precedes every output chunk.
    assert all(p["seq"] > 1 for n, p in followed.events if n in ("stdout", "stderr"))

    status = api.status(job)
    assert status["state"] == "done"
    assert status["result"] == result
    assert status["language"] == "python" and status["version"]


def test_event_log_resumes_after_last_event_id(api: Api, realtime: Realtime) -> None:
    job = api.execute(py_job("for i in range(3): print(i)"))
    followed = realtime.follow(job)
    api.start(job)
    followed.wait_result()
    full = api.replay(job)
    assert api.replay(job, after=1) == full[2:]
    with api.client.stream("GET", f"/v1/jobs/{job['jobId']}/events", headers={**api.headers(), "Last-Event-ID": str(len(full) - 2)}) as r:
        body = r.read().decode()
    assert body.count("event: ") == 1 and "event: result" in body
    # Resumed past its result, the stream has nothing more, ever: 204, which tells a
    # browser's EventSource to stop, where a 200 that ends makes it reconnect every few
    # seconds for as long as the job's record lives.
    for resume in ({"Last-Event-ID": str(len(full) - 1)}, {"Last-Event-ID": str(len(full) + 5)}):
        done = api.client.get(f"/v1/jobs/{job['jobId']}/events", headers={**api.headers(), **resume})
        assert done.status_code == 204 and done.content == b"", (resume, done.status_code, done.text)
    assert api.get(f"/v1/jobs/{job['jobId']}/events", params={"after": str(len(full) - 1)}).status_code == 204
    # The job token reads it too; another job's token does not.
    assert api.get(f"/v1/jobs/{job['jobId']}/events", token=job["jobToken"]).status_code == 200
    other = api.execute(py_job("print(0)"))
    assert api.get(f"/v1/jobs/{job['jobId']}/events", token=other["jobToken"]).status_code == 404
    api.start(other)


def test_states_move_queued_to_done(api: Api, realtime: Realtime) -> None:
    job = api.execute(py_job("import time\nprint('a', flush=True)\ntime.sleep(1)\nprint('b')\n"))
    assert api.status(job)["state"] in ("queued", "parked")
    followed = realtime.follow(job)
    api.wait_state(job, {"parked"})  # a worker holds it and waits for start
    api.start(job)
    api.wait_state(job, {"running"}, timeout_s=5)
    followed.wait_result()
    assert api.status(job)["state"] == "done"
    assert followed.text("stdout") == "a\nb\n"


def test_start_is_idempotent(api: Api, realtime: Realtime) -> None:
    job = api.execute(py_job("print(42)"))
    followed = realtime.follow(job)
    for _ in range(3):
        assert api.start(job).status_code == 202
    followed.wait_result()
    time.sleep(0.3)
    assert len(followed.results()) == 1
    assert api.start(job).status_code == 202  # after the end, still harmless


def test_job_token_can_subscribe_start_and_read_only_its_job(api: Api, stack) -> None:  # type: ignore[no-untyped-def]
    job = api.execute(py_job("print('mine')"))
    other = api.execute(py_job("print('other')"))
    rt = Realtime(stack, auth_token=job["jobToken"])
    try:
        followed = rt.follow(job)
        assert api.start(job, token=job["jobToken"]).status_code == 202
        assert followed.wait_result()["exitCode"] == 0
        assert followed.text("stdout") == "mine\n"
    finally:
        rt.close()
    assert api.get(f"/v1/jobs/{job['jobId']}", token=job["jobToken"]).status_code == 200
    # Another job's token sees nothing of this one: uniform 404, and no channel signature.
    assert api.get(f"/v1/jobs/{job['jobId']}", token=other["jobToken"]).status_code == 404
    assert api.post(f"/v1/jobs/{job['jobId']}/start", token=other["jobToken"]).status_code == 404
    denied = api.client.post(
        "/v1/channel-auth",
        data={"socket_id": "123.456", "channel_name": job["channel"]},
        headers={"Authorization": f"Bearer {other['jobToken']}"},
    )
    assert denied.status_code == 403
    # A job token never submits jobs.
    refused = api.client.post("/v1/execute", json=py_job("print(1)"), headers={"Authorization": f"Bearer {job['jobToken']}"})
    assert refused.status_code == 403
    api.start(other)
