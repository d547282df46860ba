"""One nsjail process: launched ahead of time behind a gate, released on start, watched to exit.

Launch path (all argv, never a shell string built from user data):

    nsjail --config base.cfg <flags> -- /.coderunner/gate     forked by nsjail's fork server
    enter <worker pid> <n> <cgroup.procs files...>  nsjail ...  without one (exec'd)

The fork server's child (worker/isolation/forkserver.c), or else `enter`
(worker/isolation/enter.c), asks to be killed with the worker (through the server, for a
fork), writes its own pid into the sandbox's cgroups and runs nsjail, so the jail is born
inside them and dies with the worker even if the worker is SIGKILLed. The gate (worker/isolation/gate.c) says
"ready" on its status socket as it starts, inside the finished jail; the worker then moves
nsjail itself out, leaving only jailed processes in those cgroups. The gate blocks on stdin
until `go()` sends it the program's argv, environment and rlimits as one binary frame; it
then execs the program in its place. All the costly work (namespaces, mounts, cgroups, uid
maps) therefore happens before a job even exists, and start costs one pipe write.

The gate stays pid 1 and reports the program's wait status on that status socket, which the
program cannot reach, then waits there, idle, until `let_go()` (or the worker's death): the
jail's teardown comes as the job's result is written, not while the worker reads the job's
figures and builds that result and waits for the CPU the teardown takes. nsjail runs quiet
(warnings and errors only: its info lines, some 45
a jail, one per mount, woke the worker a dozen times a job) and logs to another pipe
only the worker holds, never mixed with the program's stderr; without a report from the
gate, nsjail's own exit status says how the gate ended. Exit status and signal come from
those channels only (defence R12).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from worker.isolation.cgroups import JobCgroup
from worker.isolation.child import Child, PipeReader
from worker.isolation.forkserver import ForkServer
from worker.isolation.offload import off_loop_soon

__all__ = ["BACKSTOP_MARGIN_S", "Jail", "JailError", "JailExit", "JailSpec"]

log = logging.getLogger(__name__)

GATE_IN_JAIL = "/.coderunner/gate"

# The gate's first line on the status socket: it runs, inside the finished jail.
_GATE_READY = b"ready\n"
# What nsjail exits with when it fails itself (the gate never exits so without a report).
_NSJAIL_FAILED = 255
# The signals the gate can die of: it is its pid namespace's init with no handlers, so from
# outside only SIGKILL reaches it, and the kernel forces the rest (seccomp, faults).
_GATE_DEATHS = frozenset({signal.SIGKILL, signal.SIGSYS, signal.SIGSEGV, signal.SIGBUS, signal.SIGILL, signal.SIGFPE})
# How far short of nsjail's time limit a jail killed by SIGKILL may fall and still count as
# the backstop: nsjail counts whole seconds of wall time from its own start.
BACKSTOP_MARGIN_S = 30.0
_LOG_READ = 65536


class JailError(Exception):
    """nsjail could not build the jail (a platform failure: the program never ran)."""


def cpu_backstop_room_s(cpu_s: float) -> int:
    """Whole seconds to move a program's CPU rlimit backstop past `cpu_s` of CPU its clock
    does not count (a runtime's start-up), while at least half of the last second is left:
    a few tens of ms change nothing, a start-up of over a second gets its seconds back."""
    return max(0, math.ceil(cpu_s - 0.5))


@dataclass(frozen=True)
class Program:
    """What the gate execs: argv, extra environment, and rlimits (0 = keep the jail's)."""

    argv: list[str]
    env: dict[str, str]
    rlimit_cpu_s: int = 0
    rlimit_fsize_bytes: int = 0
    rlimit_nofile: int = 0
    # False: never run in a prestarted runtime (the job's code names the shim's own class).
    adoptable: bool = True

    def frame(self) -> bytes:
        out = [b"CRG1", struct.pack("<I", len(self.argv))]
        for arg in self.argv:
            data = arg.encode("utf-8", "surrogateescape")
            out += [struct.pack("<I", len(data)), data]
        env = [f"{k}={v}".encode() for k, v in self.env.items()]
        out.append(struct.pack("<I", len(env)))
        for item in env:
            out += [struct.pack("<I", len(item)), item]
        out.append(struct.pack("<QQQ", self.rlimit_cpu_s, self.rlimit_fsize_bytes, self.rlimit_nofile))
        return b"".join(out)


@dataclass(frozen=True)
class JailSpec:
    gate: Path
    enter: Path
    workspace: Path
    uid: int
    gid: int
    extra_mounts: list[str]
    backstop_s: int
    rlimit_cpu_s: int
    rlimit_fsize_mb: int
    rlimit_nofile: int


@dataclass
class JailExit:
    exit_code: int | None
    signal: str | None
    backstop_fired: bool
    errors: list[str] = field(default_factory=list)
    # False when the jail failed before it could exec the program (the gate's own failures,
    # a jail that ended before its go): the program never ran, whatever the job did.
    program_ran: bool = True


def build_argv(
    nsjail: str, profile: Path, spec: JailSpec, log_fd: int, status_fd: int, procs_files: list[str], enter: bool = True
) -> list[str]:
    """nsjail's argv behind `enter`'s; without `enter`, nsjail's alone (for the fork server,
    which joins the cgroups itself)."""
    flags = [
        "--config", str(profile),
        "--quiet",
        "--log_fd", str(log_fd),
        "--pass_fd", str(status_fd),
        "--user", f"65534:{spec.uid}:1",
        "--group", f"65534:{spec.gid}:1",
        "--bindmount", f"{spec.workspace}:/workspace",
        "--bindmount_ro", f"{spec.gate}:{GATE_IN_JAIL}",
        "--time_limit", str(spec.backstop_s),
        "--rlimit_cpu", str(spec.rlimit_cpu_s),
        "--rlimit_fsize", str(spec.rlimit_fsize_mb),
        "--rlimit_nofile", str(spec.rlimit_nofile),
    ]  # fmt: skip
    for mount in spec.extra_mounts:
        flags += ["--bindmount_ro", mount]
    argv = [nsjail, *flags, "--", GATE_IN_JAIL, str(status_fd)]
    if not enter:
        return argv
    return [str(spec.enter), str(os.getpid()), str(len(procs_files)), *procs_files, *argv]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"SIG{number}"


class Jail:
    """A launched jail. Use `wait_ready()`, then `go()`, then read `stdout`/`stderr` and `wait()`."""

    def __init__(
        self,
        proc: Child,
        log_fd: int,
        status_fd: int,
        cgroup: JobCgroup,
        backstop_s: float = math.inf,
        launched_at: float | None = None,
    ) -> None:
        self.proc = proc
        # nsjail's own time limit, counted from its start (see _backstop_fired).
        self._backstop_s = backstop_s
        self._launched_at = time.monotonic() if launched_at is None else launched_at
        self._status_fd = status_fd
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self._cgroup = cgroup
        self._ready = asyncio.Event()
        self._exit: JailExit | None = None
        # nsjail's log (warnings and errors), read as it comes by a plain reader callback.
        self._log_fd = log_fd
        self._log = bytearray()
        self._log_ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._releasing = False
        asyncio.get_running_loop().add_reader(log_fd, self._on_log)
        self.released = False
        self._release_error: OSError | None = None
        self._status = b""  # the gate's report, once read
        self._pids_at_release: list[int] = []
        # Set once the program's end is known: the gate's report came, or nsjail exited.
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._reported: JailExit | None = None
        self._gate_started = False
        self._let_go = False
        self._exit_wanted = False  # (someone waits for nsjail's exit: see wait)
        # Watched from the start: the gate's "ready" comes first, its report at the end.
        asyncio.get_running_loop().add_reader(status_fd, self._on_status)
        proc.on_exit(self._mark_ended)

    @classmethod
    async def launch(
        cls,
        nsjail: str,
        profile: Path,
        spec: JailSpec,
        cgroup: JobCgroup,
        merge_stderr: bool = False,
        before: Callable[[], None] | None = None,
        forkserver: ForkServer | None = None,
    ) -> Jail:
        """Start nsjail; with `merge_stderr` the program's stderr shares stdout's pipe (compilers).
        `before` (e.g. making the cgroups) runs just before the spawn, on the isolation threads.
        With a `forkserver`, nsjail is a fork of it rather than an exec behind `enter`."""
        launched_at = time.monotonic()  # (before nsjail can start its time limit's count)
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)  # (our end only: nsjail writes its log blocking)
        # A socket, not a pipe: the gate waits on its end for ours to be shut (let_go).
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ours.setblocking(False)
        theirs.setblocking(True)  # (the gate's: it blocks there for its let-go)
        status_read, status_write = ours.detach(), theirs.detach()
        try:
            procs = cgroup.procs_files()
            argv = build_argv(nsjail, profile, spec, write_fd, status_write, procs, enter=forkserver is None)
            proc = await Child.spawn(
                argv,
                merge_stderr=merge_stderr,
                pass_fds=(write_fd, status_write),
                before=before,
                server=forkserver,
                procs_files=procs,
            )
        except BaseException:
            os.close(read_fd)
            os.close(status_read)
            raise
        finally:
            os.close(write_fd)
            os.close(status_write)
        return cls(proc, read_fd, status_read, cgroup, spec.backstop_s, launched_at)

    def _on_log(self) -> None:
        """nsjail's log pipe is readable: keep what came; at EOF, nsjail has exited."""
        try:
            chunk = os.read(self._log_fd, _LOG_READ)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            if not self._gate_started and self._status_fd >= 0:
                self._on_status()  # a "ready" the gate wrote before nsjail exited counts first
            self._close_log()
            return
        self._log += chunk

    def _gate_runs(self) -> None:
        """The gate said it runs: the jail exists, with the gate in the job's cgroups. Take
        nsjail itself out of them so only jailed code is limited, and see (same trip to the
        isolation threads) that the jail stayed in them."""
        self._gate_started = True
        if self._releasing or self.proc.returncode is not None or self.proc.reaping:
            return  # (reaped already, or being reaped: its pid may be another's now)
        self._releasing = True
        self.proc.hold_reap()  # (the release names nsjail by its pid)
        off_loop_soon(self._release, quick=True).add_done_callback(self._released)

    def _release(self) -> list[int]:
        self._cgroup.release_supervisor(self.proc.pid)
        return self._cgroup.listed()

    def _released(self, done: asyncio.Future[list[int]]) -> None:
        self.proc.allow_reap()
        if done.cancelled():  # (the loop is closing)
            self._ready.set()
            return
        error = done.exception()
        if error is None:
            self._pids_at_release = done.result()
            self.released = True
        elif isinstance(error, OSError):
            self._release_error = error
        else:
            self._release_error = OSError(f"{type(error).__name__}: {error}")
        self._ready.set()

    def _close_log(self) -> None:
        """At the log's EOF (nsjail has exited), or when the jail is closed."""
        if self._log_fd >= 0:
            asyncio.get_running_loop().remove_reader(self._log_fd)
            os.close(self._log_fd)
            self._log_fd = -1
        if not self._log_ended.done():
            self._log_ended.set_result(None)
        if not self._releasing:
            self._ready.set()  # the jail never executed: wait_ready() says why

    @property
    def _log_lines(self) -> list[bytes]:
        """The log's lines, split out when asked (on the rare paths that look: a failed
        jail, an end the gate did not report)."""
        return [line for line in bytes(self._log).split(b"\n") if line]

    @property
    def exited(self) -> bool:
        """Whether the jail has been seen to end (`wait()` returned)."""
        return self._exit is not None

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until the jail is built and parked at the gate.

        Raises:
            JailError: nsjail failed (with its own error lines) or took too long.
        """
        try:
            if not self._ready.is_set():
                async with asyncio.timeout(timeout_s):  # (wait_for would make a task of the wait)
                    await self._ready.wait()
        except TimeoutError:
            raise JailError(f"nsjail did not become ready within {timeout_s:.1f}s") from None
        if self._release_error is not None:
            raise JailError(f"nsjail could not be moved out of the job's cgroups: {self._release_error}")
        if not self.released:
            await asyncio.shield(self._log_ended)
            raise JailError("nsjail failed to start the jail: " + ("; ".join(self.error_lines()) or "no log"))
        if not self._pids_at_release:
            raise JailError("jail is not inside the job's cgroups")

    def error_lines(self) -> list[str]:
        return [
            line.decode(errors="replace").strip()
            for line in self._log_lines
            if line.startswith((b"[E]", b"[F]", b"[W]"))
        ]

    def go(self, program: Program) -> bool:
        """Release the gate: the program starts now. False when the jail has ended already
        (its gate gone: nothing was started)."""
        stdin = self.proc.stdin
        if self.ended.done() or self.proc.returncode is not None or stdin is None or stdin.is_closing():
            return False
        try:
            stdin.write(program.frame())
        except (RuntimeError, OSError):  # (uvloop: the pipe closed as nsjail exited)
            return False
        return True

    def _mark_ended(self) -> None:
        if not self.ended.done():
            self.ended.set_result(None)

    def _on_status(self) -> None:
        """The status socket is readable: keep what came. Its first line is the gate's
        "ready"; a whole line after it is the gate's report.

        The gate writes the report once the program and everything it left are dead
        (gate.c); the jail's teardown waits for `let_go()`.
        """
        try:
            chunk = os.read(self._status_fd, 256)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""  # (a reset socket: its writers are gone, as at EOF)
        self._status += chunk
        if not self._gate_started and self._status.startswith(_GATE_READY):
            self._status = self._status[len(_GATE_READY) :]
            self._gate_runs()
        if chunk and not self._status.endswith(b"\n"):
            return  # no report yet, or not a whole one
        asyncio.get_running_loop().remove_reader(self._status_fd)
        if chunk:
            self._reported = self._parse_report(self._status)
        if self._reported is not None:
            if self._exit_wanted:
                self.let_go()
            self._mark_ended()  # else nsjail's exit tells (at EOF, it has exited already)

    @property
    def reported(self) -> bool:
        """Whether the gate has reported the program's end (nothing of the job runs now)."""
        return self._reported is not None

    async def wait_program(self) -> JailExit:
        """How the program ended, as soon as that is known: at the gate's report, when the
        job's processes are all gone and their output is in the pipes (see `end_output`), or
        else once nsjail has exited. `wait()` still waits for nsjail itself."""
        await asyncio.shield(self.ended)
        if self._reported is not None and self._exit is None:
            return self._reported
        return await self.wait()

    def end_output(self) -> None:
        """After the gate's report: read what the program's pipes still hold and end them
        there. nsjail keeps their write ends until it exits, so no EOF would come sooner."""
        for reader in (self.stdout, self.stderr):
            if isinstance(reader, PipeReader):
                reader.take_rest()

    def let_go(self) -> None:
        """Let a gate that reported end (it waits for this: gate.c, linger), and nsjail with
        it: as the job's result is written (its figures are read), and by `wait()`."""
        if self._status_fd < 0 or self._let_go:
            return
        self._let_go = True
        try:
            status = socket.socket(fileno=self._status_fd)
        except OSError:
            return  # (a pipe: its gate cannot wait for this)
        try:
            # A shutdown, not a close: the report may still be read, and a copy of this
            # descriptor a fork holds for a moment (an exec'd launch) cannot keep it open.
            status.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # (the gate is gone already)
        finally:
            status.detach()

    async def wait(self) -> JailExit:
        if self._exit is None:
            # A gate that reports waits for let_go: now, or as its report comes.
            self._exit_wanted = True
            if self._reported is not None:
                self.let_go()
            await self.proc.wait()
            try:
                await asyncio.shield(self._log_ended)  # the last of the log: nsjail has exited
            finally:
                self._read_status()  # kept in _status, even if this wait is cancelled here
            self._exit = self._parse_exit(self._status)
        return self._exit

    def close(self) -> None:
        """Close every pipe to the jail (once its output has been read, or is not wanted, and
        after `wait()`, which reads the status socket, if it is to be called at all)."""
        self.proc.close()
        self._close_log()
        if self._status_fd >= 0:
            asyncio.get_running_loop().remove_reader(self._status_fd)
            os.close(self._status_fd)
            self._status_fd = -1

    def _read_status(self) -> None:
        """Read the rest of the gate's report into `_status` (once); every writer is gone
        once nsjail has exited, so this never blocks."""
        if self._status_fd < 0:
            return
        chunks = [self._status]
        try:
            asyncio.get_running_loop().remove_reader(self._status_fd)
            while chunk := os.read(self._status_fd, 256):
                chunks.append(chunk)
        except BlockingIOError:
            pass
        finally:
            os.close(self._status_fd)
            self._status_fd = -1
            self._status = b"".join(chunks)

    @staticmethod
    def _parse_report(status: bytes) -> JailExit | None:
        """The gate's report, or None when there is none (or it is not one). The gate's
        program ended on its own: nsjail's time limit cannot have fired (it kills the gate
        too, which then reports nothing)."""
        kind, _, value = status.removeprefix(_GATE_READY).strip().partition(b" ")
        if kind == b"exit" and value.isdigit():
            return JailExit(int(value), None, False)
        if kind == b"signal" and value.isdigit():
            return JailExit(None, _signal_name(int(value)), False)
        if kind == b"fault":
            # The gate could not set the jail up (its seccomp filter) and ran nothing.
            return JailExit(None, None, False, [f"the jail's gate failed: {value.decode(errors='replace')}"], program_ran=False)
        return None

    def _parse_exit(self, status: bytes) -> JailExit:
        reported = self._parse_report(status)
        if reported is not None:
            return reported
        # No report: the gate itself was killed (a clock fired, the memory limit, a kill
        # request, nsjail's time limit) or never ran the program. nsjail, in its one-jail
        # mode, exits as the gate did: its exit status, or 128 plus the signal that ended it.
        code = self.proc.returncode
        if not self._gate_started:
            return JailExit(None, None, False, self.error_lines() or [f"nsjail exited with {code}"], program_ran=False)
        if code is None or code < 0 or code == _NSJAIL_FAILED:
            return JailExit(None, None, False, self.error_lines() or [f"nsjail exited with {code}"])
        if code > 128 and code - 128 in _GATE_DEATHS:
            return JailExit(None, _signal_name(code - 128), self._backstop_fired(code - 128))
        if code > 128:
            # nsjail itself was stopped (an operator's or a service manager's signal): it
            # killed the jail on its way out, whatever the program was doing.
            return JailExit(None, None, False, [f"nsjail was stopped by {_signal_name(code - 128)}"])
        # The gate exits without a report only when it could not start the program (its
        # limits, the frame, a fork that failed): the program never ran.
        return JailExit(
            None, None, False, self.error_lines() or [f"the jail's gate exited with {code} before the program ran"], program_ran=False
        )

    def backstop_left_s(self) -> float:
        """Seconds until nsjail's own time limit ends the jail (infinite without one)."""
        if not self._backstop_s:
            return math.inf
        return self._launched_at + self._backstop_s - time.monotonic()

    def _backstop_fired(self, signal_number: int) -> bool:
        """Whether nsjail's own time limit ended the jail: it kills with SIGKILL once the
        jail has run that long by its wall clock, in whole seconds (its quiet log no longer
        says so). No clock of ours lets a jail live within a minute of it (see
        SandboxFactory), so the age may fall short of the limit by a margin and still say so."""
        margin = min(BACKSTOP_MARGIN_S, self._backstop_s / 2)
        return signal_number == signal.SIGKILL and time.monotonic() - self._launched_at >= self._backstop_s - margin

    def terminate_supervisor(self) -> None:
        """Last resort: SIGKILL nsjail itself (the jail dies with its pid namespace)."""
        self.proc.kill_group()
