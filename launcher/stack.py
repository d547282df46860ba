"""A whole coderunner stack as child processes: private redis-server, soketi, API, workers.

Used by `coderunner up` and by the test suite. Every child runs in its own process group
on its own free ports, so stopping the stack kills whole groups and two stacks on one
machine never share a port (soketi binds with SO_REUSEPORT: a stale one on the same
port would silently eat half the events).

A stack runs `workers` workers (each its own slots, uids and WORKER_ID, one deployment and
one Redis). With `supervise` on (`coderunner up` always, tests when they ask) a worker that
dies is started again with backoff (launcher/supervisor.py) and the stack keeps serving;
Redis, soketi or the API dying is for the caller to notice (`dead_children`). Tests use
`kill_worker` to kill or stop one worker while the rest serve, and `restart` to take
Redis, soketi or the API down and up again on the same port (with `redis_persistence`,
Redis keeps its data across that in an append-only file, fsynced every second).

Whatever ends the process that owns a stack, the stack does not outlive it: its first spawn
also starts a lifeline watcher (launcher/lifeline.py) that stops every child if the owner
goes away without stopping them itself.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from launcher.lifeline import MARK_ENV, start_time
from launcher.node import NodeNotFound, find_node
from launcher.supervisor import Backoff, Restart, describe_exit
from shared import keys
from shared.paths import REPO_ROOT
from shared.settings import Settings, worker_stop_s
from worker.isolation.uids import LOCK_DIR as UID_LOCK_DIR
from worker.isolation.uids import try_lock, uids_held

__all__ = ["WORKER_UID_STRIDE", "Stack", "StackError", "free_port", "remove_deployment", "soketi_entry"]

# Worker number i of a stack runs its jobs as uids SANDBOX_UID_BASE + i * stride + slot, so
# the workers of one stack never share a job uid (slots + 1 per worker: the self-test uses
# the uid past the last slot). A stack's range is 1000 uids: at most 10 workers.
WORKER_UID_STRIDE = 100
MAX_WORKERS = 10
# What supervise_services restarts, and how long one start may take to answer.
SUPERVISED_SERVICES = ("soketi", "api")
SERVICE_START_S = 30.0
# How long a service (the API, soketi, Redis) is given to stop before SIGKILL.
SERVICE_STOP_S = 15.0

# ioredis options of soketi's Redis adapter clients (the compose file says the same): commands
# wait for a Redis that comes back rather than fail after two tries (see _start_soketi).
SOKETI_ADAPTER_CLIENT_OPTIONS = '{"maxRetriesPerRequest":null}'


def realtime_webhook(url: str) -> dict[str, object]:
    """soketi's webhook entry for the API: `channel_occupied` of job channels only."""
    return {"url": url, "event_types": ["channel_occupied"], "filter": {"channel_name_starts_with": "private-run-"}}


class StackError(Exception):
    """A part of the stack could not start; the message names it."""


_handed_ports: set[int] = set()
_ports_lock = threading.Lock()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def free_port(hold: list[int] | None = None) -> int:
    """A loopback port nothing listens on, never the same twice in this process, nor one
    that another process's stack holds.

    Drawn below the kernel's ephemeral range: a port from `bind(0)` is closed again before the
    child that will listen on it starts, and in that gap any outgoing connection on the host
    (a test's Redis client, say) may take it as its local port, which fails the child's bind
    (an API that exits with status 3 at start-up). Ports outside that range are only ever taken
    by a listener that asks for them. With `hold`, the port's lock (a file beside the job uid
    locks) is kept, its descriptor appended there, so stacks in other processes pass it over
    until that descriptor is closed; a stack holds its ports so for its whole life (a soketi
    sharing a port through SO_REUSEPORT would silently take half the events).
    """
    low, _high = _ephemeral_range()
    first = 20000 if low > 22000 else 1024
    with _ports_lock:
        for _ in range(500):
            if low - first < 1000:  # a host whose ephemeral range starts very low: the kernel's pick
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind(("127.0.0.1", 0))
                    port = int(s.getsockname()[1])
            else:
                port = first + secrets.randbelow(low - first)
            if port in _handed_ports:
                continue
            lock = _host_lock(f"port-{port}")  # (-1: judged by its bind alone)
            if lock is None:
                continue  # another process's stack holds it
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    if lock >= 0:
                        os.close(lock)
                    continue
            _handed_ports.add(port)
            if hold is not None and lock >= 0:
                hold.append(lock)
            elif lock >= 0:
                os.close(lock)
            return port
    raise StackError("no free loopback port below the ephemeral range")


