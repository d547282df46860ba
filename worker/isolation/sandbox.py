"""Slot sandboxes: a jail parked at its gate in a fresh workspace and fresh cgroups.

Each sandbox slot keeps one ready before any job arrives (a warm pool of one per slot), so
a claimed job only has its files written and its limits set, and `start` is a pipe
write. A sandbox serves exactly one job and is destroyed with it; the slot then prepares
the next one. Names are `<workerId>.<slot>.<n>`, so the janitor of any worker on the
host can tell whose leftovers it finds.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import logging
import math
import os
import resource
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from shared.limits import Limits
from shared.manifest import PRESTART_DIR_IN_JAIL, CompilerArchive, PrestartCache, expand_argv, prestart_argv_for
from worker.isolation.buildcache import NO_CACHE, BuildCache
from worker.isolation.cgroups import CgroupLayout, JobCgroup
from worker.isolation.forkserver import ForkServer
from worker.isolation.jail import Jail, JailError, JailSpec, Program, cpu_backstop_room_s
from worker.isolation.memory import UNBOUNDED_BYTES, MemoryAdmission
from worker.isolation.mounts import MS_NODEV, MS_NOSUID, MS_REMOUNT, mount
from worker.isolation.offload import off_loop, off_loop_quick, off_loop_stoppable
from worker.isolation.uids import UidLease
from worker.isolation.workspace import Packed, Unpacking, Workspace, WorkspaceError

__all__ = [
    "GateBuildError",
    "Prime",
    "RuntimeFailed",
    "Sandbox",
    "SandboxFactory",
    "ShimBuilds",
    "ShimCompiler",
    "StartupCost",
    "StartupCosts",
    "Uncharged",
    "build_compiled_shims",
    "build_enter",
    "build_gate",
    "build_prestart_caches",
    "owner_of",
    "stage_prestart_shims",
]

log = logging.getLogger(__name__)

GATE_SOURCE = Path(__file__).with_name("gate.c")
ENTER_SOURCE = Path(__file__).with_name("enter.c")
BARE_HEADER = Path(__file__).with_name("bare.h")
# A sandbox left idle this long is replaced before use (it also bounds nsjail's backstop).
MAX_IDLE_S = 1200.0
# CPU a prestarted runtime may spend starting, on top of the largest CPU limit (a JVM in
# source-file mode, compiling its shim, took over a second here; more on a slow host).
PRESTART_CPU_ROOM_MS = 10_000
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class GateBuildError(Exception):
    """The jail gate or the cgroup entry helper could not be compiled (no C compiler?)."""


class RuntimeFailed(JailError):
    """A warm jail was built, but the runtime it prestarts did not come up in it."""


def owner_of(name: str) -> str | None:
    """The worker id inside a sandbox name `<workerId>.<slot>.<n>`, or None for other names.
    A copier's cgroup (`<sandbox>.copy`, JobCgroup.copier_folder) is its sandbox's worker's:
    one left by a worker that died mid-copy is swept with the rest of what it left."""
    parts = name.removesuffix(".copy").rsplit(".", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        return None
    return parts[0]


async def build_gate(work_root: Path, cache: BuildCache = NO_CACHE) -> Path:
    """Compile worker/gate.c once per source version; returns the path jails bind it from.

    The binary is copied into a small tmpfs of its own (`<work root>/.gate`), so the bind
    a jail's /proc/self/mountinfo shows is `/gate-<hash>` of that tmpfs, not a host path.
    """
    built = await _compile(GATE_SOURCE, work_root, "gate", cache)
    return _stage_gate(built, work_root / ".gate")


async def build_enter(work_root: Path, cache: BuildCache = NO_CACHE) -> Path:
    """Compile worker/isolation/enter.c once per source version; it runs on the host only."""
    return await _compile(ENTER_SOURCE, work_root, "enter", cache)


_GATE_TMPFS = "size=4m,nr_inodes=256,mode=755"


def _stage_gate(built: Path, folder: Path) -> Path:
    return _stage_file(built, folder, built.name.lstrip("."), 0o755)


def _stage_file(source: Path, folder: Path, name: str, mode: int) -> Path:
    """Copy `source` into the gate tmpfs as `name` (once: names carry a content hash)."""
    staged = folder / name
    if staged.is_file():
        return staged
    folder.mkdir(mode=0o755, exist_ok=True)
    if not os.path.ismount(folder):
        mount("coderunner-gate", str(folder), "tmpfs", MS_NOSUID | MS_NODEV, _GATE_TMPFS)
    else:
        # Older workers mounted it smaller; raising the caps in place keeps what is there.
        mount("coderunner-gate", str(folder), None, MS_REMOUNT | MS_NOSUID | MS_NODEV, _GATE_TMPFS)
    tmp = folder / f".tmp{os.getpid()}"
    shutil.copyfile(source, tmp)
    os.chmod(tmp, mode)
    os.replace(tmp, staged)
    return staged


def stage_prestart_shims(profiles_dir: Path, work_root: Path) -> dict[str, Path]:
    """Stage every shim of `sandbox-profiles/prestart/` into the gate tmpfs; name -> path.

    A primed jail binds its one shim read-only from there, so its mount table shows a
    tmpfs path, not where the worker is installed.
    """
    staged: dict[str, Path] = {}
    for shim in sorted((profiles_dir / "prestart").glob("*")):
        if shim.is_file():
            digest = hashlib.sha256(shim.read_bytes()).hexdigest()[:16]
            staged[shim.name] = _stage_file(shim, work_root / ".gate", f"prestart-{digest}-{shim.name}", 0o644)
    return staged


async def build_prestart_caches(
    profiles_dir: Path,
    work_root: Path,
    caches: dict[str, tuple[PrestartCache, str]],
    timeout_s: float = 60.0,
    cache: BuildCache = NO_CACHE,
) -> dict[str, tuple[str, Path]]:
    """Make each shim's PrestartCache (shim -> (the cache, the toolchain's version)) on the
    host, staged into the gate tmpfs; shim -> (its file name in the jail, the staged path).

    Named by a digest of the shim, the command and the version, so a toolchain upgraded
    between two starts gets a fresh file (CPython refuses bytecode of another version: the
    runtime would then fail to start, and its slots build plain). A shim whose cache cannot
    be made is left out, logged: its warm jails start on the source.
    """
    gate_dir = work_root / ".gate"
    made: dict[str, tuple[str, Path]] = {}
    for shim, (wanted, version) in sorted(caches.items()):
        source = profiles_dir / "prestart" / shim
        if not source.is_file():
            continue
        argv = wanted.argv(shim, f"{PRESTART_DIR_IN_JAIL}/{shim}")
        key = hashlib.sha256(b"\0".join([source.read_bytes(), *(a.encode() for a in argv), version.encode()]))
        prefix = f"prestart-cache-{key.hexdigest()[:16]}-"
        staged = gate_dir / (prefix + wanted.file)
        if not staged.is_file() and not await off_loop(_fetch_staged, cache, [staged.name], gate_dir, work_root):
            built = await _compile_shim(source, argv, work_root, timeout_s, gate_dir, prefix)
            if staged in built:
                await off_loop(_keep_staged, cache, [staged])
        if staged.is_file():
            made[shim] = (wanted.file, staged)
    return made


def _fetch_staged(cache: BuildCache, names: list[str], gate_dir: Path, work_root: Path) -> bool:
    """Stage the cached files `names` into the gate tmpfs, all of them or none (False)."""
    fetched: list[Path] = []
    try:
        for name in names:
            path = work_root / f".fetched-{name}"
            if not cache.fetch(name, path, 0o644):
                return False
            fetched.append(path)
        for path, name in zip(fetched, names, strict=True):
            _stage_file(path, gate_dir, name, 0o644)
        return True
    finally:
        for path in fetched:
            path.unlink(missing_ok=True)


def _keep_staged(cache: BuildCache, staged: list[Path]) -> None:
    for path in staged:
        cache.keep(path.name, path)


@dataclass(frozen=True)
class ShimCompiler:
    """How a compiled language's shim is compiled: the compile argv template, its memory,
    the toolchain's version, and the compiler archive the same compile also makes."""

    argv: list[str]
    memory_mb: int
    version: str
    archive: CompilerArchive | None = None


