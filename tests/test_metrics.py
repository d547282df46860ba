"""GET /metrics: queue depth and slot use for operators, in Prometheus' text format."""

from __future__ import annotations

import re
import time

import httpx
import pytest

from api.metrics import FleetSnapshot, render
from shared.messages import WorkerInfo, WorkerLoad
from tests.conftest import StackFactory
from tests.helpers import Api, py_job

_SAMPLE = re.compile(r'^(?P<name>[a-z_]+)(?:\{(?P<labels>[^}]*)\})? (?P<value>-?\d+)$')


def parse(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], int]:
    """Samples by (name, labels); every line must be a comment or a well-formed sample."""
    samples = {}
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        match = _SAMPLE.match(line)
        assert match, f"not a Prometheus sample line: {line!r}"
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match["labels"] or ""))
        samples[(match["name"], labels)] = int(match["value"])
    return samples


def test_the_text_is_prometheus_exposition_with_escaped_labels() -> None:
    load = WorkerLoad(
        jobs_claimed=5, jobs_waiting_for_sandbox=1, sandboxes_ready=2, sandboxes_building=1, sandboxes_in_use=5,
        sandbox_builds_failed=3, steps_waiting_for_memory=2,
    )  # fmt: skip
    odd = WorkerInfo(worker_id='w"1\\\n', slots=8, runtimes=[], started_at_ms=0, load=load)
    old = WorkerInfo(worker_id="w2", slots=4, runtimes=[], started_at_ms=0)  # no load reported yet
    text = render(FleetSnapshot(queue_depth=7, callbacks_due=2, workers=[(odd, 5), (old, 1)], ended={"done": 9}))
    samples = parse(text)
    assert samples[("coderunner_queue_depth", frozenset())] == 7
    assert samples[("coderunner_slots", frozenset())] == 12
    assert samples[("coderunner_slots_in_use", frozenset())] == 5
    assert samples[("coderunner_jobs_claimed", frozenset())] == 6
    assert samples[("coderunner_steps_waiting_for_memory", frozenset())] == 2
    assert samples[("coderunner_jobs_ended_total", frozenset({("state", "done")}))] == 9
    escaped = 'w\\"1\\\\\\n'
    assert samples[("coderunner_worker_sandboxes", frozenset({("worker", escaped), ("state", "building")}))] == 1
    assert ("coderunner_worker_slots", frozenset({("worker", "w2")})) in samples
    assert not [k for k in samples if k[0] == "coderunner_worker_sandboxes" and ("worker", "w2") in k[1]]
    for name in {k[0] for k in samples}:
        assert f"# TYPE {name} " in text and f"# HELP {name} " in text
    # Redis's memory: shown when Redis answered INFO, left out when it refused.
    assert not [k for k in samples if k[0].startswith("coderunner_redis_")]
    memory = parse(render(FleetSnapshot(queue_depth=0, callbacks_due=0, workers=[], redis_memory=(5 << 20, 0))))
    assert memory[("coderunner_redis_used_memory_bytes", frozenset())] == 5 << 20
    assert memory[("coderunner_redis_maxmemory_bytes", frozenset())] == 0


@pytest.mark.stack
@pytest.mark.slow
def test_metrics_show_the_queue_the_slots_and_the_jobs_that_ended(make_stack: StackFactory) -> None:
    stack = make_stack(WORKER_MAX_SANDBOXES="2", WORKER_HEARTBEAT_MS="300", WORKER_LEASE_TTL_MS="3000")
    api = Api(stack)
    try:
        job = api.execute(py_job("print(1)"))
        api.start(job)
        assert api.wait_state(job, {"done"}, timeout_s=30)["result"]["outcome"] == "completed"
        killed = api.execute(py_job("print(2)"))
        assert api.post(f"/v1/jobs/{killed['jobId']}/kill").status_code == 202
        deadline = time.monotonic() + 10
        while True:
            answer = httpx.get(f"{stack.api_url}/metrics")  # no token: open, like /health
            assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain; version=0.0.4")
            samples = parse(answer.text)
            ready = samples.get(("coderunner_worker_sandboxes", frozenset({("worker", stack.worker_ids["worker"]), ("state", "ready")})))
            if ready == 2 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert ready == 2  # both slots rebuilt and warm again
        assert samples[("coderunner_workers", frozenset())] == 1
        assert samples[("coderunner_slots", frozenset())] == 2
        assert samples[("coderunner_queue_depth", frozenset())] == 0
        assert samples[("coderunner_jobs_ended_total", frozenset({("state", "done")}))] == 1
        ended_killed = samples[("coderunner_jobs_ended_total", frozenset({("state", "killed")}))]
        assert ended_killed == 1
        with stack.redis() as redis:
            memory = redis.info("memory")
        used = samples[("coderunner_redis_used_memory_bytes", frozenset())]
        assert 0.5 * memory["used_memory"] < used < 2 * memory["used_memory"], (used, memory["used_memory"])
        assert samples[("coderunner_redis_maxmemory_bytes", frozenset())] == memory["maxmemory"]
        # A Redis user without INFO (an ACL keeping @dangerous out): the rest still shows.
        with stack.redis() as redis:
            redis.execute_command("ACL", "SETUSER", "default", "-info")
        try:
            answer = httpx.get(f"{stack.api_url}/metrics")
            assert answer.status_code == 200, answer.text
            samples = parse(answer.text)
            assert samples[("coderunner_workers", frozenset())] == 1
            assert not [k for k in samples if k[0].startswith("coderunner_redis_")]
        finally:
            with stack.redis() as redis:
                redis.execute_command("ACL", "SETUSER", "default", "+info")
    finally:
        api.close()


@pytest.mark.stack
def test_a_metrics_token_keeps_metrics_to_its_holder(make_stack: StackFactory) -> None:
    stack = make_stack(with_worker=False, METRICS_TOKEN="scrape-" + "x" * 20)
    api = Api(stack)
    try:
        # Queued jobs with no worker to take them: the queue's depth shows them.
        for i in range(3):
            api.execute(py_job(f"print({i})"))
        assert httpx.get(f"{stack.api_url}/metrics").status_code == 401
        api_token = {"Authorization": f"Bearer {stack.api_token}"}
        assert httpx.get(f"{stack.api_url}/metrics", headers=api_token).status_code == 401
        answer = httpx.get(f"{stack.api_url}/metrics", headers={"Authorization": "Bearer scrape-" + "x" * 20})
        assert answer.status_code == 200
        samples = parse(answer.text)
        assert samples[("coderunner_queue_depth", frozenset())] == 3
        assert samples[("coderunner_workers", frozenset())] == 0
    finally:
        api.close()
