"""Compile while parked: a compiled job borrows a spare sandbox before its start, and what a
client sees is the same as compiling after start, in the same order, only sooner.

Java is the probe: javac takes several times as long as the run, so a start → result time
shorter than the compile's own duration can only mean the compile happened before start.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.stack import Stack
from shared.manifest import PRESTART_DIR_IN_JAIL
from shared.paths import REPO_ROOT
from tests.conftest import StackFactory
from tests.helpers import Api, Followed, Realtime, pids_with_cmdline, py_job, watched_commands

pytestmark = pytest.mark.slow

JAVA_OK = """public class Main {
    public static void main(String[] args) {
        System.out.println("hello from java " + args.length);
    }
}
"""
JAVA_BROKEN = "public class Main { void f() { int x = ; } }\n"


def java(source: str) -> dict[str, Any]:
    return {"language": "java", "files": [{"name": "Main.java", "content": source}]}


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(extra_env={"WORKER_MAX_SANDBOXES": "2", "WORKER_PRESTART": ""}) as s:
        yield s


@pytest.fixture
def clients(stack: Stack) -> Iterator[tuple[Api, Realtime]]:
    api, rt = Api(stack), Realtime(stack)
    try:
        yield api, rt
    finally:
        rt.close()
        api.close()


def start_and_wait(api: Api, followed: Followed, timeout_s: float = 60) -> tuple[dict[str, Any], float]:
    t0 = time.monotonic()
    assert api.start(followed.job).status_code in (200, 202)
    result = followed.wait_result(timeout_s)
    return result, (time.monotonic() - t0) * 1000


def names_in_order(followed: Followed) -> list[str]:
    """Event names by seq, after checking the seqs have no hole and no repeat."""
    events = sorted((p["seq"], n) for n, p in followed.events)
    assert [seq for seq, _ in events] == list(range(len(events))), followed.summary()
    return [n for _, n in events]


def phases(followed: Followed) -> list[str]:
    return [p["phase"] for n, p in sorted(followed.events, key=lambda e: e[1]["seq"]) if n == "stage"]


def both_slots_serve(api: Api, rt: Realtime, probe: str = "import time; time.sleep(0.5); print('ok')") -> list[Followed]:
    """Two started jobs run side by side (no slot is still held), each to completion."""
    jobs = [api.execute(py_job(probe)) for _ in range(2)]
    follows = [rt.follow(j) for j in jobs]
    t0 = time.monotonic()
    for f in follows:
        api.start(f.job)
    for f in follows:
        assert f.wait_result()["outcome"] == "completed"
    assert time.monotonic() - t0 < 1.5, "a killed job's sandbox was not given back"
    return follows


def started_jobs_recall_the_borrower(api: Api, rt: Realtime) -> Followed:
    """A long job takes the slot nobody borrowed; a quick one must then recall the borrowed
    sandbox rather than wait. Returns the long job, still running."""
    long = api.execute(py_job("import time; time.sleep(3); print('long')"))
    long_follow = rt.follow(long)
    api.start(long)
    time.sleep(0.5)
    quick = api.execute(py_job("print('quick')"))
    quick_follow = rt.follow(quick)
    result, took_ms = start_and_wait(api, quick_follow)
    assert result["outcome"] == "completed" and took_ms < 1500, (took_ms, quick_follow.summary())
    assert not long_follow.results(), "the quick job waited for the long one"
    return long_follow


def test_a_parked_java_job_is_compiled_before_its_start(clients: tuple[Api, Realtime]) -> None:
    api, rt = clients
    job = api.execute(java(JAVA_OK))
    followed = rt.follow(job)
    time.sleep(4)  # parked: time enough to compile
    assert not followed.events, "nothing may be published before start"
    result, took_ms = start_and_wait(api, followed)
    assert result["outcome"] == "completed", followed.summary()
    assert followed.text("stdout") == "hello from java 0\n"
    assert phases(followed) == ["queued", "compiling", "running"]
    assert names_in_order(followed)[-1] == "result"
    compile_ms = result["compile"]["durationMs"]
    assert took_ms < compile_ms, f"start → result {took_ms:.0f} ms, compile {compile_ms} ms: compiled after start"


def test_a_compile_error_found_while_parked_is_delivered_after_start(clients: tuple[Api, Realtime]) -> None:
    api, rt = clients
    job = api.execute(java(JAVA_BROKEN))
    followed = rt.follow(job)
    time.sleep(4)
    assert not followed.events
    result, took_ms = start_and_wait(api, followed)
    assert result["outcome"] == "compile_error", followed.summary()
    assert "error" in result["compile"]["output"]
    assert phases(followed) == ["queued", "compiling"]
    assert "compile_output" in names_in_order(followed)
    assert took_ms < result["compile"]["durationMs"]


def test_killing_a_parked_job_that_compiled_frees_its_sandbox(clients: tuple[Api, Realtime]) -> None:
    api, rt = clients
    job = api.execute(java(JAVA_OK))
    followed = rt.follow(job)
    time.sleep(4)
    assert api.post(f"/v1/jobs/{job['jobId']}/kill").status_code == 202
    assert followed.wait_result()["outcome"] == "killed"
    both_slots_serve(api, rt)


def test_a_started_job_recalls_a_borrowed_sandbox(clients: tuple[Api, Realtime]) -> None:
    """Two slots: a parked Java job holds one (compiled); a started job holds the other; a
    second started job must not wait for either: it recalls the borrowed one. The Java job
    then compiles after its own start, with one compile stage all the same."""
    api, rt = clients
    parked = api.execute(java(JAVA_OK))
    parked_follow = rt.follow(parked)
    time.sleep(4)
    long_follow = started_jobs_recall_the_borrower(api, rt)
    result, took_ms = start_and_wait(api, parked_follow)
    assert result["outcome"] == "completed", parked_follow.summary()
    assert parked_follow.text("stdout") == "hello from java 0\n"
    assert phases(parked_follow) == ["queued", "compiling", "running"]
    assert took_ms > result["compile"]["durationMs"], "it was compiled before start, yet its sandbox was recalled"
    assert long_follow.wait_result()["outcome"] == "completed"


def test_a_compile_still_running_at_start_streams_live_and_can_be_killed(clients: tuple[Api, Realtime]) -> None:
    api, rt = clients
    # Enough functions to keep gcc -O2 busy for several seconds.
    source = "".join(f"int f{i}(int x) {{ return x * {i} + (x >> 3) ^ {i}; }}\n" for i in range(60000))
    source += "int main(void) { return f1(2) == 0; }\n"
    job = api.execute({"language": "c", "files": [{"name": "main.c", "content": source}]})
    followed = rt.follow(job)
    time.sleep(1.0)  # the compile is under way, parked
    assert api.start(job).status_code in (200, 202)
    deadline = time.monotonic() + 3
    while "compiling" not in phases(followed):
        assert time.monotonic() < deadline, f"the compile stage did not go out at start: {followed.summary()}"
        time.sleep(0.02)
    assert api.post(f"/v1/jobs/{job['jobId']}/kill").status_code == 202
    result = followed.wait_result(timeout_s=20)
    assert result["outcome"] == "killed" and result["killedBy"] == "user" and result["compile"] is not None
    assert phases(followed) == ["queued", "compiling"]
    names_in_order(followed)


# ---------------------------------------------------------------- interpreted: load while parked

PY_PROBE = "import os, sys\nprint(sorted(os.listdir('.')), sys.argv[1:], os.getcwd())\n"


def wait_loaded_while_parked(stack: Stack, job: dict[str, Any]) -> None:
    deadline = time.monotonic() + 5
    while f"job {job['jobId']}: loaded while parked" not in stack.log("worker"):
        assert time.monotonic() < deadline, "the parked job was not loaded into a spare sandbox"
        time.sleep(0.02)


def test_a_parked_python_job_is_loaded_before_its_start(stack: Stack, clients: tuple[Api, Realtime]) -> None:
    api, rt = clients
    job = api.execute(py_job(PY_PROBE, args=["a b"]))
    followed = rt.follow(job)
    wait_loaded_while_parked(stack, job)
    assert not followed.events, "nothing may be published before start"
    result, _ = start_and_wait(api, followed)
    assert result["outcome"] == "completed" and result["exitCode"] == 0, followed.summary()
    # What the program sees is what a job loaded after start sees.
    assert followed.text("stdout") == "['main.py'] ['a b'] /workspace\n"
    assert phases(followed) == ["queued", "running"]
    assert names_in_order(followed)[-1] == "result"


def test_a_start_that_comes_while_the_load_goes_on_takes_the_job_straight_to_running(
    stack: Stack, clients: tuple[Api, Realtime]
) -> None:
    # A grader sends its start right after its execute, while the job's files still go into
    # the spare sandbox (many of them here, so the load is sure to be under way). The job
    # waits for the load and then takes one fenced write to `running`: it never says
    # `starting`, which was a round trip more to Redis for every such job. (A start that
    # wins the race to the claim takes another path, with no load while parked: such a job
    # is tried again.)
    api, rt = clients
    files = [{"name": "main.py", "content": "import os\nprint(len(os.listdir('data/a/b/c')))\n"}]
    files += [{"name": f"data/a/b/c/f{n}.txt", "content": "x" * 16384} for n in range(99)]
    loaded_while_parked = 0
    for _ in range(5):
        both_slots_serve(api, rt, "print('ok')")  # (both slots have a sandbox ready after this)
        time.sleep(0.5)
        with watched_commands(stack) as seen:
            job = api.execute({"language": "python", "files": files, "collectOutput": True})
            assert api.start(job).status_code in (200, 202)
            output = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "30000"}).json()
        assert output["outcome"] == "completed" and output["stdout"] == "99\n", output
        if f"job {job['jobId']}: loaded while parked" not in stack.log("worker"):
            continue
        loaded_while_parked += 1
        writes = [command for command in seen if job["jobId"] in command and "EVALSHA" in command]
        assert any("running" in command.split() for command in writes), writes
        assert not any("starting" in command.split() for command in writes), writes
        if loaded_while_parked == 2:
            break
    assert loaded_while_parked, "no job was claimed before its start"


@pytest.mark.parametrize("killed", ["nsjail", "runtime"])
def test_a_loaded_sandbox_that_ended_while_parked_is_replaced_at_start(
    stack: Stack, clients: tuple[Api, Realtime], killed: str
) -> None:
    # Its jail killed while the job waited (the host's OOM killer, say): the sandbox goes
    # back as its jail ends, and at start the job loads into a fresh one, not into a dead
    # one (internal_error, or a dead runtime's exit taken for the program's). Review: a
    # prestarted runtime killed alone leaves its gate waiting to be let go and nsjail alive;
    # the jail has ended all the same.
    api, rt = clients
    job = api.execute(py_job("print('ran')"))
    followed = rt.follow(job)
    wait_loaded_while_parked(stack, job)
    if killed == "nsjail":
        _kill_the_stacks_jails(stack)
    else:
        _kill_the_stacks_runtimes(stack)
    # Seen as it happens, not at the start: a start sent right after the kill could
    # otherwise reach the worker before the gate's report does.
    wait_logged(stack, f"job {job['jobId']}: the sandbox it loaded in while parked has ended")
    result, _ = start_and_wait(api, followed)
    assert result["outcome"] == "completed" and followed.text("stdout") == "ran\n", stack.log("worker")[-4000:]
    assert phases(followed) == ["queued", "running"]


def wait_logged(stack: Stack, line: str, timeout_s: float = 5) -> None:
    deadline = time.monotonic() + timeout_s
    while line not in stack.log("worker"):
        assert time.monotonic() < deadline, f"the worker did not log {line!r}"
        time.sleep(0.02)


def _kill_the_stacks_jails(stack: Stack) -> None:
    """SIGKILL every nsjail of the stack's worker, and wait until the worker reaped them."""
    jails = pids_with_cmdline(b"nsjail", f"/run/{stack.deployment}/".encode())
    assert jails, "no jail of this stack found"
    for pid in jails:
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while any(Path(f"/proc/{pid}").exists() for pid in jails):
        assert time.monotonic() < deadline, "the killed jails were not reaped"
        time.sleep(0.01)


