"""Parking costs no sandbox: many unstarted jobs never keep a started one waiting.

A parked job is a record and a subscription; the warm sandboxes go to jobs that start.
One client's unstarted jobs are capped so it cannot take every claim of the fleet.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import StackFactory
from tests.helpers import Api, Realtime, py_job

pytestmark = [pytest.mark.stack, pytest.mark.sandbox]


def _states(stack, jobs) -> dict[str, int]:  # type: ignore[no-untyped-def]
    counts: dict[str, int] = {}
    with stack.redis() as redis:
        for job in jobs:
            state = redis.hget(f"job:{job['jobId']}:status", "state").decode()
            counts[state] = counts.get(state, 0) + 1
    return counts


def _wait_states(stack, jobs, want: dict[str, int], timeout_s: float = 15) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while (got := _states(stack, jobs)) != want:
        assert time.monotonic() < deadline, f"states {got}, wanted {want}"
        time.sleep(0.05)


def test_a_started_job_runs_at_once_while_50_unstarted_jobs_are_parked(make_stack: StackFactory) -> None:
    stack = make_stack(WORKER_MAX_SANDBOXES="1")
    api, rt = Api(stack), Realtime(stack)
    try:
        idle = [api.execute(py_job("print('never started')")) for _ in range(50)]
        _wait_states(stack, idle, {"parked": 50})
        job = api.execute(py_job("print('me first')"))
        followed = rt.follow(job)
        t0 = time.monotonic()
        api.start(job)
        result = followed.wait_result(timeout_s=10)
        took = time.monotonic() - t0
        assert result["outcome"] == "completed" and followed.text("stdout") == "me first\n"
        assert took < 3.0, f"the started job waited {took:.1f}s behind parked ones"
        # And the single slot serves one started job after another, parked ones untouched.
        for parked in idle[:3]:
            f = rt.follow(parked)
            api.start(parked)
            assert f.wait_result()["outcome"] == "completed"
        assert _states(stack, idle[3:]) == {"parked": 47}
        for parked in idle[3:]:
            assert api.post(f"/v1/jobs/{parked['jobId']}/kill").status_code == 202
        _wait_states(stack, idle[3:], {"killed": 47})
    finally:
        rt.close()
        api.close()


def test_a_worker_holds_at_most_its_parked_maximum(make_stack: StackFactory) -> None:
    stack = make_stack(WORKER_MAX_SANDBOXES="1", WORKER_MAX_PARKED="5")
    api = Api(stack)
    try:
        jobs = [api.execute(py_job("print(1)")) for _ in range(10)]
        # Five parked plus one per slot may be held; the rest stay in the queue for others.
        _wait_states(stack, jobs, {"parked": 6, "queued": 4})
        time.sleep(0.5)
        assert _states(stack, jobs) == {"parked": 6, "queued": 4}
        # Starting one frees room: the worker claims the next.
        api.start(jobs[0])
        api.wait_state(jobs[0], {"done"})
        _wait_states(stack, jobs, {"done": 1, "parked": 6, "queued": 3})
        for job in jobs[1:]:
            api.post(f"/v1/jobs/{job['jobId']}/kill")
    finally:
        api.close()


def test_one_client_cannot_hold_more_unstarted_jobs_than_its_cap(make_stack: StackFactory) -> None:
    stack = make_stack(MAX_PARKED_PER_PRINCIPAL="3")
    api = Api(stack)
    try:
        jobs = [api.execute(py_job("print(1)")) for _ in range(3)]
        refused = api.post("/v1/execute", json=py_job("print(1)"))
        assert refused.status_code == 429, refused.text
        body = refused.json()
        assert "waiting for start" in body["error"] and body["retryAfterMs"] > 0
        # A started (or ended) job no longer counts.
        api.start(jobs[0])
        api.wait_state(jobs[0], {"done"})
        assert api.post("/v1/execute", json=py_job("print(1)")).status_code == 202
        assert api.post("/v1/execute", json=py_job("print(1)")).status_code == 429
        assert api.post(f"/v1/jobs/{jobs[1]['jobId']}/kill").status_code == 202
        api.wait_state(jobs[1], {"killed"})  # the worker ends a parked job; then it stops counting
        assert api.post("/v1/execute", json=py_job("print(1)")).status_code == 202
    finally:
        api.close()


def test_one_clients_unstarted_jobs_hold_bounded_input_and_ended_jobs_none(make_stack: StackFactory) -> None:
    """MAX_UNSTARTED_INPUT_MB bounds the stored specs of one client's jobs not yet started
    (Redis holds every byte of their inline files); a job's spec goes when it ends."""
    stack = make_stack(MAX_UNSTARTED_INPUT_MB="1")
    api = Api(stack)
    data = "x" * 400_000
    body = py_job("print(len(open('data.txt').read()))", files=[
        {"name": "main.py", "content": "print(len(open('data.txt').read()))"},
        {"name": "data.txt", "content": data},
    ])  # fmt: skip
    try:
        jobs = [api.execute(body) for _ in range(2)]
        refused = api.post("/v1/execute", json=body)
        assert refused.status_code == 429, refused.text
        error = refused.json()
        assert "MAX_UNSTARTED_INPUT_MB" in error["error"] and error["retryAfterMs"] > 0, error
        assert api.post("/v1/execute", json=py_job("print(1)")).status_code == 202  # a small one still fits
        with stack.redis() as redis:
            assert redis.strlen(f"job:{jobs[0]['jobId']}:spec") > 400_000
        # A started job no longer counts, and once it has ended its spec is gone from Redis.
        api.start(jobs[0])
        assert api.wait_state(jobs[0], {"done"})["result"]["outcome"] == "completed"
        third = api.execute(body)
        # A parked job killed: the same.
        api.wait_state(jobs[1], {"parked"})
        assert api.post(f"/v1/jobs/{jobs[1]['jobId']}/kill").status_code == 202
        api.wait_state(jobs[1], {"killed"})
        with stack.redis() as redis:
            for job in jobs:
                assert not redis.exists(f"job:{job['jobId']}:spec"), job
                assert redis.exists(f"job:{job['jobId']}:status")  # the record stays for its TTL
            assert redis.exists(f"job:{third['jobId']}:spec")
        assert api.post("/v1/execute", json=body).status_code == 202
    finally:
        api.close()


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_parked_job_holds_its_inline_files_once(make_stack: StackFactory) -> None:
    """A parked job keeps its files' bytes for its start, and lets go of the spec's text of
    them: 20 parked jobs with a 4 MiB file each grow the worker by about 80 MiB, not 160."""
    stack = make_stack(WORKER_MAX_SANDBOXES="1")  # (one slot: nothing is loaded while parked)
    api = Api(stack)
    pid = stack.procs["worker"].pid
    size, count = 4 << 20, 20
    try:
        warm = api.execute(py_job("print(1)"))  # the worker's own first-job allocations
        api.start(warm)
        api.wait_state(warm, {"done"})
        before = _rss_bytes(pid)
        jobs = []
        for i in range(count):
            files = [{"name": "main.py", "content": "print(1)"}, {"name": "big.txt", "content": str(i % 10) * size}]
            jobs.append(api.execute(py_job("", files=files)))
        for job in jobs:
            api.wait_state(job, {"parked"})
        grown = _rss_bytes(pid) - before
        assert count * size * 0.9 < grown < count * size * 1.4, grown / (1 << 20)
        for job in jobs:
            api.post(f"/v1/jobs/{job['jobId']}/kill")
    finally:
        api.close()


def test_a_start_lost_with_the_pubsub_connection_is_still_honoured_quickly(make_stack: StackFactory) -> None:
    stack = make_stack(WORKER_MAX_SANDBOXES="1")
    api, rt = Api(stack), Realtime(stack)
    try:
        for _ in range(3):
            job = api.execute(py_job("print('started anyway')"))
            followed = rt.follow(job)
            api.wait_state(job, {"parked"})
            with stack.redis() as redis:
                assert redis.client_kill_filter(_type="pubsub") >= 1
            t0 = time.monotonic()
            api.start(job)  # its live message may be lost; the stored flag is not
            assert followed.wait_result(timeout_s=8)["outcome"] == "completed"
            # Re-read on reconnect, not at the 10 s safety poll.
            assert time.monotonic() - t0 < 4.0
    finally:
        rt.close()
        api.close()
