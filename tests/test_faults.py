"""Faults with real processes: workers killed or frozen, Redis restarted, soketi down.

Nothing is lost and nothing runs twice: a parked job of a killed worker runs once
elsewhere; a running one ends `lost` within the lease bound and is never re-run; a worker
frozen past its lease writes nothing once it thaws (fencing); Redis restarted with its
append-only file keeps queue, flags, logs and results; soketi down loses only the live
view. Each test prints its figures (and appends them to test-output/faults.json); README
Operations quotes them.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from launcher.node import find_node
from launcher.stack import Stack, free_port
from launcher.supervisor import Backoff, describe_exit
from shared.paths import REPO_ROOT
from tests.conftest import StackFactory
from tests.helpers import Api, Realtime, dies_with_the_tests, py_job, run_job

TERMINAL = {"done", "killed", "error", "expired", "lost"}
# Short liveness settings so a dead worker is noticed in about a second.
HEARTBEAT_MS = 300
LEASE_MS = 1000
FAST_LEASE = {"WORKER_HEARTBEAT_MS": str(HEARTBEAT_MS), "WORKER_LEASE_TTL_MS": str(LEASE_MS)}
# How long Redis stays down in the restart test: well inside the lease (5 s there).
REDIS_DOWN_S = 2.0
REDIS_LONG_DOWN_S = 7.0
FIGURES = REPO_ROOT / "test-output" / "faults.json"

T = TypeVar("T")

slow = [pytest.mark.stack, pytest.mark.sandbox, pytest.mark.slow]


# ------------------------------------------------------------------ helpers


def figure(test: str, **values: Any) -> None:
    """Print a measured figure and keep it in test-output/faults.json."""
    print(f"FIGURES {test}: {values}")
    FIGURES.parent.mkdir(parents=True, exist_ok=True)
    with FIGURES.open("a") as out:
        out.write(json.dumps({"test": test, "at": time.time(), **values}) + "\n")


def wait_until(check: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.02) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(interval_s)


def durable_log(stack: Stack, job_id: str) -> list[tuple[int, str, Any]]:
    """The job's event log straight from Redis: (seq, name, payload or raw chunk text)."""
    with stack.redis() as redis:
        raw = redis.xrange(f"job:{job_id}:events")
    out: list[tuple[int, str, Any]] = []
    for _, fields in raw:
        payload = json.loads(fields[b"data"]) if b"data" in fields else fields[b"chunk"].decode()
        out.append((int(fields[b"seq"]), fields[b"name"].decode(), payload))
    return out


def running_stages(log: list[tuple[int, str, Any]]) -> int:
    return sum(1 for _, name, p in log if name == "stage" and p["phase"] == "running")


def results_in(log: list[tuple[int, str, Any]]) -> list[dict[str, Any]]:
    return [p for _, name, p in log if name == "result"]


def status_hash(stack: Stack, job_id: str) -> dict[bytes, bytes]:
    with stack.redis() as redis:
        return redis.hgetall(f"job:{job_id}:status")  # type: ignore[no-any-return]


def holder(stack: Stack, job_id: str) -> str | None:
    """The id of the worker holding the job's claim (None when nobody does)."""
    raw = status_hash(stack, job_id).get(b"worker")
    return raw.decode() if raw else None


def worker_name(stack: Stack, worker_id: str) -> str:
    for name, ids in stack.worker_history.items():
        if worker_id in ids:
            return name
    raise AssertionError(f"{worker_id} is none of this stack's workers: {stack.worker_history}")


def incarnation_log(stack: Stack, name: str, worker_id: str) -> str:
    """The part of `<name>.log` written by the incarnation with that id (the supervisor
    marks each restart in the file)."""
    text = stack.log(name)
    parts = re.split(r"^--- \S+ coderunner supervisor: \S+ restarted as (\S+) .*$", text, flags=re.M)
    # parts: [first incarnation, id2, text2, id3, text3, ...]
    ids = stack.worker_history[name]
    chunks = {ids[0]: parts[0]}
    for i in range(1, len(parts) - 1, 2):
        chunks[parts[i]] = parts[i + 1]
    return chunks.get(worker_id, "")


def ran_on(stack: Stack, job_id: str) -> str | None:
    """The id of the worker incarnation whose log reports the job's finished run."""
    pattern = re.compile(rf"job {re.escape(job_id)}: \w+ exit=")
    for name in stack.worker_names():
        for worker_id in stack.worker_history.get(name, []):
            if pattern.search(incarnation_log(stack, name, worker_id)):
                return worker_id
    return None


def reclaimed(stack: Stack, job_id: str, owner: str) -> bool:
    """Another worker holds the job now, or already finished it (a fast job can start and
    end between two looks at its holder)."""
    status = status_hash(stack, job_id)
    taker = status.get(b"worker")
    return (taker is not None and taker.decode() != owner) or status.get(b"result") is not None


def runs_logged(stack: Stack, job_id: str) -> int:
    """How many worker log lines report a finished run of the job (any outcome but lost)."""
    pattern = re.compile(rf"job {re.escape(job_id)}: \w+ exit=")
    return sum(len(pattern.findall(stack.log(name))) for name in stack.worker_names())


def assert_contiguous(log: list[tuple[int, str, Any]]) -> None:
    assert [seq for seq, _, _ in log] == list(range(len(log))), [(s, n) for s, n, _ in log]


# ------------------------------------------------------------------ the supervisor


def test_backoff_doubles_to_its_cap_and_resets_after_a_long_run() -> None:
    backoff = Backoff()
    assert [backoff.delay(1.0) for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff.delay(30.0) == 0.5  # it stayed up 30 s: a fresh failure, not a loop
    assert backoff.delay(29.9) == 1.0
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(3) == "exited with status 3"


def _serves_a_job(port: int, token: str) -> None:
    """A job run through the API at `port` completes."""
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}) as http:
        job = http.post("/v1/execute", json=py_job("print('served')")).json()
        assert http.post(f"/v1/jobs/{job['jobId']}/start").status_code == 202
        status = wait_until(
            lambda: (s := http.get(f"/v1/jobs/{job['jobId']}").json())["state"] in TERMINAL and s, 30, "the job"
        )
        assert status["result"]["outcome"] == "completed", status


