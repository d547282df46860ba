"""Slot sandboxes: a jail parked at its gate in a fresh workspace and fresh cgroups.

Each sandbox slot keeps one ready before any job arrives (a warm pool of one per slot), so
a claimed job only has its files written and its limits set, and `start` is a pipe
write. A sandbox serves exactly one job and is destroyed with it; the slot then prepares
the next one. Names are `<workerId>.<slot>.<n>`, so the janitor of any worker on the
host can tell whose leftovers it finds.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from shared.limits import Limits
from worker.isolation.cgroups import CgroupLayout, JobCgroup
from worker.isolation.jail import Jail, JailSpec, Program
from worker.isolation.mounts import MS_NODEV, MS_NOSUID, mount
from worker.isolation.offload import off_loop
from worker.isolation.workspace import Workspace

__all__ = ["GateBuildError", "Sandbox", "SandboxFactory", "build_gate", "owner_of"]

log = logging.getLogger(__name__)

GATE_SOURCE = Path(__file__).with_name("gate.c")
# A sandbox left idle this long is replaced before use (it also bounds nsjail's backstop).
MAX_IDLE_S = 1200.0


class GateBuildError(Exception):
    """The jail gate could not be compiled (no C compiler?)."""


def owner_of(name: str) -> str | None:
    """The worker id inside a sandbox name `<workerId>.<slot>.<n>`, or None for other names."""
    parts = name.rsplit(".", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[0]


async def build_gate(work_root: Path) -> Path:
    """Compile worker/gate.c once per source version; returns the path jails bind it from.

    The binary is copied into a small tmpfs of its own (`<work root>/.gate`), so the bind
    a jail's /proc/self/mountinfo shows is `/gate-<hash>` of that tmpfs, not a host path.
    """
    built = await _compile_gate(work_root)
    return _stage_gate(built, work_root / ".gate")


def _stage_gate(built: Path, folder: Path) -> Path:
    staged = folder / built.name.lstrip(".")
    if staged.is_file() and os.access(staged, os.X_OK):
        return staged
    folder.mkdir(mode=0o755, exist_ok=True)
    if not os.path.ismount(folder):
        mount("coderunner-gate", str(folder), "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=16,mode=755")
    tmp = folder / f".tmp{os.getpid()}"
    shutil.copyfile(built, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, staged)
    return staged


async def _compile_gate(work_root: Path) -> Path:
    """Compile worker/gate.c once per source version; returns the binary's path."""
    source = GATE_SOURCE.read_bytes()
    dest = work_root / f".gate-{hashlib.sha256(source).hexdigest()[:16]}"
    if dest.is_file() and os.access(dest, os.X_OK):
        return dest
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise GateBuildError("a C compiler (cc) is needed once at start-up to build the jail gate (apt install gcc)")
    tmp = dest.with_suffix(f".tmp{os.getpid()}")
    for static in (["-static"], []):  # static needs libc.a; the dynamic build works too (the jail has /lib)
        proc = await asyncio.create_subprocess_exec(
            compiler, "-O2", *static, "-o", str(tmp), str(GATE_SOURCE),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        )  # fmt: skip
        out, _ = await proc.communicate()
        if proc.returncode == 0:
            os.chmod(tmp, 0o755)
            os.replace(tmp, dest)
            return dest
    raise GateBuildError(f"building the jail gate failed: {out.decode(errors='replace')[-400:]}")


@dataclass
class Sandbox:
    name: str
    slot: int
    uid: int
    workspace: Workspace
    cgroup: JobCgroup
    jail: Jail
    created_at: float = field(default_factory=time.monotonic)
    # Compiled languages get a second jail over the same workspace, with its own cgroup
    # and limits, built while the job is parked.
    compile_cgroup: JobCgroup | None = None
    compile_jail: Jail | None = None

    @property
    def idle_s(self) -> float:
        return time.monotonic() - self.created_at

    async def load(self, files: list[tuple[str, bytes]], limits: Limits) -> None:
        """Write the job's files and set its memory and process limits (before start)."""
        await off_loop(self._load, files, limits)

    def _load(self, files: list[tuple[str, bytes]], limits: Limits) -> None:
        self.workspace.stage(files)
        # +1 pid: nsjail's clone of the gate is counted once before the program replaces it.
        self.cgroup.set_limits(memory_bytes=limits.memory_mb * 1024 * 1024, pids=limits.pids + 1)

    def start(self, program: Program) -> None:
        self.jail.go(program)

    async def destroy(self, exit_grace_s: float = 5.0) -> None:
        """Kill every process of the sandbox and remove its cgroups and workspace."""
        pairs = [(self.cgroup, self.jail)]
        if self.compile_cgroup is not None and self.compile_jail is not None:
            pairs.append((self.compile_cgroup, self.compile_jail))
        try:
            for cgroup, jail in pairs:
                try:
                    await off_loop(cgroup.kill)
                    try:
                        await asyncio.wait_for(jail.wait(), exit_grace_s)
                    except TimeoutError:
                        log.error("sandbox %s: nsjail did not exit after the kill; killing it", self.name)
                        jail.terminate_supervisor()
                        await jail.wait()
                except Exception:
                    log.exception("sandbox %s: waiting for nsjail failed", self.name)
                    jail.terminate_supervisor()
                finally:
                    jail.close()
                    await cgroup.remove()
        finally:
            await off_loop(self.workspace.destroy)


