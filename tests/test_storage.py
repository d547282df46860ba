"""Output is stored at its own size: JSON escaping never multiplies what Redis keeps.

A program writing control bytes used to leave six bytes in Redis for each one it wrote
(a `\\u0001` in the log's JSON and again in the pullable result). Chunk events and collected
output are now stored raw, so a job keeps at most about twice its output budget (the log
and the pullable copy) whatever the bytes are, and `/output` is streamed, not built whole.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import msgspec
import pytest
from redis.exceptions import OutOfMemoryError

from launcher.stack import Stack
from shared import keys
from shared.messages import Outcome
from tests.conftest import StackFactory
from tests.helpers import Api, Realtime, py_job, watched_commands

pytestmark = [pytest.mark.stack, pytest.mark.sandbox, pytest.mark.slow]

MIB = 1024 * 1024
# What README's Operations section promises: per finished job, at most three times its
# output budget (the log and the pullable copy, plus Redis's own allocation overhead on
# 8 KiB stream entries, measured at about a quarter) and 1 MiB for everything else.
PER_JOB_OVERHEAD = 1 * MIB
BUDGET_FACTOR = 3


def _used(stack) -> int:  # type: ignore[no-untyped-def]
    with stack.redis() as redis:
        return int(redis.info("memory")["used_memory"])


# The server maximum this test runs with (MAX_OUTPUT_KB); the bound scales with it.
MAX_OUTPUT_KB = 2048


def test_ten_jobs_of_maximal_control_byte_output_stay_within_the_bound(make_stack: StackFactory) -> None:
    stack = make_stack(WORKER_MAX_SANDBOXES="4", MAX_OUTPUT_KB=str(MAX_OUTPUT_KB))
    api = Api(stack)  # no live client: a Python one would spend minutes parsing 6x-escaped JSON
    budget = MAX_OUTPUT_KB * 1024
    # Half again the budget: the rest is dropped and the result says truncated.
    code = f"import sys\nb = b'\\x01' * 65536\nfor _ in range({budget * 3 // 2 // 65536}): sys.stdout.buffer.write(b)\n"
    try:
        before = _used(stack)
        jobs = [api.execute(py_job(code, collectOutput=True, limits={"outputKb": MAX_OUTPUT_KB})) for _ in range(10)]
        for job in jobs:
            api.start(job)
        for job in jobs:
            result = api.wait_state(job, {"done", "error", "killed"}, timeout_s=120)["result"]
            assert result["outcome"] == "completed" and result["truncated"] is True, result
        after = _used(stack)
        grown = after - before
        bound = 10 * (BUDGET_FACTOR * budget + PER_JOB_OVERHEAD)
        print(f"Redis grew by {grown / MIB:.1f} MiB for 10 jobs (bound {bound / MIB:.0f} MiB; "
              f"JSON-escaped storage would be about {10 * 2 * 6 * budget / MIB:.0f} MiB)")  # fmt: skip
        assert grown < bound

        # The pullable result is exact and streamed: \x01 is valid UTF-8, so it comes back
        # as JSON text, six bytes per byte on the wire.
        url = f"/v1/jobs/{jobs[0]['jobId']}/output"
        with httpx.Client(base_url=stack.api_url, timeout=60) as client, client.stream("GET", url, headers=api.headers()) as response:
            assert response.status_code == 200
            assert "content-length" not in response.headers  # streamed, not built whole
            body = response.read()

        out = json.loads(body)
        assert out["stdout"] == "\x01" * budget and out["stdoutEncoding"] == "utf8"
        assert out["stderr"] == "" and out["truncated"] is True and out["artifacts"] == []
        # And the log's chunks read back as the same text.
        log = api.replay(jobs[1], timeout_s=120)
        text = "".join(p["chunk"] for n, p in log if n == "stdout")
        assert text == "\x01" * budget
    finally:
        api.close()


def test_binary_output_is_exact_and_base64_in_the_pullable_result(api: Api, realtime: Realtime) -> None:
    import base64

    data = bytes(range(256)) * 1000
    code = "import sys\nsys.stdout.buffer.write(bytes(range(256)) * 1000)\nsys.stderr.write('ok ✓')\n"
    job = api.execute(py_job(code, collectOutput=True))
    followed = realtime.follow(job)
    api.start(job)
    followed.wait_result()
    t0 = time.monotonic()
    out = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "5000"}).json()
    assert time.monotonic() - t0 < 5
    assert out["stdoutEncoding"] == "base64" and base64.b64decode(out["stdout"]) == data
    assert out["stderrEncoding"] == "utf8" and out["stderr"] == "ok ✓"


def test_one_client_keeps_at_most_its_retained_output_bound(make_stack: StackFactory) -> None:
    # 3 MiB per client; each job keeps 2 MiB (1 MiB in the log, 1 MiB pullable).
    stack = make_stack(MAX_RETAINED_OUTPUT_MB="3", RUN_RESULT_TTL="4")
    api = Api(stack)
    code = "import sys\nsys.stdout.write('y' * 1048576)\n"
    try:
        for _ in range(2):
            job = api.execute(py_job(code, collectOutput=True, limits={"outputKb": 1024}))
            api.start(job)
            assert api.wait_state(job, {"done"}, timeout_s=30)["result"]["outcome"] == "completed"
        refused = api.post("/v1/execute", json=py_job("print(1)"))
        assert refused.status_code == 429, refused.text
        body = refused.json()
        assert "MAX_RETAINED_OUTPUT_MB" in body["error"] and 0 < body["retryAfterMs"] <= 5000
        with stack.redis() as redis:
            owner_keys = [k.decode() for k in redis.keys("owner:*:retained:bytes")]
            assert len(owner_keys) == 1
            # (each job's log: 128 chunk events of 8 KiB, its stages and result, each with what
            # Redis spends on the entry besides: about 1.29 times its text for 8 KiB ones)
            assert 2 * 2 * 1048576 * 1.1 < int(redis.hget(owner_keys[0], "_total")) < 2 * 2 * 1048576 * 1.3
        # As the results expire, the client may submit again.
        time.sleep(body["retryAfterMs"] / 1000 + 0.5)
        assert api.post("/v1/execute", json=py_job("print(1)")).status_code == 202
    finally:
        api.close()


def test_a_jobs_log_is_on_its_owners_ledger_at_what_redis_keeps_of_it(make_stack: StackFactory) -> None:
    # Red team: the ledger counted a log's text alone. A program alternating one-byte writes
    # between its two streams (one event each) kept 118 KB of log in Redis for 6,000 bytes
    # of output, and its owner's ledger said 12,000 (the bound on what one client keeps,
    # MAX_RETAINED_OUTPUT_MB, was ten times too loose for such output).
    stack = make_stack()
    api = Api(stack)
    # (The worker gathers such a program's writes after its first few hundred: CHATTY_BURST.)
    code = "import os, time\nfor i in range(2000):\n    os.write(1 + i % 2, b'x')\n    time.sleep(0.0015)\n"
    try:
        job = api.execute(py_job(code, limits={"wallTimeMs": 20000}))
        api.start(job)
        assert api.wait_state(job, {"done"}, timeout_s=60)["result"]["outcome"] == "completed"
        with stack.redis() as redis:
            (ledger,) = redis.keys("owner:*:retained:bytes")
            counted = int(redis.hget(ledger, "_total"))
            kept = int(redis.memory_usage(keys.events_key(job["jobId"]), samples=0))
            events = int(redis.xlen(keys.events_key(job["jobId"])))
        print(f"{events} events: {kept} B kept, {counted} B counted")
        assert events > 300, events  # (the writes did come as many events)
        assert kept <= counted <= 2 * kept, (kept, counted)
    finally:
        api.close()


def test_a_flood_of_big_jobs_holds_bounded_input_and_none_once_they_end(make_stack: StackFactory) -> None:
    """Input swells Redis no more than output: 30 jobs of 1 MiB from one client with an 8 MiB
    bound on what its unstarted jobs hold (MAX_UNSTARTED_INPUT_MB) leave Redis about 8 MiB
    bigger, not 30; and once they have ended their specs are gone (only records stay)."""
    stack = make_stack(MAX_UNSTARTED_INPUT_MB="8", WORKER_MAX_SANDBOXES="2")
    api = Api(stack)
    files = [{"name": "main.py", "content": "print(len(open('d.txt').read()))"}, {"name": "d.txt", "content": "z" * MIB}]
    try:
        before = _used(stack)
        answers = [api.post("/v1/execute", json=py_job("", files=files)) for _ in range(30)]
        accepted = [a.json() for a in answers if a.status_code == 202]
        refused = [a for a in answers if a.status_code != 202]
        assert 6 <= len(accepted) <= 8 and all(r.status_code == 429 for r in refused), [a.status_code for a in answers]
        grown = _used(stack) - before
        # (jemalloc keeps a string of just over 1 MiB in a 1.25 MiB size class, and Redis may
        # still hold a 1 MiB query buffer for the API's connection after a big command)
        assert grown < 1.25 * MIB * len(accepted) + 3 * MIB, grown / MIB
        for job in accepted:
            api.start(job)
        for job in accepted:
            assert api.wait_state(job, {"done"}, timeout_s=30)["result"]["outcome"] == "completed"
        assert _used(stack) - before < 2 * MIB, (_used(stack) - before) / MIB
    finally:
        api.close()


def test_a_full_redis_refuses_new_work_and_ends_what_it_admitted(make_stack: StackFactory) -> None:
    """At its maxmemory (noeviction) Redis refuses every write that may grow it. New work
    waits (an execute is a 503, stdin too), but a running job still logs its output and
    writes its result, a parked job can be started, a kill ends a job, and heartbeats keep
    the worker's lease: none of it waits for room."""
    lease_ms, heartbeat_ms = 3000, 500
    stack = make_stack(WORKER_MAX_SANDBOXES="3", WORKER_LEASE_TTL_MS=str(lease_ms), WORKER_HEARTBEAT_MS=str(heartbeat_ms))
    api = Api(stack)
    running = api.execute(py_job("import sys, time\nprint('a', flush=True)\nsys.stdin.readline()\nprint('b')", collectOutput=True))
    parked = api.execute(py_job("print('parked')", collectOutput=True))
    endless = api.execute(py_job("import time\ntime.sleep(60)"))
    alive = f"worker:{stack.worker_ids['worker']}:alive"
    try:
        for job in (running, endless):
            assert api.start(job).status_code == 202
        for job, state in ((running, "running"), (endless, "running"), (parked, "parked")):
            api.wait_state(job, {state})
        with stack.redis() as redis:
            redis.config_set("maxmemory", 1)  # far below what it holds: every growing write is refused
            try:
                with pytest.raises(OutOfMemoryError):
                    redis.set("probe", "x")
                refused = api.post("/v1/execute", json=py_job("print(1)"))
                assert refused.status_code == 503 and "storage is full" in refused.json()["error"], refused.text
                typed = api.post(f"/v1/jobs/{running['jobId']}/stdin", token=running["jobToken"], json={"chunk": "go\n"})
                assert typed.status_code == 503, typed.text
                assert api.start(parked).status_code == 202
                assert api.wait_state(parked, {"done"}, timeout_s=15)["result"]["outcome"] == "completed"
                pulled = api.get(f"/v1/jobs/{parked['jobId']}/output")
                assert pulled.status_code == 200 and pulled.json()["stdout"] == "parked\n", pulled.text
                assert api.post(f"/v1/jobs/{endless['jobId']}/kill").status_code == 202
                assert api.wait_state(endless, {"killed"}, timeout_s=15)["result"]["outcome"] == "killed"
                # Several leases' worth of heartbeats went through: the lease is fresh.
                time.sleep(2 * lease_ms / 1000)
                assert redis.pttl(alive) > lease_ms - 3 * heartbeat_ms, redis.pttl(alive)
                assert api.status(running)["state"] == "running"
                assert api.post(f"/v1/jobs/{running['jobId']}/kill").status_code == 202
                assert api.wait_state(running, {"killed"}, timeout_s=15)["result"]["outcome"] == "killed"
                assert "".join(p["chunk"] for n, p in api.replay(running) if n == "stdout") == "a\n"
            finally:
                redis.config_set("maxmemory", 0)
        # With room again, new work runs.
        job = api.execute(py_job("print('after')", collectOutput=True))
        api.start(job)
        assert api.wait_state(job, {"done"}, timeout_s=15)["result"]["outcome"] == "completed"
    finally:
        api.close()