def _host_lock(name: str) -> int | None:
    """The descriptor holding the host-wide lock `name` (beside the job uid locks); None while
    another process holds it; -1 when this process cannot take locks at all (not root)."""
    try:
        UID_LOCK_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
        return try_lock(UID_LOCK_DIR / name)
    except OSError:
        return -1


def _reserve_uid_block() -> tuple[int, int | None]:
    """The first of 1000 job uids no other live stack on this host uses, and the descriptor
    whose lock holds them (None when this process cannot lock: not root).

    Workers refuse to start on uids another worker holds (worker/isolation/uids.py), so
    stacks side by side (a test run beside a dev stack) must not draw the same block.
    """
    for _ in range(200):
        block = secrets.randbelow(800)
        fd = _host_lock(f"stack-block-{block}")
        if fd == -1:
            return 100000 + 1000 * block, None
        if fd is None:
            continue
        # A worker started by hand on uids of this block (not through a stack) shows here.
        if uids_held(100000 + 1000 * block, 1000):
            os.close(fd)
            continue
        return 100000 + 1000 * block, fd
    raise StackError("no free block of job uids on this host (800 stacks running?)")


def _dev_token() -> str:
    """A random API token that no command line mistakes for an option (no leading "-")."""
    while (token := secrets.token_urlsafe(24)).startswith("-"):
        pass
    return token


def soketi_guard() -> Path:
    return REPO_ROOT / "realtime" / "guard.js"


def soketi_entry() -> Path:
    return REPO_ROOT / "realtime" / "node_modules" / "@soketi" / "soketi" / "bin" / "server.js"


def _wait_for(check, what: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None, log: Path | None = None) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise StackError(f"{what} exited with status {proc.returncode} during start-up{_log_tail(log)}")
        try:
            if check():
                return
        except Exception as exc:
            last = exc
        time.sleep(0.05)
    raise StackError(f"{what} did not become ready within {timeout_s:.0f}s ({last}){_log_tail(log)}")


def _log_tail(log: Path | None, lines: int = 12) -> str:
    """The end of a child's log, for a start-up error that would otherwise say only a status."""
    if log is None:
        return ""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            tail = f.read().decode("utf-8", "replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "; its log ends:\n" + "\n".join(tail) if tail else ""


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=1) as response:
        return bool(response.status == 200)


def remove_deployment(deployment: str) -> None:
    """Remove what a deployment's workers left on this host: cgroups, mounts, work root.

    Workers clean up after themselves when stopped; this also covers a worker that was
    killed (tests do that on purpose) with no other worker left to run its janitor.
    """
    from worker.isolation.mounts import detach
    from worker.isolation.workspace import detach_workspace

    roots = [Path("/sys/fs/cgroup") / c / deployment for c in ("memory", "pids", "cpu", "cpuacct", "unified")]
    roots.append(Path("/sys/fs/cgroup") / deployment)
    for root in roots:
        if not root.is_dir():
            continue
        walk = sorted(os.walk(root), key=lambda w: -w[0].count("/"))
        killed = False
        for dirpath, _dirs, _files in walk:
            kill = Path(dirpath) / "cgroup.kill"
            if kill.exists() and dirpath != str(root):
                try:
                    kill.write_text("1")
                    killed = True
                except OSError:
                    pass
        if killed:
            time.sleep(0.05)  # (what the kill reached is gone before its folder is removed)
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
        # Workers that started at the same moment may each have mounted the shared `.gate`
        # and toolchain folders (one on top of the other): detach every layer left.
        prefix = f"{work_root}/"
        for _ in range(8):
            left = [
                line.split()[1]
                for line in Path("/proc/self/mounts").read_text().splitlines()
                if len(line.split()) > 1 and line.split()[1].startswith(prefix)
            ]
            if not left:
                break
            for point in sorted(left, key=len, reverse=True):
                try:
                    detach(point)
                except Exception:  # MountError: left for the next round, then for rmtree
                    pass
        shutil.rmtree(work_root, ignore_errors=True)


