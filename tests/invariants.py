"""Host invariants I1-I9 (SANDBOX.md §3.0), checked after every hostile program.

Each check compares the host against a baseline taken before the program ran, waiting a
short while for asynchronous teardown (cgroup removal and workspace detaching happen just
after the result is published).
"""

from __future__ import annotations

import errno
import hashlib
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.stack import Stack
from tests.helpers import Api, Realtime, compiled_shims, host_processes, py_job

__all__ = ["Baseline", "HostWatch", "Neighbour", "cgroup_mounts", "check_result_shape", "check_trivial_job"]

RESULT_FIELDS = {
    "exitCode", "signal", "timedOut", "idleTimedOut", "truncated", "durationMs", "cpuMs", "memoryKb",
    "outcome", "compile", "stdout", "stderr", "seq",
}  # fmt: skip

# I6/I7 allowances: the spread measured after each of ~130 hostile programs (three whole
# runs of the suite on a busy two-core VM, other stacks running beside it), with margin.
#   Shmem (host-wide, so other stacks' tmpfs files count too): -4.2 .. +5.0 MiB. 12 MiB
#     still catches one jail's filled /tmp or /dev/shm (16 MiB each).
#   Worker descriptors: +1 or +2 per job, +5 at most; finished jails' pipes close in
#     batches (when their transports are collected), so the count drifts up and drops.
#   Worker RSS: -4.1 .. +3.9 MiB.
SHMEM_SLACK_KB = 12 * 1024
ROOT_SIGNALS_SLACK = 16
_COMPILED_SHIMS = set(compiled_shims().values())
WORKER_FD_SLACK = 8
WORKER_RSS_SLACK_KB = 16 * 1024


# The v1 hierarchies a hybrid host's worker creates sandbox cgroups in (cpuacct only
# without cgroup2), each holding <deployment>/<sandbox> and <deployment>/supervisor.
V1_CONTROLLERS = ("memory", "pids", "cpu", "cpuacct")


def _read(path: str | Path) -> str:
    """A file that must be readable: an error is a broken observation, never "nothing there"."""
    return Path(path).read_text()


def _read_vanishing(path: str | Path) -> str:
    """A /proc or cgroup entry that may go away while it is read (a process exits, a cgroup is
    removed): gone reads as empty; any other error still raises."""
    try:
        return Path(path).read_text()
    except (FileNotFoundError, ProcessLookupError):
        return ""
    except OSError as exc:
        # ENODEV: a cgroup v1 file opened just before its cgroup was removed.
        if exc.errno in (errno.ESRCH, errno.ENODEV):
            return ""
        raise


