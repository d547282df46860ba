"""Redis connections dropping under a running job must not lose or double anything."""

from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import StackFactory
from tests.helpers import Api, Realtime, py_job

pytestmark = [pytest.mark.stack, pytest.mark.sandbox, pytest.mark.slow]


def test_client_connections_killed_during_a_run(make_stack: StackFactory) -> None:
    stack = make_stack()
    api, rt = Api(stack), Realtime(stack)
    stop = threading.Event()

    def sever() -> None:
        with stack.redis() as redis:
            while not stop.is_set():
                try:
                    # Every client but this one loses its connection (the worker's included).
                    redis.client_kill_filter(_type="normal", skipme=True)
                except Exception:
                    pass
                time.sleep(0.1)

    try:
        job = api.execute(py_job("import time\nfor i in range(40):\n    print(i, flush=True)\n    time.sleep(0.025)\n", collectOutput=True))
        followed = rt.follow(job)
        api.start(job)
        thread = threading.Thread(target=sever, daemon=True)
        thread.start()
        time.sleep(1.5)
        stop.set()
        thread.join()
        status = api.wait_state(job, {"done", "error", "killed", "lost"}, timeout_s=20)
        assert status["result"]["outcome"] == "completed", status
        log = api.replay(job)
        assert [p["seq"] for _, p in log] == list(range(len(log)))
        assert [n for n, _ in log].count("result") == 1
        assert "".join(p["chunk"] for n, p in log if n == "stdout") == "".join(f"{i}\n" for i in range(40))
        output = api.get(f"/v1/jobs/{job['jobId']}/output").json()
        assert output["stdout"] == "".join(f"{i}\n" for i in range(40))
        time.sleep(0.5)
        assert len(followed.results()) <= 1
        # The worker is still serving.
        nxt = api.execute(py_job("print('after')"))
        f2 = rt.follow(nxt)
        api.start(nxt)
        assert f2.wait_result()["outcome"] == "completed"
    finally:
        stop.set()
        rt.close()
        api.close()