def _children(parent: int) -> list[int]:
    """The processes whose parent is `parent` (Redis rewrites its environment with its
    title, so _marked cannot find it)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def _marked(mark: str) -> list[int]:
    needle = f"CODERUNNER_TEST_MARK={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            if state != "Z" and needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            pass
    return found


def _pid_of_worker(mark: str, worker_id: str) -> int:
    for pid in _marked(mark):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if f"WORKER_ID={worker_id}".encode() in env and b"-m\0worker" in cmdline and os.getpgid(pid) == pid:
            return pid
    raise AssertionError(f"no process runs worker {worker_id}")


@pytest.mark.stack
@pytest.mark.sandbox
@pytest.mark.slow
def test_up_restarts_a_dead_worker_or_api_and_stops_when_redis_dies(tmp_path: Path) -> None:
    """`coderunner up --workers 2`: a SIGKILLed worker is restarted (said in the output and
    the log folder) while the stack keeps serving, and so is the API; Redis dying stops
    everything."""
    port = free_port()
    mark = secrets.token_hex(8)
    env = {**os.environ, "CODERUNNER_TEST_MARK": mark, "CODERUNNER_LOG_ROOT": str(tmp_path / "logs")}
    env.pop("EXECUTOR_API_TOKEN", None)
    up = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "up", "--port", str(port), "--workers", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=REPO_ROOT,
        env=env,
        text=True,
        preexec_fn=dies_with_the_tests(),
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(up.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        try:
            wait_until(lambda: "Ctrl-C stops everything" in "".join(lines) or up.poll() is not None, 90, "the banner")
            banner = "".join(lines)
            assert "Ctrl-C stops everything" in banner, f"`up` exited with {up.poll()}"
        except AssertionError as exc:
            raise AssertionError(f"{exc}; `up` said:\n{''.join(lines)}") from None
        token = re.search(r"API token\s+(\S+)", banner).group(1)  # type: ignore[union-attr]
        log_dir = Path(re.search(r"Logs\s+(\S+)", banner).group(1))  # type: ignore[union-attr]
        ids = re.search(r"Workers\s+2 \((\S+), (\S+)\)", banner)
        assert ids is not None, banner
        first, second = ids.group(1), ids.group(2)
        assert first.startswith("worker-") and second.startswith("worker1-"), banner

        victim = _pid_of_worker(mark, second)
        killed_at = time.monotonic()
        os.killpg(victim, signal.SIGKILL)
        said = wait_until(lambda: [ln for ln in lines if "worker1" in ln and "ready" in ln], 30, "the restart")
        back_after = time.monotonic() - killed_at
        out = "".join(lines)
        assert f"worker1 ({second}, pid {victim}) killed by SIGKILL" in out and "restarting in 0.5 s" in out, out
        new_id = re.search(r"worker1 restarted as (\S+)", out).group(1)  # type: ignore[union-attr]
        assert new_id != second and new_id.startswith("worker1-"), out
        assert said and new_id in said[0]
        # The stack is still up, with both workers, and serves a job.
        assert up.poll() is None
        _serves_a_job(port, token)
        assert "killed by SIGKILL" in (log_dir / "supervisor.log").read_text()
        assert f"restarted as {new_id}" in (log_dir / "worker1.log").read_text()
        # Both incarnations wrote to worker1.log; a new one is a new process with a new id.
        _pid_of_worker(mark, new_id)
        figure("up_worker_restart", killed_to_ready_s=round(back_after, 2))

        # The API dying is for the supervisor too: it comes back on its port and serves.
        api_pid = next(p for p in _marked(mark) if b"-m\0api" in Path(f"/proc/{p}/cmdline").read_bytes())
        os.killpg(os.getpgid(api_pid), signal.SIGKILL)
        wait_until(lambda: any(ln.startswith("coderunner up: api restarted") for ln in lines), 30, "the API's restart")
        out = "".join(lines)
        assert f"api (pid {api_pid}) killed by SIGKILL" in out and up.poll() is None, out
        _serves_a_job(port, token)

        # Redis dying is not (a fresh one would have forgotten every job): the whole stack
        # stops, nothing is left.
        redis_pid = next(p for p in _children(up.pid) if Path(f"/proc/{p}/cmdline").read_bytes().startswith(b"redis-server"))
        os.killpg(os.getpgid(redis_pid), signal.SIGKILL)
        assert up.wait(60) == 1
        reader.join(5)
        out = "".join(lines)
        assert "redis exited unexpectedly; stopping" in out, out
        assert f"logs kept in {log_dir}" in out
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(30)
            except subprocess.TimeoutExpired:
                up.kill()
    time.sleep(0.3)
    assert _marked(mark) == [], "left behind"


# ------------------------------------------------------------------ workers killed


@pytest.mark.stack
@pytest.mark.sandbox
@pytest.mark.slow
def test_parked_job_of_a_killed_worker_runs_once_elsewhere(make_fleet: StackFactory) -> None:
    stack = make_fleet(workers=2, supervise=True, **FAST_LEASE)
    api, rt = Api(stack), Realtime(stack)
    try:
        job = api.execute(py_job("print('ran once')", collectOutput=True))
        job_id = job["jobId"]
        followed = rt.follow(job)
        api.wait_state(job, {"parked"}, timeout_s=10)
        owner = wait_until(lambda: holder(stack, job_id), 5, "the claim")
        victim = worker_name(stack, owner)
        killed_at = time.monotonic()
        stack.kill_worker(victim, signal.SIGKILL)
        assert api.start(job).status_code == 202  # durable: nobody live holds the job
        wait_until(lambda: reclaimed(stack, job_id, owner), 15, "a new claim")
        reclaimed_after = time.monotonic() - killed_at
        result = followed.wait_result(timeout_s=20)
        result_after = time.monotonic() - killed_at
        taken = wait_until(lambda: ran_on(stack, job_id), 5, "the run in a worker's log")
        assert result["outcome"] == "completed", result
        assert followed.text("stdout") == "ran once\n"
        time.sleep(1.0)  # room for a second result, should there be one
        log = durable_log(stack, job_id)
        assert_contiguous(log)
        assert running_stages(log) == 1 and len(results_in(log)) == 1, log
        assert len(followed.results()) == 1
        assert api.get(f"/v1/jobs/{job_id}/output").json()["stdout"] == "ran once\n"
        # It ran on another incarnation than the one killed, and only there.
        assert taken != owner
        assert f"job {job_id}: completed" not in incarnation_log(stack, victim, owner)
        assert runs_logged(stack, job_id) == 1
        # The supervisor brought the killed worker back, with a new id, after 0.5 s.
        restart = wait_until(lambda: [r for r in stack.restarts if r.old_id == owner and r.new_id], 10, "the restart")[0]
        assert restart.returncode == -signal.SIGKILL and restart.delay_s == 0.5
        figure(
            "parked_job_worker_sigkill",
            lease_ms=LEASE_MS,
            heartbeat_ms=HEARTBEAT_MS,
            kill_to_reclaim_s=round(reclaimed_after, 2),
            kill_to_result_s=round(result_after, 2),
            taken_by_restarted_incarnation=worker_name(stack, taken) == victim,
        )
    finally:
        rt.close()
        api.close()


@pytest.mark.stack
@pytest.mark.sandbox
@pytest.mark.slow
def test_running_job_of_a_killed_worker_is_lost_within_the_bound(make_fleet: StackFactory) -> None:
    stack = make_fleet(workers=2, supervise=True, **FAST_LEASE)
    api, rt = Api(stack), Realtime(stack)
    try:
        job = api.execute(py_job("import time\nprint('started', flush=True)\ntime.sleep(30)\n", collectOutput=True))
        job_id = job["jobId"]
        followed = rt.follow(job)
        api.start(job)
        wait_until(lambda: "started" in followed.text("stdout"), 15, "the program's first line")
        owner = holder(stack, job_id)
        assert owner is not None
        victim = worker_name(stack, owner)
        killed_at = time.monotonic()
        stack.kill_worker(victim, signal.SIGKILL)
        wait_until(lambda: status_hash(stack, job_id).get(b"state") == b"lost", 15, "lost in Redis", 0.01)
        in_log_after = time.monotonic() - killed_at
        result = followed.wait_result(timeout_s=10)
        live_after = time.monotonic() - killed_at
        assert result["outcome"] == "lost", result
        bound_s = (LEASE_MS + 2 * HEARTBEAT_MS) / 1000
        # WORKER_LEASE_TTL_MS for the lease to run out, one upkeep interval for a survivor to
        # notice, one heartbeat to confirm Redis did not stall meanwhile; plus scheduling
        # slack on a busy two-core machine.
        assert in_log_after <= bound_s + 1.0, (in_log_after, bound_s)
        time.sleep(2.0)  # room for a re-run or a second result, should there be one
        log = durable_log(stack, job_id)
        assert_contiguous(log)
        assert running_stages(log) == 1 and [r["outcome"] for r in results_in(log)] == ["lost"], log
        assert len(followed.results()) == 1
        assert followed.text("stdout") == "started\n"
        replay = api.replay(job)
        assert [n for n, _ in replay].count("result") == 1
        assert "".join(p["chunk"] for n, p in replay if n == "stdout") == "started\n"
        assert api.status(job)["state"] == "lost"
        # collectOutput: the verdict is there to pull, though no worker stored any output, and
        # with it what the program streamed (its log's): it was "" though the log, the SSE
        # replay and the live view all had the line.
        pulled = api.get(f"/v1/jobs/{job_id}/output")
        assert pulled.status_code == 200 and pulled.json()["outcome"] == "lost", pulled.text
        assert (pulled.json()["stdout"], pulled.json()["stderr"], pulled.json()["stdoutEncoding"]) == ("started\n", "", "utf8")
        assert runs_logged(stack, job_id) == 0  # no worker ever ran it to an end
        figure(
            "running_job_worker_sigkill",
            lease_ms=LEASE_MS,
            heartbeat_ms=HEARTBEAT_MS,
            bound_s=bound_s,
            kill_to_lost_in_redis_s=round(in_log_after, 2),
            kill_to_lost_live_s=round(live_after, 2),
        )
    finally:
        rt.close()
        api.close()


def test_a_result_stored_as_its_worker_died_still_reaches_its_follower(make_fleet: StackFactory) -> None:
    # The worker stored the result of a followed job, then died (SIGKILL) while its lane still
    # paced the job's output out: nothing held that the result was owed live, and nobody ever
    # published it (3 of 3 in a red team's runs). Whoever reaps the worker publishes it now.
    stack = make_fleet(workers=2, supervise=True, WORKER_MAX_SANDBOXES="2", **FAST_LEASE)
    api, rt = Api(stack), Realtime(stack)
    lines = 4096  # 4 MiB: its lane needs about a second to pace it out after the result is stored
    code = f"import sys\nline = 'x' * 1023 + '\\n'\nfor i in range({lines}):\n    sys.stdout.write(line)\n"
    try:
        job = api.execute(py_job(code, limits={"outputKb": 16384}))
        job_id = job["jobId"]
        followed = rt.follow(job)
        api.start(job)
        # State and holder from one read: the run can end between two reads on a loaded machine,
        # and the stored result takes the holder off the status.
        seen: dict[bytes, bytes] = {}
        wait_until(lambda: _running(stack, job_id, seen), 15, "the run", 0.005)
        owner = seen[b"worker"].decode()
        wait_until(lambda: status_hash(stack, job_id).get(b"state") == b"done", 30, "the stored result", 0.002)
        stack.kill_worker(worker_name(stack, owner), signal.SIGKILL)
        assert followed.results() == [], "the result went live before the kill: the test proves nothing"
        killed_at = time.monotonic()
        result = followed.wait_result(timeout_s=15)
        live_after = time.monotonic() - killed_at
        assert result == api.status(job)["result"] and result["outcome"] == "completed", result
        time.sleep(1.0)  # (room for a second copy)
        assert len(followed.results()) == 1, followed.summary()
        with stack.redis() as redis:
            assert not any(redis.exists(f"worker:{wid}:unpublished") for ids in stack.worker_history.values() for wid in ids)
        figure("stored_result_worker_sigkill", kill_to_result_live_s=round(live_after, 2))
    finally:
        rt.close()
        api.close()


def _running(stack: Stack, job_id: str, seen: dict[bytes, bytes]) -> bool:
    """True once the job's status says running; keeps that very read in `seen`."""
    status = status_hash(stack, job_id)
    if status.get(b"state") != b"running":
        return False
    seen.update(status)
    return True


