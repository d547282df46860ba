"""The worker's soketi publisher against a real soketi: every delivery is its own connection
(soketi closes each after one answer), and the next one is dialled ahead of its event."""

from __future__ import annotations

import asyncio
import time

import pytest

from shared.settings import load_settings
from tests.conftest import StackFactory
from tests.helpers import Api, Realtime, py_job
from worker.messaging import publisher as publisher_module
from worker.messaging.publisher import Publisher, _Event

pytestmark = [pytest.mark.stack]


def test_each_delivery_finds_its_connection_dialled(make_stack: StackFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    stack = make_stack(with_worker=False)
    api, rt = Api(stack), Realtime(stack)
    job = api.execute(py_job("print(1)"))  # no worker: it stays queued; only its channel is used
    channel = job["channel"]
    followed = rt.follow(job)
    looks: list[str] = []

    async def main() -> tuple[int, int]:
        publisher = Publisher(load_settings(stack.env()))
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
        publisher = Publisher(load_settings(stack.env()))
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
