"""`coderunner up` runs the whole stack and stops without leaving a process behind;
pusher-js (the browser client) drives a job through it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from launcher.stack import free_port
from shared.paths import REPO_ROOT

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


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _sandbox_mounts() -> set[str]:
    return {line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines() if line.startswith("coderunner-ws ")}


def test_up_runs_everything_and_stops_clean(tmp_path: Path) -> None:
    mounts_before = _sandbox_mounts()
    port = free_port()
    env = dict(os.environ)
    env.pop("EXECUTOR_API_TOKEN", None)
    up = subprocess.Popen(
        [sys.executable, "-m", "launcher.cli", "up", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=REPO_ROOT,
        env=env,
        text=True,
    )
    banner = ""
    try:
        deadline = time.monotonic() + 60
        assert up.stdout is not None
        while "Ctrl-C stops everything" not in banner:
            line = up.stdout.readline()
            assert line, f"coderunner up exited early:\n{banner}"
            banner += line
            assert time.monotonic() < deadline, banner
        token = re.search(r"API token\s+(\S+)", banner).group(1)  # type: ignore[union-attr]
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
            ["node", str(REPO_ROOT / "clients/js/run-job.mjs"), api, token, "python", str(program), "pusher-js\n"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert client.returncode == 0, client.stderr
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
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    assert up.returncode == 0
    time.sleep(0.2)
    survivors = [pid for pid in family if _alive(pid)]
    assert survivors == [], f"left behind: {survivors}"
    # No workspace mount is left either (other stacks of this test session keep theirs).
    other_deployments = {Path(m).parent for m in mounts_before}
    left = {m for m in _sandbox_mounts() if Path(m).parent not in other_deployments}
    assert not left, left
    # Nothing else is listening on the API port either.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=1)