def _record(stack: Stack, job_id: str) -> dict[str, Any]:
    """Everything Redis holds about a job's run."""
    with stack.redis() as redis:
        return {
            "status": redis.hgetall(f"job:{job_id}:status"),
            "events": redis.xrange(f"job:{job_id}:events"),
            "output": redis.get(f"job:{job_id}:output"),
            "stdout": redis.get(f"job:{job_id}:stdout"),
            "start": redis.exists(f"start:{job_id}"),
        }


@pytest.mark.stack
@pytest.mark.sandbox
@pytest.mark.slow
def test_worker_frozen_past_its_lease_writes_nothing_when_it_thaws(make_fleet: StackFactory) -> None:
    stack = make_fleet(workers=2, supervise=True, **FAST_LEASE)
    api, rt = Api(stack), Realtime(stack)
    try:
        program = "import time\nfor i in range(100):\n    print(i, flush=True)\n    time.sleep(0.1)\n"
        job = api.execute(py_job(program, collectOutput=True))
        job_id = job["jobId"]
        followed = rt.follow(job)
        api.start(job)
        wait_until(lambda: followed.text("stdout").count("\n") >= 5, 15, "some output")
        owner = holder(stack, job_id)
        assert owner is not None
        victim = worker_name(stack, owner)
        stopped_at = time.monotonic()
        stack.kill_worker(victim, signal.SIGSTOP)
        try:
            wait_until(lambda: status_hash(stack, job_id).get(b"state") == b"lost", 15, "lost", 0.01)
            lost_after = time.monotonic() - stopped_at
            followed.wait_result(timeout_s=10)
            # Frozen until the fleet has recovered everything: the job is lost and the other
            # worker's janitor has killed and removed the frozen one's jails, this job's too.
            wait_until(lambda: not _sandboxes_of(stack, owner), 20, "the frozen worker's jails to be swept", 0.1)
            swept_after = time.monotonic() - stopped_at
            time.sleep(0.5)
            before = _record(stack, job_id)
        finally:
            stack.kill_worker(victim, signal.SIGCONT)
        thawed_at = time.monotonic()

        # The thawed worker finds out at its first write for the job and gives it up (its
        # first write is usually a batch of the output its program wrote before the kill).
        def gave_up() -> bool:
            text = incarnation_log(stack, victim, owner)
            return f"job {job_id}: lease lost" in text or f"job {job_id}: result not written" in text

        wait_until(gave_up, 15, "the thawed worker to give the job up", 0.01)
        gave_up_after = time.monotonic() - thawed_at
        time.sleep(1.0)
        after = _record(stack, job_id)
        assert after == before, "the thawed worker changed the record"
        log = durable_log(stack, job_id)
        assert_contiguous(log)
        assert [r["outcome"] for r in results_in(log)] == ["lost"] and running_stages(log) == 1
        # Live: one result, and every event delivered is the logged event of its seq.
        assert [r["outcome"] for r in followed.results()] == ["lost"]
        logged = {seq: (name, payload) for seq, name, payload in log}
        for name, payload in followed.events:
            seq = payload["seq"]
            assert seq in logged and logged[seq][0] == name, (name, payload)
            if name in ("stdout", "stderr"):
                assert logged[seq][1] == payload["chunk"]
        result_seq = results_in(log)[0]["seq"]
        arrived = [p["seq"] for _, p in followed.events]
        late = arrived[arrived.index(result_seq) + 1 :]
        assert all(seq < result_seq for seq in late), late
        assert victim not in [r.name for r in stack.restarts]  # it never died
        figure(
            "worker_sigstop_past_lease",
            lease_ms=LEASE_MS,
            heartbeat_ms=HEARTBEAT_MS,
            stop_to_lost_s=round(lost_after, 2),
            stop_to_jails_swept_s=round(swept_after, 2),
            record_unchanged=after == before,
            live_events_after_the_result=len(late),
            thaw_to_job_given_up_s=round(gave_up_after, 2),
        )
    finally:
        rt.close()
        api.close()


