"""One nsjail process: launched ahead of time behind a gate, released on start, watched to exit.

Launch path (all argv, never a shell string built from user data):

    /bin/sh -c ENTER  <n> <cgroup.procs files...>  nsjail --config base.cfg <flags> -- /bin/sh -c GATE gate <program argv>

ENTER writes its own pid into the job's cgroups and execs nsjail, so the jail is born
inside them. When nsjail logs that the jail is executing, the worker moves nsjail itself
out, leaving only jailed processes in the job's cgroups. GATE, already inside the jail,
blocks on one line of stdin; `go()` writes it and the program replaces the gate. All the
costly work (namespaces, mounts, cgroups, uid maps) therefore happens while the job is
parked, and start costs one pipe write.

nsjail's log goes to a pipe only the worker holds (never mixed with the program's
stderr), and it is the source of the exit status and signal (defence R12).
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

from worker.cgroups import JobCgroup

__all__ = ["Jail", "JailError", "JailExit", "JailSpec"]

log = logging.getLogger(__name__)

GO_LINE = b"go\n"
_ENTER = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1" || exit 125; shift; n=$((n-1)); done; exec "$@"'
_GATE = 'read -r line || exit 0; [ "$line" = go ] || exit 0; unset PWD OLDPWD; exec "$@"'

_EXITED = re.compile(rb"exited with status: (\d+)")
_SIGNALLED = re.compile(rb"terminated with signal: (SIG[A-Z0-9]+) \((\d+)\)")
_TIME_LIMIT = re.compile(rb"run time >= time limit")


class JailError(Exception):
    """nsjail could not build the jail (a platform failure: the program never ran)."""


@dataclass(frozen=True)
class JailSpec:
    argv: list[str]
    env: dict[str, str]
    workspace: Path
    uid: int
    gid: int
    extra_mounts: list[str]
    backstop_s: int
    rlimit_cpu_s: int
    rlimit_fsize_mb: int
    rlimit_nofile: int
    seccomp_policy: Path | None = None


@dataclass
class JailExit:
    exit_code: int | None
    signal: str | None
    backstop_fired: bool
    errors: list[str] = field(default_factory=list)


def build_argv(nsjail: str, profile: Path, spec: JailSpec, log_fd: int, procs_files: list[str]) -> list[str]:
    flags = [
        "--config", str(profile),
        "--log_fd", str(log_fd),
        "--user", f"65534:{spec.uid}:1",
        "--group", f"65534:{spec.gid}:1",
        "--bindmount", f"{spec.workspace}:/workspace",
        "--time_limit", str(spec.backstop_s),
        "--rlimit_cpu", str(spec.rlimit_cpu_s),
        "--rlimit_fsize", str(spec.rlimit_fsize_mb),
        "--rlimit_nofile", str(spec.rlimit_nofile),
    ]  # fmt: skip
    if spec.seccomp_policy is not None:
        flags += ["--seccomp_policy", str(spec.seccomp_policy)]
    for mount in spec.extra_mounts:
        flags += ["--bindmount_ro", mount]
    for name, value in spec.env.items():
        flags += ["--env", f"{name}={value}"]
    return [
        "/bin/sh", "-c", _ENTER, "coderunner-enter", str(len(procs_files)), *procs_files,
        nsjail, *flags, "--", "/bin/sh", "-c", _GATE, "gate", *spec.argv,
    ]  # fmt: skip


class Jail:
    """A launched jail. Use `wait_ready()`, then `go()`, then read `stdout`/`stderr` and `wait()`."""

    def __init__(self, proc: asyncio.subprocess.Process, log_reader: asyncio.StreamReader, cgroup: JobCgroup) -> None:
        self.proc = proc
        self.stdout = proc.stdout
        self.stderr = proc.stderr
        self._cgroup = cgroup
        self._log_reader = log_reader
        self._ready = asyncio.Event()
        self._exit: JailExit | None = None
        self._log_lines: list[bytes] = []
        self._log_task = asyncio.create_task(self._read_log(), name=f"nsjail-log:{cgroup.job_id}")
        self.released = False

    @classmethod
    async def launch(cls, nsjail: str, profile: Path, spec: JailSpec, cgroup: JobCgroup) -> Jail:
        read_fd, write_fd = os.pipe()
        try:
            argv = build_argv(nsjail, profile, spec, write_fd, cgroup.procs_files())
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                pass_fds=(write_fd,),
                env={},
                start_new_session=True,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=1 << 20)
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(read_fd, "rb", 0))
        return cls(proc, reader, cgroup)

    async def _read_log(self) -> None:
        while True:
            line = await self._log_reader.readline()
            if not line:
                break
            self._log_lines.append(line)
            if not self._ready.is_set() and b"Executing " in line:
                # The jail exists (nsjail logs this from inside the child, just before exec):
                # take nsjail itself out of the job's cgroups so only jailed code is limited.
                self._cgroup.release_supervisor(self.proc.pid)
                self.released = True
                self._ready.set()
        self._ready.set()

    async def wait_ready(self, timeout_s: float) -> None:
        """Wait until the jail is built and parked at the gate.

        Raises:
            JailError: nsjail failed (with its own error lines) or took too long.
        """
        try:
            await asyncio.wait_for(self._ready.wait(), timeout_s)
        except TimeoutError:
            raise JailError(f"nsjail did not become ready within {timeout_s:.1f}s") from None
        if not self.released:
            await self._log_task
            raise JailError("nsjail failed to start the jail: " + "; ".join(self.error_lines()) or "no log")
        if not self._cgroup.pids():
            raise JailError("jail is not inside the job's cgroups")

    def error_lines(self) -> list[str]:
        return [
            line.decode(errors="replace").strip()
            for line in self._log_lines
            if line.startswith((b"[E]", b"[F]", b"[W]"))
        ]

    def go(self) -> None:
        """Release the gate: the program starts now."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(GO_LINE)

    async def wait(self) -> JailExit:
        if self._exit is None:
            await self.proc.wait()
            await self._log_task
            self._exit = self._parse_exit()
        return self._exit

    def _parse_exit(self) -> JailExit:
        exit_code: int | None = None
        sig: str | None = None
        backstop = False
        for line in self._log_lines:
            if _TIME_LIMIT.search(line):
                backstop = True
            match = _EXITED.search(line)
            if match:
                exit_code = int(match.group(1))
                continue
            match = _SIGNALLED.search(line)
            if match:
                sig = match.group(1).decode()
        if exit_code is None and sig is None:
            return JailExit(None, None, backstop, self.error_lines() or [f"nsjail exited with {self.proc.returncode}"])
        return JailExit(exit_code, sig, backstop)

    def terminate_supervisor(self) -> None:
        """Last resort: SIGKILL nsjail itself (the jail dies with its pid namespace)."""
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
