"""The worker's side of nsjail's fork server (worker/isolation/forkserver.c).

The server is nsjail's own code loaded once: each jail is a fork of it instead of an exec
of nsjail, which saves what every exec paid again (mapping the binary, the dynamic loader,
glibc's CPU probing, protobuf's start-up): about 1.2 to 1.9 ms of host CPU a jail here.
The child does what `enter` did before its exec (a session, its descriptors, death with
the server, its pid into the job's cgroups), then runs nsjail's main() as a fresh process
would; nothing of one jail is ever in another's process.

One server per worker, started on an isolation thread (its parent-death signal follows the
thread that spawned it, and those live as long as the worker) and driven from the event
loop over a socketpair: a spawn is one datagram out with the child's descriptors attached
and one back with its pid. The server reaps a child only when asked, after the worker has
seen it exit through a pidfd, so until then the pid is the child's own, as with a child of
the worker itself. If the server is lost, its children die with it (their parent-death
signal); the pending spawns fail, and the next spawn starts a new server.
"""

from __future__ import annotations

import array
import asyncio
import logging
import os
import signal
import socket
import struct
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

from worker.isolation.offload import off_loop, off_loop_soon

__all__ = ["FORKSERVER_NAME", "ForkServer", "ForkServerError", "find_forkserver", "kill_session"]

log = logging.getLogger(__name__)

# Built next to nsjail by scripts/build-nsjail.sh.
FORKSERVER_NAME = "nsjail-forkserver"
# The server's receive buffer (forkserver.c: MAX_MESSAGE) and its limits on a request.
_MAX_REQUEST = 1 << 20
_MAX_FDS = 16
_MAX_CGROUPS = 16
# Room in the server's argument area for each child's nsjail argv, so that ps and
# /proc/<pid>/cmdline show a forked jail as the nsjail run it is (see show_argv in the C).
FORKSERVER_TITLE_ROOM = 32 * 1024
_SPAWNED = struct.Struct("=cIi")
_REAPED = struct.Struct("=cIii")
_REPLY_SIZE = max(_SPAWNED.size, _REAPED.size)


class ForkServerError(OSError):
    """The fork server could not spawn (it is gone, or the fork failed)."""


def find_forkserver(nsjail: str) -> str | None:
    """The fork server built with this nsjail (same folder, same build), if there is one."""
    candidate = Path(nsjail).with_name(FORKSERVER_NAME)
    return str(candidate) if os.access(candidate, os.X_OK) else None


