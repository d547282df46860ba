"""The durable start flag, the warm-up expiry, and claims that survive a dying worker."""

from __future__ import annotations

import itertools
import json
import os
import signal
import time
from pathlib import Path

import pytest

from shared import keys
from tests.conftest import StackFactory
from tests.helpers import Api, Realtime, host_processes, pids_with_cmdline, py_job, watched_commands
from worker.job.run import QUIET_WAIT_S

pytestmark = [pytest.mark.stack, pytest.mark.sandbox]


def _running(stack, worker_id: str) -> dict[int, str]:  # type: ignore[no-untyped-def]
    """Live (not zombie) processes of a worker's jails: nsjail naming its sandboxes, or
    anything running as one of the stack's job uids."""
    uids = range(stack.uid_base, stack.uid_base + int(stack.extra_env.get("WORKER_MAX_SANDBOXES", "8")) + 1)
    return {
        pid: cmdline.replace(b"\0", b" ").decode(errors="replace")[:100]
        for pid, cmdline, status in host_processes()
        if "zombie" not in status.get("State", "")
        and (int(status["Uid"].split()[0]) in uids or f"/{worker_id}.".encode() in cmdline)
    }


def _leftovers(deployment: str, worker_id: str) -> list[str]:
    """Sandbox cgroups of that worker and host processes whose command line names them."""
    jobs = Path("/sys/fs/cgroup/unified") / deployment / "jobs"
    found = [p.name for p in jobs.iterdir() if p.name.startswith(worker_id + ".")]
    return found + [str(pid) for pid in pids_with_cmdline(f"/{worker_id}.".encode())]


def test_start_sent_while_no_worker_runs_is_honoured(make_stack: StackFactory) -> None:
    stack = make_stack(with_worker=False)
    api, rt = Api(stack), Realtime(stack)
    try:
        job = api.execute(py_job("print('ran after all')"))
        followed = rt.follow(job)
        assert api.start(job).status_code == 202
        time.sleep(0.5)
        assert api.status(job)["state"] == "queued"  # nobody to run it yet
        stack.start_worker()
        result = followed.wait_result()
        assert result["outcome"] == "completed" and result["exitCode"] == 0
        assert followed.text("stdout") == "ran after all\n"
        assert api.status(job)["state"] == "done"
    finally:
        rt.close()
        api.close()


def test_no_start_expires_and_frees_the_slot(make_stack: StackFactory) -> None:
    stack = make_stack(WORKER_WARMUP_MS="1500", WORKER_MAX_SANDBOXES="1")
    api, rt = Api(stack), Realtime(stack)
    try:
        parked = api.execute(py_job("print('never')"))
        followed = rt.follow(parked)
        t0 = time.monotonic()
        result = followed.wait_result(timeout_s=10)
        waited = time.monotonic() - t0
        assert result["outcome"] == "expired"
        assert result["exitCode"] is None and result["durationMs"] == 0
        assert 1.0 <= waited < 5.0
        assert [n for n, _ in followed.events if n in ("stdout", "stderr")] == []
        status = api.status(parked)
        assert status["state"] == "expired" and status["result"]["outcome"] == "expired"
        # A start after expiry is refused: the job can no longer run.
        assert api.start(parked).status_code == 409

        # The only slot is free again: the next job runs.
        nxt = api.execute(py_job("print('next')"))
        f2 = rt.follow(nxt)
        api.start(nxt)
        assert f2.wait_result()["outcome"] == "completed"
        assert f2.text("stdout") == "next\n"
    finally:
        rt.close()
        api.close()