def test_waiting_for_output_wakes_when_the_result_lands(api: Api) -> None:
    lags = []
    for _ in range(5):
        job = api.execute(py_job("import time\ntime.sleep(0.5)\nprint('late')\n", collectOutput=True))
        api.start(job)
        response = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "10000"})
        answered_ms = time.time() * 1000
        assert response.status_code == 200 and response.json()["stdout"] == "late\n"
        lags.append(answered_ms - api.status(job)["updatedAtMs"])
    # The answer follows the stored result by a few ms, not by a polling interval.
    lags.sort()
    assert lags[2] < 30, lags


def test_waiting_for_output_is_woken_by_the_result_only_and_ends_at_its_deadline(stack: Stack, api: Api) -> None:
    # Twenty output events arrive before the result: none of them wakes the wait.
    chatty = "import time\nfor i in range(20):\n    print(i, flush=True)\n    time.sleep(0.02)\n"
    job = api.execute(py_job(chatty, collectOutput=True))
    with watched_commands(stack) as seen:
        api.start(job)
        response = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "10000"})
    assert response.status_code == 200, response.text
    assert response.json()["stdout"] == "".join(f"{i}\n" for i in range(20))
    # The API's blocking reads for this job (its done stream, or formerly its event log).
    waits = (f"job:{job['jobId']}:done", f"job:{job['jobId']}:events")
    reads = [command for command in seen if command.startswith("XREAD") and any(key in command for key in waits)]
    assert 1 <= len(reads) <= 2, reads
    # Nor is the output looked for before the result is there: the job had not ended when the
    # request came, so the API waited first and then fetched once (it looked twice before).
    looks = [command for command in seen if command.startswith("GET ") and f"job:{job['jobId']}:output" in command]
    assert len(looks) == 1, looks

    slow = api.execute(py_job("import time\ntime.sleep(3)\n", collectOutput=True))
    api.start(slow)
    t0 = time.monotonic()
    response = api.get(f"/v1/jobs/{slow['jobId']}/output", params={"waitMs": "400"})
    waited_s = time.monotonic() - t0
    assert response.status_code == 404 and 0.35 < waited_s < 1.5, (response.status_code, waited_s)
    api.post(f"/v1/jobs/{slow['jobId']}/kill")