@dataclass
class ShimBuilds:
    # Shim -> the files its compile made (name in the workspace, content), read once here:
    # every warm jail of the language writes them into its workspace.
    files: dict[str, list[tuple[str, bytes]]] = field(default_factory=dict)
    # Binds (`host:jail`, read-only) of the compiler archives, for compile jails.
    compile_mounts: list[str] = field(default_factory=list)


async def build_compiled_shims(
    profiles_dir: Path,
    work_root: Path,
    compilers: dict[str, ShimCompiler],
    timeout_s: float = 120.0,
    cache: BuildCache = NO_CACHE,
) -> ShimBuilds:
    """Compile the shims of compiled languages the way a job's entry file is compiled,
    staged into the gate tmpfs. A warm jail copies a shim's files into its workspace for the
    runtime's start-up and removes them before any job's files go in. The same compile
    makes the language's compiler archive, if its manifest names one. Like the gate, a build
    stays in the work root for the workers that start after (named by a digest of the shim,
    the command and the toolchain's version).

    Java's source-file mode would do without the shim's compile, but it runs javac inside
    the VM at every warm-up: 1.2 s of CPU against 0.1 s for the VM itself. A shim that does
    not compile is left out (its language is then prestarted from the source, if its
    runtime can run one) and logged.
    """
    gate_dir = work_root / ".gate"
    builds = ShimBuilds()
    for shim, how in sorted(compilers.items()):
        source = profiles_dir / "prestart" / shim
        if not source.is_file():
            continue
        argv = expand_argv(how.argv, entry=shim, sources=[shim], args=[], memory_mb=how.memory_mb)
        archive_make = [] if how.archive is None else how.archive.make
        key = hashlib.sha256(b"\0".join([source.read_bytes(), *(a.encode() for a in [*argv, *archive_make]), how.version.encode()]))
        prefix = f"prestart-build-{key.hexdigest()[:16]}-"
        archive = work_root / f".compiler-archive-{key.hexdigest()[:16]}"
        # Written under another name first: a half-written archive must never be used.
        fresh = archive.with_name(f"{archive.name}.tmp{os.getpid()}")
        kept = sorted(p for p in gate_dir.glob(f"{prefix}*") if p.is_file())
        if not kept or (how.archive is not None and not archive.is_file()):
            kept = await off_loop(_fetch_build, cache, prefix, gate_dir, work_root, archive if how.archive is not None else None)
        if not kept or (how.archive is not None and not archive.is_file()):
            making = argv if how.archive is None else _archive_making(argv, how.archive, fresh)
            kept = await _compile_shim(source, making, work_root, timeout_s, gate_dir, prefix)
            if fresh.is_file():
                if kept:
                    os.replace(fresh, archive)
                else:
                    fresh.unlink()
            if kept and (how.archive is None or archive.is_file()):
                await off_loop(_keep_build, cache, prefix, kept, archive if how.archive is not None else None)
        if kept:
            builds.files[shim] = [(path.name.removeprefix(prefix), path.read_bytes()) for path in kept]
        if how.archive is not None and archive.is_file():
            builds.compile_mounts.append(f"{archive}:{how.archive.path}")
    return builds