@pytest.mark.stack
@pytest.mark.sandbox
@pytest.mark.slow
def test_parked_job_of_a_frozen_worker_runs_once_after_it_thaws(make_fleet: StackFactory) -> None:
    """A worker frozen with a parked job: the job goes back to the queue and another worker
    takes it. Thawed, the first one still holds its subscription and sees the start too; it
    must neither run the job nor publish anything for it."""
    stack = make_fleet(workers=2, supervise=True, **FAST_LEASE)
    api, rt = Api(stack), Realtime(stack)
    try:
        job = api.execute(py_job("print('once')", collectOutput=True))
        job_id = job["jobId"]
        followed = rt.follow(job)
        api.wait_state(job, {"parked"}, timeout_s=10)
        owner = wait_until(lambda: holder(stack, job_id), 5, "the claim")
        victim = worker_name(stack, owner)
        stopped_at = time.monotonic()
        stack.kill_worker(victim, signal.SIGSTOP)
        try:
            taken = wait_until(lambda: (h := holder(stack, job_id)) not in (None, owner) and h, 15, "a new claim")
            reclaimed_after = time.monotonic() - stopped_at
        finally:
            stack.kill_worker(victim, signal.SIGCONT)
        time.sleep(1.0)  # the thawed worker is back on its feet, still subscribed to the job
        assert api.start(job).status_code == 202
        result = followed.wait_result(timeout_s=20)
        assert result["outcome"] == "completed", result
        time.sleep(1.5)
        log = durable_log(stack, job_id)
        assert_contiguous(log)
        assert running_stages(log) == 1 and len(results_in(log)) == 1, log
        assert runs_logged(stack, job_id) == 1
        assert f"job {job_id}: completed" not in incarnation_log(stack, victim, owner)
        live = [(p["seq"], n) for n, p in followed.events]
        doubled = [item for item, count in Counter(live).items() if count > 1]
        figure(
            "parked_job_worker_sigstop",
            stop_to_reclaim_s=round(reclaimed_after, 2),
            taken_by=worker_name(stack, taken),
            live_events=len(live),
            live_events_delivered_twice=doubled,
        )
        # Live: every logged event once; the thawed worker published nothing for the job
        # (it writes its fenced state change before it publishes the parked backlog).
        assert sorted(live) == [(seq, name) for seq, name, _ in log], live
    finally:
        rt.close()
        api.close()


