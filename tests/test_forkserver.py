"""nsjail's fork server (worker/isolation/forkserver.c and .py), driven as the worker does.

Every jail of a worker is a fork of it that runs nsjail's main(): these check the child's
descriptors, its cgroups, the reaping on request, and that nothing outlives its owner (a
cancelled spawn, a lost server, a killed worker). The jails' own isolation is the hostile
suite's business, which runs on the fork server like every stack.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from shared.paths import LOCAL_NSJAIL
from tests.helpers import alive, host_processes, pids_with_cmdline
from worker.isolation.forkserver import FORKSERVER_NAME, ForkServer, ForkServerError, find_forkserver

pytestmark = [pytest.mark.sandbox]

SERVER = str(LOCAL_NSJAIL.with_name(FORKSERVER_NAME))
# A plain nsjail run of a shell: enough to drive the server's mechanics.
NSJAIL = [
    str(LOCAL_NSJAIL), "-Mo", "--quiet", "--chroot", "/", "--disable_proc",
    "--user", "65534:65534:1", "--group", "65534:65534:1", "--",
]  # fmt: skip


def _sh(script: str) -> list[str]:
    return [*NSJAIL, "/bin/sh", "-c", script]


def _children(pid: int) -> list[int]:
    return [child for child, _, status in host_processes() if status.get("PPid") == str(pid)]


async def _exited(pid: int, timeout_s: float = 10) -> None:
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return  # (gone and reaped already: by init, when its server went first)
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    loop.add_reader(pidfd, lambda: done.done() or done.set_result(None))
    try:
        await asyncio.wait_for(done, timeout_s)
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


async def _read_all(fd: int) -> bytes:
    return await asyncio.to_thread(_read_blocking, fd)


def _read_blocking(fd: int) -> bytes:
    parts = []
    while chunk := os.read(fd, 65536):
        parts.append(chunk)
    os.close(fd)
    return b"".join(parts)


@pytest.fixture
async def server() -> ForkServer:
    assert find_forkserver(str(LOCAL_NSJAIL)) == SERVER, "scripts/build-nsjail.sh did not build the fork server"
    forks = ForkServer(SERVER)
    yield forks
    forks.close()


async def test_a_fork_runs_nsjail_with_the_descriptors_it_was_given_at_their_numbers(server: ForkServer) -> None:
    stdin_r, stdin_w = os.pipe()
    out_r, out_w = os.pipe()
    extra_r, extra_w = os.pipe()
    script = "read line; echo got $line; echo side >&9; ls /proc/self/fd; read line"
    pid = await server.spawn(
        [*NSJAIL[:-1], "--pass_fd", "9", "--", "/bin/sh", "-c", script], {0: stdin_r, 1: out_w, 2: out_w, 9: extra_w}, []
    )
    ours = {os.readlink(f"/proc/self/fd/{fd}") for fd in (stdin_r, out_w, extra_w)}
    for fd in (stdin_r, out_w, extra_w):
        os.close(fd)
    os.write(stdin_w, b"hello\n")
    out = b""
    while not out.endswith(b"\n9\n"):  # the jail runs (and waits for its second line)
        out += await asyncio.to_thread(os.read, out_r, 4096)
    # The fork keeps exactly what it was given: 0, 1, 2 and 9, plus what nsjail opens itself,
    # and none of the server's (its socket) or the worker's.
    given = {name: os.readlink(f"/proc/{pid}/fd/{name}") for name in os.listdir(f"/proc/{pid}/fd")}
    assert {"0", "1", "2", "9"} <= set(given)
    assert given["9"] in ours and given["0"] in ours and given["1"] == given["2"] and given["1"] in ours
    assert not any(link.startswith("socket:") for link in given.values()), given
    os.write(stdin_w, b"bye\n")
    os.close(stdin_w)
    out += await _read_all(out_r)
    assert await _read_all(extra_r) == b"side\n"
    assert out.splitlines()[0] == b"got hello"
    assert sorted(out.splitlines()[1:]) == [b"0", b"1", b"2", b"3", b"9"]  # (3: ls's own listing)
    await _exited(pid)
    assert os.waitstatus_to_exitcode(await server.reap(pid)) == 0


async def test_the_fork_joins_each_cgroup_before_nsjail_runs_or_exits_125_saying_why(
    server: ForkServer, tmp_path: Path
) -> None:
    procs = [tmp_path / "a.procs", tmp_path / "b.procs"]
    for path in procs:
        path.write_text("")
    out_r, out_w = os.pipe()
    devnull = os.open(os.devnull, os.O_RDONLY)
    pid = await server.spawn(_sh("echo ran"), {0: devnull, 1: out_w, 2: out_w}, [str(p) for p in procs])
    os.close(out_w)
    assert await _read_all(out_r) == b"ran\n"
    await _exited(pid)
    assert os.waitstatus_to_exitcode(await server.reap(pid)) == 0
    assert [p.read_text() for p in procs] == [f"{pid}\n", f"{pid}\n"]  # its own pid, before nsjail forked

    out_r, out_w = os.pipe()
    missing = tmp_path / "gone" / "cgroup.procs"
    pid = await server.spawn(_sh("echo must-not-run"), {0: devnull, 1: out_w, 2: out_w}, [str(procs[0]), str(missing)])
    os.close(out_w)
    os.close(devnull)
    said = await _read_all(out_r)
    assert said == f"enter: {missing}: No such file or directory\n".encode()
    await _exited(pid)
    assert os.waitstatus_to_exitcode(await server.reap(pid)) == 125


async def test_a_fork_stays_a_zombie_of_the_server_until_the_worker_asks_it_reaped(server: ForkServer) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    pid = await server.spawn(_sh("exit 7"), {0: devnull, 1: devnull, 2: devnull}, [])
    os.close(devnull)
    await _exited(pid)
    await asyncio.sleep(0.2)
    assert Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"  # its pid is still its own
    assert pid in _children(server.pid)
    assert os.waitstatus_to_exitcode(await server.reap(pid)) == 7
    assert not Path(f"/proc/{pid}").exists()
    assert await server.reap(pid) is None  # (reaped once: nothing left to reap)


async def test_a_reap_asked_while_the_servers_socket_is_full_waits_its_turn(server: ForkServer) -> None:
    """A server fallen behind (stopped here) until its socket is full: a reap asked then
    used to be answered None at once, leaving the child a zombie in the server for good
    and its status lost. It now waits until the server reads again, and gets the status."""
    devnull = os.open(os.devnull, os.O_RDWR)
    pid = await server.spawn(_sh("exit 7"), {0: devnull, 1: devnull, 2: devnull}, [])
    os.close(devnull)
    await _exited(pid)
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        fillers = []
        for fake in range(4_000_000, 4_100_000):  # (pids no process has: the server answers None)
            filler = server.reap(fake)
            fillers.append(filler)
            if filler.done() or getattr(server, "_late_reaps", None):
                break  # the socket is full
        real = server.reap(pid)
        assert not real.done(), "a reap was refused while the server was merely behind"
    finally:
        os.kill(server.pid, signal.SIGCONT)
    assert os.waitstatus_to_exitcode(await asyncio.wait_for(real, 10)) == 7
    await asyncio.wait_for(asyncio.gather(*fillers), 10)
    assert not Path(f"/proc/{pid}").exists()


async def _run_with_config(server: ForkServer, config: Path, script: str) -> tuple[int, bytes]:
    out_r, out_w = os.pipe()
    devnull = os.open(os.devnull, os.O_RDONLY)
    argv = [NSJAIL[0], "--config", str(config), *NSJAIL[1:], "/bin/sh", "-c", script]
    pid = await server.spawn(argv, {0: devnull, 1: out_w, 2: out_w}, [])
    os.close(out_w)
    os.close(devnull)
    said = await _read_all(out_r)
    await _exited(pid)
    return os.waitstatus_to_exitcode(await server.reap(pid)), said


def _policy(*killed: str) -> str:
    lines = ["POLICY probe {", f"  KILL_PROCESS {{ {', '.join(killed)} }}", "}", "USE probe DEFAULT ALLOW"]
    return "".join(f'seccomp_string: "{line}"\n' for line in lines)


async def test_a_config_parsed_once_in_the_server_acts_as_each_jails_own_parse(
    server: ForkServer, tmp_path: Path
) -> None:
    # The server parses a config file, and compiles its seccomp policy, once; a child takes
    # them ready-made while the file's bytes are the ones parsed. Whatever the file says
    # must hold in every jail, and an edit must hold from the next jail on.
    config = tmp_path / "jail.cfg"
    config.write_text(_policy("newuname"))  # (kafel's name for uname(2))
    for _ in range(3):
        status, said = await _run_with_config(server, config, "uname -s; echo after-uname")
        assert status == 0 and b"Bad system call" in said and b"Linux" not in said, said
        assert said.endswith(b"after-uname\n"), said
    config.write_text(_policy("sethostname"))  # the policy changed on disk
    status, said = await _run_with_config(server, config, "uname -s; hostname x; echo after-hostname")
    assert said.startswith(b"Linux\n") and b"Bad system call" in said and said.endswith(b"after-hostname\n"), said
    config.write_text('hostname: "from-the-config"\n')  # no policy at all now
    status, said = await _run_with_config(server, config, "uname -n; hostname x 2>/dev/null; echo after-hostname")
    assert (status, said) == (0, b"from-the-config\nafter-hostname\n"), said
    config.write_text("this is not a config\n")  # refused as nsjail refuses it
    status, said = await _run_with_config(server, config, "echo must-not-run")
    assert status != 0 and b"must-not-run" not in said, said


def _nss_modules(databases: tuple[str, ...] = ("passwd", "group")) -> set[str]:
    """The NSS module libraries nsswitch.conf names for `databases` that exist here."""
    names: set[str] = set()
    for line in Path("/etc/nsswitch.conf").read_text().splitlines():
        database, _, sources = line.partition("#")[0].partition(":")
        if database.strip() in databases:
            # (files and dns are part of glibc itself since 2.34: nothing to load)
            names.update(word for word in sources.split() if not word.startswith("[") and word not in ("files", "dns"))
    return {
        f"libnss_{name}.so.2" for name in names
        if Path(f"/lib/x86_64-linux-gnu/libnss_{name}.so.2").exists() or Path(f"/usr/lib/libnss_{name}.so.2").exists()
    }  # fmt: skip


async def test_the_server_loads_the_user_lookup_modules_every_jail_would_load_again(server: ForkServer) -> None:
    # nsjail looks its --user and --group up by name: each exec'd nsjail read nsswitch.conf
    # and loaded its modules (libnss_systemd and two libraries more, here). The server has
    # them loaded before its first fork, so no child loads them again.
    devnull = os.open(os.devnull, os.O_RDWR)
    pid = await server.spawn(_sh("true"), {0: devnull, 1: devnull, 2: devnull}, [])
    os.close(devnull)
    await _exited(pid)
    await server.reap(pid)
    assert server.pid is not None
    maps = Path(f"/proc/{server.pid}/maps").read_text()
    assert {name for name in _nss_modules() if name not in maps} == set()


async def test_a_cancelled_spawn_leaves_no_child_behind(server: ForkServer) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    first = await server.spawn(_sh("true"), {0: devnull, 1: devnull, 2: devnull}, [])  # (server up)
    await _exited(first, 60)
    await server.reap(first)  # (so the only child left to look for is the cancelled one's)
    task = asyncio.ensure_future(server.spawn(_sh("sleep 300"), {0: devnull, 1: devnull, 2: devnull}, []))
    await asyncio.sleep(0)  # the request is out; the answer is not in yet
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    os.close(devnull)
    deadline = time.monotonic() + 30  # (a loaded host: a full make test runs beside stacks)
    while server._spawns and time.monotonic() < deadline:  # the answer comes (the fork exists) ...
        await asyncio.sleep(0.01)
    await asyncio.sleep(0)  # (... and its abandonment runs, as the answer's callback)
    while time.monotonic() < deadline and any(alive(child) for child in _children(server.pid)):
        await asyncio.sleep(0.05)
    left = {child: Path(f"/proc/{child}/stat").read_text() for child in _children(server.pid) if alive(child)}
    assert left == {}


async def test_a_lost_server_takes_its_children_and_the_next_spawn_starts_another(server: ForkServer) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    pid = await server.spawn(_sh("sleep 30"), {0: devnull, 1: devnull, 2: devnull}, [])
    first = server.pid
    assert first is not None and alive(pid)
    os.kill(first, signal.SIGKILL)
    await _exited(pid)  # its parent-death signal
    status = await server.reap(pid)
    assert status is None  # (its status went with the server)
    for _ in range(100):
        if server.pid is None:
            break
        await asyncio.sleep(0.02)
    assert server.pid is None
    again = await server.spawn(_sh("true"), {0: devnull, 1: devnull, 2: devnull}, [])
    os.close(devnull)
    assert server.pid not in (None, first)
    await _exited(again)
    assert os.waitstatus_to_exitcode(await server.reap(again)) == 0


async def test_a_server_that_stops_answering_is_replaced() -> None:
    """A stopped (or stuck) server fails the spawn after its timeout, and is killed with its
    jails; the next spawn starts another."""
    server = ForkServer(SERVER, answer_timeout_s=0.5)
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        running = await server.spawn(_sh("sleep 30"), {0: devnull, 1: devnull, 2: devnull}, [])
        stopped = server.pid
        assert stopped is not None
        os.kill(stopped, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(ForkServerError, match="did not answer"):
            await server.spawn(_sh("true"), {0: devnull, 1: devnull, 2: devnull}, [])
        assert 0.4 < time.monotonic() - started < 3
        await _exited(running)  # (it went with its server)
        again = await server.spawn(_sh("true"), {0: devnull, 1: devnull, 2: devnull}, [])
        assert server.pid not in (None, stopped)
        await _exited(again)
        assert os.waitstatus_to_exitcode(await server.reap(again)) == 0
    finally:
        os.close(devnull)
        server.close()


async def test_a_spawn_beyond_the_servers_limits_is_refused_before_it_is_sent(server: ForkServer) -> None:
    with pytest.raises(ValueError):
        await server.spawn(_sh("true"), {n: 0 for n in range(17)}, [])
    with pytest.raises(ValueError):
        await server.spawn(["x" * (1 << 20)], {}, [])
    assert server.pid is None  # nothing was started for them


async def test_a_malformed_request_is_answered_with_an_error_not_a_pid(server: ForkServer) -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    await server.spawn(_sh("true"), {0: devnull, 1: devnull, 2: devnull}, [])
    server_pid = server.pid
    assert server_pid is not None
    # One more descriptor than the request says: the server refuses it, naming the request.
    request = b"S" + (1).to_bytes(4, "little") + (0).to_bytes(4, "little") * 2 + (1).to_bytes(4, "little") + b"x\0"
    sock = server._sock
    assert sock is not None
    answer = asyncio.get_running_loop().create_future()
    server._spawns[1] = answer
    import array
    import socket

    sock.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [devnull]))])
    with pytest.raises(ForkServerError):
        await asyncio.wait_for(answer, 5)
    os.close(devnull)
    assert server.pid == server_pid  # (still serving)


def test_a_killed_worker_takes_the_server_and_every_jail_with_it(tmp_path: Path) -> None:
    """The worker SIGKILLed: its fork server dies (its socket's end, or else the parent-death
    signal of the thread that started it), and with it each fork, each one an nsjail.

    (Each nsjail's jail then gets nsjail's own parent-death signal. nsjail sets it without
    looking again whether it is still there, and about one jail in 30 outlives an nsjail
    SIGKILLed this way, exec'd or forked alike: a worker's jails live in cgroups, which the
    worker kills when nsjail dies and the next worker's janitor kills after a crash. Not
    asserted here, where there are no cgroups; cleaned up.)"""
    marker = f"forkserver-test-{os.getpid()}-{time.monotonic_ns()}"
    script = textwrap.dedent(
        f"""
        import asyncio, os, sys
        sys.path.insert(0, {str(Path(__file__).resolve().parents[1])!r})
        from worker.isolation.forkserver import ForkServer

        async def main():
            server = ForkServer({SERVER!r})
            devnull = os.open(os.devnull, os.O_RDWR)
            argv = {NSJAIL!r} + ["/bin/sh", "-c", "sleep 300; : {marker}"]
            for _ in range(3):
                await server.spawn(argv, {{0: devnull, 1: devnull, 2: devnull}}, [])
            print(server.pid, flush=True)
            await asyncio.sleep(300)

        asyncio.run(main())
        """
    )
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert worker.stdout is not None
        server_pid = int(worker.stdout.readline())
        deadline = time.monotonic() + 10
        # (Until it settles: an nsjail's clone shows nsjail's command line until it execs.)
        while time.monotonic() < deadline and len(_with_marker(marker, worker.pid)) != 6:
            time.sleep(0.05)
        assert len(_with_marker(marker, worker.pid)) == 6  # three nsjail, each with its jail's shell
        worker.kill()
        worker.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (alive(server_pid) or any(_argv0(p) == os.fsencode(LOCAL_NSJAIL) for p in _with_marker(marker))):
            time.sleep(0.05)
        assert not alive(server_pid)
        nsjails = [pid for pid in _with_marker(marker) if _argv0(pid) == os.fsencode(LOCAL_NSJAIL)]
        assert nsjails == []
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        if worker.stdout is not None:
            worker.stdout.close()
        for pid in _with_marker(marker):
            os.kill(pid, signal.SIGKILL)


def _argv0(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return b""


def _with_marker(marker: str, but: int = 0) -> list[int]:
    """Live processes whose command line holds `marker` (other than `but`)."""
    return [pid for pid in pids_with_cmdline(marker.encode()) if pid != but and alive(pid)]