def _fetch_build(cache: BuildCache, prefix: str, gate_dir: Path, work_root: Path, archive: Path | None) -> list[Path]:
    """A compiled shim's files (and its compiler archive) from the cache, staged; [] if the
    cache has not all of them. Its list of files is kept last, so a build kept half-way
    (a worker stopped mid-keep) is never taken for a whole one."""
    listing = cache.read(f"{prefix}files")
    names = [prefix + name for name in listing.decode(errors="replace").split()] if listing else []
    if not names or (archive is not None and not cache.fetch(archive.name.lstrip("."), archive, 0o444)):
        return []
    if not _fetch_staged(cache, names, gate_dir, work_root):
        return []
    return sorted(gate_dir / name for name in names)


def _keep_build(cache: BuildCache, prefix: str, staged: list[Path], archive: Path | None) -> None:
    if archive is not None:
        cache.keep(archive.name.lstrip("."), archive)
    _keep_staged(cache, staged)
    cache.keep(f"{prefix}files", "".join(f"{path.name.removeprefix(prefix)}\n" for path in staged).encode())


def _archive_making(argv: list[str], archive: CompilerArchive, dest: Path) -> list[str]:
    """`argv` making the archive at `dest`: `make` stands where the command names the
    archive's path (the compiler cannot use an archive it is making), else after argv[0]."""
    make = [item.replace("{archive}", str(dest)) for item in archive.make]
    out = [item for item in argv if archive.path not in item]
    at = next((i for i, item in enumerate(argv) if archive.path in item), 1)
    return [*out[:at], *make, *out[at:]]


async def _compile_shim(
    source: Path, argv: list[str], work_root: Path, timeout_s: float, gate_dir: Path, prefix: str
) -> list[Path]:
    """Run `argv` over a copy of `source` in a folder of its own, and stage what it made
    into `gate_dir` under `prefix`; [] if it failed."""
    with tempfile.TemporaryDirectory(prefix=".prestart-build-", dir=work_root) as tmp:
        shutil.copyfile(source, Path(tmp) / source.name)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, cwd=tmp, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
            )
            out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
        except (OSError, TimeoutError) as exc:
            log.warning("prestart shim %s did not compile (%r); its language starts from the source", source.name, exc)
            return []
        made = sorted(p for p in Path(tmp).iterdir() if p.name != source.name and p.is_file())
        if proc.returncode != 0 or not made:
            log.warning("prestart shim %s did not compile: %s", source.name, out.decode(errors="replace")[-500:])
            return []
        return [_stage_file(path, gate_dir, prefix + path.name, 0o644) for path in made]


# The C helpers are built without a C library (bare.h says why): no start files, no libc,
# nothing the compiler would quietly call that bare.h does not define.
_BARE_FLAGS = (
    "-O2", "-static", "-nostdlib", "-ffreestanding", "-fno-builtin", "-fno-stack-protector",
    "-fno-tree-loop-distribute-patterns", "-fno-asynchronous-unwind-tables", "-fno-pie", "-no-pie",
)  # fmt: skip


async def _compile(source_path: Path, work_root: Path, name: str, cache: BuildCache = NO_CACHE) -> Path:
    """Compile one of the C helpers once per version of its source, of bare.h and of the
    compiler; returns the binary's path."""
    # gcc by name first: the flags are gcc's (another `cc` may ignore the one that keeps loops
    # from becoming calls to a C library that is not there; the link would then fail).
    compiler = shutil.which("gcc") or shutil.which("cc")
    digest = hashlib.sha256(source_path.read_bytes() + BARE_HEADER.read_bytes() + " ".join(_BARE_FLAGS).encode())
    # The compiler by its installed file (an upgrade replaces it): a build kept in the cache
    # outlives reboots, where one in the work root (under /run) never did.
    digest.update(_file_identity(compiler).encode())
    dest = work_root / f".{name}-{digest.hexdigest()[:16]}"
    if dest.is_file() and os.access(dest, os.X_OK):
        return dest
    if await off_loop(cache.fetch, dest.name.lstrip("."), dest, 0o755):
        return dest
    if compiler is None:
        raise GateBuildError(f"a C compiler (gcc) is needed once at start-up to build the jail {name} (apt install gcc)")
    tmp = dest.with_suffix(f".tmp{os.getpid()}")
    proc = await asyncio.create_subprocess_exec(
        compiler, *_BARE_FLAGS, "-o", str(tmp), str(source_path),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise GateBuildError(f"building the jail {name} failed: {out.decode(errors='replace')[-400:]}")
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)
    await off_loop(cache.keep, dest.name.lstrip("."), dest)
    return dest


