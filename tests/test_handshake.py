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
    job = api.execute(py_job("import sys\nprint('hello')\nprint('oops', file=sys.stderr)\nsys.exit(3)\n"))
    assert job["status"] == "queued"
    assert job["channel"] == f"private-run-{job['jobId']}"
    assert job["jobToken"].startswith(job["jobId"] + ".")

    followed = realtime.follow(job)
    assert api.start(job).json() == {"ok": True}
    result = followed.wait_result()
    time.sleep(0.3)  # a duplicate result, if one existed, would arrive in this window

    names = [name for name, _ in followed.events]
    seqs = [payload["seq"] for _, payload in followed.events]
    # Nothing lost and nothing doubled: seq is 0..n-1 exactly once each.
    assert sorted(seqs) == list(range(len(seqs)))
    by_seq = [name for _, name in sorted(zip(seqs, names, strict=True))]
    assert by_seq[0] == "stage" and by_seq[-1] == "result"
    stages = [p["phase"] for n, p in sorted(followed.events, key=lambda e: e[1]["seq"]) if n == "stage"]
    assert stages == ["queued", "running"]
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
    assert result["memoryKb"] > 0
    # stage{running} precedes every output chunk.
    running_seq = next(p["seq"] for n, p in followed.events if n == "stage" and p["phase"] == "running")
    assert all(p["seq"] > running_seq for n, p in followed.events if n in ("stdout", "stderr"))

    status = api.status(job)
    assert status["state"] == "done"
    assert status["result"] == result
    assert status["language"] == "python" and status["version"]


def test_states_move_queued_to_done(api: Api, realtime: Realtime) -> None:
    job = api.execute(py_job("import time\nprint('a', flush=True)\ntime.sleep(1)\nprint('b')\n"))
    assert api.status(job)["state"] == "queued"
    followed = realtime.follow(job)
    api.wait_state(job, {"queued"})
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