@dataclass
class Stack:
    api_port: int = 0
    api_host: str = "127.0.0.1"
    api_token: str = ""
    extra_env: dict[str, str] = field(default_factory=dict)
    log_dir: Path | None = None
    with_worker: bool = True
    # How many workers start() runs (with_worker=False: none).
    workers: int = 1
    # Restart workers that die (see launcher/supervisor.py); start_supervisor() turns it on later.
    supervise: bool = False
    # The supervisor also restarts soketi and the API when they die (`coderunner up`), on
    # their ports, with the workers' backoff. Redis is not: without persistence a fresh one
    # would have forgotten every job, and the stack stops instead (dead_children says so).
    supervise_services: bool = False
    # Redis with `appendonly yes` + `appendfsync everysec`, so a restart keeps its data.
    redis_persistence: bool = False
    # Called with each supervisor message (`coderunner up` prints them), from its thread.
    on_event: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        # Locks of the ports this stack chose, held until it stops (see free_port).
        self._port_fds: list[int] = []
        self.api_port = self.api_port or free_port(self._port_fds)
        self.api_token = self.api_token or os.environ.get("EXECUTOR_API_TOKEN") or _dev_token()
        self.redis_port = free_port(self._port_fds)
        self.redis_password = secrets.token_hex(16)
        self.soketi_port = free_port(self._port_fds)
        self.soketi_metrics_port = free_port(self._port_fds)
        self.pusher_key = "coderunner-" + secrets.token_hex(6)
        self.pusher_secret = secrets.token_hex(24)
        self.pusher_app_id = str(100000 + secrets.randbelow(900000))
        # Signs callbacks (a receiver checks signatures with it); random unless set.
        self.callback_secret = os.environ.get("CALLBACK_SECRET") or secrets.token_hex(24)
        # Each stack is its own deployment: its own cgroup tree, workspace root and job uids,
        # so stacks side by side (tests, a dev stack next to CI) never judge each other's
        # sandboxes (a worker's janitor removes sandboxes of workers its Redis calls dead).
        self.deployment = "coderunner-" + secrets.token_hex(4)
        self.uid_base, self._uid_block_fd = _reserve_uid_block()
        self._tmp = tempfile.TemporaryDirectory(prefix="coderunner-stack-")
        self.data_dir = Path(self._tmp.name)
        self.log_dir = self.log_dir or self.data_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        # name -> the WORKER_ID of its current incarnation; worker_history: every one it had.
        self.worker_ids: dict[str, str] = {}
        self.worker_history: dict[str, list[str]] = {}
        # Every failure the supervisor handled, oldest first (updated in place on restart).
        self.restarts: list[Restart] = []
        self.notes: list[str] = []
        self._lock = threading.RLock()
        self._worker_index: dict[str, int] = {}
        self._worker_env: dict[str, dict[str, str]] = {}
        self._started_at: dict[str, float] = {}
        self._launched_at_ms: dict[str, int] = {}
        self._backoff: dict[str, Backoff] = {}
        self._pending: dict[str, Restart] = {}
        self._retired: set[str] = set()
        self._awaiting_ready: dict[str, tuple[str, float]] = {}
        self._supervisor: threading.Thread | None = None
        self._supervisor_stop = threading.Event()
        # The lifeline watcher (launcher/lifeline.py) and the write end of its pipe.
        self._lifeline: subprocess.Popen[bytes] | None = None
        self._lifeline_fd = -1

    # -------------------------------------------------------------- addresses

    @property
    def api_url(self) -> str:
        return f"http://{self.api_host}:{self.api_port}"

    @property
    def webhook_url(self) -> str:
        """Where soketi, on this host, reaches the API's webhook route."""
        host = "127.0.0.1" if self.api_host in ("", "0.0.0.0") else "[::1]" if self.api_host == "::" else self.api_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.api_port}/v1/realtime/webhooks"

    @property
    def redis_url(self) -> str:
        return f"redis://:{self.redis_password}@127.0.0.1:{self.redis_port}/0"

    @property
    def worker_stop_s(self) -> float:
        """How long a worker is given to stop before SIGKILL (its grace, from its settings)."""
        grace = self.extra_env.get("WORKER_SHUTDOWN_GRACE_MS") or os.environ.get("WORKER_SHUTDOWN_GRACE_MS") or ""
        return worker_stop_s(int(grace) if grace.isdigit() else Settings().worker_shutdown_grace_ms)

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
                # soketi runs on its Redis adapter in this Redis (see _start_soketi).
                "PUSHER_PUBLISH": "redis",
                "CALLBACK_SECRET": self.callback_secret,
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

    def _log(self, name: str) -> Path | None:
        return None if self.log_dir is None else self.log_dir / f"{name}.log"

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        assert self.log_dir is not None
        with self._lock:
            self._start_lifeline()
            env = dict(env or self.env())
            env[MARK_ENV] = self.deployment  # how the lifeline tells our processes from others
            log_file = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 - lives as long as the child
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO_ROOT,
                start_new_session=True,  # its own process group: stopping kills the whole group
            )
            log_file.close()
            self._started_at[name] = time.monotonic()
            role = "worker" if name in self._worker_index else "service"
            try:
                # Not waited for yet, so the child is there to read, a zombie at worst.
                started = start_time(proc.pid) or 0
                os.write(self._lifeline_fd, f"+{proc.pid} {started} {role}\n".encode())
            except OSError:
                pass  # the watcher is gone (killed by hand): the stack runs on without one
            return proc

    def _start_lifeline(self) -> None:
        """Start the watcher that stops this stack if its owner dies without doing so
        (launcher/lifeline.py). Only this process holds the pipe's write end: it is not
        inheritable, and every child is spawned with its other descriptors closed."""
        if self._lifeline is not None:
            return
        read_fd, write_fd = os.pipe()
        try:
            self._lifeline = subprocess.Popen(
                [sys.executable, "-m", "launcher.lifeline", self.deployment, str(self.worker_stop_s)],
                stdin=read_fd,
                stdout=subprocess.DEVNULL,
                cwd=REPO_ROOT,
                start_new_session=True,  # not in the owner's group: a Ctrl-C there must not end it
            )
        except BaseException:
            os.close(write_fd)
            raise
        finally:
            os.close(read_fd)
        self._lifeline_fd = write_fd

    def _release_lifeline(self) -> None:
        """The stack was stopped here: the watcher has nothing to do."""
        if self._lifeline is None:
            return
        try:
            os.write(self._lifeline_fd, b"stopped\n")
        except OSError:
            pass
        os.close(self._lifeline_fd)
        self._lifeline_fd = -1
        try:
            self._lifeline.wait(10)
        except subprocess.TimeoutExpired:
            self._lifeline.kill()
            self._lifeline.wait()
        self._lifeline = None

    def start(self, timeout_s: float = 30.0) -> None:
        try:
            self._start_redis(timeout_s)
            # soketi, the API and the first worker need only Redis, and each spends most of
            # its start-up on its own CPU-bound work (node loading soketi, imports, the
            # worker's builds and self-test): started together, a stack is up about a
            # second sooner than one after the other.
            ready = [self._spawn_soketi(), self._spawn_api()]
            first = self._add_worker() if self.with_worker and self.workers > 0 else None
            for wait in ready:
                wait(timeout_s)
            if first is not None:
                # The first worker alone (it mounts the folders the deployment's workers
                # share), then the others at once, then wait for each.
                self._wait_worker_ready(first, timeout_s)
                names = [self._add_worker() for _ in range(self.workers - 1)]
                for name in names:
                    self._wait_worker_ready(name, timeout_s)
            if self.supervise:
                self.start_supervisor()
        except BaseException:
            self.stop()
            raise

    def _start_redis(self, timeout_s: float) -> None:
        if self.redis_persistence:
            # Every write is in the append-only file within about a second; a clean shutdown
            # (SIGTERM) writes and fsyncs the rest before it exits.
            persistence = ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            persistence = ["--appendonly", "no"]
        # The password goes in a file only this user reads, never on a command line (which
        # any local user sees in /proc until redis-server rewrites its title).
        config = self.data_dir / "redis-auth.conf"
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(f'requirepass "{self.redis_password}"\n')
        argv = [
            "redis-server", str(config),
            "--port", str(self.redis_port),
            "--bind", "127.0.0.1",
            "--save", "",
            *persistence,
            "--dir", str(self.data_dir),
            "--daemonize", "no",
        ]  # fmt: skip
        self.procs["redis"] = proc = self._spawn("redis", argv)
        _wait_for(lambda: self._redis_call("ping"), "redis-server", timeout_s, proc, self._log("redis"))

    def _start_soketi(self, timeout_s: float) -> None:
        self._spawn_soketi()(timeout_s)

    def _spawn_soketi(self) -> Callable[[float], None]:
        """Start soketi; returns what waits (up to its argument, in seconds) until it is ready."""
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
                # A job channel's first subscriber tells the API (api/webhooks.py), so jobs whose
                # subscriptions are signed elsewhere with the app secret are heard live too.
                "SOKETI_DEFAULT_APP_WEBHOOKS": json.dumps([realtime_webhook(self.webhook_url)]),
                # One webhook request every 25 ms at most: a client subscribing and
                # unsubscribing in a loop made one each, and took the API's connections.
                "SOKETI_WEBHOOKS_BATCHING": "true",
                "SOKETI_WEBHOOKS_BATCHING_DURATION": "25",
                # Workers PUBLISH live events where soketi's Redis adapter listens (one hop
                # less than its HTTP API); several soketi nodes would share them the same way.
                "SOKETI_ADAPTER_DRIVER": "redis",
                "SOKETI_DB_REDIS_HOST": "127.0.0.1",
                "SOKETI_DB_REDIS_PORT": str(self.redis_port),
                "SOKETI_DB_REDIS_PASSWORD": self.redis_password,
                "SOKETI_DB_REDIS_DB": "0",
                # Its adapter's client gives a PUBLISH up after two tries, and soketi stops at
                # the rejection (an unhandled one ends the process): a Redis restart while any
                # event went out ended every follower's connection for good. It waits instead.
                "SOKETI_ADAPTER_REDIS_PUB_OPTIONS": SOKETI_ADAPTER_CLIENT_OPTIONS,
                "SOKETI_ADAPTER_REDIS_SUB_OPTIONS": SOKETI_ADAPTER_CLIENT_OPTIONS,
                "NODE_NO_WARNINGS": "1",
            }
        )
        # realtime/guard.js refuses malformed client messages, each of which stopped soketi.
        argv = [node, "--require", str(soketi_guard()), str(entry), "start"]
        self.procs["soketi"] = proc = self._spawn("soketi", argv, env)
        url = f"http://127.0.0.1:{self.soketi_port}/ready"
        return lambda timeout_s: _wait_for(lambda: _http_ok(url), "soketi", timeout_s, proc, self._log("soketi"))

    def _start_api(self, timeout_s: float) -> None:
        self._spawn_api()(timeout_s)

    def _spawn_api(self) -> Callable[[float], None]:
        """Start the API; returns what waits (up to its argument, in seconds) until it answers."""
        argv = [sys.executable, "-m", "api", "--host", self.api_host, "--port", str(self.api_port)]
        self.procs["api"] = proc = self._spawn("api", argv)
        url = f"{self.api_url}/health"
        return lambda timeout_s: _wait_for(lambda: _http_ok(url), "API", timeout_s, proc, self._log("api"))

    def restart(self, name: str, down_s: float = 0.0, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> float:
        """Take Redis, soketi or the API down (with `sig`, whole group) and start it again on
        the same port after `down_s`; returns how long it was unreachable, in seconds."""
        starter = self._service_starter(name)
        began = time.monotonic()
        self.stop_process(name, sig)
        time.sleep(down_s)
        starter(timeout_s)
        return time.monotonic() - began

    # -------------------------------------------------------------- workers

    def worker_names(self) -> list[str]:
        with self._lock:
            return sorted(self._worker_index, key=self._worker_index.__getitem__)

    def start_worker(self, timeout_s: float = 30.0, extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """Start one more worker and wait until it has listed itself in Redis (its first heartbeat)."""
        name = self._add_worker(extra_env)
        self._wait_worker_ready(name, timeout_s)
        return self.procs[name]

    def _add_worker(self, extra_env: dict[str, str] | None = None) -> str:
        with self._lock:
            index = len(self._worker_index)
            if index >= MAX_WORKERS:
                raise StackError(f"a stack runs at most {MAX_WORKERS} workers")
            name = "worker" if index == 0 else f"worker{index}"
            self._worker_index[name] = index
            self._worker_env[name] = dict(extra_env or {})
            self._backoff[name] = Backoff()
            self._launch_worker(name)
            return name

    def _launch_worker(self, name: str) -> subprocess.Popen[bytes]:
        """Spawn a new incarnation of worker `name`, with a fresh WORKER_ID."""
        with self._lock:
            worker_id = f"{name}-{secrets.token_hex(4)}"
            env = self.env()
            env["WORKER_ID"] = worker_id
            own = self._worker_env[name]
            if "SANDBOX_UID_BASE" not in self.extra_env and "SANDBOX_UID_BASE" not in own:
                env["SANDBOX_UID_BASE"] = str(self.uid_base + WORKER_UID_STRIDE * self._worker_index[name])
            env.update(own)
            proc = self._spawn(name, [sys.executable, "-m", "worker"], env)
            self.procs[name] = proc
            self.worker_ids[name] = worker_id
            self.worker_history.setdefault(name, []).append(worker_id)
            self._launched_at_ms[name] = int(time.time() * 1000)
            return proc

    def _wait_worker_ready(self, name: str, timeout_s: float) -> None:
        proc = self.procs[name]
        _wait_for(lambda: self._is_ready(name), f"worker ({name})", timeout_s, proc, self._log(name))

    def _is_ready(self, name: str) -> bool:
        """Whether this incarnation of worker `name` has listed itself in Redis (its first
        heartbeat). Its liveness key alone comes earlier, before it has swept its leftovers and
        declared its lease settings on the host; and with a fixed WORKER_ID a killed
        incarnation's listing stays behind, so the listing must be newer than the launch."""
        with self.redis() as redis:
            listed = redis.hget(keys.WORKERS, self.worker_ids[name])
        if not listed:
            return False
        try:
            return int(json.loads(listed)["startedAtMs"]) >= self._launched_at_ms[name]
        except (ValueError, KeyError, TypeError):
            return False

    def kill_worker(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send `sig` to worker `name`'s process group (SIGKILL, SIGSTOP, SIGCONT...); returns
        the pid. Under supervision a worker that dies of it is restarted like any crash."""
        with self._lock:
            proc = self.procs[name]
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                pass
        if sig == signal.SIGKILL:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        return proc.pid

    def start_supervisor(self) -> None:
        """Restart workers that die (see launcher/supervisor.py), until stop()."""
        with self._lock:
            self.supervise = True
            if self._supervisor is None:
                self._supervisor_stop.clear()
                self._supervisor = threading.Thread(target=self._supervise_loop, name="stack-supervisor", daemon=True)
                self._supervisor.start()

    def stop_supervisor(self) -> None:
        thread = self._supervisor
        if thread is not None:
            self._supervisor_stop.set()
            # (a service it is starting again is waited for, so none starts after the stop)
            thread.join(10 + (SERVICE_START_S if self.supervise_services else 0))
            self._supervisor = None

    def _supervise_loop(self) -> None:
        while not self._supervisor_stop.wait(0.1):
            try:
                self._supervise_once()
                if self.supervise_services:
                    for name in SUPERVISED_SERVICES:
                        self._supervise_service(name)
            except Exception as exc:  # the supervisor itself must not die
                self._note(f"supervisor: {exc!r}")

    def _service_starter(self, name: str) -> Callable[[float], None]:
        """What starts Redis, soketi or the API (on its port), given how long it may take."""
        starters = {"redis": self._start_redis, "soketi": self._start_soketi, "api": self._start_api}
        if name not in starters:
            raise ValueError(f"restart() takes one of {sorted(starters)}, not {name!r}")
        return starters[name]

    def _record_death(self, name: str, proc: subprocess.Popen[bytes], old_id: str, now: float) -> None:
        """A supervised child found dead: its restart is due after its backoff (lock held)."""
        uptime = now - self._started_at.get(name, now)
        delay = self._backoff.setdefault(name, Backoff()).delay(uptime)  # (a service's: made here)
        returncode = proc.returncode
        assert returncode is not None
        record = Restart(name=name, old_id=old_id, returncode=returncode, uptime_s=uptime, delay_s=delay, died_at=now)
        self._pending[name] = record
        self.restarts.append(record)
        who = f"{old_id}, pid {proc.pid}" if old_id else f"pid {proc.pid}"
        self._note(f"{name} ({who}) {describe_exit(returncode)} after {uptime:.1f} s up; restarting in {delay:.1f} s", name)

    def _supervise_service(self, name: str) -> None:
        """Notice `name` (soketi or the API) dead, and start it again once its backoff is over."""
        now = time.monotonic()
        with self._lock:
            pending = self._pending.get(name)
            if pending is None:
                proc = self.procs.get(name)
                if proc is None or proc.poll() is None:
                    return
                _kill_group(proc)  # whatever it left in its group goes with it
                self._record_death(name, proc, "", now)
                return
            if now < pending.died_at + pending.delay_s or self._supervisor_stop.is_set():
                return
        # Started outside the lock: the start waits until the service answers.
        try:
            self._service_starter(name)(SERVICE_START_S)
        except StackError as exc:
            self.stop_process(name)  # (one that never answered)
            with self._lock:
                pending.died_at = time.monotonic()
                pending.delay_s = self._backoff[name].delay(0.0)
            self._note(f"{name} did not come back ({exc}); trying again in {pending.delay_s:.1f} s", name)
            return
        with self._lock:
            pending.restarted_at = time.monotonic()
            del self._pending[name]
            pid = self.procs[name].pid
        self._note(f"{name} restarted (pid {pid}), {pending.restarted_at - pending.died_at:.1f} s after it died", name)

    def _supervise_once(self) -> None:
        now = time.monotonic()
        with self._lock:
            for name in self.worker_names():
                if name in self._retired:
                    continue
                pending = self._pending.get(name)
                if pending is not None:
                    if now >= pending.died_at + pending.delay_s and not self._supervisor_stop.is_set():
                        proc = self._launch_worker(name)
                        pending.new_id = self.worker_ids[name]
                        pending.restarted_at = now
                        del self._pending[name]
                        self._awaiting_ready[name] = (pending.new_id, now)
                        self._note(f"{name} restarted as {pending.new_id} (pid {proc.pid})", name)
                    continue
                proc = self.procs.get(name)
                if proc is None or proc.poll() is None:
                    continue
                _kill_group(proc)  # whatever the leader left in its group goes with it
                returncode = proc.returncode
                old_id = self.worker_ids[name]
                self._awaiting_ready.pop(name, None)
                if returncode == 0:
                    self._retired.add(name)
                    self._note(f"{name} ({old_id}) stopped by itself (status 0); not restarted", name)
                    continue
                self._record_death(name, proc, old_id, now)
            awaiting = dict(self._awaiting_ready)
        for name, (worker_id, since) in awaiting.items():
            try:
                ready = self._is_ready(name)
            except Exception:
                continue  # Redis down: ask again at the next round
            if ready:
                with self._lock:
                    if self._awaiting_ready.get(name, ("", 0.0))[0] == worker_id:
                        del self._awaiting_ready[name]
                        self._note(f"{name} ({worker_id}) ready {time.monotonic() - since:.1f} s after its restart", name)

    def _note(self, message: str, name: str | None = None) -> None:
        """One supervisor message: kept, logged (supervisor.log, the worker's log), reported."""
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        self.notes.append(message)
        assert self.log_dir is not None
        try:
            with open(self.log_dir / "supervisor.log", "a") as out:
                out.write(f"{stamp} {message}\n")
            if name is not None:
                with open(self.log_dir / f"{name}.log", "a") as out:
                    out.write(f"--- {stamp} coderunner supervisor: {message} ---\n")
        except OSError:
            pass
        if self.on_event is not None:
            self.on_event(message)

    # -------------------------------------------------------------- redis

    def _redis_call(self, command: str, *args: str) -> bool:
        with self.redis() as redis:
            return bool(getattr(redis, command)(*args))

    def redis(self):  # type: ignore[no-untyped-def]
        """A synchronous client of this stack's Redis (for tests and tools)."""
        import redis

        return redis.Redis.from_url(self.redis_url, socket_connect_timeout=5)

    # -------------------------------------------------------------- stopping

    def stop_process(self, name: str, sig: int = signal.SIGTERM, timeout_s: float | None = None) -> int | None:
        """Stop one child (its whole process group); a supervised worker stays stopped. A
        worker is given worker_stop_s before SIGKILL unless told otherwise, a service SERVICE_STOP_S."""
        if timeout_s is None:
            timeout_s = self.worker_stop_s if name in self._worker_index else SERVICE_STOP_S
        with self._lock:
            proc = self.procs.get(name)
            if name in self._worker_index:
                self._retired.add(name)
                self._pending.pop(name, None)
        if proc is None:
            return None
        _terminate([proc], sig, timeout_s)
        return proc.returncode

    def stop(self) -> None:
        self.stop_supervisor()
        with self._lock:
            self._retired.update(self._worker_index)
            self._pending.clear()
            workers = [proc for name, proc in self.procs.items() if name in self._worker_index]
        # Workers first, all at once (they hand parked jobs back and let running ones finish
        # within their grace), then the API and soketi together (each waits out a short
        # grace of its own), and Redis last.
        _terminate(workers, signal.SIGTERM, self.worker_stop_s)
        _terminate([self.procs[name] for name in ("api", "soketi") if name in self.procs], signal.SIGTERM, SERVICE_STOP_S)
        self.stop_process("redis")
        self.procs.clear()

    def hurry_workers(self) -> None:
        """SIGTERM the workers again: a stopping worker then cancels its running jobs at once
        (each still gets its result) instead of waiting out its grace."""
        with self._lock:
            workers = [proc for name, proc in self.procs.items() if name in self._worker_index]
        for proc in workers:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def cleanup(self) -> None:
        self.stop()
        self._remove_deployment()
        self._release_lifeline()
        self._tmp.cleanup()
        if self._uid_block_fd is not None:
            os.close(self._uid_block_fd)  # the block is free for another stack
            self._uid_block_fd = None
        for fd in self._port_fds:
            os.close(fd)  # the ports are free for another stack
        self._port_fds.clear()

    def __enter__(self) -> Stack:
        """`with Stack(...) as stack:` starts it, and cleans up after it however the block
        ends (a failed start included)."""
        try:
            self.start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.cleanup()

    def _remove_deployment(self) -> None:
        remove_deployment(self.deployment)

    def log(self, name: str) -> str:
        assert self.log_dir is not None
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def dead_children(self) -> list[str]:
        """Children that exited; those the supervisor looks after do not count."""
        with self._lock:
            supervised = set(self._worker_index) if self._supervisor is not None else set()
            if self._supervisor is not None and self.supervise_services:
                supervised.update(SUPERVISED_SERVICES)
            return [name for name, proc in self.procs.items() if proc.poll() is not None and name not in supervised]


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _terminate(procs: list[subprocess.Popen[bytes]], sig: int, timeout_s: float) -> None:
    """Signal every group, wait for the leaders together, then SIGKILL what is left."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, sig)
                os.killpg(proc.pid, signal.SIGCONT)  # a stopped process gets the signal too
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    # Whatever the leaders did, nothing of their groups may survive.
    for proc in procs:
        _kill_group(proc)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