def _file_identity(path: str | None) -> str:
    """Which file `path` resolves to, and which version of it (size and change time)."""
    if path is None:
        return "none"
    real = os.path.realpath(path)
    try:
        info = os.stat(real)
    except OSError:
        return real
    return f"{real}:{info.st_size}:{info.st_mtime_ns}"


@dataclass(frozen=True)
class StartupCost:
    """What a language's runtime holds and has spent once started and waiting: its memory
    without file cache, its jail's CPU from the gate's go, and the time from that go until
    it said it was ready."""

    resident_bytes: int
    cpu_ms: int
    wall_ms: int


@dataclass(frozen=True)
class Uncharged:
    """What a step's limits, clocks and figures leave out: the part of the jail's memory
    and CPU that was there before the job (a prestarted runtime's), or that a plain jail's
    runtime is taken to spend starting (StartupCosts), and for a plain jail that start-up's
    time, which its wall and idle clocks add and its duration leaves out."""

    memory_bytes: int = 0
    cpu_ms: int = 0
    wall_ms: int = 0


class StartupCosts:
    """The start-up costs a language's prestarted runtimes measured (the latest few): what a
    plain sandbox running the same command leaves out of its job's limits and figures too,
    so a job is charged alike whichever kind of sandbox the pool had for it (a saturated
    worker builds plain ones). Nothing until one of the language's runtimes has started
    on this worker: its first plain runs are charged their start-up."""

    SAMPLES = 5

    def __init__(self) -> None:
        self._samples: collections.deque[StartupCost] = collections.deque(maxlen=self.SAMPLES)

    def record(self, cost: StartupCost) -> None:
        self._samples.append(cost)

    def typical(self) -> StartupCost | None:
        """Memory and CPU: each one's median over the samples (one slow start-up moves
        neither). Time: the shortest, since a runtime is started in the background at a
        low CPU weight, and the load it waited behind is no part of its start-up."""
        if not self._samples:
            return None
        samples = list(self._samples)
        return StartupCost(
            resident_bytes=int(statistics.median(s.resident_bytes for s in samples)),
            cpu_ms=int(statistics.median(s.cpu_ms for s in samples)),
            wall_ms=min(s.wall_ms for s in samples),
        )


@dataclass(frozen=True)
class Prime:
    """A language runtime a warm jail starts before its job (see sandbox-profiles/prestart/).

    `program` is what the gate execs at warm-up: the interpreter part of the language's run
    command plus the shim. A job adopts the waiting runtime only if its own run command
    starts with that same `prefix`; the shim then runs the job's entry file in place.
    """

    language: str
    shim: str
    prefix: tuple[str, ...]
    program: Program
    # A compiled shim's files (name in the workspace, content): in the workspace for the
    # runtime's start-up only. Without them the shim's source is bound in the jail instead.
    workspace_files: tuple[tuple[str, bytes], ...] = ()
    startup: StartupCosts = field(default_factory=StartupCosts, compare=False, hash=False)

    def adopts(self, program: Program) -> bool:
        # The runtime was started with the environment the job's command gets (the language's),
        # in the same order: it is its environment, /proc/self/environ included, with nothing
        # for the shim to take out or put in.
        return (
            program.adoptable
            and tuple(program.argv[: len(self.prefix)]) == self.prefix
            and len(program.argv) > len(self.prefix)
            and list(program.env.items()) == list(self.program.env.items())
        )