def test_parked_job_of_a_killed_worker_is_requeued(make_stack: StackFactory) -> None:
    stack = make_stack(WORKER_HEARTBEAT_MS="300", WORKER_LEASE_TTL_MS="1000")
    api, rt = Api(stack), Realtime(stack)
    try:
        job = api.execute(py_job("print('second life')"))
        followed = rt.follow(job)
        # Wait until the first worker has claimed and parked it, then kill that worker hard.
        _wait_claimed(stack, job["jobId"])
        os.killpg(stack.procs["worker"].pid, signal.SIGKILL)
        stack.procs["worker"].wait()
        api.start(job)  # durable: stored while nobody holds the job
        stack.start_worker()
        result = followed.wait_result(timeout_s=20)
        assert result["outcome"] == "completed", result.get("message")
        assert followed.text("stdout") == "second life\n"
        # The second claim continued the same sequence: the durable log holds one
        # stage{queued} (the first claim's; a re-claim logs none) and everything after,
        # numbered without gaps or doubles.
        with stack.redis() as redis:
            log = [(int(f[b"seq"]), f[b"name"].decode()) for _, f in redis.xrange(f"job:{job['jobId']}:events")]
        assert [seq for seq, _ in log] == list(range(len(log)))
        names = [name for _, name in log]
        assert names[:2] == ["stage", "stage"] and names[-1] == "result"
        assert set(names[2:-1]) == {"stdout"}  # one or more chunks, as the pipe delivered them
        # Live, the subscriber got all of it from seq 0: the second worker published the
        # first claim's stage{queued} from the log at start.
        live = sorted((p["seq"], n) for n, p in followed.events)
        assert live == log
    finally:
        rt.close()
        api.close()


def test_a_reclaimed_job_that_expires_publishes_its_result_once(make_stack: StackFactory) -> None:
    # A second claim reads the first claim's events from the log when it goes live; a job
    # that ends unstarted goes live after its result is written, so the log then holds
    # the result too, which must not go out a second time.
    stack = make_stack(WORKER_HEARTBEAT_MS="300", WORKER_LEASE_TTL_MS="1000", WORKER_WARMUP_MS="3000")
    api, rt = Api(stack), Realtime(stack)
    try:
        job = api.execute(py_job("print('never')"))
        followed = rt.follow(job)
        _wait_claimed(stack, job["jobId"])
        os.killpg(stack.procs["worker"].pid, signal.SIGKILL)
        stack.procs["worker"].wait()
        stack.start_worker()  # re-queues the dead worker's parked job, claims it, lets it expire
        result = followed.wait_result(timeout_s=20)
        assert result["outcome"] == "expired"
        time.sleep(0.5)  # time for a second copy to arrive
        assert [n for n, _ in followed.events].count("result") == 1, followed.summary()
        with stack.redis() as redis:
            log = [(int(f[b"seq"]), f[b"name"].decode()) for _, f in redis.xrange(f"job:{job['jobId']}:events")]
        assert log == [(0, "stage"), (1, "result")]
        assert sorted((p["seq"], n) for n, p in followed.events) == log
    finally:
        api.close()
        rt.close()


def _wait_claimed(stack, job_id: str) -> None:  # type: ignore[no-untyped-def]
    claimed = f"worker:{stack.worker_ids['worker']}:claimed"
    deadline = time.monotonic() + 5
    with stack.redis() as redis:
        while job_id.encode() not in redis.lrange(claimed, 0, -1):
            assert time.monotonic() < deadline, "job was never claimed"
            time.sleep(0.02)


def test_running_job_of_a_killed_worker_is_lost_not_rerun(make_stack: StackFactory) -> None:
    stack = make_stack(WORKER_HEARTBEAT_MS="300", WORKER_LEASE_TTL_MS="1000")
    api, rt = Api(stack), Realtime(stack)
    try:
        job = api.execute(py_job("import time\nprint('started', flush=True)\ntime.sleep(30)\n"))
        followed = rt.follow(job)
        api.start(job)
        deadline = time.monotonic() + 10
        # The whole line (python writes "started" and "\n" apart; both must be out first).
        while "started\n" not in followed.text("stdout"):
            assert time.monotonic() < deadline, "program never printed"
            time.sleep(0.02)
        os.killpg(stack.procs["worker"].pid, signal.SIGKILL)
        stack.procs["worker"].wait()
        # Its jails died with it (the program, its warm spares, their nsjails), before any
        # other worker's janitor could have seen them: nothing runs on for nsjail's backstop.
        dead = stack.worker_ids["worker"]
        deadline = time.monotonic() + 3
        while alive := _running(stack, dead):
            assert time.monotonic() < deadline, f"still running after the worker died: {alive}"
            time.sleep(0.05)
        stack.start_worker()  # its reaper notices the dead lease
        result = followed.wait_result(timeout_s=20)
        assert result["outcome"] == "lost"
        assert api.status(job)["state"] == "lost"
        time.sleep(1.0)
        assert len(followed.results()) == 1
        assert followed.text("stdout") == "started\n"  # never re-run
        # What the dead worker's jails left (cgroups, workspaces) was found and removed by
        # the surviving worker's janitor.
        deadline = time.monotonic() + 10
        while _leftovers(stack.deployment, dead):
            assert time.monotonic() < deadline, f"leftovers of {dead}: {_leftovers(stack.deployment, dead)}"
            time.sleep(0.1)
    finally:
        rt.close()
        api.close()


