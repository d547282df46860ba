"""A whole coderunner stack as child processes: private redis-server, soketi, API, worker.

Used by `coderunner up` and by the test suite. Every child runs in its own process group
on its own free ports, so stopping the stack kills whole groups and two stacks on one
machine never share a port (soketi binds with SO_REUSEPORT: a stale one on the same
port would silently eat half the events).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from launcher.node import NodeNotFound, find_node
from shared.paths import REPO_ROOT

__all__ = ["Stack", "StackError", "free_port", "remove_deployment", "soketi_entry"]


class StackError(Exception):
    """A part of the stack could not start; the message names it."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _dev_token() -> str:
    """A random API token that no command line mistakes for an option (no leading "-")."""
    while (token := secrets.token_urlsafe(24)).startswith("-"):
        pass
    return token


def soketi_entry() -> Path:
    return REPO_ROOT / "realtime" / "node_modules" / "@soketi" / "soketi" / "bin" / "server.js"


def _wait_for(check, what: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise StackError(f"{what} exited with status {proc.returncode} during start-up")
        try:
            if check():
                return
        except Exception as exc:
            last = exc
        time.sleep(0.05)
    raise StackError(f"{what} did not become ready within {timeout_s:.0f}s ({last})")


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=1) as response:
        return bool(response.status == 200)


def remove_deployment(deployment: str) -> None:
    """Remove what a deployment's workers left on this host: cgroups, mounts, work root.

    Workers clean up after themselves when stopped; this also covers a worker that was
    killed (tests do that on purpose) with no other worker left to run its janitor.
    """
    from worker.workspace import detach_workspace

    roots = [Path("/sys/fs/cgroup") / c / deployment for c in ("memory", "pids", "cpu", "cpuacct", "unified")]
    roots.append(Path("/sys/fs/cgroup") / deployment)
    for root in roots:
        if not root.is_dir():
            continue
        walk = sorted(os.walk(root), key=lambda w: -w[0].count("/"))
        for dirpath, _dirs, _files in walk:
            kill = Path(dirpath) / "cgroup.kill"
            if kill.exists() and dirpath != str(root):
                try:
                    kill.write_text("1")
                except OSError:
                    pass
        time.sleep(0.05)
        for dirpath, _dirs, _files in walk:
            try:
                os.rmdir(dirpath)
            except OSError:
                pass
    work_root = Path(f"/run/{deployment}")
    if work_root.is_dir():
        mounts = Path("/proc/self/mounts").read_text()
        toolchains = work_root / ".toolchains"
        for child in [*work_root.iterdir(), *(toolchains.iterdir() if toolchains.is_dir() else [])]:
            if child.is_dir() and child != toolchains:
                detach_workspace(child, mounts)
        shutil.rmtree(work_root, ignore_errors=True)


