"""Per-job cgroups the worker owns, on pure cgroup v2 hosts and on hybrid (v1 + v2) hosts.

The worker, not nsjail, creates every cgroup, writes the limits and reads the counters:
nsjail's own per-jail cgroups vanish when it exits, taking the OOM counter with them, and
the counters must come from a channel the job cannot write (defence R12).

Layout under the configured name (default `coderunner`):

    pure v2:  <v2>/coderunner/jobs/<jobId>      memory.max, memory.swap.max, pids.max, cpu.max
              <v2>/coderunner/supervisor        nsjail itself, once the jail is running
    hybrid:   memory/coderunner/<jobId>, pids/coderunner/<jobId>, cpu/coderunner/<jobId> (v1 limits)
              <unified>/coderunner/jobs/<jobId> (v2 without controllers: cpu.stat, cgroup.kill)
              .../coderunner/supervisor in each hierarchy

nsjail starts inside the job cgroups (so the jail inherits them) and is moved to the
supervisor cgroups as soon as the jail exists, so only jailed processes are limited,
counted and killed. Creating, limiting and removing cgroups take kernel locks and run on
the isolation threads (worker/isolation/offload.py). The clocks read the counters on the
event loop, through descriptors opened when the cgroups are made: reading through an open
descriptor is an in-kernel copy, while opening a cgroup file waits behind other sandboxes'
cgroup creation and removal (4x slower at the median and 10x at p99 here, under churn).
"""

from __future__ import annotations

import enum
import errno
import functools
import logging
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from worker.isolation.offload import off_loop

__all__ = ["CgroupError", "CgroupLayout", "CgroupMode", "JobCgroup", "JobCounters", "detect_layout"]

log = logging.getLogger(__name__)

# How many times the worker moves a container's root processes aside and asks again before
# its root cgroup's controllers are taken as refused (start-up only).
ROOT_MOVE_ATTEMPTS = 5

CPU_PERIOD_US = 100_000
# A v1 memory cgroup's limit before one is written (PAGE_COUNTER_MAX in 4 KiB pages).
_V1_NO_MEMORY_LIMIT = str((2**63 - 1) // 4096 * 4096)
# The memory high-water mark's file in each layout (v1, v2).
_PEAK_FILES = ("memory.max_usage_in_bytes", "memory.peak")
# CPU weight of a sandbox being built (nsjail setting up, a runtime starting) against one that
# runs a job: 1/16, as nice 12 is to nice 0. Warm jails are built in the background, often
# while a started job runs or streams; on a small host they would otherwise take half its
# CPU. A job's own run gets the normal weight back when it is loaded.
BACKGROUND_CPU_SHARE = 1 / 16


class CgroupError(Exception):
    """cgroups cannot enforce the sandbox's limits; the message says what is missing."""


class CgroupMode(enum.StrEnum):
    V2 = "v2"
    HYBRID = "hybrid"


# An OOM kill against a job's own v1 limit leaves its peak usage this close to the limit at
# least (the last charge that failed was at most a charge batch, 64 pages); a peak further
# below means the deployment's ceiling ran out first.
OOM_NEAR_LIMIT_BYTES = 1 << 20


@dataclass(frozen=True)
class JobCounters:
    cpu_us: int
    memory_peak_bytes: int
    oom_kills: int
    # OOM kills came while the job never reached its own memory limit: the kernel ended it
    # for the deployment's ceiling on all jobs together (SANDBOX_MEMORY_TOTAL_MB).
    ceiling_oom: bool = False


# Plain descriptors, not file objects: a job's set-up and teardown touch a few dozen
# cgroup files, and io's fstat/seek and object churn cost more than the read or write.
def _read(path: str | Path) -> str:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 65536):
            chunks.append(chunk)
        return b"".join(chunks).decode()
    finally:
        os.close(fd)


def _pread_text(fd: int) -> str:
    """The whole file behind `fd`, read afresh from offset 0 (kernfs regenerates it).

    A cgroup file with one line per record (cgroup.procs) gives at most a page per read, so
    a read is the whole file only when it stopped short of half a page: the kernel ends a
    read early only at the end of the file or when the next record would overflow the page.
    """
    data = os.pread(fd, 65536, 0)
    if len(data) < 2048:
        return data.decode()
    chunks = [data]
    offset = len(data)
    while chunk := os.pread(fd, 65536, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks).decode()


def _close_fds(fds: dict[str, int]) -> None:
    """Close what a JobCgroup kept open when it is dropped without close_files (a cancelled
    set-up, say); by then nothing else can use these descriptors."""
    for fd in fds.values():
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


# The flags open(path, "wb") uses, so errors stay what they were.
_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC


def _write(path: str | Path, value: str) -> None:
    fd = os.open(path, _WRITE_FLAGS, 0o666)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


