"""`coderunner up` runs the whole stack and stops without leaving a process behind;
pusher-js (the browser client) drives a job through it."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from launcher.node import find_node
from launcher.stack import free_port
from shared.paths import REPO_ROOT
from tests.helpers import alive, dies_with_the_tests

pytestmark = [pytest.mark.stack, pytest.mark.sandbox, pytest.mark.slow]


def _children() -> dict[int, int]:
    """pid -> parent pid for every process on the machine."""
    table: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may contain spaces and parentheses: split after the last ')'.
        fields = stat[stat.rindex(")") + 2 :].split()
        table[int(entry.name)] = int(fields[1])
    return table


def _descendants(root: int) -> set[int]:
    table = _children()
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in table.items() if ppid in frontier} - found
        found |= frontier
    return found



def _sandbox_mounts() -> set[str]:
    return {line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines() if line.startswith("coderunner-ws ")}


def _marked(mark: str) -> list[int]:
    """Processes whose environment carries CODERUNNER_TEST_MARK=<mark> (every child of an
    `up` started with it inherits it, whatever session or process group it moved to)."""
    needle = f"CODERUNNER_TEST_MARK={mark}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and alive(int(entry.name)):
            try:
                if needle in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def _up_env(tmp_path: Path) -> tuple[dict[str, str], str]:
    mark = secrets.token_hex(8)
    env = dict(os.environ)
    env.pop("EXECUTOR_API_TOKEN", None)
    env["CODERUNNER_TEST_MARK"] = mark
    env["CODERUNNER_LOG_ROOT"] = str(tmp_path / "logs")
    return env, mark


def _up_process(port: int, env: dict[str, str], *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "up", "--port", str(port), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=REPO_ROOT,
        env=env,
        text=True,
        preexec_fn=dies_with_the_tests(),
    )


def _banner(up: subprocess.Popen[str], timeout_s: float = 60) -> str:
    """What `up` prints until its stack serves (the line saying how to stop it)."""
    banner = ""
    deadline = time.monotonic() + timeout_s
    assert up.stdout is not None
    while "Ctrl-C stops everything" not in banner:
        line = up.stdout.readline()
        assert line, f"coderunner up exited early:\n{banner}"
        banner += line
        assert time.monotonic() < deadline, banner
    return banner


def _token_and_logs(banner: str) -> tuple[str, Path]:
    """The API token and the log folder `up` printed."""
    token = re.search(r"API token\s+(\S+)", banner)
    logs = re.search(r"Logs\s+(\S+)", banner)
    assert token is not None and logs is not None, banner
    return token.group(1), Path(logs.group(1))


def test_up_on_a_busy_port_says_so_before_anything_starts(tmp_path: Path) -> None:
    env, mark = _up_env(tmp_path)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        started = time.monotonic()
        up = subprocess.run(
            [sys.executable, "-m", "launcher.cli", "up", "--port", str(port)],
            capture_output=True,
            cwd=REPO_ROOT,
            env=env,
            text=True,
            timeout=60,
        )
        elapsed = time.monotonic() - started
    output = up.stdout + up.stderr
    assert up.returncode != 0, output
    assert f"127.0.0.1:{port}" in output and "in use" in output, output
    assert "make up PORT=9000" in output, output
    # Nothing was printed for a stack that never ran: no banner, no token, no start line.
    assert up.stdout == "", up.stdout
    assert "API token" not in output and "starting" not in output and "Playground" not in output, output
    assert elapsed < 15, elapsed  # it checked first instead of starting Redis and soketi
    assert _marked(mark) == [], "children were started"
    assert not (tmp_path / "logs").exists(), list((tmp_path / "logs").rglob("*"))


def test_up_refuses_an_api_port_that_is_not_one(tmp_path: Path) -> None:
    env, mark = _up_env(tmp_path)
    for value, reason in [("abc", "must be an integer"), ("0", "must be a TCP port")]:
        up = subprocess.run(
            [sys.executable, "-m", "launcher.cli", "up"],
            capture_output=True, cwd=REPO_ROOT, env={**env, "API_PORT": value}, text=True, timeout=60,
        )  # fmt: skip
        assert up.returncode == 2 and f"coderunner up: API_PORT='{value}' is invalid: {reason}" in up.stderr, up.stderr
        assert "Traceback" not in up.stderr, up.stderr
    assert _marked(mark) == [], "children were started"


def test_up_runs_everything_and_stops_clean(tmp_path: Path) -> None:
    mounts_before = _sandbox_mounts()
    port = free_port()
    env, mark = _up_env(tmp_path)
    up = _up_process(port, env)
    try:
        banner = _banner(up)
        token, log_dir = _token_and_logs(banner)
        assert log_dir.parent == tmp_path / "logs" and log_dir.is_dir(), banner
        api = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{api}/health").json() == {"status": "ok"}
        page = httpx.get(f"{api}/")
        assert page.status_code == 200 and "pusher.min.js" in page.text
        assert httpx.get(f"{api}/static/pusher.min.js").status_code == 200

        family = _descendants(up.pid)
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") for pid in family]
        assert any(c.startswith(b"redis-server") for c in commands), commands
        assert any(b"soketi" in c for c in commands), commands
        assert any(b"-m api" in c for c in commands) and any(b"-m worker" in c for c in commands), commands

        # pusher-js, as a browser would use it, through the stack `up` started.
        program = tmp_path / "echo.py"
        program.write_text("name = input()\nprint(f'hello {name}')\n")
        client = subprocess.run(
            [find_node(), str(REPO_ROOT / "clients/js/run-job.mjs"), api, token, "python", str(program), "pusher-js\n"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert client.returncode == 0, client.stderr
        # The job id goes to stderr, so stdout is nothing but JSON lines.
        job_id = re.search(r"job (\S+) \(waiting up to (\d+) s", client.stderr)
        assert job_id is not None, client.stderr
        assert int(job_id.group(2)) >= 30 + 30, client.stderr  # wall limit plus warm-up, at least
        events = sorted((json.loads(line) for line in client.stdout.splitlines()), key=lambda e: e["data"]["seq"])
        # stage{queued} may be published before the client subscribes; from `running` on,
        # every event arrives, in seq order without gaps.
        phases = [e["data"]["phase"] for e in events if e["event"] == "stage"]
        assert phases in (["queued", "running"], ["running"]), events
        seqs = [e["data"]["seq"] for e in events]
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
        assert events[-1]["event"] == "result" and events[-1]["data"]["outcome"] == "completed"
        assert "".join(e["data"]["chunk"] for e in events if e["event"] == "stdout") == "hello pusher-js\n"
        family = _descendants(up.pid)  # now includes nothing new, but refresh anyway
    finally:
        up.send_signal(signal.SIGINT)
        try:
            rest, _ = up.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    assert up.returncode == 0
    time.sleep(0.2)
    survivors = [pid for pid in family if alive(pid)]
    assert survivors == [], f"left behind: {survivors}"
    assert _marked(mark) == [], "left behind"
    # The logs outlive the stack, and `up` says where they are as it stops.
    assert f"logs kept in {log_dir}" in rest, rest
    for name in ("api", "worker", "redis", "soketi"):
        assert (log_dir / f"{name}.log").is_file(), name
    assert job_id.group(1) in (log_dir / "worker.log").read_text(errors="replace")
    api_log = (log_dir / "api.log").read_text(errors="replace")
    assert "startup complete" in api_log and "shutdown complete" in api_log, api_log  # written up to the end
    # No workspace mount is left either (other stacks of this test session keep theirs).
    other_deployments = {Path(m).parent for m in mounts_before}
    left = {m for m in _sandbox_mounts() if Path(m).parent not in other_deployments}
    assert not left, left
    # Nothing else is listening on the API port either.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)


def test_a_second_ctrl_c_ends_running_jobs_at_once_each_with_its_result(tmp_path: Path) -> None:
    # The first Ctrl-C gives running jobs the worker's grace (10 s); the second, as the
    # README says, ends them now. `up` kept the second to itself, and waited out the grace.
    port = free_port()
    env, _ = _up_env(tmp_path)
    up = _up_process(port, env)
    try:
        token, log_dir = _token_and_logs(_banner(up))
        api = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"})
        job = api.post("/v1/execute", json={"language": "python", "files": [{"name": "main.py", "content": "import time\ntime.sleep(60)\n"}]}).json()
        assert api.post(f"/v1/jobs/{job['jobId']}/start").status_code == 202
        deadline = time.monotonic() + 20
        while api.get(f"/v1/jobs/{job['jobId']}").json()["state"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        up.send_signal(signal.SIGINT)
        time.sleep(1)
        stopped_at = time.monotonic()
        up.send_signal(signal.SIGINT)
        up.communicate(timeout=30)
        took = time.monotonic() - stopped_at
    finally:
        if up.poll() is None:
            up.kill()
    assert took < 7, f"the second Ctrl-C waited {took:.1f} s (the grace is 10 s)"
    worker_log = (log_dir / "worker.log").read_text(errors="replace")
    assert "cancelling 1 running jobs" in worker_log, worker_log[-2000:]
    assert f"job {job['jobId']}: killed" in worker_log, worker_log[-2000:]


def test_up_stops_clean_when_its_terminal_goes_away(tmp_path: Path) -> None:
    """Closing the terminal `make up` runs in sends SIGHUP, and writes to it fail from then on:
    the stack still stops whole (its children are in sessions of their own, so the hangup
    reaches only `up`)."""
    port = free_port()
    env, mark = _up_env(tmp_path)
    up = _up_process(port, env, "--no-worker")
    try:
        _banner(up)
        family = _descendants(up.pid)
        assert len(family) >= 3, family  # redis-server, soketi, the API
        assert up.stdout is not None
        up.stdout.close()  # the terminal is gone: whatever `up` prints now fails
        up.send_signal(signal.SIGHUP)
        up.wait(timeout=30)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    time.sleep(0.2)
    survivors = [pid for pid in family if alive(pid)]
    assert survivors == [], f"left behind: {survivors}"
    assert _marked(mark) == [], "left behind"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)


def test_a_killed_up_leaves_nothing_running(tmp_path: Path) -> None:
    """SIGKILL gives `up` no chance to stop its children; its lifeline does it instead:
    workers first, then the services, and the deployment's mounts go too."""
    mounts_before = _sandbox_mounts()
    port = free_port()
    env, mark = _up_env(tmp_path)
    up = _up_process(port, env)
    try:
        _banner(up)
        family = _descendants(up.pid)
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ") for pid in family]
        assert any(b"-m worker" in c for c in commands) and any(c.startswith(b"redis-server") for c in commands)
        # The worker's warm workspaces: it fills its pool after it reports ready, so under a
        # loaded suite the banner can come before the first mount.
        deadline = time.monotonic() + 30
        while not (_sandbox_mounts() - mounts_before) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _sandbox_mounts() - mounts_before
    finally:
        up.kill()
        up.wait()
    deadline = time.monotonic() + 30
    while (survivors := [pid for pid in family if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert survivors == [], f"left behind: {survivors}"
    assert _marked(mark) == [], "left behind"
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
    # The worker's warm workspaces went with it (other stacks of this session keep theirs).
    deadline = time.monotonic() + 10
    other_deployments = {Path(m).parent for m in mounts_before}
    while (left := {m for m in _sandbox_mounts() if Path(m).parent not in other_deployments}) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left


def test_ctrl_c_during_start_up_stops_without_a_banner(tmp_path: Path) -> None:
    """Ctrl-C while the stack is still starting: `up` stops it once it is up, prints neither
    the banner nor the token, and leaves nothing running."""
    port = free_port()
    env, mark = _up_env(tmp_path)
    up = _up_process(port, env, "--no-worker")
    try:
        assert up.stdout is not None
        first = up.stdout.readline()
        assert "starting" in first, first
        up.send_signal(signal.SIGINT)
        rest, _ = up.communicate(timeout=60)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
    assert up.returncode == 130, rest
    assert "interrupted during start-up" in rest and "API token" not in rest and "Ctrl-C stops everything" not in rest
    time.sleep(0.2)
    assert _marked(mark) == [], "left behind"
