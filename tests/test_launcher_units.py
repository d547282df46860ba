"""The launcher's small parts: which node runs soketi and the clients, the persistent log
folders of `coderunner up`, the port check it makes before starting anything, and the
lifeline that stops a stack whose owner died."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import launcher.node as node_mod
from launcher.cli import new_log_dir, port_in_use
from launcher.lifeline import MARK_ENV, SERVICE_GRACE_S, WORKER_GRACE_S, live_marked, start_time
from launcher.node import NodeNotFound, find_node, node_major
from shared.paths import REPO_ROOT
from tests.helpers import alive


def fake_node(folder: Path, version: str, real: str | None = None, marker: Path | None = None) -> Path:
    """A `node` that prints `version` for --version; with `real`, runs that node otherwise."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "node"
    body = f'if [ "$1" = "--version" ]; then echo {version}; exit 0; fi\n'
    if marker is not None:
        body += f'echo "$@" >> {marker}\n'
    body += f'exec {real} "$@"\n' if real else "exit 1\n"
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.fixture(autouse=True)
def _no_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CODERUNNER_SYSTEM_NODE", raising=False)


def test_node_major_reads_the_version(tmp_path: Path) -> None:
    assert node_major(fake_node(tmp_path / "a", "v18.19.0")) == 18
    assert node_major(fake_node(tmp_path / "b", "v20.18.0")) == 20
    assert node_major(tmp_path / "missing") is None
    assert node_major(fake_node(tmp_path / "c", "not-a-version")) is None


def test_system_node_20_is_chosen_and_a_newer_one_is_not(tmp_path: Path) -> None:
    system = fake_node(tmp_path / "sys", "v20.11.1")
    local = fake_node(tmp_path / "local", "v20.18.0")
    assert find_node(path=str(system.parent), local=local) == str(system)
    # uWebSockets.js has no native build for Node.js 22: soketi would run without its
    # backpressure limit, so the local Node.js 20 runs it.
    newer = fake_node(tmp_path / "newer", "v22.3.0")
    assert find_node(path=str(newer.parent), local=local) == str(local)


def test_an_old_system_node_falls_back_to_the_local_one(tmp_path: Path) -> None:
    system = fake_node(tmp_path / "sys", "v18.19.0")
    local = fake_node(tmp_path / "local", "v20.18.0")
    assert find_node(path=str(system.parent), local=local) == str(local)
    # No system node at all: the local one too.
    (tmp_path / "empty").mkdir()
    assert find_node(path=str(tmp_path / "empty"), local=local) == str(local)


def test_no_usable_node_says_what_it_found_and_what_to_run(tmp_path: Path) -> None:
    system = fake_node(tmp_path / "sys", "v18.19.0")
    with pytest.raises(NodeNotFound) as excinfo:
        find_node(path=str(system.parent), local=tmp_path / "nowhere" / "node")
    message = str(excinfo.value)
    assert "Node.js 18" in message and str(system) in message and "make deps" in message
    # A local node that is itself too old is not taken either.
    old_local = fake_node(tmp_path / "local", "v16.20.0")
    with pytest.raises(NodeNotFound, match=r"Node\.js 16"):
        find_node(path=str(system.parent), local=old_local)


def test_the_override_stands_in_for_the_system_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    new_system = fake_node(tmp_path / "sys", "v22.3.0")
    local = fake_node(tmp_path / "local", "v20.18.0")
    monkeypatch.setenv("CODERUNNER_SYSTEM_NODE", str(fake_node(tmp_path / "old", "v18.19.0")))
    assert find_node(path=str(new_system.parent), local=local) == str(local)
    monkeypatch.setenv("CODERUNNER_SYSTEM_NODE", str(tmp_path / "does-not-exist"))
    assert find_node(path=str(new_system.parent), local=local) == str(local)
    with pytest.raises(NodeNotFound, match="CODERUNNER_SYSTEM_NODE"):
        find_node(path=str(new_system.parent), local=tmp_path / "nowhere")


