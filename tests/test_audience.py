"""A job nobody follows costs soketi nothing; a late follower is heard.

Graders pull results and never subscribe: publishing their events to an empty channel
would cost soketi (and the worker) a request per batch for nothing. Whether anyone may
follow is the audience mark the API sets when it signs a subscription (one Redis look).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from pysher.channel import Channel

from launcher.stack import Stack, free_port
from shared import keys
from tests.conftest import StackFactory
from tests.helpers import Api, Followed, Realtime, py_job

pytestmark = [pytest.mark.stack, pytest.mark.sandbox]

_TALLY = re.compile(
    r"live events: (\d+) delivered \(\d+ through Redis\), (\d+) refused or unreachable, (\d+) dropped, (\d+) unheard"
    r" \((\d+) audience checks\)"
)


def _tally(stack) -> tuple[int, ...]:  # type: ignore[no-untyped-def]
    stack.stop_process("worker", signal.SIGTERM)
    found = _TALLY.findall(stack.log("worker"))
    assert found, stack.log("worker")[-2000:]
    return tuple(int(x) for x in found[-1])


def test_jobs_nobody_follows_send_soketi_nothing(make_stack: StackFactory) -> None:
    stack = make_stack(WORKER_MAX_SANDBOXES="2")
    api = Api(stack)
    try:
        jobs = [api.execute(py_job("for i in range(3): print(i)", collectOutput=True)) for _ in range(5)]
        for job in jobs:
            api.start(job)
        for job in jobs:
            assert api.wait_state(job, {"done"})["result"]["outcome"] == "completed"
            assert api.get(f"/v1/jobs/{job['jobId']}/output").json()["stdout"] == "0\n1\n2\n"
        delivered, refused, dropped, unheard, checks = _tally(stack)
        assert delivered == 0 and refused == 0 and dropped == 0
        assert unheard >= 5 * 4  # stages, output and the result of each job
        assert checks <= 10  # looks of their own (the appends read the mark in passing): at most one a job
    finally:
        api.close()


def test_a_follower_who_comes_late_is_heard(make_stack: StackFactory) -> None:
    stack = make_stack(WORKER_MAX_SANDBOXES="1")
    api, rt = Api(stack), Realtime(stack)
    try:
        job = api.execute(py_job("import time\nfor i in range(12):\n    print(i, flush=True)\n    time.sleep(0.25)\n"))
        api.start(job)
        api.wait_state(job, {"running"})
        time.sleep(0.6)
        followed = rt.follow(job)  # after start: nothing was published to it so far
        result = followed.wait_result(timeout_s=20)
        assert result["outcome"] == "completed"
        live = [p["chunk"] for n, p in followed.events if n == "stdout"]
        assert live and "11\n" in "".join(live)  # it heard the rest of the run live
        # What it missed is in the durable log, whole.
        log = api.replay(job)
        assert "".join(p["chunk"] for n, p in log if n == "stdout") == "".join(f"{i}\n" for i in range(12))
    finally:
        rt.close()
        api.close()


def test_a_follower_who_comes_just_before_the_end_gets_the_result_live(make_stack: StackFactory) -> None:
    # The lane looks for an audience at most once a second: a client who subscribes within
    # that second of the job's end (its status said `running`) must still get the result.
    stack = make_stack(WORKER_MAX_SANDBOXES="1")
    api, rt = Api(stack), Realtime(stack)
    try:
        for _ in range(3):
            job = api.execute(py_job("import time\nprint('x', flush=True)\ntime.sleep(0.6)\n"))
            api.start(job)
            api.wait_state(job, {"running"})
            time.sleep(0.1)  # the lane has looked, and found nobody
            followed = rt.follow(job)
            assert api.get(f"/v1/jobs/{job['jobId']}").json()["state"] == "running"
            assert followed.wait_result(timeout_s=10)["outcome"] == "completed"
    finally:
        rt.close()
        api.close()


def test_signing_a_subscription_marks_the_job_as_followed(make_stack: StackFactory) -> None:
    stack = make_stack(WORKER_MAX_SANDBOXES="1")
    api, rt = Api(stack), Realtime(stack)
    redis = stack.redis()
    try:
        followed = api.execute(py_job("print(1)"))
        unfollowed = api.execute(py_job("print(2)", collectOutput=True))
        assert not redis.exists(keys.audience_key(followed["jobId"]))
        watch = rt.follow(followed)  # signs through /v1/channel-auth, then subscribes
        assert redis.exists(keys.audience_key(followed["jobId"]))
        assert 0 < redis.ttl(keys.audience_key(followed["jobId"])) <= 86400
        api.start(followed)
        api.start(unfollowed)
        assert watch.wait_result()["outcome"] == "completed"
        assert "1\n" in "".join(p["chunk"] for n, p in watch.events if n == "stdout")
        assert api.wait_state(unfollowed, {"done"})["result"]["outcome"] == "completed"
        assert not redis.exists(keys.audience_key(unfollowed["jobId"]))
    finally:
        redis.close()
        rt.close()
        api.close()


def test_a_late_follower_hears_every_event_logged_after_it_subscribed(make_stack: StackFactory) -> None:
    # The lane's own look for an audience is at most once a second, but every append to the
    # log reads the mark while nobody is known to follow: an event logged after the
    # subscription was signed is published, not dropped on a "no" up to a second old.
    stack = make_stack(WORKER_MAX_SANDBOXES="1")
    api, rt = Api(stack), Realtime(stack)
    redis = stack.redis()
    try:
        for _ in range(2):
            job = api.execute(py_job("import time\nfor i in range(40):\n    print(i, flush=True)\n    time.sleep(0.05)\n"))
            api.start(job)
            api.wait_state(job, {"running"})
            time.sleep(0.2)  # the lane has looked, and found nobody
            followed = rt.follow(job)
            logged_before = int(redis.hget(keys.status_key(job["jobId"]), "nextSeq") or 0)
            result = followed.wait_result(timeout_s=20)
            assert result["outcome"] == "completed"
            heard = sorted(p["seq"] for _n, p in followed.events)
            expected = list(range(logged_before, result["seq"] + 1))
            assert [seq for seq in expected if seq not in heard] == [], (logged_before, heard)
    finally:
        redis.close()
        rt.close()
        api.close()


def _heard_once_in_order(followed, result: dict) -> None:  # type: ignore[no-untyped-def]
    """Every event of the job, from seq 0 to its result, each once."""
    time.sleep(0.5)  # (time for a second copy to arrive, should one be sent)
    seqs = [p["seq"] for _n, p in followed.events]
    assert sorted(seqs) == list(range(result["seq"] + 1)), followed.summary()
    assert len(followed.results()) == 1, followed.summary()


def test_a_subscription_signed_outside_the_api_hears_a_short_job_whole_and_once(make_stack: StackFactory) -> None:
    # A backend that signs its own subscriptions: only soketi's webhook tells the API of the
    # follower, and it may land after a short job has ended (soketi sends it as the
    # subscription succeeds, and the client starts the job at once). Nobody published the
    # job live then; the webhook's handler does, from the log, once.
    stack = make_stack(WORKER_MAX_SANDBOXES="1")
    api, rt = Api(stack), Realtime(stack)
    redis = stack.redis()
    try:
        # The webhook certainly after the end: subscribed once the job is done.
        job = api.execute(py_job("print('hello')"))
        api.start(job)
        assert api.wait_state(job, {"done"})["result"]["outcome"] == "completed"
        followed = rt.follow(job, signed_here=stack.pusher_secret)
        result = followed.wait_result(timeout_s=10)
        assert followed.text("stdout") == "hello\n"
        _heard_once_in_order(followed, result)
        assert (redis.get(keys.late_replay_key(job["jobId"])) or b"").startswith(b"api:")
        # As a backend's IDE does it: subscribe, start at once; the webhook lands before, during
        # or after the run. Whichever way, every event once.
        for _ in range(4):
            job = api.execute(py_job("print('hello')"))
            followed = rt.follow(job, signed_here=stack.pusher_secret)
            api.start(job)
            result = followed.wait_result(timeout_s=10)
            assert result["outcome"] == "completed" and followed.text("stdout") == "hello\n"
            _heard_once_in_order(followed, result)
    finally:
        redis.close()
        rt.close()
        api.close()


@pytest.mark.parametrize("signed", ["by the API", "by a backend"])
def test_a_page_reloaded_after_its_job_ended_hears_how_it_ended(make_stack: StackFactory, signed: str) -> None:
    # A new subscriber of an ended job's channel (the page reloaded, its connection came back)
    # was told nothing when the job had been followed live, or its late replay had gone: the
    # seed's React hook then stayed "queued" for good on a job that expired or was lost (its
    # status reconciliation knows no such states). Now the webhook brings it the result.
    stack = make_stack(WORKER_MAX_SANDBOXES="1", WORKER_WARMUP_MS="1500")
    api = Api(stack)
    secret = stack.pusher_secret if signed == "by a backend" else None
    try:
        ran = api.execute(py_job("print('hello')"))
        first = Realtime(stack)
        followed = first.follow(ran, signed_here=secret)
        api.start(ran)
        assert followed.wait_result(timeout_s=20)["outcome"] == "completed"
        expired = api.execute(py_job("print('never')"))
        followed = first.follow(expired, signed_here=secret)
        assert followed.wait_result(timeout_s=20)["outcome"] == "expired"  # (never started)
        first.close()
        for job in (ran, expired) * 2:  # (reloaded twice: each new subscription hears it)
            time.sleep(0.3)  # (soketi has seen the last subscriber go)
            again = Realtime(stack)
            try:
                heard = again.follow(job, signed_here=secret)
                result = heard.wait_result(timeout_s=10)
                time.sleep(0.3)  # (a second copy would have come by now)
                assert [name for name, _p in heard.events] == ["result"], heard.summary()
                assert result == api.status(job)["result"], (result, api.status(job))
            finally:
                again.close()
    finally:
        api.close()


@contextlib.contextmanager
def _second_api(stack: Stack, **env: str):  # type: ignore[no-untyped-def]
    """Another API process on the stack's Redis and soketi (soketi's webhooks still go to the
    first), with `env` on top of the stack's; yields its URL."""
    port = free_port()
    other = subprocess.Popen(
        [sys.executable, "-m", "api", "--host", "127.0.0.1", "--port", str(port)],
        env={**stack.env(), "API_PORT": str(port), **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the second API never answered"
            time.sleep(0.1)
        yield url
    finally:
        other.terminate()
        other.wait(10)


def test_a_page_reloaded_at_once_hears_the_result_whichever_api_signs_it(make_stack: StackFactory) -> None:
    # Two API processes. A page follows a job through the first (which also gets soketi's
    # webhooks), the job ends, and the page reloads at once, its new subscription signed by
    # the second. The first had marked the job moments before, and skipped the reload's
    # webhook by its own memory of that mark: the page heard nothing (6 of 6).
    stack = make_stack(WORKER_MAX_SANDBOXES="2")
    api = Api(stack)
    with _second_api(stack) as other_url:
        for _ in range(3):
            first = Realtime(stack)
            try:
                job = api.execute(py_job("print('hi')"))
                followed = first.follow(job)
                api.start(job)
                assert followed.wait_result(timeout_s=20)["outcome"] == "completed"
            finally:
                first.close()
            time.sleep(0.2)  # (soketi has seen the last subscriber go)
            again = Realtime(stack)
            again.pusher.auth_endpoint = f"{other_url}/v1/channel-auth"
            try:
                heard = again.follow(job)
                result = heard.wait_result(timeout_s=10)
                time.sleep(0.3)  # (a second copy would have come by now)
                assert [name for name, _p in heard.events] == ["result"], heard.summary()
                assert result == api.status(job)["result"]
            finally:
                again.close()
    api.close()


def test_a_subscriber_the_api_signed_as_the_job_ran_hears_its_result_once(make_stack: StackFactory) -> None:
    # Two API processes: one signs the subscription and starts the job, the other (soketi's
    # webhook target, slow for a moment) handles the subscription's channel_occupied after the
    # job ended. Taking it for a page reloaded after the end, it published the result again
    # to a subscriber who had heard it live. The signature is now known to every process.
    stack = make_stack(WORKER_MAX_SANDBOXES="2")
    api, rt = Api(stack), Realtime(stack)
    webhook_api = stack.procs["api"].pid
    try:
        with _second_api(stack) as other_url:
            signer = httpx.Client(base_url=other_url, headers={"Authorization": f"Bearer {stack.api_token}"})
            for _ in range(3):
                job = api.execute(py_job("print('hi')"))
                followed = Followed(job)
                channel = Channel(job["channel"], rt.pusher.connection)
                channel.bind("pusher_internal:subscription_succeeded", lambda _d, f=followed: f.subscribed.set())
                for event in Realtime.EVENTS:
                    channel.bind(event, lambda data, event=event, f=followed: f.add(event, data))
                rt.pusher.channels[job["channel"]] = channel
                rt._followed.append(followed)
                os.kill(webhook_api, signal.SIGSTOP)  # (soketi's webhook waits for it)
                try:
                    signed = signer.post("/v1/channel-auth", json={"socket_id": rt.pusher.connection.socket_id, "channel_name": job["channel"]})
                    assert signed.status_code == 200, signed.text
                    rt.pusher.connection.send_event("pusher:subscribe", {"channel": job["channel"], "auth": signed.json()["auth"]})
                    assert followed.subscribed.wait(10)
                    assert signer.post(f"/v1/jobs/{job['jobId']}/start").status_code == 202
                    assert followed.wait_result(timeout_s=20)["outcome"] == "completed"
                    time.sleep(0.3)
                finally:
                    os.kill(webhook_api, signal.SIGCONT)
                time.sleep(1.0)  # (the webhook handled; a second result would be here)
                assert len(followed.results()) == 1, followed.summary()
            signer.close()
    finally:
        rt.close()
        api.close()


SLOW_COUNT = "import time\nfor i in range(8):\n    print(i, flush=True)\n    time.sleep(0.25)\n"


def test_subscriptions_made_while_the_api_was_down_are_heard(make_stack: StackFactory) -> None:
    # Signed outside the API while it was down: soketi sends its channel_occupied webhook once,
    # it found nobody, and nothing else ever marked the job. The follower heard nothing of
    # either job, not even the result (3 of 3). The API's sweep now asks soketi which job
    # channels are followed and marks those the webhook never reported: a short job that
    # ended first is replayed, a longer one heard from where the mark came (its worker sends
    # what it logged unheard).
    stack = make_stack(WORKER_MAX_SANDBOXES="2", REALTIME_SWEEP_MS="300")
    api = Api(stack)
    short, longer = api.execute(py_job("print('hi')")), api.execute(py_job(SLOW_COUNT))
    api.close()
    secret = stack.env()["PUSHER_SECRET"]
    rt = Realtime(stack)
    try:
        stack.stop_process("api", signal.SIGKILL)
        followed = [rt.follow(job, signed_here=secret) for job in (short, longer)]
        time.sleep(0.5)  # (soketi's webhooks have failed by now)
        stack.restart("api")
        api = Api(stack)
        for job in (short, longer):
            api.start(job)
        for heard in followed:
            result = heard.wait_result(timeout_s=20)
            assert result["outcome"] == "completed", heard.summary()
            _heard_once_in_order(heard, result)
        assert "a lost webhook" in stack.log("api")
    finally:
        rt.close()
        api.close()


def test_a_kill_the_api_could_not_publish_reaches_the_follower(make_stack: StackFactory) -> None:
    # A queued job, followed, killed through an API process that cannot reach soketi (a port
    # that takes the connection and never answers; as one SIGKILLed before it published): it ended the job in
    # Redis, and the follower never heard the result. Its publish is now owed in Redis until
    # soketi took it, and a sweep sends it once due (the other API's: the first one's own
    # sweep cannot reach soketi either, and leaves it owed).
    stack = make_stack(with_worker=False, REALTIME_SWEEP_MS="300")
    api, rt = Api(stack), Realtime(stack)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        job = api.execute(py_job("print('never')"))
        followed = rt.follow(job)
        with _second_api(stack, PUSHER_PORT=str(silent.getsockname()[1]), PUSHER_TIMEOUT_MS="300") as doomed_url:
            doomed = httpx.Client(base_url=doomed_url, headers={"Authorization": f"Bearer {stack.api_token}"})
            assert doomed.post(f"/v1/jobs/{job['jobId']}/kill").status_code == 202
            doomed.close()
            result = followed.wait_result(timeout_s=10)  # (owed for 5 x 300 ms, then swept)
        assert result == api.status(job)["result"] and result["outcome"] == "killed", result
        time.sleep(0.5)
        assert len(followed.results()) == 1, followed.summary()
    finally:
        silent.close()
        rt.close()
        api.close()