def test_stdin_stored_before_any_worker_subscribed_reaches_the_program_first(make_stack: StackFactory) -> None:
    # Frames stored while no worker held the job were published to nobody: the worker that
    # claims it must read them from the stream (a job with none stored skips that read and
    # takes every later frame from pub/sub, with the stream behind a gap or a quiet second).
    stack = make_stack(with_worker=False)
    api, rt = Api(stack), Realtime(stack)
    echo = "import sys\nfor line in sys.stdin:\n    print('echo:' + line, end='', flush=True)\nprint('eof')\n"
    try:
        job = api.execute(py_job(echo))
        followed = rt.follow(job)
        for line in ("one\n", "two\n"):
            response = api.post(f"/v1/jobs/{job['jobId']}/stdin", token=job["jobToken"], json={"chunk": line})
            assert response.status_code == 200, response.text
        assert api.start(job).status_code == 202
        stack.start_worker()
        deadline = time.monotonic() + 20
        while "echo:two\n" not in followed.text("stdout"):
            assert time.monotonic() < deadline, followed.summary()
            time.sleep(0.02)
        response = api.post(f"/v1/jobs/{job['jobId']}/stdin", token=job["jobToken"], json={"chunk": "three\n"})
        assert response.status_code == 200
        assert api.post(f"/v1/jobs/{job['jobId']}/stdin/close", token=job["jobToken"]).status_code == 200
        result = followed.wait_result()
        assert result["outcome"] == "completed", result
        assert followed.text("stdout") == "echo:one\necho:two\necho:three\neof\n"
    finally:
        rt.close()
        api.close()


# About 1.5 s of gcc (a million-token initialiser, twice, in ~250 MB): long enough to stop
# its worker in the middle of the compile.
_SLOW_COMPILE_C = """#define A(x) x x x x
#define B(x) A(A(A(A(x))))
#define C(x) B(B(x))
int v = 0 C(A(A(+1)));
int w = 0 C(A(A(+1)));
#include <stdio.h>
int main(void) { printf("%d\\n", v + w); return 0; }
"""


def _wait_for(followed, name: str, timeout_s: float = 10) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not any(n == name or p.get("phase") == name for n, p in list(followed.events)):
        assert time.monotonic() < deadline, f"no {name}: {followed.summary()}"
        time.sleep(0.02)


def test_a_job_handed_back_while_compiling_is_published_once(make_stack: StackFactory) -> None:
    # The first worker goes live at start and publishes the log; stopped mid-compile it hands
    # the job back (the program never ran). The next worker compiles again and must publish
    # only what it adds: no seq twice, none missing.
    stack = make_stack(WORKER_SHUTDOWN_GRACE_MS="200", WORKER_MAX_SANDBOXES="2")
    api, rt = Api(stack), Realtime(stack)
    try:
        job = api.execute({"language": "c", "files": [{"name": "main.c", "content": _SLOW_COMPILE_C}]})
        followed = rt.follow(job)
        api.start(job)
        _wait_for(followed, "compiling")
        stack.stop_process("worker", signal.SIGTERM)
        assert api.status(job)["state"] == "queued"
        stack.start_worker()
        result = followed.wait_result(timeout_s=60)
        assert result["outcome"] == "completed", result
        assert followed.text("stdout") == "2097152\n"
        seqs = [p["seq"] for _n, p in followed.events]
        assert sorted(seqs) == list(range(result["seq"] + 1)), seqs
        # The log says what happened: two compiles, the second one whole.
        with stack.redis() as redis:
            log = redis.xrange(f"job:{job['jobId']}:events")
        phases = [json.loads(f[b"data"])["phase"] for _, f in log if f[b"name"] == b"stage"]
        assert phases == ["queued", "compiling", "compiling", "running"]
        assert len(log) == result["seq"] + 1
    finally:
        rt.close()
        api.close()


