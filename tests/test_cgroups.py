"""cgroup handling in both layouts, and the refusal to run when limits cannot be enforced.

This machine is hybrid (v1 memory/pids/cpu + a v2 mount for cpu.stat and cgroup.kill), and
every other sandbox test exercises that layout for real. A pure v2 host cannot be made here
(the memory and pids controllers are bound to v1), so the v2 code path runs against a
fabricated cgroup2 tree: it proves what the worker writes and reads, not the kernel.
"""

from __future__ import annotations

import errno
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from launcher.stack import Stack, remove_deployment
from shared.paths import REPO_ROOT
from tests.conftest import StackFactory
from tests.helpers import Api, py_job
from worker.isolation.cgroups import CgroupError, CgroupLayout, CgroupMode, JobCgroup, detect_layout


def _fake_v2(root: Path) -> str:
    (root / "cgroup.controllers").write_text("cpuset cpu io memory hugetlb pids rdma misc\n")
    (root / "cgroup.subtree_control").write_text("")
    (root / "cgroup.procs").write_text("")
    return f"cgroup2 {root} cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n"


def test_pure_v2_limits_counters_and_kill(tmp_path: Path) -> None:
    layout = detect_layout("coderunner", _fake_v2(tmp_path))
    assert layout.mode is CgroupMode.V2
    layout.prepare(jobs_memory_bytes=3 << 30)
    base = tmp_path / "coderunner"
    assert (base / "jobs").is_dir() and (base / "supervisor").is_dir()
    assert (base / "jobs" / "memory.max").read_text() == str(3 << 30)  # all jobs together
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (base / "jobs" / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"

    job = layout.job("w.0.1")
    job.create()
    d = base / "jobs" / "w.0.1"
    for name in ("cpu.max", "cpu.weight", "memory.oom.group", "cgroup.kill", "memory.swap.max"):
        (d / name).write_text("")
    job.set_limits(memory_bytes=128 << 20, pids=33, background=True)
    assert (d / "cpu.weight").read_text() == "6"  # a warm sandbox being built yields the CPU
    job.set_limits(memory_bytes=128 << 20, pids=33)
    assert (d / "cpu.weight").read_text() == "100"  # a loaded job runs at the normal weight
    assert (d / "memory.max").read_text() == str(128 << 20)
    assert (d / "memory.swap.max").read_text() == "0"  # swap off: an OOM kill, never thrashing
    assert (d / "pids.max").read_text() == "33"
    assert (d / "cpu.max").read_text() == "100000 100000"  # one core
    assert (d / "memory.oom.group").read_text() == "1"  # an OOM ends the whole job
    assert job.procs_files() == [str(d / "cgroup.procs")]

    (d / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    (d / "memory.peak").write_text(str(100 << 20))
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 7\noom 1\noom_kill 1\noom_group_kill 1\n")
    counters = job.counters()
    assert (counters.cpu_us, counters.memory_peak_bytes, counters.oom_kills) == (2_500_000, 100 << 20, 1)
    assert not counters.ceiling_oom  # its own limit was reached
    # Killed without ever reaching its own limit: the ceiling on all jobs (jobs/memory.max).
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 1\noom_group_kill 1\n")
    assert job.counters().ceiling_oom

    (d / "cgroup.procs").write_text("")
    job.kill()
    assert (d / "cgroup.kill").read_text() == "1"


def test_a_limit_write_that_waits_never_holds_up_the_clocks_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pump raising a job's memory limit writes on an isolation thread (a v1 limit's write
    may wait on the host's memory cgroups) while the clocks read the counters on the event
    loop through the same kept descriptors: the read must not wait for the write."""
    layout = detect_layout("coderunner", _fake_v2(tmp_path))
    layout.prepare(jobs_memory_bytes=3 << 30)
    job = layout.job("w.0.1")
    job.create()
    (tmp_path / "coderunner" / "jobs" / "w.0.1" / "cpu.stat").write_text("usage_usec 2500000\n")
    job.set_limits(memory_bytes=128 << 20, pids=33)
    assert job.cpu_us() == 2_500_000
    writing, release = threading.Event(), threading.Event()
    real_pwrite = os.pwrite

    def slow_pwrite(fd: int, data: bytes, offset: int) -> int:
        writing.set()
        release.wait(10)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", slow_pwrite)
    raising = threading.Thread(target=job.raise_memory_limit, args=(1 << 20,))
    raising.start()
    try:
        assert writing.wait(5)
        read: list[int] = []
        reader = threading.Thread(target=lambda: read.append(job.cpu_us()), daemon=True)
        reader.start()
        reader.join(2)
        assert read == [2_500_000], "the counters' read waited for the limit's write"
    finally:
        release.set()
        raising.join(5)
    assert job.memory_limit_bytes == (128 << 20) + (1 << 20)


@pytest.mark.parametrize("kernel", ["no memory.peak (before 5.19)", "memory.peak not resettable (before 6.12)"])
def test_v2_without_a_resettable_peak_samples_the_jobs_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    # Before 5.19 the peak was read from memory.current after the job (about 0: its
    # processes were gone); before 6.12 it kept a prestarted runtime's warm-up peak.
    layout = detect_layout("coderunner", _fake_v2(tmp_path))
    layout.prepare(jobs_memory_bytes=3 << 30)
    job = layout.job("w.0.1")
    job.create()
    d = tmp_path / "coderunner" / "jobs" / "w.0.1"
    (d / "memory.current").write_text(str(30 << 20))  # the waiting runtime
    no_peak = "before 5.19" in kernel
    if not no_peak:
        (d / "memory.peak").write_text(str(100 << 20))  # its warm-up

        def refused(fd: int, data: bytes, offset: int) -> int:
            raise OSError(9, "Bad file descriptor")  # opened read-only: the kernel has no reset

        monkeypatch.setattr(os, "pwrite", refused)
    job.reset_memory_peak()
    assert job.samples_memory
    for usage in (40, 60, 45):
        (d / "memory.current").write_text(str(usage << 20))
        job.note_memory()
    (d / "memory.current").write_text(str(1 << 20))  # the program is gone
    assert job.memory_peak_bytes() == 60 << 20
    if not no_peak:
        (d / "memory.peak").write_text(str(150 << 20))  # past the warm-up's: the job's own
        assert job.memory_peak_bytes() == 150 << 20


@pytest.mark.parametrize("co_mounted", [True, False])
def test_v1_without_cgroup2_uses_cpuacct_once_whether_or_not_it_shares_cpus_folder(
    tmp_path: Path, co_mounted: bool
) -> None:
    # Without a cgroup2 mount the CPU figure comes from cpuacct, which most hosts mount
    # together with cpu (one hierarchy, `cpu,cpuacct`): its folder must be made, joined and
    # removed once, not twice.
    roots = {c: tmp_path / c for c in ("memory", "pids", "cpu,cpuacct")}
    mounts = f"cgroup {roots['memory']} cgroup rw,memory 0 0\ncgroup {roots['pids']} cgroup rw,pids 0 0\n"
    if co_mounted:
        mounts += f"cgroup {roots['cpu,cpuacct']} cgroup rw,cpu,cpuacct 0 0\n"
    else:
        roots["cpu"], roots["cpuacct"] = tmp_path / "cpu", tmp_path / "cpuacct"
        mounts += f"cgroup {roots['cpu']} cgroup rw,cpu 0 0\ncgroup {roots['cpuacct']} cgroup rw,cpuacct 0 0\n"
    layout = detect_layout("coderunner", mounts)
    assert layout.mode is CgroupMode.HYBRID and layout.v2 is None and layout.v1_cpuacct is not None
    for root in roots.values():
        root.mkdir(exist_ok=True)
    layout.prepare()
    job = layout.job("w.0.1")
    job.create()
    procs = job.procs_files()
    assert len(procs) == len(set(procs)) == (3 if co_mounted else 4)
    assert layout.job_ids() == {"w.0.1"}
    usage = layout.v1_cpuacct / "coderunner" / "w.0.1" / "cpuacct.usage"
    usage.write_text("2500000000\n")
    assert job.cpu_us() == 2_500_000
    job.close_files()
    usage.unlink()  # a real cgroup's files go with its folder; this tree's are plain files
    assert job.try_remove()
    assert layout.job_ids() == set()
    # Swap on, with no memory+swap accounting: jobs could swap past their limits (refused at start).
    header = "Filename\tType\tSize\tUsed\tPriority\n"
    assert layout.swap_unbounded(header + "/swapfile\tfile\t1048572\t0\t-2\n")
    assert not layout.swap_unbounded(header)
    (roots["memory"] / "memory.memsw.limit_in_bytes").write_text("9223372036854771712\n")
    assert not layout.swap_unbounded(header + "/swapfile\tfile\t1048572\t0\t-2\n")


@pytest.mark.parametrize(
    ("memory_peak", "memsw_peak", "memsw", "ceiling"),
    [
        (64 << 20, 64 << 20, True, False),  # its own limit, reached
        ((64 << 20) - (512 << 10), 0, True, False),  # within a charge or two of it: its own
        (40 << 20, 40 << 20, True, True),  # far below both: the ceiling (or the host)
        (40 << 20, 64 << 20, True, False),  # swapped out: memory+swap reached its limit
        (40 << 20, 0, False, True),  # no swap accounting on this host
    ],
)
def test_v1_tells_an_oom_kill_at_the_jobs_own_limit_from_one_below_it(
    tmp_path: Path, memory_peak: int, memsw_peak: int, memsw: bool, ceiling: bool
) -> None:
    roots = {c: tmp_path / c for c in ("memory", "pids", "cpu,cpuacct")}
    mounts = "".join(f"cgroup {root} cgroup rw,{c} 0 0\n" for c, root in roots.items())
    for root in roots.values():
        root.mkdir()
    layout = detect_layout("coderunner", mounts)
    layout.prepare()
    job = layout.job("w.0.1")
    job.create()
    mem = roots["memory"] / "coderunner" / "w.0.1"
    (mem / "memory.limit_in_bytes").write_text(str(1 << 62))
    if memsw:
        (mem / "memory.memsw.limit_in_bytes").write_text(str(1 << 62))
    job.set_limits(memory_bytes=64 << 20, pids=8)
    (mem / "memory.max_usage_in_bytes").write_text(str(memory_peak))
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    if memsw:
        (mem / "memory.memsw.max_usage_in_bytes").write_text(str(memsw_peak))
    counters = job.counters()
    assert counters.oom_kills == 1 and counters.ceiling_oom is ceiling
    (mem / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    assert not job.counters().ceiling_oom  # no OOM kill: nothing to tell


@pytest.mark.parametrize(
    ("mounts", "reason"),
    [
        ("proc /proc proc rw 0 0\n", "neither cgroup v2"),
        ("cgroup /sys/fs/cgroup/memory cgroup rw,memory 0 0\n", "neither cgroup v2"),
        # Memory and pids, but nothing to count CPU time with: cpuMs would never fire.
        ("cgroup /m cgroup rw,memory 0 0\ncgroup /p cgroup rw,pids 0 0\ncgroup /c cgroup rw,cpu 0 0\n", "cpuMs could not"),
    ],
)
def test_layouts_that_cannot_enforce_limits_are_refused(mounts: str, reason: str) -> None:
    with pytest.raises(CgroupError, match=reason):
        detect_layout("coderunner", mounts)


def test_pure_v2_without_the_cpu_controller_runs_jobs_uncapped(tmp_path: Path) -> None:
    # Some hosts delegate memory and pids but not cpu: the worker starts, enables what is
    # there at every level, and its jobs run without a core cap, their CPU still counted.
    mounts = _fake_v2(tmp_path)
    (tmp_path / "cgroup.controllers").write_text("io memory pids\n")
    layout = detect_layout("coderunner", mounts)
    layout.prepare()
    base = tmp_path / "coderunner"
    for folder in (tmp_path, base, base / "jobs"):
        assert (folder / "cgroup.subtree_control").read_text() == "+memory +pids"
    job = layout.job("w.0.1")
    job.create()
    job.set_limits(memory_bytes=128 << 20, pids=33)
    d = base / "jobs" / "w.0.1"
    assert job.cpu_cap_cores is None and not (d / "cpu.max").exists()
    (d / "cpu.stat").write_text("usage_usec 1500000\n")
    assert job.cpu_us() == 1_500_000


@pytest.fixture
def cgroupfs_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Writes to the fake tree as cgroupfs takes them: a file the kernel did not make cannot
    be created by writing to it (EACCES); the writes are recorded."""
    from worker.isolation import cgroups

    written: list[tuple[str, str]] = []
    real = cgroups._write

    def write(path: str | Path, value: str) -> None:
        if not Path(path).exists():
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        written.append((str(path), value))
        real(path, value)

    monkeypatch.setattr(cgroups, "_write", write)
    return written


def test_v2_without_swap_accounting_builds_jobs_and_refuses_only_with_swap_on(
    tmp_path: Path, cgroupfs_writes: list[tuple[str, str]]
) -> None:
    # A kernel with swapaccount=0 (or built without swap) has no memory.swap.max: writing it
    # failed every sandbox. Without swap on there is nothing to bound; with it, the worker
    # must refuse to start, as on v1.
    layout = detect_layout("coderunner", _fake_v2(tmp_path))
    base = tmp_path / "coderunner"
    (base / "jobs").mkdir(parents=True)
    for folder in (base, base / "jobs"):
        (folder / "cgroup.subtree_control").write_text("")
    layout.prepare()
    job = layout.job("w.0.1")
    job.create()
    d = base / "jobs" / "w.0.1"
    for name in ("memory.max", "pids.max", "cgroup.procs"):
        (d / name).write_text("")
    job.set_limits(memory_bytes=128 << 20, pids=33)
    assert (d / "memory.max").read_text() == str(128 << 20) and not (d / "memory.swap.max").exists()
    swap_on = "Filename\tType\tSize\tUsed\tPriority\n/swapfile\tfile\t1048572\t0\t-2\n"
    assert not layout.swap_unbounded("Filename\tType\tSize\tUsed\tPriority\n")
    assert layout.swap_unbounded(swap_on)
    (base / "jobs" / "memory.swap.max").write_text("max")
    assert not layout.swap_unbounded(swap_on)


def test_v2_that_refuses_the_cpu_controller_still_enables_memory_and_pids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernel may refuse +cpu alone (real-time tasks outside the root cgroup): one write of
    # all three failed whole and the worker did not start; it runs jobs without a core cap.
    from worker.isolation import cgroups

    real = cgroups._write

    def write(path: str | Path, value: str) -> None:
        if "+cpu" in value.split():
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        real(path, value)

    monkeypatch.setattr(cgroups, "_write", write)
    layout = detect_layout("coderunner", _fake_v2(tmp_path))
    layout.prepare()
    base = tmp_path / "coderunner"
    for folder in (tmp_path, base, base / "jobs"):
        assert (folder / "cgroup.subtree_control").read_text() == "+memory +pids"


def test_a_v2_job_that_only_reclaimed_at_its_limit_and_died_of_the_ceiling_is_told_so(tmp_path: Path) -> None:
    # memory.events' `max` counts reclaim at the job's own limit too (page cache, say): a job
    # that touched its limit once, then was killed for the ceiling, got the plain verdict.
    layout = detect_layout("coderunner", _fake_v2(tmp_path))
    layout.prepare()
    job = layout.job("w.0.1")
    job.create()
    d = tmp_path / "coderunner" / "jobs" / "w.0.1"
    (d / "cpu.stat").write_text("usage_usec 1000\n")
    (d / "memory.peak").write_text(str(100 << 20))
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 0\noom_kill 1\noom_group_kill 1\n")
    assert job.counters().ceiling_oom


def test_in_a_container_the_jobs_ceiling_comes_from_its_memory_limit(tmp_path: Path) -> None:
    # A container's own cgroup namespace shows its limit on the root: the host's 64 GiB would
    # let the jobs take more than the container has, and its OOM killer pick the worker.
    from shared.settings import Settings
    from worker.__main__ import jobs_memory_bytes

    layout = detect_layout("coderunner", _fake_v2(tmp_path))
    meminfo = "MemTotal: 67108864 kB\n"
    assert layout.root_memory_limit_bytes() is None  # a host's real root has no limit
    (tmp_path / "memory.max").write_text("max\n")
    assert layout.root_memory_limit_bytes() is None
    (tmp_path / "memory.max").write_text(f"{4 << 30}\n")
    assert jobs_memory_bytes(Settings(), meminfo, layout.root_memory_limit_bytes()) == 3 << 30
    assert jobs_memory_bytes(Settings(), meminfo, None) == 56 << 30


@pytest.mark.parametrize("name", ["a/b", "..", "init", "-x", "a b"])
def test_a_cgroup_name_that_is_not_one_folder_is_refused(name: str) -> None:
    from shared.errors import ConfigError
    from shared.settings import load_settings

    with pytest.raises(ConfigError, match="SANDBOX_CGROUP_NAME"):
        load_settings({"PUSHER_SECRET": "x" * 16, "SANDBOX_CGROUP_NAME": name})


def test_a_cgroup2_mount_outside_the_workers_namespace_is_refused(tmp_path: Path) -> None:
    # A host's /sys/fs/cgroup bound into a container with a cgroup namespace of its own: the
    # worker could make folders there but never move a process into one.
    layout = detect_layout("coderunner", _fake_v2(tmp_path))
    def info(root: str) -> str:
        return f"30 23 0:27 {root} {tmp_path} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"

    layout.check_namespace(info("/"))
    layout.check_namespace(info("/docker/abc"))  # a part of the tree, inside it
    layout.check_namespace("")  # (not listed: nothing to tell)
    with pytest.raises(CgroupError, match="outside this process's cgroup namespace"):
        layout.check_namespace(info("/../../system.slice"))


def test_a_containers_root_still_busy_after_one_move_is_asked_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Inside a container the root cgroup holds processes: they are moved to /init and the
    # controllers asked again; one that forked meanwhile (or a kernel not done with the moves)
    # makes the root busy once more, which stopped the worker at the first retry.
    from worker.isolation import cgroups

    real, refusals = cgroups._write, [3]

    def write(path: str | Path, value: str) -> None:
        if Path(path) == tmp_path / "cgroup.subtree_control" and refusals[0]:
            refusals[0] -= 1
            raise OSError(errno.EBUSY, "Device or resource busy", str(path))
        real(path, value)

    monkeypatch.setattr(cgroups, "_write", write)
    (tmp_path / "cgroup.procs").write_text("")
    layout = detect_layout("coderunner", _fake_v2(tmp_path))
    layout.prepare()
    assert (tmp_path / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert (tmp_path / "init").is_dir()


def test_a_cgroup_that_cannot_be_removed_is_logged_once_not_every_try(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # remove_blocking asks every 5 ms for two seconds: a warning on each try was 400 lines a
    # second for one stuck folder, every upkeep round.
    layout = detect_layout("coderunner", _fake_v2(tmp_path))
    layout.prepare()
    job = layout.job("w.0.1")
    job.create()
    (tmp_path / "coderunner" / "jobs" / "w.0.1" / "stuck").write_text("")  # rmdir: not empty
    with caplog.at_level("WARNING", logger="worker.isolation.cgroups"):
        assert not any(job.try_remove() for _ in range(50))
    assert caplog.text.count("cannot remove") == 1, caplog.text


def test_v2_without_memory_and_pids_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu io\n")
    with pytest.raises(CgroupError, match="memory and pids"):
        detect_layout("coderunner", f"cgroup2 {tmp_path} cgroup2 rw 0 0\n")


@pytest.mark.sandbox
def test_worker_refuses_to_start_without_cgroups(tmp_path: Path) -> None:
    """End to end: the real worker, shown a host without cgroups, exits and says why."""
    mounts = tmp_path / "mounts"
    mounts.write_text("proc /proc proc rw 0 0\ntmpfs /tmp tmpfs rw 0 0\n")
    env = dict(os.environ, PUSHER_SECRET="x", SANDBOX_MOUNTS_FILE=str(mounts),
               SANDBOX_WORK_ROOT=str(tmp_path / "work"), SANDBOX_CGROUP_NAME="refusal-test")  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "worker"], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "cannot sandbox on this host" in proc.stderr
    assert "memory and pids" in proc.stderr or "neither cgroup v2" in proc.stderr
    # It never got as far as claiming: it refused before connecting to Redis at all.
    assert "ready" not in proc.stderr


def test_a_worker_refuses_a_host_whose_swap_no_cgroup_can_bound(tmp_path: Path) -> None:
    """End to end: cgroup v1 memory without swap accounting, and swap on. A job could swap
    past its memoryMb (and every slot thrash the host): the worker says so and stops."""
    roots = {c: tmp_path / c for c in ("memory", "pids", "cpu,cpuacct")}
    for root in roots.values():
        root.mkdir()
    mounts = tmp_path / "mounts"
    mounts.write_text("".join(f"cgroup {root} cgroup rw,{name} 0 0\n" for name, root in roots.items()))
    swaps = tmp_path / "swaps"
    swaps.write_text("Filename\tType\tSize\tUsed\tPriority\n/swapfile\tfile\t1048572\t0\t-2\n")
    env = dict(os.environ, PUSHER_SECRET="x", SANDBOX_MOUNTS_FILE=str(mounts), SANDBOX_SWAPS_FILE=str(swaps),
               SANDBOX_WORK_ROOT=str(tmp_path / "work"), SANDBOX_CGROUP_NAME="swap-test")  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "worker", "--check"], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 3, proc.stderr
    assert "swapaccount=1" in proc.stderr and "turn swap off" in proc.stderr
    # A kernel built without swap has no table: no swap, not a reason to refuse.
    from worker.__main__ import _swaps

    assert _swaps(str(tmp_path / "no-such-table")) == ""


@pytest.mark.sandbox
def test_worker_check_reports_the_hybrid_layout() -> None:
    env = dict(os.environ, PUSHER_SECRET="x", SANDBOX_WORK_ROOT="/run/coderunner-check-test", SANDBOX_CGROUP_NAME="coderunner-check-test")
    proc = subprocess.run([sys.executable, "-m", "worker", "--check"], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok: hybrid") or proc.stdout.startswith("ok: cgroup v2")
    for language in ("python", "c", "java", "rust"):
        assert language in proc.stdout
    remove_deployment("coderunner-check-test")


def test_warm_sandboxes_yield_the_cpu_to_running_jobs(stack: Stack, api: Api) -> None:
    """Hybrid, for real: the cgroups of sandboxes waiting in the pool carry the background
    CPU weight, and a job's own sandbox the normal one from its load on."""
    cpu_root = Path("/sys/fs/cgroup/cpu") / stack.deployment
    job = api.execute(py_job("import time\nprint('up', flush=True)\ntime.sleep(3)\n"))
    api.start(job)
    deadline = time.monotonic() + 20
    shares: dict[str, str] = {}
    while time.monotonic() < deadline:
        shares = {
            d.name: (d / "cpu.shares").read_text().strip()
            for d in cpu_root.iterdir()
            if d.is_dir() and d.name != "supervisor" and (d / "cgroup.procs").read_text().strip()
        }
        if "1024" in shares.values() and "64" in shares.values():
            break
        time.sleep(0.1)
    api.post(f"/v1/jobs/{job['jobId']}/kill")
    # The running job (normal weight) and at least one warm sandbox (1/16 of it) side by side.
    assert sorted(set(shares.values())) == ["1024", "64"], shares


def _spawn_into(files: list[str], program: str) -> subprocess.Popen[bytes]:
    """A Python child that joins the cgroups (their cgroup.procs `files`) before it runs `program`."""
    join = "".join(f"open({f!r}, 'w').write(str(os.getpid()))\n" for f in files)
    return subprocess.Popen([sys.executable, "-c", f"import os, time\n{join}{program}"])


def _joined(job: JobCgroup, children: list[subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
    """A sleeping stand-in (kept in `children`) that has joined `job`'s cgroups, and is all they hold."""
    child = _spawn_into(job.procs_files(), "time.sleep(30)")
    children.append(child)
    _wait_joined_everywhere(job, child.pid)
    return child


def _wait_joined_everywhere(job: JobCgroup, pid: int) -> None:
    """Until `pid` is all that every one of `job`'s folders lists. (pids() names it once the
    first folder does: a kill through cgroup.kill before its move into the cgroup2 one would
    miss it.)"""
    deadline = time.monotonic() + 10
    while not all(job._procs(d).split() == [str(pid)] for d in job._all_dirs()):
        assert time.monotonic() < deadline, "the stand-in never joined"
        time.sleep(0.01)


@contextmanager
def _host_cgroup(label: str) -> Iterator[tuple[CgroupLayout, JobCgroup, list[subprocess.Popen[bytes]]]]:
    """A job cgroup on this host's real hierarchies, in a deployment of its own, and a list
    for the children a test starts: all killed and removed at the end, however it ends."""
    name = f"coderunner-{label}-{os.getpid()}"
    layout = detect_layout(name)
    layout.prepare()
    job = layout.job("w.0.1")
    children: list[subprocess.Popen[bytes]] = []
    try:
        yield layout, job, children
    finally:
        for child in children:
            child.kill()
            child.wait()
        job.remove_blocking()
        remove_deployment(name)


@pytest.mark.sandbox
def test_kept_counter_descriptors_read_afresh_on_this_host() -> None:
    """Hybrid, for real: the clocks read the counters and the cgroup2 process list through
    descriptors opened once (open_counters), and each read is fresh; the cgroup v1 process
    lists are opened anew every time (a v1 cgroup.procs kept open serves a stale list for
    a second). may_hold_leftovers says so while anything is there, and not once nothing is; the
    descriptors are closed with the cgroups."""
    with _host_cgroup("kept-fds") as (_layout, job, children):
        _check_kept_descriptors(job, children)


def _fds_into(job: JobCgroup) -> set[str]:
    """What this process's descriptors open on files of `job`'s cgroups point at. Found by
    target, not by count: the count moves with whatever else the test process opens or its
    garbage collection closes."""
    return _fds_under(tuple(f"{d}/" for d in job.paths()))


def _fds_under(dirs: tuple[str, ...]) -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed since the listing (the listing's own descriptor, for one)
        if target.startswith(dirs):
            found.add(target)
    return found


def _check_kept_descriptors(job: JobCgroup, children: list[subprocess.Popen[bytes]]) -> None:

    def listed_everywhere(pid: int) -> bool:
        return all(str(pid) in (d / "cgroup.procs").read_text().split() for d in job.paths())

    def wait_until(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    job.create()
    job.set_limits(memory_bytes=256 << 20, pids=16)
    job.open_counters()
    assert _fds_into(job)  # the counters stay open
    peak_before = job.memory_peak_bytes()
    program = "data = b'x' * (8 << 20)\nwhile time.process_time() < 0.5: pass\ntime.sleep(30)"
    burner = _spawn_into(job.procs_files(), program)
    children.append(burner)
    wait_until(lambda: listed_everywhere(burner.pid), "the burner never joined every cgroup")
    first = job.cpu_us()
    wait_until(lambda: job.cpu_us() - first >= 200_000, "no fresh CPU figure through the kept descriptor")
    assert job.memory_peak_bytes() >= peak_before + (8 << 20)
    assert job.pids() == [burner.pid]
    # Listed at once in every hierarchy, v1 included, though pids() read them just now.
    late = _spawn_into(job.procs_files(), "time.sleep(30)")
    children.append(late)
    wait_until(lambda: listed_everywhere(late.pid), "the second process never joined every cgroup")
    assert set(job.pids()) == {burner.pid, late.pid}
    assert job.may_hold_leftovers()
    job.kill()
    assert burner.wait(5) == -9 and late.wait(5) == -9
    if job.v2_dir is not None:
        wait_until(lambda: not job.may_hold_leftovers(), "the emptied cgroup is still said to hold processes")
    else:
        assert job.may_hold_leftovers()  # no cgroup2 listing to read cheaply: only a kill is sure
    assert job.pids() == []
    # The peak restarts from the current usage when reset (through the descriptor the
    # peak is read through: on cgroup2 from 6.12 a reset holds only for that one).
    spike = _spawn_into(job.procs_files(), "data = b'x' * (32 << 20)\ndel data\ntime.sleep(30)")
    children.append(spike)
    wait_until(lambda: job.memory_peak_bytes() >= 32 << 20, "no 32 MiB peak")
    wait_until(lambda: job.memory_current_bytes() < 16 << 20, "the spike never freed its memory")
    job.reset_memory_peak()
    assert job.memory_peak_bytes() < 16 << 20
    job.kill()
    spike.wait(5)
    assert job.remove_blocking()
    assert not _fds_into(job)  # closed with the cgroups


@pytest.mark.sandbox
def test_making_loading_and_releasing_sandboxes_opens_each_cgroup_file_once_on_this_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Hybrid, for real: a sandbox's limits are written when it is made and rewritten when its
    job is loaded, through one descriptor a file; a new memory cgroup's limit is known, not
    read; the supervisor folders' process lists are opened once for every sandbox the worker
    makes. Each open of a cgroup file waits behind other sandboxes' cgroup churn. The files
    hold what was written last, and a released nsjail (a stand-in) is in the supervisor
    cgroups."""
    opened: list[str] = []
    read: list[str] = []
    real_open = os.open

    def counting_open(path: str | Path, flags: int, mode: int = 0o777, **kwargs: object) -> int:
        opened.append(os.fspath(path))
        if flags & os.O_ACCMODE == os.O_RDONLY:
            read.append(os.fspath(path))
        return real_open(path, flags, mode, **kwargs)  # type: ignore[arg-type]

    with _host_cgroup("opens") as (layout, job, children):
        second = layout.job("w.0.2")
        try:
            monkeypatch.setattr(os, "open", counting_open)
            for each in (job, second):
                each.create()
                each.set_limits(memory_bytes=256 << 20, pids=16, background=True)
                each.set_limits(memory_bytes=128 << 20, pids=33)
                monkeypatch.setattr(os, "open", real_open)
                stand_in = _joined(each, children)
                monkeypatch.setattr(os, "open", counting_open)
                each.release_supervisor(stand_in.pid)
            monkeypatch.setattr(os, "open", real_open)
            twice = sorted({path for path in opened if opened.count(path) > 1})
            assert not twice, twice
            assert sum(path in layout.supervisor_procs_files for path in opened) == len(layout.supervisor_procs_files)
            assert not [path for path in read if path.endswith("/memory.limit_in_bytes")]
            for each in (job, second):
                memory = Path(each.v1_dirs["memory"])
                assert (memory / "memory.limit_in_bytes").read_text().strip() == str(128 << 20)
                if (memory / "memory.memsw.limit_in_bytes").exists():
                    assert (memory / "memory.memsw.limit_in_bytes").read_text().strip() == str(128 << 20)
                assert (Path(each.v1_dirs["pids"]) / "pids.max").read_text().strip() == "33"
                assert (Path(each.v1_dirs["cpu"]) / "cpu.shares").read_text().strip() == "1024"
                assert each.pids() == []  # released: only jailed processes stay limited
            for procs in layout.supervisor_procs_files:
                listed = Path(procs).read_text().split()
                assert all(str(child.pid) in listed for child in children), procs
        finally:
            monkeypatch.setattr(os, "open", real_open)
            for child in children:
                child.kill()
                child.wait()
            second.remove_blocking()


@pytest.mark.sandbox
def test_a_supervisor_folder_made_again_is_written_to_afresh_on_this_host() -> None:
    """The supervisor folders' process lists stay open for the worker's life; when one is
    removed and made again (another worker of the deployment starting, an operator), the
    next release opens it afresh instead of failing every build from then on."""
    with _host_cgroup("supervisor-again") as (layout, job, children):
        job.create()
        first = _joined(job, children)
        job.release_supervisor(first.pid)
        first.kill()
        first.wait()
        for procs in layout.supervisor_procs_files:
            deadline = time.monotonic() + 10
            while Path(procs).read_text().split():
                assert time.monotonic() < deadline, f"{procs} never emptied"
                time.sleep(0.01)
            os.rmdir(os.path.dirname(procs))
        layout.prepare()  # the folders, made again
        second = _joined(job, children)
        job.release_supervisor(second.pid)
        for procs in layout.supervisor_procs_files:
            assert Path(procs).read_text().split() == [str(second.pid)], procs
        assert job.pids() == []


@pytest.mark.sandbox
def test_resident_memory_leaves_out_the_file_cache_charged_to_the_job(tmp_path: Path) -> None:
    """A prestarted runtime's memory base (what its job's limit is raised by) is its
    resident memory, not the file cache charged to its cgroup: that cache is reclaimable,
    and charged to whichever cgroup read a file first. Taken with the cache, a job that
    evicted shared toolchain pages made the next warm runtime's job a bigger limit."""
    data = tmp_path / "toolchain.bin"  # on disk: tmpfs pages are not file cache
    with open(data, "wb") as f:
        f.write(os.urandom(48 << 20))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # next read is the job's
    with _host_cgroup("resident") as (_layout, job, children):
        job.create()
        job.set_limits(memory_bytes=256 << 20, pids=16)
        reader = f"data = b'x' * (8 << 20)\nopen({str(data)!r}, 'rb').read()\nprint('ok', flush=True)\ntime.sleep(30)"
        children.append(_spawn_into(job.procs_files(), reader))
        deadline = time.monotonic() + 10
        while job.memory_current_bytes() < 56 << 20:
            assert time.monotonic() < deadline, f"the read was not charged here ({job.memory_current_bytes()} bytes)"
            time.sleep(0.05)
        time.sleep(0.2)  # the read's buffer is freed (the process sleeps)
        resident = job.memory_resident_bytes()
        assert 8 << 20 <= resident < 32 << 20, (resident, job.memory_current_bytes())


@pytest.mark.sandbox
def test_a_dropped_cgroup_closes_its_descriptors() -> None:
    """A JobCgroup dropped without its removal (a cancelled set-up) leaks no descriptor."""
    name = f"coderunner-dropped-{os.getpid()}"
    layout = detect_layout(name)
    layout.prepare()
    job = layout.job("w.0.1")
    try:
        job.create()
        job.open_counters()
        dirs = tuple(f"{d}/" for d in job.paths())
        assert _fds_under(dirs)
        del job
        gc.collect()
        assert not _fds_under(dirs)
    finally:
        remove_deployment(name)


@pytest.mark.sandbox
@pytest.mark.parametrize("with_cgroup_kill", [True, False])
def test_kill_ends_the_job_and_never_a_process_its_listing_no_longer_holds(with_cgroup_kill: bool) -> None:
    """Hybrid, for real, with and without cgroup.kill (a host without it is made by hiding
    the file). The job's processes die. A pid the listing gave but that is not the job's by
    the time of the signal (its number reused by a host process: here a stand-in, handed to
    the kill as if listed) is left alone."""
    with _host_cgroup(f"kill-{int(with_cgroup_kill)}") as (layout, job, children):
        job.create()
        if not with_cgroup_kill:
            assert job.v2_dir is not None
            layout.optional_files[f"{os.path.dirname(job.v2_dir)}/cgroup.kill"] = False
        assert (job._kill_file() is not None) is with_cgroup_kill
        inside = _spawn_into(job.procs_files(), "time.sleep(30)")
        bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        children += [inside, bystander]
        _wait_joined_everywhere(job, inside.pid)
        real_listing = job.pids
        listings = 0

        def pids() -> list[int]:
            # The first listing names the bystander too, as if it had taken a job process's number.
            nonlocal listings
            listings += 1
            return sorted({*real_listing(), bystander.pid}) if listings == 1 else real_listing()

        job.pids = pids  # type: ignore[method-assign]
        job.kill()
        assert inside.wait(5) == -9
        time.sleep(0.1)
        assert bystander.poll() is None, "a process outside the job was killed"
        assert job.remove_blocking()


def test_the_jobs_memory_ceiling_defaults_to_the_host_less_a_reserve() -> None:
    from shared.settings import Settings
    from worker.__main__ import jobs_memory_bytes

    meminfo = "MemTotal:       16777216 kB\nMemFree: 1 kB\n"  # 16 GiB: 2 GiB kept back
    assert jobs_memory_bytes(Settings(), meminfo) == 14 << 30
    assert jobs_memory_bytes(Settings(), "MemTotal: 2097152 kB\n") == 1 << 30  # at least 1 GiB kept
    assert jobs_memory_bytes(Settings(), "MemTotal: 524288 kB\n") == 256 << 20
    assert jobs_memory_bytes(Settings(sandbox_memory_total_mb=300), meminfo) == 300 << 20


@pytest.mark.stack
@pytest.mark.sandbox
def test_jobs_together_stay_under_the_deployments_memory_ceiling(make_stack: StackFactory) -> None:
    # Each job may use 256 MiB, but all of them together only 240. Two jobs of 256 MiB never
    # run at once (worker/isolation/memory.py): each holds 160 MiB, and both complete. One
    # that runs alone and passes the ceiling before its own limit is ended by the ceiling,
    # which its result says; and nothing outside the jails is ended.
    stack = make_stack(SANDBOX_MEMORY_TOTAL_MB="240", WORKER_MAX_SANDBOXES="2")
    v1 = Path("/sys/fs/cgroup/memory") / stack.deployment / "memory.limit_in_bytes"
    ceiling = v1 if v1.exists() else Path("/sys/fs/cgroup") / stack.deployment / "jobs" / "memory.max"
    assert int(ceiling.read_text()) == 240 << 20
    code = "import time\nblock = bytearray(160 << 20)\nfor i in range(0, len(block), 4096): block[i] = 1\nprint('held', flush=True)\ntime.sleep(1)\n"

    def holding(mib: int) -> str:
        return code.replace("160 << 20", f"{mib} << 20")

    big = {"memoryMb": 256, "wallTimeMs": 20000}
    with Api(stack) as api:
        jobs = [api.execute(py_job(code, limits=big)) for _ in range(2)]
        api.wait_state(jobs[1], {"parked", "queued"})
        for job in jobs:
            api.start(job)
        results = [api.wait_state(job, {"done", "error"})["result"] for job in jobs]
        assert [r["outcome"] for r in results] == ["completed", "completed"], results
        alone = api.execute(py_job(holding(250), limits=big))
        api.start(alone)
        ended = api.wait_state(alone, {"done", "error"})["result"]
        assert ended["outcome"] == "memory_exceeded" and ended["killedBy"] == "memory", ended
        assert "SANDBOX_MEMORY_TOTAL_MB" in ended["message"], ended
        # A job past its own limit says nothing of the ceiling.
        own = api.execute(py_job(code, limits={"memoryMb": 64, "wallTimeMs": 20000}))
        api.start(own)
        result = api.wait_state(own, {"done", "error"})["result"]
        assert result["outcome"] == "memory_exceeded" and "message" not in result, result
        # A batch's case says the same, in its test_result event (the result's own list
        # leaves the text out); a case past its own limit says nothing.
        batch = api.execute(py_job(holding(250), limits=big, tests=[{"name": "big"}]))
        own = api.execute(py_job(code, limits={"memoryMb": 64, "wallTimeMs": 20000}, tests=[{"name": "own"}]))
        api.start(batch)
        batch_result = api.wait_state(batch, {"done", "error"})["result"]
        api.start(own)
        own_case = api.wait_state(own, {"done", "error"})["result"]["tests"][0]
        assert batch_result["tests"][0]["outcome"] == "memory_exceeded" and "message" not in batch_result["tests"][0]
        (case,) = [data for name, data in api.replay(batch) if name == "test_result"]
    assert case["outcome"] == "memory_exceeded" and case["killedBy"] == "memory", case
    assert "SANDBOX_MEMORY_TOTAL_MB" in case["message"], case
    assert own_case["outcome"] == "memory_exceeded" and "message" not in own_case, own_case
    assert stack.dead_children() == [], "a process of the stack died"


def test_a_read_write_mount_beneath_a_bound_folder_is_refused() -> None:
    from worker.isolation.toolchains import ToolchainError, bind_sources, check_no_writable_submounts

    sources = bind_sources((REPO_ROOT / "sandbox-profiles" / "base.cfg").read_text(), ["/etc/alternatives"])
    assert "/usr" in sources and "/etc/alternatives" in sources and "/dev/null" not in sources
    info = "22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n"
    check_no_writable_submounts(sources, info + "40 22 0:40 / /usr/share/ro ro,relatime - tmpfs none ro\n")
    check_no_writable_submounts(sources, info + "41 22 0:41 / /usrlocal rw,relatime - tmpfs none rw\n")  # not beneath
    with pytest.raises(ToolchainError, match=r"/usr/local/my data is mounted read-write beneath /usr"):
        check_no_writable_submounts(sources, info + "42 22 0:42 / /usr/local/my\\040data rw,relatime - tmpfs none rw\n")


@pytest.mark.sandbox
def test_worker_refuses_a_host_with_a_writable_mount_under_usr(tmp_path: Path) -> None:
    """End to end, in a private mount namespace: a tmpfs over /usr/local/games (read-write,
    beneath /usr, which every jail binds read-only) makes the worker refuse to start."""
    env = dict(os.environ, PUSHER_SECRET="x", SANDBOX_WORK_ROOT=str(tmp_path / "work"), SANDBOX_CGROUP_NAME="submount-test")
    script = f"mount -t tmpfs none /usr/local/games && exec {sys.executable} -m worker --check"
    try:
        proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                              env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        remove_deployment("submount-test")
    assert proc.returncode == 3, proc.stderr
    assert "/usr/local/games is mounted read-write beneath /usr" in proc.stderr