@dataclass
class Sandbox:
    name: str
    slot: int
    uid: int
    workspace: Workspace
    cgroup: JobCgroup
    jail: Jail
    created_at: float = field(default_factory=time.monotonic)
    # The runtime waiting in the jail, if it was primed.
    prime: Prime | None = None
    runtime_pid: int = 0
    # What the job is not charged (set by load).
    uncharged: Uncharged = Uncharged()
    # Compiled languages get a second jail over the same workspace, with its own cgroup
    # and limits, built while the job is parked.
    compile_cgroup: JobCgroup | None = None
    compile_jail: Jail | None = None

    @property
    def idle_s(self) -> float:
        return time.monotonic() - self.created_at

    def adopts(self, program: Program) -> bool:
        """Whether the runtime waiting here (if any) can run `program` in place."""
        return self.prime is not None and self.prime.adopts(program)

    async def load(
        self,
        files: list[tuple[str, bytes]],
        limits: Limits,
        program: Program,
        executable: frozenset[str] = frozenset(),
        stand_in: Prime | None = None,
    ) -> None:
        """Write the job's files and set its limits (before start).

        With a prestarted runtime that adopts `program`, what the runtime already holds is
        added to the memory limit and subtracted from the figures, and the program's
        rlimits are set on the waiting process from outside (its CPU rlimit past what it
        has used), so the job gets what a fresh `run` command would, its runtime's start-up
        not charged. A plain sandbox whose program the language's prime (`stand_in`) would
        have adopted is charged alike: its limits and figures leave out what that
        language's runtimes measured their start-up at (StartupCosts).
        """
        # A job's files are usually a few kilobytes: their copy is one of the job's short steps.
        small = sum(len(data) for _, data in files) <= QUICK_LOAD_BYTES
        await (off_loop_quick if small else off_loop)(self._load, files, limits, program, executable, stand_in)

    def _load(
        self,
        files: list[tuple[str, bytes]],
        limits: Limits,
        program: Program,
        executable: frozenset[str],
        stand_in: Prime | None,
    ) -> None:
        self.workspace.stage(files, executable)
        memory = limits.memory_mb * 1024 * 1024
        startup = stand_in.startup.typical() if stand_in is not None and stand_in.adopts(program) else None
        if self.prime is None and startup is not None:
            # The figure leaves out the resident part only: what of the runtime's files is
            # charged to this run depends on who read them first (often another cgroup).
            memory += startup.resident_bytes
            self.uncharged = Uncharged(memory_bytes=startup.resident_bytes, cpu_ms=startup.cpu_ms, wall_ms=startup.wall_ms)
        elif self.adopts(program):
            if not self.cgroup.holds(self.runtime_pid):
                # Its number may be another process's by now: root must not prlimit that.
                raise JailError("the prestarted runtime is gone")
            # The figure counts from what is there now; the limit is raised by the runtime's
            # resident memory only: a fresh run's limit covers the runtime's file pages too,
            # and which cgroup they are charged to depends on who read them first. (Its
            # clocks start after its start-up, and its CPU figure counts from the go.)
            self.uncharged = Uncharged(memory_bytes=self.cgroup.memory_current_bytes())
            memory += self.cgroup.memory_resident_bytes()
            _set_rlimits(self.runtime_pid, program, _cpu_used_s(self.runtime_pid))
        # +1 pid: nsjail's clone of the gate is counted once before the program replaces it.
        self.cgroup.set_limits(memory_bytes=memory, pids=limits.pids + 1)
        self.cgroup.reset_memory_peak()

    async def copy_in(self, packed: Packed) -> None:
        """Unpack `packed` (a test case's compiled program) into the workspace, charged to a
        memory cgroup of its own under the ceiling: not to the jail's, whose limit would
        then hold what the program may delete to use the room itself. Its caller holds
        `packed.charge_bytes` of the ceiling for the step. A cancel kills the copier."""
        unpacking = Unpacking()
        await off_loop_stoppable(lambda: self._copy_in(packed, unpacking), unpacking.stop)

    def _copy_in(self, packed: Packed, unpacking: Unpacking) -> None:
        try:
            procs = self.cgroup.make_copier_cgroup()
        except OSError as exc:
            raise WorkspaceError(f"no cgroup for copying the compiled program: {exc}") from None
        try:
            self.workspace.unpack(packed, [procs], unpacking)  # (which waits for its copier)
        finally:
            self.cgroup.remove_copier_cgroup()

    def start(self, program: Program) -> bool:
        return self.jail.go(program)

    async def destroy(self, exit_grace_s: float = 5.0) -> None:
        """Kill every process of the sandbox and remove its cgroups and workspace."""
        pairs = [(self.cgroup, self.jail)]
        if self.compile_cgroup is not None and self.compile_jail is not None:
            pairs.append((self.compile_cgroup, self.compile_jail))
        try:
            for cgroup, jail in pairs:
                try:
                    # A jail seen to exit (after every run: the step saw its cgroup empty or
                    # killed it, and waited) has nothing left alive; any straggler dies in
                    # the removal below. One whose gate reported has only the gate and
                    # nsjail left: the wait lets the gate go (it waits for that: gate.c).
                    if not jail.exited:
                        if not jail.reported:
                            await off_loop(cgroup.kill)
                        try:
                            # (wait_for, though it makes a task: on Debian's 3.11.2, which the
                            # venv runs on, asyncio.timeout expiring in a task already being
                            # cancelled raises CancelledError, and a teardown must reach
                            # terminate_supervisor whoever awaits it.)
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
        finally:
            # One short trip for all of it when nothing is left alive (every process is
            # dead by now, as a rule); cgroups that still hold some wait on the other threads.
            left = await off_loop_quick(self._remove_all, [cgroup for cgroup, _ in pairs])
            if left:
                left = [cgroup for cgroup in left if not await off_loop(cgroup.remove_blocking)]
            await self._remove_stragglers(left)

    def _remove_all(self, cgroups: list[JobCgroup]) -> list[JobCgroup]:
        """Remove the empty cgroups and the workspace; the cgroups left (no waiting here)."""
        try:
            return [cgroup for cgroup in cgroups if not cgroup.try_remove()]
        finally:
            self.workspace.destroy()

    async def _remove_stragglers(self, left: list[JobCgroup]) -> None:
        """Processes killed but not gone (stuck in the kernel, say) keep their cgroups: the
        slot's next sandbox would run beside them on the same outside uid. So the slot waits
        (its destroy does not return) while they are killed and looked for again, up to
        STRAGGLER_WAIT_S, off the isolation threads between tries."""
        delay, waited = 0.25, 0.0
        while left:
            if waited >= STRAGGLER_WAIT_S:
                log.error(
                    "sandbox %s: cgroups %s still hold processes after %.0f s; the slot goes on",
                    self.name, [c.job_id for c in left], waited,
                )  # fmt: skip
                return
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, 5.0)
            left = [cgroup for cgroup in left if not await off_loop(cgroup.remove_blocking, 0.5)]


