"""Worker pieces that need no services: cgroup layout detection, nsjail argv and log parsing."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import math
import os
import random
import select
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shared.messages import CompileInfo, CtrlMessage, JobState, Outcome, StdinFrame
from shared.settings import load_settings
from worker.callbacks.sender import CallbackSender
from worker.isolation.cgroups import CgroupError, CgroupMode, JobCounters, detect_layout
from worker.isolation.child import Child, PipeReader, _pipe_object, read_pipe
from worker.isolation.jail import Jail, JailError, JailExit, JailSpec, Program, build_argv
from worker.isolation.memory import UNBOUNDED_BYTES, MemoryAdmission
from worker.isolation.pool import SandboxPool
from worker.isolation.sandbox import MAX_IDLE_S, Prime, StartupCost, StartupCosts, Uncharged, build_enter
from worker.isolation.workspace import (
    PACKED_FROM_BYTES,
    SnapshotTooBig,
    Unpacking,
    Workspace,
    WorkspaceError,
    pack_if_big,
    tmpfs_charge,
)
from worker.job.events import JobEvents
from worker.job.flusher import MAX_PENDING_BYTES, OutputFlusher
from worker.job.outcome import judge_run
from worker.job.output import StreamTail
from worker.job.precompile import Precompile, PrecompileState
from worker.job.stdin import StdinFeed
from worker.job.supervise import COALESCE_S, Activity, Clocks, StepFacts, _pump, cpu_clock_due_at, supervise
from worker.messaging.queue import Advanced, LivePublish, StoredFrame
from worker.tasks import cancel_and_wait
from worker.worker import Worker

HYBRID = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0
cgroup /sys/fs/cgroup/cpuacct cgroup rw,relatime,cpuacct 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""


def test_hybrid_layout_is_recognised() -> None:
    layout = detect_layout("coderunner", HYBRID)
    assert layout.mode is CgroupMode.HYBRID
    assert layout.v1_memory == Path("/sys/fs/cgroup/memory") and layout.v1_pids == Path("/sys/fs/cgroup/pids")
    assert layout.v2 == Path("/sys/fs/cgroup/unified")
    job = layout.job("ab" * 16)
    files = job.procs_files()
    assert "/sys/fs/cgroup/memory/coderunner/" + "ab" * 16 + "/cgroup.procs" in files
    assert "/sys/fs/cgroup/unified/coderunner/jobs/" + "ab" * 16 + "/cgroup.procs" in files
    # The cgroup that carries the CPU weight is joined last (see JobCgroup.procs_files).
    assert files[-1] == "/sys/fs/cgroup/cpu/coderunner/" + "ab" * 16 + "/cgroup.procs"
    assert len(files) == len(set(files)) == 4


def test_pure_v2_without_controllers_is_refused(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpu io\n")
    with pytest.raises(CgroupError, match="memory and pids"):
        detect_layout("coderunner", f"cgroup2 {tmp_path} cgroup2 rw 0 0\n")


def test_pure_v2_with_controllers(tmp_path: Path) -> None:
    (tmp_path / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    layout = detect_layout("coderunner", f"cgroup2 {tmp_path} cgroup2 rw 0 0\n")
    assert layout.mode is CgroupMode.V2
    assert layout.job("ab" * 16).procs_files() == [str(tmp_path / "coderunner" / "jobs" / ("ab" * 16) / "cgroup.procs")]


def test_no_cgroups_at_all_is_refused_with_a_reason() -> None:
    with pytest.raises(CgroupError, match="neither"):
        detect_layout("coderunner", "proc /proc proc rw 0 0\n")


def test_nsjail_argv_is_a_list_and_starts_the_gate() -> None:
    spec = JailSpec(
        gate=Path("/run/coderunner/.gate-x"),
        enter=Path("/run/coderunner/.enter-x"),
        workspace=Path("/run/coderunner/x"),
        uid=61003,
        gid=61003,
        extra_mounts=["/opt/tool"],
        backstop_s=40,
        rlimit_cpu_s=16,
        rlimit_fsize_mb=64,
        rlimit_nofile=64,
    )
    argv = build_argv("/bin/nsjail", Path("/p/base.cfg"), spec, 9, 10, ["/cg/a/cgroup.procs", "/cg/b/cgroup.procs"])
    assert argv[:5] == ["/run/coderunner/.enter-x", str(os.getpid()), "2", "/cg/a/cgroup.procs", "/cg/b/cgroup.procs"]
    assert argv[5] == "/bin/nsjail"
    assert argv[argv.index("--user") + 1] == "65534:61003:1"
    assert argv[argv.index("--bindmount") + 1] == "/run/coderunner/x:/workspace"
    assert "/run/coderunner/.gate-x:/.coderunner/gate" in argv
    assert "/opt/tool" in argv
    assert argv[argv.index("--pass_fd") + 1] == "10"
    assert argv[argv.index("--") + 1 :] == ["/.coderunner/gate", "10"]


async def test_enter_joins_every_cgroup_before_it_execs(tmp_path: Path) -> None:
    """The compiled helper writes its pid to each procs file, then becomes the program."""
    enter = await build_enter(tmp_path)
    procs = [tmp_path / "a.procs", tmp_path / "b.procs"]
    for path in procs:
        path.write_text("")
    proc = await asyncio.create_subprocess_exec(
        str(enter), str(os.getpid()), "2", *map(str, procs), "/bin/sh", "-c", "echo $$",
        stdout=asyncio.subprocess.PIPE, env={},
    )
    out, _ = await proc.communicate()
    assert proc.returncode == 0
    pid = out.decode().strip()
    assert pid == str(proc.pid)  # exec'd in place: the shell is the very process that joined
    assert [path.read_text() for path in procs] == [f"{pid}\n", f"{pid}\n"]


@pytest.mark.parametrize(
    "args",
    [
        ["{me}", "1", "{missing}", "/bin/touch", "{marker}"],  # the cgroup write fails
        ["{me}", "3", "{ok}", "/bin/touch"],  # more procs files claimed than arguments
        ["{me}", "-1", "/bin/touch", "{marker}"],
        ["{me}", "x", "/bin/touch", "{marker}"],
        ["1", "0", "/bin/touch", "{marker}"],  # its parent is not the one named: the worker is gone
        ["x", "0", "/bin/touch", "{marker}"],
        ["0", "/bin/touch", "{marker}"],  # the pid left out
    ],
)
async def test_enter_refuses_a_bad_count_or_a_failed_write_before_exec(tmp_path: Path, args: list[str]) -> None:
    enter = await build_enter(tmp_path)
    marker = tmp_path / "ran"
    (tmp_path / "ok.procs").write_text("")
    paths = {
        "missing": tmp_path / "no-such-cgroup" / "cgroup.procs",
        "ok": tmp_path / "ok.procs",
        "marker": marker,
        "me": os.getpid(),
    }
    argv = [str(enter), *(arg.format(**paths) for arg in args)]
    proc = await asyncio.create_subprocess_exec(*argv, stderr=asyncio.subprocess.PIPE, env={})
    _, err = await proc.communicate()
    assert proc.returncode == 125, err
    assert not marker.exists()


async def test_what_enter_became_dies_with_the_process_that_spawned_it(tmp_path: Path) -> None:
    """A stand-in worker spawns `enter` from a helper thread, as the isolation threads do,
    then is SIGKILLed: the program enter exec'd (nsjail, in the worker) dies with it."""
    enter = await build_enter(tmp_path)
    worker = (
        "import os, subprocess, sys, threading, time\n"
        "def spawn():\n"
        f"    p = subprocess.Popen([{str(enter)!r}, str(os.getpid()), '0', '/bin/sleep', '60'],\n"
        "                         stdout=subprocess.DEVNULL, start_new_session=True)\n"
        "    print(p.pid, flush=True)\n"
        "    time.sleep(60)  # the signal follows the spawning thread: isolation threads live on\n"
        "threading.Thread(target=spawn).start()\n"
        "time.sleep(60)\n"
    )
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", worker, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    child = int(await asyncio.wait_for(proc.stdout.readline(), 10))
    async with asyncio.timeout(5):  # past the exec: the pid is sleep's now (a busy host takes a while)
        while not Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"/bin/sleep\0"):
            await asyncio.sleep(0.02)
    proc.kill()
    await asyncio.wait_for(proc.wait(), 5)
    deadline = time.monotonic() + 5
    # Reparented to init (or a subreaper), which reaps it; a zombie counts as dead.
    while Path(f"/proc/{child}").exists() and "zombie" not in Path(f"/proc/{child}/status").read_text():
        assert time.monotonic() < deadline, "the program outlived the process that spawned enter"
        await asyncio.sleep(0.02)


async def test_enter_looks_for_a_program_named_without_a_slash_on_path(tmp_path: Path) -> None:
    enter = await build_enter(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "say-hello").write_text("#!/bin/sh\necho hello \"$@\"\n")
    (bin_dir / "say-hello").chmod(0o755)
    env = {"PATH": f"{tmp_path / 'nowhere'}:{bin_dir}:/bin"}
    proc = await asyncio.create_subprocess_exec(
        str(enter), str(os.getpid()), "0", "say-hello", "there", stdout=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    out, _ = await proc.communicate()
    assert (proc.returncode, out) == (0, b"hello there\n")
    proc = await asyncio.create_subprocess_exec(
        str(enter), str(os.getpid()), "0", "no-such-program", stderr=asyncio.subprocess.PIPE, env=env,
    )  # fmt: skip
    _, err = await proc.communicate()
    assert proc.returncode == 127 and err.startswith(b"no-such-program: error 2"), err


async def test_the_jail_helpers_link_no_c_library(tmp_path: Path) -> None:
    """glibc's start-up alone (CPUID probing, a trip to the hypervisor each) cost each of
    them ~0.5 ms of CPU per jail on a VM; built bare they are a few KiB of their own code."""
    from worker.isolation.sandbox import GATE_SOURCE, _compile

    for binary in (await _compile(GATE_SOURCE, tmp_path, "gate"), await build_enter(tmp_path)):
        data = binary.read_bytes()
        assert len(data) < 64 * 1024, (binary, len(data))
        assert b"__libc_start_main" not in data and b"GLIBC" not in data
        assert b"/lib64/ld-linux" not in data  # no interpreter: nothing is loaded before _start


async def test_a_gate_that_is_not_init_signals_nothing_but_its_own(tmp_path: Path) -> None:
    """Outside a pid namespace the gate's end-of-job kill(-1) would reach every process its
    uid may signal on the host (every process, for root). Run as an unprivileged uid beside
    another process of that uid, the gate ends and leaves that process alone."""
    from worker.isolation.sandbox import GATE_SOURCE, _compile

    gate = await _compile(GATE_SOURCE, tmp_path, "gate")
    uid = "65531"
    neighbour = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "30"])
    try:
        await asyncio.sleep(0.2)  # (setpriv has exec'd sleep as that uid)
        status_read, status_write = os.pipe()
        proc = subprocess.run(
            ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", str(gate), str(status_write)],
            input=Program(argv=["/bin/true"], env={}).frame(), capture_output=True, pass_fds=(status_write,), timeout=10,
        )  # fmt: skip
        os.close(status_write)
        with os.fdopen(status_read, "rb") as status:
            assert (proc.returncode, status.read()) == (0, b"ready\nexit 0\n")
        assert neighbour.poll() is None, "the gate killed a process it did not start"
    finally:
        neighbour.kill()
        neighbour.wait()


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_off_loop_answers_raises_and_waits_out_a_cancelled_call(loop_kind: str) -> None:
    """The isolation threads' contract: the call's result or error reaches the caller on
    its loop, and a caller cancelled meanwhile returns only once the call is over (a
    cgroup being made must not be removed under it)."""
    from worker.isolation.offload import off_loop, off_loop_soon

    ended: list[str] = []

    def slow() -> None:
        time.sleep(0.2)
        ended.append("slow")

    def fails() -> None:
        raise OSError(16, "busy")

    async def main() -> None:
        assert await off_loop(lambda a, b: (a, b), 1, b=2) == (1, 2)
        name = await off_loop(lambda: threading.current_thread().name)
        assert name.startswith("isolation_") and name != threading.current_thread().name
        assert await asyncio.gather(*(off_loop(pow, 2, n) for n in range(8))) == [2**n for n in range(8)]
        with pytest.raises(OSError, match="busy"):
            await off_loop(fails)
        assert await off_loop_soon(lambda: 7) == 7
        task = asyncio.ensure_future(off_loop(slow))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert ended == ["slow"]  # (not before the call was over)

    _run_on(loop_kind, main())


def _raise_busy() -> None:
    raise OSError(16, "busy")


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_jobs_short_steps_have_a_thread_that_slow_isolation_work_never_holds_up(loop_kind: str) -> None:
    """off_loop_quick runs on its own thread, one call at a time and in order, with the
    same contract as off_loop; every general thread busy (a teardown waiting out
    stragglers, say) leaves it free."""
    from worker.isolation.offload import off_loop, off_loop_quick, off_loop_soon

    release = threading.Event()
    order: list[int] = []

    async def main() -> None:
        held = [asyncio.ensure_future(off_loop(release.wait, 10)) for _ in range(4)]
        try:
            await asyncio.sleep(0.05)
            name = await asyncio.wait_for(off_loop_quick(lambda: threading.current_thread().name), 2)
            assert name == "isolation-quick_0", name
            assert await asyncio.wait_for(off_loop_soon(lambda: 7, quick=True), 2) == 7
            await asyncio.gather(*(off_loop_quick(order.append, n) for n in range(20)))
            assert order == list(range(20))
            with pytest.raises(OSError, match="busy"):
                await off_loop_quick(_raise_busy)
            assert not any(task.done() for task in held)
        finally:
            release.set()
        assert await asyncio.gather(*held) == [True] * 4

    _run_on(loop_kind, main())


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_an_inbox_hands_its_items_in_order_to_futures_that_are_no_tasks(loop_kind: str) -> None:
    """Inbox.next() is `ensure_future(get())` without the task: items in order, each to one
    taker; what a taker took stays taken; a taker cancelled while it waited takes nothing;
    get(), get_nowait() and a drain that puts back (supervise's _take_kill) still work."""
    from worker.job.supervise import _has_kill, _take_kill
    from worker.messaging.inbox import Inbox, next_item

    async def main() -> None:
        inbox: Inbox[object] = Inbox()
        tasks_before = len(asyncio.all_tasks())
        inbox.put_nowait("a")
        first = next_item(inbox)
        assert first.done() and first.result() == "a" and inbox.empty()
        second, third = inbox.next(), inbox.next()
        assert not isinstance(second, asyncio.Task) and len(asyncio.all_tasks()) == tasks_before
        assert not second.done()
        inbox.put_nowait("b")
        inbox.put_nowait("c")
        inbox.put_nowait("d")
        assert second.result() == "b" and third.result() == "c" and inbox.qsize() == 1
        assert await asyncio.wait_for(inbox.get(), 1) == "d"
        gone = inbox.next()
        gone.cancel()
        after = inbox.next()
        inbox.put_nowait("e")
        assert gone.cancelled() and after.result() == "e" and inbox.empty()
        cancelled_alone = inbox.next()
        cancelled_alone.cancel()
        inbox.put_nowait("f")  # (nobody waits: it stays queued)
        assert inbox.get_nowait() == "f"
        # A get() waiting while the item goes to a taker waits on for the next one.
        getter = asyncio.ensure_future(inbox.get())
        await asyncio.sleep(0)
        taker = inbox.next()
        inbox.put_nowait("g")
        await asyncio.sleep(0)
        assert taker.result() == "g" and not getter.done()
        inbox.put_nowait("h")
        assert await asyncio.wait_for(getter, 1) == "h"
        # A kill among queued messages: found and left in place, then taken alone.
        inbox.put_nowait(CtrlMessage(type="start"))
        inbox.put_nowait(CtrlMessage(type="kill"))
        assert _has_kill(inbox) and inbox.qsize() == 2
        assert _take_kill(inbox) and inbox.qsize() == 1 and not _has_kill(inbox)
        assert inbox.next().result() == CtrlMessage(type="start")

    _run_on(loop_kind, main())


@pytest.fixture
def gate_dir(tmp_path: Path) -> Any:
    """`<tmp_path>/.gate`, which staging mounts a tmpfs on: unmounted afterwards."""
    folder = tmp_path / ".gate"
    folder.mkdir()
    yield folder
    if os.path.ismount(folder):
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


async def test_a_language_whose_mounted_folder_is_missing_is_not_offered(tmp_path: Path) -> None:
    """Java's manifest binds /etc/java-17-openjdk; on a host whose JDK is another (21, say)
    javac still answers its version probe. The folder missing must drop Java alone: binding
    it failed the worker's start, for every language."""
    import msgspec

    from shared.manifest import parse_manifest
    from shared.paths import REPO_ROOT
    from worker.runtimes import discover_runtimes

    pdir = REPO_ROOT / "sandbox-profiles" / "languages"
    python = parse_manifest((pdir / "python.toml").read_text(), "python.toml")
    java = parse_manifest((pdir / "java.toml").read_text(), "java.toml")
    elsewhere = msgspec.structs.replace(java, mounts=[str(tmp_path / "java-21-openjdk-is-here-instead")])
    found = await discover_runtimes([python, elsewhere])
    assert set(found) == {"python"}
    assert set(await discover_runtimes([python, java])) == {"python", "java"}  # (this host's is 17)


async def test_the_python_shim_runs_from_its_cache_as_from_its_source(tmp_path: Path, gate_dir: Path) -> None:
    """The bytecode made at start-up (python.toml's prestart_cache) serves a job exactly as
    the source does: same output, exit status, argv, and a traceback that starts at the
    job's file (the shim's frames are named by the source's path in the jail)."""
    from shared.manifest import parse_manifest
    from shared.paths import REPO_ROOT
    from worker.isolation.sandbox import build_prestart_caches

    pdir = REPO_ROOT / "sandbox-profiles"
    manifest = parse_manifest((pdir / "languages" / "python.toml").read_text(), "python.toml")
    assert manifest.prestart == "python.py" and manifest.prestart_cache is not None
    made = await build_prestart_caches(pdir, tmp_path, {"python.py": (manifest.prestart_cache, "3")})
    name, cached = made["python.py"]
    assert name == "python.pyc" and cached.parent == gate_dir
    again = await build_prestart_caches(pdir, tmp_path, {"python.py": (manifest.prestart_cache, "3")})
    assert again == made and cached.stat().st_mtime_ns == again["python.py"][1].stat().st_mtime_ns  # made once
    job = tmp_path / "job"
    job.mkdir()
    (job / "main.py").write_text("import sys\nprint(sys.argv, __name__, input())\ndef f():\n    1 / 0\nf()\n")
    env = {**manifest.env, "PATH": "/usr/bin:/bin", "HOME": str(job)}

    def run(shim: Path) -> tuple[int, bytes, bytes]:
        argv = ["/usr/bin/python3", "-u", str(shim)]
        frame = Program(argv=[*argv[:2], "main.py", "an arg"], env={}).frame()
        proc = subprocess.run(argv, input=frame + b"typed\n", capture_output=True, cwd=job, env=env, timeout=20)
        return proc.returncode, proc.stdout, proc.stderr

    code, out, err = run(cached)
    assert (code, out) == (1, b"['main.py', 'an arg'] __main__ typed\n"), err
    assert err.startswith(b"\0coderunner-prestart-ready\nTraceback (most recent call last):\n  File \"" + str(job / "main.py").encode())
    assert b"prestart" not in err.partition(b"ready\n")[2] and err.endswith(b"ZeroDivisionError: division by zero\n")
    assert run(pdir / "prestart" / "python.py") == (code, out, err)


