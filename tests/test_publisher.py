"""The worker's soketi publisher against a real soketi: through soketi's Redis adapter (the
stack's default), or over HTTP, where every delivery is its own connection (soketi closes
each after one answer) and the next one is dialled ahead of its event."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
import redis

from launcher.stack import free_port
from shared import keys
from shared.settings import load_settings
from tests.conftest import StackFactory
from tests.helpers import Api, Realtime, py_job, run_job, watched_commands
from worker.messaging import publisher as publisher_module
from worker.messaging.publisher import Publisher, _Event, adapter_channel

pytestmark = [pytest.mark.stack]


def test_each_delivery_finds_its_connection_dialled(make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    stack = make_stack(with_worker=False)
    api, rt = Api(stack), Realtime(stack)
    job = api.execute(py_job("print(1)"))  # no worker: it stays queued; only its channel is used
    channel = job["channel"]
    followed = rt.follow(job)
    looks: list[str] = []

    async def main() -> tuple[int, int]:
        publisher = Publisher(load_settings({**stack.env(), "PUSHER_PUBLISH": "http"}))
        ready_connection = publisher._ready_connection

        def recorded():  # type: ignore[no-untyped-def]
            found = ready_connection()
            looks.append("ready" if found is not None else "dial")
            return found

        monkeypatch.setattr(publisher, "_ready_connection", recorded)
        for i in range(5):
            await publisher.deliver([_Event(channel, "stdout", f'{{"chunk":"{i}\\n","seq":{i}}}')])
            await asyncio.sleep(0.05)  # the next connection is dialled meanwhile
        # A connection older than a server's idle timeout is not trusted: dialled again.
        publisher._idle = [(r, w, opened - 60) for r, w, opened in publisher._idle]
        await publisher.deliver([_Event(channel, "stdout", '{"chunk":"5\\n","seq":5}')])
        sent, failed = publisher.sent, publisher.failed
        await publisher.aclose()
        return sent, failed

    try:
        sent, failed = asyncio.run(main())
        assert (sent, failed) == (6, 0)
        deadline = time.monotonic() + 5
        while followed.text("stdout") != "".join(f"{i}\n" for i in range(6)):
            assert time.monotonic() < deadline, followed.summary()
            time.sleep(0.02)
        # The first delivery and the one after the stale connection dialled for themselves;
        # every other found a connection dialled ahead of it.
        assert looks == ["dial", "ready", "ready", "ready", "ready", "dial"], looks
    finally:
        rt.close()
        api.close()
    assert publisher_module.IDLE_CONNECTION_S < 10  # under uWS's idle timeout


def test_a_result_in_the_batch_being_paced_still_goes_when_close_runs_out_of_time(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A lane paced to a slow rate holds its last batch (output and the result) back; close()
    # gives up waiting before it is sent. The output may be dropped, the result may not.
    monkeypatch.setattr(publisher_module, "LANE_BURST_BYTES", 1024)
    monkeypatch.setattr(publisher_module, "LANE_RATE_BYTES_S", 8 * 1024)
    stack = make_stack(with_worker=False)
    api, rt = Api(stack), Realtime(stack)
    job = api.execute(py_job("print(1)"))  # no worker: only its channel is used
    followed = rt.follow(job)
    chunk = "x" * 8000

    async def main() -> None:
        publisher = Publisher(load_settings({**stack.env(), "PUSHER_PUBLISH": "http"}))
        lane = publisher.lane(job["channel"])
        for seq in range(3):
            lane.send("stdout", f'{{"chunk":"{chunk}","seq":{seq}}}'.encode())
        lane.send("result", b'{"outcome":"completed","seq":3}')
        await asyncio.sleep(0.2)  # the drain has taken the batch and is pacing it (~3 s)
        await lane.close(timeout_s=0.3)
        await publisher.aclose()

    try:
        asyncio.run(main())
        assert followed.finished.wait(5), followed.summary()
        assert [p["seq"] for n, p in followed.events if n == "result"] == [3]
    finally:
        rt.close()
        api.close()


def test_after_a_failed_delivery_output_pauses_but_a_result_still_goes(
    make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One delivery that timed out (a soketi stalled for a moment) pauses live delivery for
    # BACKOFF_S. Another job that ends in that window must still get its result live: a
    # pusher-js client that sees no later event never learns of a gap to read from the log.
    stack = make_stack(with_worker=False)
    api, rt = Api(stack), Realtime(stack)
    job = api.execute(py_job("print(1)"))  # no worker: only its channel is used
    followed = rt.follow(job)

    async def main() -> tuple[int, int]:
        publisher = Publisher(load_settings({**stack.env(), "PUSHER_PUBLISH": "http"}))
        request = publisher._request
        calls = 0

        async def first_times_out(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            if calls == 1:
                raise TimeoutError
            return await request(*args, **kwargs)

        monkeypatch.setattr(publisher, "_request", first_times_out)
        await publisher.deliver([_Event("private-run-someone-else", "stdout", '{"chunk":"a","seq":1}')])
        await publisher.deliver([
            _Event(job["channel"], "stdout", '{"chunk":"dropped\\n","seq":0}'),
            _Event(job["channel"], "result", '{"outcome":"completed","seq":1}'),
        ])  # fmt: skip
        counts = publisher.sent, publisher.dropped
        await publisher.aclose()
        return counts

    try:
        sent, dropped = asyncio.run(main())
        assert (sent, dropped) == (1, 1)
        assert followed.finished.wait(5), followed.summary()
        assert [n for n, _ in followed.events] == ["result"]
    finally:
        rt.close()
        api.close()


def test_a_soketi_that_stays_down_is_logged_once_per_pause_not_per_event(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> int:
        publisher = Publisher(load_settings({"PUSHER_SECRET": "s" * 16, "PUSHER_PUBLISH": "http"}))

        async def down(*_args, **_kwargs):  # type: ignore[no-untyped-def]
            raise ConnectionRefusedError

        monkeypatch.setattr(publisher, "_request", down)
        for i in range(20):  # twenty jobs ending while soketi is down: each result is tried
            await publisher.deliver([_Event(f"private-run-{i}", "result", '{"seq":1}')])
        failed = publisher.failed
        await publisher.aclose()
        return failed

    with caplog.at_level("DEBUG", logger="worker.messaging.publisher"):
        assert asyncio.run(main()) == 20
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "soketi unreachable" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


def test_a_stalled_soketi_holds_up_one_probe_at_a_time_and_is_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # soketi takes connections but does not answer: each delivery times out. During the
    # pause one result at a time goes as a probe; the others do not each wait out the
    # timeout (every job's task would live that much longer), and the log says it once.
    monkeypatch.setattr(publisher_module, "BACKOFF_S", 0.2)

    async def main() -> tuple[int, int, float]:
        publisher = Publisher(load_settings({"PUSHER_SECRET": "s" * 16, "PUSHER_PUBLISH": "http", "PUSHER_TIMEOUT_MS": "200"}))
        attempts = 0

        async def stalled(*_args, **_kwargs):  # type: ignore[no-untyped-def]
            nonlocal attempts
            attempts += 1
            await asyncio.sleep(60)

        monkeypatch.setattr(publisher, "_request", stalled)
        await publisher.deliver([_Event("private-run-first", "result", '{"seq":1}')])  # the failure
        started = time.monotonic()
        await asyncio.gather(*(publisher.deliver([_Event(f"private-run-{i}", "result", '{"seq":1}')]) for i in range(10)))
        took = time.monotonic() - started
        for _ in range(3):  # probes one after another, each timing out within the pause it began in
            await publisher.deliver([_Event("private-run-later", "result", '{"seq":1}')])
        await publisher.aclose()
        return attempts, publisher.dropped, took

    with caplog.at_level("DEBUG", logger="worker.messaging.publisher"):
        attempts, dropped, took = asyncio.run(main())
    assert attempts == 1 + 1 + 3 and dropped == 9, (attempts, dropped)
    assert took < 0.5, took  # the ten together waited for one probe, not ten
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "soketi unreachable" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


async def _paused_publisher(monkeypatch: pytest.MonkeyPatch, answer_s: float) -> tuple[Publisher, list[str]]:
    """A publisher just paused (its first delivery timed out), over a soketi that now
    answers each request after `answer_s`; the channels it was handed, as they are."""
    monkeypatch.setattr(publisher_module, "BACKOFF_S", 5.0)
    publisher = Publisher(load_settings({"PUSHER_SECRET": "s" * 16, "PUSHER_PUBLISH": "http", "PUSHER_TIMEOUT_MS": "200"}))
    delivered: list[str] = []
    stalled = True

    async def soketi(_path: str, _params: Any, body: bytes) -> tuple[int, bytes]:
        if stalled:
            await asyncio.sleep(60)
        await asyncio.sleep(answer_s)
        delivered.append(json.loads(body)["channel"])
        return 200, b"{}"

    monkeypatch.setattr(publisher, "_request", soketi)
    await publisher.deliver([_Event("private-run-first", "result", '{"seq":1}')])  # times out: the pause
    stalled = False
    return publisher, delivered


def _result(job: str) -> list[_Event]:
    return [_Event(f"private-run-{job}", "result", '{"seq":1}')]


def test_two_results_in_one_pause_both_go_once_soketi_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    # After one failed delivery, a second job's result that came while the first job's went
    # as the pause's probe was dropped, soketi answering or not: its follower had no later
    # seq to notice the loss by, and waited for a result that never came.
    async def main() -> tuple[list[str], int]:
        # (An answer takes a moment: the second result comes meanwhile.)
        publisher, delivered = await _paused_publisher(monkeypatch, answer_s=0.05)
        await asyncio.gather(publisher.deliver(_result("a")), publisher.deliver(_result("b")))
        await publisher.aclose()
        return sorted(delivered), publisher.dropped

    delivered, dropped = asyncio.run(main())
    assert delivered == ["private-run-a", "private-run-b"] and dropped == 0, (delivered, dropped)


def test_a_result_waiting_on_a_probe_its_job_gave_up_on_goes_as_the_next_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    # The probe's own lane closed (its timeout) and cancelled it: soketi had told nothing,
    # yet another job's result waiting on it was shed as though the probe had failed.
    async def main() -> tuple[list[str], int]:
        publisher, delivered = await _paused_publisher(monkeypatch, answer_s=0.1)
        probe = asyncio.create_task(publisher.deliver(_result("a")))
        await asyncio.sleep(0.02)
        waiting = asyncio.create_task(publisher.deliver(_result("b")))
        await asyncio.sleep(0.02)
        probe.cancel()  # (job a's lane gave up on it)
        await asyncio.gather(probe, return_exceptions=True)
        await waiting
        await publisher.aclose()
        return delivered, publisher.dropped

    delivered, dropped = asyncio.run(main())
    assert delivered == ["private-run-b"] and dropped == 0, (delivered, dropped)


def test_a_result_soketi_surely_never_had_stays_owed_and_is_sent_again_from_the_log(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Job b's result waits on job a's probe in a pause; the probe times out and b's result
    is shed, never sent. Its lane used to close saying nothing, and the worker stopped owing
    it: a client that stayed subscribed waited for good. The lane now says it was lost, and
    OwedResults sends it again from the log once soketi answers; a result that may have got
    through (a timeout) is never sent twice."""
    from worker.messaging import owed as owed_module
    from worker.messaging.owed import OwedResults

    monkeypatch.setattr(owed_module, "RETRY_S", (0.05, *[0.1] * 9))

    async def main() -> tuple[bool, bool, list[str], list[str], int]:
        monkeypatch.setattr(publisher_module, "BACKOFF_S", 5.0)
        publisher = Publisher(load_settings({"PUSHER_SECRET": "s" * 16, "PUSHER_PUBLISH": "http", "PUSHER_TIMEOUT_MS": "200"}))
        delivered: list[str] = []
        mode = "stalled"

        async def soketi(_path: str, _params: Any, body: bytes) -> tuple[int, bytes]:
            if mode == "stalled":
                await asyncio.sleep(60)  # (every request times out)
            if mode == "refusing":
                return 503, b"busy"
            delivered.append(json.loads(body)["channel"])
            return 200, b"{}"

        monkeypatch.setattr(publisher, "_request", soketi)
        await publisher.deliver(_result("first"))  # times out: the pause
        lane_a, lane_b = publisher.lane("private-run-a"), publisher.lane("private-run-b")
        for lane in (lane_a, lane_b):
            lane._audience = True  # (followed: a client subscribed)
        lane_a.send("result", b'{"seq":1}')  # the pause's probe: it times out (it may have got there)
        await asyncio.sleep(0.05)
        lane_b.send("result", b'{"seq":1}')  # waits on a's probe, and is shed when it fails
        await asyncio.gather(lane_a.close(2), lane_b.close(2))
        lost = (lane_a.result_lost, lane_b.result_lost)

        class Queue:
            gone: list[str] = []

            async def last_result(self, job_id: str) -> bytes:
                return b'{"seq":1,"outcome":"completed"}'

            def delivered(self, job_id: str) -> None:
                self.gone.append(job_id)

        queue = Queue()
        mode = "refusing"  # (the first attempt again: surely not had, so owed still)
        publisher._down_until = 0.0
        owed = OwedResults(queue, publisher, 2.0)  # type: ignore[arg-type]
        runner = asyncio.create_task(owed.run())
        owed.owe("b")
        await asyncio.sleep(0.3)
        assert queue.gone == [] and len(owed) == 1
        mode = "answering"
        for _ in range(100):
            if queue.gone:
                break
            await asyncio.sleep(0.02)
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await publisher.aclose()
        return lost[0], lost[1], delivered, queue.gone, owed.sent_again

    lost_a, lost_b, delivered, gone, sent_again = asyncio.run(main())
    assert (lost_a, lost_b) == (False, True)  # (a's may have reached soketi: never sent twice)
    assert delivered == ["private-run-b"] and gone == ["b"] and sent_again == 1, (delivered, gone, sent_again)