@pytest.mark.parametrize("fits", [False, True], ids=["goes back", "runs here"])
def test_a_job_whose_compile_ends_during_the_grace_runs_only_if_it_can_finish_in_it(
    make_stack: StackFactory, fits: bool
) -> None:
    # SIGTERM mid-compile; the compile ends inside the grace. A program allowed to run longer
    # than what is left of it was started on the stopping worker and ended `killed` (by
    # "user") at the grace's end: it goes back to the queue instead, to run whole elsewhere.
    # One whose wall clock fits in what is left runs here, compiled once.
    grace_ms, wall_ms = ("20000", 3000) if fits else ("3000", 10000)
    stack = make_stack(WORKER_SHUTDOWN_GRACE_MS=grace_ms, WORKER_MAX_SANDBOXES="2")
    api, rt = Api(stack), Realtime(stack)
    code = _SLOW_COMPILE_C.replace("int main(void) {", f"#include <unistd.h>\nint main(void) {{ sleep({wall_ms // 1500});")
    try:
        job = api.execute({"language": "c", "files": [{"name": "main.c", "content": code}], "limits": {"wallTimeMs": wall_ms}})
        followed = rt.follow(job)
        api.start(job)
        _wait_for(followed, "compiling")
        stack.stop_process("worker", signal.SIGTERM)
        if fits:
            assert api.status(job)["state"] == "done"
        else:
            assert api.status(job)["state"] == "queued"
            stack.start_worker()
        result = followed.wait_result(timeout_s=60)
        assert result["outcome"] == "completed", result
        assert followed.text("stdout") == "2097152\n"
        with stack.redis() as redis:
            log = redis.xrange(f"job:{job['jobId']}:events")
        phases = [json.loads(f[b"data"])["phase"] for _, f in log if f[b"name"] == b"stage"]
        assert phases == ["queued", "compiling", "running"] if fits else ["queued", "compiling", "compiling", "running"]
    finally:
        rt.close()
        api.close()


def test_a_kill_of_a_job_handed_back_unstarted_publishes_what_its_claim_logged(make_stack: StackFactory) -> None:
    # A claim logs stage{queued} (seq 0) and publishes nothing before start; handed back and
    # then killed in the queue, the job's stage and result both reach a follower.
    stack = make_stack(WORKER_MAX_SANDBOXES="1")
    api, rt = Api(stack), Realtime(stack)
    try:
        job = api.execute(py_job("print('never')"))
        followed = rt.follow(job)
        _wait_claimed(stack, job["jobId"])
        stack.stop_process("worker", signal.SIGTERM)  # hands the parked job back
        assert api.status(job)["state"] == "queued"
        assert api.post(f"/v1/jobs/{job['jobId']}/kill").status_code == 202
        result = followed.wait_result(timeout_s=10)
        assert result["outcome"] == "killed" and result["seq"] == 1
        time.sleep(0.3)
        assert sorted((p["seq"], n) for n, p in followed.events) == [(0, "stage"), (1, "result")]
    finally:
        rt.close()
        api.close()


def _sandboxes_ready(stack) -> int:  # type: ignore[no-untyped-def]
    """Ready warm sandboxes, as the stack's worker last advertised in its heartbeat."""
    with stack.redis() as redis:
        info = redis.hget(keys.WORKERS, stack.worker_ids["worker"])
    return int(((json.loads(info) if info else {}).get("load") or {}).get("sandboxesReady", 0))


def _writes_of(seen: list[str], job_id: str) -> list[list[str]]:
    """The commands MONITOR saw naming the job's status record, split into words."""
    return [command.split() for command in seen if f"job:{job_id}:status" in command]