async def test_a_shim_whose_cache_cannot_be_made_is_served_from_its_source(tmp_path: Path, gate_dir: Path) -> None:
    from shared.limits import DEFAULT_LIMITS
    from shared.manifest import PrestartCache
    from worker.isolation.sandbox import SandboxFactory, build_prestart_caches

    pdir = tmp_path / "profiles"
    (pdir / "prestart").mkdir(parents=True)
    (pdir / "prestart" / "s.py").write_text("pass\n")
    failing = PrestartCache(file="s.pyc", make=["/bin/sh", "-c", "echo no compiler here; exit 3"])
    silent = PrestartCache(file="s.pyc", make=["/bin/true"])  # says it worked, made nothing
    missing = PrestartCache(file="s.pyc", make=["/no/such/compiler"])
    for cache in (failing, silent, missing):
        assert await build_prestart_caches(pdir, tmp_path, {"s.py": (cache, "1")}) == {}
    assert not list(gate_dir.iterdir())
    factory = SandboxFactory(
        nsjail="nsjail", profiles_dir=pdir, work_root=tmp_path, gate=tmp_path, enter=tmp_path, cgroups=None,  # type: ignore[arg-type]
        uid_base=60000, max_limits=DEFAULT_LIMITS, prestart_shims={"s.py": pdir / "prestart" / "s.py"},
    )  # fmt: skip
    prime = factory.prime_for("py", ["/usr/bin/python3", "-u", "{entry}", "{args}"], "s.py", {}, DEFAULT_LIMITS)
    assert prime is not None and prime.program.argv[-1] == "/.coderunner/prestart/s.py"
    assert factory._shim_file("s.py") == pdir / "prestart" / "s.py"
    made = PrestartCache(file="s.pyc", make=["/bin/sh", "-c", "cp \"$0\" \"$1\"", "{shim}", "{out}"])
    factory.prestart_caches = await build_prestart_caches(pdir, tmp_path, {"s.py": (made, "1")})
    prime = factory.prime_for("py", ["/usr/bin/python3", "-u", "{entry}", "{args}"], "s.py", {}, DEFAULT_LIMITS)
    assert prime is not None and prime.program.argv[-1] == "/.coderunner/prestart/s.pyc"
    assert factory._shim_file("s.py") == factory.prestart_caches["s.py"][1]


async def test_the_gate_gives_the_program_its_frame_in_a_namespace_of_its_own(tmp_path: Path) -> None:
    """The frame's environment is merged into the gate's own as putenv(3) would (replaced
    in place, or appended), its rlimits are set, the program's
    end is reported, and what it left running is gone before the report. (Run in a pid
    namespace of its own: the gate, as init, signals every process it can see.)"""
    from worker.isolation.sandbox import GATE_SOURCE, _compile

    gate = await _compile(GATE_SOURCE, tmp_path, "gate")

    def run(program: Program) -> tuple[int, bytes, bytes]:
        status_read, status_write = os.pipe()
        try:
            proc = subprocess.run(
                ["unshare", "--pid", "--fork", "--kill-child", str(gate), str(status_write)],
                input=program.frame() + b"stdin after the frame",
                capture_output=True, pass_fds=(status_write,), timeout=10,
                env={"PATH": "/usr/bin:/bin", "KEEP": "1", "DROP": "x", "TWICE": "a"},
            )  # fmt: skip
        finally:
            os.close(status_write)
        with os.fdopen(status_read, "rb") as status:
            return proc.returncode, proc.stdout, status.read()

    env = {"TWICE": "b", "NEW": "x=y", "DROP": "gone", "EMPTY": ""}
    code, out, report = run(Program(argv=["/usr/bin/env"], env=env))
    assert (code, report) == (0, b"ready\nexit 0\n")
    assert out.decode().splitlines() == ["PATH=/usr/bin:/bin", "KEEP=1", "DROP=gone", "TWICE=b", "NEW=x=y", "EMPTY="]
    limits = Program(argv=["/bin/cat", "/proc/self/limits"], env={}, rlimit_cpu_s=3, rlimit_fsize_bytes=4096, rlimit_nofile=17)
    code, out, report = run(limits)
    rows = {line[:26].strip(): line[26:].split()[:2] for line in out.decode().splitlines()[1:]}
    assert rows["Max cpu time"] == ["3", "3"] and rows["Max file size"] == ["4096", "4096"]
    assert rows["Max open files"] == ["17", "17"] and rows["Max core file size"] == ["1", "1"]
    assert rows["Max pending signals"] == ["256", "256"] and rows["Max msgqueue size"] == ["0", "0"]
    code, out, report = run(Program(argv=["/bin/sh", "-c", "cat; sleep 60 & kill -9 $$"], env={}))
    assert (code, out, report) == (137, b"stdin after the frame", b"ready\nsignal 9\n")
    code, out, report = run(Program(argv=["/bin/sh", "-c", "exit 7"], env={}))
    assert (code, report) == (7, b"ready\nexit 7\n")
    code, out, report = run(Program(argv=["/no/such/program"], env={}))
    assert (code, report) == (127, b"ready\nexit 127\n")


def test_gate_frame_carries_argv_verbatim() -> None:
    program = Program(argv=["/usr/bin/python3", "main.py", "; rm -rf /", "a\nb"], env={"A": "1"}, rlimit_cpu_s=3)
    frame = program.frame()
    assert frame.startswith(b"CRG1")
    argc = struct.unpack_from("<I", frame, 4)[0]
    assert argc == 4
    offset, args = 8, []
    for _ in range(argc):
        (n,) = struct.unpack_from("<I", frame, offset)
        args.append(frame[offset + 4 : offset + 4 + n].decode())
        offset += 4 + n
    # A user-controlled argument stays one argv element; no shell ever parses it.
    assert args == program.argv
    assert struct.unpack_from("<QQQ", frame, len(frame) - 24) == (3, 0, 0)


class _StoredStdin:
    """The stdin stream as a feeder sees it, counting its reads."""

    def __init__(self, frames: list[StoredFrame]) -> None:
        self.frames = frames
        self.reads = 0

    async def stdin_frames(self, job_id: str, after_id: str | None, count: int = 64) -> list[StoredFrame]:
        self.reads += 1
        start = 0 if after_id is None else next(i for i, f in enumerate(self.frames) if f.id == after_id) + 1
        return self.frames[start : start + count]

    async def stdin_written(self, job_id: str, attempt: int, total_bytes: int, through_id: str) -> None:
        pass


class _Pipe:
    def __init__(self) -> None:
        self.data = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed


def test_a_frame_that_comes_after_the_jail_closed_stdin_is_dropped_not_an_error() -> None:
    # The jail's end closes the program's stdin (worker/isolation/child.py) a few ms before
    # the step stops the feeder; a frame in between must not fail the job. Under uvloop, as
    # the worker runs, a write to the closed pipe raises RuntimeError.
    import uvloop

    async def main() -> bytes:
        loop = asyncio.get_running_loop()
        read_end, write_end = os.pipe()
        transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, os.fdopen(write_end, "wb"))
        writer = asyncio.StreamWriter(transport, protocol, None, loop)
        inbox: asyncio.Queue[StdinFrame] = asyncio.Queue()
        inbox.put_nowait(StdinFrame(n=0, kind="data", data=base64.b64encode(b"a\n").decode(), id="1-0"))
        feed = StdinFeed(_StoredStdin([]), "job", 1, inbox, None, close_after_upfront=False, stored_before=0)  # type: ignore[arg-type]
        feeding = asyncio.create_task(feed.run(writer, Activity(0.0)))
        await asyncio.sleep(0.05)
        writer.close()  # the jail ended
        inbox.put_nowait(StdinFrame(n=1, kind="data", data=base64.b64encode(b"late\n").decode(), id="2-0"))
        inbox.put_nowait(StdinFrame(n=2, kind="close", data="", id="3-0"))
        await asyncio.wait_for(feeding, 5)
        with os.fdopen(read_end, "rb") as reader:
            return reader.read()

    assert uvloop.run(main()) == b"a\n"


async def test_frames_in_hand_reach_the_program_while_redis_is_slow_to_record_them() -> None:
    # Two lines typed quickly; Redis stalls on recording the first as written. The second
    # must still reach the program (it waits for it, printing nothing, so the idle clock
    # would end the job), and the records catch up with the latest count.
    class SlowToRecord(_StoredStdin):
        def __init__(self) -> None:
            super().__init__([])
            self.answer = asyncio.Event()
            self.recorded: list[tuple[int, str]] = []

        async def stdin_written(self, job_id: str, attempt: int, total_bytes: int, through_id: str) -> None:
            await self.answer.wait()
            self.recorded.append((total_bytes, through_id))

    stream = SlowToRecord()
    inbox: asyncio.Queue[StdinFrame] = asyncio.Queue()
    for n, line in enumerate([b"one\n", b"two\n", b"three\n"]):
        inbox.put_nowait(StdinFrame(n=n, kind="data", data=base64.b64encode(line).decode(), id=f"{n + 1}-0"))
    feed = StdinFeed(stream, "job", 1, inbox, None, close_after_upfront=False, stored_before=0)  # type: ignore[arg-type]
    pipe = _Pipe()
    feeding = asyncio.create_task(feed.run(pipe, Activity(0.0)))  # type: ignore[arg-type]
    try:
        async with asyncio.timeout(2):
            while pipe.data != b"one\ntwo\nthree\n":
                await asyncio.sleep(0.01)
        assert stream.recorded == []  # (Redis has not answered yet)
        stream.answer.set()
        inbox.put_nowait(StdinFrame(n=3, kind="close", data="", id="4-0"))
        await asyncio.wait_for(feeding, 2)
        async with asyncio.timeout(2):
            while not stream.recorded or stream.recorded[-1] != (14, "3-0"):
                await asyncio.sleep(0.01)
        assert stream.recorded in ([(4, "1-0"), (14, "3-0")], [(14, "3-0")]), stream.recorded
        # Once the step is over, a recording Redis is slow to answer is not waited for.
        stream.answer.clear()
        feed._unrecorded = (99, "9-0")
        feed._recorder = asyncio.create_task(feed._record())
        await asyncio.sleep(0.01)
        feed.stop()
        await asyncio.sleep(0.01)
        assert feed._recorder.cancelled()
    finally:
        feeding.cancel()


async def test_a_count_of_written_stdin_that_redis_did_not_take_is_recorded_later(monkeypatch: pytest.MonkeyPatch) -> None:
    # 64 KiB sent before start reach the program, and their one recording meets a Redis blip.
    # The count was dropped, to be fixed "by the next frame": but the API, still holding
    # the 64 KiB as pending, refused every next frame at its cap, and a program waiting for
    # input waited until its idle clock ended it.
    from redis.exceptions import ConnectionError as RedisConnectionError

    monkeypatch.setattr("worker.job.stdin.RECORD_RETRY_S", 0.01)

    class BlipOnce(_StoredStdin):
        def __init__(self) -> None:
            super().__init__([])
            self.calls = 0
            self.recorded: list[tuple[int, str]] = []

        async def stdin_written(self, job_id: str, attempt: int, total_bytes: int, through_id: str) -> None:
            self.calls += 1
            if self.calls <= 2:
                raise RedisConnectionError("Connection reset by peer")
            self.recorded.append((total_bytes, through_id))

    stream = BlipOnce()
    inbox: asyncio.Queue[StdinFrame] = asyncio.Queue()
    inbox.put_nowait(StdinFrame(n=0, kind="data", data=base64.b64encode(b"x" * 65536).decode(), id="1-0"))
    feed = StdinFeed(stream, "job", 1, inbox, None, close_after_upfront=False, stored_before=0)  # type: ignore[arg-type]
    pipe = _Pipe()
    feeding = asyncio.create_task(feed.run(pipe, Activity(0.0)))  # type: ignore[arg-type]
    try:
        async with asyncio.timeout(2):
            while not stream.recorded:
                await asyncio.sleep(0.01)
        assert stream.recorded == [(65536, "1-0")] and stream.calls == 3
    finally:
        feed.stop()
        feeding.cancel()


@pytest.mark.parametrize("stored_before", [None, 1, 0])
async def test_stdin_feeder_reads_the_stream_first_unless_nothing_was_stored(stored_before: int | None) -> None:
    stream = _StoredStdin([StoredFrame(id="1-0", n=0, kind="data", data=b"a\n")] if stored_before else [])
    inbox: asyncio.Queue[StdinFrame] = asyncio.Queue()
    if not stored_before:
        # Stored and published after the subscription: it comes through pub/sub.
        inbox.put_nowait(StdinFrame(n=0, kind="data", data=base64.b64encode(b"a\n").decode(), id="1-0"))
    inbox.put_nowait(StdinFrame(n=1, kind="close", data="", id="2-0"))
    feed = StdinFeed(stream, "job", 1, inbox, None, close_after_upfront=False, stored_before=stored_before)  # type: ignore[arg-type]
    pipe = _Pipe()
    await asyncio.wait_for(feed.run(pipe, Activity(0.0)), 5)  # type: ignore[arg-type]
    assert pipe.data == b"a\n" and pipe.closed
    # With nothing stored before the subscription, the stream is never read.
    assert stream.reads == (0 if stored_before == 0 else 1)


class _Watch:
    """A ConnectionWatch whose connection the test replaces."""

    def __init__(self) -> None:
        self.generation = self.seen = 0
        self.next: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def replace(self) -> None:
        self.generation += 1
        self.next.set_result(None)
        self.next = asyncio.get_running_loop().create_future()

    def replaced(self) -> bool:
        replaced, self.seen = self.generation != self.seen, self.generation
        return replaced

    def look(self) -> asyncio.Future[None] | None:
        return None if self.replaced() else self.next


async def test_a_quiet_stdin_feeder_reads_the_stream_only_when_pubsub_may_have_lost_a_frame() -> None:
    # While the connection holds, pub/sub loses nothing: a quiet feeder does not poll the
    # stream. A replaced connection may have lost a frame: it reads the stream at once.
    stream = _StoredStdin([])
    inbox: asyncio.Queue[StdinFrame] = asyncio.Queue()
    watch = _Watch()
    feed = StdinFeed(stream, "job", 1, inbox, None, close_after_upfront=False, stored_before=0, watch=watch)  # type: ignore[arg-type]
    pipe = _Pipe()
    feeding = asyncio.create_task(feed.run(pipe, Activity(0.0)))  # type: ignore[arg-type]
    try:
        await asyncio.sleep(2.5)
        assert stream.reads == 0
        # Stored while the connection was down (its message lost), then it came back.
        stream.frames += [StoredFrame(id="1-0", n=0, kind="data", data=b"lost\n"), StoredFrame(id="2-0", n=1, kind="close", data=b"")]
        watch.replace()
        await asyncio.wait_for(asyncio.shield(feeding), 2)
    finally:
        feeding.cancel()
    assert pipe.data == b"lost\n" and pipe.closed and stream.reads == 1


class _ExitsLate:
    """A jail whose pipes reach EOF well before nsjail is reaped (its teardown follows)."""

    reported = False

    def __init__(self, reap_after_s: float) -> None:
        self.reap_after_s = reap_after_s
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def go(self, program: Program) -> bool:
        asyncio.get_running_loop().call_later(self.reap_after_s, self.ended.set_result, None)
        return True

    def backstop_left_s(self) -> float:
        return math.inf

    async def wait_program(self) -> JailExit:
        await self.ended
        return JailExit(exit_code=0, signal=None, backstop_fired=False)

    def end_output(self) -> None:
        pass


class _CountingCgroup:
    """A job cgroup that counts reads of its CPU counter, which runs at `cores` while read."""

    def __init__(self, cap_cores: float | None = None, cores: float = 0.0) -> None:
        self.cpu_reads = 0
        self.cpu_cap_cores = cap_cores
        self.cores = cores
        self.born = time.monotonic()
        self.killed_at: float | None = None
        self.kill_threads: list[threading.Thread] = []

    def cpu_us(self) -> int:
        self.cpu_reads += 1
        return int(((self.killed_at or time.monotonic()) - self.born) * self.cores * 1e6)

    def kill(self) -> None:
        self.killed_at = self.killed_at or time.monotonic()
        self.kill_threads.append(threading.current_thread())

    def may_hold_leftovers(self) -> bool:
        return True

    oom_count = 0
    oom_kills_whole_job = True
    samples_memory = False
    judged_on: list[threading.Thread] = []

    def oom_kills(self) -> int:
        return self.oom_count

    def counters(self, judge_ceiling: bool = True) -> JobCounters:
        if judge_ceiling and self.oom_count:
            self.judged_on = [*self.judged_on, threading.current_thread()]
        ceiling = judge_ceiling and self.oom_count > 0
        return JobCounters(cpu_us=self.cpu_us(), memory_peak_bytes=0, oom_kills=self.oom_count, ceiling_oom=ceiling)


def test_a_program_is_never_started_within_the_span_a_gates_kill_counts_as_the_backstop() -> None:
    # A SIGKILL of the gate that close to nsjail's own time limit is taken for it (timed_out,
    # killedBy wall): a program started with less room could have a v2 group OOM kill there
    # reported as a timeout.
    from worker.isolation.jail import BACKSTOP_MARGIN_S
    from worker.job.supervise import BACKSTOP_ROOM_S, EXIT_GRACE_S

    assert BACKSTOP_ROOM_S >= BACKSTOP_MARGIN_S + EXIT_GRACE_S


async def test_supervision_sleeps_between_output_eof_and_the_reap() -> None:
    # A spin here (a finished pump kept in the wait set) cost the worker ~4 ms of CPU per job.
    stdout, stderr = asyncio.StreamReader(), asyncio.StreamReader()
    stdout.feed_data(b"1\n")
    stdout.feed_eof()
    stderr.feed_eof()
    received: list[bytes] = []

    async def on_data(data: bytes) -> None:
        received.append(data)

    cgroup = _CountingCgroup()
    facts = await supervise(
        _ExitsLate(0.2),  # type: ignore[arg-type]
        cgroup,  # type: ignore[arg-type]
        Program(argv=["main"], env={}),
        Clocks(wall_ms=5000, cpu_ms=5000, idle_ms=None),
        [(stdout, on_data), (stderr, on_data)],
        asyncio.Queue(),
    )
    assert received == [b"1\n"] and facts.exit.exit_code == 0 and facts.fired is None
    # The first read, the end-of-step read, and one per wake-up: the 50 ms CPU poll over
    # 200 ms, the two pumps ending, and the reap. A spin makes it thousands.
    assert cgroup.cpu_reads <= 12, cgroup.cpu_reads


async def test_a_step_samples_memory_where_the_kernel_cannot_tell_its_peak() -> None:
    # cgroup2 before 5.19 has no memory.peak, and before 6.12 cannot reset it: the clocks'
    # CPU reads take a sample of the usage too (and only there: no cost elsewhere).
    class Sampled(_CountingCgroup):
        samples_memory = True
        notes = 0

        def note_memory(self) -> None:
            self.notes += 1

    sampled, plain = Sampled(), _CountingCgroup()
    for cgroup in (sampled, plain):
        await _step(cgroup, _ExitsLate(1.0), cpu_ms=5000)  # type: ignore[arg-type]
    assert 3 <= sampled.notes <= sampled.cpu_reads, (sampled.notes, sampled.cpu_reads)  # (a read every 100 ms)
    assert not hasattr(plain, "notes")


async def test_supervision_kills_a_jobs_cgroup_off_the_event_loop() -> None:
    # A kill's write waits on the cgroup lock that other sandboxes' set-ups hold: it runs on
    # an isolation thread whether the jail ended unreported (a hybrid host, where no cheap
    # listing shows the cgroups empty) or the step was cancelled mid-run.
    loop_thread = threading.current_thread()
    ended_by_itself = _CountingCgroup()
    await _step(ended_by_itself, _ExitsLate(0.05), cpu_ms=5000)
    cancelled = _CountingCgroup()
    step = asyncio.create_task(_step(cancelled, _ExitsLate(30), cpu_ms=5000))
    await asyncio.sleep(0.1)
    step.cancel()
    with pytest.raises(asyncio.CancelledError):
        await step
    for cgroup in (ended_by_itself, cancelled):
        assert cgroup.kill_threads and loop_thread not in cgroup.kill_threads


async def test_the_ceiling_is_judged_off_the_event_loop_and_only_after_an_oom_kill() -> None:
    # Telling the memory ceiling from the job's own limit opens cgroup files afresh.
    loop_thread = threading.current_thread()
    plain = _CountingCgroup()
    facts = await _step(plain, _ExitsLate(0.01), cpu_ms=5000)
    assert not plain.judged_on and not facts.ceiling_oom
    oom = _CountingCgroup()
    oom.oom_count = 1
    facts = await _step(oom, _ExitsLate(0.01), cpu_ms=5000)
    assert facts.oom_kills == 1 and facts.ceiling_oom
    assert oom.judged_on and loop_thread not in oom.judged_on


async def test_without_group_oom_kills_one_oom_kill_ends_the_whole_step() -> None:
    # cgroup v1 has no memory.oom.group: the kernel kills one process and the rest of the
    # program runs on (a verdict v2 never gives). The clocks' tick ends the rest.
    v1 = _CountingCgroup()
    v1.oom_kills_whole_job = False
    asyncio.get_running_loop().call_later(0.15, setattr, v1, "oom_count", 1)
    started = time.monotonic()
    facts = await _step(v1, _ExitsLate(1.0), cpu_ms=5000)
    assert facts.fired == "memory" and v1.killed_at is not None and v1.killed_at - started < 0.5
    assert judge_run(facts).outcome == Outcome.MEMORY_EXCEEDED and judge_run(facts).killed_by == "memory"
    # With the kernel's group kill there is nothing to do: the step ends when the jail does.
    v2 = _CountingCgroup()
    asyncio.get_running_loop().call_later(0.15, setattr, v2, "oom_count", 1)
    facts = await _step(v2, _ExitsLate(0.4), cpu_ms=5000)
    assert facts.fired is None and facts.oom_kills == 1