def _deliver_five(stack_env: dict[str, str], channel: str) -> tuple[int, int, int]:
    """Deliver five stdout events one by one; (sent, of them through Redis, failed)."""

    async def main() -> tuple[int, int, int]:
        publisher = Publisher(load_settings(stack_env))
        for i in range(5):
            await publisher.deliver([_Event(channel, "stdout", f'{{"chunk":"{i}\\n","seq":{i}}}')])
        counts = publisher.sent, publisher.sent_via_redis, publisher.failed
        await publisher.aclose()
        return counts

    return asyncio.run(main())


@pytest.mark.parametrize("prefix", ["", "nobody-listens", "redis-unreachable"])
def test_events_go_through_soketis_redis_adapter_or_else_http(make_stack: StackFactory, prefix: str) -> None:
    # The stack's soketi listens on its Redis adapter's channel: a PUBLISH there reaches
    # every subscriber with no HTTP request. Where no soketi node listens (here: another
    # prefix), PUBLISH reaches nobody and each event goes over HTTP instead, once. Where the
    # publisher cannot reach Redis at all (restarting: its connection refused), nothing was
    # sent, and each event goes over HTTP too (they were dropped, a result with them).
    stack = make_stack(with_worker=False)
    api, rt = Api(stack), Realtime(stack)
    job = api.execute(py_job("print(1)"))  # no worker: only its channel is used
    followed = rt.follow(job)
    env = {**stack.env(), "PUSHER_PUBLISH": "redis"}
    if prefix == "redis-unreachable":
        env["REDIS_URL"] = f"redis://:{stack.redis_password}@127.0.0.1:{free_port()}/0"  # (nothing listens)
    else:
        env["PUSHER_REDIS_PREFIX"] = prefix
    try:
        sent, via_redis, failed = _deliver_five(env, job["channel"])
        assert (sent, via_redis, failed) == (5, 5 if prefix == "" else 0, 0)
        deadline = time.monotonic() + 5
        while followed.text("stdout") != "".join(f"{i}\n" for i in range(5)):
            assert time.monotonic() < deadline, followed.summary()
            time.sleep(0.02)
        time.sleep(0.2)
        assert [p["seq"] for n, p in followed.events if n == "stdout"] == list(range(5)), followed.summary()
    finally:
        rt.close()
        api.close()