def test_this_machine_has_a_node_20() -> None:
    node = find_node()
    major = node_major(node)
    assert major == 20, node
    assert node in {node_mod.system_node(), str(node_mod.LOCAL_NODE)}


def test_log_dirs_are_fresh_and_only_the_newest_are_kept(tmp_path: Path) -> None:
    root = tmp_path / "logs"
    made = [new_log_dir(root, keep=3) for _ in range(5)]
    assert len(set(made)) == 5  # same second: suffixed, never shared
    kept = sorted(p for p in root.iterdir() if not p.name.startswith(".") and p.name != "latest")
    assert kept == sorted(made[-3:]), kept
    assert (root / "latest").resolve() == made[-1].resolve()
    # Folders that are not runs are never touched.
    (root / "notes").mkdir()
    new_log_dir(root, keep=1)
    assert (root / "notes").is_dir()


def test_port_in_use_is_detected(tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert port_in_use("127.0.0.1", port) == "in use"
        assert port_in_use("0.0.0.0", port) == "in use"
    assert port_in_use("127.0.0.1", port) is None
    assert port_in_use("no-such-host.invalid", 8000) is not None


def test_free_ports_are_distinct_and_outside_the_ephemeral_range() -> None:
    """A port handed to a child is closed until the child binds it; an outgoing connection
    can take a port from the ephemeral range in that gap (once an API failed to start so)."""
    from launcher.stack import free_port

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(1024 <= p < low for p in ports), ports
    with socket.socket() as s:
        s.bind(("127.0.0.1", ports[-1]))  # free indeed


def test_a_port_another_stack_holds_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    import secrets as secrets_mod

    from launcher import stack as stack_mod

    held: list[int] = []
    port = stack_mod.free_port(held)
    assert len(held) == 1  # (root: the lock is taken and kept)
    stack_mod._handed_ports.discard(port)  # as if chosen by another process's stack
    first = 20000
    real = secrets_mod.randbelow
    draws = iter([port - first, port - first])
    monkeypatch.setattr(stack_mod.secrets, "randbelow", lambda n: next(draws, None) or real(n))
    assert stack_mod.free_port() != port  # its lock is held: passed over
    os.close(held.pop())
    draws = iter([port - first])
    stack_mod._handed_ports.discard(port)
    assert stack_mod.free_port() == port  # free again once let go


def test_a_child_that_dies_at_start_up_is_reported_with_its_log(tmp_path: Path) -> None:
    from launcher.stack import StackError, _wait_for

    log = tmp_path / "api.log"
    log.write_text("".join(f"line {i}\n" for i in range(40)) + "ERROR: [Errno 98] address already in use\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait()
    with pytest.raises(StackError) as caught:
        _wait_for(lambda: False, "API", 5, proc, log)
    message = str(caught.value)
    assert message.startswith("API exited with status 3 during start-up; its log ends:")
    assert message.endswith("address already in use") and "line 29" in message and "line 28" not in message  # 12 lines


def test_stack_runs_soketi_with_the_chosen_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stack starts soketi with find_node()'s choice, here the local fallback."""
    from launcher.stack import Stack

    real = find_node()
    marker = tmp_path / "ran"
    monkeypatch.setenv("CODERUNNER_SYSTEM_NODE", str(fake_node(tmp_path / "old", "v18.19.0")))
    monkeypatch.setattr(node_mod, "LOCAL_NODE", fake_node(tmp_path / "local", "v20.18.0", real=real, marker=marker))
    stack = Stack(with_worker=False, log_dir=tmp_path / "logs")
    try:
        stack.start()
        assert "soketi" in marker.read_text() and " start" in marker.read_text()
    finally:
        stack.cleanup()
    # No local node either: the stack says what is missing instead of starting soketi.
    monkeypatch.setattr(node_mod, "LOCAL_NODE", tmp_path / "nowhere" / "node")
    stack = Stack(with_worker=False, log_dir=tmp_path / "logs2")
    try:
        with pytest.raises(Exception, match=r"Node\.js 20 is needed"):
            stack.start()
    finally:
        stack.cleanup()
    assert os.path.isdir(tmp_path / "logs2")


def test_the_stacks_redis_password_is_never_on_a_command_line(tmp_path: Path) -> None:
    """Review: `redis-server --requirepass <password>` showed it to every local user in
    /proc/<pid>/cmdline until Redis rewrote its title. It goes in a file of the stack's own
    (mode 0600) now, and Redis still refuses a client without it."""
    import redis as redis_py

    from launcher.stack import Stack

    stack = Stack(with_worker=False, log_dir=tmp_path / "logs")
    try:
        stack.start()
        argv = [str(arg) for arg in stack.procs["redis"].args]
        assert argv[0].endswith("redis-server") and not any(stack.redis_password in arg for arg in argv), argv
        config = Path(argv[1])
        assert config.stat().st_mode & 0o777 == 0o600 and stack.redis_password in config.read_text()
        with stack.redis() as client:
            assert client.ping()
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(port=stack.redis_port, socket_connect_timeout=5).set("k", "v")
    finally:
        stack.cleanup()


@pytest.mark.parametrize("how", ["cannot be started", "never gets ready"])
def test_a_stack_used_with_with_cleans_up_after_a_failed_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """`with Stack(...)` stops what it started and removes its files when the start fails
    half-way, as when the block ends: Redis, started first, and the API, started beside
    soketi."""
    from launcher.stack import Stack

    started: list[str] = []
    spawn_api = Stack._spawn_api
    api: list[subprocess.Popen[bytes]] = []

    def api_noted(self: Stack) -> Any:
        started.append("api")
        wait = spawn_api(self)
        api.append(self.procs["api"])
        return wait

    def soketi_fails(self: Stack) -> Any:
        if how == "cannot be started":
            raise RuntimeError("soketi would not start")

        def wait(timeout_s: float) -> None:
            raise RuntimeError("soketi would not start")

        return wait

    monkeypatch.setattr(Stack, "_spawn_soketi", soketi_fails)
    monkeypatch.setattr(Stack, "_spawn_api", api_noted)
    stack = Stack(with_worker=False, log_dir=tmp_path / "logs")
    with pytest.raises(RuntimeError, match="soketi would not start"), stack:
        pass
    assert started == ([] if how == "cannot be started" else ["api"])
    assert all(proc.poll() is not None for proc in api)  # the API spawned beside soketi ended too
    assert stack.procs == {}
    assert not stack.data_dir.exists()


def _sleeper(mark: str | None, ignore_term: bool = False) -> subprocess.Popen[bytes]:
    """A process group of its own, carrying CODERUNNER_STACK=<mark> (or no mark)."""
    env = {k: v for k, v in os.environ.items() if k != MARK_ENV}
    if mark is not None:
        env[MARK_ENV] = mark
    script = ("trap '' TERM; " if ignore_term else "") + "sleep 60 & wait"
    return subprocess.Popen(["sh", "-c", script], env=env, start_new_session=True)


def _lifeline(deployment: str, lines: list[str]) -> subprocess.Popen[bytes]:
    """A watcher told `lines`; its pipe is closed at once, as when its owner dies."""
    read_fd, write_fd = os.pipe()
    watcher = subprocess.Popen([sys.executable, "-m", "launcher.lifeline", deployment], stdin=read_fd, cwd=REPO_ROOT)
    os.close(read_fd)
    os.write(write_fd, "".join(f"{line}\n" for line in lines).encode())
    os.close(write_fd)
    return watcher


def test_the_lifeline_stops_its_stack_when_the_owner_is_gone() -> None:
    """Its owner gone without a word, the watcher ends the groups it was told of: one that
    ignores SIGTERM too (SIGKILL after its grace), and one whose leader's environment shows
    no mark (Redis overwrites it with its process title) but whose start time is the one
    given. A group whose id now belongs to a process with another start time and no mark
    of this stack (the id reused) is left alone."""
    deployment = f"coderunner-test-{secrets.token_hex(4)}"
    ours, stubborn = _sleeper(deployment), _sleeper(deployment, ignore_term=True)
    unmarked, stranger = _sleeper(None), _sleeper("another-stack")
    procs = (ours, stubborn, unmarked, stranger)
    try:
        time.sleep(0.2)  # the traps are set
        starts = {proc.pid: start_time(proc.pid) for proc in procs}
        watcher = _lifeline(
            deployment,
            [
                f"+{ours.pid} {starts[ours.pid]} worker",
                f"+{unmarked.pid} {starts[unmarked.pid]} service",
                f"+{stubborn.pid} {starts[stubborn.pid]} service",
                f"+{stranger.pid} {starts[stranger.pid] + 1} service",  # type: ignore[operator]
            ],
        )
        started = time.monotonic()
        assert watcher.wait(WORKER_GRACE_S + 3 * SERVICE_GRACE_S) == 0
        assert SERVICE_GRACE_S <= time.monotonic() - started < WORKER_GRACE_S  # only the stubborn one was waited for
        assert ours.wait(1) == -signal.SIGTERM
        assert unmarked.wait(1) == -signal.SIGTERM
        assert stubborn.wait(1) == -signal.SIGKILL
        assert stranger.poll() is None and live_marked(stranger.pid, "another-stack")
    finally:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_the_lifeline_does_nothing_once_the_stack_was_stopped() -> None:
    deployment = f"coderunner-test-{secrets.token_hex(4)}"
    ours = _sleeper(deployment)
    try:
        watcher = _lifeline(deployment, [f"+{ours.pid} {start_time(ours.pid)} service", "stopped"])
        assert watcher.wait(5) == 0
        assert ours.poll() is None
    finally:
        os.killpg(ours.pid, signal.SIGKILL)
        ours.wait()


def test_what_a_test_starts_dies_with_the_test_process(tmp_path: Path) -> None:
    # A run cut short with no teardown (`timeout make test` kills pytest outright) left the
    # `coderunner up` stacks and redis-servers its tests had started running for good.
    script = (
        "import subprocess, sys, time\n"
        "from tests.helpers import dies_with_the_tests\n"
        "child = subprocess.Popen(['sleep', '1000'], preexec_fn=dies_with_the_tests(), start_new_session=True)\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(1000)\n"
    )
    tests_process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=REPO_ROOT, text=True)
    assert tests_process.stdout is not None
    child = int(tests_process.stdout.readline())
    try:
        os.kill(tests_process.pid, signal.SIGKILL)
        tests_process.wait(5)
        deadline = time.monotonic() + 5
        while alive(child):
            assert time.monotonic() < deadline, "the child outlived the process that started it"
            time.sleep(0.02)
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)



