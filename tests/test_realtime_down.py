"""soketi is only the live view: with it dead or hanging, jobs still run at full speed and
the durable log and status stay complete."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tests.conftest import StackFactory
from tests.helpers import Api, py_job

pytestmark = [pytest.mark.stack, pytest.mark.sandbox, pytest.mark.slow]


def _run_without_live_view(api: Api) -> float:
    job = api.execute(py_job("import sys\nfor i in range(50): print(i)\nprint('e', file=sys.stderr)\n"))
    t0 = time.monotonic()
    api.start(job)
    status = api.wait_state(job, {"done", "error"}, timeout_s=10)
    took = time.monotonic() - t0
    assert status["result"]["outcome"] == "completed"
    log = api.replay(job)
    assert [p["seq"] for _, p in log] == list(range(len(log)))
    stdout = "".join(p["chunk"] for n, p in log if n == "stdout")
    assert stdout == "".join(f"{i}\n" for i in range(50))
    return took


def test_dead_soketi_does_not_stall_jobs(make_stack: StackFactory) -> None:
    stack = make_stack()
    api = Api(stack)
    try:
        stack.stop_process("soketi")
        for _ in range(3):
            assert _run_without_live_view(api) < 1.5
    finally:
        api.close()


def test_hanging_soketi_does_not_stall_jobs(make_stack: StackFactory) -> None:
    # A server that accepts connections and never answers: the worst kind of slow.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(100)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    stack = make_stack(PUSHER_PORT=str(listener.getsockname()[1]), PUSHER_TIMEOUT_MS="1000")
    api = Api(stack)
    try:
        for _ in range(3):
            assert _run_without_live_view(api) < 1.5
    finally:
        api.close()
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        listener.close()
