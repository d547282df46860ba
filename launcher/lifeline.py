"""A stack's lifeline: however the process that started a stack ends, the stack ends too.

A stack's children run in sessions of their own, so that each can be stopped as a whole
process group; it also means that nothing stops them when the process that started them
dies without doing so (SIGKILL, a `timeout`, a test runner's hard stop, an unhandled
signal): they would go on holding ports, CPU and job uids. So `Stack` starts this small
watcher first, in a session of its own, on the read end of a pipe whose write end only the
stack's owner holds, and tells it each process group it starts:

    +<pgid> <start> worker|service    a group to stop if the owner goes away (<start>:
                                      its leader's start time, /proc/<pgid>/stat field 22)
    stopped                           the owner stopped the stack itself: nothing to do

The pipe closing without `stopped` means the owner is gone. The watcher then stops the
groups the way `Stack.stop` would: SIGTERM to the workers (they hand their parked jobs
back), then to the services, SIGKILL for whatever is left after a grace, and finally
removes the deployment's cgroups, mounts and folders. A group is signalled only while it
is still the one the stack started: its leader alive with the start time it was told, or,
once the leader is gone, a live member carrying the stack's CODERUNNER_STACK mark in its
environment (Redis rewrites its own environment's memory for its process title, so the
mark alone would miss it). A group id the kernel has since given to an unrelated process
is never touched.

    python -m launcher.lifeline <deployment> [<worker grace s>]    (stdin: the pipe)
"""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MARK_ENV", "SERVICE_GRACE_S", "WORKER_GRACE_S", "Group", "live_marked", "main", "start_time"]

MARK_ENV = "CODERUNNER_STACK"
# As Stack.stop: workers get their stop grace (Stack.worker_stop_s, passed on the command
# line; this when none is), the services a shorter one.
WORKER_GRACE_S = 25.0
SERVICE_GRACE_S = 5.0


def _live_stat(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first), or None when the
    process is gone or a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return None if fields[0] == "Z" else fields


def start_time(pid: int) -> int | None:
    """A live process's start time (clock ticks after boot), which a reused pid does not
    share; None when it is gone or a zombie."""
    fields = _live_stat(pid)
    return None if fields is None else int(fields[19])


def live_marked(pgid: int, deployment: str) -> bool:
    """Whether process group `pgid` has a live (not zombie) member carrying this stack's mark."""
    mark = f"{MARK_ENV}={deployment}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _live_stat(entry.name)
        if fields is None or int(fields[2]) != pgid:
            continue
        try:
            if mark in (entry / "environ").read_bytes().split(b"\0"):
                return True
        except OSError:
            continue
    return False


@dataclass(frozen=True)
class Group:
    pgid: int
    leader_start: int

    def ours(self, deployment: str) -> bool:
        """Still the group the stack started, with someone alive in it."""
        if start_time(self.pgid) == self.leader_start:
            return True
        return live_marked(self.pgid, deployment)


def _signal(groups: list[Group], sig: int, deployment: str) -> list[Group]:
    """Send `sig` to each group still ours; returns those that got it."""
    sent = []
    for group in groups:
        if group.ours(deployment):
            try:
                os.killpg(group.pgid, sig)
                if sig != signal.SIGKILL:
                    os.killpg(group.pgid, signal.SIGCONT)  # a stopped process gets the signal too
                sent.append(group)
            except (ProcessLookupError, PermissionError):
                pass
    return sent


def _wait_gone(groups: list[Group], deployment: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while groups and time.monotonic() < deadline:
        groups = [group for group in groups if group.ours(deployment)]
        if groups:
            time.sleep(0.1)


def stop_groups(workers: list[Group], services: list[Group], deployment: str, worker_grace_s: float = WORKER_GRACE_S) -> None:
    _wait_gone(_signal(workers, signal.SIGTERM, deployment), deployment, worker_grace_s)
    _wait_gone(_signal(services, signal.SIGTERM, deployment), deployment, SERVICE_GRACE_S)
    _wait_gone(_signal(workers + services, signal.SIGKILL, deployment), deployment, SERVICE_GRACE_S)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (1, 2):
        print("usage: python -m launcher.lifeline <deployment> [<worker grace s>]   (stdin: the stack's pipe)", file=sys.stderr)
        return 2
    deployment = args[0]
    worker_grace_s = float(args[1]) if len(args) == 2 else WORKER_GRACE_S
    # In a session of its own nothing aimed at the owner's terminal reaches it; these are
    # for a watcher started by hand.
    for sig in (signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    workers: list[Group] = []
    services: list[Group] = []
    for line in sys.stdin.buffer:
        words = line.split()
        if words == [b"stopped"]:
            return 0
        if len(words) == 3 and words[0].startswith(b"+") and words[0][1:].isdigit() and words[1].isdigit():
            group = Group(int(words[0][1:]), int(words[1]))
            (workers if words[2] == b"worker" else services).append(group)
    stop_groups(workers, services, deployment, worker_grace_s)
    from launcher.stack import remove_deployment  # only now: the watcher idles on little memory

    remove_deployment(deployment)
    return 0


if __name__ == "__main__":
    sys.exit(main())