@pytest.mark.parametrize("size", [10, 64 * 1024 - 1, 64 * 1024, 300 * 1024])
def test_pulled_output_is_the_same_whole_or_streamed(api: Api, size: int) -> None:
    # Up to 64 KiB a stream comes with the result and is answered in one piece; more is
    # streamed slice by slice. Either way: exact text, a multi-byte character across every
    # boundary, the other stream and the rest of the result intact.
    code = (
        "import sys\n"
        f"text = ('é' * {size})[: {size} // 2] + 'x' * ({size} % 2)\n"
        "sys.stdout.write(text)\nsys.stderr.write('err ✓')\n"
    )
    job = api.execute(py_job(code, collectOutput=True, limits={"outputKb": 1024}))
    api.start(job)
    response = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "20000"})
    assert response.status_code == 200, response.text
    out = response.json()
    expected = "é" * (size // 2) + "x" * (size % 2)
    assert len(expected.encode()) == size
    assert out["stdoutEncoding"] == "utf8" and out["stdout"] == expected
    assert out["stderr"] == "err ✓" and out["exitCode"] == 0 and out["outcome"] == "completed"
    # The non-waiting read answers the same body.
    assert api.get(f"/v1/jobs/{job['jobId']}/output").content == response.content
    assert (out["stdoutBytes"], out["stderrBytes"]) == (size, len("err ✓".encode()))


async def test_a_stream_that_goes_away_mid_read_breaks_the_body_off() -> None:
    # A slow reader of a large output whose stored stream expires (or is evicted) under it:
    # the body must break off, not end as valid JSON with a shorter stdout.
    from shared.messages import StoredOutput
    from shared.runresult import SLICE_BYTES, OutputGone, run_result_pieces

    stored = {"stdout": b"y" * (3 * SLICE_BYTES), "stderr": b""}
    meta = msgspec.json.encode(StoredOutput(
        exit_code=0, signal=None, timed_out=False, idle_timed_out=False, truncated=False, duration_ms=1, cpu_ms=1,
        memory_kb=1, outcome=Outcome.COMPLETED, compile=None, stdout_encoding="utf8", stderr_encoding="utf8",
        artifacts=[], artifacts_truncated=False, stdout_bytes=3 * SLICE_BYTES, stderr_bytes=0,
    ))  # fmt: skip

    async def read(stream: str, offset: int, size: int) -> bytes:
        if stream == "stdout" and offset >= SLICE_BYTES:
            return b""  # expired after the first slice
        return stored[stream][offset : offset + size]

    with pytest.raises(OutputGone, match="stdout ended at byte 262146 of 786438"):
        [piece async for piece in run_result_pieces(read, meta)]


def test_a_collected_job_killed_in_the_queue_has_its_verdict_at_output(make_stack: StackFactory) -> None:
    # Killed before any worker took it, the job has a result (killed) but no output was ever
    # stored: a grader pulling it must get that verdict, not "no output for this job".
    stack = make_stack(with_worker=False)
    with Api(stack) as api, Api(stack) as waiter:
        job = api.execute(py_job("print(1)", collectOutput=True))
        path = f"/v1/jobs/{job['jobId']}/output"
        waited: list[httpx.Response] = []
        wait = threading.Thread(target=lambda: waited.append(waiter.get(path, params={"waitMs": "20000"})))
        wait.start()
        time.sleep(0.5)  # the long-poll is waiting
        assert api.post(f"/v1/jobs/{job['jobId']}/kill").status_code == 202
        wait.join(10)
        for response in [*waited, api.get(path), api.get(path, params={"waitMs": "5000"})]:
            assert response.status_code == 200, response.text
            body = response.json()
            assert body["outcome"] == "killed" and body["stdout"] == "" and body["stderr"] == "", body
            assert body["message"] == "killed before it started", body
        # A job that does not collect output still has none to pull.
        plain = api.execute(py_job("print(1)"))
        assert api.post(f"/v1/jobs/{plain['jobId']}/kill").status_code == 202
        assert api.get(f"/v1/jobs/{plain['jobId']}/output").status_code == 404


def test_a_run_whose_output_is_gone_is_not_answered_as_empty_output(stack: Stack, api: Api) -> None:
    # A job that ran to its end stored its output; once that has expired (here: deleted, as
    # an expiry a moment ahead of the status would), the answer is the uniform 404, never
    # the verdict with empty streams, which a grader would take for a wrong answer.
    job = api.execute(py_job("print('answer')", collectOutput=True))
    api.start(job)
    api.wait_state(job, {"done"})
    path = f"/v1/jobs/{job['jobId']}/output"
    assert api.get(path).json()["stdout"] == "answer\n"
    with stack.redis() as redis:
        redis.delete(f"job:{job['jobId']}:output")
    assert api.get(path).status_code == 404


def test_the_output_limit_never_cuts_a_character_in_half(make_stack: StackFactory) -> None:
    # 1 KiB of three-byte characters ends one byte into the 342nd: that byte is left out,
    # so the live text, the log and the kept bytes all stay the same valid UTF-8 (before,
    # the events ended in U+FFFD and the pullable stdout turned to base64).
    stack = make_stack(WORKER_MAX_SANDBOXES="2")
    api = Api(stack)
    code = "print('\\u2603' * 2000)\n"
    expected = "\u2603" * 341
    try:
        plain = api.execute(py_job(code, collectOutput=True, limits={"outputKb": 1}))
        batch = api.execute(py_job(code, collectOutput=True, limits={"outputKb": 1}, tests=[{"name": "snowmen"}]))
        for job in (plain, batch):
            api.start(job)
        result = api.wait_state(plain, {"done"})["result"]
        assert result["truncated"] is True, result
        out = api.get(f"/v1/jobs/{plain['jobId']}/output").json()
        assert out["stdoutEncoding"] == "utf8" and out["stdout"] == expected, out
        live = "".join(p["chunk"] for n, p in api.replay(plain) if n == "stdout")
        assert live == expected
        api.wait_state(batch, {"done"})
        case = api.get(f"/v1/jobs/{batch['jobId']}/output").json()["tests"][0]
        assert case["truncated"] is True and case["stdout"] == expected, case
        assert case.get("stdoutEncoding", "utf8") == "utf8", case
    finally:
        api.close()


def test_nothing_written_after_the_output_limits_cut_goes_out(make_stack: StackFactory) -> None:
    # Two invalid bytes cross the 1 KiB limit (their text, six bytes, does not fit the two
    # left): the cut falls two bytes short of it. A later write's first two bytes went out
    # after the hole before, in the events, the log and the pullable stdout.
    stack = make_stack(WORKER_MAX_SANDBOXES="2")
    api = Api(stack)
    code = (
        "import os, time\n"
        "os.write(1, b'a' * 1022 + b'\\x80\\x80REST\\n')\n"
        "time.sleep(0.3)\n"
        "os.write(1, b'later\\n')\n"
    )
    try:
        job = api.execute(py_job(code, collectOutput=True, limits={"outputKb": 1}))
        api.start(job)
        result = api.wait_state(job, {"done"})["result"]
        assert result["truncated"] is True and result["outcome"] == "completed", result
        live = "".join(p["chunk"] for n, p in api.replay(job) if n == "stdout")
        assert live == "a" * 1022
        out = api.get(f"/v1/jobs/{job['jobId']}/output").json()
        assert out["stdout"] == "a" * 1022, out
    finally:
        api.close()