class _RedisDyingOnPublish:
    """A loopback proxy to the stack's Redis that passes everything on until a PUBLISH comes,
    then drops the connection without passing it on or answering: Redis killed with the
    command in flight, as seen by the one who sent it."""

    def __init__(self, redis_port: int) -> None:
        self._redis_port = redis_port
        self.port = free_port()
        self.cut = 0
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self._thread.start()
        assert ready.wait(5)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", self.port))
        ready.set()
        self._loop.run_forever()

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        redis_r, redis_w = await asyncio.open_connection("127.0.0.1", self._redis_port)

        async def upstream() -> None:
            while data := await client_r.read(65536):
                if b"PUBLISH" in data.upper():
                    self.cut += 1
                    return
                redis_w.write(data)

        async def downstream() -> None:
            while data := await redis_r.read(65536):
                client_w.write(data)

        pumps = [asyncio.ensure_future(upstream()), asyncio.ensure_future(downstream())]
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        for pump in pumps:
            pump.cancel()
        client_w.close()
        redis_w.close()

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def test_events_whose_publish_lost_redis_midway_go_over_http_but_never_a_result(make_stack: StackFactory) -> None:
    # Redis died with a batch's PUBLISH in flight: the batch was dropped whole, so a live
    # follower missed output that Redis most likely never passed on (one full-suite run in
    # three lost the tail of a job's stdout as Redis was killed). Output and stages now go
    # again over HTTP (a client drops a seq it already has); an artifact or the result,
    # which a client may act on twice, does not.
    stack = make_stack(with_worker=False)
    api, rt = Api(stack), Realtime(stack)
    job = api.execute(py_job("print(1)"))  # no worker: only its channel is used
    followed = rt.follow(job)
    proxy = _RedisDyingOnPublish(stack.redis_port)
    env = {**stack.env(), "PUSHER_PUBLISH": "redis",
           "REDIS_URL": f"redis://:{stack.redis_password}@127.0.0.1:{proxy.port}/0"}  # fmt: skip
    channel = job["channel"]
    batch = [
        _Event(channel, "stdout", '{"chunk":"0\\n","seq":0}'),
        _Event(channel, "stderr", '{"chunk":"1\\n","seq":1}'),
        _Event(channel, "artifact", '{"name":"a.txt","mimeType":"text/plain","bytes":1,"url":"/a","seq":2}'),
        _Event(channel, "stage", '{"phase":"running","seq":3}'),
        _Event(channel, "result", '{"outcome":"completed","seq":4}'),
    ]

    async def main() -> tuple[int, int, int]:
        publisher = Publisher(load_settings(env))
        await publisher.deliver(batch)
        counts = publisher.sent, publisher.sent_via_redis, publisher.failed
        await publisher.aclose()
        return counts

    try:
        sent, via_redis, failed = asyncio.run(main())
        assert proxy.cut == 1, proxy.cut
        assert (sent, via_redis, failed) == (3, 0, 2), (sent, via_redis, failed)
        deadline = time.monotonic() + 5
        while followed.text("stdout") + followed.text("stderr") != "0\n1\n" or not any(
            name == "stage" for name, _ in followed.events
        ):
            assert time.monotonic() < deadline, followed.summary()
            time.sleep(0.02)
        time.sleep(0.3)
        # Output and the stage (a client shows them once, had it had them); never the
        # artifact or the result a second time.
        assert sorted(name for name, _ in followed.events) == ["stage", "stderr", "stdout"], followed.summary()
    finally:
        proxy.close()
        rt.close()
        api.close()


