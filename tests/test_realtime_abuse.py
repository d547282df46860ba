"""One realtime client must not hurt the others: soketi is public (anyone with the app key,
which `GET /v1/realtime` shows, may open a WebSocket), and what a client sends it reaches the
API through soketi's webhooks."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
import websocket

from api import store as store_module
from tests.conftest import StackFactory
from tests.helpers import Api, Realtime, py_job

pytestmark = [pytest.mark.stack, pytest.mark.sandbox]

# Each of these stopped soketi 1.6.1 (an uncaught TypeError in its message handler), and every
# follower's connection with it; the last three are shapes of the same kind it would read too.
MALFORMED = [
    {"event": "pusher:subscribe"},
    {"event": "pusher:unsubscribe"},
    {"event": "pusher:subscribe", "data": {"channel": 7}},
    {"event": "pusher:subscribe", "data": {"channel": "private-run-x", "auth": 5}},
    {"event": "pusher:signin", "data": "x"},
    {"event": ["pusher:subscribe"], "data": {}},
]


def _raw_socket(stack, receive_buffer: int | None = None) -> websocket.WebSocket:  # type: ignore[no-untyped-def]
    """A bare WebSocket to soketi (its socket id as `socket_id`); with `receive_buffer`, the
    kernel holds at most that much for it unread (a small one: soketi feels a reader stop)."""
    sockopt = [(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)] if receive_buffer else []
    ws = websocket.create_connection(
        f"ws://127.0.0.1:{stack.soketi_port}/app/{stack.pusher_key}?protocol=7&client=js&version=8.4.0",
        timeout=5, sockopt=sockopt,
    )  # fmt: skip
    established = json.loads(ws.recv())
    assert established["event"] == "pusher:connection_established"
    ws.socket_id = json.loads(established["data"])["socket_id"]  # type: ignore[attr-defined]
    return ws


def test_a_malformed_client_message_is_refused_and_soketi_stays_up(make_stack: StackFactory) -> None:
    stack = make_stack(WORKER_MAX_SANDBOXES="2")
    api, rt = Api(stack), Realtime(stack)
    try:
        job = api.execute(py_job("import time\nfor i in range(6):\n    print(i, flush=True)\n    time.sleep(0.2)\n"))
        followed = rt.follow(job)
        api.start(job)
        attacker = _raw_socket(stack)
        for message in MALFORMED:
            attacker.send(json.dumps(message))
            answer = json.loads(attacker.recv())
            assert answer["event"] == "pusher:error" and answer["data"]["code"] == 4300, (message, answer)
        attacker.send(json.dumps({"event": "pusher:ping", "data": {}}))
        assert json.loads(attacker.recv())["event"] == "pusher:pong"  # (the attacker's connection stays, too)
        attacker.close()
        result = followed.wait_result(timeout_s=20)
        assert result["outcome"] == "completed"
        assert "".join(p["chunk"] for n, p in followed.events if n == "stdout") == "".join(f"{i}\n" for i in range(6))
        assert stack.procs["soketi"].poll() is None, stack.log("soketi")[-2000:]
        again = rt.follow(api.execute(py_job("print('after')")))  # (and it still admits subscribers)
        api.start(again.job)
        assert again.wait_result(timeout_s=20)["outcome"] == "completed"
    finally:
        rt.close()
        api.close()


def test_a_subscribe_storm_on_an_ended_jobs_channel_costs_little_and_breaks_nothing(make_stack: StackFactory) -> None:
    # A job-token holder signs its ended job's channel once, then subscribes and unsubscribes in
    # a loop: each cycle is a new first subscriber, so soketi sent the API a webhook and the API
    # published the result back, thousands a second. The API stopped answering for minutes,
    # and after a long storm its publisher to soketi stayed wedged until restart. soketi now
    # batches its webhooks (one request every 25 ms), the API handles a channel once a batch
    # and sends a result again at most every RESEND_GAP_MS (one sooner goes when it is over).
    stack = make_stack(WORKER_MAX_SANDBOXES="2", REALTIME_SWEEP_MS="300")
    api = Api(stack)
    job = api.execute(py_job("print('hi')"))
    api.start(job)
    assert api.wait_state(job, {"done"})["result"]["outcome"] == "completed"
    attacker = _raw_socket(stack)
    socket_id = attacker.socket_id  # type: ignore[attr-defined]
    signed = api.client.post(
        "/v1/channel-auth", json={"socket_id": socket_id, "channel_name": job["channel"]}, headers=api.headers(job["jobToken"])
    )
    assert signed.status_code == 200, signed.text
    subscribe = json.dumps({"event": "pusher:subscribe", "data": {"channel": job["channel"], "auth": signed.json()["auth"]}})
    unsubscribe = json.dumps({"event": "pusher:unsubscribe", "data": {"channel": job["channel"]}})
    results = []

    def read() -> None:
        try:
            while raw := attacker.recv():  # ('' once the socket is closed)
                message = json.loads(raw)
                if message.get("event") == "result":
                    results.append(message)
        except (websocket.WebSocketException, OSError):
            pass

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    slowest_health = 0.0
    began = time.monotonic()
    cycles = 0
    with httpx.Client(base_url=stack.api_url, timeout=10) as health:
        while time.monotonic() - began < 3:
            for _ in range(200):
                attacker.send(subscribe)
                attacker.send(unsubscribe)
            cycles += 200
            asked = time.monotonic()
            assert health.get("/health").status_code == 200
            slowest_health = max(slowest_health, time.monotonic() - asked)
    attacker.close()
    assert cycles > 2000, cycles  # (a storm, not a drizzle)
    assert slowest_health < 1.0, f"/health took {slowest_health:.2f} s during the storm"
    # About one result per gap, and one per sweep for those within a gap: not one per cycle.
    assert len(results) <= 3 / (store_module.RESEND_GAP_MS / 1000) + 3 / 0.3 + 2, len(results)
    # Afterwards the API still publishes what it must: a page reloaded hears the result once,
    # and a new job's follower hears it live.
    time.sleep(1.0)
    rt = Realtime(stack)
    try:
        reloaded = rt.follow(job)
        assert reloaded.wait_result(timeout_s=10) == api.status(job)["result"]
        fresh = rt.follow(api.execute(py_job("print('after')")))
        api.start(fresh.job)
        assert fresh.wait_result(timeout_s=20)["outcome"] == "completed"
        time.sleep(1.0)
        assert len(reloaded.results()) == 1, reloaded.summary()
    finally:
        rt.close()
        api.close()


def test_a_subscriber_that_stops_reading_is_let_go_and_a_huge_message_refused(make_stack: StackFactory) -> None:
    # soketi kept up to 1 MiB of unsent events for each subscriber that stopped reading, for as
    # long as it stayed: a few dozen held a hundred MB and slowed every other follower. Such a
    # connection is now closed once 1 MiB waits; and a client message past 64 KiB (soketi took
    # 100 MiB) ends its connection too. The follower who reads hears everything.
    stack = make_stack(WORKER_MAX_SANDBOXES="2")
    api, rt = Api(stack), Realtime(stack)
    try:
        # 8 MB: past what the kernel's socket buffers take for the stalled reader, then 1 MiB more.
        program = "import sys\nfor i in range(80):\n    sys.stdout.write(str(i % 10) * 100_000 + '\\n')\n"
        job = api.execute(py_job(program, limits={"outputKb": 16384}))
        reader = rt.follow(job)
        stalled = _raw_socket(stack, receive_buffer=16 * 1024)
        signed = api.client.post(
            "/v1/channel-auth", json={"socket_id": stalled.socket_id, "channel_name": job["channel"]}, headers=api.headers()  # type: ignore[attr-defined]
        )
        stalled.send(json.dumps({"event": "pusher:subscribe", "data": {"channel": job["channel"], "auth": signed.json()["auth"]}}))
        api.start(job)
        assert reader.wait_result(timeout_s=30)["outcome"] == "completed"
        heard = "".join(p["chunk"] for n, p in reader.events if n == "stdout")
        assert heard == "".join(str(i % 10) * 100_000 + "\n" for i in range(80))
        # Only now does the stalled socket read: what soketi sent before it let go, then the end.
        stalled.settimeout(5)
        with pytest.raises(websocket.WebSocketConnectionClosedException):
            while True:
                stalled.recv()
        huge = _raw_socket(stack)
        huge.send(json.dumps({"event": "pusher:ping", "data": {"pad": "x" * 100_000}}))
        with pytest.raises((websocket.WebSocketConnectionClosedException, ConnectionError)):
            while True:
                huge.recv()
        assert stack.procs["soketi"].poll() is None
    finally:
        rt.close()
        api.close()