@dataclass
class SandboxFactory:
    """Everything needed to build sandboxes on this host."""

    nsjail: str
    profiles_dir: Path
    work_root: Path
    gate: Path
    cgroups: CgroupLayout
    uid_base: int
    max_limits: Limits
    extra_mounts: list[str] = field(default_factory=list)
    workspace_bytes: int = 64 * 1024 * 1024
    workspace_inodes: int = 4096
    rlimit_fsize_mb: int = 16
    rlimit_nofile: int = 64
    ready_timeout_s: float = 10.0
    _counter: int = 0

    def profile(self, name: str = "base") -> Path:
        return self.profiles_dir / f"{name}.cfg"

    def program_rlimits(self, limits: Limits, compiler: bool = False) -> dict[str, int]:
        """The rlimits the gate applies to a step's program.

        Compilers may write up to the whole workspace (object files) and open more files.
        """
        return {
            # Per-process CPU backstop above the step-level CPU clock the worker enforces.
            "rlimit_cpu_s": math.ceil(limits.cpu_ms / 1000) + 1,
            "rlimit_fsize_bytes": self.workspace_bytes if compiler else self.rlimit_fsize_mb * 1024 * 1024,
            "rlimit_nofile": 256 if compiler else self.rlimit_nofile,
        }

    def _name(self, owner: str, slot: int) -> str:
        self._counter += 1
        return f"{owner}.{slot}.{self._counter}"

    async def _launch(
        self, name: str, uid: int, workspace: Workspace, limits: Limits, merge_stderr: bool
    ) -> tuple[JobCgroup, Jail]:
        """Cgroup plus a jail parked at the gate, over an existing workspace."""
        cgroup = self.cgroups.job(name)
        jail: Jail | None = None
        try:
            await off_loop(self._make_cgroup, cgroup, limits)
            spec = JailSpec(
                gate=self.gate,
                workspace=workspace.path,
                uid=uid,
                gid=uid,
                extra_mounts=self.extra_mounts,
                # nsjail's own clock is only a backstop behind the worker's clocks: it covers the
                # longest a sandbox may wait for a job, then for a start, then run.
                backstop_s=int(MAX_IDLE_S + 120 + limits.wall_time_ms / 1000 + 60),
                rlimit_cpu_s=math.ceil(limits.cpu_ms / 1000) + 1,
                rlimit_fsize_mb=max(self.rlimit_fsize_mb, self.workspace_bytes >> 20),
                rlimit_nofile=max(self.rlimit_nofile, 256),
            )
            jail = await Jail.launch(self.nsjail, self.profile(), spec, cgroup, merge_stderr=merge_stderr)
            await jail.wait_ready(self.ready_timeout_s)
        except BaseException:
            await off_loop(cgroup.kill)
            try:
                if jail is not None:
                    jail.terminate_supervisor()
                    await asyncio.shield(jail.wait())
                    jail.close()
            except Exception:
                log.exception("sandbox %s: nsjail failed while being torn down", name)
            finally:
                await asyncio.shield(cgroup.remove())
            raise
        return cgroup, jail

    @staticmethod
    def _make_cgroup(cgroup: JobCgroup, limits: Limits) -> None:
        cgroup.create()
        cgroup.set_limits(memory_bytes=limits.memory_mb * 1024 * 1024, pids=limits.pids + 1)

    async def prepare(self, owner: str, slot: int) -> Sandbox:
        """Build a fresh sandbox for `slot` and wait until its jail sits at the gate."""
        name = self._name(owner, slot)
        uid = self.uid_base + slot
        workspace = Workspace(self.work_root, name, uid, uid)
        try:
            await off_loop(workspace.create, self.workspace_bytes, self.workspace_inodes)
            cgroup, jail = await self._launch(name, uid, workspace, self.max_limits, merge_stderr=False)
        except BaseException:
            await off_loop(workspace.destroy)
            raise
        return Sandbox(name=name, slot=slot, uid=uid, workspace=workspace, cgroup=cgroup, jail=jail)

    async def add_compile_jail(self, sandbox: Sandbox, owner: str, limits: Limits) -> None:
        """Give `sandbox` a compile jail (its own cgroup and limits)."""
        name = self._name(owner, sandbox.slot)
        cgroup, jail = await self._launch(name, sandbox.uid, sandbox.workspace, limits, merge_stderr=False)
        sandbox.compile_cgroup, sandbox.compile_jail = cgroup, jail