@dataclass
class Stack:
    api_port: int = 0
    api_host: str = "127.0.0.1"
    api_token: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    with_worker: bool = True

    def __post_init__(self) -> None:
        self.api_port = self.api_port or free_port()
        self.api_token = self.api_token or os.environ.get("EXECUTOR_API_TOKEN") or _dev_token()
        self.redis_port = free_port()
        self.redis_password = secrets.token_hex(16)
        self.soketi_port = free_port()
        self.soketi_metrics_port = free_port()
        self.pusher_key = "coderunner-" + secrets.token_hex(6)
        self.pusher_secret = secrets.token_hex(24)
        self.pusher_app_id = str(100000 + secrets.randbelow(900000))
        # Each stack is its own deployment: its own cgroup tree, workspace root and job uids,
        # so stacks side by side (tests, a dev stack next to CI) never judge each other's
        # sandboxes (a worker's janitor removes sandboxes of workers its Redis calls dead).
        self.deployment = "coderunner-" + secrets.token_hex(4)
        self.uid_base = 100000 + 1000 * secrets.randbelow(800)
        self._tmp = tempfile.TemporaryDirectory(prefix="coderunner-stack-")
        self.data_dir = Path(self._tmp.name)
        self.log_dir = self.log_dir or self.data_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.worker_ids: dict[str, str] = {}
        self._workers: list[subprocess.Popen[bytes]] = []

    # -------------------------------------------------------------- addresses

    @property
    def api_url(self) -> str:
        return f"http://{self.api_host}:{self.api_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://:{self.redis_password}@127.0.0.1:{self.redis_port}/0"

    def env(self) -> dict[str, str]:
        """The settings every coderunner child gets."""
        env = dict(os.environ)
        env.update(
            {
                "REDIS_URL": self.redis_url,
                "EXECUTOR_API_TOKEN": self.api_token,
                "PUSHER_HOST": "127.0.0.1",
                "PUSHER_PORT": str(self.soketi_port),
                "PUSHER_SCHEME": "http",
                "PUSHER_APP_ID": self.pusher_app_id,
                "PUSHER_KEY": self.pusher_key,
                "PUSHER_SECRET": self.pusher_secret,
                "SANDBOX_CGROUP_NAME": self.deployment,
                "SANDBOX_WORK_ROOT": f"/run/{self.deployment}",
                "SANDBOX_UID_BASE": str(self.uid_base),
                "API_HOST": self.api_host,
                "API_PORT": str(self.api_port),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        return env

    # -------------------------------------------------------------- lifecycle

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        assert self.log_dir is not None
        log_file = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the child
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=env or self.env(),
            cwd=REPO_ROOT,
            start_new_session=True,  # its own process group: stopping kills the whole group
        )
        log_file.close()
        return proc

    def start(self, timeout_s: float = 30.0) -> None:
        try:
            self._start_redis(timeout_s)
            self._start_soketi(timeout_s)
            self._start_api(timeout_s)
            if self.with_worker:
                self.start_worker(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start_redis(self, timeout_s: float) -> None:
        argv = [
            "redis-server",
            "--port", str(self.redis_port),
            "--bind", "127.0.0.1",
            "--requirepass", self.redis_password,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.data_dir),
            "--daemonize", "no",
        ]  # fmt: skip
        self.procs["redis"] = proc = self._spawn("redis", argv)
        _wait_for(lambda: self._redis_call("ping"), "redis-server", timeout_s, proc)

    def _start_soketi(self, timeout_s: float) -> None:
        entry = soketi_entry()
        if not entry.exists():
            raise StackError(f"soketi is not installed ({entry} missing): run `make deps`")
        try:
            node = find_node()
        except NodeNotFound as exc:
            raise StackError(str(exc)) from None
        env = dict(os.environ)
        env.update(
            {
                "SOKETI_HOST": "127.0.0.1",
                "SOKETI_PORT": str(self.soketi_port),
                "SOKETI_METRICS_HOST": "127.0.0.1",
                "SOKETI_METRICS_SERVER_PORT": str(self.soketi_metrics_port),
                "SOKETI_DEFAULT_APP_ID": self.pusher_app_id,
                "SOKETI_DEFAULT_APP_KEY": self.pusher_key,
                "SOKETI_DEFAULT_APP_SECRET": self.pusher_secret,
                "SOKETI_DEFAULT_APP_ENABLE_CLIENT_MESSAGES": "false",
                # The workers keep every event under PUSHER_MAX_PAYLOAD_KB: say the same here.
                "SOKETI_DEFAULT_APP_MAX_EVENT_PAYLOAD_IN_KB": self.env().get("PUSHER_MAX_PAYLOAD_KB", "100"),
                "SOKETI_SHUTDOWN_GRACE_PERIOD": "200",
                "NODE_NO_WARNINGS": "1",
            }
        )
        self.procs["soketi"] = proc = self._spawn("soketi", [node, str(entry), "start"], env)
        _wait_for(lambda: _http_ok(f"http://127.0.0.1:{self.soketi_port}/ready"), "soketi", timeout_s, proc)

    def _start_api(self, timeout_s: float) -> None:
        argv = [sys.executable, "-m", "api", "--host", self.api_host, "--port", str(self.api_port)]
        self.procs["api"] = proc = self._spawn("api", argv)
        _wait_for(lambda: _http_ok(f"{self.api_url}/health"), "API", timeout_s, proc)

    def start_worker(self, timeout_s: float = 30.0, extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start one more worker and wait until it holds its liveness key in Redis."""
        index = len(self._workers)
        name = "worker" if index == 0 else f"worker{index}"
        worker_id = f"{name}-{secrets.token_hex(4)}"
        env = self.env()
        env["WORKER_ID"] = worker_id
        env.update(extra_env or {})
        proc = self._spawn(name, [sys.executable, "-m", "worker"], env)
        self._workers.append(proc)
        self.procs[name] = proc
        self.worker_ids[name] = worker_id
        _wait_for(lambda: self._redis_call("exists", f"worker:{worker_id}:alive"), f"worker ({name})", timeout_s, proc)
        return proc

    def _redis_call(self, command: str, *args: str) -> bool:
        with self.redis() as redis:
            return bool(getattr(redis, command)(*args))

    def redis(self):  # type: ignore[no-untyped-def]
        """A synchronous client of this stack's Redis (for tests and tools)."""
        import redis

        return redis.Redis.from_url(self.redis_url)

    def stop_process(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 15.0) -> int | None:
        proc = self.procs.get(name)
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        # Whatever the leader did, nothing of its group may survive.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
        return proc.returncode

    def stop(self) -> None:
        # Workers first (they hand parked jobs back), then the API, soketi, and Redis last.
        order = [n for n in self.procs if n.startswith("worker")] + ["api", "soketi", "redis"]
        for name in order:
            self.stop_process(name)
        self.procs.clear()

    def cleanup(self) -> None:
        self.stop()
        self._remove_deployment()
        self._tmp.cleanup()

    def _remove_deployment(self) -> None:
        remove_deployment(self.deployment)

    def log(self, name: str) -> str:
        assert self.log_dir is not None
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def dead_children(self) -> list[str]:
        return [name for name, proc in self.procs.items() if proc.poll() is not None]