class _EndsAtTheKill(_ExitsLate):
    """A jail parked at its gate until released; a kill of its cgroup ends it there."""

    def __init__(self) -> None:
        super().__init__(0.01)
        self.released: list[Program] = []

    def go(self, program: Program) -> bool:
        self.released.append(program)
        return super().go(program)

    async def wait_program(self) -> JailExit:
        await self.ended
        return JailExit(exit_code=None, signal="SIGKILL", backstop_fired=False)


async def test_a_kill_that_came_before_the_release_keeps_the_gate_shut() -> None:
    # Stop pressed while the job was told `running`, before its program was let go: the
    # program never runs, not even for the moment the kill takes. Other messages stay.
    jail = _EndsAtTheKill()
    cgroup = _CountingCgroup()
    original_kill = cgroup.kill

    def kill() -> None:
        original_kill()
        jail.ended.get_loop().call_soon_threadsafe(lambda: jail.ended.done() or jail.ended.set_result(None))

    cgroup.kill = kill  # type: ignore[method-assign]
    inbox: asyncio.Queue[Any] = asyncio.Queue()
    other = CtrlMessage(type="start")
    for item in (other, CtrlMessage(type="kill")):
        inbox.put_nowait(item)
    facts = await asyncio.wait_for(_step(cgroup, jail, cpu_ms=5000, inbox=inbox), 3)
    assert jail.released == [] and facts.fired == "user" and facts.duration_ms == 0
    assert cgroup.killed_at is not None and inbox.get_nowait() is other and inbox.empty()
    # With nothing waiting the gate opens as before.
    jail = _EndsAtTheKill()
    facts = await asyncio.wait_for(_step(_CountingCgroup(), jail, cpu_ms=5000), 3)
    assert len(jail.released) == 1 and facts.fired is None


async def test_a_step_cancelled_twice_while_its_kill_runs_still_cleans_up() -> None:
    # The worker's second stop signal lands while the step's finally waits for the kill on an
    # isolation thread: the pumps and the pending inbox read must still be dealt with (a
    # leaked read would swallow the next message, a kill meant for the run).
    stop_kill = threading.Event()

    class SlowKill(_CountingCgroup):
        def kill(self) -> None:
            stop_kill.wait(5)
            super().kill()

    inbox: asyncio.Queue[Any] = asyncio.Queue()
    step = asyncio.create_task(_step(SlowKill(), _ExitsLate(30), cpu_ms=5000, inbox=inbox))
    await asyncio.sleep(0.05)
    step.cancel()
    await asyncio.sleep(0.05)
    step.cancel()
    asyncio.get_running_loop().call_later(0.1, stop_kill.set)
    with pytest.raises(asyncio.CancelledError):
        await step
    later = CtrlMessage(type="kill")
    inbox.put_nowait(later)
    await asyncio.sleep(0.01)
    assert inbox.get_nowait() is later  # no leftover read took it


def test_the_cpu_clock_cannot_fire_before_the_cap_lets_the_budget_be_spent() -> None:
    ahead_s = 0.2 + (os.cpu_count() or 1) * 0.005  # two 100 ms periods' quota, a slice per CPU
    assert cpu_clock_due_at(10.0, 15.0, None) == 10.0  # no cap: any time
    assert cpu_clock_due_at(10.0, 15.0, 1.0) == pytest.approx(10.0 + 15.0 - ahead_s)
    assert cpu_clock_due_at(10.0, 15.0, 2.0) == pytest.approx(10.0 + (15.0 - 2 * 0.2 - (ahead_s - 0.2)) / 2)
    assert cpu_clock_due_at(10.0, 0.1, 1.0) == 10.0  # a budget within what it may hold at go


async def _step(cgroup: _CountingCgroup, jail: Any, cpu_ms: int, inbox: asyncio.Queue[Any] | None = None) -> Any:
    """A silent step (its pipes at EOF from the start) under `cgroup`'s CPU counter."""
    stdout = asyncio.StreamReader()
    stdout.feed_eof()

    async def on_data(data: bytes) -> None:
        pass

    return await supervise(
        jail,
        cgroup,  # type: ignore[arg-type]
        Program(argv=["main"], env={}),
        Clocks(wall_ms=5000, cpu_ms=cpu_ms, idle_ms=None),
        [(stdout, on_data)],
        asyncio.Queue() if inbox is None else inbox,
    )


async def _silent_step(ends_after_s: float, clocks: Clocks, uncharged: Uncharged | None = None) -> Any:
    """A program that writes nothing and ends `ends_after_s` after its go."""
    stdout = asyncio.StreamReader()
    stdout.feed_eof()

    async def on_data(data: bytes) -> None:
        pass

    return await supervise(
        _ExitsLate(ends_after_s),
        _CountingCgroup(),  # type: ignore[arg-type]
        Program(argv=["main"], env={}),
        clocks,
        [(stdout, on_data)],
        asyncio.Queue(),
        uncharged=uncharged or Uncharged(),
    )


async def test_a_plain_jails_runtime_start_up_is_off_its_wall_and_idle_clocks_and_its_duration() -> None:
    # A prestarted runtime's clocks start once it is up; a plain jail's at the gate's go,
    # before its runtime starts: the start-up its language's runtimes measured is added to
    # the wall and idle clocks and left out of the duration, as its CPU is of the CPU clock.
    start_up = Uncharged(wall_ms=300)
    walled = Clocks(wall_ms=200, cpu_ms=5000)
    assert (await _silent_step(0.4, walled)).fired == "wall"
    facts = await _silent_step(0.4, walled, start_up)
    assert facts.fired is None and 50 <= facts.duration_ms <= 200, facts
    quiet = Clocks(wall_ms=5000, cpu_ms=5000, idle_ms=150)
    assert (await _silent_step(0.35, quiet)).fired == "idle"
    assert (await _silent_step(0.35, quiet, start_up)).fired is None
    # (A step ending within its start-up's measure reports no time, not a negative one.)
    assert (await _silent_step(0.05, walled, start_up)).duration_ms == 0


def test_a_languages_start_up_is_its_runtimes_median_memory_and_cpu_and_shortest_time() -> None:
    # Its runtimes are started in the background at a low CPU weight: a start-up that waited
    # behind a busy worker's jobs is no measure of what starting takes.
    costs = StartupCosts()
    assert costs.typical() is None
    for resident, cpu, wall in ((10, 5, 900), (30, 50, 40), (20, 6, 60), (25, 7, 700)):
        costs.record(StartupCost(resident_bytes=resident << 20, cpu_ms=cpu, wall_ms=wall))
    assert costs.typical() == StartupCost(resident_bytes=22 << 20 | 1 << 19, cpu_ms=6, wall_ms=40)


class _ReapedSlowly(_ExitsLate):
    """A jail whose program has ended (`ended`) but whose nsjail takes a while to be reaped."""

    async def wait_program(self) -> JailExit:
        await self.ended
        await asyncio.sleep(0.05)
        return JailExit(exit_code=0, signal=None, backstop_fired=False)


async def test_a_kill_that_comes_as_a_step_ends_by_itself_stays_for_the_next_step() -> None:
    # A compile that ends just as the user presses Stop: the step is over, so the kill is not
    # its to act on, but the run that follows must see it, not start as if none came.
    inbox: asyncio.Queue[Any] = asyncio.Queue()
    kill = CtrlMessage(type="kill")
    asyncio.get_running_loop().call_later(0.03, inbox.put_nowait, kill)
    facts = await _step(_CountingCgroup(), _ReapedSlowly(0.01), 5000, inbox)
    assert facts.fired is None
    assert inbox.qsize() == 1 and inbox.get_nowait() is kill


async def test_a_capped_step_reads_its_cpu_counter_at_the_slower_pace_until_its_budget_is_within_reach() -> None:
    # Under a one-core cap a 500 ms step cannot spend 5 s of CPU: the counter (an rstat
    # flush in the kernel per read) is read every 100 ms, not every 50 ms, besides the reads
    # at go and for the step's figures; a step shorter than that reads it only for those.
    capped = _CountingCgroup(cap_cores=1.0)
    facts = await _step(capped, _ExitsLate(0.5), 5000)
    assert facts.fired is None and 5 <= capped.cpu_reads <= 7, capped.cpu_reads
    uncapped = _CountingCgroup()
    await _step(uncapped, _ExitsLate(0.5), 5000)
    assert uncapped.cpu_reads >= 10, uncapped.cpu_reads
    short = _CountingCgroup(cap_cores=1.0)
    await _step(short, _ExitsLate(0.05), 5000)
    assert short.cpu_reads == 2, short.cpu_reads
    # Near its budget it is polled as before, and the CPU clock fires: a step spending one
    # core's worth, with a 500 ms budget, is stopped at about 500 ms of CPU.
    spinning = _CountingCgroup(cap_cores=1.0, cores=1.0)
    facts = await _step(spinning, _ExitsLate(3.0), 500)
    assert facts.fired == "cpu" and 500 <= facts.cpu_ms <= 620, facts
    assert 480 <= facts.duration_ms <= 620, facts


class _LogOnly:
    """The queue's append, always accepted."""

    async def advance(self, job_id: str, attempt: int, events: list, state=None, started=False, audience=False, token="", publish=None) -> Advanced:  # type: ignore[no-untyped-def, type-arg]
        return Advanced(heard=False)


class _SentLane:
    followed = True
    adapter = None

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, object]]] = []

    def send(self, name: str, data: bytes) -> None:
        self.sent.append((name, json.loads(data)))

    def wants_audience(self) -> bool:
        return False

    def knows_nobody_follows(self) -> bool:
        return False


async def test_a_held_go_live_publishes_the_backlog_with_the_first_output() -> None:
    lane = _SentLane()
    events = JobEvents(_LogOnly(), lane, "job", 1, 1, [(0, "stage", b'{"phase":"queued","seq":0}')])  # type: ignore[arg-type]
    events.go_live_within(10.0)
    await events.stage("running")
    assert lane.sent == [] and not events.live  # a stage does not end the hold
    await events.chunk_runs([("stdout", "1\n")])
    assert events.live
    assert [(name, data["seq"]) for name, data in lane.sent] == [("stage", 0), ("stage", 1), ("stdout", 2)]
    await events.chunk_runs([("stderr", "x")])
    assert [(name, data["seq"]) for name, data in lane.sent][-1] == ("stderr", 3)


class _DirectLane(_SentLane):
    """A lane that lets appends publish for it (JobLane.direct_mode says `mode`)."""

    adapter = "redis-adapter"

    def __init__(self, mode: str | None) -> None:
        super().__init__()
        self.mode = mode
        self.direct: list[tuple[int, bool]] = []

    def direct_mode(self, size: int) -> str | None:
        return self.mode

    def adapter_message(self, name: str, data: bytes) -> bytes:
        return json.dumps([name, json.loads(data)["seq"]]).encode()

    def published_directly(self, count: int, size: int, followed: bool) -> None:
        self.direct.append((count, followed))


class _PublishingLog(_LogOnly):
    """An append whose script publishes the first `reach` messages it is given (the next one
    found no soketi node, so it stopped there)."""

    def __init__(self, reach: int) -> None:
        self.reach = reach
        self.published: list[tuple[str, int]] = []

    async def advance(self, job_id: str, attempt: int, events: list, state=None, started=False, audience=False, token="", publish: LivePublish | None = None) -> Advanced:  # type: ignore[no-untyped-def, type-arg]
        if publish is None:
            return Advanced(heard=False)
        went = [*publish.logged, *publish.messages][: self.reach]
        self.published += [tuple(json.loads(message)) for message in went]  # type: ignore[misc]
        return Advanced(heard=publish.only_if_followed, published=len(went))


async def test_the_append_ending_a_held_go_live_publishes_the_backlog_and_itself_in_order() -> None:
    # The script publishes the first two (the backlog's stages) and stops: the output goes
    # through the lane, after them; later output is published by its own append.
    lane, log = _DirectLane("followed"), _PublishingLog(reach=2)
    events = JobEvents(log, lane, "job", 1, 1, [(0, "stage", b'{"phase":"queued","seq":0}')])  # type: ignore[arg-type]
    events.go_live_within(10.0)
    await events.stage("running")
    assert log.published == [] and lane.sent == [] and not events.live  # a stage does not end the hold
    await events.chunk_runs([("stdout", "1\n")])
    assert events.live
    assert log.published == [("stage", 0), ("stage", 1)]
    assert [(name, data["seq"]) for name, data in lane.sent] == [("stdout", 2)]
    assert lane.direct == [(2, True)]
    log.reach = 10
    await events.chunk_runs([("stdout", "2\n"), ("stderr", "3")])
    assert log.published[2:] == [("stdout", 3), ("stderr", 4)] and len(lane.sent) == 1
    lane.mode = None  # (the lane is busy: through it, as before)
    await events.chunk_runs([("stdout", "4")])
    assert [(name, data["seq"]) for name, data in lane.sent] == [("stdout", 2), ("stdout", 5)]
    assert len(log.published) == 4


async def test_a_job_its_running_append_found_unfollowed_goes_live_at_once_without_a_hold() -> None:
    """A grader's job: the running stage's append read no audience mark, so there is nothing
    to send together with the first output. It goes live at start, with no timer and no
    task; the lane (a real one, its publisher never reached) keeps the backlog for a
    follower who may still come. A lane that has not looked yet, or knows of a follower,
    holds the go-live as before."""
    from worker.messaging.publisher import Publisher

    publisher = Publisher(load_settings({"PUSHER_SECRET": "s" * 16, "PUSHER_PUBLISH": "http"}))
    try:
        for learned in (None, True, False):
            lane = publisher.lane(f"private-run-{learned}")
            assert not lane.knows_nobody_follows()
            events = JobEvents(_LogOnly(), lane, "job", 1, 1, [(0, "stage", b'{"phase":"queued","seq":0}')])  # type: ignore[arg-type]
            await events.stage("running")  # (_LogOnly's append answers "nobody follows")
            if learned is not None:
                lane.learned_audience(learned)
            else:
                lane._audience_checked_at = None  # (an append that did not ask)
            tasks_before = len(asyncio.all_tasks())
            await events.go_live_at_start(10.0)
            if learned is False:
                assert lane.knows_nobody_follows()
                assert events.live and events._live_timer is None and events._live_task is None
                assert len(asyncio.all_tasks()) == tasks_before  # (no task made for it)
                async with asyncio.timeout(2):
                    while len(lane._unheard) < 2:  # the drain keeps both stages for a late follower
                        await asyncio.sleep(0.01)
                assert [event.name for event, _ in lane._unheard] == ["stage", "stage"]
                # A job claimed again reads its backlog from the log: not before its program
                # starts, so it holds as before.
                claimed_again = JobEvents(_LogOnly(), lane, "job", 1, 3, [])  # type: ignore[arg-type]
                await claimed_again.go_live_at_start(10.0)
                assert not claimed_again.live and claimed_again._live_timer is not None
                await claimed_again.drop_hold()
            else:
                assert not lane.knows_nobody_follows()
                assert not events.live and events._live_timer is not None  # held, as before
                await events.drop_hold()
            await lane.close(0.5)
    finally:
        await publisher.aclose()


async def test_a_held_go_live_ends_on_its_timer_without_output() -> None:
    lane = _SentLane()
    events = JobEvents(_LogOnly(), lane, "job", 1, 0)  # type: ignore[arg-type]
    await events.stage("running")
    events.go_live_within(0.01)
    await asyncio.sleep(0.005)
    assert lane.sent == []
    await asyncio.sleep(0.05)
    assert events.live and [name for name, _ in lane.sent] == ["stage"]


async def test_a_held_go_live_is_dropped_when_the_job_is_over() -> None:
    lane = _SentLane()
    events = JobEvents(_LogOnly(), lane, "job", 1, 0)  # type: ignore[arg-type]
    await events.stage("running")
    events.go_live_within(0.01)
    await events.drop_hold()
    await asyncio.sleep(0.05)
    assert lane.sent == [] and not events.live


async def test_a_go_live_under_way_is_not_scheduled_again_and_the_end_of_the_job_stops_it() -> None:
    # The hold's timer fired while an append held the log's lock (a quiet job's running
    # write): its go-live waits for the lock, and a go_live_within meanwhile (that running
    # write's own) must not start a second one, which drop_hold would not know of.
    gate = asyncio.Event()

    class _SlowLog(_LogOnly):
        async def advance(self, *args, **kwargs) -> Advanced:  # type: ignore[no-untyped-def]
            await gate.wait()
            return Advanced(heard=False)

    lane = _SentLane()
    events = JobEvents(_SlowLog(), lane, "job", 1, 0)  # type: ignore[arg-type]
    events.go_live_within(0.001)
    running = asyncio.ensure_future(events.stage("running"))
    await asyncio.sleep(0.02)  # (the timer fired; its go-live waits for the append's lock)
    first = events._live_task
    assert first is not None and not first.done() and not events.live
    events.go_live_within(0.001)
    await asyncio.sleep(0.02)
    assert events._live_task is first  # no second go-live
    await events.drop_hold()
    assert first.done()
    gate.set()
    await running
    await asyncio.sleep(0.02)
    assert lane.sent == [] and not events.live


async def test_a_hand_back_says_the_log_was_published_only_once_it_was() -> None:
    # A job stopped while its go_live was still held back (or never started) published
    # nothing of this claim: the hand-back must not tell the next claim otherwise.
    lane = _SentLane()
    events = JobEvents(_LogOnly(), lane, "job", 1, 3, published_before=2)  # type: ignore[arg-type]
    await events.state(JobState.STARTING)
    events.go_live_within(10.0)
    assert events.published_to == 2
    await events.drop_hold()
    assert events.published_to == 2 and lane.sent == []

    class _Log(_LogOnly):
        async def event_log(self, job_id: str) -> list[tuple[int, str, bytes]]:
            return [(seq, "stage", b'{"seq":%d}' % seq) for seq in range(4)]

    events = JobEvents(_Log(), lane, "job", 1, 3, published_before=2)  # type: ignore[arg-type]
    await events.stage("compiling")
    await events.go_live()
    assert events.published_to == 4
    assert [data["seq"] for _, data in lane.sent] == [2, 3]  # not what the earlier claim published


class _LoggedBefore(_LogOnly):
    """A job's log as a second claim finds it: what an earlier claim logged, and the result
    once the finishing script has written it."""

    def __init__(self) -> None:
        self.log: list[tuple[int, str, bytes]] = [(0, "stage", b'{"phase":"queued","seq":0}')]

    async def event_log(self, job_id: str) -> list[tuple[int, str, bytes]]:
        return list(self.log)


async def test_a_held_go_live_that_fires_after_the_result_is_logged_leaves_the_result_to_its_writer() -> None:
    # A second claim reads its backlog from the log. A quiet program ends within the hold:
    # the result is in the log when the hold's timer reads it, and the result's writer
    # publishes it too. The live channel must carry it once.
    queue, lane = _LoggedBefore(), _SentLane()
    events = JobEvents(queue, lane, "job", 2, 1)  # type: ignore[arg-type]
    events.go_live_within(0.005)
    seq = await events.take_result_seq()
    result = b'{"outcome":"completed","seq":1}'
    queue.log.append((seq, "result", result))
    await asyncio.sleep(0.05)  # the hold's timer fires while the result is being stored
    await events.go_live()
    events.publish("result", result)
    assert [(name, data["seq"]) for name, data in lane.sent] == [("stage", 0), ("result", 1)]


class _Ended:
    """A jail's `ended` as the pool reads it (a parked compile only adds and removes its
    callback on it; the tests of what that callback does use a real future)."""

    def __init__(self) -> None:
        self.is_done = False

    def done(self) -> bool:
        return self.is_done

    def add_done_callback(self, callback: Callable[[object], None]) -> None:
        pass

    def remove_done_callback(self, callback: Callable[[object], None]) -> int:
        return 0


class _FakeSandbox:
    """What the warm pool looks at: a slot, an age, a jail that may have died."""

    def __init__(self, slot: int, serial: int) -> None:
        self.slot, self.name, self.prime = slot, f"s{slot}-{serial}", None
        self.idle_s = 0.0
        self.jail = SimpleNamespace(ended=_Ended())
        self.destroyed = False

    def adopts(self, _program: object) -> bool:
        return False

    async def destroy(self) -> None:
        self.destroyed = True