def _sandboxes_of(stack: Stack, worker_id: str) -> list[str]:
    jobs = Path("/sys/fs/cgroup/unified") / stack.deployment / "jobs"
    try:
        return [p.name for p in jobs.iterdir() if p.name.startswith(worker_id + ".")]
    except FileNotFoundError:
        return []


@pytest.mark.stack
@pytest.mark.sandbox
@pytest.mark.slow
def test_worker_thawed_after_its_lease_was_taken_runs_new_jobs_right(make_fleet: StackFactory) -> None:
    """While a worker is frozen, the others' janitors remove its sandboxes (its lease ran
    out). Thawed, it must not hand a job a sandbox that no longer exists."""
    stack = make_fleet(workers=2, supervise=False, WORKER_MAX_SANDBOXES="2", **FAST_LEASE)
    api, rt = Api(stack), Realtime(stack)
    try:
        frozen = stack.worker_ids["worker"]
        assert _sandboxes_of(stack, frozen)  # its warm pool
        frozen_at = time.monotonic()
        stack.kill_worker("worker", signal.SIGSTOP)
        try:
            # Its lease runs out and worker1's janitor removes its warm sandboxes.
            wait_until(lambda: not _sandboxes_of(stack, frozen), 20, "the frozen worker's sandboxes to be swept", 0.1)
            swept_after = time.monotonic() - frozen_at
        finally:
            stack.kill_worker("worker", signal.SIGCONT)
        wait_until(lambda: stack._redis_call("exists", f"worker:{frozen}:alive"), 10, "the thawed heartbeat")
        # Only the thawed worker serves now, so every job lands on it.
        stack.stop_process("worker1")
        outcomes = []
        for i in range(4):
            job = api.execute(py_job(f"print({i})"))
            followed = rt.follow(job)
            api.start(job)
            result = followed.wait_result(timeout_s=30)
            outcomes.append((result["outcome"], followed.text("stdout"), result.get("message")))
        figure("worker_thawed_runs_jobs", freeze_to_swept_s=round(swept_after, 2), outcomes=outcomes)
        assert outcomes == [("completed", f"{i}\n", None) for i in range(4)], outcomes
    finally:
        rt.close()
        api.close()


# ------------------------------------------------------------------ Redis restarted