def _kill_the_stacks_runtimes(stack: Stack) -> None:
    """SIGKILL every prestarted runtime in the stack's jails (their gates and nsjail stay)."""
    runtimes = [
        pid
        for pid in pids_with_cmdline(PRESTART_DIR_IN_JAIL.encode())
        if f"/{stack.deployment}/".encode() in _cgroups_of(pid)
    ]
    assert runtimes, "no prestarted runtime of this stack found"
    for pid in runtimes:
        os.kill(pid, signal.SIGKILL)


def _cgroups_of(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cgroup").read_bytes()
    except OSError:
        return b""


def test_a_compiled_sandbox_that_ended_while_parked_is_compiled_again_after_start(stack: Stack, clients: tuple[Api, Realtime]) -> None:
    # Seen as its jail ends (nothing of the compile went out yet: its events were only
    # recorded), the sandbox goes back and the job compiles again after its start, the
    # client seeing one compile. (A jail that ends as the job starts, its compile's events
    # already sent on, makes the job fail as the platform's: test_worker_units.)
    api, rt = clients
    job = api.execute(java(JAVA_OK))
    followed = rt.follow(job)
    wait_logged(stack, f"job {job['jobId']}: compiled while parked", timeout_s=30)
    _kill_the_stacks_jails(stack)
    wait_logged(stack, f"job {job['jobId']}: the sandbox it compiled in while parked has ended")
    result, _ = start_and_wait(api, followed)
    assert result["outcome"] == "completed", followed.summary()
    assert followed.text("stdout") == "hello from java 0\n"
    assert phases(followed) == ["queued", "compiling", "running"]
    names_in_order(followed)
    assert "Traceback" not in stack.log("worker").split(f"job {job['jobId']}: compiled while parked")[-1]
    both_slots_serve(api, rt)


def test_killing_a_parked_loaded_job_frees_its_sandbox(stack: Stack, clients: tuple[Api, Realtime]) -> None:
    api, rt = clients
    job = api.execute(py_job("print('never')"))
    followed = rt.follow(job)
    wait_loaded_while_parked(stack, job)
    assert api.post(f"/v1/jobs/{job['jobId']}/kill").status_code == 202
    result = followed.wait_result()
    assert result["outcome"] == "killed" and not followed.text("stdout")
    # Both slots serve again, and the next jobs do not see the killed job's files.
    probe = "import time, os; time.sleep(0.5); print(sorted(os.listdir('.')))"
    for f in both_slots_serve(api, rt, probe):
        assert f.text("stdout") == "['main.py']\n"


def test_a_started_job_recalls_a_loaded_sandbox(stack: Stack, clients: tuple[Api, Realtime]) -> None:
    """Two slots: a parked Python job holds one (loaded), a started job the other; a second
    started job recalls the loaded one, and the parked job loads after its own start."""
    api, rt = clients
    parked = api.execute(py_job("print('parked')"))
    parked_follow = rt.follow(parked)
    wait_loaded_while_parked(stack, parked)
    long_follow = started_jobs_recall_the_borrower(api, rt)
    result, _ = start_and_wait(api, parked_follow)
    assert result["outcome"] == "completed" and parked_follow.text("stdout") == "parked\n", parked_follow.summary()
    assert phases(parked_follow) == ["queued", "running"]
    assert long_follow.wait_result()["outcome"] == "completed"


@pytest.mark.stack
@pytest.mark.sandbox
def test_a_compile_is_held_to_its_manifests_idle_limit(make_stack: StackFactory, tmp_path: Path) -> None:
    # A manifest's compile limits carry idleMs like the run's; the compile ignored it.
    profiles = tmp_path / "profiles"
    shutil.copytree(REPO_ROOT / "sandbox-profiles", profiles)
    manifest = profiles / "languages" / "c.toml"
    text = manifest.read_text()
    text = text.replace('argv = ["/usr/bin/gcc"', 'argv = ["/bin/sh", "-c", "sleep 5", "/usr/bin/gcc"', 1)
    text = text.replace("limits = { wallTimeMs = 20000,", "limits = { idleMs = 1000, wallTimeMs = 20000,", 1)
    assert "idleMs = 1000" in text and "sleep 5" in text
    manifest.write_text(text)
    stack = make_stack(SANDBOX_PROFILES_DIR=str(profiles), WORKER_MAX_SANDBOXES="1")
    api = Api(stack)
    try:
        source = "int main(void) { return 0; }\n"
        job = api.execute({"language": "c", "files": [{"name": "main.c", "content": source}]})
        api.start(job)
        result = api.replay(job, timeout_s=30)[-1][1]
        assert result["outcome"] == "compile_error", result
        assert result["compile"]["timedOut"] is True and result["compile"]["signal"] == "SIGKILL"
        assert 900 <= result["compile"]["durationMs"] < 3000, result["compile"]
    finally:
        api.close()