def test_a_job_started_before_its_claim_goes_from_parked_to_running_in_one_write(make_stack: StackFactory) -> None:
    # A grader's job is often started before any worker claims it (the worker is busy). With
    # a warm sandbox free at its claim, it is not parked at all: one fenced write takes it
    # from the claim's `parked` to `running` as its files go in (there was a `starting` write,
    # a Redis round trip, before the sandbox was even looked for).
    stack = make_stack(WORKER_MAX_SANDBOXES="2", WORKER_MAX_PARKED="1")
    api, rt = Api(stack), Realtime(stack)
    try:
        # Three unstarted jobs fill the worker's room for claims (one parked plus one a
        # slot), so the next job waits in the queue, started, until one of them goes.
        blockers = [api.execute(py_job("print('never')")) for _ in range(3)]
        for blocker in blockers:
            _wait_claimed(stack, blocker["jobId"])
        job = api.execute(py_job("print('straight in')"))
        followed = rt.follow(job)
        assert api.start(job).status_code == 202
        # A warm sandbox ready besides the one a blocker may have borrowed (its heartbeat says).
        deadline = time.monotonic() + 15
        while _sandboxes_ready(stack) < 1:
            assert time.monotonic() < deadline, "no warm sandbox ready"
            time.sleep(0.1)
        assert api.status(job)["state"] == "queued"
        with watched_commands(stack) as seen:
            api.post(f"/v1/jobs/{blockers[0]['jobId']}/kill")
            result = followed.wait_result(timeout_s=15)
        assert result["outcome"] == "completed", result
        writes = _writes_of(seen, job["jobId"])
        assert any("running" in words for words in writes), writes
        assert not any("starting" in words for words in writes), [w for w in writes if "starting" in w]
        # The client sees every event from seq 0, in order, as for a job it started parked.
        live = [(n, p.get("phase")) for n, p in sorted(followed.events, key=lambda e: e[1]["seq"])]
        assert live == [("stage", "queued"), ("stage", "running"), ("stdout", None), ("result", None)], live
        assert [p["seq"] for _, p in followed.events] == [0, 1, 2, 3], followed.summary()
        assert followed.text("stdout") == "straight in\n"
    finally:
        for blocker in blockers:
            api.post(f"/v1/jobs/{blocker['jobId']}/kill")
        rt.close()
        api.close()


def _state_writes(seen: list[str], job_ids: list[str]) -> list[tuple[str, str]]:
    """(job id, state) of every command MONITOR saw set one of these jobs' `state`, in order."""
    found = []
    for words in (command.split() for command in seen):
        if len(words) > 3 and words[0].upper() == "HSET" and "state" in words[2:-1:2]:
            job_id = words[1].removeprefix("job:").removesuffix(":status")
            if job_id in job_ids:
                found.append((job_id, words[words.index("state", 2) + 1]))
    return found


def test_a_started_job_that_waits_a_moment_for_a_sandbox_goes_from_parked_to_running_in_one_write(
    make_stack: StackFactory,
) -> None:
    # A busy worker (one slot here) has started jobs wait their turn. A wait as short as a
    # job's run says nothing: like a job that finds a sandbox free, the waiting one goes
    # from the claim's `parked` to `running` in one fenced write, where it wrote `starting`
    # first (a Redis round trip more for every job of a saturated worker).
    stack = make_stack(WORKER_MAX_SANDBOXES="1")
    api, rt = Api(stack), Realtime(stack)
    try:
        deadline = time.monotonic() + 15
        while _sandboxes_ready(stack) < 1:
            assert time.monotonic() < deadline, "no warm sandbox ready"
            time.sleep(0.1)
        with watched_commands(stack) as seen:
            jobs = []
            for n in range(3):
                jobs.append(api.execute(py_job(f"print({n})", collectOutput=True)))
                if n == 2:
                    followed = rt.follow(jobs[-1])
                assert api.start(jobs[-1]).status_code == 202
            for n, job in enumerate(jobs):
                output = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "15000"}).json()
                assert output["outcome"] == "completed" and output["stdout"] == f"{n}\n", output
            followed.wait_result(timeout_s=15)
        ids = [job["jobId"] for job in jobs]
        order = _state_writes(seen, ids)
        # The last two were claimed while the one before them held the only sandbox...
        waited = [job for before, job in itertools.pairwise(ids) if order.index((job, "parked")) < order.index((before, "done"))]
        assert waited, order
        # ...and none of the three ever said `starting`.
        for job in jobs:
            writes = _writes_of(seen, job["jobId"])
            assert not any("starting" in words for words in writes), [w for w in writes if "starting" in w]
        # The last one's follower sees every event, in order, from when its running write landed.
        live = [(n, p.get("phase")) for n, p in sorted(followed.events, key=lambda e: e[1]["seq"])]
        assert live == [("stage", "queued"), ("stage", "running"), ("stdout", None), ("result", None)], live
        assert [p["seq"] for _, p in followed.events] == [0, 1, 2, 3], followed.summary()
    finally:
        rt.close()
        api.close()