@pytest.mark.stack
@pytest.mark.sandbox
@pytest.mark.slow
@pytest.mark.parametrize(
    ("how", "down_s"),
    [("SIGTERM", REDIS_DOWN_S), ("SIGKILL", REDIS_DOWN_S), ("SIGTERM", REDIS_LONG_DOWN_S)],
    ids=["sigterm", "sigkill", "sigterm-past-the-lease"],
)
def test_redis_restart_with_aof_keeps_queue_flags_logs_and_results(make_fleet: StackFactory, how: str, down_s: float) -> None:
    """Redis with `appendonly yes` + `appendfsync everysec`, restarted mid-run (a clean
    shutdown, or killed outright), with a job in every state; down for 2 s, or for longer
    than the 5 s lease (every liveness key has expired when it is back)."""
    # One slot and one parked job at most: the worker holds the running and the parked job,
    # later ones stay in the queue.
    stack = make_fleet(
        workers=1,
        supervise=True,
        redis_persistence=True,
        WORKER_MAX_SANDBOXES="1",
        WORKER_MAX_PARKED="1",
        WORKER_HEARTBEAT_MS="500",
        WORKER_LEASE_TTL_MS="5000",
    )
    api, rt = Api(stack), Realtime(stack)
    try:
        done = api.execute(py_job("print('finished before')", collectOutput=True))
        api.start(done)
        api.wait_state(done, {"done"}, timeout_s=20)
        done_before = (_record(stack, done["jobId"]), api.replay(done), api.get(f"/v1/jobs/{done['jobId']}/output").json())

        lines = 40
        running = api.execute(
            py_job(f"import time\nfor i in range({lines}):\n    print(i, flush=True)\n    time.sleep(0.1)\n", collectOutput=True)
        )
        followed = rt.follow(running)
        api.start(running)
        wait_until(lambda: followed.text("stdout").count("\n") >= 5, 15, "the running job's output")
        parked = api.execute(py_job("print('was parked')"))
        api.wait_state(parked, {"parked"}, timeout_s=10)
        queued_started = api.execute(py_job("print('start kept')"))
        queued = api.execute(py_job("print('was queued')"))
        assert api.start(queued_started).status_code == 202
        time.sleep(0.3)
        assert api.status(queued_started)["state"] == "queued" and api.status(queued)["state"] == "queued"
        if how == "SIGKILL":
            time.sleep(1.5)  # past the fsync second: what the kill may take is only the last second

        # Meanwhile a client keeps asking for the running job's status.
        codes: list[int] = []
        asking = threading.Event()

        def ask() -> None:
            with httpx.Client(base_url=stack.api_url, headers=api.headers(), timeout=10) as http:
                while not asking.is_set():
                    try:
                        codes.append(http.get(f"/v1/jobs/{running['jobId']}").status_code)
                    except httpx.HTTPError:
                        codes.append(0)
                    time.sleep(0.05)

        asker = threading.Thread(target=ask, daemon=True)
        asker.start()
        unreachable_s = stack.restart("redis", down_s=down_s, sig=getattr(signal, how))
        time.sleep(1.0)
        asking.set()
        asker.join(15)

        # The finished job: record, log and pullable output as they were.
        assert _record(stack, done["jobId"]) == done_before[0]
        assert api.replay(done) == done_before[1]
        assert api.get(f"/v1/jobs/{done['jobId']}/output").json() == done_before[2]
        # The running job finished normally, every line in the log, the output and live.
        status = api.wait_state(running, TERMINAL, timeout_s=30)
        assert status["result"]["outcome"] == "completed", status
        expected = "".join(f"{i}\n" for i in range(lines))
        log = durable_log(stack, running["jobId"])
        assert_contiguous(log)
        assert running_stages(log) == 1 and len(results_in(log)) == 1
        assert "".join(p for _, n, p in log if n == "stdout") == expected
        assert api.get(f"/v1/jobs/{running['jobId']}/output").json()["stdout"] == expected
        followed.wait_result(timeout_s=10)
        live_seqs = sorted(p["seq"] for _, p in followed.events)
        live_gaps = len(log) - len(set(live_seqs))
        assert len(followed.results()) == 1
        # The start flag stored while the job was queued was kept: it runs without a new start.
        assert api.wait_state(queued_started, TERMINAL, timeout_s=30)["result"]["outcome"] == "completed"
        # The parked and the queued job are still there and run once started.
        for job, text in ((parked, "was parked\n"), (queued, "was queued\n")):
            f = rt.follow(job)
            assert api.start(job).status_code == 202
            result = f.wait_result(timeout_s=30)
            assert result["outcome"] == "completed" and f.text("stdout") == text, (result, f.summary())
        for job in (done, running, parked, queued_started, queued):
            assert running_stages(durable_log(stack, job["jobId"])) == 1
        refused = [c for c in codes if c != 200]
        figure(
            f"redis_restart_aof_{how.lower()}_{down_s:g}s",
            redis_unreachable_s=round(unreachable_s, 2),
            status_polls=len(codes),
            non_200=sorted(set(refused)),
            non_200_count=len(refused),
            live_events_missed=live_gaps,
        )
        assert set(refused) <= {503}, codes  # a client is told to retry, never a wrong answer
    finally:
        rt.close()
        api.close()


# ------------------------------------------------------------------ soketi down


def _run_job_argv(stack: Stack, program: Path) -> list[str]:
    """clients/js/run-job.mjs running `program` (Python) against the stack."""
    return [find_node(), str(REPO_ROOT / "clients/js/run-job.mjs"), stack.api_url, stack.api_token, "python", str(program)]


