"""Redis away for longer than a lease: live workers are not judged dead, jobs go on.

Redis is frozen with SIGSTOP (its data stays, its clients get no answer): every lease
expires meanwhile, for live workers too. A worker must tell that from a dead worker, so
the job running through the outage ends `completed` with all its output, not `lost`.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest
import websocket

from shared.pusher import signed_query
from tests.conftest import StackFactory
from tests.helpers import Api, Realtime, py_job, run_job

pytestmark = [pytest.mark.stack, pytest.mark.sandbox, pytest.mark.slow]

LEASE_MS = 1000


def _freeze(stack, seconds: float) -> None:  # type: ignore[no-untyped-def]
    pid = stack.procs["redis"].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)


def test_a_job_runs_through_a_redis_outage_of_three_leases(make_stack: StackFactory) -> None:
    stack = make_stack(WORKER_HEARTBEAT_MS="300", WORKER_LEASE_TTL_MS=str(LEASE_MS), WORKER_MAX_SANDBOXES="2")
    # A second worker: the one that would wrongly reap the first after the outage.
    stack.start_worker(extra_env={"WORKER_MAX_SANDBOXES": "1"})
    api = Api(stack)
    lines = 24
    code = f"import time\nfor i in range({lines}):\n    print(i, flush=True)\n    time.sleep(0.25)\n"
    try:
        job = api.execute(py_job(code, collectOutput=True, limits={"wallTimeMs": 30000, "idleMs": 20000}))
        api.start(job)
        api.wait_state(job, {"running"}, timeout_s=10)
        time.sleep(1.0)
        _freeze(stack, 3 * LEASE_MS / 1000 + 0.5)
        status = api.wait_state(job, {"done", "error", "killed", "lost"}, timeout_s=40)
        assert status["result"]["outcome"] == "completed", status
        log = api.replay(job)
        assert [p["seq"] for _, p in log] == list(range(len(log)))
        assert "".join(p["chunk"] for n, p in log if n == "stdout") == "".join(f"{i}\n" for i in range(lines))
        assert api.get(f"/v1/jobs/{job['jobId']}/output").json()["stdout"] == "".join(f"{i}\n" for i in range(lines))
        # Both workers are still there and serving.
        assert not stack.dead_children()
        for _ in range(2):
            nxt = api.execute(py_job("print('after')"))
            api.start(nxt)
            assert api.wait_state(nxt, {"done"}, timeout_s=20)["result"]["outcome"] == "completed"
    finally:
        api.close()


def test_a_second_sigterm_during_an_outage_stops_the_worker_promptly(make_stack: StackFactory) -> None:
    stack = make_stack(WORKER_HEARTBEAT_MS="300", WORKER_LEASE_TTL_MS=str(LEASE_MS), WORKER_SHUTDOWN_GRACE_MS="20000")
    api = Api(stack)
    try:
        job = api.execute(py_job("import time\nprint('started', flush=True)\ntime.sleep(60)\n"))
        api.start(job)
        api.wait_state(job, {"running"}, timeout_s=10)
        worker = stack.procs["worker"]
        redis_pid = stack.procs["redis"].pid
        os.kill(redis_pid, signal.SIGSTOP)
        try:
            os.killpg(worker.pid, signal.SIGTERM)
            time.sleep(0.5)
            t0 = time.monotonic()
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(timeout=30)
            took = time.monotonic() - t0
        finally:
            os.kill(redis_pid, signal.SIGCONT)
        assert took < 20, f"the worker took {took:.1f}s to stop after the second signal"
        # What it could not write is recovered: another worker finds the job's claim once
        # the stopped worker's lease is gone, and ends it lost (it had started).
        stack.start_worker()
        status = api.wait_state(job, {"done", "killed", "lost", "error"}, timeout_s=30)
        assert status["state"] in ("killed", "lost"), status
        assert len([n for n, _ in api.replay(job) if n == "result"]) == 1
    finally:
        api.close()


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_a_worker_stops_promptly_while_redis_is_away(make_stack: StackFactory, how: str) -> None:
    # A stop's last words to Redis (hand back stray claims, unregister) each have a bound
    # that a stop with Redis away used to wait out in retries: 4 s in all, for nothing, as
    # the worker's claims are recovered by the others once its lease is gone either way.
    stack = make_stack(WORKER_HEARTBEAT_MS="300", WORKER_LEASE_TTL_MS=str(LEASE_MS))
    api = Api(stack)
    redis = stack.procs["redis"]
    try:
        job = api.execute(py_job("print('parked through it')"))
        api.wait_state(job, {"parked"}, timeout_s=10)
        worker = stack.procs["worker"]
        if how == "killed":
            os.killpg(redis.pid, signal.SIGKILL)
            redis.wait(timeout=5)
        else:
            os.kill(redis.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(timeout=30)
            took = time.monotonic() - t0
        finally:
            if how == "frozen":
                os.kill(redis.pid, signal.SIGCONT)
        # Killed: nothing waits on Redis. Frozen: the one unretried question's 1 s bound.
        assert took < (1.5 if how == "killed" else 2.5), f"the worker took {took:.1f}s to stop"
        if how == "frozen":
            # Nothing was lost: the parked job (claimed, never started) goes back to the
            # queue once the stopped worker's lease is gone, and a new worker runs it.
            stack.start_worker()
            api.start(job)
            status = api.wait_state(job, {"done", "killed", "lost", "error"}, timeout_s=30)
            assert status["result"]["outcome"] == "completed", status
            assert "".join(p["chunk"] for n, p in api.replay(job) if n == "stdout") == "parked through it\n"
    finally:
        api.close()


@pytest.mark.parametrize("how", ["killed", "frozen"])
def test_soketi_stops_promptly_while_redis_is_away(make_stack: StackFactory, how: str) -> None:
    # soketi's Redis adapter waits for Redis rather than drop a command, and its stop waits
    # on the adapter: a subscriber's eviction asks Redis for the channel's listeners, and
    # the QUIT queues behind a waiting PUBLISH. With Redis away soketi ran until its SIGKILL;
    # realtime/guard.js bounds the stop.
    stack = make_stack(with_worker=False)
    follower = websocket.create_connection(
        f"ws://127.0.0.1:{stack.soketi_port}/app/{stack.pusher_key}?protocol=7", timeout=5
    )
    redis = stack.procs["redis"]
    try:
        assert json.loads(follower.recv())["event"] == "pusher:connection_established"
        follower.send(json.dumps({"event": "pusher:subscribe", "data": {"channel": "anyone"}}))
        assert json.loads(follower.recv())["event"] == "pusher_internal:subscription_succeeded"
        if how == "killed":
            os.killpg(redis.pid, signal.SIGKILL)
            redis.wait(timeout=5)
        else:
            os.kill(redis.pid, signal.SIGSTOP)
        # An event soketi must PUBLISH for its other nodes: it waits for Redis.
        path = f"/apps/{stack.pusher_app_id}/events"
        body = json.dumps({"name": "ping", "channel": "anyone", "data": "{}"}).encode()
        query = signed_query("POST", path, body, stack.pusher_key, stack.pusher_secret, int(time.time()))
        with httpx.Client(timeout=5) as client:
            sent = client.post(
                f"http://127.0.0.1:{stack.soketi_port}{path}",
                params=query,
                content=body,
                headers={"content-type": "application/json"},
            )
        assert sent.status_code == 200, sent.text
        assert json.loads(follower.recv())["event"] == "ping"  # (delivered here all the same)
        t0 = time.monotonic()
        stack.stop_process("soketi", timeout_s=10)
        took = time.monotonic() - t0
        # The follower was told to come back later before soketi waited on anything.
        told = json.loads(follower.recv())
        assert told["event"] == "pusher:error" and told["data"]["code"] == 4200, told
    finally:
        follower.close()
        if how == "frozen":
            os.kill(redis.pid, signal.SIGCONT)
    # (its grace of 200 ms, then 2 s at most)
    assert took < 4, f"soketi took {took:.1f}s to stop"
    log = stack.log("soketi")
    assert "(Redis away?): exiting" in log and "process uncaughtException" not in log, log[-2000:]


def test_a_program_that_ended_keeps_its_verdict_and_output_when_the_grace_ends_mid_hand_over(
    make_stack: StackFactory,
) -> None:
    # The program writes 1.1 MiB and exits while Redis is frozen: the flusher holds 1 MiB it
    # cannot log, the pumps wait for it, the rest waits in the pipe. The worker's grace ends
    # meanwhile and Redis comes back a second later. Before, the stop cancelled the pumps:
    # the last 32 KiB never reached the log, and the result said `killed` (SIGKILL, by
    # "user") for a program that had exited 0 by itself.
    stack = make_stack(WORKER_SHUTDOWN_GRACE_MS="1000", WORKER_MAX_SANDBOXES="2")
    api = Api(stack)
    code = (
        "import os, time\n"
        "time.sleep(1)\n"
        "for _ in range(17):\n"
        "    os.write(1, b'x' * 65535 + b'\\n')\n"
        "os.write(1, b'y' * 32767 + b'\\n')\n"
    )
    expected = ("x" * 65535 + "\n") * 17 + "y" * 32767 + "\n"
    try:
        job = api.execute(py_job(code, collectOutput=True, limits={"outputKb": 4096, "wallTimeMs": 20000}))
        api.start(job)
        api.wait_state(job, {"running"}, timeout_s=10)
        worker, redis_pid = stack.procs["worker"], stack.procs["redis"].pid
        os.kill(redis_pid, signal.SIGSTOP)
        try:
            time.sleep(1.6)  # (the program has written it all and exited)
            os.killpg(worker.pid, signal.SIGTERM)
            time.sleep(1.9)  # (the grace ended 0.9 s ago)
        finally:
            os.kill(redis_pid, signal.SIGCONT)
        worker.wait(timeout=30)
        status = api.wait_state(job, {"done", "killed", "lost", "error"}, timeout_s=20)
        result = status["result"]
        assert result["outcome"] == "completed" and result["exitCode"] == 0, result
        assert result["truncated"] is False and "killedBy" not in result, result
        log = api.replay(job)
        assert [p["seq"] for _, p in log] == list(range(len(log)))
        assert "".join(p["chunk"] for n, p in log if n == "stdout") == expected
        assert api.get(f"/v1/jobs/{job['jobId']}/output").json()["stdout"] == expected
    finally:
        api.close()


def test_a_redis_restart_as_a_followed_job_ends_keeps_soketi_and_the_live_result(make_fleet: StackFactory) -> None:
    # Redis SIGKILLed (and back 1 s later, its data kept) the moment a job's result is stored,
    # its output still going out live. The worker's PUBLISHes found no Redis: they were dropped,
    # the result with them, though nothing had been sent. Sent over HTTP instead, soketi's
    # Redis adapter failed to pass them on, and soketi stopped (an unhandled rejection),
    # ending every follower's connection for good. The follower gets every event now, and
    # soketi serves the next job.
    stack = make_fleet(workers=1, redis_persistence=True, WORKER_MAX_SANDBOXES="2")
    api, rt = Api(stack), Realtime(stack)
    lines = 1024
    code = f"import sys\nline = 'x' * 1023 + '\\n'\nfor i in range({lines}):\n    sys.stdout.write(line)\n"
    try:
        job = api.execute(py_job(code, limits={"outputKb": 16384}))
        followed = rt.follow(job)
        api.start(job)
        with stack.redis() as redis:
            deadline = time.monotonic() + 30
            while redis.hget(f"job:{job['jobId']}:status", "state") != b"done":
                assert time.monotonic() < deadline, "the job never ended"
                time.sleep(0.002)
        stack.restart("redis", down_s=1.0, sig=signal.SIGKILL)
        result = followed.wait_result(timeout_s=20)
        assert result["outcome"] == "completed", result
        assert followed.text("stdout") == ("x" * 1023 + "\n") * lines, followed.summary()
        assert "uncaughtException" not in stack.log("soketi"), stack.log("soketi")[-2000:]
        assert stack.dead_children() == [], stack.dead_children()
        # soketi still serves: the next job is heard live, whole.
        after, heard = run_job(api, rt, py_job("print('after')"))
        assert after["outcome"] == "completed" and heard.text("stdout") == "after\n", heard.summary()
    finally:
        rt.close()
        api.close()
