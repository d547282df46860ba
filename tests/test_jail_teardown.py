"""A real sandbox factory in this process: jails that fail half-way are taken apart whole,
and a step's clocks rest on what this kernel really does.

The worker's own preflight builds the factory (self-test included), on a deployment of its
own, so these tests see exactly what a worker does; they need root, cgroups and nsjail.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import secrets
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from launcher.stack import remove_deployment
from shared.limits import DEFAULT_LIMITS
from shared.messages import CtrlMessage
from shared.settings import load_settings
from tests.helpers import pids_with_cmdline
from worker.__main__ import preflight
from worker.isolation.cgroups import JobCgroup
from worker.isolation.jail import JailError, Program
from worker.isolation.memory import MemoryAdmission
from worker.isolation.mounts import MS_NODEV, MS_NOSUID, mount
from worker.isolation.sandbox import SandboxFactory
from worker.isolation.workspace import Packed, Unpacking, detach_workspace, pack
from worker.job.supervise import Clocks, cpu_clock_due_at, supervise

pytestmark = [pytest.mark.sandbox]


@contextlib.asynccontextmanager
async def _factory(**env: str) -> AsyncIterator[SandboxFactory]:
    name = "coderunner-teardown-" + secrets.token_hex(3)
    settings = load_settings(
        {
            "PUSHER_SECRET": "x",
            "SANDBOX_CGROUP_NAME": name,
            "SANDBOX_WORK_ROOT": f"/run/{name}",
            "SANDBOX_UID_BASE": str(190000 + 10 * secrets.randbelow(1000)),
            "WORKER_MAX_SANDBOXES": "2",
            **env,
        }
    )
    built, _runtimes = await preflight(settings, "teardown")
    try:
        yield built
    finally:
        if built.forkserver is not None:
            built.forkserver.close()
        if built.uid_lease is not None:
            built.uid_lease.close()
        remove_deployment(name)


@pytest.fixture(params=["forked", "exec"])
async def factory(request: pytest.FixtureRequest) -> AsyncIterator[SandboxFactory]:
    """Jails forked by nsjail's fork server (what workers use), and exec'd behind `enter`
    (NSJAIL_FORKSERVER=0, or an nsjail built without one)."""
    async with _factory(NSJAIL_FORKSERVER="1" if request.param == "forked" else "0") as built:
        assert (built.forkserver is not None) == (request.param == "forked")
        yield built


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def test_a_jail_that_cannot_leave_its_cgroups_fails_fast_and_leaves_nothing(
    factory: SandboxFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Moving nsjail out of the job's cgroups failed: the build must end with a JailError at
    # once (not at the ready timeout), and the jail, its pipes, its status socket and its
    # cgroups must all go.
    sandbox = await factory.prepare("teardown", 0)  # warm the paths: descriptors opened once stay out of the count
    await sandbox.destroy()
    before = _open_fds()

    def refuse(self: JobCgroup, pid: int) -> None:
        raise OSError(errno.EBUSY, "refused by the test")

    monkeypatch.setattr(JobCgroup, "release_supervisor", refuse)
    started = time.monotonic()
    with pytest.raises(JailError, match="could not be moved out of the job's cgroups"):
        await factory.prepare("teardown", 0)
    assert time.monotonic() - started < factory.ready_timeout_s / 2
    assert _open_fds() == before
    assert pids_with_cmdline(b"nsjail", f"{factory.work_root}/".encode()) == []
    assert {n for n in factory.cgroups.job_ids() if n.startswith("teardown.")} == set()
    monkeypatch.undo()
    sandbox = await factory.prepare("teardown", 0)  # and the next one builds as usual
    await sandbox.destroy()
    assert _open_fds() == before


async def test_a_jail_is_seen_inside_its_cgroups_after_the_release_by_one_listing(
    factory: SandboxFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once nsjail is moved out of the job's cgroups, the jail must still be in them: one
    listing says so (its launcher joined every folder before nsjail's exec, or nothing ran),
    the cgroup2 one through its kept descriptor, no v1 listing opened afresh. A release that
    took the jail out with nsjail (here, by the test) fails the build."""
    opened: list[str] = []
    real_open = os.open

    def counting_open(path: str | os.PathLike[str], flags: int, mode: int = 0o777, **kwargs: object) -> int:
        opened.append(os.fspath(path))
        return real_open(path, flags, mode, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", counting_open)
    sandbox = await factory.prepare("listing", 0)
    monkeypatch.setattr(os, "open", real_open)
    try:
        listings = [path for path in opened if path.endswith("/cgroup.procs") and "/supervisor/" not in path]
        assert sandbox.cgroup.v2_dir is not None  # (this host: hybrid, with cgroup2)
        assert listings == [f"{sandbox.cgroup.v2_dir}/cgroup.procs"], listings
    finally:
        await sandbox.destroy()

    released = JobCgroup.release_supervisor

    def release_all(self: JobCgroup, pid: int) -> None:
        for other in self.pids():
            released(self, other)
        released(self, pid)

    monkeypatch.setattr(JobCgroup, "release_supervisor", release_all)
    with pytest.raises(JailError, match="jail is not inside the job's cgroups"):
        await factory.prepare("listing", 0)


def _mounts_on(path: str) -> int:
    return [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines()].count(path)


async def test_each_sandbox_of_a_slot_gets_a_fresh_tmpfs_on_the_slots_kept_mount_point(factory: SandboxFactory) -> None:
    """A slot's sandboxes mount their workspaces on one folder, kept between them (removing
    a folder just unmounted waits on the host's mount locks): each gets a tmpfs of its own,
    the teardown leaves nothing mounted there, a tmpfs some failed teardown left on it is
    taken off before the next goes on, another slot has another folder, and the folders go
    when the worker is done with them."""
    # The start-up self-test's slot (one past the last: WORKER_MAX_SANDBOXES is 2 here) is
    # never used again, so its folder went with it.
    assert not list(factory.work_root.glob("teardown.2.*"))
    first = await factory.prepare("slots", 0)
    where = str(first.workspace.path)
    try:
        first.workspace.stage([("mine.txt", b"the first sandbox's")])
        assert _mounts_on(where) == 1
    finally:
        await first.destroy()
    assert os.path.isdir(where) and _mounts_on(where) == 0
    # As if a teardown's detach had failed: a tmpfs still on the folder, with a file in it.
    mount("coderunner-ws", where, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m")
    with open(f"{where}/stale.txt", "w") as f:
        f.write("left over")
    second = await factory.prepare("slots", 0)
    other = await factory.prepare("slots", 1)
    try:
        assert str(second.workspace.path) == where
        assert _mounts_on(where) == 1 and os.listdir(where) == []  # nothing of before, nothing beneath
        assert str(other.workspace.path) != where and _mounts_on(str(other.workspace.path)) == 1
    finally:
        await second.destroy()
        await other.destroy()
    factory.remove_mount_points()
    assert not os.path.exists(where) and not other.workspace.path.exists()
    # A dead worker's folder with tmpfs stacked on it goes whole in the janitor's sweep.
    os.mkdir(where)
    for _ in range(3):
        mount("coderunner-ws", where, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m")
    detach_workspace(Path(where), Path("/proc/self/mounts").read_text())
    assert not os.path.exists(where) and _mounts_on(where) == 0


# Writes more than a pipe holds, leaves a child that would print later (its command line
# alone names it "left-behind"), and exits 3.
_LEAVES_A_CHILD = """
import subprocess, sys, time
sys.stdout.write("x" * 300000 + "\\n")
subprocess.Popen(["/usr/bin/python3", "-c", "import time; time.sleep(30); print('late')", "left-" + "behind"])
print("end", flush=True)
time.sleep(0.5)
sys.exit(3)
"""


async def test_a_step_ends_at_the_gates_report_without_waiting_for_nsjail(factory: SandboxFactory) -> None:
    # The gate reports once the program and all it left behind are dead; the step must end
    # there, with every byte of output, while nsjail has yet to take the jail apart (a few
    # ms of a job's latency). Here nsjail is stopped, so it cannot exit at all until the
    # test lets it go on: a step that waited for it would run into the wall clock.
    sandbox = await factory.prepare("teardown", 0)
    jail = sandbox.jail
    out: list[bytes] = []
    left: list[int] = []
    alive_at_report: list[bool] = []

    async def collect(data: bytes) -> None:
        out.append(data)

    reported = jail._on_status

    def on_status() -> None:
        if left:
            alive_at_report.append(os.path.exists(f"/proc/{left[0]}"))
        reported()

    jail._on_status = on_status  # type: ignore[method-assign]
    asyncio.get_running_loop().add_reader(jail._status_fd, on_status)  # (watched since launch)
    os.kill(jail.proc.pid, signal.SIGSTOP)
    try:
        step = asyncio.create_task(
            supervise(
                jail,
                sandbox.cgroup,
                Program(argv=["/usr/bin/python3", "-c", _LEAVES_A_CHILD], env={}),
                Clocks(wall_ms=30000, cpu_ms=30000, idle_ms=None),
                [(jail.stdout, collect), (jail.stderr, collect)],
                asyncio.Queue(),
            )
        )
        while not left and not step.done():
            await asyncio.sleep(0.02)
            left += pids_with_cmdline(b"left-behind")
        facts = await asyncio.wait_for(step, 15)
        assert not jail.exited  # the step did not wait for nsjail
    finally:
        os.kill(jail.proc.pid, signal.SIGCONT)
        await sandbox.destroy()
    assert (facts.exit.exit_code, facts.exit.signal, facts.fired) == (3, None, None)
    assert b"".join(out) == b"x" * 300000 + b"\nend\n"
    assert facts.duration_ms < 10000
    # The child it left was dead when the gate reported (the gate kills and reaps first).
    assert len(left) == 1 and alive_at_report == [False]


async def test_a_reported_gate_stays_until_it_is_let_go_and_only_then_is_the_jail_torn_down(
    factory: SandboxFactory,
) -> None:
    # The jail's teardown (its mount namespace goes with the gate, then nsjail exits) took
    # the CPU the worker needed to read the job's figures and store its result: the gate now
    # waits, idle and alone in the job's cgroups, until let_go (as the result is written), then goes.
    sandbox = await factory.prepare("linger", 0)
    jail = sandbox.jail
    try:
        facts = await asyncio.wait_for(
            supervise(
                jail,
                sandbox.cgroup,
                Program(argv=["/bin/sh", "-c", "exit 3"], env={}),
                Clocks(wall_ms=30000, cpu_ms=30000, idle_ms=None),
                [(jail.stdout, _discard), (jail.stderr, _discard)],
                asyncio.Queue(),
                feed_stdin=_no_stdin,
            ),
            15,
        )
        assert (facts.exit.exit_code, facts.exit.signal) == (3, None) and jail.reported
        await asyncio.sleep(0.3)
        gate = sandbox.cgroup.listed()
        assert len(gate) == 1 and not jail.exited and jail.proc.returncode is None, gate
        jail.let_go()
        ended = await asyncio.wait_for(jail.wait(), 5)
        assert (ended.exit_code, ended.signal) == (3, None)
        assert sandbox.cgroup.listed() == []
    finally:
        await sandbox.destroy()
    # wait() asked before the report lets the gate go as the report comes (the self-test's
    # way), and a destroy right after a report does the same: neither waits out a clock.
    for slot in (1, 2):
        sandbox = await factory.prepare("linger", slot)
        try:
            program = Program(argv=["/bin/sh", "-c", "sleep 0.3; exit 5"], env={})
            await sandbox.load([("main.sh", b":")], DEFAULT_LIMITS, program)
            assert sandbox.start(program)
            assert sandbox.jail.proc.stdin is not None
            sandbox.jail.proc.stdin.close()
            if slot == 1:
                assert not sandbox.jail.reported
                ended = await asyncio.wait_for(sandbox.jail.wait(), 5)
                assert (ended.exit_code, ended.signal) == (5, None)
            else:
                await asyncio.wait_for(asyncio.shield(sandbox.jail.ended), 5)
        finally:
            started = time.monotonic()
            await asyncio.wait_for(sandbox.destroy(), 10)
        assert sandbox.jail.exited and time.monotonic() - started < 2


async def test_a_prestarted_runtime_that_dies_in_its_warm_up_fails_the_build_at_once(factory: SandboxFactory) -> None:
    # Review: its gate reports and waits to be let go, nsjail keeps the pipes, so no EOF ends
    # the read of the ready marker: the build waited out ready_timeout_s (10 s) instead.
    from worker.isolation.sandbox import Prime, RuntimeFailed

    dies = Prime(
        language="sh",
        shim="sh",
        prefix=("/bin/sh", "-c"),
        program=Program(argv=["/bin/sh", "-c", "echo no runtime here >&2; exit 4"], env={}),
        workspace_files=(("unused", b""),),
    )
    started = time.monotonic()
    with pytest.raises(RuntimeFailed, match="no runtime here"):
        await asyncio.wait_for(factory.prepare("dies", 0, prime=dies), 20)
    assert time.monotonic() - started < 3


async def test_a_capped_step_never_gets_cpu_faster_than_its_cap_grants(factory: SandboxFactory) -> None:
    # The CPU clock leaves the counter unread until the cap could have let the budget be
    # spent (cpu_clock_due_at). Four spinning processes on this host's cores, sampled every
    # few ms: at no sample has the step used more than the bound allows, and the clock
    # still stops it at its budget.
    if (os.cpu_count() or 1) < 2:
        pytest.skip("on one CPU no number of spinners can outrun a one-core cap")
    sandbox = await factory.prepare("teardown", 0)
    cgroup = sandbox.cgroup
    if cgroup.cpu_cap_cores is None:
        await sandbox.destroy()
        pytest.skip("this host has no cpu controller: the CPU clock polls without a bound")
    assert cgroup.cpu_cap_cores == 1.0
    spin = Program(argv=["/bin/bash", "-c", "for i in 1 2 3 4; do (while :; do :; done) & done; wait"], env={})
    samples: list[tuple[float, float]] = []
    base_us, t0 = cgroup.cpu_us(), time.monotonic()

    async def silent(data: bytes) -> None:
        pass

    step = asyncio.create_task(
        supervise(
            sandbox.jail, cgroup, spin, Clocks(wall_ms=8000, cpu_ms=1500, idle_ms=None),
            [(sandbox.jail.stdout, silent), (sandbox.jail.stderr, silent)], asyncio.Queue(),
        )
    )  # fmt: skip
    try:
        while not step.done():
            samples.append((time.monotonic(), (cgroup.cpu_us() - base_us) / 1e6))
            await asyncio.sleep(0.004)
        facts = await step
    finally:
        await sandbox.destroy()
    assert facts.fired == "cpu" and 1500 <= facts.cpu_ms <= 1700, facts
    for at, used_s in samples:
        # Whatever was spent by `at` could have been spent by the earliest moment allowed.
        assert cpu_clock_due_at(t0, used_s, 1.0) <= at, (at - t0, used_s)
    # The spinners did saturate the cap: the bound was tested, not idled under.
    assert facts.cpu_ms >= 0.85 * facts.duration_ms, facts


async def test_a_cases_copy_of_a_compiled_program_is_charged_under_the_ceiling_not_to_the_case(
    factory: SandboxFactory,
) -> None:
    # A test case's copy of a big compiled program is written by a copier, as the job's uid,
    # in a memory cgroup of its own beside the case's, after the step's memory (and the
    # copy's) is admitted: its pages count under the ceiling all jobs share and in what the
    # admission holds, not in the worker's memory, nor in the case's own limit, which would
    # then hold room the program could free (by deleting the copy) and use itself.
    sandbox = await factory.prepare("teardown", 0)
    cgroup = sandbox.cgroup
    layout = cgroup.layout
    ceiling, usage = (f"{layout.v1_memory}/{layout.name}", "memory.usage_in_bytes") if layout.v1_memory else (f"{layout.v2}/{layout.name}", "memory.current")
    script = b'#!/bin/sh\necho ran "$@"\nexit 0\n' + b"#" * (8 << 20) + b"\n"
    packed = pack([("bin/prog", script), ("notes/a b.txt", b"hello")], frozenset({"bin/prog"}))
    limits = msgspec.structs.replace(DEFAULT_LIMITS, memory_mb=64)
    shell = "bin/prog 1 && stat -c '%a %u %s %n' bin/prog 'notes/a b.txt' && id -u && echo x > bin/new && cat 'notes/a b.txt'"
    program = Program(argv=["/bin/sh", "-c", shell], env={"PATH": "/usr/bin:/bin"})
    memory = MemoryAdmission(1 << 40)
    seen: dict[str, int] = {}
    out: list[bytes] = []

    async def collect(data: bytes) -> None:
        out.append(data)

    unpack = sandbox.workspace.unpack

    def unpack_and_look(packed: Packed, procs_files: list[str], unpacking: Unpacking | None = None) -> None:
        unpack(packed, procs_files, unpacking)
        folder = procs_files[0].rpartition("/")[0]  # (what the copier's folder holds, before it goes)
        seen["copier's"] = int(Path(folder, usage).read_text()) if folder.startswith(f"{ceiling}/") else -1

    sandbox.workspace.unpack = unpack_and_look  # type: ignore[method-assign]

    async def copy_in() -> None:
        seen["held"] = memory.held_bytes
        seen["case before"] = cgroup.memory_current_bytes()
        await sandbox.copy_in(packed)
        seen["case after"] = cgroup.memory_current_bytes()
        seen["folder left"] = os.path.exists(cgroup.copier_folder())

    try:
        await sandbox.load([], limits, program)
        facts = await supervise(
            sandbox.jail, cgroup, program, Clocks(wall_ms=10000, cpu_ms=5000, idle_ms=None),
            [(sandbox.jail.stdout, collect), (sandbox.jail.stderr, collect)], asyncio.Queue(),
            memory=memory, uncharged=sandbox.uncharged, before_go=copy_in, extra_memory_bytes=packed.charge_bytes,
        )  # fmt: skip
        limit = cgroup.memory_limit_bytes
    finally:
        await sandbox.destroy()
    assert (facts.exit.exit_code, facts.fired) == (0, None), (facts, out)
    assert len(script) + 5 <= packed.charge_bytes < len(script) + (64 << 10)
    assert seen["held"] == (64 << 20) + packed.charge_bytes and limit == 64 << 20
    # (v1's usage lags what was charged by the per-CPU batches of a few hundred KiB.)
    assert seen["copier's"] >= len(script) - (1 << 20), seen
    assert seen["case after"] - seen["case before"] < 1 << 20, seen
    assert not seen["folder left"]
    ran, prog, notes, uid, hello = b"".join(out).decode().splitlines()
    assert (ran, hello) == ("ran 1", "hello")
    assert prog == f"755 {uid} {len(script)} bin/prog" and notes == f"644 {uid} 5 notes/a b.txt"
    assert facts.memory_kb < 6 << 10, facts


async def test_a_kill_waiting_before_the_release_ends_a_real_jail_at_its_gate(factory: SandboxFactory) -> None:
    # The gate never opens: the jail's cgroup is killed while the gate waits for its frame,
    # nsjail ends, and the step reports a user kill with nothing run and nothing written.
    sandbox = await factory.prepare("teardown", 0)
    jail = sandbox.jail
    out: list[bytes] = []

    async def collect(data: bytes) -> None:
        out.append(data)

    inbox: asyncio.Queue[object] = asyncio.Queue()
    inbox.put_nowait(CtrlMessage(type="kill"))
    try:
        facts = await asyncio.wait_for(
            supervise(
                jail, sandbox.cgroup,
                Program(argv=["/bin/sh", "-c", "echo ran"], env={}),
                Clocks(wall_ms=30000, cpu_ms=30000, idle_ms=None),
                [(jail.stdout, collect), (jail.stderr, collect)], inbox,
            ),
            10,
        )  # fmt: skip
        assert jail.exited and sandbox.cgroup.pids() == []
    finally:
        await sandbox.destroy()
    assert facts.fired == "user" and facts.exit.exit_code is None and facts.exit.signal == "SIGKILL"
    assert out == [] and facts.duration_ms < 1000 and inbox.empty()


class _StuckCgroup:
    """A cgroup whose processes take `busy` removal tries to go."""

    def __init__(self, busy: int) -> None:
        self.job_id = f"stuck-{busy}"
        self.busy = busy
        self.tries = 0

    def remove_blocking(self, timeout_s: float = 2.0) -> bool:
        self.tries += 1
        return self.tries > self.busy


async def test_a_slot_waits_for_lingering_processes_before_it_is_rebuilt(monkeypatch: pytest.MonkeyPatch) -> None:
    # The destroy of a sandbox whose killed processes linger does not return (so its slot is
    # not rebuilt on the same uid beside them) until they are gone, or a minute has passed.
    from worker.isolation import sandbox as sandbox_module

    fake = type("S", (), {"name": "s"})()
    slow, quick = _StuckCgroup(busy=3), _StuckCgroup(busy=1)
    started = time.monotonic()
    await sandbox_module.Sandbox._remove_stragglers(fake, [slow, quick])  # type: ignore[arg-type]
    assert (slow.tries, quick.tries) == (4, 2) and time.monotonic() - started >= 0.25 + 0.5 + 1.0
    monkeypatch.setattr(sandbox_module, "STRAGGLER_WAIT_S", 0.5)
    never = _StuckCgroup(busy=1000)
    await asyncio.wait_for(sandbox_module.Sandbox._remove_stragglers(fake, [never]), 5)  # gives up, logged
    assert 2 <= never.tries <= 3


async def test_nsjails_own_time_limit_is_told_apart_from_a_kill(
    factory: SandboxFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nsjail runs quiet, so no log line says its time limit (the backstop behind our clocks)
    # fired: its SIGKILL, after the jail has lived that long, does. A jail killed sooner by
    # the same signal is not a backstop.
    from worker.isolation import sandbox as sandbox_module

    # The backstop is MAX_IDLE_S + 120 s + the longest wall time + 60 s: made 2 s here (and
    # the program is started all the same, though its wall clock is longer).
    monkeypatch.setattr(sandbox_module, "MAX_IDLE_S", 2 - 180 - factory.max_limits.wall_time_ms / 1000)
    monkeypatch.setattr("worker.job.supervise.BACKSTOP_ROOM_S", -60.0)
    sandbox = await factory.prepare("backstop", 0)
    jail = sandbox.jail
    try:
        assert jail._backstop_s == 2
        step = supervise(
            jail,
            sandbox.cgroup,
            Program(argv=["/bin/sleep", "30"], env={}),
            Clocks(wall_ms=30000, cpu_ms=30000, idle_ms=None),
            [(jail.stdout, _discard), (jail.stderr, _discard)],
            asyncio.Queue(),
        )
        facts = await asyncio.wait_for(step, 15)
    finally:
        await sandbox.destroy()
    assert (facts.exit.exit_code, facts.exit.signal, facts.exit.backstop_fired, facts.fired) == (None, "SIGKILL", True, None)
    # nsjail counts whole seconds from its own start, which comes before go().
    assert 500 <= facts.duration_ms < 10000


async def _discard(data: bytes) -> None:
    pass


async def test_a_plain_jail_whose_start_up_is_uncharged_has_room_for_it_under_its_cpu_maximum() -> None:
    # A plain jail running what a prestarted runtime would have adopted leaves the runtime's
    # start-up out of the job's charges, and its program's CPU rlimit gets that back: but the
    # jail's own rlimit (which caps the gate's) had no room over the maximum, so a busy job
    # at MAX_CPU_MS with a start-up of a second or more was SIGKILLed by the rlimit before its
    # CPU clock fired, and judged `completed` by a signal instead of `timed_out`.
    import msgspec

    from shared.limits import DEFAULT_LIMITS
    from worker.isolation.sandbox import Prime, StartupCost
    from worker.job.outcome import judge_run

    async with _factory(MAX_CPU_MS="2000") as factory:
        limits = msgspec.structs.replace(DEFAULT_LIMITS, cpu_ms=2000, wall_time_ms=20000, idle_ms=20000)
        program = Program(argv=["/bin/sh", "-c", "while :; do :; done"], env={}, **factory.program_rlimits(limits))
        stand_in = Prime(language="sh", shim="sh", prefix=("/bin/sh", "-c"), program=Program(argv=["/bin/sh", "-c", ":"], env={}))
        for _ in range(5):
            stand_in.startup.record(StartupCost(resident_bytes=0, cpu_ms=1200, wall_ms=5))
        sandbox = await factory.prepare("roomy", 0)
        try:
            await sandbox.load([("main.sh", b":")], limits, program, stand_in=stand_in)
            assert sandbox.uncharged.cpu_ms == 1200
            step = supervise(
                sandbox.jail,
                sandbox.cgroup,
                program,
                Clocks(wall_ms=limits.wall_time_ms, cpu_ms=limits.cpu_ms, idle_ms=None),
                [(sandbox.jail.stdout, _discard), (sandbox.jail.stderr, _discard)],
                asyncio.Queue(),
                uncharged=sandbox.uncharged,
            )
            facts = await asyncio.wait_for(step, 30)
        finally:
            await sandbox.destroy()
    assert facts.fired == "cpu" and judge_run(facts).outcome.value == "timed_out", facts


async def test_a_clock_kills_at_once_while_the_isolation_threads_are_busy() -> None:
    """The wall clock fires while all four isolation threads are taken by slow work (a
    teardown's retries, artifacts, big files): the kill does not wait for one of them. It
    used to, and the program ran on, past its clock, for as long as they were busy."""
    from worker.isolation.offload import off_loop_soon

    async with _factory() as factory:
        limits = msgspec.structs.replace(DEFAULT_LIMITS, wall_time_ms=300, idle_ms=None)
        program = Program(argv=["/bin/sh", "-c", "while :; do :; done"], env={}, **factory.program_rlimits(limits))
        sandbox = await factory.prepare("busy-threads", 0)
        try:
            await sandbox.load([("main.sh", b":")], limits, program)
            busy = [off_loop_soon(lambda: time.sleep(4)) for _ in range(4)]
            began = time.monotonic()
            facts = await asyncio.wait_for(
                supervise(
                    sandbox.jail, sandbox.cgroup, program, Clocks(wall_ms=300, cpu_ms=limits.cpu_ms, idle_ms=None),
                    [(sandbox.jail.stdout, _discard), (sandbox.jail.stderr, _discard)], asyncio.Queue(),
                ),
                30,
            )  # fmt: skip
            took = time.monotonic() - began
            await asyncio.gather(*busy)
        finally:
            await sandbox.destroy()
    assert facts.fired == "wall" and took < 2.0, (facts.fired, took)
    assert facts.cpu_ms < 1500, facts.cpu_ms


async def _a_step_after_the_jail_ended() -> tuple[object, object]:
    """A real sandbox whose jail is ended (its cgroup killed) before its go, then its step."""
    from worker.isolation.offload import off_loop
    from worker.job.outcome import judge_run

    async with _factory() as factory:
        sandbox = await factory.prepare("early", 0)
        try:
            await off_loop(sandbox.cgroup.kill)
            await asyncio.wait_for(sandbox.jail.wait(), 10)
            step = supervise(
                sandbox.jail,
                sandbox.cgroup,
                Program(argv=["/bin/echo", "hi"], env={}),
                Clocks(wall_ms=5000, cpu_ms=5000, idle_ms=None),
                [(sandbox.jail.stdout, _discard), (sandbox.jail.stderr, _discard)],
                asyncio.Queue(),
                feed_stdin=_no_stdin,
            )
            facts = await asyncio.wait_for(step, 15)
        finally:
            await sandbox.destroy()
    return facts, judge_run(facts)


async def _no_stdin(_activity: object) -> None:
    await asyncio.sleep(0)


async def test_a_jail_that_ended_before_its_go_ran_nothing_and_says_so() -> None:
    # nsjail's backstop during a long wait for memory, or the ceiling's OOM killer, can end a
    # jail before its go: the step was judged `completed` by SIGKILL (the stock loop), and
    # the job `lost` (uvloop's pipe raises on the go; the worker runs uvloop), for a program
    # that never ran: the platform failed before user code, which is internal_error.
    from shared.messages import Outcome

    facts, verdict = await _a_step_after_the_jail_ended()
    assert verdict.outcome is Outcome.INTERNAL_ERROR, verdict  # type: ignore[attr-defined]
    assert facts.exit.program_ran is False and facts.fired is None, facts  # type: ignore[attr-defined]


def test_a_jail_that_ended_before_its_go_ran_nothing_under_uvloop_too() -> None:
    import uvloop

    from shared.messages import Outcome

    facts, verdict = uvloop.run(_a_step_after_the_jail_ended())
    assert facts.exit.program_ran is False, facts  # type: ignore[attr-defined]
    assert verdict.outcome is Outcome.INTERNAL_ERROR, verdict  # type: ignore[attr-defined]


async def test_a_jail_too_close_to_its_own_time_limit_runs_nothing(
    factory: SandboxFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # nsjail's time limit counts from the jail's start; a step that waited long for memory
    # (or a sandbox that sat ready for long) may no longer have its wall clock left under it:
    # nsjail SIGKILLed the program part-way and it was judged timed_out at a fraction of its
    # wall clock. Nothing is started then, and the platform says it failed (internal_error:
    # the job is safe to submit again).
    from shared.messages import Outcome
    from worker.isolation import sandbox as sandbox_module
    from worker.job.outcome import judge_run

    # The backstop is MAX_IDLE_S + 120 s + the longest wall time + 60 s: made 12 s here.
    monkeypatch.setattr(sandbox_module, "MAX_IDLE_S", 12 - 180 - factory.max_limits.wall_time_ms / 1000)
    sandbox = await factory.prepare("aged", 0)
    said: list[bytes] = []

    async def keep(data: bytes) -> None:
        said.append(data)

    try:
        step = supervise(
            sandbox.jail,
            sandbox.cgroup,
            Program(argv=["/bin/echo", "ran"], env={}),
            Clocks(wall_ms=3000, cpu_ms=3000, idle_ms=None),
            [(sandbox.jail.stdout, keep), (sandbox.jail.stderr, keep)],
            asyncio.Queue(),
        )
        facts = await asyncio.wait_for(step, 15)
    finally:
        await sandbox.destroy()
    assert judge_run(facts).outcome is Outcome.INTERNAL_ERROR and said == [], (facts, said)
    assert facts.exit.program_ran is False and "time limit" in facts.exit.errors[0], facts