def _started_run_job(stack: Stack, program: Path) -> subprocess.Popen[str]:
    """run-job.mjs started on `program`, its stdout (one event a line) and stderr piped."""
    return subprocess.Popen(_run_job_argv(stack, program), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _assert_whole_run(lines: list[str], stdout: str) -> None:
    """run-job.mjs printed every event once, in `seq` order, one `result` last (completed),
    and the stdout chunks make `stdout`."""
    events = [json.loads(line) for line in lines]
    assert [e["data"]["seq"] for e in events] == list(range(len(events))), events
    assert [e["event"] for e in events].count("result") == 1 and events[-1]["event"] == "result", events
    assert events[-1]["data"]["outcome"] == "completed", events
    assert "".join(e["data"]["chunk"] for e in events if e["event"] == "stdout") == stdout


@pytest.mark.stack
@pytest.mark.sandbox
@pytest.mark.slow
def test_the_example_pusher_js_client_reads_what_an_outage_hid_from_the_log(make_stack: StackFactory, tmp_path: Path) -> None:
    """clients/js/run-job.mjs, the client to copy: soketi goes down mid-run and comes back;
    pusher-js reconnects and subscribes again. The client must not start the job again (a
    409 that used to end it), and prints every event once, in order, the ones published
    while it was away read from the job's log."""
    stack = make_stack()
    program = tmp_path / "count.py"
    lines = 40
    program.write_text(f"import time\nfor i in range({lines}):\n    print(i, flush=True)\n    time.sleep(0.1)\n")
    client = _started_run_job(stack, program)
    try:
        assert client.stdout is not None
        seen = [client.stdout.readline() for _ in range(6)]  # (stages, then the first lines)
        assert all(seen), seen
        stack.stop_process("soketi", signal.SIGKILL)
        time.sleep(1.5)
        stack.restart("soketi")  # the same port
        rest, errors = client.communicate(timeout=60)
    finally:
        client.kill()
    assert client.returncode == 0, errors
    _assert_whole_run([*seen, *rest.splitlines()], "".join(f"{i}\n" for i in range(lines)))


@pytest.mark.stack
@pytest.mark.sandbox
@pytest.mark.slow
def test_the_example_pusher_js_client_runs_a_job_while_soketi_is_down(make_stack: StackFactory, tmp_path: Path) -> None:
    """Review: with soketi down at submit, the subscription never succeeded, so the client
    never started the job (it expired) and gave up after its whole wait. It now starts the
    job when the subscription has not come within a few seconds, and reads every event
    from the job's log."""
    stack = make_stack()
    program = tmp_path / "hello.py"
    program.write_text("print('hello')\n")
    stack.stop_process("soketi", signal.SIGKILL)
    try:
        done = subprocess.run(
            _run_job_argv(stack, program),
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        stack.restart("soketi")
    assert done.returncode == 0, done.stderr
    assert "following the event log" in done.stderr
    _assert_whole_run(done.stdout.splitlines(), "hello\n")


@pytest.mark.stack
@pytest.mark.sandbox
@pytest.mark.slow
def test_the_example_pusher_js_client_ends_a_run_whose_live_view_went_silent(make_stack: StackFactory, tmp_path: Path) -> None:
    """Review: soketi gone for good in mid-run leaves no reconnect and no gap to notice, and
    the client waited out its whole wait for a result the log already held. A silence of a
    few seconds now has it ask the job's status, and read the rest from the log once the
    job has ended."""
    stack = make_stack()
    program = tmp_path / "two.py"
    program.write_text("import time\nprint('first', flush=True)\ntime.sleep(1.5)\nprint('second')\n")
    client = _started_run_job(stack, program)
    try:
        assert client.stdout is not None
        seen = []
        while not seen or json.loads(seen[-1])["event"] != "stdout":
            seen.append(client.stdout.readline())
            assert seen[-1], seen
        stack.stop_process("soketi", signal.SIGKILL)  # (not back before the run ends)
        started = time.monotonic()
        rest, errors = client.communicate(timeout=40)
        took_s = time.monotonic() - started
    finally:
        client.kill()
        stack.restart("soketi")
    assert client.returncode == 0, errors
    assert took_s < 15, took_s  # (a silence check, not the client's whole wait)
    _assert_whole_run([*seen, *rest.splitlines()], "first\nsecond\n")


@pytest.mark.sandbox
@pytest.mark.slow
def test_soketi_down_mid_run_loses_only_the_live_view(make_fleet: StackFactory) -> None:
    stack = make_fleet(workers=1, supervise=True)
    api, rt = Api(stack), Realtime(stack)
    rt2: Realtime | None = None
    try:
        lines = 100
        program = f"import time\nfor i in range({lines}):\n    print(i, flush=True)\n    time.sleep(0.1)\n"
        job = api.execute(py_job(program, collectOutput=True))
        followed = rt.follow(job)
        api.start(job)
        wait_until(lambda: followed.text("stdout").count("\n") >= 5, 15, "live output")
        down_at = time.monotonic()
        stack.stop_process("soketi", signal.SIGKILL)
        time.sleep(2.0)
        stack.restart("soketi")  # the same port
        back_at = time.monotonic()
        # A client that (re)subscribes now gets the rest live.
        rt2 = Realtime(stack)
        again = rt2.follow(job)
        first = wait_until(lambda: again.events, 15, "live events after soketi came back")
        first_live_after = time.monotonic() - back_at
        result = again.wait_result(timeout_s=30)
        assert result["outcome"] == "completed"
        expected = "".join(f"{i}\n" for i in range(lines))
        replay = api.replay(job)
        assert [p["seq"] for _, p in replay] == list(range(len(replay)))
        assert "".join(p["chunk"] for n, p in replay if n == "stdout") == expected
        assert api.get(f"/v1/jobs/{job['jobId']}/output").json()["stdout"] == expected
        # What the second client got live is the tail of the log, in order, without a gap
        # after its first event.
        seqs = [p["seq"] for _, p in again.events]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs
        assert seqs[-1] == len(replay) - 1
        # The next job is live from its first event to its result.
        nxt = api.execute(py_job("print('after the outage')"))
        f3 = rt2.follow(nxt)
        api.start(nxt)
        assert f3.wait_result(timeout_s=20)["outcome"] == "completed"
        assert sorted(p["seq"] for _, p in f3.events) == list(range(len(durable_log(stack, nxt["jobId"]))))
        figure(
            "soketi_down_mid_run",
            down_s=round(back_at - down_at, 2),
            back_to_first_live_event_s=round(first_live_after, 2),
            first_live_seq=first[0][1]["seq"],
            log_events=len(replay),
            first_client_reconnected=bool([p for _, p in followed.events if p["seq"] > first[0][1]["seq"]]),
        )
    finally:
        if rt2 is not None:
            rt2.close()
        rt.close()
        api.close()


def test_a_started_job_on_a_worker_that_cannot_build_sandboxes_ends_instead_of_waiting(
    make_stack: StackFactory, tmp_path: Path
) -> None:
    # The worker's nsjail starts failing after start-up (as on a full disk or a broken cgroup
    # tree): every rebuild fails. A started job must not stay `starting` for as long as that
    # lasts: it goes round the queue a few times, then ends internal_error with the reason.
    from bench.latency import stack_nsjail

    broken = tmp_path / "broken"
    wrapper = tmp_path / "nsjail"
    wrapper.write_text(
        f"#!/bin/sh\nif [ -e {broken} ]; then echo 'nsjail: injected failure' >&2; exit 1; fi\n"
        f'exec {stack_nsjail()} "$@"\n'
    )
    wrapper.chmod(0o755)
    stack = make_stack(NSJAIL_PATH=str(wrapper), WORKER_MAX_SANDBOXES="1")
    api, rt = Api(stack), Realtime(stack)
    try:
        warm = api.execute(py_job("print('warm')"))
        api.start(warm)
        assert api.wait_state(warm, TERMINAL)["state"] == "done"
        time.sleep(2)  # the slot's next sandbox is built
        # A test batch: its first case runs in the warm sandbox; the second needs a new one.
        batch = api.execute(py_job("print(input())", tests=[{"stdin": "a"}, {"stdin": "b"}]))
        broken.touch()  # from now on every sandbox build fails
        api.start(batch)
        done = api.wait_state(batch, TERMINAL, timeout_s=40)
        cases = [c["outcome"] for c in api.get(f"/v1/jobs/{batch['jobId']}").json()["result"]["tests"]]
        assert cases == ["completed", "internal_error"], done
        job = api.execute(py_job("print('never')"))
        followed = rt.follow(job)
        started_at = time.monotonic()
        api.start(job)
        result = followed.wait_result(timeout_s=60)
        took_s = time.monotonic() - started_at
        assert result["outcome"] == "internal_error", result
        assert "sandbox preparation failed" in result["message"], result
        assert int(status_hash(stack, job["jobId"]).get(b"handovers", b"0")) == 3
        assert took_s < 40, took_s
        assert followed.text("stdout") == ""
        figure("started_job_broken_sandboxes", internal_error_after_s=round(took_s, 1))
    finally:
        rt.close()
        api.close()


def test_a_worker_restarted_under_its_id_after_dying_in_its_self_test_starts(make_stack: StackFactory) -> None:
    # An operator's fixed WORKER_ID: the worker was killed during its start-up self-test,
    # whose workspace stayed behind. The next start must not trip over it (and exit, again
    # and again); its sweep of its own leftovers removes it once it is up.
    stack = make_stack(with_worker=False, WORKER_MAX_SANDBOXES="2", **FAST_LEASE)

    def start_fixed() -> str:
        name = stack._add_worker({"WORKER_ID": "fixed-1"})
        stack.worker_ids[name] = "fixed-1"  # what the stack waits for: the fixed id's listing
        stack._wait_worker_ready(name, 30)
        return name

    stack.kill_worker(start_fixed(), signal.SIGKILL)
    leftover = Path(f"/run/{stack.deployment}/fixed-1.2.1")  # the self-test's first name
    leftover.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "coderunner-ws", str(leftover)], check=True)
    (leftover / "probe").write_text("ok")
    with stack.redis() as redis:  # the killed incarnation's lease runs out first
        wait_until(lambda: not redis.exists("worker:fixed-1:alive"), 15, "the old lease to run out", 0.05)
    start_fixed()
    api = Api(stack)
    try:
        job = api.execute(py_job("print('up')"))
        api.start(job)
        assert api.wait_state(job, TERMINAL)["result"]["outcome"] == "completed"
        assert not leftover.exists()
    finally:
        api.close()