PRESTART_READY = b"\0coderunner-prestart-ready\n"
# Files up to this many bytes in all are written on the thread for short steps (offload.py).
QUICK_LOAD_BYTES = 256 * 1024
# How long a slot waits for killed processes that linger in its cgroups before it is rebuilt.
STRAGGLER_WAIT_S = 60.0


def _runtime_pid(cgroup: JobCgroup) -> int:
    """The host pid of the prestarted runtime: the gate's child, pid 2 of the jail."""
    for pid in cgroup.pids():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        if any(line.startswith("NSpid:") and line.split()[-1] == "2" for line in status.splitlines()):
            return pid
    raise JailError("the prestarted runtime is gone")


def _after_warm_up(
    cgroup: JobCgroup, workspace: Workspace, shim_files: list[str], cpu_at_go_us: int, wall_ms: int
) -> tuple[int, StartupCost]:
    """The runtime is up: its shim's files leave the workspace (the job's go in alone).
    Returns the runtime's host pid and its start-up cost: what it holds, and the CPU its
    jail spent since the gate let it go (what a plain run's clock, which starts there too,
    would count for it). One trip to the isolation threads for both."""
    workspace.remove(shim_files)
    cost = StartupCost(
        resident_bytes=cgroup.memory_resident_bytes(),
        cpu_ms=max(0, cgroup.cpu_us() - cpu_at_go_us) // 1000,
        wall_ms=wall_ms,
    )
    return _runtime_pid(cgroup), cost