class _FakeFactory:
    def __init__(self) -> None:
        self.built: list[_FakeSandbox] = []

    async def prepare(self, _owner: str, slot: int, _prime: object) -> _FakeSandbox:
        sandbox = _FakeSandbox(slot, len(self.built))
        self.built.append(sandbox)
        return sandbox


async def test_slots_in_use_are_the_ones_a_job_holds() -> None:
    # A worker whose builds all fail, with no job, showed every slot in use (slots less
    # ready less building counted the ones waiting to build again), and so did one that had
    # not started its pool yet: an operator would scale out instead of fixing the host.
    class Failing(_FakeFactory):
        async def prepare(self, owner: str, slot: int, prime: object) -> _FakeSandbox:
            raise OSError("no space left on device")

    failing = SandboxPool(Failing(), "w", slots=4)  # type: ignore[arg-type]
    assert failing.in_use == 0  # (not started)
    failing.start()
    for _ in range(10):
        await asyncio.sleep(0.02)
        assert failing.in_use == 0 and failing.builds_failed >= 4
    await failing.close()
    # Held by jobs: in use; given back (tearing down, then building): not.
    factory = _FakeFactory()
    pool = SandboxPool(factory, "w", slots=2)  # type: ignore[arg-type]
    pool.start()
    assert pool.in_use == 0  # (started: the builds are spawned, not yet running)
    await asyncio.sleep(0.01)
    taken = await pool.take()
    assert pool.in_use == 1
    pool.give_back(taken)
    assert pool.in_use == 0
    await asyncio.sleep(0.01)
    assert pool.in_use == 0 and pool.ready == 2
    # A job that tears its sandbox down itself (the usual end of a run): not in use then.
    taken = await pool.take()
    pool.retiring(taken.slot)
    assert pool.in_use == 0
    pool.rearm(taken.slot)
    assert pool.in_use == 0
    await asyncio.sleep(0.01)
    assert pool.ready == 2
    await pool.take()
    await pool.close()
    assert pool.in_use == 0  # (closed: nothing is anyone's any more)


async def _stale_dead_and_good(factory: _FakeFactory) -> tuple[SandboxPool, list[_FakeSandbox]]:
    """A started pool of three ready sandboxes: one idle past MAX_IDLE_S, one whose jail
    died, one good (in that order)."""
    pool = SandboxPool(factory, "w", slots=3)  # type: ignore[arg-type]
    pool.start()
    while pool.ready < 3:
        await asyncio.sleep(0)
    old, dead, _ = factory.built
    old.idle_s = MAX_IDLE_S + 1
    dead.jail.ended.is_done = True  # (its gate reported, or nsjail exited: Jail.ended)
    return pool, list(factory.built)


async def test_a_parked_job_never_borrows_a_sandbox_that_sat_too_long_or_died() -> None:
    # nsjail ends a warm jail at its own time limit: one idle past MAX_IDLE_S, or already
    # dead, would run the job at a dead gate. take() rebuilt such sandboxes; lending did not.
    factory = _FakeFactory()
    pool, (old, dead, good) = await _stale_dead_and_good(factory)
    lent = await asyncio.wait_for(pool.borrow(lambda: None), 1)
    assert lent is good
    for _ in range(10):
        await asyncio.sleep(0)
    assert old.destroyed and dead.destroyed and len(factory.built) == 5  # both slots rebuilt
    pool.keep(lent)
    again = pool.lend_ready(lambda: None, SimpleNamespace())  # type: ignore[arg-type]
    assert again is not None and again not in (old, dead)
    await pool.close()


async def test_take_ready_takes_what_take_would_now_or_nothing() -> None:
    # A job started before its claim takes a warm sandbox at once if one is ready (one fenced
    # write then takes it to running); otherwise it says `starting` and waits in take().
    # take_ready must pick as take does, and never wait.
    factory = _FakeFactory()
    assert SandboxPool(factory, "w", slots=3).take_ready() is None  # type: ignore[arg-type]  # (nothing built)
    pool, (old, dead, good) = await _stale_dead_and_good(factory)
    assert pool.take_ready() is good  # the stale and the dead are retired on the way
    assert pool.take_ready() is None  # (their slots are still being rebuilt)
    await _turns(20)
    assert old.destroyed and dead.destroyed and pool.ready == 2
    first = pool.take_ready()
    assert first is not None and first not in (old, dead, good) and pool.ready == 1
    second = await pool.take()
    assert second is not first and pool.take_ready() is None  # (all three held)
    # A sandbox given back is rebuilt first: nothing is ready until then.
    pool.give_back(second)
    assert pool.take_ready() is None
    await _turns(20)
    assert pool.take_ready() not in (None, second)
    await pool.close()


def _task_running(name: str) -> asyncio.Task[Any]:
    return next(t for t in asyncio.all_tasks() if t.get_coro().__name__ == name)  # type: ignore[union-attr]


async def test_a_take_given_up_just_as_its_sandbox_came_loses_no_slot() -> None:
    # take_unless_failing waits on a take of its own: that take can end with the sandbox a
    # turn of the loop before the waiter hears of it. A waiter cancelled in that turn (a
    # batch stopped, a worker stopping) dropped the sandbox: the slot was never built
    # again, and with every slot gone no job could run.
    factory = _FakeFactory()
    pool = SandboxPool(factory, "w", slots=1)  # type: ignore[arg-type]
    waiter = asyncio.ensure_future(pool.take_unless_failing())
    await asyncio.sleep(0)
    take = _task_running("take")
    pool.start()
    while not take.done():
        await asyncio.sleep(0)
    assert not waiter.done()  # (the window this test is about)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    for _ in range(10):
        await asyncio.sleep(0)
    assert pool.ready == 1 and len(factory.built) == 1  # ready again, as it was
    assert await asyncio.wait_for(pool.take(), 1) is factory.built[0]
    await pool.close()


async def test_a_batch_case_given_up_just_as_its_sandbox_came_gives_it_back() -> None:
    from worker.job.batch import _unless_stopped

    given_back: list[object] = []
    pool = SimpleNamespace(give_back=given_back.append)
    free, sandbox = asyncio.Event(), object()

    async def taking() -> object:
        await free.wait()
        return sandbox

    waiter = asyncio.ensure_future(_unless_stopped(asyncio.Event(), taking(), pool))  # type: ignore[arg-type]
    await asyncio.sleep(0)
    take = _task_running("taking")
    free.set()
    while not take.done():
        await asyncio.sleep(0)
    assert not waiter.done()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert given_back == [sandbox]


async def test_a_closed_pool_builds_nothing_after_a_build_fails() -> None:
    # A primed slot whose runtime fails is rebuilt plain at once; a failure that lands
    # once the pool is closing (the build gave up as it was torn down) must not start a
    # build nobody waits for, which the loop's end would leave half-made.
    class Failing(_FakeFactory):
        async def prepare(self, owner: str, slot: int, prime: object) -> _FakeSandbox:
            if prime is None:
                return await super().prepare(owner, slot, prime)
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                raise RuntimeError("the runtime went away with its jail") from None
            raise AssertionError("unreachable")

    factory = Failing()
    prime = SimpleNamespace(language="python")
    pool = SandboxPool(factory, "w", slots=1, primes={"python": prime}, first_prime="python")  # type: ignore[arg-type]
    pool.start()
    await asyncio.sleep(0.01)
    await pool.close()
    for _ in range(20):
        await asyncio.sleep(0)
    assert factory.built == [] and pool.ready == 0


class _RecordingFactory(_FakeFactory):
    """Builds only while `gate` is set, and notes what each build was primed with."""

    def __init__(self) -> None:
        super().__init__()
        self.primes: list[object] = []
        self.gate = asyncio.Event()

    async def prepare(self, owner: str, slot: int, prime: object) -> _FakeSandbox:
        self.primes.append(prime)
        await self.gate.wait()
        sandbox = await super().prepare(owner, slot, prime)
        sandbox.prime = prime
        return sandbox


async def _turns(n: int = 10) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def _priming_pool(slots: int, first_prime: str, adopts: bool) -> tuple[_RecordingFactory, object, SandboxPool]:
    """A started pool over a recording factory, with one Python prime its jobs adopt or not."""
    factory = _RecordingFactory()
    prime = SimpleNamespace(language="python", adopts=lambda _program: adopts)
    pool = SandboxPool(factory, "w", slots=slots, primes={"python": prime}, first_prime=first_prime)  # type: ignore[arg-type, dict-item]
    pool.start()
    return factory, prime, pool


async def test_a_runtime_that_failed_once_is_still_prestarted_and_still_charged_alike() -> None:
    # One warm-up that did not come up (a runtime slow to start beside busy jobs) turned
    # prestarting off for the worker's life on one slot only, and dropped the language's
    # prime: every plain jail of it was charged its runtime's start-up from then on.
    from worker.isolation.pool import PRIME_FAILURES_TO_STOP
    from worker.isolation.sandbox import RuntimeFailed

    class FailingRuntime(_FakeFactory):
        def __init__(self, failures: int) -> None:
            super().__init__()
            self.failures = failures
            self.primes: list[tuple[int, object]] = []

        async def prepare(self, owner: str, slot: int, prime: object) -> _FakeSandbox:
            self.primes.append((slot, prime))
            if prime is not None and self.failures:
                self.failures -= 1
                raise RuntimeFailed("the prestarted python runtime failed: it did not come up")
            sandbox = await super().prepare(owner, slot, prime)
            sandbox.prime = prime
            return sandbox

    python = SimpleNamespace(language="python", adopts=lambda _program: True)
    factory = FailingRuntime(failures=1)
    pool = SandboxPool(factory, "w", slots=2, primes={"python": python}, first_prime="python")  # type: ignore[arg-type, dict-item]
    pool.start()
    await _turns(20)
    assert factory.primes == [(0, python), (1, python), (0, None)]  # slot 0 plain this once
    assert pool.prime_for("python") is python
    taken = await pool.take(SimpleNamespace(), "python")  # type: ignore[arg-type]
    pool.give_back(taken)
    await _turns(20)
    assert factory.primes[-1] == (taken.slot, python)  # a python job marks its slot again
    await pool.close()
    # Failing time after time (and nowhere coming up meanwhile), it stops: on every slot,
    # and for jobs of it too.
    factory = FailingRuntime(failures=PRIME_FAILURES_TO_STOP)
    pool = SandboxPool(factory, "w", slots=2, primes={"python": python}, first_prime="python")  # type: ignore[arg-type, dict-item]
    pool.start()
    await _turns(20)

    async def python_jobs_on_both_slots() -> None:
        taken = [await pool.take(SimpleNamespace(), "python") for _ in range(2)]  # type: ignore[arg-type]
        for sandbox in taken:
            pool.give_back(sandbox)
        await _turns(20)

    while factory.failures:
        await python_jobs_on_both_slots()
    builds = len(factory.primes)
    for _ in range(2):
        await python_jobs_on_both_slots()
    assert len(factory.primes) == builds + 4 and all(prime is None for _slot, prime in factory.primes[builds:])
    assert pool.prime_for("python") is python  # (plain jails are still charged alike)
    await pool.close()


@pytest.fixture
def short_pool_clocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("worker.isolation.pool.SATURATED_FOR_S", 0.2)
    monkeypatch.setattr("worker.isolation.pool.REPRIME_IDLE_S", 0.3)


async def test_a_slot_builds_plain_while_jobs_wait_or_just_waited_then_primes_again(short_pool_clocks: None) -> None:
    # Under saturation a primed sandbox only costs more (the shim and the interpreter's
    # start-up on top of nsjail, before a job that is already waiting can have it). A job
    # that waited a moment ago still counts (under a steady load jobs come in waves); once
    # the worker is idle the plain spare is rebuilt primed.
    factory, prime, pool = _priming_pool(slots=1, first_prime="python", adopts=True)
    await asyncio.sleep(0)
    factory.gate.set()
    first = await asyncio.wait_for(pool.take(), 1)
    assert factory.primes == [prime]  # idle: primed
    # Two started jobs wait while the slot rebuilds: that build is plain.
    waiting = [asyncio.create_task(pool.take()) for _ in range(2)]
    await asyncio.sleep(0)
    factory.gate.clear()
    pool.give_back(first)
    await _turns(5)
    assert factory.primes == [prime, None]
    factory.gate.set()
    second = await asyncio.wait_for(waiting[0], 1)
    pool.give_back(second)  # one job still waits: plain again
    third = await asyncio.wait_for(waiting[1], 1)
    assert factory.primes == [prime, None, None]
    pool.give_back(third)  # nobody waits, but a job just did: plain
    await _turns(5)
    assert factory.primes == [prime, None, None, None]
    await asyncio.sleep(0.5)  # idle: the plain spare is rebuilt primed
    assert factory.primes == [prime, None, None, None, prime]
    assert pool.ready == 1 and pool._ready[0].prime is prime
    await pool.close()


async def test_plain_spares_a_burst_left_are_primed_again_once_idle(short_pool_clocks: None) -> None:
    # Both slots rebuild while a started job waits: both build plain (the waiting job
    # takes the first ready). The other plain spare is rebuilt primed once no job has asked
    # for a sandbox for a while (never under load, where it would be thrown away for
    # nothing), so the next IDE job finds its runtime started.
    factory, prime, pool = _priming_pool(slots=2, first_prime="python", adopts=True)
    factory.gate.set()
    first = await asyncio.wait_for(pool.take(), 1)
    second = await asyncio.wait_for(pool.take(), 1)
    factory.gate.clear()
    waiting = asyncio.create_task(pool.take())
    await _turns()
    pool.give_back(first)
    pool.give_back(second)
    await _turns()
    assert factory.primes[2:] == [None, None]
    factory.gate.set()
    assert (await asyncio.wait_for(waiting, 1)).prime is None
    await _turns(30)
    assert factory.primes[2:] == [None, None]  # a job asked a moment ago: not yet
    await asyncio.sleep(0.5)
    assert factory.primes[2:] == [None, None, prime]
    assert pool.ready == 1 and pool._ready[0].prime is prime
    spare = factory.built[-2]
    assert spare.destroyed and spare.prime is None
    await pool.close()


async def test_a_borrower_that_may_not_be_lent_to_leaves_priming_alone() -> None:
    # A parked job waiting to borrow while the lending cap is reached cannot be served
    # by any build; it must not turn every build of an idle worker plain.
    factory, prime, pool = _priming_pool(slots=2, first_prime="", adopts=False)
    factory.gate.set()
    await _turns()
    lent = await asyncio.wait_for(pool.borrow(lambda: None), 1)  # the one loan the cap allows
    blocked = asyncio.create_task(pool.borrow(lambda: None))
    await _turns()
    assert not blocked.done()
    pool._slot_prime[0] = pool._slot_prime[1] = prime
    started = await asyncio.wait_for(pool.take(), 1)  # the other slot's sandbox
    pool.give_back(started)
    await _turns()
    assert factory.primes[-1] is prime
    blocked.cancel()
    pool.give_back(lent)
    await pool.close()


async def test_two_offers_in_one_turn_never_lend_past_the_cap() -> None:
    # Both borrowers waited; both slots finished building in the same turn of the loop.
    # The loan is recorded when the sandbox is handed over, so the second offer sees the
    # cap (one slot always stays for started jobs) and keeps its sandbox ready.
    factory = _RecordingFactory()
    pool = SandboxPool(factory, "w", slots=2)  # type: ignore[arg-type]
    pool.start()
    await _turns()
    borrowers = [asyncio.create_task(pool.borrow(lambda: None)) for _ in range(2)]
    await _turns()
    factory.gate.set()
    await _turns()
    assert sum(b.done() for b in borrowers) == 1 and pool.ready == 1
    for b in borrowers:
        b.cancel()
    await asyncio.gather(*borrowers, return_exceptions=True)
    await pool.close()


def test_a_snapshot_refuses_folders_nested_past_its_depth_and_copies_the_rest(tmp_path: Path) -> None:
    # What a compile left is walked recursively, a descriptor per level: a tree nested
    # past the cap (a Java package of 1,500 components fits the workspace) must end in
    # WorkspaceError, not a RecursionError or a thousand open descriptors.
    workspace = Workspace(tmp_path.parent, tmp_path.name, os.getuid(), os.getgid())  # (makes nothing)
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "Main.class").write_bytes(b"\xca\xfe")
    (tmp_path / "run").write_text("#!/bin/sh\n")
    (tmp_path / "run").chmod(0o755)
    files, executable = workspace.snapshot(1 << 20)
    assert files == [("a/b/Main.class", b"\xca\xfe"), ("run", b"#!/bin/sh\n")] and executable == {"run"}
    (tmp_path / "deep" / "/".join("p" * 200)).mkdir(parents=True)  # well past the cap
    open_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(WorkspaceError, match="deeper than"):
        workspace.snapshot(1 << 20)
    assert len(os.listdir("/proc/self/fd")) == open_before


def test_staging_never_writes_through_a_link_planted_in_the_workspace(tmp_path: Path) -> None:
    # Defence R1, the write side (CVE-2024-28185/28189's class: a runner writing or chowning
    # through a link the job planted). Staging runs as root before launch; a link already
    # there (a stale tmpfs, a bug that stages late) must make it fail, never be followed.
    outside = tmp_path / "outside"
    outside.mkdir()
    canary = outside / "canary"
    canary.write_text("canary")
    box = tmp_path / "box"
    box.mkdir()
    (box / "main.py").symlink_to(canary)
    (box / "src").symlink_to(outside)
    workspace = Workspace(tmp_path, "box", os.getuid() + 1, os.getgid() + 1)
    for name in ("main.py", "src/p.py", "src/canary"):
        with pytest.raises(WorkspaceError):
            workspace.stage([(name, b"written through a link")])
    assert canary.read_text() == "canary" and sorted(os.listdir(outside)) == ["canary"]
    assert os.stat(canary).st_uid == os.getuid()  # (nothing chowned through the link either)


def test_a_snapshot_reads_only_regular_files_and_never_follows_or_blocks(tmp_path: Path) -> None:
    # What a compile left is read by root (defence R1): a link to a host file or folder is
    # skipped, and a FIFO is never opened for reading (it would block the worker's thread).
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host secret")
    box = tmp_path / "box"
    box.mkdir()
    (box / "out.bin").write_bytes(b"built")
    (box / "secret").symlink_to(outside / "secret")
    (box / "dir").symlink_to(outside)
    os.mkfifo(box / "fifo")
    files, _ = Workspace(tmp_path, "box", os.getuid(), os.getgid()).snapshot(1 << 20)
    assert files == [("out.bin", b"built")]


def test_a_snapshot_refuses_a_path_longer_than_the_copier_can_open(tmp_path: Path) -> None:
    # A batch's copier opens each path whole (PATH_MAX): a longer one (each of its parts
    # allowed) is the submission's compile_error, not every case's internal_error.
    workspace = Workspace(tmp_path.parent, tmp_path.name, os.getuid(), os.getgid())
    fd = os.open(tmp_path, os.O_DIRECTORY)
    for _ in range(17):  # 17 x 251 bytes below the workspace (made level by level: PATH_MAX)
        os.mkdir("d" * 250, dir_fd=fd)
        fd, parent = os.open("d" * 250, os.O_DIRECTORY, dir_fd=fd), fd
        os.close(parent)
    os.close(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=fd))
    os.close(fd)
    with pytest.raises(SnapshotTooBig, match="longer than 4095 bytes"):
        workspace.snapshot(1 << 20)


def test_a_stopped_unpacking_kills_its_copier_and_never_lets_one_start() -> None:
    unpacking = Unpacking()
    copier = subprocess.Popen(["sleep", "30"])
    assert unpacking.began(copier)
    unpacking.stop()
    assert copier.wait(5) == -signal.SIGKILL
    late = subprocess.Popen(["sleep", "30"])
    assert not unpacking.began(late)  # stopped before it began: killed at once
    assert late.wait(5) == -signal.SIGKILL


async def test_a_stoppable_isolation_step_is_stopped_by_a_cancel_and_still_waited_for() -> None:
    from worker.isolation.offload import off_loop_stoppable

    stop = threading.Event()
    ended: list[str] = []

    def step() -> None:
        stop.wait(30)
        time.sleep(0.05)  # (its clean-up, which the cancelled caller must still wait for)
        ended.append("ended")

    task = asyncio.create_task(off_loop_stoppable(step, stop.set))
    await asyncio.sleep(0.05)
    began = time.monotonic()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert ended == ["ended"] and time.monotonic() - began < 5