@pytest.mark.stack
def test_a_stopping_api_ends_its_long_waits_at_once(make_stack: StackFactory) -> None:
    # SIGTERM with one event stream and one /output?waitMs open: uvicorn waited for both to
    # end by themselves, about 30 s (a restart held that long, every start refused and parked
    # jobs expiring meanwhile). They now end at once: the wait answers a 503 to ask again, the
    # stream ends with a retry hint (its EventSource reconnects with Last-Event-ID).
    stack = make_stack(with_worker=False)
    api = Api(stack)
    job = api.execute(py_job("print(1)", collectOutput=True))  # (stays queued: no worker)
    api.close()
    auth = {"Authorization": f"Bearer {stack.api_token}"}
    got: dict[str, Any] = {}

    def wait_output() -> None:
        with httpx.Client(base_url=stack.api_url, headers=auth, timeout=90) as client:
            answer = client.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": 60000})
            got["output"] = (answer.status_code, answer.json())

    def read_events() -> None:
        with httpx.stream("GET", f"{stack.api_url}/v1/jobs/{job['jobId']}/events", headers=auth, timeout=90) as answer:
            got["events"] = b"".join(answer.iter_bytes())

    readers = [threading.Thread(target=wait_output), threading.Thread(target=read_events)]
    for reader in readers:
        reader.start()
    time.sleep(1.0)  # (both waiting in Redis)
    began = time.monotonic()
    stack.stop_process("api", signal.SIGTERM)
    took = time.monotonic() - began
    for reader in readers:
        reader.join(10)
    assert took < 3, f"the API took {took:.1f} s to stop"
    assert got["output"][0] == 503 and got["output"][1]["retryAfterMs"] == 1000, got["output"]
    assert got["events"] == b"retry: 1000\n\n", got["events"]  # (a queued job's log is empty)


@pytest.mark.sandbox
@pytest.mark.slow
def test_up_brings_a_crashed_soketi_or_api_back_on_its_port(make_fleet: StackFactory) -> None:
    # `coderunner up` supervises soketi and the API as it does workers: one that dies (here
    # SIGKILLed, whole group, as a crash would end it) is started again on its port after the
    # backoff, and said so; clients that reconnect are served as before. Redis is not
    # restarted (a fresh one would have forgotten every job): its death is still reported.
    stack = make_fleet(workers=1, supervise=True, supervise_services=True)
    api = Api(stack)
    try:
        for name in ("soketi", "api"):
            old = stack.procs[name]
            os.killpg(old.pid, signal.SIGKILL)
            wait_until(lambda name=name: any(n.startswith(f"{name} restarted") for n in stack.notes), 30, f"{name} back")
            assert stack.procs[name].pid != old.pid and stack.dead_children() == []
            assert any(n.startswith(f"{name} (pid {old.pid}) killed by SIGKILL") for n in stack.notes), stack.notes
            # Served again, on the same port: a job followed live from a fresh client.
            api.close()
            api, rt = Api(stack), Realtime(stack)
            try:
                result, heard = run_job(api, rt, py_job(f"print('after {name}')"))
            finally:
                rt.close()
            assert result["outcome"] == "completed" and heard.text("stdout") == f"after {name}\n", heard.summary()
        assert [(r.name, r.returncode) for r in stack.restarts] == [("soketi", -9), ("api", -9)]
        os.killpg(stack.procs["redis"].pid, signal.SIGKILL)
        wait_until(lambda: "redis" in stack.dead_children(), 10, "redis reported dead")
        time.sleep(1.0)
        assert "redis" in stack.dead_children() and all(r.name != "redis" for r in stack.restarts)
    finally:
        api.close()