class _KeptWriters:
    """Files opened to write on first use and kept open (closed when dropped)."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        weakref.finalize(self, _close_fds, self._fds)

    def write_all(self, data: bytes) -> None:
        """Write `data` to each file, in order. A descriptor whose folder was removed (and
        perhaps made again since) is opened afresh, once; other errors are raised."""
        with self._lock:  # (a descriptor reopened meanwhile must not be written through)
            try:
                self._write_all(data)
            except OSError as exc:
                if exc.errno not in (errno.ENODEV, errno.ENOENT, errno.EBADF):
                    raise
                _close_fds(self._fds)
                self._write_all(data)

    def _write_all(self, data: bytes) -> None:
        for path in self.paths:
            fd = self._fds.get(path)
            if fd is None:
                fd = self._fds[path] = os.open(path, _WRITE_FLAGS, 0o666)
            os.write(fd, data)


def _keyed(text: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            out[name] = int(value)
    return out


def _mounts(mounts_text: str) -> tuple[Path | None, dict[str, Path]]:
    """The first cgroup2 mount point and the v1 mount point of every controller."""
    v2: Path | None = None
    v1: dict[str, Path] = {}
    for line in mounts_text.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        where, fstype, options = fields[1], fields[2], fields[3].split(",")
        if fstype == "cgroup2" and v2 is None:
            v2 = Path(where)
        elif fstype == "cgroup":
            for option in options:
                if option in ("memory", "pids", "cpu", "cpuacct"):
                    v1.setdefault(option, Path(where))
    return v2, v1


def _mount_root(mountinfo_text: str, mount_point: Path) -> str | None:
    """The root a mount shows (mountinfo's fourth field: for a cgroup mount, relative to this
    process's cgroup namespace, "/.." and on when outside it), or None when not listed.
    (Octal escapes, as for spaces, are left as they are: cgroup roots seldom have any.)"""
    for line in mountinfo_text.splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[4] == str(mount_point):
            return fields[3]
    return None


@dataclass(frozen=True)
class CgroupLayout:
    mode: CgroupMode
    name: str
    # pure v2: the single hierarchy. hybrid: the unified mount (may be None).
    v2: Path | None
    v1_memory: Path | None = None
    v1_pids: Path | None = None
    v1_cpu: Path | None = None
    v1_cpuacct: Path | None = None
    # Which optional files job cgroups have (the same for every job on one kernel): looked
    # up once, not on every job (see JobCgroup._has).
    optional_files: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)

    def describe(self) -> str:
        if self.mode is CgroupMode.V2:
            return f"cgroup v2 at {self.v2}"
        parts = [f"v1 memory at {self.v1_memory}", f"v1 pids at {self.v1_pids}"]
        parts.append(
            f"cgroup2 at {self.v2} for cpu.stat/cgroup.kill" if self.v2 else "no cgroup2 (cpuacct, signal sweep)"
        )
        return "hybrid: " + ", ".join(parts)

    # -- set-up ------------------------------------------------------------------------

    def _v2_base(self) -> Path | None:
        return self.v2 / self.name if self.v2 else None

    def prepare(self, jobs_memory_bytes: int = 0) -> None:
        """Create the parent folders (idempotent), and with `jobs_memory_bytes` cap the
        memory of all jobs together there. Raises CgroupError with a fix-it hint."""
        try:
            enable = self._prepare_v2_controllers() if self.mode is CgroupMode.V2 else ""
            base = self._v2_base()
            if base is not None:
                (base / "jobs").mkdir(parents=True, exist_ok=True)
                (base / "supervisor").mkdir(exist_ok=True)
                if enable:
                    _write(base / "jobs" / "cgroup.subtree_control", enable)
            for root in self.v1_roots():
                (root / self.name / "supervisor").mkdir(parents=True, exist_ok=True)
            if jobs_memory_bytes > 0:
                _write(self.jobs_memory_limit_file(), str(jobs_memory_bytes))
        except OSError as exc:
            raise CgroupError(f"cannot prepare cgroups ({self.describe()}): {exc}") from None

    def swap_unbounded(self, swaps: str) -> bool:
        """Whether jobs could swap past their memory limits: a memory controller without
        swap accounting (v1: no memory.memsw.*; v2: no memory.swap.max; the kernel's
        swapaccount=0, or one built without it) on a host with swap on (`swaps`:
        /proc/swaps). Swappiness 0 only makes swapping rare, not impossible. Asked after
        prepare (v2 looks in the jobs' folder)."""
        swapping = any(line.strip() for line in swaps.splitlines()[1:])
        if not swapping:
            return False
        if self.v1_memory is not None:
            return not (self.v1_memory / "memory.memsw.limit_in_bytes").exists()
        base = self._v2_base()
        return base is not None and not (base / "jobs" / "memory.swap.max").exists()

    def check_namespace(self, mountinfo_text: str) -> None:
        """Refuse a cgroup2 mount that shows cgroups outside this process's cgroup namespace
        (a host's /sys/fs/cgroup bound into a container that has a namespace of its own): the
        worker could make folders there, but could never move a process into one, and every
        sandbox would fail at its start with nothing said."""
        if self.v2 is None:
            return
        root = _mount_root(mountinfo_text, self.v2)
        if root is not None and (root == "/.." or root.startswith("/../")):
            raise CgroupError(
                f"the cgroup2 mount at {self.v2} shows cgroups outside this process's cgroup namespace (root {root}): "
                "mount the container's own cgroup2 there (its namespace's /sys/fs/cgroup), not the host's"
            )

    def root_memory_limit_bytes(self) -> int | None:
        """The memory limit on the hierarchy's root as the worker sees it, the one ancestor
        its jobs' cgroups share with everything else here: set inside a container (its own
        cgroup namespace on v2, its cgroup mounted as the root on v1), where the container's
        OOM killer would otherwise pick among the worker and the jobs. None: unlimited (a
        host's real root has no limit)."""
        path = self.v2 / "memory.max" if self.mode is CgroupMode.V2 and self.v2 else (
            self.v1_memory / "memory.limit_in_bytes" if self.v1_memory is not None else None
        )  # fmt: skip
        if path is None or not path.exists():
            return None
        text = _read(path).strip()
        if not text.isdigit() or int(text) >= 1 << 60:  # "max", or v1's page-rounded "unlimited"
            return None
        return int(text)

    def jobs_memory_limit_file(self) -> Path:
        """The file that caps the memory of every job of this deployment together."""
        if self.mode is CgroupMode.V2:
            base = self._v2_base()
            assert base is not None
            return base / "jobs" / "memory.max"
        assert self.v1_memory is not None
        return self.v1_memory / self.name / "memory.limit_in_bytes"

    def _prepare_v2_controllers(self) -> str:
        """Enable the controllers down to the deployment's folder; what it enabled, as
        written to a cgroup.subtree_control. Without the cpu controller jobs run with no
        one-core cap (their CPU is still counted and clocked: cpu.stat is always there)."""
        assert self.v2 is not None
        wanted = {"memory", "pids", "cpu"}
        available = set(_read(self.v2 / "cgroup.controllers").split())
        missing = {"memory", "pids"} - available
        if missing:
            raise CgroupError(
                f"cgroup v2 at {self.v2} lacks the {', '.join(sorted(missing))} controller(s); "
                "enable them in the parent's cgroup.subtree_control (or run the worker with its own delegated cgroup)"
            )
        enable = " ".join(f"+{c}" for c in sorted(wanted & available))
        base = self.v2 / self.name
        base.mkdir(exist_ok=True)
        root_control = self.v2 / "cgroup.subtree_control"
        try:
            enable = self._enable(root_control, enable)
        except OSError as exc:
            # EBUSY: the hierarchy root has processes of its own (inside a container). Move ours aside.
            if exc.errno != errno.EBUSY:
                raise
            leaf = self.v2 / "init"
            leaf.mkdir(exist_ok=True)
            for attempt in range(ROOT_MOVE_ATTEMPTS):
                for pid in _read(self.v2 / "cgroup.procs").split():
                    try:
                        _write(leaf / "cgroup.procs", pid)
                    except OSError:
                        pass  # (gone, or a kernel thread: the write below says whether it matters)
                try:
                    enable = self._enable(root_control, enable)
                    break
                except OSError as again:
                    # A process forked meanwhile, or the kernel not yet done with the moves.
                    if again.errno != errno.EBUSY or attempt == ROOT_MOVE_ATTEMPTS - 1:
                        raise
                    time.sleep(0.05)
        return self._enable(base / "cgroup.subtree_control", enable)

    @staticmethod
    def _enable(control: Path, enable: str) -> str:
        """Write `enable` to a cgroup.subtree_control; what was enabled. The cpu controller
        is optional: a kernel may refuse it alone (real-time tasks outside the root, with
        CONFIG_RT_GROUP_SCHED), and then jobs run without a core cap, not not at all."""
        try:
            _write(control, enable)
            return enable
        except OSError as exc:
            if exc.errno == errno.EBUSY or "+cpu" not in enable.split():
                raise
            without_cpu = " ".join(c for c in enable.split() if c != "+cpu")
            _write(control, without_cpu)
            log.warning("%s refused the cpu controller (%s): jobs run without a one-core cap", control, exc)
            return without_cpu

    @functools.cached_property
    def supervisor_procs_files(self) -> list[str]:
        """Where nsjail moves once it has made a jail (JobCgroup.release_supervisor): the
        deployment's `supervisor` folders, the cgroup2 one first."""
        base = self._v2_base()
        folders = ([base / "supervisor"] if base is not None else []) + [
            root / self.name / "supervisor" for root in self.v1_roots()
        ]
        return [f"{folder}/cgroup.procs" for folder in folders]

    @functools.cached_property
    def supervisor_procs(self) -> _KeptWriters:
        """The supervisor folders' cgroup.procs, opened once for the worker's life: every
        sandbox writes to them, and an open waits behind other sandboxes' cgroup churn."""
        return _KeptWriters(self.supervisor_procs_files)

    def v1_roots(self) -> list[Path]:
        """Each v1 hierarchy sandboxes use, once (cpuacct is usually co-mounted with cpu)."""
        roots: list[Path] = []
        for root in (self.v1_memory, self.v1_pids, self.v1_cpu, self.v1_cpuacct):
            if root is not None and root not in roots:
                roots.append(root)
        return roots

    def job(self, job_id: str) -> JobCgroup:
        return JobCgroup(self, job_id)

    def job_ids(self) -> set[str]:
        """Names of the sandbox cgroups that exist on this host (any worker's)."""
        dirs: list[Path] = []
        base = self._v2_base()
        if base is not None:
            dirs.append(base / "jobs")
        dirs += [root / self.name for root in self.v1_roots()]
        names: set[str] = set()
        for d in dirs:
            if d.is_dir():
                names.update(c.name for c in d.iterdir() if c.is_dir() and c.name not in ("supervisor", "jobs"))
        return names


def detect_layout(name: str, mounts_text: str | None = None) -> CgroupLayout:
    """Work out which cgroup layout this host has, or say why sandboxing is impossible."""
    if mounts_text is None:
        mounts_text = _read(Path("/proc/self/mounts"))
    v2, v1 = _mounts(mounts_text)
    if v2 is not None and "memory" not in v1 and "pids" not in v1:
        controllers = set(_read(v2 / "cgroup.controllers").split()) if (v2 / "cgroup.controllers").exists() else set()
        if {"memory", "pids"} <= controllers:
            return CgroupLayout(mode=CgroupMode.V2, name=name, v2=v2)
        raise CgroupError(
            f"cgroup v2 at {v2} does not offer the memory and pids controllers (has: {' '.join(sorted(controllers)) or 'none'}); "
            "the worker cannot enforce memory and process limits"
        )
    if "memory" in v1 and "pids" in v1:
        if v2 is None and "cpuacct" not in v1:
            raise CgroupError(
                "cgroup v1 memory and pids are mounted, but neither a cgroup2 mount (cpu.stat) nor a v1 cpuacct "
                "hierarchy is: the worker could not count a job's CPU time, so cpuMs could not be enforced"
            )
        return CgroupLayout(
            mode=CgroupMode.HYBRID,
            name=name,
            v2=v2,
            v1_memory=v1["memory"],
            v1_pids=v1["pids"],
            v1_cpu=v1.get("cpu"),
            v1_cpuacct=v1.get("cpuacct") if v2 is None else None,
        )
    raise CgroupError(
        "neither cgroup v2 with memory+pids nor cgroup v1 memory and pids hierarchies are mounted; "
        "mount them (e.g. boot with systemd.unified_cgroup_hierarchy=1) so the worker can enforce limits"
    )


class JobCgroup:
    """The cgroups of one job: create with limits, enter, count, kill, remove."""

    def __init__(self, layout: CgroupLayout, job_id: str) -> None:
        self.layout = layout
        self.job_id = job_id
        # Folders and files as plain strings: pathlib's joins and conversions cost more than
        # the cgroup writes themselves, a few dozen of them for every sandbox made and removed.
        self.v2_dir = f"{layout.v2}/{layout.name}/jobs/{job_id}" if layout.v2 else None
        self.v1_dirs: dict[str, str] = {}
        for ctrl, root in (("memory", layout.v1_memory), ("pids", layout.v1_pids), ("cpu", layout.v1_cpu)):
            if root is not None:
                self.v1_dirs[ctrl] = f"{root}/{layout.name}/{job_id}"
        self._cpuacct = f"{layout.v1_cpuacct}/{layout.name}/{job_id}" if layout.v1_cpuacct else None
        self._cpu_stat = f"{self.v2_dir}/cpu.stat" if self.v2_dir is not None else None
        # Limit files and the values last written to them: a rewrite that changes nothing
        # (the CPU quota, swappiness when a job's limits go in) is skipped.
        self._written: dict[str, str] = {}
        # Removal errors already logged (folder, errno).
        self._remove_errors: set[tuple[str, int]] = set()
        # The CPU bandwidth cap last written, in cores (None: no cpu controller here).
        self.cpu_cap_cores: float | None = None
        # The memory limit last written (what a step in these cgroups may take of the
        # ceiling all jobs share: worker/isolation/memory.py).
        self.memory_limit_bytes = 0
        self._raising = threading.Lock()  # (see raise_memory_limit)
        # Open descriptors of the files a running job's clocks and kill use (see the module
        # docstring), by path; "w:" before the path for one opened to write. The lock keeps
        # close_files from racing a read: a closed descriptor's number can be reused at once,
        # and a read through it would see another file (pids to kill, say).
        self._fds: dict[str, int] = {}
        self._fds_lock = threading.Lock()
        self._writes_lock = threading.Lock()  # (see _limit; taken before _fds_lock)
        weakref.finalize(self, _close_fds, self._fds)
        # Where the kernel cannot tell the job's own memory peak (cgroup2 before 5.19 has no
        # memory.peak; before 6.12 it cannot be reset, so it holds a prestarted runtime's
        # warm-up), the step's clocks sample the usage (note_memory) and the peak is the
        # highest sample, unless the kernel's peak passed what it was at the reset
        # (`_peak_floor`): then that is the job's.
        self.samples_memory = False
        # Whether one OOM kill ends the whole job (v2's memory.oom.group): set_limits decides.
        self.oom_kills_whole_job = False
        self._peak_floor: int | None = None
        self._sampled_peak = 0

    def _has(self, path: str) -> bool:
        """Whether the optional file `path` (in one of this job's cgroups) exists on this host."""
        folder, _, name = path.rpartition("/")
        key = f"{folder.rpartition('/')[0]}/{name}"  # the job's folder is the only part that varies
        found = self.layout.optional_files.get(key)
        if found is None:
            found = os.path.exists(path)
            # Absent because this job's folder is (no longer, or not yet) there says nothing
            # about the host: only an answer from an existing folder is kept for every job.
            if found or os.path.isdir(folder):
                self.layout.optional_files[key] = found
        return found

    def _limit(self, path: str, value: str) -> None:
        # Through a kept descriptor: a sandbox's limits are written when it is made and again
        # when its job is loaded into it, and each open waits behind other sandboxes' churn.
        # A cgroup file takes each write whole, whatever the offset; at 0 for a plain file.
        # The write is under a lock of its own: a v1 memory limit's write may wait on the
        # host's memory cgroups, and the clocks' reads on the event loop must not wait for it.
        if self._written.get(path) != value:
            with self._writes_lock:
                with self._fds_lock:
                    fd = self._kept_fd(path, write=True)
                os.pwrite(fd, value.encode(), 0)
            self._written[path] = value

    def paths(self) -> list[Path]:
        return [Path(d) for d in self._all_dirs()]

    def _all_dirs(self) -> list[str]:
        dirs = list(self.v1_dirs.values())
        if self.v2_dir is not None:
            dirs.append(self.v2_dir)
        # cpuacct is usually co-mounted with cpu (`cpu,cpuacct`): then it is the same folder.
        if self._cpuacct is not None and self._cpuacct not in dirs:
            dirs.append(self._cpuacct)
        return dirs

    def create(self) -> None:
        """Make the cgroup folders. Raises OSError on failure."""
        for d in self._all_dirs():
            os.mkdir(d)
        if "memory" in self.v1_dirs:
            # What a new v1 memory cgroup starts with (no limit), known without reading it.
            self._written[f"{self.v1_dirs['memory']}/memory.limit_in_bytes"] = _V1_NO_MEMORY_LIMIT

    def open_counters(self) -> None:
        """Open the files a running job's clocks and end read (the counters, the cgroup2
        process list), so the event loop does not have to (see the module docstring)."""
        self.counters()
        if self.v2_dir is not None:
            try:
                self._read_kept(f"{self.v2_dir}/cgroup.procs")
            except OSError:
                pass  # opened when first needed

    def _kept_fd(self, path: str | Path, write: bool = False) -> int:
        """The open descriptor for `path`, opened now if need be (with the lock held).

        Opened to read, or with `write` to write; the memory peak file both ways where the
        kernel allows (see reset_memory_peak), so that one descriptor serves both.
        """
        key = ("w:" if write else "") + os.fspath(path)
        fd = self._fds.get(key)
        if fd is None:
            if write:
                fd = os.open(path, _WRITE_FLAGS, 0o666)
            elif os.path.basename(path) in _PEAK_FILES:
                try:
                    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                except PermissionError:
                    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)  # a read-only peak (v2 before 6.12)
            else:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self._fds[key] = fd
        return fd

    def _read_kept(self, path: str | Path) -> str:
        with self._fds_lock:
            return _pread_text(self._kept_fd(path))

    def close_files(self) -> None:
        """Close the descriptors kept open (a later read opens its file again)."""
        with self._writes_lock, self._fds_lock:
            fds = list(self._fds.values())
            self._fds.clear()  # the same dict the finaliser holds: nothing is closed twice
        for fd in fds:
            os.close(fd)

    def _kill_file(self) -> str | None:
        if self.v2_dir is not None and self._has(f"{self.v2_dir}/cgroup.kill"):
            return f"{self.v2_dir}/cgroup.kill"
        return None

    def raise_memory_limit(self, size: int) -> None:
        """Raise the memory limit (and v1's memory+swap with it) by `size` bytes. One raise at
        a time (two pumps may ask at once, on two isolation threads: v1 refuses a memory+swap
        limit below the memory limit another raise has just written)."""
        with self._raising:
            self._write_memory_limit(self.memory_limit_bytes + size)

    def _write_memory_limit(self, memory_bytes: int) -> None:
        """The memory limit, and on v1 memory+swap equal to it (swap off)."""
        if self.layout.mode is CgroupMode.V2:
            assert self.v2_dir is not None
            self._limit(f"{self.v2_dir}/memory.max", str(memory_bytes))
        else:
            mem = self.v1_dirs["memory"]
            memsw = f"{mem}/memory.memsw.limit_in_bytes"
            limit = f"{mem}/memory.limit_in_bytes"
            # v1 refuses memory > memsw: order the two writes so the pair is always valid.
            current = int(self._written.get(limit) or _read(limit))
            pairs = [(memsw, memory_bytes), (limit, memory_bytes)]
            if memory_bytes < current:
                pairs.reverse()
            for path, value in pairs:
                if path is limit or self._has(path):
                    self._limit(path, str(value))
        self.memory_limit_bytes = memory_bytes

    def set_limits(self, memory_bytes: int, pids: int, cpu_cores: float = 1.0, background: bool = False) -> None:
        """Write (or rewrite) the memory, process and CPU-bandwidth limits, swap off; with
        `background`, a low CPU weight (see BACKGROUND_CPU_SHARE), else the normal one."""
        quota = max(1000, int(CPU_PERIOD_US * cpu_cores))
        share = BACKGROUND_CPU_SHARE if background else 1.0
        self._write_memory_limit(memory_bytes)
        if self.layout.mode is CgroupMode.V2:
            assert self.v2_dir is not None
            if self._has(f"{self.v2_dir}/memory.swap.max"):  # (absent without swap accounting)
                self._limit(f"{self.v2_dir}/memory.swap.max", "0")
            self._limit(f"{self.v2_dir}/pids.max", str(pids))
            if self._has(f"{self.v2_dir}/cpu.max"):
                self._limit(f"{self.v2_dir}/cpu.max", f"{quota} {CPU_PERIOD_US}")
                self.cpu_cap_cores = quota / CPU_PERIOD_US
            if self._has(f"{self.v2_dir}/cpu.weight"):
                self._limit(f"{self.v2_dir}/cpu.weight", str(max(1, round(100 * share))))
            # Group OOM kills: one OOM ends the whole job instead of leaving a half-dead program.
            if self._has(f"{self.v2_dir}/memory.oom.group"):
                self._limit(f"{self.v2_dir}/memory.oom.group", "1")
                self.oom_kills_whole_job = True
            return
        mem = self.v1_dirs["memory"]
        if self._has(f"{mem}/memory.swappiness"):
            try:
                self._limit(f"{mem}/memory.swappiness", "0")
            except OSError:
                pass
        self._limit(f"{self.v1_dirs['pids']}/pids.max", str(pids))
        cpu = self.v1_dirs.get("cpu")
        if cpu is not None:
            self._limit(f"{cpu}/cpu.cfs_period_us", str(CPU_PERIOD_US))
            self._limit(f"{cpu}/cpu.cfs_quota_us", str(quota))
            self.cpu_cap_cores = quota / CPU_PERIOD_US
            self._limit(f"{cpu}/cpu.shares", str(max(2, round(1024 * share))))

    def copier_folder(self) -> str:
        """A memory cgroup beside this job's, under the ceiling all jobs share, for a copy
        into the job's workspace that the job's own limit must not hold (Sandbox.copy_in)."""
        memory = self.v1_dirs.get("memory") or self.v2_dir
        assert memory is not None  # (a layout without a memory controller is refused at start)
        return memory + ".copy"

    def make_copier_cgroup(self) -> str:
        """Create the copier's folder (one left by a copy whose worker died is taken over:
        it is empty, or this fails); its cgroup.procs. Raises OSError."""
        folder = self.copier_folder()
        try:
            os.mkdir(folder)
        except FileExistsError:
            os.rmdir(folder)
            os.mkdir(folder)
        return f"{folder}/cgroup.procs"

    def remove_copier_cgroup(self) -> None:
        """Remove the copier's folder once its copier is gone. What it wrote stays charged
        under the ceiling (to the folder's parent) until the workspace goes."""
        try:
            os.rmdir(self.copier_folder())
        except OSError as exc:
            log.warning("job %s: cannot remove its copier's cgroup: %s", self.job_id, exc)

    def procs_files(self) -> list[str]:
        """Files a launcher writes its own pid into before it execs nsjail.

        The v1 cpu cgroup comes last: it carries a warm sandbox's low CPU weight, and a move
        into a cgroup holds a lock that every fork and exit on the host waits on; the
        launcher makes its other moves at the worker's weight, not starved in mid-move.
        """
        cpu = self.v1_dirs.get("cpu")
        dirs = [d for d in self._all_dirs() if d != cpu] + ([cpu] if cpu is not None else [])
        return [f"{d}/cgroup.procs" for d in dirs]

    def release_supervisor(self, pid: int) -> None:
        """Move nsjail (pid) out of the job's cgroups, after it has created the jail."""
        try:
            self.layout.supervisor_procs.write_all(str(pid).encode())
        except ProcessLookupError:
            return
        except OSError as exc:
            if exc.errno == errno.ESRCH:
                return
            raise

    def counters(self, judge_ceiling: bool = True) -> JobCounters:
        """The counters, through the kept descriptors. After an OOM kill, `judge_ceiling`
        also decides `ceiling_oom`, which opens files afresh: off the event loop only."""
        oom_kills = self.oom_kills()
        return JobCounters(
            cpu_us=self.cpu_us(),
            memory_peak_bytes=self.memory_peak_bytes(),
            oom_kills=oom_kills,
            ceiling_oom=judge_ceiling and oom_kills > 0 and not self._own_memory_limit_reached(),
        )

    def cpu_us(self) -> int:
        try:
            if self._cpu_stat is not None:
                return _keyed(self._read_kept(self._cpu_stat)).get("usage_usec", 0)
            if self._cpuacct is not None:
                return int(self._read_kept(f"{self._cpuacct}/cpuacct.usage")) // 1000
        except (OSError, ValueError):
            pass
        return 0

    def memory_peak_bytes(self) -> int:
        try:
            if self.layout.mode is CgroupMode.V2:
                assert self.v2_dir is not None
                peak = f"{self.v2_dir}/memory.peak"
                if not self._has(peak):
                    return max(self._sampled_peak, int(self._read_kept(f"{self.v2_dir}/memory.current")))
                value = int(self._read_kept(peak))
                if self._peak_floor is not None and value <= self._peak_floor:
                    return self._sampled_peak  # (never above the warm-up's: sampled)
                return value
            return int(self._read_kept(f"{self.v1_dirs['memory']}/memory.max_usage_in_bytes"))
        except (OSError, ValueError):
            return 0

    def note_memory(self) -> None:
        """One sample of the usage, for a peak the kernel cannot tell (`samples_memory`)."""
        try:
            assert self.v2_dir is not None
            self._sampled_peak = max(self._sampled_peak, int(self._read_kept(f"{self.v2_dir}/memory.current")))
        except (OSError, ValueError):
            pass

    def memory_current_bytes(self) -> int:
        try:
            if self.layout.mode is CgroupMode.V2:
                assert self.v2_dir is not None
                return int(_read(f"{self.v2_dir}/memory.current"))
            return int(_read(f"{self.v1_dirs['memory']}/memory.usage_in_bytes"))
        except (OSError, ValueError):
            return 0

    def memory_resident_bytes(self) -> int:
        """The usage less the file cache charged here (reclaimable, and charged to whoever
        read a file first, so it differs with what other jobs left in the cache)."""
        current = self.memory_current_bytes()
        try:
            if self.layout.mode is CgroupMode.V2:
                assert self.v2_dir is not None
                stat, names = _read(f"{self.v2_dir}/memory.stat"), ("active_file", "inactive_file")
            else:
                stat, names = _read(f"{self.v1_dirs['memory']}/memory.stat"), ("total_active_file", "total_inactive_file")
            fields = dict(line.split(" ", 1) for line in stat.splitlines())
            cache = sum(int(fields[name]) for name in names)
        except (OSError, ValueError, KeyError):
            return current
        return max(0, current - cache)

    def reset_memory_peak(self) -> None:
        """Restart the peak from the current usage: v1 always; v2 on kernels ≥ 6.12, where a
        reset holds for the descriptor it was written through, which is the one the peak
        is then read through. Older v2 kernels cannot reset it (or have none): the peak is
        then sampled from here on (see `samples_memory`)."""
        v2 = self.layout.mode is CgroupMode.V2 and self.v2_dir is not None
        path = f"{self.v2_dir}/memory.peak" if v2 else f"{self.v1_dirs['memory']}/memory.max_usage_in_bytes"
        if v2 and not self._has(path):
            self.samples_memory = True  # (before 5.19)
        try:
            with self._fds_lock:
                os.pwrite(self._kept_fd(path), b"0", 0)
        except OSError:
            if v2 and self._has(path):
                self.samples_memory = True  # (before 6.12)
                try:
                    self._peak_floor = int(self._read_kept(path))
                except (OSError, ValueError):
                    self._peak_floor = None
        if self.samples_memory:
            self._sampled_peak = 0
            self.note_memory()

    def oom_kills(self) -> int:
        try:
            if self.layout.mode is CgroupMode.V2:
                assert self.v2_dir is not None
                return _keyed(self._read_kept(f"{self.v2_dir}/memory.events")).get("oom_kill", 0)
            return _keyed(self._read_kept(f"{self.v1_dirs['memory']}/memory.oom_control")).get("oom_kill", 0)
        except (OSError, ValueError):
            return 0

    def _own_memory_limit_reached(self) -> bool:
        """Whether the job's usage ever reached its own limit (asked after an OOM kill only).

        A kill counts in the victim's cgroup whichever limit ran out. v2 counts a limit
        reached where it was: the job's own `oom` events (its file has its own
        and its descendants', never its parent's). v1's failcnt cannot tell (with a
        memory+swap limit, which is checked first, this kernel counts neither), so v1 asks
        whether the peak of memory, or of memory+swap, came within OOM_NEAR_LIMIT_BYTES of
        its limit (a memory+swap peak from before start only errs towards the plain
        verdict). Unreadable: assume it was (the plain verdict).
        """
        try:
            if self.layout.mode is CgroupMode.V2:
                assert self.v2_dir is not None
                # (`max` counts reclaim at the limit too, which a job touching its limit
                # does without ever failing an allocation there.)
                return _keyed(_read(f"{self.v2_dir}/memory.events")).get("oom", 0) > 0
            mem = self.v1_dirs["memory"]
            for limit_name, peak_name in (
                ("memory.limit_in_bytes", "memory.max_usage_in_bytes"),
                # With swap, memory+swap can reach its (equal) limit with memory below it.
                ("memory.memsw.limit_in_bytes", "memory.memsw.max_usage_in_bytes"),
            ):
                limit_path = f"{mem}/{limit_name}"
                if limit_name != "memory.limit_in_bytes" and not self._has(limit_path):
                    continue
                limit = int(self._written.get(limit_path) or _read(limit_path))
                if int(_read(f"{mem}/{peak_name}")) >= limit - OOM_NEAR_LIMIT_BYTES:
                    return True
            return False
        except (OSError, ValueError):
            return True

    def _procs(self, d: str) -> str:
        # cgroup v1 keeps a cgroup.procs listing per open file and serves it again for a
        # second: only a fresh open reads it afresh. cgroup2 lists anew.
        return self._read_kept(f"{d}/cgroup.procs") if d == self.v2_dir else _read(f"{d}/cgroup.procs")

    def pids(self) -> list[int]:
        seen: set[int] = set()
        for d in self._all_dirs():
            try:
                seen.update(int(p) for p in self._procs(d).split())
            except (OSError, ValueError):
                continue
        return sorted(seen)

    def holds(self, pid: int) -> bool:
        """Whether `pid` is in the job's cgroups (see `listed`)."""
        try:
            return pid in self.listed()
        except OSError:
            return False

    def listed(self) -> list[int]:
        """The job's processes by one listing: enough, a jail's processes are in all of its
        folders (its launcher joined every one before nsjail's exec, or nothing ran). The
        cgroup2 one where there is one, read through its kept descriptor (pids() reads every
        listing, each v1 one opened afresh). Raises OSError."""
        d = self.v2_dir if self.v2_dir is not None else next(iter(self.v1_dirs.values()))
        return [int(p) for p in self._procs(d).split()]

    def may_hold_leftovers(self) -> bool:
        """After the jail has exited: whether a kill is needed to be sure nothing is left.

        Nothing should be: the jail's pid namespace ended with its first process, and no
        process can leave it. Where the cgroup2 tree lists every process of the job, one read
        through a kept descriptor shows that (cheap enough for the event loop), and the kill
        (whose write waits on the lock that other sandboxes' cgroup creation and removal
        hold) is needed only if it does not. Elsewhere only the kill is sure.
        """
        if self.v2_dir is not None:
            try:
                return bool(self._read_kept(f"{self.v2_dir}/cgroup.procs").split())
            except OSError:
                pass
        return True

    def kill(self) -> None:
        """SIGKILL every process of the job, however it detached or whatever it ignores.

        With cgroup.kill (cgroup2, kernel 5.14+, hybrid hosts too) the kernel does it all,
        forks made while it walks the tree included. Without it, each listed process is
        signalled through a pidfd, and only if it is still listed once the pidfd is open:
        a listed process may exit and its number go to a host process before the signal.
        """
        kill_file = self._kill_file()
        if kill_file is not None:
            try:
                with self._fds_lock:
                    os.write(self._kept_fd(kill_file, write=True), b"1")
                return
            except OSError as exc:
                # ENODEV: written through a descriptor kept from before the cgroup was removed.
                if exc.errno in (errno.ENOENT, errno.ENODEV):
                    return
                log.warning("job %s: cgroup.kill failed, signalling instead: %s", self.job_id, exc)
        self._signal_listed()

    def _signal_listed(self) -> None:
        pidfds: dict[int, int] = {}
        try:
            for pid in self.pids():
                try:
                    pidfds[pid] = os.pidfd_open(pid)
                except ProcessLookupError:
                    pass
            if not pidfds:
                return
            still = set(self.pids())
            for pid, pidfd in pidfds.items():
                if pid not in still:
                    continue  # gone since the first listing: the pidfd may be another process's
                try:
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                except PermissionError:
                    log.warning("job %s: cannot signal pid %s", self.job_id, pid)
        finally:
            for pidfd in pidfds.values():
                os.close(pidfd)

    def try_remove(self) -> bool:
        """Remove the job's cgroups (closing the kept descriptors once all are gone); False
        while some still hold processes."""
        leftover = False
        for d in self._all_dirs():
            try:
                os.rmdir(d)
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.EBUSY and (d, exc.errno) not in self._remove_errors:
                    # Once per folder and error: remove_blocking asks every 5 ms.
                    self._remove_errors.add((d, exc.errno))
                    log.warning("job %s: cannot remove %s: %s", self.job_id, d, exc)
                leftover = True
        if not leftover:
            self.close_files()
        return not leftover

    def remove_blocking(self, timeout_s: float = 2.0) -> bool:
        """Kill stragglers and remove the cgroups; True when all are gone (isolation threads only)."""
        deadline = time.monotonic() + timeout_s
        try:
            while not self.try_remove():
                if time.monotonic() > deadline:
                    log.error("job %s: cgroups still busy after %.1fs: pids %s", self.job_id, timeout_s, self.pids())
                    return False
                self.kill()
                time.sleep(0.005)
            return True
        finally:
            self.close_files()

    async def remove(self, timeout_s: float = 2.0) -> bool:
        """`remove_blocking` on the isolation threads."""
        return await off_loop(self.remove_blocking, timeout_s)
