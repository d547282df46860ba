"""A child process spawned off the event loop, then driven from it.

`asyncio.create_subprocess_exec` forks and waits for the exec on the loop's own thread
(about a quarter of the worker's loop time under load). Here the spawn runs on an
isolation thread (`subprocess.Popen`), and the loop then takes over the child's pipes as
ordinary asyncio streams and learns of its exit from a pidfd, so nothing about the child
blocks the loop. The surface is the part of `asyncio.subprocess.Process` the jail uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable, Sequence
from typing import cast

from worker.isolation.forkserver import ForkServer, kill_session
from worker.isolation.offload import off_loop, off_loop_quick

__all__ = ["Child", "PipeReader"]

log = logging.getLogger(__name__)

PIPE_LIMIT = 1 << 20
# What a program's stdin pipe holds (the kernel's default is 64 KiB). The API's cap on
# stdin waiting for the program (64 KiB) counts what the worker has not written yet; with
# the writer holding nothing back either (write_pipe), at most this much more sits written
# but unread, where the default pipe and buffer let 128 KiB more through.
STDIN_PIPE_BYTES = 16 * 1024


class _WriteProtocol(asyncio.streams.FlowControlMixin):
    """Flow control for a pipe the loop writes to, plus the close waiter StreamWriter wants."""

    def __init__(self) -> None:
        super().__init__()
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if not self._closed.done():
            self._closed.set_result(None)

    def _get_close_waiter(self, stream: asyncio.StreamWriter) -> asyncio.Future[None]:
        return self._closed


class _LibuvOwned:
    """A pipe descriptor handed to uvloop, which closes it through libuv.

    uvloop closes a pipe's descriptor itself and then also calls the file object's
    `close()`, closing the same number a second time. With isolation threads opening
    descriptors concurrently, that number may by then be another pipe or a Redis socket.
    This stand-in's `close()` is a no-op, so the descriptor is closed exactly once.
    """

    def __init__(self, fd: int) -> None:
        self._fd = fd

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        pass


def _pipe_object(fd: int, mode: str):  # type: ignore[no-untyped-def]
    if type(asyncio.get_running_loop()).__module__.startswith("uvloop"):
        return _LibuvOwned(fd)
    return os.fdopen(fd, mode, 0)  # the stock loop closes the file object, once


class PipeReader(asyncio.StreamReader):
    """A StreamReader over a pipe whose reading can be held for a moment.

    The transport under a StreamReader reads whenever the pipe is readable, whether or not
    anyone calls `read()`: a program writing line by line wakes the loop for every line
    even while its reader waits to gather lines. Held, the pipe itself gathers them (the
    writer blocks only if its 64 KiB fill up) and the next read takes them in one go.
    """

    _pipe: asyncio.ReadTransport | None = None
    _held = False
    _fd = -1
    _pause_end: asyncio.Future[None] | None = None
    _widened = False
    # When the oldest bytes buffered came (time.monotonic()), kept once they are read: the
    # date of what the last read() returned.
    fed_at = 0.0

    def feed_data(self, data: bytes) -> None:
        if not self._buffer:
            self.fed_at = time.monotonic()
        super().feed_data(data)

    def buffered_since(self) -> float | None:
        return self.fed_at if self._buffer else None

    def set_transport(self, transport: asyncio.BaseTransport) -> None:
        super().set_transport(transport)
        # uvloop's pipe transports have the ReadTransport methods without the base class.
        self._pipe = cast(asyncio.ReadTransport, transport)

    def hold(self) -> None:
        # Only a transport that is reading: one the StreamReader paused itself (its buffer
        # is full) stays the StreamReader's to resume, and one past EOF has nothing to hold.
        if self._pipe is None or self._pipe.is_closing() or self._paused or self._eof:
            return
        self._pipe.pause_reading()
        self._held = True

    def release(self) -> None:
        if not self._held:
            return
        self._held = False
        if self._pipe is not None and not self._pipe.is_closing():
            self._pipe.resume_reading()

    async def pause(self, seconds: float, release: bool = True) -> None:
        """Hold the pipe for `seconds`, or until `take_rest()` ends it, whichever is first
        (and keep holding it after, with `release` False: see take_gathered). At once for
        a stream that has ended: nothing more can come to gather (a step whose last line
        and end came together would otherwise end a whole hold later)."""
        if self._eof:
            return
        self.hold()
        loop = asyncio.get_running_loop()
        self._pause_end = waiter = loop.create_future()
        timer = loop.call_later(seconds, _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._pause_end = None
            if release:
                self.release()

    async def wait_buffered(self, seconds: float) -> None:
        """Until something is buffered or the stream has ended, at most `seconds`. Nothing is
        read out: what comes stays in the buffer, where take_gathered sees it."""
        if self._buffer or self._eof:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await self._wait_for_data("wait_buffered")  # type: ignore[attr-defined]

    def take_gathered(self, limit: int) -> tuple[bytes, bool]:
        """Up to `limit` bytes the stream holds now, without waiting: what is in this reader's
        buffer, then (while the pipe is held) what the pipe gathered, read straight from it;
        and whether the stream has ended. A `read()` waiting meanwhile may then return b""
        without the stream having ended (see at_eof)."""
        data = bytes(self._buffer[:limit])
        del self._buffer[:limit]
        if len(data) < limit and self._held and not self._eof and self._pipe is not None and not self._pipe.is_closing():
            try:
                # One read: what the pipe holds now (at most its 64 KiB), as the transport's
                # own read would take it; a loop would race a writer one write at a time.
                chunk = os.read(self._fd, limit - len(data))
                if not chunk:
                    self.feed_eof()
                data += chunk
            except BlockingIOError:
                pass
        self._maybe_resume_transport()  # type: ignore[attr-defined]
        return data, self.at_eof()

    def drop_gathered(self, keep: int) -> tuple[bytes, int, bool]:
        """take_gathered for bytes that are only dropped: takes what the buffer and (held)
        pipe hold now, and returns the last `keep` bytes of it, how many there were, and
        whether the stream has ended. The rest of the pipe goes to /dev/null by splice(2),
        uncopied (a read of a full 1 MiB pipe cost about twice as much)."""
        head = bytes(self._buffer)
        self._buffer.clear()
        piped = b""
        dropped = 0
        if self._held and not self._eof and self._pipe is not None and not self._pipe.is_closing():
            try:
                waiting = struct.unpack("i", fcntl.ioctl(self._fd, termios.FIONREAD, b"\0\0\0\0"))[0]
                if waiting > keep:
                    dropped = os.splice(self._fd, _dev_null(), waiting - keep)
                piped = os.read(self._fd, keep)
                if not piped and not dropped:
                    self.feed_eof()
            except BlockingIOError:
                pass
        self._maybe_resume_transport()  # type: ignore[attr-defined]
        return (head + piped)[-keep:], len(head) + dropped + len(piped), self.at_eof()

    def _widenable(self) -> bool:
        # (Not once widened, nor closed: a closed transport's descriptor may be another file's.)
        return not self._widened and self._fd >= 0 and self._pipe is not None and not self._pipe.is_closing()

    def short_of(self, size: int) -> int:
        """How much less than `size` bytes the pipe holds (0 once widened, or closed)."""
        if not self._widenable():
            return 0
        try:
            return max(0, size - fcntl.fcntl(self._fd, fcntl.F_GETPIPE_SZ))
        except OSError:
            return 0

    def widen(self, size: int) -> None:
        """Let the pipe hold `size` bytes (once; a pipe that cannot stays as it is)."""
        if not self._widenable():
            return
        self._widened = True
        try:
            fcntl.fcntl(self._fd, fcntl.F_SETPIPE_SZ, size)
        except OSError as exc:
            log.warning("a pipe could not be widened to %d bytes (%s): output past its budget drains slower", size, exc)

    def take_rest(self) -> None:
        """End the stream with what the pipe holds now, though its write end stays open.

        For a pipe whose every writer that matters is known to be gone while some other
        holder keeps it open (nsjail, for a jail whose gate has reported): nothing more can
        come, so no EOF need be waited for.
        """
        if self._pipe is None or self._pipe.is_closing() or self._eof or self._fd < 0:
            return  # (a closed transport's descriptor may be another file's by now)
        self._held = False
        os.set_blocking(self._fd, False)
        try:
            while data := os.read(self._fd, 65536):
                self.feed_data(data)
        except BlockingIOError:
            pass
        self.feed_eof()
        self._pipe.close()
        if self._pause_end is not None:
            _resolve(self._pause_end)


_null_fd = -1


def _dev_null() -> int:
    global _null_fd
    if _null_fd < 0:
        _null_fd = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
    return _null_fd


async def read_pipe(fd: int) -> tuple[asyncio.StreamReader, asyncio.BaseTransport]:
    """A StreamReader over `fd`, and its transport (which owns `fd`).

    Close the transport when done: at EOF uvloop keeps a pipe open if the protocol asks it
    to, and StreamReaderProtocol does.
    """
    loop = asyncio.get_running_loop()
    reader = PipeReader(limit=PIPE_LIMIT)
    reader._fd = fd
    os.set_blocking(fd, False)  # (read straight from, at times: see take_gathered)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), _pipe_object(fd, "rb"))
    return reader, transport


async def write_pipe(fd: int) -> asyncio.StreamWriter:
    """A StreamWriter over `fd` (the transport owns and closes it) whose `drain()` returns
    only once everything written is in the pipe: what the worker counts as written to a
    program is there for it to read, not in a buffer of ours."""
    loop = asyncio.get_running_loop()
    transport, protocol = await loop.connect_write_pipe(_WriteProtocol, _pipe_object(fd, "wb"))
    transport.set_write_buffer_limits(high=0)
    return asyncio.StreamWriter(transport, protocol, None, loop)


class Child:
    """A spawned child: `stdin` (StreamWriter), `stdout`/`stderr` (StreamReader), `wait()`."""

    def __init__(self, popen: subprocess.Popen[bytes] | None, pid: int = 0, server: ForkServer | None = None) -> None:
        # Spawned here (popen) or by the fork server, which then reaps it when asked.
        self._popen = popen
        self._server = server
        self.pid = popen.pid if popen is not None else pid
        self.returncode: int | None = None
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader | None = None
        self.stderr: asyncio.StreamReader | None = None
        self._exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pidfd = -1
        # Asked of the fork server, not answered yet: the pid is about to be another's.
        self.reaping = False
        self._transports: list[asyncio.BaseTransport] = []
        self._reap_holds = 0

    @classmethod
    async def spawn(
        cls,
        argv: Sequence[str],
        *,
        merge_stderr: bool,
        pass_fds: Sequence[int],
        before: Callable[[], None] | None = None,
        server: ForkServer | None = None,
        procs_files: Sequence[str] = (),
    ) -> Child:
        """Spawn `argv` in a new session with an empty environment and piped stdio.

        `before` runs first on the same isolation thread (one trip there, not two): set-up
        the child needs, such as its cgroups. If it raises, nothing is spawned. With a
        `server`, `argv` is nsjail's and the fork server runs it, in `procs_files` (the
        cgroups); without, `argv` is run as it is (`enter` joins the cgroups).
        """
        # Raw descriptors, not subprocess.PIPE: Popen's file objects would close them again.
        pipes = [os.pipe2(os.O_CLOEXEC) for _ in range(2 if merge_stderr else 3)]
        for read_end, _write_end in pipes:
            # A pipe is its creator's (root, unmapped in the job's user namespace) with mode
            # 0600: the job could not open its own stdio again by name (/dev/stdin is
            # /proc/self/fd/0). Only the processes holding one of its descriptors can name it.
            os.fchmod(read_end, 0o666)
        stdin_r, stdin_w = pipes[0]
        try:
            fcntl.fcntl(stdin_w, fcntl.F_SETPIPE_SZ, STDIN_PIPE_BYTES)
        except OSError:
            pass  # (the kernel's default size: the cap is then looser, nothing breaks)
        stdout_r, stdout_w = pipes[1]
        stderr_r, stderr_w = pipes[2] if not merge_stderr else (-1, stdout_w)
        popen: subprocess.Popen[bytes] | None = None
        pid = 0
        try:
            if server is None:
                popen = await off_loop(_spawn, before, list(argv), stdin_r, stdout_w, stderr_w, tuple(pass_fds))
            else:
                if before is not None:
                    await off_loop_quick(before)
                fds = {0: stdin_r, 1: stdout_w, 2: stderr_w, **{fd: fd for fd in pass_fds}}
                pid = await server.spawn(argv, fds, procs_files)
        except BaseException:
            for fd in (stdin_w, stdout_r, stderr_r):
                if fd >= 0:
                    _close_quietly(fd)
            raise
        finally:
            for fd in {stdin_r, stdout_w, stderr_w}:  # the child's ends: it has its own copies now
                _close_quietly(fd)
        child = cls(popen, pid, server)
        try:
            child.stdin = await write_pipe(stdin_w)
            stdin_w = -1
            child.stdout, transport = await read_pipe(stdout_r)
            child._transports.append(transport)
            stdout_r = -1
            if stderr_r >= 0:
                child.stderr, transport = await read_pipe(stderr_r)
                child._transports.append(transport)
                stderr_r = -1
            child._watch_exit()
        except BaseException:
            for fd in (stdin_w, stdout_r, stderr_r):
                if fd >= 0:
                    _close_quietly(fd)
            child.close()
            child.kill_group()
            if popen is not None:
                await off_loop(popen.wait)
            else:
                if child._pidfd < 0:
                    child._watch_exit()
                await asyncio.shield(child._exited)
            raise
        return child

    def _watch_exit(self) -> None:
        self._pidfd = os.pidfd_open(self.pid)
        asyncio.get_running_loop().add_reader(self._pidfd, self._on_exit)

    def hold_reap(self) -> None:
        """Leave the child unreaped until `allow_reap()`: while a zombie, its pid is its own.

        For work on another thread that names the child by pid (a write of it into a
        cgroup's process list): reaped meanwhile, the number could go to a host process,
        which that write would then move.
        """
        self._reap_holds += 1

    def allow_reap(self) -> None:
        self._reap_holds -= 1
        if self._reap_holds == 0 and self._pidfd >= 0 and not self.reaping:
            # Watched again: if it has exited meanwhile, its pidfd is still readable.
            asyncio.get_running_loop().add_reader(self._pidfd, self._on_exit)

    def _on_exit(self) -> None:
        """The pidfd is readable: the child has exited; reap it (never blocks now)."""
        if self._reap_holds:
            asyncio.get_running_loop().remove_reader(self._pidfd)  # (readable until reaped)
            return
        if self._server is not None:
            # The fork server's child: it reaps, when asked (one ask; the pidfd is not
            # watched meanwhile, as it stays readable until then).
            asyncio.get_running_loop().remove_reader(self._pidfd)
            if not self.reaping:
                self.reaping = True
                self._server.reap(self.pid).add_done_callback(self._reaped_by_server)
            return
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = self.pid, 0
        if pid == 0:
            return
        asyncio.get_running_loop().remove_reader(self._pidfd)
        self._reaped(status)

    def _reaped_by_server(self, reaped: asyncio.Future[int | None]) -> None:
        status = None if reaped.cancelled() else reaped.result()
        if status is None:
            # Not reaped by the server: it is gone, and the child with it (its parent-death
            # signal), reparented and reaped elsewhere. SIGKILL is what ended it.
            log.warning("child %d: its exit status went with the nsjail fork server", self.pid)
            status = signal.SIGKILL
        self._reaped(status)

    def _reaped(self, status: int) -> None:
        os.close(self._pidfd)
        self._pidfd = -1
        self.returncode = os.waitstatus_to_exitcode(status)
        if self.stdin is not None:
            self.stdin.close()  # nobody is left to read it
        if self._popen is not None:
            self._popen.returncode = self.returncode  # so Popen's finaliser does not reap again
        if not self._exited.done():
            self._exited.set_result(self.returncode)

    async def wait(self) -> int:
        return await asyncio.shield(self._exited)

    def on_exit(self, callback: Callable[[], None]) -> None:
        """Call `callback` (on the loop) once the child has exited and been reaped."""
        self._exited.add_done_callback(lambda _: callback())

    def close(self) -> None:
        """Close the pipes (after their readers are done with them)."""
        if self.stdin is not None:
            self.stdin.close()
        for transport in self._transports:
            transport.close()

    def kill_group(self) -> None:
        """SIGKILL the child's whole process group (it leads its own session)."""
        if self.returncode is None:
            kill_session(self.pid)


def _spawn(
    before: Callable[[], None] | None, argv: list[str], stdin: int, stdout: int, stderr: int, pass_fds: tuple[int, ...]
) -> subprocess.Popen[bytes]:
    if before is not None:
        before()
    return subprocess.Popen(
        argv, stdin=stdin, stdout=stdout, stderr=stderr, pass_fds=pass_fds, env={}, start_new_session=True
    )


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