class ForkServer:
    """Spawns nsjail processes by forking the server; see the module's docstring."""

    def __init__(self, path: str, answer_timeout_s: float = 10.0) -> None:
        self.path = path
        # A fork answers in about a millisecond; one that has not in this long never will
        # (the server is stopped or stuck), and its jails go with it (see spawn).
        self.answer_timeout_s = answer_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sock: socket.socket | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._starting: asyncio.Lock | None = None
        self._next_id = 0
        self._spawns: dict[int, asyncio.Future[int]] = {}
        self._reaps: dict[int, asyncio.Future[int | None]] = {}
        self._writable: asyncio.Future[None] | None = None
        self._late_reaps: set[asyncio.Task[None]] = set()

    @property
    def pid(self) -> int | None:
        """The running server's pid (None before the first spawn, or once it is gone)."""
        return self._process.pid if self._sock is not None and self._process is not None else None

    async def spawn(self, argv: Sequence[str], fds: Mapping[int, int], procs_files: Sequence[str]) -> int:
        """Fork a child that puts `fds` (its number -> ours) in place, joins `procs_files`
        and runs nsjail's main() with `argv`; its pid. Our descriptors stay ours to close.

        Raises:
            ForkServerError: the server is gone, or could not fork.
        """
        if len(fds) > _MAX_FDS or len(procs_files) > _MAX_CGROUPS or not argv:
            raise ValueError("spawn request beyond the fork server's limits")
        targets = list(fds)
        self._next_id = self._next_id % 0xFFFFFFFF + 1
        request_id = self._next_id
        # Every string NUL-terminated, encoded in one call (not one per argument).
        strings = os.fsencode("\0".join([*procs_files, *argv]) + "\0")
        request = b"S" + struct.pack(f"=II{len(targets)}III", request_id, len(targets), *targets, len(procs_files), len(argv)) + strings
        if len(request) > _MAX_REQUEST:
            raise ValueError("spawn request beyond the fork server's limits")
        await self._ensure_running()
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[int] = loop.create_future()
        self._spawns[request_id] = answer
        try:
            await self._send(request, [fds[target] for target in targets])
        except BaseException:
            self._spawns.pop(request_id, None)
            raise
        try:
            return await asyncio.wait_for(asyncio.shield(answer), self.answer_timeout_s)
        except asyncio.CancelledError:
            # The child may exist already: it must not outlive a caller that left.
            answer.add_done_callback(self._abandon)
            raise
        except TimeoutError:
            self._spawns.pop(request_id, None)  # (failed here, not by _lost: nobody would read that)
            self._lost(f"no answer to a spawn in {self.answer_timeout_s:g} s")
            raise ForkServerError(f"the nsjail fork server did not answer in {self.answer_timeout_s:g} s") from None

    def reap(self, pid: int) -> asyncio.Future[int | None]:
        """Reap a child seen to exit; its wait status (None when it was not there to reap:
        the server went away, and with it the child's status)."""
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[int | None] = loop.create_future()
        if self._sock is None or loop is not self._loop or pid in self._reaps:
            answer.set_result(None)
            return answer
        self._reaps[pid] = answer
        request = b"R" + struct.pack("=I", pid)
        try:
            self._sock.send(request)
        except BlockingIOError:
            # The server is behind and its socket full: the request waits its turn, as a
            # spawn's does. Answered None here, the child would stay a zombie in the server
            # for its whole life, holding a pid, and its status would be lost.
            late = loop.create_task(self._reap_late(pid, request))
            self._late_reaps.add(late)
            late.add_done_callback(self._late_reaps.discard)
        except OSError:  # (the server is gone)
            self._reaps.pop(pid, None)
            answer.set_result(None)
        return answer

    async def _reap_late(self, pid: int, request: bytes) -> None:
        try:
            await self._send(request, [])
        except ForkServerError:
            answer = self._reaps.pop(pid, None)
            if answer is not None and not answer.done():
                answer.set_result(None)

    def close(self) -> None:
        """Stop the server (its children get their SIGKILL) and fail what still waits."""
        self._lost("closed")

    async def _ensure_running(self) -> None:
        loop = asyncio.get_running_loop()
        if self._sock is not None and loop is self._loop:
            return
        if self._starting is None or loop is not self._loop:
            self._lost("bound to another event loop")
            self._starting = asyncio.Lock()
            self._loop = loop
        async with self._starting:
            if self._sock is not None:
                return
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                self._process = await off_loop(_start, self.path, theirs.fileno())
            except BaseException:
                ours.close()
                raise
            finally:
                theirs.close()
            ours.setblocking(False)
            self._sock = ours
            loop.add_reader(ours.fileno(), self._on_reply)

    async def _send(self, request: bytes, fds: list[int]) -> None:
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while True:
            sock = self._sock
            if sock is None:
                raise ForkServerError("the nsjail fork server is gone")
            try:
                sock.sendmsg([request], ancillary)
                return
            except BlockingIOError:
                await self._until_writable(sock)
            except OSError as exc:
                self._lost(f"send failed: {exc}")
                raise ForkServerError(f"the nsjail fork server is gone: {exc}") from None

    async def _until_writable(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        if self._writable is None or self._writable.done():
            self._writable = loop.create_future()
            waiter = self._writable
            loop.add_writer(sock.fileno(), lambda: waiter.done() or waiter.set_result(None))
            waiter.add_done_callback(lambda _: self._sock is sock and loop.remove_writer(sock.fileno()))
        await asyncio.shield(self._writable)

    def _on_reply(self) -> None:
        sock = self._sock
        if sock is None:
            return
        while True:
            try:
                reply = sock.recv(_REPLY_SIZE)
            except BlockingIOError:
                return
            except OSError as exc:
                self._lost(f"receive failed: {exc}")
                return
            if not reply:
                self._lost("it exited")
                return
            if reply[:1] == b"S" and len(reply) == _SPAWNED.size:
                _, request_id, pid = _SPAWNED.unpack(reply)
                answer = self._spawns.pop(request_id, None)
                if answer is None or answer.done():
                    continue
                if pid > 0:
                    answer.set_result(pid)
                else:
                    answer.set_exception(ForkServerError(-pid, f"nsjail fork server: {os.strerror(-pid)}"))
            elif reply[:1] == b"R" and len(reply) == _REAPED.size:
                _, pid, found, status = _REAPED.unpack(reply)
                reaped = self._reaps.pop(pid, None)
                if reaped is not None and not reaped.done():
                    reaped.set_result(status if found else None)
            else:
                self._lost(f"unreadable reply {reply[:16]!r}")
                return

    def _lost(self, why: str) -> None:
        """The server is gone or going: fail the spawns, answer the reaps, stop it."""
        sock, self._sock = self._sock, None
        if sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(sock.fileno())
                self._loop.remove_writer(sock.fileno())
            sock.close()  # (its EOF ends a server still running)
            if why != "closed":
                log.warning("nsjail fork server lost: %s", why)
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        for answer in self._spawns.values():
            if not answer.done():
                answer.set_exception(ForkServerError(f"the nsjail fork server is gone: {why}"))
        for reaped in self._reaps.values():
            if not reaped.done():
                reaped.set_result(None)
        self._spawns.clear()
        self._reaps.clear()
        process, self._process = self._process, None
        if process is not None:
            process.kill()  # (SIGKILL: a server stuck in a fork is not left behind)
            _reap_later(process)

    def _abandon(self, answer: asyncio.Future[int]) -> None:
        """A spawn whose caller was cancelled: kill the child, reap it when it has exited."""
        if answer.cancelled() or answer.exception() is not None:
            return
        pid = answer.result()
        kill_session(pid)
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            return
        loop = asyncio.get_running_loop()

        def exited() -> None:
            loop.remove_reader(pidfd)
            os.close(pidfd)
            self.reap(pid)

        loop.add_reader(pidfd, exited)


def kill_session(pid: int) -> None:
    """SIGKILL a child that leads its own session, and all its group. A fork just made may not
    have called setsid() yet (its pid is then no group's): then the child alone, which has
    started nothing yet."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _start(path: str, sock_fd: int) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [path, str(os.getpid()), " " * FORKSERVER_TITLE_ROOM],
        stdin=sock_fd,
        stdout=subprocess.DEVNULL,
        env={},
        start_new_session=True,
    )


def _reap_later(process: subprocess.Popen[bytes]) -> None:
    """Reap a killed server without waiting on the loop: on an isolation thread."""
    if process.poll() is not None:
        return
    try:
        off_loop_soon(process.wait)
    except RuntimeError:  # (no loop running: at exit)
        process.wait()
