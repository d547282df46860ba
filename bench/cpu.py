"""Host CPU accounting for throughput runs: what the whole machine spent, and who spent it.

A snapshot reads, at one instant:
    host      busy jiffies of /proc/stat (user + nice + system + irq + softirq, all CPUs);
    client    this benchmark's own CPU (every thread, not its children), so it can be taken out:
              a bare-nsjail run's jails are this process's children and stay in;
    groups    utime + stime of each long-lived process of the stack (worker, api, soketi,
              redis and their own helpers), from /proc/<pid>/stat; a jail (nsjail and all
              below it, or anything in the deployment's cgroups) is not the worker's;
    jails     the deployment's cgroup CPU counter, which keeps the CPU of job cgroups
              already removed (cgroup v2 `cpu.stat` usage_usec, or v1 `cpuacct.usage`).
The difference of two snapshots divided by the jobs completed in between is CPU per job.
Short-lived processes outside the jails' cgroups and everything else on the machine
(other users included) end up in "other".
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["Snapshot", "per_job_ms", "snapshot"]

TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")
CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class Snapshot:
    at: float
    host_ms: float
    client_ms: float
    jails_ms: float | None = None
    # group -> {(pid, start time): CPU ms so far}; the start time tells a reused pid apart.
    groups: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)


def _host_busy_ms() -> float:
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
    return (user + nice + system + irq + softirq) * TICK_MS


def _client_ms() -> float:
    times = os.times()
    return (times.user + times.system) * 1000


def _jails_ms(deployment: str | None) -> float | None:
    if deployment is None:
        return None
    for base in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
        stat = base / deployment / "cpu.stat"
        try:
            for line in stat.read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1000
        except OSError:
            pass
    try:
        return int((CGROUP_ROOT / "cpuacct" / deployment / "cpuacct.usage").read_text()) / 1e6
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class _Proc:
    ppid: int
    comm: str
    start: int
    cpu_ms: float


def _processes() -> dict[int, _Proc]:
    table: dict[int, _Proc] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "stat").read_text()
        except OSError:
            continue  # gone since the listing
        comm = raw[raw.index("(") + 1 : raw.rindex(")")]
        rest = raw[raw.rindex(")") + 2 :].split()
        # After the comm: state(0) ppid(1) … utime(11) stime(12) … starttime(19).
        table[int(entry.name)] = _Proc(int(rest[1]), comm, int(rest[19]), (int(rest[11]) + int(rest[12])) * TICK_MS)
    return table


def _in_jail(pid: int, comm: str, deployment: str | None) -> bool:
    if comm == "nsjail":
        return True
    if deployment is None:
        return False
    try:
        return deployment in Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False


def _tree(table: dict[int, _Proc], root: int, deployment: str | None) -> list[int]:
    """root and its descendants, leaving out every jail and what runs inside it."""
    children: dict[int, list[int]] = {}
    for pid, proc in table.items():
        children.setdefault(proc.ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid not in table or _in_jail(pid, table[pid].comm, deployment):
            continue
        found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def snapshot(groups: dict[str, list[int]] | None = None, deployment: str | None = None) -> Snapshot:
    """One reading; `groups` names the root pids of each part of the stack (none for Piston)."""
    table = _processes() if groups else {}
    cpu: dict[str, dict[tuple[int, int], float]] = {}
    for name, roots in (groups or {}).items():
        pids = {pid for root in roots for pid in _tree(table, root, deployment)}
        cpu[name] = {(pid, table[pid].start): table[pid].cpu_ms for pid in pids}
    return Snapshot(time.perf_counter(), _host_busy_ms(), _client_ms(), _jails_ms(deployment), cpu)


def per_job_ms(before: Snapshot, after: Snapshot, jobs: int) -> dict[str, float]:
    """CPU ms per job: `total` (host minus this client), its parts, `other`, and `client`."""
    jobs = max(jobs, 1)
    client = after.client_ms - before.client_ms
    total = after.host_ms - before.host_ms - client
    parts: dict[str, float] = {}
    for name, now in after.groups.items():
        then = before.groups.get(name, {})
        # A process that started in the window counts from zero; one that ended is lost (rare).
        parts[name] = sum(ms - then.get(key, 0.0) for key, ms in now.items())
    if before.jails_ms is not None and after.jails_ms is not None:
        parts["jails"] = after.jails_ms - before.jails_ms
    figures = {"total": total / jobs}
    if parts:
        figures.update({name: ms / jobs for name, ms in parts.items()})
        figures["other"] = (total - sum(parts.values())) / jobs
    figures["client"] = client / jobs
    return {name: round(ms, 2) for name, ms in figures.items()}