def test_the_stacks_workers_publish_through_redis(make_stack: StackFactory) -> None:
    # `make up` and every test stack run soketi on its Redis adapter and the workers with
    # PUSHER_PUBLISH=redis: a followed job's events all appear on the adapter's channel,
    # published by the worker, each once and in order. Its output is published by the very
    # script that logs it (JobLane.direct_mode), with the stages held back before it, and
    # its result by the script that stores it.
    stack = make_stack()
    seen: list[dict[str, object]] = []
    listening = threading.Event()

    def listen() -> None:
        with redis.Redis.from_url(stack.redis_url).pubsub() as pubsub:
            pubsub.subscribe(adapter_channel(""))
            listening.set()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                message = pubsub.get_message(timeout=0.1)
                if message and message["type"] == "message":
                    seen.append(json.loads(message["data"]))
                    if json.loads(seen[-1]["data"])["event"] == "result":  # type: ignore[arg-type]
                        return

    listener = threading.Thread(target=listen, daemon=True)
    listener.start()
    assert listening.wait(5)
    api, rt = Api(stack), Realtime(stack)
    scripted: list[str] = []
    try:
        job = api.execute(py_job("print(1)"))
        followed = rt.follow(job)
        with watched_commands(stack, scripted):
            api.start(job)
            result = followed.wait_result()
        listener.join(10)
        assert result["outcome"] == "completed" and followed.text("stdout") == "1\n"
        published = [command for command in scripted if command.startswith("PUBLISH") and job["channel"] in command]
        assert any("stdout" in command and "result" not in command for command in published), (published, scripted[-20:])
        assert any("result" in command for command in published), (published, scripted[-20:])
        with stack.redis() as r:
            assert r.keys(keys.worker_unpublished_key("*")) == []  # (not owed: it went)
        # (soketi itself also PUBLISHes there what reaches it over HTTP, for its other nodes,
        # under its own uuid.)
        ours = [m for m in seen if str(m["uuid"]).startswith("coderunner-worker-") and m["channel"] == job["channel"]]
        frames = [json.loads(m["data"]) for m in ours]  # type: ignore[arg-type]
        assert [(f["event"], json.loads(f["data"])["seq"]) for f in frames] == [
            (name, payload["seq"]) for name, payload in followed.events
        ], (frames, followed.summary())
        assert frames[-1]["event"] == "result"
    finally:
        rt.close()
        api.close()