def test_tmpfs_charge_counts_whole_pages_and_an_inode_for_each_file_and_folder() -> None:
    files = [("a/b/c.class", b"x"), ("a/d", b"y" * 4097), ("top", b"")]
    assert tmpfs_charge(files) == 4096 + 8192 + 0 + (3 + 2) * 1024  # folders a and a/b
    assert pack_if_big(files, frozenset()) is None  # (the worker writes these itself)
    big = [("out/big", b"x" * (PACKED_FROM_BYTES - 4096)), *[(f"out/c{n}.class", b"c") for n in range(8)]]
    packed = pack_if_big(big, frozenset())  # under the threshold in bytes, past it in charge
    assert packed is not None and packed.charge_bytes == tmpfs_charge(big) >= PACKED_FROM_BYTES


async def _swallows_a_cancel() -> None:
    """What redis-py's client sometimes does with a cancel that lands during a command."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        pass


async def _ends_when_cancelled(loop_coro: Any) -> None:
    task = asyncio.create_task(loop_coro)
    await asyncio.sleep(0.05)  # inside its command
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 2)


async def test_the_callback_sender_stops_though_its_redis_client_swallowed_the_cancel() -> None:
    # It kept looping for good: the worker could not exit (asyncio waits at the end for
    # the tasks it cancels), as a worker refused for a live worker's id showed.
    redis = SimpleNamespace(register_script=lambda _source: None)
    sender = CallbackSender(SimpleNamespace(callback_timeout_ms=1000), redis, None, "t")  # type: ignore[arg-type]

    async def round_() -> float:
        await _swallows_a_cancel()
        return 0.01

    sender._round = round_  # type: ignore[method-assign]
    await _ends_when_cancelled(sender.run())


async def test_upkeep_stops_though_redis_swallowed_the_cancel() -> None:
    # (The heartbeat checks too, but on Python 3.11 its wait_for already turns a swallowed
    # cancel into a CancelledError, so a test of it here could not fail.)
    settings = load_settings({"REDIS_URL": "redis://unused", "PUSHER_SECRET": "x", "WORKER_PRESTART": "off",
                              "WORKER_HEARTBEAT_MS": "10", "WORKER_LEASE_TTL_MS": "30"})  # fmt: skip
    worker = Worker(settings, "w", SimpleNamespace(memory=MemoryAdmission(UNBOUNDED_BYTES)), {})  # type: ignore[arg-type]

    async def swallow(*_args: Any, **_kwargs: Any) -> list[str]:
        await _swallows_a_cancel()
        return []

    ctx = SimpleNamespace(queue=SimpleNamespace(claimed_ids=swallow))
    await _ends_when_cancelled(worker._upkeep(ctx))  # type: ignore[arg-type]


def _run_on(loop_kind: str, main: Any) -> None:
    """Run `main` on the stock asyncio loop or on uvloop (the worker's): their pipe
    transports differ."""
    import uvloop

    if loop_kind == "uvloop":
        uvloop.run(main)
    else:
        asyncio.run(main)


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_program_writing_line_by_line_wakes_the_pump_once_per_gathered_batch(loop_kind: str) -> None:
    # The pump's pause between small reads must hold the pipe's reading too: otherwise the
    # transport reads (and wakes the loop) for every line anyway, and the pause only
    # delays the event. 200 lines, one every 0.2 ms, are gathered into few reads.
    import threading

    lines, fed, chunks, took = 200, [], [], []

    async def main() -> None:
        read_fd, write_fd = os.pipe()
        reader, transport = await read_pipe(read_fd)
        assert isinstance(reader, PipeReader)
        original = reader.feed_data

        def counting(data: bytes) -> None:
            fed.append(len(data))
            original(data)

        reader.feed_data = counting  # type: ignore[method-assign]

        def write() -> None:
            started = time.monotonic()
            for n in range(lines):
                os.write(write_fd, b"%d\n" % n)
                time.sleep(0.0002)
            took.append(time.monotonic() - started)
            os.close(write_fd)

        async def on_data(data: bytes) -> None:
            chunks.append(data)

        writer = threading.Thread(target=write)
        writer.start()
        try:
            await asyncio.wait_for(_pump(reader, on_data, Activity(0.0)), 10)
        finally:
            writer.join()
            transport.close()

    _run_on(loop_kind, main())
    assert b"".join(chunks) == b"".join(b"%d\n" % n for n in range(lines))
    # At most one read per pause while the lines came, whatever pace a busy machine gave
    # them (about 0.25 ms apart on an idle one: some 30 reads, against 200 unheld).
    bound = took[0] / COALESCE_S + 10
    assert len(fed) <= bound, f"{len(fed)} pipe reads for {lines} lines written in {took[0] * 1000:.0f} ms"


async def test_a_step_is_gathered_longer_only_while_it_stays_chatty() -> None:
    # A bucket, not a count: a long interactive session (3,000 outputs over five minutes) is
    # never slowed for what it printed; a burst is, and so is a program paced just under a
    # rate (a rule of one-second windows let 199 a second through for good); calm ends it.
    from worker.job.supervise import CHATTY_BURST, CHATTY_COALESCE_S, CHATTY_REFILL_PER_S

    loop = asyncio.get_running_loop()
    now = [1000.0]
    loop.time = lambda: now[0]  # type: ignore[method-assign]

    def hand_overs_until_chatty(activity: Activity, apart_s: float, most: int) -> int:
        for n in range(1, most + 1):
            now[0] += apart_s
            activity.count_hand_over()
            if activity.chatty:
                return n
        return most + 1

    try:
        session = Activity(now[0])
        assert hand_overs_until_chatty(session, 0.1, 3000) == 3001
        burst = Activity(now[0])
        assert CHATTY_BURST < hand_overs_until_chatty(burst, 0.001, 1000) <= CHATTY_BURST * 1.1
        for _ in range(200):  # gathered: two streams, a hand-over each a hold, for 5 s
            now[0] += CHATTY_COALESCE_S / 2
            burst.count_hand_over()
            assert burst.chatty
        for _ in range(3):  # an interactive pace again: chatty until the bucket is half full
            now[0] += 0.3
            burst.count_hand_over()
        assert burst.chatty
        now[0] += CHATTY_BURST / 2 / CHATTY_REFILL_PER_S
        burst.count_hand_over()
        assert not burst.chatty
        paced = Activity(now[0])  # just under 200 a second, for as long as it likes
        assert hand_overs_until_chatty(paced, 1 / 199, 10 * 199) < 2 * 199
        now[0] += 5.0  # and a long silence
        paced.count_hand_over()
        assert not paced.chatty
    finally:
        del loop.time  # type: ignore[method-assign]


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_step_that_keeps_alternating_tiny_writes_is_gathered_longer(loop_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Red team: one byte at a time, alternately to stdout and stderr, 1.5 ms apart, made an
    # event of nearly every write (the two streams are never merged), 400-850 a second, each
    # 30-40 B of log in Redis besides its byte. Past a burst of CHATTY_BURST hand-overs, a step's pumps
    # gather for CHATTY_COALESCE_S instead: a few hand-overs a hold, in the order written.
    from worker.job import supervise as supervise_module

    monkeypatch.setattr(supervise_module, "CHATTY_BURST", 100)
    monkeypatch.setattr(supervise_module, "CHATTY_COALESCE_S", 0.05)
    writes, handed, took = 1200, [], []

    async def main() -> None:
        ends = [os.pipe(), os.pipe()]
        readers = [await read_pipe(read_fd) for read_fd, _ in ends]
        out, err = (write_fd for _, write_fd in ends)
        code = (f"import os, time\nfor i in range({writes}):\n    os.write({out} if i % 2 else {err}, b'%d ' % i)\n"
                "    time.sleep(0.001)\n")  # fmt: skip
        started = time.monotonic()
        writer = subprocess.Popen([sys.executable, "-c", code], pass_fds=(out, err))
        for _, write_fd in ends:
            os.close(write_fd)

        def sink(stream: str) -> Any:
            async def on_data(data: bytes) -> None:
                handed.append((stream, data))

            return on_data

        pumps, activity = supervise_module._Pumps(), Activity(0.0)
        try:
            await asyncio.wait_for(asyncio.gather(*(
                _pump(reader, sink(stream), activity, pumps) for (reader, _), stream in zip(readers, ("out", "err"), strict=True)
            )), 30)  # fmt: skip
            took.append(time.monotonic() - started)
        finally:
            writer.wait()
            for _, transport in readers:
                transport.close()

    _run_on(loop_kind, main())
    for stream, parity in (("err", 0), ("out", 1)):
        assert b"".join(data for name, data in handed if name == stream) == b"".join(
            b"%d " % i for i in range(writes) if i % 2 == parity
        )
    # (100 hand-overs, then some 2 a hold: ~60 over the 1.5 s or so the writes take; ~900 before)
    bound = 100 + 3 * took[0] / 0.05 + 20
    assert len(handed) <= bound, f"{len(handed)} hand-overs for {writes} writes in {took[0] * 1000:.0f} ms"


# Writes (stream, bytes, pause after it in ms): each a pattern two pipes read apart from each
# other used to misorder. Lines gathered in stdout's held pipe went after a stderr line
# written later; a partial line waiting for its rest went after the stderr line written
# after it; at the end a held stdout went after the traceback written last.
_ORDER_PATTERNS = {
    "gathered": [("out", b"a\n", 0.5), ("out", b"b\n", 0.5), ("err", b"E\n", 6)],
    "partial line": [("out", b"x", 0.5), ("err", b"E\n", 0.5), ("out", b"y\n", 6)],
    # The line's start went out ahead of E; its rest, read later, must not overtake F.
    "rest of a line taken": [("out", b"x", 0.5), ("err", b"E\n", 0.5), ("err", b"F\n", 0.5), ("out", b"y\n", 6)],
}


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
@pytest.mark.parametrize("pattern", list(_ORDER_PATTERNS))
def test_the_two_streams_are_handed_over_in_the_order_they_were_written(loop_kind: str, pattern: str) -> None:
    # Writes 0.5 ms apart are told apart only if the loop reads each pipe before the other
    # pipe's next write: a machine busy enough to wake the loop later than that hands both
    # pipes over in one wake, and two pipes keep no order (see _Pumps). So a misordered run
    # is tried again, up to three times; with the ordering broken, every run misorders.
    writes = _ORDER_PATTERNS[pattern] * 15
    failures = []
    for _attempt in range(3):
        failure = _misordered(writes, _hand_overs(loop_kind, writes))
        if failure is None:
            return
        failures.append(failure)
    pytest.fail("\n".join(failures))


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_the_two_streams_keep_their_order_while_a_hand_over_is_held_up(loop_kind: str) -> None:
    # The first stderr hand-over takes 50 ms (the flusher full while Redis is slow), and the
    # program writes on meanwhile: stdout's pump, waiting its turn with S1, then took what its
    # reader had buffered since (S2) along with it, ahead of E2, written before S2.
    writes = [("err", b"E1\n", 3), ("out", b"S1\n", 3), ("err", b"E2\n", 3), ("out", b"S2\n", 3)]
    failures = []
    for _attempt in range(3):
        failure = _misordered(writes, _hand_overs(loop_kind, writes, slow_first={"err": 0.05}))
        if failure is None:
            return
        failures.append(failure)
    pytest.fail("\n".join(failures))


def _hand_overs(
    loop_kind: str, writes: list[tuple[str, bytes, float]], slow_first: dict[str, float] | None = None
) -> list[tuple[str, bytes]]:
    """What two pumps hand over while another process makes `writes` to their pipes; with
    `slow_first`, a stream's first hand-over takes that many seconds."""
    handed: list[tuple[str, bytes]] = []
    slow = dict(slow_first or {})

    async def main() -> None:
        from worker.job.supervise import _Pumps

        fds = {name: os.pipe() for name in ("out", "err")}
        readers = {name: await read_pipe(fds[name][0]) for name in fds}

        # Written by another process: a thread here would take turns with the loop for the
        # interpreter lock, every few ms, and bunch the writes up.
        plan = [(fds[name][1], data, pause_ms / 1000) for name, data, pause_ms in writes]
        code = f"import os, time\nfor fd, data, pause in {plan!r}:\n    os.write(fd, data)\n    time.sleep(pause)\n"

        def taker(name: str) -> Any:
            async def on_data(data: bytes) -> None:
                if name in slow:
                    await asyncio.sleep(slow.pop(name))
                handed.append((name, data))

            return on_data

        order = _Pumps()
        activity = Activity(0.0)
        pumps = [asyncio.ensure_future(_pump(readers[name][0], taker(name), activity, order)) for name in fds]
        await asyncio.sleep(0.01)  # (both reading before the first write)
        write_ends = tuple(fds[name][1] for name in fds)
        writer = subprocess.Popen([sys.executable, "-c", code], pass_fds=write_ends)
        for fd in write_ends:
            os.close(fd)
        try:
            await asyncio.wait_for(asyncio.gather(*pumps), 10)
        finally:
            writer.wait()
            for _, transport in readers.values():
                transport.close()

    _run_on(loop_kind, main())
    return handed


def _misordered(writes: list[tuple[str, bytes, float]], handed: list[tuple[str, bytes]]) -> str | None:
    """None if `handed` is `writes` in order, else where it is not. Each stream must be whole
    (always, however busy the machine), and the hand-overs in write order: consecutive writes
    to one stream may share a hand-over (and a line its rest), never one of the other
    stream's between."""
    for name in ("out", "err"):
        assert b"".join(d for n, d in handed if n == name) == b"".join(d for n, d, _ in writes if n == name)
    runs: list[tuple[str, bytes]] = []
    for name, data, _ in writes:
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1] + data)
        else:
            runs.append((name, data))
    got: list[tuple[str, bytes]] = []
    for name, data in handed:
        if got and got[-1][0] == name:
            got[-1] = (name, got[-1][1] + data)
        else:
            got.append((name, data))
    if got == runs:
        return None
    first = next((i for i, (a, b) in enumerate(zip(got, runs, strict=False)) if a != b), min(len(got), len(runs)))
    return f"hand-over {first} of {len(runs)}: {got[max(0, first - 2) : first + 3]}"


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_program_writing_a_byte_at_a_time_costs_the_loop_little(loop_kind: str) -> None:
    # Review: reading a held pipe until it was empty raced a writer still writing, one
    # byte a read (325,548 reads and 0.49 s of the loop's CPU for 1 MB, against one read
    # and 0.03 s before the pumps took each other's bytes).
    size, handed = 300_000, []

    async def main() -> None:
        from worker.job.supervise import _Pumps

        read_fd, write_fd = os.pipe()
        reader, transport = await read_pipe(read_fd)
        code = f"import os\nfor _ in range({size}):\n    os.write({write_fd}, b'x')\n"
        writer = subprocess.Popen([sys.executable, "-c", code], pass_fds=(write_fd,))
        os.close(write_fd)

        async def on_data(data: bytes) -> None:
            handed.append(len(data))

        try:
            started = time.process_time()
            await asyncio.wait_for(_pump(reader, on_data, Activity(0.0), _Pumps()), 60)
            handed.append(-round((time.process_time() - started) * 1000))
        finally:
            writer.wait()
            transport.close()

    _run_on(loop_kind, main())
    cpu_ms = -handed.pop()
    assert sum(handed) == size
    # (10-20 ms here; about 100 with the racing reads)
    assert cpu_ms < 50, f"{cpu_ms} ms of CPU to take {size} bytes written one at a time ({len(handed)} hand-overs)"


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_output_past_a_spent_budget_is_read_in_few_big_reads(loop_kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Red team: read 64 KiB a wake-up as it came, what a program wrote past its output budget
    # (only to be dropped) cost the worker 94-98 % of a core for a job charged 0.2-0.6 of one.
    # Now the pipe is widened and read whole once a tick; once the program ended, at once.
    from worker.job import supervise as supervise_module

    monkeypatch.setattr(supervise_module, "DROP_TICK_S", 0.01)
    size = 16 << 20
    seen: dict[str, tuple[int, float]] = {}

    async def drain(ended: bool) -> tuple[int, float]:
        read_fd, write_fd = os.pipe()
        reader, transport = await read_pipe(read_fd)
        code = f"import os\nb = b'x' * 65536\nfor _ in range({size // 65536}):\n    os.write({write_fd}, b)\n"
        writer = subprocess.Popen([sys.executable, "-c", code], pass_fds=(write_fd,))
        os.close(write_fd)
        program_ended = asyncio.get_running_loop().create_future()
        if ended:
            program_ended.set_result(None)
        handed: list[int] = []

        async def on_data(data: bytes) -> None:
            handed.append(len(data))

        try:
            started = time.monotonic()
            # (A cgroup whose limit rises: this test is about the pipe.)
            room = SimpleNamespace(raise_memory_limit=lambda size: None)
            drops = supervise_module._Drops(lambda: True, program_ended, room)  # type: ignore[arg-type]
            await asyncio.wait_for(_pump(reader, on_data, Activity(0.0), supervise_module._Pumps(drops)), 30)
            # (all of it read: dropped, only each read's end handed over, for a stderr's tail)
            assert writer.wait(5) == 0 and (sum(handed) == size if ended else max(handed) <= StreamTail.SIZE), handed
            return len(handed), time.monotonic() - started
        finally:
            writer.wait()
            transport.close()

    async def main() -> None:
        seen["dropped"] = await drain(ended=False)
        seen["ended"] = await drain(ended=True)

    _run_on(loop_kind, main())
    # (16 MiB through a 1 MiB pipe emptied once a tick: some 16-32 turns, at least 0.16 s;
    # read as it comes, ~256 reads of 64 KiB within a few tens of ms)
    reads, took_s = seen["dropped"]
    assert reads <= 80 and took_s >= 0.1, seen
    assert seen["ended"][0] > 100, seen


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_holding_a_pipe_leaves_the_stream_readers_own_pause_alone(loop_kind: str) -> None:
    # While the pump waits on a slow consumer, the StreamReader pauses its transport once
    # its buffer passes twice its limit; the pump's own hold and release after a small read
    # must not resume that transport, or the buffer grows with all the program writes.
    import threading

    limit, total = 64 * 1024, 4 * 1024 * 1024
    seen: dict[str, int] = {}

    async def main() -> None:
        loop = asyncio.get_running_loop()
        read_fd, write_fd = os.pipe()
        reader = PipeReader(limit=limit)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), _pipe_object(read_fd, "rb"))
        written = threading.Event()

        def write() -> None:
            try:
                os.write(write_fd, b"x" * total)
            except OSError:
                pass
            written.set()

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        try:
            for _ in range(200):  # until the StreamReader has paused itself
                await asyncio.sleep(0.005)
                if len(reader._buffer) > 2 * limit:
                    break
            reader.hold()
            await asyncio.sleep(0.01)
            reader.release()
            await asyncio.sleep(0.2)
            seen["buffered"] = len(reader._buffer)
            seen["all_written"] = written.is_set()
        finally:
            transport.close()  # the blocked writer gets EPIPE once the loop has closed it
            await loop.run_in_executor(None, writer.join, 5)
            os.close(write_fd)

    _run_on(loop_kind, main())
    assert seen["buffered"] <= 4 * limit, seen
    assert not seen["all_written"], seen


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_a_pipe_held_open_by_someone_else_ends_with_what_it_holds(loop_kind: str) -> None:
    # After the gate's report nsjail still holds the program's pipes open, so their EOF
    # comes only with nsjail's exit: take_rest() must end the stream at once with all the
    # pipe holds (read before, and still in it), and end a pump's pause there too.
    got: dict[str, Any] = {}

    async def main() -> None:
        read_fd, write_fd = os.pipe()
        reader, transport = await read_pipe(read_fd)
        assert isinstance(reader, PipeReader)
        try:
            os.write(write_fd, b"a" * 1000)
            await asyncio.sleep(0.02)  # the transport reads this part
            pause = asyncio.create_task(reader.pause(30))
            await asyncio.sleep(0)
            os.write(write_fd, b"b" * 60000)  # held: this part stays in the pipe
            started = time.monotonic()
            reader.take_rest()
            got["data"] = await asyncio.wait_for(reader.read(), 1)
            await asyncio.wait_for(pause, 1)
            got["took"] = time.monotonic() - started
        finally:
            transport.close()
            os.close(write_fd)

    _run_on(loop_kind, main())
    assert got["data"] == b"a" * 1000 + b"b" * 60000
    assert got["took"] < 0.5, got["took"]


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
@pytest.mark.parametrize("ending", ["closed", "take_rest"])
def test_a_stream_that_ended_with_its_last_line_is_not_held_for_more(
    loop_kind: str, ending: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # print(1) then exit: "1\n" and the end come together. The pump handed the line over and
    # then held the pipe to gather more, a whole hold (2 ms, 25 for a chatty step) on every
    # step's end, though nothing more could come: its pause cannot hold a pipe at its end.
    monkeypatch.setattr("worker.job.supervise.COALESCE_S", 1.0)
    got: dict[str, Any] = {}

    async def main() -> None:
        read_fd, write_fd = os.pipe()
        reader, transport = await read_pipe(read_fd)
        taken: list[bytes] = []

        async def on_data(data: bytes) -> None:
            taken.append(data)

        try:
            os.write(write_fd, b"1\n")
            if ending == "closed":
                os.close(write_fd)
            await asyncio.sleep(0.05)  # the transport reads the line (and the end)
            if ending == "take_rest":
                reader.take_rest()
            started = time.monotonic()
            await asyncio.wait_for(_pump(reader, on_data, Activity(asyncio.get_running_loop().time())), 5)
            got["took"], got["taken"] = time.monotonic() - started, taken
        finally:
            transport.close()
            if ending != "closed":
                os.close(write_fd)

    _run_on(loop_kind, main())
    assert got["taken"] == [b"1\n"]
    assert got["took"] < 0.5, got["took"]


def _exhaust_seccomp_budget() -> None:
    """In a child before exec: stack allow-all filters until not even a one-instruction
    filter fits the kernel's instruction budget per call path, so the gate's is refused."""
    import ctypes

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        os._exit(99)
    allow = struct.pack("<HBBI", 0x06, 0, 0, 0x7FFF0000)  # RET ALLOW
    noop = struct.pack("<HBBI", 0x05, 0, 0, 0)  # JA +0
    length = 4096
    while length:
        code = ctypes.create_string_buffer(noop * (length - 1) + allow)
        prog = SockFprog(length, ctypes.addressof(code))
        if libc.prctl(22, 2, ctypes.byref(prog), 0, 0) != 0:  # PR_SET_SECCOMP, FILTER: full
            length //= 2


async def test_a_gate_whose_filter_the_kernel_refuses_runs_nothing_and_says_so(tmp_path: Path) -> None:
    # The gate's own seccomp filter is part of the policy: without it the gate must run no
    # program, and say why on the status pipe, so the job ends as an internal error and
    # not as a program that "exited 126".
    import subprocess

    from worker.isolation.sandbox import GATE_SOURCE, _compile

    gate = await _compile(GATE_SOURCE, tmp_path, "gate")
    status_read, status_write = os.pipe()
    proc = subprocess.run(
        [str(gate), str(status_write)],
        input=Program(argv=["/bin/echo", "ran"], env={}).frame(),
        capture_output=True,
        pass_fds=(status_write,),
        preexec_fn=_exhaust_seccomp_budget,
        timeout=10,
    )
    os.close(status_write)
    with os.fdopen(status_read, "rb") as status:
        report = status.read()
    assert (proc.returncode, proc.stdout, report) == (126, b"", b"ready\nfault seccomp\n")

    async def exited() -> int:
        return 126

    log, log_write = _log_pipe()
    os.close(log_write)
    read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    os.write(write_end, report)
    os.close(write_end)
    proc_stub = SimpleNamespace(wait=exited, on_exit=lambda callback: None, stdout=None, stderr=None, pid=0, returncode=126)
    jail = Jail(proc_stub, log, read_end, SimpleNamespace(job_id="x"))  # type: ignore[arg-type]
    ended = await asyncio.wait_for(jail.wait(), 2)
    assert (ended.exit_code, ended.signal) == (None, None)
    assert ended.errors == ["the jail's gate failed: seccomp"]


def _log_pipe() -> tuple[int, int]:
    """A pipe like the one nsjail logs to: the worker's end (non-blocking) and nsjail's."""
    read_end, write_end = os.pipe()
    os.set_blocking(read_end, False)
    return read_end, write_end


async def test_the_program_ends_at_a_whole_report_and_at_nothing_else() -> None:
    # The step ends at the gate's report, before nsjail exits: only a whole, well-formed
    # line may end it. A partial line waits for the rest; a line that is not a report
    # leaves the end to nsjail's exit.
    async def running() -> int:
        await asyncio.sleep(3600)
        return 0

    for lines, want in (([b"exi", b"t 3\n"], 3), ([b"nonsense\n"], None)):
        status_read, status_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        stdin = SimpleNamespace(write=lambda data: None, is_closing=lambda: False)
        proc = SimpleNamespace(
            wait=running, on_exit=lambda callback: None, stdin=stdin, stdout=None, stderr=None, pid=0, returncode=None, close=lambda: None
        )
        log, log_write = _log_pipe()
        jail = Jail(proc, log, status_read, SimpleNamespace(job_id="x"))  # type: ignore[arg-type]
        jail.go(Program(argv=["/bin/true"], env={}))
        for line in lines:
            assert not jail.ended.done()
            os.write(status_write, line)
            await asyncio.sleep(0.05)
        if want is None:
            assert not jail.ended.done() and not jail.reported
        else:
            assert jail.ended.done() and jail.reported
            ended = await asyncio.wait_for(jail.wait_program(), 1)
            assert (ended.exit_code, ended.signal) == (want, None)
        os.close(status_write)
        os.close(log_write)
        jail.close()


async def test_a_wait_cancelled_after_the_jail_exited_loses_neither_the_report_nor_the_log() -> None:
    # supervise() cancels its wait task, destroy() times one out: the next wait() must still
    # read the gate's report (and the log reader must still be alive to end).
    status_read, status_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    os.write(status_write, b"signal 9\n")
    os.close(status_write)

    async def exited() -> int:
        return 0

    log, log_write = _log_pipe()
    proc = SimpleNamespace(wait=exited, on_exit=lambda callback: None, stdout=None, stderr=None, pid=0, returncode=0)
    jail = Jail(proc, log, status_read, SimpleNamespace(job_id="x"))  # type: ignore[arg-type]
    first = asyncio.create_task(jail.wait())
    await asyncio.sleep(0.01)  # nsjail has exited; its log is still being read
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    os.close(log_write)
    ended = await asyncio.wait_for(jail.wait(), 2)
    assert (ended.exit_code, ended.signal) == (None, "SIGKILL")


async def test_a_jail_is_ready_at_the_gates_first_line_and_ends_as_nsjail_says() -> None:
    # nsjail runs quiet: the gate's "ready" on the status pipe (however it is cut) says the
    # jail runs; without a report from the gate, nsjail's exit status (128 + the signal)
    # says how the gate ended, and the log keeps nsjail's warnings and errors.
    released: list[int] = []
    cgroup = SimpleNamespace(job_id="x", release_supervisor=released.append, listed=lambda: [8])
    status_read, status_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    async def exited() -> int:
        return 137

    log, log_write = _log_pipe()
    proc = SimpleNamespace(
        wait=exited,
        on_exit=lambda callback: None,
        hold_reap=lambda: None,
        reaping=False,
        allow_reap=lambda: None,
        stdout=None,
        stderr=None,
        pid=5,
        returncode=None,  # (still running when the gate says it runs)
    )
    jail = Jail(proc, log, status_read, cgroup, backstop_s=3600)  # type: ignore[arg-type]
    warning = b"[W][2026-12-02T00:37:14+0000][1] createMountTarget():142 open('/proc/modules'): No such file"
    os.write(log_write, warning + b"\n")
    os.write(status_write, b"rea")
    await asyncio.sleep(0.02)
    assert released == [] and not jail.ended.done()
    os.write(status_write, b"dy\n")
    await asyncio.wait_for(jail.wait_ready(2), 3)
    assert released == [5] and not jail.ended.done()
    os.close(status_write)  # the gate was killed: it never reported
    os.close(log_write)
    proc.returncode = 137
    ended = await asyncio.wait_for(jail.wait(), 2)
    assert (ended.exit_code, ended.signal, ended.backstop_fired) == (None, "SIGKILL", False)
    assert jail.error_lines() == [warning.decode()]


@pytest.mark.parametrize(
    ("returncode", "ran_s", "want"),
    [
        (128 + 9, 0, (None, "SIGKILL", False)),  # a clock of ours, a kill, the memory limit
        (128 + 9, 16, (None, "SIGKILL", True)),  # nsjail's time limit (the backstop), 30 s
        (128 + 9, 14, (None, "SIGKILL", False)),  # short of it by more than the margin
        (128 + 31, 60, (None, "SIGSYS", False)),  # the kernel's (seccomp); only SIGKILL is a backstop
        (128 + 15, 60, (None, None, False)),  # nsjail itself stopped by SIGTERM: not the gate's
        (124, 0, (None, None, False)),  # the gate's own early exit: the program never ran
        (0, 0, (None, None, False)),  # (the frame never came)
        (255, 0, (None, None, False)),  # nsjail failed itself
        (-9, 0, (None, None, False)),  # nsjail itself was killed
    ],
)
async def test_an_end_the_gate_did_not_report_is_read_from_nsjails_exit(
    returncode: int, ran_s: float, want: tuple[Any, ...]
) -> None:
    status_read, status_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    os.write(status_write, b"ready\n")
    os.close(status_write)

    async def exited() -> int:
        return returncode

    cgroup = SimpleNamespace(job_id="x", release_supervisor=lambda pid: None, listed=lambda: [8])
    log, log_write = _log_pipe()
    os.close(log_write)
    proc = SimpleNamespace(
        wait=exited, on_exit=lambda callback: None, hold_reap=lambda: None, allow_reap=lambda: None, reaping=False,
        stdout=None, stderr=None, pid=5, returncode=None,
    )  # fmt: skip
    jail = Jail(proc, log, status_read, cgroup, backstop_s=30)  # type: ignore[arg-type]
    await asyncio.wait_for(jail.wait_ready(2), 3)
    jail._launched_at -= ran_s
    proc.returncode = returncode
    ended = await asyncio.wait_for(jail.wait(), 2)
    assert (ended.exit_code, ended.signal, ended.backstop_fired) == want
    assert bool(ended.errors) == (want[:2] == (None, None))


async def test_nsjail_stays_unreaped_while_it_is_moved_out_of_the_jobs_cgroups() -> None:
    # The release writes nsjail's pid into the supervisor cgroups on an isolation thread.
    # If nsjail died and were reaped meanwhile, that number could go to a host process,
    # which the write would then move: nsjail is reaped only once the release is over.
    proc = await Child.spawn(["/bin/sh", "-c", "read line"], merge_stderr=True, pass_fds=())
    writing = threading.Event()
    may_finish = threading.Event()

    def release(pid: int) -> None:
        writing.set()
        may_finish.wait(10)

    cgroup = SimpleNamespace(job_id="x", release_supervisor=release, listed=lambda: [proc.pid])
    status_read, status_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    log, log_write = _log_pipe()
    jail = Jail(proc, log, status_read, cgroup)  # type: ignore[arg-type]
    try:
        os.write(status_write, b"ready\n")
        assert await asyncio.to_thread(writing.wait, 5)
        watch = os.pidfd_open(proc.pid)
        os.kill(proc.pid, 9)
        assert select.select([watch], [], [], 5)[0]  # it has exited
        os.close(watch)
        for _ in range(20):  # turns enough for the loop to have reaped it, had it been watched
            await asyncio.sleep(0.005)
        state = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert state == "Z" and proc.returncode is None
        may_finish.set()
        await asyncio.wait_for(jail.wait_ready(2), 3)
        assert await asyncio.wait_for(proc.wait(), 2) == -9
        assert not Path(f"/proc/{proc.pid}").exists()
    finally:
        may_finish.set()
        os.close(log_write)
        os.close(status_write)
        proc.close()
        jail.close()


async def test_nsjail_reaped_before_its_ready_line_is_read_is_not_released_by_pid() -> None:
    # nsjail died just after the gate said it runs, and its exit was handled first:
    # its pid may be another process's now, so nothing is written into a cgroup by it.
    released: list[int] = []
    cgroup = SimpleNamespace(job_id="x", release_supervisor=released.append, listed=lambda: [8])
    status_read, status_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    log, log_write = _log_pipe()
    proc = SimpleNamespace(
        on_exit=lambda callback: None, hold_reap=lambda: None, allow_reap=lambda: None, reaping=False,
        stdout=None, stderr=None, pid=5, returncode=-9, close=lambda: None,
    )  # fmt: skip
    jail = Jail(proc, log, status_read, cgroup)  # type: ignore[arg-type]
    os.write(status_write, b"ready\n")
    await asyncio.sleep(0.02)
    os.close(log_write)
    with pytest.raises(JailError, match="failed to start the jail"):
        await asyncio.wait_for(jail.wait_ready(2), 3)
    assert released == []
    os.close(status_write)
    jail.close()


async def test_a_jail_that_never_executes_fails_with_nsjails_own_errors() -> None:
    # nsjail ended (its log at EOF) before the gate said it runs: wait_ready()
    # reports nsjail's error lines, and nsjail is never moved out of cgroups it was not in.
    released: list[int] = []
    cgroup = SimpleNamespace(job_id="x", release_supervisor=released.append, listed=lambda: [])
    status_read, status_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    os.close(status_write)
    log, log_write = _log_pipe()
    proc = SimpleNamespace(on_exit=lambda callback: None, stdout=None, stderr=None, pid=5, returncode=255, close=lambda: None)
    jail = Jail(proc, log, status_read, cgroup)  # type: ignore[arg-type]
    os.write(log_write, b"[I][t] Mode: STANDALONE_ONCE\n[E][t][1] mountFs(): mount('/usr'): Permission denied\n")
    await asyncio.sleep(0.01)
    os.write(log_write, b"[F][t][1] runChild(): Launching child process failed")
    os.close(log_write)
    with pytest.raises(JailError, match=r"failed to start the jail: \[E\].*Permission denied; \[F\].*Launching child"):
        await asyncio.wait_for(jail.wait_ready(2), 3)
    assert released == []
    jail.close()


async def test_closing_a_jail_ends_a_wait_for_it_to_be_ready() -> None:
    status_read, status_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    log, log_write = _log_pipe()
    proc = SimpleNamespace(on_exit=lambda callback: None, stdout=None, stderr=None, pid=5, returncode=None, close=lambda: None)
    jail = Jail(proc, log, status_read, SimpleNamespace(job_id="x"))  # type: ignore[arg-type]
    waiting = asyncio.create_task(jail.wait_ready(30))
    await asyncio.sleep(0.05)
    jail.close()
    with pytest.raises(JailError, match="failed to start the jail"):
        await asyncio.wait_for(waiting, 2)
    for fd in (status_write, log_write):
        os.close(fd)


@pytest.mark.parametrize(("burn_s", "added_s"), [(0.0, 0), (0.9, 1)])
def test_a_waiting_runtimes_cpu_rlimit_gives_back_its_start_up(burn_s: float, added_s: int) -> None:
    """RLIMIT_CPU counts a process's CPU from its own start: a runtime that spent most of a
    second starting gets that second added to the job's rlimit (else the kernel kills a
    busy job before the worker's CPU clock fires); a quick start-up changes nothing."""
    import resource
    import subprocess

    from worker.isolation.sandbox import _cpu_used_s, _set_rlimits

    burner = subprocess.Popen(
        [sys.executable, "-c", f"import time\nwhile time.process_time() < {burn_s}: pass\nprint(flush=True)\ntime.sleep(30)"],
        stdout=subprocess.PIPE,
    )
    try:
        assert burner.stdout is not None and burner.stdout.readline() == b"\n"  # done burning
        used = _cpu_used_s(burner.pid)
        assert burn_s - 0.05 <= used < burn_s + 0.5, used  # /proc counts whole ticks
        _set_rlimits(burner.pid, Program(argv=["x"], env={}, rlimit_cpu_s=3, rlimit_nofile=64), used)
        assert resource.prlimit(burner.pid, resource.RLIMIT_CPU) == (3 + added_s, 3 + added_s)
        assert resource.prlimit(burner.pid, resource.RLIMIT_NOFILE) == (64, 64)
    finally:
        burner.kill()
        burner.wait()


async def test_a_publish_whose_answer_is_lost_is_not_sent_again() -> None:
    # A PUBLISH whose connection drops before the answer may have gone out: the publisher's
    # Redis client must not send it again (that could double a result), and a result counts
    # as failed, not as unheard (which would send it once more over HTTP; only output and
    # stages go again, see test_publisher's lost-midway test).
    from shared.settings import load_settings
    from worker.messaging.publisher import Publisher, _Event

    publishes: list[bytes] = []

    async def redis_that_drops_publishes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            if b"PUBLISH" in data:
                publishes.append(data)
                writer.close()
                return
            writer.write(b"+OK\r\n" * data.count(b"*"))  # the client's set-up commands

    server = await asyncio.start_server(redis_that_drops_publishes, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    publisher = Publisher(load_settings({"REDIS_URL": f"redis://127.0.0.1:{port}/0", "PUSHER_PUBLISH": "redis", "PUSHER_PORT": "9"}))
    try:
        await publisher.deliver([_Event("private-run-x", "result", '{"seq":1}')])
    finally:
        await publisher.aclose()
        server.close()
    assert len(publishes) == 1
    assert (publisher.sent, publisher.failed) == (0, 1)


async def test_a_lane_lets_an_append_publish_only_when_that_keeps_its_rules() -> None:
    from worker.messaging.publisher import LANE_BURST_BYTES, Publisher

    env = {"REDIS_URL": "redis://127.0.0.1:9/0", "PUSHER_PORT": "9"}  # (nothing is sent)
    over_http = Publisher(load_settings({**env, "PUSHER_PUBLISH": "http"})).lane("private-run-x")
    publisher = Publisher(load_settings({**env, "PUSHER_PUBLISH": "redis"}))
    lane = publisher.lane("private-run-x")
    await asyncio.sleep(0)  # (its drain waits, idle)
    assert over_http.direct_mode(10) is None  # (events go through HTTP: no script publishes)
    assert lane.direct_mode(10) == "followed"  # never looked: the script looks for the mark
    assert lane.direct_mode(LANE_BURST_BYTES + 1) is None  # past what the pacing allows now
    lane.learned_audience(False)
    assert lane.direct_mode(10) is None  # nobody at the last look: no messages built in vain
    lane.learned_audience(True)
    assert lane.direct_mode(10) == "always"
    lane.published_directly(2, LANE_BURST_BYTES, True)  # (what went out spends the pacing's room)
    assert lane.direct_mode(100_000) is None and (publisher.sent, publisher.sent_via_redis) == (2, 2)
    lane._tokens = float(LANE_BURST_BYTES)
    lane.send("stdout", b'{"chunk":"x","seq":3}')
    assert lane.direct_mode(10) is None  # something waits in the lane: it goes first
    for each in (lane, over_http):
        await each.close(0.1)
    await publisher.aclose()


def _compiled() -> tuple[StepFacts, CompileInfo]:
    """What a compile that succeeded in 5 ms returns."""
    facts = StepFacts(JailExit(exit_code=0, signal=None, backstop_fired=False), None, 5, 5, 1024, 0)
    return facts, CompileInfo(exit_code=0, signal=None, timed_out=False, duration_ms=5, output="")


class _LendingPool:
    """Lends one sandbox at once to a parked compile; records what is kept or given back."""

    def __init__(self) -> None:
        self.kept: list[object] = []
        self.given_back: list[object] = []
        # (A sandbox whose jail is alive.)
        self.sandbox = SimpleNamespace(jail=SimpleNamespace(ended=_Ended()))

    async def borrow(self, recall: Any, program: Program, language: str) -> object:
        return self.sandbox

    def keep(self, sandbox: object) -> None:
        self.kept.append(sandbox)

    def give_back(self, sandbox: object) -> None:
        self.given_back.append(sandbox)


async def test_a_kill_sent_on_to_a_compile_that_ends_without_reading_it_reaches_the_run() -> None:
    # Started while its parked compile runs: a kill then goes to the compile's own inbox.
    # A compile that ends before it reads it has not acted on it, so the run must see it.
    compiling = asyncio.Event()
    finish = asyncio.Event()

    async def compile_(inbox: Any, sandbox: Any, events: Any) -> Any:
        compiling.set()
        await finish.wait()
        return _compiled()

    async def load(sandbox: Any) -> None:
        pass

    pool = _LendingPool()
    precompile = Precompile("job", pool, load, compile_, Program(argv=["main"], env={}), "c")  # type: ignore[arg-type]
    await compiling.wait()
    ctrl: asyncio.Queue[Any] = asyncio.Queue()
    kill = CtrlMessage(type="kill")
    loop = asyncio.get_running_loop()
    loop.call_later(0.01, ctrl.put_nowait, kill)
    loop.call_later(0.03, finish.set)
    assert await precompile.settle(ctrl, _LoggedEvents()) == "compiled"
    assert ctrl.qsize() == 1 and ctrl.get_nowait() is kill
    assert precompile.take() is pool.sandbox and pool.kept == [pool.sandbox]


@pytest.mark.parametrize(
    "ends", ["while-parked", "then-recalled", "as-it-starts", "while-its-start-logs", "after-start", "loaded"]
)
async def test_a_held_sandbox_whose_jail_ends_while_parked_is_given_back_once(ends: str) -> None:
    # The host's OOM killer, say, ends the held sandbox's jail while the job waits: the
    # sandbox goes back at once (its slot rebuilds, not at the job's start or expiry), and at
    # start the job compiles (or loads) again, its first compile's recorded events dropped
    # (none went out). Once the start has begun, the jail's end is the start's to judge. In
    # every case the sandbox goes back once at most (the jail's `ended` is a real future: its
    # callbacks run a turn after it is set, removed or not).
    async def compile_(inbox: Any, sandbox: Any, events: Any) -> Any:
        await events.stage("compiling")
        return _compiled()

    async def load(sandbox: Any) -> None:
        pass

    loop = asyncio.get_running_loop()
    pool = _LendingPool()
    ended: asyncio.Future[None] = loop.create_future()
    pool.sandbox.jail.ended = ended
    if ends == "loaded":
        pool.lend_ready = lambda recall, program, language: pool.sandbox  # type: ignore[attr-defined]
    precompile = Precompile("job", pool, load, None if ends == "loaded" else compile_, Program(argv=["main"], env={}), "c")  # type: ignore[arg-type]
    held = PrecompileState.LOADED if ends == "loaded" else PrecompileState.COMPILED
    for _ in range(100):
        if precompile.state is held:
            break
        await asyncio.sleep(0)
    assert precompile.state is held
    sent = _SentEvents()
    if ends in ("while-parked", "loaded"):
        ended.set_result(None)
        await asyncio.sleep(0)
        assert pool.given_back == [pool.sandbox] and precompile.state is PrecompileState.GONE
        assert await precompile.settle(asyncio.Queue(), sent) == "gone"
        assert sent.calls == []
    elif ends == "then-recalled":
        # Recalled by a started job in the turn the jail ended, before its give-back ran.
        ended.set_result(None)
        precompile._recall()
        await asyncio.sleep(0)
        assert pool.given_back == [pool.sandbox]
    elif ends == "as-it-starts":
        # Ended, its give-back not yet run: nothing has gone out, so the job compiles again.
        ended.set_result(None)
        assert await precompile.settle(asyncio.Queue(), sent) == "gone"
        await asyncio.sleep(0)
        assert sent.calls == [] and pool.given_back == [pool.sandbox]
    elif ends == "while-its-start-logs":
        # Ended while the start logs the recorded compile (a Redis round trip): what went out
        # cannot be taken back, and compiling again would show the client two compiles: the
        # job fails as the platform's.
        sent.during_stage = lambda: ended.set_result(None)
        with pytest.raises(JailError, match="ended before it could run"):
            await precompile.settle(asyncio.Queue(), sent)
        await asyncio.sleep(0)
        assert sent.calls == [("stage", "compiling")] and pool.given_back == [pool.sandbox]
    else:
        assert await precompile.settle(asyncio.Queue(), sent) == "compiled"
        assert precompile.take() is pool.sandbox
        ended.set_result(None)
        await asyncio.sleep(0)
        assert pool.given_back == [] and sent.calls == [("stage", "compiling")]
    await asyncio.sleep(0)
    assert len(pool.given_back) <= 1


async def test_a_recalled_compile_that_swallows_its_cancel_still_gives_its_sandbox_back_once() -> None:
    # A compile step that swallows the recall's cancel and returns: what it did is not the
    # job's any more, and the sandbox goes back once (before, the compile's end set the job
    # COMPILED again over the recall's GONE, and never gave the sandbox back).
    compiling = asyncio.Event()

    async def compile_(inbox: Any, sandbox: Any, events: Any) -> Any:
        compiling.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.Event().wait()
        return _compiled()

    async def load(sandbox: Any) -> None:
        pass

    pool = _LendingPool()
    precompile = Precompile("job", pool, load, compile_, Program(argv=["main"], env={}), "c")  # type: ignore[arg-type]
    await compiling.wait()
    precompile._recall()
    for _ in range(10):
        await asyncio.sleep(0)
    assert precompile.state is PrecompileState.GONE and pool.given_back == [pool.sandbox]
    assert await precompile.settle(asyncio.Queue(), _SentEvents()) == "gone"
    assert pool.given_back == [pool.sandbox]


async def test_a_discarded_precompile_gives_its_sandbox_back_only_once_its_load_is_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A parked job's load waits behind slow work on the isolation threads (it finishes
    # whatever a cancel says: off_loop), and the job is killed. The discard's wait is bounded:
    # it gave the sandbox back anyway, its slot was rebuilt at the same mount point and uid,
    # and the load's files landed in the next job's workspace.
    monkeypatch.setattr("worker.job.precompile.cancel_and_wait", functools.partial(cancel_and_wait, timeout_s=0.05))
    loading, load_over = asyncio.Event(), asyncio.Event()

    async def load(sandbox: Any) -> None:
        loading.set()
        while not load_over.is_set():  # (as off_loop: a cancel waits for the thread)
            with contextlib.suppress(asyncio.CancelledError):
                await load_over.wait()
        raise asyncio.CancelledError

    async def compile_(inbox: Any, sandbox: Any, events: Any) -> Any:
        raise AssertionError("never reached: the load is cancelled")

    pool = _LendingPool()
    precompile = Precompile("job", pool, load, compile_, Program(argv=["main"], env={}), "c")  # type: ignore[arg-type]
    await asyncio.wait_for(loading.wait(), 1)
    try:
        await precompile.discard()
        assert precompile.state is PrecompileState.GONE and pool.given_back == []
    finally:
        load_over.set()
        for _ in range(10):
            await asyncio.sleep(0)
    assert pool.given_back == [pool.sandbox]


class _LoggedEvents:
    async def stage(self, phase: str) -> None:
        pass

    async def chunk_runs(self, runs: list[tuple[str, str]]) -> None:
        pass


@pytest.mark.parametrize("breaks", ["while-parked", "after-start", "after-start-before-any-event"])
async def test_a_parked_compile_that_breaks_is_compiled_again_only_if_nothing_went_out(breaks: str) -> None:
    # A compile that breaks while parked (a jail error, say) left nothing a client saw: the
    # job compiles after start. One that breaks after start had its stage and output sent on
    # already: compiling again would show the client the compile twice, so settle raises
    # what broke it and the job ends as any compile that breaks after start.
    compiling, fail = asyncio.Event(), asyncio.Event()

    async def compile_(inbox: Any, sandbox: Any, events: Any) -> Any:
        if breaks != "after-start-before-any-event":
            await events.stage("compiling")
            await events.chunk_runs([("compile_output", "cc: working\n")])
        compiling.set()
        await fail.wait()
        raise OSError("the jail broke")

    async def load(sandbox: Any) -> None:
        pass

    pool = _LendingPool()
    precompile = Precompile("job", pool, load, compile_, Program(argv=["main"], env={}), "c")  # type: ignore[arg-type]
    await compiling.wait()
    sent = _SentEvents()
    if breaks == "while-parked":
        fail.set()
        await asyncio.sleep(0.01)
        assert await precompile.settle(asyncio.Queue(), sent) == "gone"
        assert sent.calls == []
    elif breaks == "after-start":
        asyncio.get_running_loop().call_later(0.02, fail.set)
        with pytest.raises(OSError, match="the jail broke"):
            await precompile.settle(asyncio.Queue(), sent)
        assert sent.calls == [("stage", "compiling"), ("chunks", [("compile_output", "cc: working\n")])]
    else:  # (a load that fails, say: nothing for a client to have seen)
        asyncio.get_running_loop().call_later(0.02, fail.set)
        assert await precompile.settle(asyncio.Queue(), sent) == "gone"
        assert sent.calls == []
    assert pool.given_back == [pool.sandbox] and precompile.sandbox is None
    await precompile.discard()


class _SentEvents:
    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []
        self.during_stage: Callable[[], None] | None = None  # (called while a stage's write waits)

    async def stage(self, phase: str) -> None:
        self.calls.append(("stage", phase))
        if self.during_stage is not None:
            self.during_stage()
            await asyncio.sleep(0)

    async def chunk_runs(self, runs: list[tuple[str, str]]) -> None:
        self.calls.append(("chunks", runs))


async def test_a_cancelled_settle_leaves_no_reader_on_the_jobs_control_queue() -> None:
    # The worker stopping cancels a job waiting for its parked compile: no read of the job's
    # control queue may outlive that wait and take a message meant for whoever reads next.
    finish = asyncio.Event()

    async def compile_(inbox: Any, sandbox: Any, events: Any) -> Any:
        await finish.wait()

    async def load(sandbox: Any) -> None:
        pass

    precompile = Precompile("job", _LendingPool(), load, compile_, Program(argv=["main"], env={}), "c")  # type: ignore[arg-type]
    await asyncio.sleep(0.01)
    ctrl: asyncio.Queue[Any] = asyncio.Queue()
    settling = asyncio.create_task(precompile.settle(ctrl, _LoggedEvents()))
    await asyncio.sleep(0.01)
    settling.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await settling
    kill = CtrlMessage(type="kill")
    ctrl.put_nowait(kill)
    await asyncio.sleep(0.01)
    assert ctrl.qsize() == 1 and ctrl.get_nowait() is kill
    await precompile.discard()


async def test_a_loan_recalled_before_its_borrower_resumed_still_goes_to_the_started_job() -> None:
    # A rebuilt sandbox is lent to a waiting parked compile; in the same turn, before that
    # compile resumes, a started job finds nothing ready and recalls the loan. The recall must
    # not be lost: the sandbox goes to the started job, not to a compile that may keep it
    # until its own start or expiry.
    factory = _RecordingFactory()
    factory.gate.set()
    pool = SandboxPool(factory, "w", slots=2)  # type: ignore[arg-type]
    pool.start()
    await _turns()
    lent = await pool.borrow(lambda: None)
    running = await pool.take()

    async def compile_(inbox: Any, sandbox: Any, events: Any) -> Any:
        await asyncio.Event().wait()

    async def load(sandbox: Any) -> None:
        pass

    parked = Precompile("parked", pool, load, compile_, Program(argv=["main"], env={}), "c")  # type: ignore[arg-type]
    await _turns()
    assert parked.state is PrecompileState.WAITING  # one slot always stays for started jobs
    factory.gate.clear()
    pool.give_back(lent)  # its slot rebuilds, held at the gate
    await _turns()

    async def start() -> Any:
        await factory.gate.wait()  # woken in the turn the rebuild ends, after it
        return await pool.take()

    started = asyncio.create_task(start())
    await _turns()
    factory.gate.set()
    await _turns()
    assert started.done(), parked.state
    assert started.result() is not running and parked.state is PrecompileState.GONE
    await parked.discard()
    await pool.close()


async def _slow_taker_step(taker_s: float, jail: Any, idle_ms: int | None) -> tuple[Any, list[bytes]]:
    """A step whose program wrote one line, and whose output is taken away slowly (the
    flusher full while Redis is away): each hand-over takes `taker_s`."""
    stdout = asyncio.StreamReader()
    stdout.feed_data(b"line\n")
    stdout.feed_eof()
    taken: list[bytes] = []

    async def on_data(data: bytes) -> None:
        await asyncio.sleep(taker_s)
        taken.append(data)

    facts = await supervise(
        jail,
        _CountingCgroup(),  # type: ignore[arg-type]
        Program(argv=["main"], env={}),
        Clocks(wall_ms=5000, cpu_ms=5000, idle_ms=idle_ms),
        [(stdout, on_data)],
        asyncio.Queue(),
    )
    return facts, taken


async def test_output_held_up_on_the_workers_side_does_not_count_as_idle() -> None:
    # The program is blocked writing because the worker cannot take its output away yet:
    # that is not the program being idle.
    facts, taken = await _slow_taker_step(0.3, _ExitsLate(0.33), idle_ms=150)
    assert facts.fired is None and taken == [b"line\n"], facts


async def test_output_held_up_on_the_workers_side_is_waited_for_past_the_exit_grace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The program has exited; what it wrote is still being handed over (slowly, not stuck):
    # it is waited for, not cut off at the grace period and silently lost.
    monkeypatch.setattr("worker.job.supervise.EXIT_GRACE_S", 0.1)
    facts, taken = await _slow_taker_step(0.3, _ExitsLate(0.02), idle_ms=None)
    assert facts.fired is None and taken == [b"line\n"], facts


async def test_a_flusher_that_stopped_while_full_never_leaves_a_pump_waiting_for_room() -> None:
    # Its append failed (fenced, or Redis away too long) with a full batch queued: the pump
    # waiting then got the error, but the next hand-over (the other stream's, or what is left)
    # filled it again, and no flush loop was left to make room: that pump waited forever, and
    # the step with it, holding its slot until the worker stopped.
    gate = asyncio.Event()

    class FailingEvents:
        job_id = "j1"

        async def chunk_runs(self, _runs: list[tuple[str, str]]) -> None:
            await gate.wait()
            raise RuntimeError("the append failed")

    flusher = OutputFlusher(FailingEvents())  # type: ignore[arg-type]
    flusher.add("stdout", ["x"])
    await _turns()  # (its batch taken: the append is in flight)
    flusher.add("stdout", ["y" * 8192] * (MAX_PENDING_BYTES // 8192))
    waiting = asyncio.create_task(flusher.room())
    await _turns()
    assert not waiting.done()
    gate.set()
    with pytest.raises(RuntimeError, match="append failed"):
        await asyncio.wait_for(waiting, 1)
    flusher.add("stderr", ["z"])
    with pytest.raises(RuntimeError, match="append failed"):
        await asyncio.wait_for(flusher.room(), 1)
    assert not await flusher.drain(1)


async def test_a_wait_for_a_sandbox_counts_failed_builds_from_the_last_success() -> None:
    # Two started jobs wait on a worker whose builds begin to fail: one more build succeeds
    # (the first job takes it), then every build fails. The second job must give up too,
    # counting failures from that success, not wait for a success that never comes.
    pool = SandboxPool(_FakeFactory(), "w", slots=2)  # type: ignore[arg-type]
    mark = pool.build_mark()
    pool.builds_failed += 2
    assert not pool.failing(mark)
    pool.builds_made += 1  # went to the job ahead
    assert not pool.failing(mark)
    pool.builds_failed += 2
    assert not pool.failing(mark)
    pool.builds_failed += 1
    assert pool.failing(mark)


async def test_output_still_moving_after_the_exit_grace_is_waited_for_between_hand_overs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # At the end of the grace the pump is between two slow hand-overs (none in progress), but
    # output is still moving: the step keeps waiting rather than cut the rest off.
    monkeypatch.setattr("worker.job.supervise.EXIT_GRACE_S", 0.1)
    stdout = asyncio.StreamReader()
    stdout.feed_data(b"a\n")
    loop = asyncio.get_running_loop()
    loop.call_later(0.15, stdout.feed_data, b"b\n")
    loop.call_later(0.16, stdout.feed_eof)
    taken: list[bytes] = []

    async def on_data(data: bytes) -> None:
        await asyncio.sleep(0.1)
        taken.append(data)

    facts = await supervise(
        _ExitsLate(0.02),  # type: ignore[arg-type]
        _CountingCgroup(),  # type: ignore[arg-type]
        Program(argv=["main"], env={}),
        Clocks(wall_ms=5000, cpu_ms=5000, idle_ms=None),
        [(stdout, on_data)],
        asyncio.Queue(),
    )
    assert facts.fired is None and b"".join(taken) == b"a\nb\n", taken


async def test_a_slot_whose_sandbox_teardown_fails_builds_its_next_one() -> None:
    factory = _FakeFactory()
    pool = SandboxPool(factory, "w", slots=1)  # type: ignore[arg-type]
    pool.start()
    await _turns()
    sandbox = await pool.take()

    async def broken_destroy() -> None:
        raise OSError("umount: target is busy")

    sandbox.destroy = broken_destroy  # type: ignore[method-assign]
    pool.give_back(sandbox)
    await _turns()
    assert pool.ready == 1 and len(factory.built) == 2
    await pool.close()


def test_an_optional_cgroup_file_is_not_judged_absent_from_a_missing_folder(tmp_path: Path) -> None:
    # A kill on the clean-up path of a failed build looked for cgroup.kill in a job folder
    # that did not exist yet: "absent" was kept for the host, and every later kill fell back
    # to signalling listed processes one by one.
    cgroup = detect_layout("coderunner", HYBRID).job("j1")
    kill = tmp_path / "j1" / "cgroup.kill"
    assert not cgroup._has(str(kill))
    kill.parent.mkdir()
    kill.touch()
    assert cgroup._has(str(kill))
    assert cgroup._has(str(tmp_path / "j2" / "cgroup.kill"))  # the host's answer, for every job


async def test_a_live_lane_counts_bytes_for_text_that_is_not_ascii(monkeypatch: pytest.MonkeyPatch) -> None:
    # Pacing and shedding count what goes over the wire: bytes. Counting characters for
    # "é" (two bytes each) let twice the bytes through the burst, and left the count of
    # pending bytes growing for ever (sends added bytes, drains took away characters).
    from worker.messaging import publisher as publisher_module

    monkeypatch.setattr(publisher_module, "LANE_BURST_BYTES", 64 * 1024)
    monkeypatch.setattr(publisher_module, "LANE_RATE_BYTES_S", 10**9)
    delivered: list[int] = []

    class Publisher:
        dropped = 0
        unheard = 0

        async def occupied(self, channel: str) -> str:
            return "present"

        async def deliver(self, batch: list[Any]) -> None:
            delivered.append(sum(len(event.data.encode()) for event in batch))

    lane = publisher_module.JobLane(Publisher(), "private-run-x")  # type: ignore[arg-type]
    chunk = json.dumps({"chunk": "é" * 4000, "seq": 1}, ensure_ascii=False).encode()
    for _ in range(50):
        lane.send("stdout", chunk)
    await lane.close(timeout_s=5)
    assert sum(delivered) == 50 * len(chunk) and lane._pending_bytes == 0


async def test_a_lane_flush_waits_for_what_is_queued_and_leaves_the_lane_open() -> None:
    from worker.messaging.publisher import JobLane

    delivered: list[list[str]] = []

    class Slow:
        dropped = unheard = audience_checks = 0

        async def occupied(self, channel: str) -> str:
            return "present"

        async def deliver(self, batch: list[Any]) -> None:
            await asyncio.sleep(0.1)
            delivered.append([event.name for event in batch])

    lane = JobLane(Slow(), "private-run-x")  # type: ignore[arg-type]
    assert await lane.flush(0.01)  # nothing queued
    lane.send("stage", b'{"seq":0}')
    assert not await lane.flush(0.02)  # still under way: gives up, drops nothing
    assert await lane.flush(1.0) and delivered == [["stage"]]
    lane.send("stdout", b'{"seq":1}')
    assert await lane.flush(1.0) and delivered == [["stage"], ["stdout"]]  # still open
    await lane.close(1.0)
    assert await lane.flush(0.01)  # closed: nothing to wait for


def test_the_output_budget_never_keeps_half_a_character() -> None:
    from worker.job.output import CompileOutput, OutputBudget

    snow = "\u2603".encode()  # three bytes
    # Cut inside a character that one read holds whole.
    budget = OutputBudget(7, keep_bytes=True)
    chunks = budget.feed("stdout", snow * 3) + budget.flush("stdout")
    assert "".join(chunks) == "\u2603\u2603" and bytes(budget.data["stdout"]) == snow * 2 and budget.truncated
    # A character begun in one read and cut in the next.
    budget = OutputBudget(4, keep_bytes=True)
    chunks = budget.feed("stdout", snow + snow[:1]) + budget.feed("stdout", snow[1:] + snow) + budget.flush("stdout")
    assert "".join(chunks) == "\u2603" and bytes(budget.data["stdout"]) == snow
    # Its rest dropped because the other stream spent the budget meanwhile.
    budget = OutputBudget(8, keep_bytes=True)
    chunks = budget.feed("stdout", snow[:2])
    assert budget.feed("stderr", b"x" * 10) == ["x" * 6]
    chunks += budget.feed("stdout", snow[2:]) + budget.flush("stdout")
    assert chunks == [] and bytes(budget.data["stdout"]) == b""
    assert bytes(budget.data["stderr"]) == b"x" * 6
    # A stream nothing was cut from keeps what the program wrote, invalid ending and all.
    budget = OutputBudget(100, keep_bytes=True)
    assert budget.feed("stdout", snow[:2]) + budget.flush("stdout") == ["\ufffd"]
    assert bytes(budget.data["stdout"]) == snow[:2]
    # Compiler output: the marker follows whole characters.
    compile_output = CompileOutput(1024)
    compile_output.feed(snow * 400)
    assert compile_output.text == "\u2603" * 341 + compile_output.marker
    # A character split across two reads of one pipe, the other's output read in between.
    compile_output = CompileOutput(1024)
    chunks = compile_output.feed(b"\xc3", "stdout") + compile_output.feed(b"warning\n", "stderr")
    chunks += compile_output.feed(b"\xa9\n", "stdout") + compile_output.flush()
    assert "".join(chunks) == compile_output.text == "warning\n\u00e9\n"
    assert compile_output.stream_text("stdout") == "\u00e9\n"


def test_invalid_bytes_are_charged_as_the_text_they_go_out_as() -> None:
    # Each invalid byte is published as U+FFFD, three bytes of text: a program writing 0xff
    # sent three times its outputKb through soketi and the event log.
    from worker.job.output import OutputBudget

    limit, read = 512 * 1024, 65536
    budget = OutputBudget(limit, keep_bytes=True)
    text = "".join(chunk for _ in range(3 * limit // read) for chunk in budget.feed("stdout", b"\xff" * read))
    text += "".join(budget.flush("stdout"))
    assert budget.truncated and limit - 3 < len(text.encode()) <= limit
    assert bytes(budget.data["stdout"]).decode("utf-8", "replace") == text  # the events are the kept bytes
    # One read bigger than the budget, of random bytes: cut where its text fits.
    for seed in range(5):
        noise = random.Random(seed).randbytes(3 * read)
        budget = OutputBudget(limit // 8, keep_bytes=True)
        text = "".join(budget.feed("stdout", noise) + budget.feed("stdout", noise) + budget.flush("stdout"))
        assert budget.truncated and limit // 8 - 8 <= len(text.encode()) <= limit // 8
        assert bytes(budget.data["stdout"]).decode("utf-8", "replace") == text
    # Valid text, however far from ASCII, is charged by its bytes as before.
    budget = OutputBudget(limit, keep_bytes=True)
    snow = "\u2603".encode() * (limit // 3)
    assert "".join(budget.feed("stdout", snow)) == snow.decode() and not budget.truncated
    # A literal U+FFFD the program wrote is its own three bytes: nothing extra.
    budget = OutputBudget(9, keep_bytes=True)
    assert "".join(budget.feed("stdout", "\ufffd".encode() * 3)) == "\ufffd" * 3 and budget.left == 0


def test_nothing_after_the_output_budgets_cut_goes_out() -> None:
    # An invalid byte crossing the limit cut the output short of it (its text did not fit
    # the bytes left), and later reads still let that many bytes through: the events and
    # the kept stdout were no longer a prefix of what the program wrote.
    from worker.job.output import CompileOutput, OutputBudget

    budget = OutputBudget(1024, keep_bytes=True)
    chunks = budget.feed("stdout", b"a" * 1022 + b"\x80\x80REST\n")
    assert budget.truncated
    chunks += budget.feed("stdout", b"later\n") + budget.feed("stderr", b"E\n")
    chunks += budget.flush("stdout") + budget.flush("stderr")
    assert "".join(chunks) == "a" * 1022
    assert bytes(budget.data["stdout"]) == b"a" * 1022 and not budget.data["stderr"]
    # The compiler's per-stream copies are cut the same way.
    compile_output = CompileOutput(512)
    compile_output.feed(b"a" * 1022 + b"\x80\x80REST\n")
    compile_output.feed(b"later\n")
    compile_output.flush()
    assert compile_output.stream_text("stdout") == "a" * 1022


def test_an_unfinished_character_at_a_streams_end_stays_within_the_budget() -> None:
    # Held back, it was charged its own bytes; published as U+FFFD it is more.
    from worker.job.output import OutputBudget

    budget = OutputBudget(4, keep_bytes=True)
    chunks = budget.feed("stdout", b"abc") + budget.feed("stdout", b"\xe2") + budget.flush("stdout")
    assert "".join(chunks) == "abc" and budget.truncated and bytes(budget.data["stdout"]) == b"abc"
    budget = OutputBudget(8, keep_bytes=True)
    chunks = budget.feed("stdout", b"abc\xf0\x80") + budget.flush("stdout")  # two U+FFFD: 6 bytes
    assert "".join(chunks) == "abc" and budget.truncated
    # Where it fits, it goes out and is charged as the text it is.
    budget = OutputBudget(6, keep_bytes=True)
    chunks = budget.feed("stdout", b"abc") + budget.feed("stdout", b"\xe2") + budget.flush("stdout")
    assert "".join(chunks) == "abc\ufffd" and not budget.truncated and budget.left == 0
    assert bytes(budget.data["stdout"]) == b"abc\xe2"


async def test_a_cases_output_cut_never_keeps_half_a_character() -> None:
    from worker.job.batch import _CaseOutput

    snow = "\u2603".encode()
    output = _CaseOutput(4)
    await output.sink("stdout")(snow + snow[:1])
    await output.sink("stdout")(snow[1:] + b"more")
    await output.sink("stdout")(b"after the cut")
    assert bytes(output.data["stdout"]) == snow and output.truncated
    output = _CaseOutput(1024)
    await output.sink("stdout")(snow * 400)
    assert bytes(output.data["stdout"]) == snow * 341


async def test_a_lane_that_learns_of_a_follower_late_sends_what_went_by_unheard_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A subscription signed outside the API is marked by soketi's webhook a moment after it
    # was made: the job's first events may find "nobody" by then. Once the lane learns of
    # the follower, those go out first, in order, then the rest.
    from worker.messaging import publisher as publisher_module

    delivered: list[int] = []

    class Publisher:
        dropped = unheard = audience_checks = 0
        claims = 0

        async def occupied(self, channel: str) -> str:
            return "none"

        async def deliver(self, batch: list[Any]) -> None:
            delivered.extend(json.loads(event.data)["seq"] for event in batch)

        async def claim_late_replay(self, channel: str, token: str) -> bool:
            self.claims += 1
            return True

    publisher = Publisher()
    lane = publisher_module.JobLane(publisher, "private-run-x")  # type: ignore[arg-type]
    for seq in range(3):
        lane.send("stdout", json.dumps({"chunk": "x", "seq": seq}).encode())
    assert await lane.flush(1.0) and delivered == [] and publisher.unheard == 3
    lane.learned_audience(True)  # the mark, read by the next append
    for seq in range(3, 5):
        lane.send("stdout", json.dumps({"chunk": "x", "seq": seq}).encode())
    await lane.close(timeout_s=2)
    assert delivered == [0, 1, 2, 3, 4] and publisher.unheard == 0
    assert publisher.claims == 1  # (it took the late replay's claim once, before any delivery)

    # What is kept is bounded; past the bound nothing more is (a gap, then what is live).
    monkeypatch.setattr(publisher_module, "LANE_UNHEARD_KEEP_BYTES", 50)
    delivered.clear()
    lane = publisher_module.JobLane(Publisher(), "private-run-y")  # type: ignore[arg-type]
    for seq, size in enumerate([20, 20, 40, 5]):
        lane.send("stdout", json.dumps({"chunk": "x" * size, "seq": seq}).encode())
        await lane.flush(1.0)
    lane.learned_audience(True)
    lane.send("result", b'{"seq":4}')
    await lane.close(timeout_s=2)
    assert delivered == [0, 4]  # 43 bytes of JSON fit, the next 43 do not, nor the 5 after


async def test_a_lane_that_cannot_ask_for_its_late_replay_claim_asks_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # One Redis failure as the lane asked for the claim (its client's retries spent) was
    # taken for "not ours" for good: the lane published nothing more, its result included,
    # and nobody else did (the API takes the claim only for a job that had ended).
    from worker.messaging import publisher as publisher_module

    monkeypatch.setattr(publisher_module, "CLAIM_RETRY_S", 0.01)
    delivered: list[int] = []

    class Publisher:
        dropped = unheard = audience_checks = 0
        answers = [None, True]
        tokens: list[str] = []

        async def occupied(self, channel: str) -> str:
            return "none"

        async def deliver(self, batch: list[Any]) -> None:
            delivered.extend(json.loads(event.data)["seq"] for event in batch)

        async def claim_late_replay(self, channel: str, token: str) -> bool | None:
            self.tokens.append(token)
            return self.answers.pop(0)

    publisher = Publisher()
    lane = publisher_module.JobLane(publisher, "private-run-x")  # type: ignore[arg-type]
    lane.send("stdout", json.dumps({"chunk": "prompt> ", "seq": 0}).encode())
    assert await lane.flush(1.0) and delivered == []  # (nobody follows yet: kept)
    lane.learned_audience(True)
    lane.send("stdout", json.dumps({"chunk": "x", "seq": 1}).encode())
    lane.send("result", b'{"seq":2}')
    await lane.close(timeout_s=2)
    assert delivered == [0, 1, 2]
    assert len(publisher.tokens) == 2 and len(set(publisher.tokens)) == 1  # (asked again, as the same lane)


async def test_a_closing_lane_waits_a_while_for_its_late_replay_claim(monkeypatch: pytest.MonkeyPatch) -> None:
    # close() past its timeout asked for the claim once and took "cannot tell" for "not
    # ours": the result it still held was counted unheard, and nobody published it.
    from worker.messaging import publisher as publisher_module

    monkeypatch.setattr(publisher_module, "CLAIM_RETRY_S", 0.01)
    delivered: list[int] = []
    back_at = asyncio.get_running_loop().time() + 0.4  # (Redis away until then)

    class Publisher:
        dropped = unheard = failed = audience_checks = 0

        async def occupied(self, channel: str) -> str:
            return "none"

        async def deliver(self, batch: list[Any]) -> None:
            delivered.extend(json.loads(event.data)["seq"] for event in batch)

        async def claim_late_replay(self, channel: str, token: str) -> bool | None:
            return True if asyncio.get_running_loop().time() >= back_at else None

    publisher = Publisher()
    lane = publisher_module.JobLane(publisher, "private-run-x")  # type: ignore[arg-type]
    lane.send("stdout", json.dumps({"chunk": "prompt> ", "seq": 0}).encode())
    assert await lane.flush(1.0) and delivered == []  # (nobody follows yet: kept)
    lane.learned_audience(True)
    lane.send("result", b'{"seq":1}')
    await lane.close(timeout_s=0.1)
    # (Past its timeout a lane drops what is left of the output; its result still goes.)
    assert delivered == [1] and publisher.dropped == 1 and publisher.unheard == 0 and publisher.failed == 0


@pytest.mark.parametrize("closing", [False, True], ids=["running", "closing"])
async def test_a_lane_whose_late_replay_the_api_took_publishes_nothing_more(closing: bool) -> None:
    # The follower's mark landed only after the job had ended: the API's webhook handler took
    # the job's late-replay claim and publishes its whole log. The lane, learning of the
    # follower now, must not send any of it again (a double result, or doubled output).
    from worker.messaging import publisher as publisher_module

    delivered: list[int] = []

    class Publisher:
        dropped = unheard = audience_checks = 0
        claims = 0

        async def occupied(self, channel: str) -> str:
            return "none"  # (its looks found nobody: the mark came later)

        async def deliver(self, batch: list[Any]) -> None:
            delivered.extend(json.loads(event.data)["seq"] for event in batch)

        async def claim_late_replay(self, channel: str, token: str) -> bool:
            self.claims += 1
            if closing and self.claims == 1:
                await asyncio.sleep(10)  # a slow Redis: close() runs out of time, asks again
            return False

    publisher = Publisher()
    lane = publisher_module.JobLane(publisher, "private-run-x")  # type: ignore[arg-type]
    for seq in range(3):
        lane.send("stdout", json.dumps({"chunk": "x", "seq": seq}).encode())
    await lane.flush(1.0)
    lane.learned_audience(True)  # the mark, read by the result's own write
    lane.send("result", b'{"seq":3}')
    await lane.close(timeout_s=0.2 if closing else 2)
    assert delivered == [] and publisher.claims == (2 if closing else 1)


async def test_a_lane_whose_first_look_finds_the_api_replaying_sends_nothing() -> None:
    # A job ended (reaped, expired, killed while parked), then a late webhook's mark landed:
    # the API took the late replay and publishes the log, result included. This lane learns
    # of the follower only now, from a look of its own (nothing went by unheard before), and
    # must not send the result a second time.
    from worker.messaging import publisher as publisher_module

    delivered: list[int] = []
    claims: list[str] = []

    class Publisher:
        dropped = unheard = audience_checks = 0

        async def occupied(self, channel: str) -> str:
            return "replayed"

        async def deliver(self, batch: list[Any]) -> None:
            delivered.extend(json.loads(event.data)["seq"] for event in batch)

        async def claim_late_replay(self, channel: str, token: str) -> bool:
            claims.append(token)
            return True

    lane = publisher_module.JobLane(Publisher(), "private-run-x")  # type: ignore[arg-type]
    lane.send("stage", b'{"phase":"queued","seq":0}')
    lane.send("result", b'{"seq":1}')
    await lane.close(timeout_s=2)
    assert delivered == [] and claims == []


async def test_an_idle_lane_holding_unheard_events_looks_again_for_a_follower(monkeypatch: pytest.MonkeyPatch) -> None:
    # A prompt printed before the webhook's mark landed, then the program waits on stdin:
    # nothing more is sent, yet the prompt must reach the follower once the mark is there.
    from worker.messaging import publisher as publisher_module

    monkeypatch.setattr(publisher_module, "AUDIENCE_RECHECK_S", 0.05)
    delivered: list[int] = []

    class Publisher:
        dropped = unheard = audience_checks = 0
        marked = False

        async def occupied(self, channel: str) -> str:
            return "present" if self.marked else "none"

        async def deliver(self, batch: list[Any]) -> None:
            delivered.extend(json.loads(event.data)["seq"] for event in batch)

        async def claim_late_replay(self, channel: str, token: str) -> bool:
            return True

    publisher = Publisher()
    lane = publisher_module.JobLane(publisher, "private-run-x")  # type: ignore[arg-type]
    lane.send("stdout", b'{"chunk":"name? ","seq":0}')
    await lane.flush(1.0)
    await asyncio.sleep(0.15)
    assert delivered == [] and not lane.followed
    publisher.marked = True  # the webhook landed
    for _ in range(40):
        if delivered:
            break
        await asyncio.sleep(0.05)
    assert delivered == [0] and lane.followed and publisher.unheard == 0
    await lane.close(timeout_s=1)


async def test_a_hand_back_counts_events_no_follower_heard_as_unpublished() -> None:
    lane = _SentLane()
    lane.followed = False
    events = JobEvents(_LogOnly(), lane, "job", 1, 1, [(0, "stage", b'{"phase":"queued","seq":0}')])  # type: ignore[arg-type]
    await events.go_live()
    await events.chunk_runs([("stdout", "1\n")])
    assert events.live and events.published_to == 0  # the next claim publishes them again
    lane.followed = True
    assert events.published_to == 2


def test_the_jail_backstop_covers_a_long_warm_up_and_the_longest_compile(tmp_path: Path) -> None:
    # A sandbox lent to a parked job waits out the warm-up and a compile before its run:
    # nsjail's own clock must not end the run early when WORKER_WARMUP_MS is long.
    from shared.limits import DEFAULT_LIMITS, RequestedLimits
    from worker.__main__ import start_wait_s
    from worker.isolation.sandbox import MAX_IDLE_S, SandboxFactory

    def runtime(compile_limits: RequestedLimits | None) -> Any:
        return SimpleNamespace(manifest=SimpleNamespace(compile=SimpleNamespace(limits=compile_limits) if compile_limits else None))

    rust = runtime(RequestedLimits(wall_time_ms=30000))
    settings = load_settings({"PUSHER_SECRET": "x", "WORKER_WARMUP_MS": "300000"})
    assert start_wait_s(settings, {"python": runtime(None), "rust": rust}) == 330.0
    assert start_wait_s(load_settings({"PUSHER_SECRET": "x"}), {"python": runtime(None)}) == 120.0  # never less
    factory = SandboxFactory(
        nsjail="nsjail", profiles_dir=tmp_path, work_root=tmp_path, gate=tmp_path, enter=tmp_path, cgroups=None,  # type: ignore[arg-type]
        uid_base=60000, max_limits=DEFAULT_LIMITS, start_wait_s=330.0,
    )  # fmt: skip
    assert factory.backstop_s(DEFAULT_LIMITS) == int(MAX_IDLE_S + 330 + DEFAULT_LIMITS.wall_time_ms / 1000 + 60)



def test_sandbox_names_are_unique_and_keep_with_the_clock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The janitor reads a sandbox's age from its name: a number counted on by one a name ran
    # ahead of the clock on a busy worker (hours after days), and its orphans looked young.
    from shared.limits import DEFAULT_LIMITS
    from worker.isolation import sandbox

    clock_ms = 1_700_000_000_000
    monkeypatch.setattr(sandbox.time, "time_ns", lambda: clock_ms * 1_000_000)
    factory = sandbox.SandboxFactory(
        nsjail="nsjail", profiles_dir=tmp_path, work_root=tmp_path, gate=tmp_path, enter=tmp_path, cgroups=None,  # type: ignore[arg-type]
        uid_base=60000, max_limits=DEFAULT_LIMITS,
    )  # fmt: skip
    numbers = []
    for _ in range(1000):  # three names a second for a thousand seconds...
        numbers += [int(factory._name("w", slot).rsplit(".", 1)[1]) for slot in range(3)]
        clock_ms += 1000
    assert len(set(numbers)) == len(numbers) and numbers == sorted(numbers)
    assert numbers[-1] == clock_ms - 1000 + 2  # ...and the last is of its own second
    clock_ms += 5
    assert factory._name("w", 0) == f"w.0.{clock_ms}"


def test_a_prime_adopts_only_a_program_with_its_environment() -> None:
    """The waiting runtime started in the environment a job's command gets (the shim takes
    nothing out and puts nothing in: /proc/self/environ could not follow): a program whose
    environment differs, or comes in another order, runs in a plain jail."""
    env = {"A": "1", "B": "2"}
    prime = Prime(language="python", shim="python.py", prefix=("/usr/bin/python3", "-u"),
                  program=Program(argv=["/usr/bin/python3", "-u", "/shim.py"], env=dict(env)))  # fmt: skip
    job = ["/usr/bin/python3", "-u", "main.py"]
    assert prime.adopts(Program(argv=job, env=dict(env)))
    assert not prime.adopts(Program(argv=job, env={**env, "C": "3"}))
    assert not prime.adopts(Program(argv=job, env={"B": "2", "A": "1"}))
    assert not prime.adopts(Program(argv=job, env=dict(env), adoptable=False))


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_leaving_with_redis_away_still_unregisters_from_a_run_cancelled_into_its_clean_up(loop_kind: str) -> None:
    """Worker.run's clean-up may run in a task cancelled once already (its cancel taken as
    the way out). The recovery of stray claims waits at most its bound there too, and the
    unregister after it is still tried: on Python 3.11.2 an asyncio.timeout expiring in
    such a task raised CancelledError, which skipped the rest of the clean-up."""
    unregistered: list[bool] = []

    async def never_answers(_worker_id: str) -> list[str]:
        await asyncio.sleep(3600)  # (Redis away: the read waits out its own bound)
        return []

    async def unregister() -> None:
        unregistered.append(True)

    worker = Worker.__new__(Worker)
    worker.worker_id, worker._jobs, worker._claiming = "w", {}, None
    async def answers() -> bool:
        return True  # (the probe's PING went through; the read after it does not)

    ctx: Any = SimpleNamespace(queue=SimpleNamespace(claimed_ids=never_answers, unregister=unregister), redis_answers=answers)

    async def cancelled_run() -> str:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass  # (a run() cancelled: its finally goes on)
        assert asyncio.current_task().cancelling() == 1  # type: ignore[union-attr]
        await worker._leave(ctx, timeout_s=0.1)
        return "cleaned up"

    async def main() -> None:
        task = asyncio.ensure_future(cancelled_run())
        await asyncio.sleep(0.01)
        task.cancel()
        assert await asyncio.wait_for(task, 5) == "cleaned up"
        assert unregistered == [True]

    _run_on(loop_kind, main())