def test_the_banner_shows_only_the_secrets_up_made_up() -> None:
    """An EXECUTOR_API_TOKEN or CALLBACK_SECRET given in the environment may be a real one:
    the banner (terminal scrollback, journald, CI logs) says it is yours, not what it is."""
    from types import SimpleNamespace

    from launcher.cli import banner

    stack = SimpleNamespace(
        api_url="http://127.0.0.1:8000", api_token="tok-made-up-0123456789", callback_secret="cb-made-up-0123456789",
        soketi_port=6001, pusher_key="key", log_dir="/tmp/logs", worker_names=lambda: [], worker_ids={},
    )  # fmt: skip
    made_up = banner(stack, {})  # type: ignore[arg-type]
    assert "#token=tok-made-up-0123456789" in made_up and "CALLBACK_SECRET=cb-made-up-0123456789" in made_up
    stack.api_token, stack.callback_secret = "real-token-from-the-env", "real-secret-from-the-env"
    given = banner(stack, {"EXECUTOR_API_TOKEN": stack.api_token, "CALLBACK_SECRET": stack.callback_secret})  # type: ignore[arg-type]
    assert "real-token-from-the-env" not in given and "real-secret-from-the-env" not in given, given
    assert "yours, from EXECUTOR_API_TOKEN" in given and "your CALLBACK_SECRET" in given
