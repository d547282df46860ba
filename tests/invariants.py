"""Host invariants I1-I9 (SANDBOX.md §3.0), checked after every hostile program.

Each check compares the host against a baseline taken before the program ran, waiting a
short while for asynchronous teardown (cgroup removal and workspace detaching happen just
after the result is published).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.stack import Stack
from tests.helpers import Api, Realtime, py_job

__all__ = ["Baseline", "HostWatch"]

RESULT_FIELDS = {
    "exitCode", "signal", "timedOut", "idleTimedOut", "truncated", "durationMs", "cpuMs", "memoryKb",
    "outcome", "compile", "stdout", "stderr",
}  # fmt: skip


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def _proc_status(pid: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for line in _read(f"/proc/{pid}/status").splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def _fingerprint(path: Path) -> tuple[str, int, int, int]:
    st = path.stat()
    return hashlib.sha256(path.read_bytes()).hexdigest(), st.st_uid, st.st_mode, st.st_mtime_ns


@dataclass
class Baseline:
    zombies: int
    ipc: str
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
        self.jobs_dir = Path("/sys/fs/cgroup/unified") / self.dep / "jobs"
        slots = int(stack.extra_env.get("WORKER_MAX_SANDBOXES", "8"))
        # Job uids of every worker of this stack (slots, plus the self-test's one past them).
        self.uids = set(range(stack.uid_base, stack.uid_base + slots + 1))
        canary = canary_dir / "canary.txt"
        canary.write_text("do not touch\n")
        os.chmod(canary, 0o600)
        self.canary_paths = [canary, Path("/etc/passwd"), Path("/etc/hostname")]
        if Path("/etc/shadow").exists():
            self.canary_paths.append(Path("/etc/shadow"))

    # ---------------------------------------------------------------- observations

    def worker_pid(self) -> int:
        return self.stack.procs["worker"].pid

    def zombies(self) -> int:
        count = 0
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and _proc_status(entry.name).get("State", "").startswith("Z"):
                count += 1
        return count

    def ipc(self) -> str:
        # The host's SysV IPC objects (the jail's namespace would show none of them).
        return "".join(_read(f"/proc/sysvipc/{kind}") for kind in ("shm", "msg", "sem"))

    def shmem_kb(self) -> int:
        for line in _read("/proc/meminfo").splitlines():
            if line.startswith("Shmem:"):
                return int(line.split()[1])
        return 0

    def worker_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.worker_pid()}/fd"))

    def worker_rss_kb(self) -> int:
        return int(_proc_status(str(self.worker_pid())).get("VmRSS", "0 kB").split()[0])

    def redis_clients(self) -> int:
        with self.stack.redis() as redis:
            return int(redis.info("clients")["connected_clients"])

    def gate_pids(self) -> set[int]:
        """Parked gates of this stack: the gate binary, running as one of its job uids."""
        found = set()
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and _read(entry / "cmdline").startswith("/.coderunner/gate\0"):
                uid_line = _proc_status(entry.name).get("Uid", "")
                if uid_line and int(uid_line.split()[0]) in self.uids:
                    found.add(int(entry.name))
        return found

    def job_uid_processes(self) -> dict[int, str]:
        """Host processes running as this stack's job uids, other than parked gates."""
        gates = self.gate_pids()
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) in gates:
                continue
            uid_line = _proc_status(entry.name).get("Uid", "")
            if uid_line and int(uid_line.split()[0]) in self.uids:
                found[int(entry.name)] = _read(entry / "cmdline").replace("\0", " ")[:120]
        return found

    def sandbox_cgroups(self) -> dict[str, list[int]]:
        out = {}
        if self.jobs_dir.is_dir():
            for d in self.jobs_dir.iterdir():
                if d.is_dir():
                    out[d.name] = [int(p) for p in _read(d / "cgroup.procs").split()]
        return out

    def workspace_mounts(self) -> set[str]:
        prefix = str(self.work_root) + "/"
        return {
            line.split()[1]
            for line in _read("/proc/self/mounts").splitlines()
            if line.startswith("coderunner-ws ") and line.split()[1].startswith(prefix)
        }

    # ---------------------------------------------------------------- checks

    def baseline(self) -> Baseline:
        return Baseline(
            zombies=self.zombies(),
            ipc=self.ipc(),
            shmem_kb=self.shmem_kb(),
            worker_fds=self.worker_fds(),
            worker_rss_kb=self.worker_rss_kb(),
            redis_clients=self.redis_clients(),
            canaries={p: _fingerprint(p) for p in self.canary_paths},
        )

    def problems(self, base: Baseline) -> list[str]:
        found: list[str] = []
        gates = self.gate_pids()
        cgroups = self.sandbox_cgroups()
        # I1: every sandbox cgroup left is a parked warm sandbox (one gate, nothing else).
        for name, pids in cgroups.items():
            if len(pids) != 1 or pids[0] not in gates:
                found.append(f"I1 sandbox cgroup {name} holds {pids}")
        # I2: nothing runs as a job uid except parked gates; no new zombies.
        stray = self.job_uid_processes()
        if stray:
            found.append(f"I2 processes left as job uids: {stray}")
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
        # I5: only warm sandboxes' workspaces stay mounted.
        mounts = self.workspace_mounts()
        warm = {str(self.work_root / name) for name, pids in cgroups.items() if pids and pids[0] in gates}
        if mounts - warm:
            found.append(f"I5 workspace mounts left: {sorted(mounts - warm)}")
        # I6: no host IPC objects appeared; shared memory back near its baseline.
        if self.ipc() != base.ipc:
            found.append("I6 host SysV IPC objects changed")
        if self.shmem_kb() > base.shmem_kb + 32 * 1024:
            found.append(f"I6 Shmem {self.shmem_kb()} kB vs {base.shmem_kb} kB")
        # I7: the worker leaks neither descriptors nor memory.
        if self.worker_fds() > base.worker_fds + 12:
            found.append(f"I7 worker fds {self.worker_fds()} > {base.worker_fds}")
        if self.worker_rss_kb() > base.worker_rss_kb + 64 * 1024:
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