def test_a_job_killed_while_it_waits_for_a_sandbox_ends_killed_before_it_ran(make_stack: StackFactory) -> None:
    # Started, waiting its turn for the only sandbox (and still quiet about it): a kill ends
    # it then, with nothing of it run, and the busy job goes on.
    stack = make_stack(WORKER_MAX_SANDBOXES="1")
    api = Api(stack)
    try:
        busy = api.execute(py_job("import time\ntime.sleep(30)\n"))
        api.start(busy)
        api.wait_state(busy, {"running"}, timeout_s=15)
        quiet = False
        for _ in range(3):
            with watched_commands(stack) as seen:
                job = api.execute(py_job("open('ran', 'w')\nprint('ran')", collectOutput=True))
                api.start(job)
                _wait_claimed(stack, job["jobId"])
                assert api.post(f"/v1/jobs/{job['jobId']}/kill").status_code in (200, 202)
                result = api.wait_state(job, {"killed"}, timeout_s=15)["result"]
            assert result["outcome"] == "killed" and result["message"] == "killed before it ran", result
            quiet = not any("starting" in words for words in _writes_of(seen, job["jobId"]))
            if quiet:  # (killed within its quiet wait, as meant: a slow VM may miss it)
                break
        assert quiet, "no kill reached a job in its quiet wait"
        assert api.status(busy)["state"] == "running"
        api.post(f"/v1/jobs/{busy['jobId']}/kill")
    finally:
        api.close()


def test_a_started_job_that_waits_for_a_sandbox_says_starting_not_parked(make_stack: StackFactory) -> None:
    # Started before its claim, but no warm sandbox free (the only one runs another job for
    # seconds): once it has waited a moment (run.QUIET_WAIT_S) its status says it was started
    # and waits (`starting`), not that it waits for a start.
    stack = make_stack(WORKER_MAX_SANDBOXES="1", WORKER_MAX_PARKED="1")
    api = Api(stack)
    try:
        busy = api.execute(py_job("import time\ntime.sleep(4)\n"))
        api.start(busy)
        api.wait_state(busy, {"running"}, timeout_s=15)
        blocker = api.execute(py_job("print('never')"))  # (the worker's room for claims is full)
        _wait_claimed(stack, blocker["jobId"])
        job = api.execute(py_job("print('after')", collectOutput=True))
        api.start(job)
        time.sleep(0.3)
        assert api.status(job)["state"] == "queued"
        api.post(f"/v1/jobs/{blocker['jobId']}/kill")
        _wait_claimed(stack, job["jobId"])
        deadline = time.monotonic() + QUIET_WAIT_S + 0.5
        # (queued until the claim's script, which follows the move into the claimed list that
        # _wait_claimed saw; then parked, the claim's own state, through its quiet wait)
        while api.status(job)["state"] in ("queued", "parked"):
            assert time.monotonic() < deadline, "still parked, though started"
            time.sleep(0.01)
        states = set()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            states.add(api.status(job)["state"])
            time.sleep(0.05)
        assert states == {"starting"}, states
        assert api.status(busy)["state"] == "running"
        assert api.wait_state(job, {"done"}, timeout_s=15)["result"]["outcome"] == "completed"
    finally:
        api.close()