def _cpu_used_s(pid: int) -> float:
    """The CPU time a process has used (all its threads), in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def _set_rlimits(pid: int, program: Program, cpu_used_s: float) -> None:
    """Give a waiting runtime the rlimits the gate would have given `program`.

    The CPU rlimit is a backstop a second past the job's CPU limit, which the worker
    enforces on the cgroup counting from start. The rlimit counts the process's CPU from
    its own start, warm-up included (`cpu_used_s`), so whole seconds of that are added back
    until at least half of the second is left: a few tens of ms (Python, Node, Ruby, Java on
    its compiled shim) change nothing; a start-up of over a second (the JVM compiling its
    shim in source-file mode, a slow host) gets its seconds back. Otherwise a busy job would
    be SIGKILLed before its CPU clock fired, and end "completed" by a signal where a fresh
    run times out.
    """
    cpu_s = program.rlimit_cpu_s + cpu_backstop_room_s(cpu_used_s) if program.rlimit_cpu_s else 0
    for which, value in (
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_FSIZE, program.rlimit_fsize_bytes),
        (resource.RLIMIT_NOFILE, program.rlimit_nofile),
    ):
        if value:
            # Only ever lowered (raising a hard limit needs CAP_SYS_RESOURCE, which a
            # containerised worker may lack): the runtime was started with the maxima, and
            # its jail's CPU maximum has PRESTART_CPU_ROOM_MS more for its start-up.
            _soft, hard = resource.prlimit(pid, which)
            if hard != resource.RLIM_INFINITY:
                value = min(value, hard)
            resource.prlimit(pid, which, (value, value))


@dataclass
class SandboxFactory:
    """Everything needed to build sandboxes on this host."""

    nsjail: str
    profiles_dir: Path
    work_root: Path
    gate: Path
    enter: Path
    cgroups: CgroupLayout
    uid_base: int
    max_limits: Limits
    # This worker's hold on its job uids (worker/isolation/uids.py), kept as long as the factory.
    uid_lease: UidLease | None = None
    extra_mounts: list[str] = field(default_factory=list)
    # Staged prestart shims by file name (stage_prestart_shims), and what the compiled ones
    # compiled to (build_compiled_shims).
    prestart_shims: dict[str, Path] = field(default_factory=dict)
    # Shim -> (file name in the jail, staged path) of its PrestartCache, if one was made.
    prestart_caches: dict[str, tuple[str, Path]] = field(default_factory=dict)
    prestart_builds: dict[str, list[tuple[str, bytes]]] = field(default_factory=dict)
    # Binds every compile jail gets (compiler archives, see build_compiled_shims).
    compile_mounts: list[str] = field(default_factory=list)
    # nsjail's fork server (worker/isolation/forkserver.py), when nsjail was built with one:
    # jails are then forks of it, not execs of nsjail.
    forkserver: ForkServer | None = None
    workspace_bytes: int = 64 * 1024 * 1024
    workspace_inodes: int = 4096
    rlimit_fsize_mb: int = 16
    rlimit_nofile: int = 64
    ready_timeout_s: float = 10.0
    # The longest a sandbox lent to a parked job may wait between the loan and the run: the
    # warm-up (WORKER_WARMUP_MS) and then the longest compile (see backstop_s).
    start_wait_s: float = 120.0
    # What the steps running at once may hold of the jobs' memory ceiling (unbounded unless
    # the worker sets it from the ceiling: worker/isolation/memory.py).
    memory: MemoryAdmission = field(default_factory=lambda: MemoryAdmission(UNBOUNDED_BYTES))
    # Numbers the sandboxes' names (`<owner>.<slot>.<n>`): the clock in ms, or one more than
    # the last name's when that was in the same ms. From the clock, so a worker restarted
    # under the same WORKER_ID never meets a name its last incarnation left behind (killed
    # in its start-up self-test, say, which comes before its sweep); kept with the clock,
    # because the janitor reads a sandbox's age from it (one counted on by one a name ran
    # ahead of the clock by hours on a busy worker, and its orphans looked that much younger).
    _counter: int = 0
    # Each slot's kept workspace mount point (see Workspace), by owner and slot.
    _mount_points: dict[tuple[str, int], str] = field(default_factory=dict)

    def backstop_s(self, limits: Limits) -> int:
        """nsjail's own time limit, only a backstop behind the worker's clocks: it covers the
        longest a sandbox may wait for a job, then for a start (a parked job's warm-up and
        its compile), then run, plus a minute."""
        return int(MAX_IDLE_S + self.start_wait_s + limits.wall_time_ms / 1000 + 60)

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
        self._counter = max(self._counter + 1, time.time_ns() // 1_000_000)
        return f"{owner}.{slot}.{self._counter}"

    def _workspace(self, owner: str, slot: int, uid: int) -> Workspace:
        """A fresh workspace on `slot`'s kept mount point. The folder is named as a sandbox
        is, with a number of its own: the janitor finds a dead worker's by its id and reads
        its age from the number, as for the sandboxes."""
        name = self._mount_points.get((owner, slot))
        if name is None:
            name = self._mount_points[(owner, slot)] = self._name(owner, slot)
        return Workspace(self.work_root, name, uid, uid, keep_mount_point=True)

    def remove_mount_points(self) -> None:
        """Remove the slots' mount points (blocking: isolation threads only). One a tmpfs is
        still on (a teardown that never finished) stays, for the janitor or the next start."""
        for name in self._mount_points.values():
            try:
                os.rmdir(self.work_root / name)
            except FileNotFoundError:
                pass
            except OSError as exc:
                log.warning("workspace mount point %s stays: %s", name, exc)
        self._mount_points.clear()

    async def _launch(
        self,
        name: str,
        uid: int,
        workspace: Workspace,
        limits: Limits,
        merge_stderr: bool,
        mounts: list[str] | None = None,
        new_workspace: bool = False,
    ) -> tuple[JobCgroup, Jail]:
        """Cgroup plus a jail parked at the gate, over `workspace` (created first when new)."""
        cgroup = self.cgroups.job(name)
        jail: Jail | None = None
        try:
            spec = JailSpec(
                gate=self.gate,
                enter=self.enter,
                workspace=workspace.path,
                uid=uid,
                gid=uid,
                extra_mounts=[*self.extra_mounts, *(mounts or [])],
                backstop_s=self.backstop_s(limits),
                rlimit_cpu_s=math.ceil(limits.cpu_ms / 1000) + 1,
                rlimit_fsize_mb=max(self.rlimit_fsize_mb, self.workspace_bytes >> 20),
                rlimit_nofile=max(self.rlimit_nofile, 256),
            )
            # The workspace and cgroups are made on the thread that spawns nsjail, in the same trip.
            if new_workspace:
                make = functools.partial(self._make_workspace_and_cgroup, workspace, cgroup, limits)
            else:
                make = functools.partial(self._make_cgroup, cgroup, limits)
            jail = await Jail.launch(
                self.nsjail, self.profile(), spec, cgroup, merge_stderr=merge_stderr, before=make, forkserver=self.forkserver
            )
            await jail.wait_ready(self.ready_timeout_s)
        except BaseException:
            try:
                await off_loop(cgroup.kill)
                if jail is not None:
                    jail.terminate_supervisor()
                    await asyncio.shield(jail.wait())
            except Exception:
                log.exception("sandbox %s: nsjail failed while being torn down", name)
            finally:
                if jail is not None:
                    jail.close()
                # Even if cancelled again meanwhile: the cgroups (and the descriptors kept
                # of them) go, and what the kill did not reach dies in the removal.
                await asyncio.shield(cgroup.remove())
            raise
        return cgroup, jail

    @staticmethod
    def _make_cgroup(cgroup: JobCgroup, limits: Limits, background: bool = False) -> None:
        cgroup.create()
        cgroup.set_limits(memory_bytes=limits.memory_mb * 1024 * 1024, pids=limits.pids + 1, background=background)
        cgroup.open_counters()

    def _make_workspace_and_cgroup(self, workspace: Workspace, cgroup: JobCgroup, limits: Limits) -> None:
        """A warm sandbox's: built in the background, at a low CPU weight until a job loads it."""
        workspace.create(self.workspace_bytes, self.workspace_inodes)
        self._make_cgroup(cgroup, limits, background=True)

    def prime_for(
        self, language: str, manifest_run: list[str], shim: str, env: dict[str, str], limits: Limits
    ) -> Prime | None:
        """The Prime of a language whose manifest names a staged shim, for jobs with `limits`."""
        if shim not in self.prestart_shims:
            return None
        built = self.prestart_builds.get(shim, [])
        # A shim with a cache starts the runtime on the cache, bound under the cache's name.
        started_on = shim if built or shim not in self.prestart_caches else self.prestart_caches[shim][0]
        argv = prestart_argv_for(manifest_run, started_on, limits.memory_mb, compiled=bool(built))
        if argv is None:
            return None
        program = Program(
            argv=argv,
            # The language's, which is every job's (Prime.adopts checks): the runtime starts in
            # the very environment the gate would give the job's command, so nothing of the
            # worker's shows in it, not even in /proc/self/environ, which a process cannot change.
            env=dict(env),
            # The most any job may get, plus room for start-up: lowered to the job's own at load.
            **self.program_rlimits(msgspec.structs.replace(limits, cpu_ms=self.max_limits.cpu_ms + PRESTART_CPU_ROOM_MS)),
        )
        return Prime(language=language, shim=shim, prefix=tuple(argv[:-1]), program=program, workspace_files=tuple(built))

    async def prepare(self, owner: str, slot: int, prime: Prime | None = None) -> Sandbox:
        """Build a fresh sandbox for `slot` and wait until its jail sits at the gate; with a
        `prime`, the gate is released at once into the waiting runtime."""
        name = self._name(owner, slot)
        uid = self.uid_base + slot
        workspace = self._workspace(owner, slot, uid)
        mounts = [f"{self._shim_file(prime.shim)}:{prime.program.argv[-1]}"] if prime and not prime.workspace_files else []
        # The jail's CPU rlimit caps the gate's: a waiting runtime needs the room, and so does
        # the program of a plain jail whose runtime's start-up is left uncharged (Sandbox.load
        # with a stand-in): the gate lowers every program's own to what it may have.
        limits = msgspec.structs.replace(self.max_limits, cpu_ms=self.max_limits.cpu_ms + PRESTART_CPU_ROOM_MS)
        try:
            cgroup, jail = await self._launch(name, uid, workspace, limits, merge_stderr=False, mounts=mounts, new_workspace=True)
        except BaseException:
            await off_loop(workspace.destroy)
            raise
        sandbox = Sandbox(name=name, slot=slot, uid=uid, workspace=workspace, cgroup=cgroup, jail=jail, prime=prime)
        if prime is not None:
            try:
                names = [name for name, _ in prime.workspace_files]
                if names:
                    await off_loop(workspace.stage, list(prime.workspace_files))
                cpu_at_go_us = cgroup.cpu_us()
                go_at = time.monotonic()
                if not jail.go(prime.program):
                    raise JailError("the jail ended before its runtime was started")
                await self._await_runtime(jail)
                wall_ms = round((time.monotonic() - go_at) * 1000)
                sandbox.runtime_pid, cost = await off_loop(_after_warm_up, cgroup, workspace, names, cpu_at_go_us, wall_ms)
                prime.startup.record(cost)
            except Exception as exc:
                await asyncio.shield(sandbox.destroy())
                raise RuntimeFailed(f"the prestarted {prime.language} runtime failed: {exc}") from exc
            except BaseException:
                await asyncio.shield(sandbox.destroy())
                raise
        return sandbox

    def _shim_file(self, shim: str) -> Path:
        """What a warm jail binds as its shim: the shim's cache if one was made, else its source."""
        cached = self.prestart_caches.get(shim)
        return cached[1] if cached is not None else self.prestart_shims[shim]

    async def _await_runtime(self, jail: Jail) -> None:
        """Wait for the prestarted runtime's ready marker: its start-up is over, it waits for
        its frame, and the marker is off its stderr before any job can write there."""
        assert jail.stderr is not None

        def ended(_: object) -> None:
            # A runtime that died: its gate reported and waits to be let go, nsjail holds the
            # pipes, and no EOF would come. What it wrote is all there is.
            jail.end_output()

        jail.ended.add_done_callback(ended)
        try:
            async with asyncio.timeout(self.ready_timeout_s):  # (wait_for would make a task of the read)
                marker = await jail.stderr.readexactly(len(PRESTART_READY))
        except TimeoutError:
            raise JailError(f"the prestarted runtime did not come up within {self.ready_timeout_s:g} s") from None
        except asyncio.IncompleteReadError as exc:
            said = exc.partial[:300].decode(errors="replace").strip()
            raise JailError(f"the prestarted runtime ended before it was ready, saying {said!r}") from None
        finally:
            jail.ended.remove_done_callback(ended)
        if marker != PRESTART_READY:
            raise JailError(f"the prestarted runtime said {marker!r} instead of being ready")

    async def add_compile_jail(self, sandbox: Sandbox, owner: str, limits: Limits) -> None:
        """Give `sandbox` a compile jail (its own cgroup and limits)."""
        name = self._name(owner, sandbox.slot)
        cgroup, jail = await self._launch(
            name, sandbox.uid, sandbox.workspace, limits, merge_stderr=False, mounts=self.compile_mounts
        )
        sandbox.compile_cgroup, sandbox.compile_jail = cgroup, jail