def test_a_stack_publishing_over_http_still_streams(make_stack: StackFactory) -> None:
    # PUSHER_PUBLISH=http: for a Pusher-protocol server that is not soketi on this Redis.
    stack = make_stack(PUSHER_PUBLISH="http")
    api, rt = Api(stack), Realtime(stack)
    try:
        result, followed = run_job(api, rt, py_job("print(1)\nprint(2)"))
        assert result["outcome"] == "completed" and followed.text("stdout") == "1\n2\n", followed.summary()
    finally:
        rt.close()
        api.close()


def test_a_pause_that_begins_again_as_its_probe_is_answered_has_one_probe_out(monkeypatch: pytest.MonkeyPatch) -> None:
    # The probe was answered and woke the two results waiting on it; another delivery failed
    # in that same moment, so a pause was on again. Both waiters became "the" probe, the
    # second replacing the first: two requests out at once during a pause, and the first
    # probe's answer settled the second's waiters.
    async def main() -> tuple[list[str], int, int]:
        publisher, delivered = await _paused_publisher(monkeypatch, answer_s=0.05)
        out = most_out = 0

        async def soketi(_path: str, _params: Any, body: bytes) -> tuple[int, bytes]:
            nonlocal out, most_out
            out += 1
            most_out = max(most_out, out)
            await asyncio.sleep(0.05)
            out -= 1
            delivered.append(json.loads(body)["channel"])
            return 200, b"{}"

        monkeypatch.setattr(publisher, "_request", soketi)
        probe = asyncio.create_task(publisher.deliver(_result("a")))
        await asyncio.sleep(0.01)
        waiters = [asyncio.create_task(publisher.deliver(_result(job))) for job in ("b", "c")]
        await asyncio.sleep(0.01)

        def another_delivery_failed(_probe: object) -> None:
            # (Runs after the waiters' wake-ups are set off, before they run: what a failure
            # elsewhere does to the publisher.)
            publisher._down_until = time.monotonic() + 5.0

        publisher._probe.add_done_callback(another_delivery_failed)  # type: ignore[union-attr]
        await asyncio.wait_for(asyncio.gather(probe, *waiters), 5)
        await publisher.aclose()
        return sorted(delivered), publisher.dropped, most_out

    delivered, dropped, most_out = asyncio.run(main())
    assert delivered == ["private-run-a", "private-run-b", "private-run-c"] and dropped == 0, (delivered, dropped)
    assert most_out == 1, most_out