def _proc_status(pid: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in _read_vanishing(f"/proc/{pid}/status").splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def cgroup_mounts(mounts: str) -> tuple[Path | None, dict[str, Path]]:
    """The cgroup2 mount and each v1 controller's mount, read here rather than taken from the
    worker's own layout code, so a mistake there cannot hide a leftover from these checks."""
    v2: Path | None = None
    v1: dict[str, Path] = {}
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "cgroup2" and v2 is None:
            v2 = Path(fields[1])
        elif len(fields) >= 4 and fields[2] == "cgroup":
            for option in fields[3].split(","):
                if option in V1_CONTROLLERS:
                    v1.setdefault(option, Path(fields[1]))
    return v2, v1


def _fingerprint(path: Path) -> tuple[str, int, int, int]:
    st = path.stat()
    return hashlib.sha256(path.read_bytes()).hexdigest(), st.st_uid, st.st_mode, st.st_mtime_ns


@dataclass
class Baseline:
    zombies: int
    root_signals_queued: int
    shmem_kb: int
    worker_fds: int
    worker_rss_kb: int
    redis_clients: int
    canaries: dict[Path, tuple[str, int, int, int]] = field(default_factory=dict)


class HostWatch:
    def __init__(self, stack: Stack, canary_dir: Path) -> None:
        self.stack = stack
        self.dep = stack.deployment
        self.work_root = Path(f"/run/{self.dep}")
        self.v2_root, self.v1_roots = cgroup_mounts(_read("/proc/self/mounts"))
        self.slots = slots = int(stack.extra_env.get("WORKER_MAX_SANDBOXES", "8"))
        # Job uids of every worker of this stack (slots, plus the self-test's one past them).
        self.uids = set(range(stack.uid_base, stack.uid_base + slots + 1))
        canary = canary_dir / "canary.txt"
        canary.write_text("do not touch\n")
        os.chmod(canary, 0o600)
        # One more beside the workspaces themselves (the janitor clears folders there, never
        # files): a program that reached the work root would find it first.
        beside = self.work_root / "canary.txt"
        beside.write_text("do not touch\n")
        os.chmod(beside, 0o600)
        self.canary_paths = [canary, beside, Path("/etc/passwd"), Path("/etc/hostname")]
        if Path("/etc/shadow").exists():
            self.canary_paths.append(Path("/etc/shadow"))

    # ---------------------------------------------------------------- observations

    def worker_pid(self) -> int:
        return self.stack.procs["worker"].pid

    def worker_pids(self) -> set[int]:
        return {proc.pid for name, proc in self.stack.procs.items() if name.startswith("worker")}

    def zombies(self) -> int:
        """Zombies this stack is responsible for: children of its processes (the services,
        nsjail, anything they started) or of its job uids. Other stacks and test runs on the
        host make zombies of their own, which are none of this stack's business."""
        table: dict[int, tuple[int, str, int]] = {}  # pid -> (ppid, state, uid)
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                status = _proc_status(entry.name)
                if status.get("PPid") and status.get("Uid"):
                    table[int(entry.name)] = (int(status["PPid"]), status.get("State", ""), int(status["Uid"].split()[0]))
        ours = {proc.pid for proc in self.stack.procs.values()}
        grew = True
        while grew:
            more = {pid for pid, (ppid, _, _) in table.items() if ppid in ours} - ours
            ours |= more
            grew = bool(more)
        return sum(
            1
            for pid, (ppid, state, uid) in table.items()
            if state.startswith("Z") and (ppid in ours or uid in self.uids)
        )

    def root_signals_queued(self) -> int:
        # Signals queued and not yet taken, counted for root (this process's user). Every
        # jail's user namespace is root's, so what a jail queues counts here too: a jail
        # holding many (or a leftover holding them) takes root's host-wide budget.
        for line in _read("/proc/self/status").splitlines():
            if line.startswith("SigQ:"):
                return int(line.split()[1].split("/")[0])
        raise AssertionError("/proc/self/status has no SigQ line")

    def shmem_kb(self) -> int:
        for line in _read("/proc/meminfo").splitlines():
            if line.startswith("Shmem:"):
                return int(line.split()[1])
        raise AssertionError("/proc/meminfo has no Shmem line")

    def _worker_fd_targets(self) -> list[str]:
        base = f"/proc/{self.worker_pid()}/fd"
        targets = []
        for fd in os.listdir(base):
            try:
                targets.append(os.readlink(f"{base}/{fd}"))
            except FileNotFoundError:
                continue  # closed while listed
        return targets

    def worker_fds(self) -> int:
        """Descriptors other than the cgroup counter files a warm or running sandbox keeps
        open (a few per sandbox, so their number follows the pool; worker_cgroup_fd_problems
        checks those)."""
        return sum(1 for t in self._worker_fd_targets() if not t.startswith("/sys/fs/cgroup/"))

    def worker_cgroup_fd_problems(self) -> list[str]:
        """Leaks among the cgroup files the worker holds open: any of a removed cgroup (kept
        descriptors close with their cgroups), or more per cgroup than the clocks keep (the
        CPU, memory peak and OOM counters, the process list, cgroup.kill: 5)."""
        per_cgroup: dict[str, int] = {}
        problems = []
        for target in self._worker_fd_targets():
            if target.startswith("/sys/fs/cgroup/"):
                folder = os.path.dirname(target)
                per_cgroup[folder] = per_cgroup.get(folder, 0) + 1
                if not os.path.isdir(folder):
                    problems.append(f"{target} of a removed cgroup")
        problems += [f"{n} files of {folder}" for folder, n in per_cgroup.items() if n > 5]
        return problems

    def worker_rss_kb(self) -> int:
        for line in _read(f"/proc/{self.worker_pid()}/status").splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        raise AssertionError(f"the worker ({self.worker_pid()}) has no VmRSS: is it a zombie?")

    def redis_clients(self) -> int:
        with self.stack.redis() as redis:
            return int(redis.info("clients")["connected_clients"])

    def gate_pids(self) -> set[int]:
        """Parked gates of this stack: the gate binary, running as one of its job uids, as
        pid 1 of its own pid namespace. A process can write any command line over its own,
        so that only picks candidates; what it runs (its executable on the stack's gate
        tmpfs) and being a namespace's init are what no program can fake."""
        try:
            gate_dev = os.stat(self.work_root / ".gate").st_dev
        except OSError:
            return set()
        found = set()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and _read_vanishing(entry / "cmdline").startswith("/.coderunner/gate\0"):
                status = _proc_status(entry.name)
                uid_line, nspid = status.get("Uid", ""), status.get("NSpid", "").split()
                try:
                    runs_the_gate = os.stat(entry / "exe").st_dev == gate_dev
                except OSError:
                    continue
                if uid_line and int(uid_line.split()[0]) in self.uids and runs_the_gate and nspid[-1:] == ["1"]:
                    found.add(int(entry.name))
        return found

    def waiting_runtimes(self, gates: set[int]) -> dict[int, int]:
        """Prestarted runtimes still waiting for their job: pid -> its gate.

        One counts only if it is a parked gate's child, runs a prestart shim, and one of its
        threads is blocked reading its stdin (syscall 0, read, on descriptor 0): a runtime
        that has taken a job is running that job's code and is not waiting.
        """
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            stat = _read_vanishing(entry / "stat")
            if not stat or int(stat[stat.rindex(")") + 2 :].split()[1]) not in gates:
                continue
            argv = _read_vanishing(entry / "cmdline").split("\0")
            # A shim bound in the jail, or a compiled one (Java's, started by its class name).
            if not any(arg.startswith("/.coderunner/prestart/") or arg in _COMPILED_SHIMS for arg in argv):
                continue
            # Any of its threads (the JVM reads on a thread of its own, not the process's first).
            try:
                threads = list((entry / "task").iterdir())
            except OSError:
                continue
            if any(_read_vanishing(t / "syscall").split()[:2] == ["0", "0x0"] for t in threads):
                found[int(entry.name)] = int(stat[stat.rindex(")") + 2 :].split()[1])
        return found

    def warm_pids(self) -> set[int]:
        """Every process a warm sandbox may hold: parked gates and their waiting runtimes."""
        gates = self.gate_pids()
        return gates | set(self.waiting_runtimes(gates))

    def job_uid_processes(self) -> dict[int, str]:
        """Host processes running as this stack's job uids, other than warm sandboxes'."""
        gates = self.warm_pids()
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in gates:
                continue
            uid_line = _proc_status(entry.name).get("Uid", "")
            if uid_line and int(uid_line.split()[0]) in self.uids:
                found[int(entry.name)] = _read_vanishing(entry / "cmdline").replace("\0", " ")[:120]
        return found

    def stray_nsjails(self) -> dict[int, str]:
        """nsjail processes of this stack (their command line binds a workspace under the
        stack's work root) that its workers do not own. They run as root, so the job-uid scan
        never sees them: a jail orphaned by its worker, still holding its gate and workspace.

        Owned: a child of a worker (nsjail exec'd behind `enter`) or of a worker's fork
        server (nsjail forked from it: worker/isolation/forkserver.c), and that nsjail's
        child for the moment before it execs the gate.
        """
        marker = f"{self.work_root}/"
        ours: dict[int, tuple[int, str]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            argv = _read_vanishing(entry / "cmdline").split("\0")
            if any(Path(arg).name == "nsjail" for arg in argv) and any(marker in arg for arg in argv):
                stat = _read_vanishing(entry / "stat")
                if stat:
                    ours[int(entry.name)] = (int(stat[stat.rindex(")") + 2 :].split()[1]), " ".join(argv)[:160])
        workers = self.worker_pids() | self.fork_servers()
        return {
            pid: text
            for pid, (ppid, text) in ours.items()
            if ppid not in workers and not (ppid in ours and ours[ppid][0] in workers)
        }

    def fork_servers(self) -> set[int]:
        """The nsjail fork servers this stack's workers started (their children)."""
        workers = {str(pid) for pid in self.worker_pids()}
        return {
            pid
            for pid, cmdline, status in host_processes()
            if status.get("PPid") in workers and cmdline.split(b"\0")[0].endswith(b"/nsjail-forkserver")
        }

    def cgroup_trees(self) -> dict[str, Path]:
        """Where this stack's sandbox cgroups live, per hierarchy: the cgroup2 tree's `jobs`
        folder and every v1 controller's deployment folder (the worker creates all of these
        at start-up, so each must exist)."""
        trees: dict[str, Path] = {}
        if self.v2_root is not None:
            trees["v2"] = self.v2_root / self.dep / "jobs"
        for ctrl in V1_CONTROLLERS:
            root = self.v1_roots.get(ctrl)
            if root is not None and (ctrl != "cpuacct" or (root / self.dep).is_dir()):
                trees[f"v1 {ctrl}"] = root / self.dep
        for label, tree in trees.items():
            if not tree.is_dir():
                raise AssertionError(f"the {label} cgroup tree of this stack is missing: {tree}")
        if not trees:
            raise AssertionError("no cgroup hierarchy is mounted")
        return trees

    def sandbox_cgroups(self) -> dict[str, dict[str, list[int]]]:
        """Every sandbox cgroup of this stack in every hierarchy: tree -> name -> its pids."""
        out: dict[str, dict[str, list[int]]] = {}
        for label, tree in self.cgroup_trees().items():
            found: dict[str, list[int]] = {}
            for d in tree.iterdir():
                if d.name in ("supervisor", "jobs") or not d.is_dir():
                    continue
                pids = [int(p) for p in _read_vanishing(d / "cgroup.procs").split()]
                if d.is_dir():  # else it was removed between the listing and the read: gone
                    found[d.name] = pids
            out[label] = found
        return out

    def workspace_mounts(self) -> list[str]:
        """Where workspace tmpfs are mounted, once per mount (two on one folder: one hides the other)."""
        prefix = str(self.work_root) + "/"
        return [
            line.split()[1]
            for line in _read("/proc/self/mounts").splitlines()
            if line.startswith("coderunner-ws ") and line.split()[1].startswith(prefix)
        ]

    # ---------------------------------------------------------------- checks

    def sandboxes_alive(self) -> int:
        """The worker's nsjail processes (its children, or its fork server's): its pool's
        sandboxes, ready or in use."""
        worker = str(self.worker_pid())
        processes = list(host_processes())
        servers = {str(pid) for pid in self.fork_servers() if any(p == pid and st.get("PPid") == worker for p, _, st in processes)}
        return sum(
            1
            for pid, cmdline, status in processes
            if status.get("PPid") in {worker, *servers} and b"nsjail" in cmdline and str(pid) not in servers
        )

    def baseline(self, settle_s: float = 5.0) -> Baseline:
        """What the checks compare with, taken once the worker's pool is whole again: a
        sandbox being rebuilt holds about a dozen descriptors fewer or more than a ready
        one, and a baseline taken mid-rebuild once made I7 see 40 descriptors against 28."""
        deadline = time.monotonic() + settle_s
        while self.sandboxes_alive() < self.slots and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1)  # (a sandbox just spawned finishes its set-up)
        return Baseline(
            zombies=self.zombies(),
            root_signals_queued=self.root_signals_queued(),
            shmem_kb=self.shmem_kb(),
            worker_fds=self.worker_fds(),
            worker_rss_kb=self.worker_rss_kb(),
            redis_clients=self.redis_clients(),
            canaries={p: _fingerprint(p) for p in self.canary_paths},
        )

    def problems(self, base: Baseline) -> list[str]:
        found: list[str] = []
        gates = self.gate_pids()
        runtimes = self.waiting_runtimes(gates)
        trees = self.sandbox_cgroups()

        def warm(pids: list[int]) -> bool:
            """One parked gate, and at most its own waiting runtime."""
            parked = [pid for pid in pids if pid in gates]
            return len(parked) == 1 and all(pid in gates or runtimes.get(pid) == parked[0] for pid in pids) and len(pids) <= 2

        # I1: every sandbox cgroup left, in every hierarchy, is a parked warm sandbox (one
        # gate, and its prestarted runtime if it was primed; nothing else).
        for label, cgroups in trees.items():
            for name, pids in cgroups.items():
                if not warm(pids):
                    found.append(f"I1 {label} sandbox cgroup {name} holds {pids}")
        # I2: nothing runs as a job uid except parked gates; no nsjail of this stack outside
        # its workers; no new zombies.
        stray = self.job_uid_processes()
        if stray:
            found.append(f"I2 processes left as job uids: {stray}")
        orphans = self.stray_nsjails()
        if orphans:
            found.append(f"I2 nsjail processes no worker owns: {orphans}")
        if self.zombies() > base.zombies:
            found.append(f"I2 zombies {self.zombies()} > {base.zombies}")
        # I3: the services are alive; Redis saw no extra clients stay connected.
        dead = self.stack.dead_children()
        if dead:
            found.append(f"I3 dead: {dead}")
        elif self.redis_clients() > base.redis_clients + 2:
            found.append(f"I3 redis clients {self.redis_clients()} > {base.redis_clients}")
        # I4: canaries unchanged (content, owner, mode, mtime).
        for path, print_ in base.canaries.items():
            if _fingerprint(path) != print_:
                found.append(f"I4 {path} changed")
        # I5: only warm sandboxes' workspaces stay mounted. A workspace is mounted on its
        # slot's folder (`<worker>.<slot>.<n>`, n of its own), a sandbox's cgroups are named
        # `<worker>.<slot>.<n>`: matched by worker and slot.
        mounts = self.workspace_mounts()
        warm_slots = {name.rsplit(".", 1)[0] for cgroups in trees.values() for name, pids in cgroups.items() if warm(pids)}
        left = sorted(m for m in mounts if Path(m).name.rsplit(".", 1)[0] not in warm_slots)
        left += sorted({m for m in mounts if mounts.count(m) > 1})
        if left:
            found.append(f"I5 workspace mounts left: {left}")
        # I6: root's queued signals and the host's shared memory back near their baselines.
        # (A jail's SysV IPC objects live in its own IPC namespace: none can reach the host's.)
        if self.root_signals_queued() > base.root_signals_queued + ROOT_SIGNALS_SLACK:
            found.append(f"I6 root has {self.root_signals_queued()} signals queued vs {base.root_signals_queued}")
        if self.shmem_kb() > base.shmem_kb + SHMEM_SLACK_KB:
            found.append(f"I6 Shmem {self.shmem_kb()} kB vs {base.shmem_kb} kB")
        # I7: the worker leaks neither descriptors nor memory (a dead worker is I3's).
        if "worker" in dead:
            return found
        if self.worker_fds() > base.worker_fds + WORKER_FD_SLACK:
            found.append(f"I7 worker fds {self.worker_fds()} > {base.worker_fds}")
        leaks = self.worker_cgroup_fd_problems()
        if leaks:
            found.append(f"I7 worker holds cgroup files open: {leaks[:4]}")
        if self.worker_rss_kb() > base.worker_rss_kb + WORKER_RSS_SLACK_KB:
            found.append(f"I7 worker RSS {self.worker_rss_kb()} kB > {base.worker_rss_kb} kB")
        return found

    def settle(self, base: Baseline, timeout_s: float = 8.0) -> None:
        """Wait until every invariant holds, or fail with what is still wrong."""
        deadline = time.monotonic() + timeout_s
        while True:
            problems = self.problems(base)
            if not problems:
                return
            if time.monotonic() > deadline:
                raise AssertionError("invariants broken: " + "; ".join(problems))
            time.sleep(0.1)


def check_result_shape(out: dict[str, Any], limit_ms: int) -> None:
    """I8: the result is complete, JSON-clean, bounded, and not later than the limit allows."""
    assert set(out) >= RESULT_FIELDS, set(out) ^ RESULT_FIELDS
    assert out["durationMs"] <= limit_ms + 1000, out["durationMs"]
    assert len(out["stdout"]) + len(out["stderr"]) <= 4 * 1024 * 1024


def check_trivial_job(api: Api, realtime: Realtime) -> None:
    """I9: a trivial job right afterwards runs, at normal speed."""
    job = api.execute(py_job("print(1)"))
    followed = realtime.follow(job)
    t0 = time.monotonic()
    api.start(job)
    result = followed.wait_result(timeout_s=10)
    took = time.monotonic() - t0
    assert result["outcome"] == "completed" and followed.text("stdout") == "1\n", result
    assert took < 2.0, f"a trivial job took {took:.2f}s after the hostile one"


# The neighbour: a job that keeps a canary in its own workspace while the hostile one runs
# beside it, then reports on it. Its stdin stays open until the harness closes it.
_NEIGHBOUR_PY = """
import hashlib, os, sys
secret = %r
with open("canary.txt", "w") as f:
    f.write(secret)
os.chmod("canary.txt", 0o600)
before = os.stat("canary.txt")
print("ready", flush=True)
sys.stdin.read()
after = os.stat("canary.txt")
with open("canary.txt") as f:
    kept = f.read() == secret
same = (before.st_mtime_ns, before.st_mode, before.st_ino) == (after.st_mtime_ns, after.st_mode, after.st_ino)
print("kept" if kept else "CHANGED", "same" if same else "TOUCHED", sorted(os.listdir(".")))
"""
_NEIGHBOUR_LIMITS = {"wallTimeMs": 120000, "idleMs": 120000, "cpuMs": 2000, "memoryMb": 64, "pids": 8}


class Neighbour:
    """I4's canary in another job's workspace: started before a hostile program, checked
    after it (the neighbour's own program reads its canary back and lists its workspace)."""

    def __init__(self, api: Api, realtime: Realtime) -> None:
        self.api = api
        self.secret = secrets.token_hex(16)
        self.job = api.execute(py_job(_NEIGHBOUR_PY % self.secret, limits=_NEIGHBOUR_LIMITS, collectOutput=True))
        self.followed = realtime.follow(self.job)
        api.start(self.job)
        deadline = time.monotonic() + 15
        while "ready" not in self.followed.text("stdout"):
            assert not self.followed.results(), f"the neighbour ended early: {self.followed.summary()}"
            assert time.monotonic() < deadline, f"the neighbour never got ready: {self.followed.summary()}"
            time.sleep(0.02)

    def end(self) -> None:
        """Kill it if it still runs (a failed case must not leave it holding a slot)."""
        if not self.followed.results():
            self.api.post(f"/v1/jobs/{self.job['jobId']}/kill")
            self.followed.finished.wait(15)

    def check(self) -> None:
        """Close its stdin and read its report: canary unchanged, nothing added beside it."""
        response = self.api.post(f"/v1/jobs/{self.job['jobId']}/stdin/close")
        assert response.status_code == 200, f"the neighbour ended before the check: {self.followed.summary()}"
        result = self.followed.wait_result(timeout_s=15)
        assert result["outcome"] == "completed", result
        report = self.followed.text("stdout")
        assert report == "ready\nkept same ['canary.txt', 'main.py']\n", f"I4 another job's workspace: {report!r}"
