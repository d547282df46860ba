"""The hostile-program suite (SANDBOX.md §3): each program must end in its exact verdict,
its live events must be the durable log (seq 0..n, one result), and after each one the
host invariants I1-I9 must hold.

Limits follow the catalogue's test profile so every clock is distinguishable:
wall 8 s, idle 4 s, CPU 2 s, 128 MiB, 32 pids (Java 64), 512 KiB of output. Each check
is meant to fail when the layer it stands for is switched off (the network namespace,
the seccomp KILL list, the pids, memory and CPU cgroups, the jail's own /etc/passwd...),
not merely when the program misbehaves.
"""

from __future__ import annotations

import atexit
import base64
import ctypes
import hashlib
import mmap
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from launcher.stack import Stack
from shared.paths import REPO_ROOT
from tests.helpers import Api, Followed, Realtime
from tests.invariants import HostWatch, Neighbour, cgroup_mounts, check_result_shape, check_trivial_job
from tests.seccomp_view import AUDIT_ARCH_I386, ERRNO, KILL_PROCESS, installed_filters, verdict

pytestmark = [pytest.mark.stack, pytest.mark.sandbox, pytest.mark.slow]

# A job's peak memory (the cgroup's own high-water mark) never passes its limit; a page or
# two of accounting slack at most.
MEMORY_SLACK_KB = 1024
LIMITS = {"wallTimeMs": 8000, "idleMs": 4000, "cpuMs": 2000, "memoryMb": 128, "pids": 32, "outputKb": 512}
FILE = {"python": "main.py", "javascript": "main.js", "c": "main.c", "cpp": "main.cpp", "rust": "main.rs",
        "java": "Main.java", "bash": "main.sh", "go": "main.go", "ruby": "main.rb"}  # fmt: skip

Check = Callable[[dict[str, Any], Followed], None]


SIGNAL_BUDGET_C = r"""
#include <errno.h>
#include <fcntl.h>
#include <mqueue.h>
#include <signal.h>
#include <stdio.h>
#include <unistd.h>
int main(void) {
    sigset_t rt;
    sigemptyset(&rt);
    for (int s = SIGRTMIN; s <= SIGRTMAX; s++) sigaddset(&rt, s);
    sigprocmask(SIG_BLOCK, &rt, NULL);
    union sigval v = {0};
    long n = 0;
    while (n < 200000 && sigqueue(getpid(), SIGRTMIN, v) == 0) n++;
    printf("queued %ld errno %d\n", n, errno);
    mqd_t q = mq_open("/coderunner-probe", O_CREAT | O_RDWR, 0600, NULL);
    printf("mq_open %d errno %d\n", q == (mqd_t)-1 ? -1 : 0, q == (mqd_t)-1 ? errno : 0);
    fflush(stdout);
    sleep(2); /* the signals stay queued while the harness looks at root's count */
    return 0;
}
"""


@dataclass
class Case:
    id: str
    language: str
    code: str
    check: Check
    # Every program gets a grader's stdin, then EOF ("" is no input at all): the catalogue
    # is about confinement, and the open-ended stdin of an IDE has tests of its own.
    stdin: str = ""
    limits: dict[str, int] = field(default_factory=dict)
    # A harness action while the program runs (gets the stack and the followed job).
    during: Callable[[Stack, Followed], None] | None = None
    # More fields of the execute request.
    body: dict[str, Any] = field(default_factory=dict)

    @property
    def wall_ms(self) -> int:
        return {**LIMITS, **self.limits}["wallTimeMs"]


def expect(**fields: Any) -> Callable[[dict[str, Any]], None]:
    def check(out: dict[str, Any]) -> None:
        for key, value in fields.items():
            assert out[key] == value, f"{key}={out[key]!r}, expected {value!r}; {summary(out)}"

    return check


def summary(out: dict[str, Any]) -> str:
    keep = ("outcome", "exitCode", "signal", "timedOut", "idleTimedOut", "truncated", "durationMs", "cpuMs", "memoryKb")
    text = {k: out.get(k) for k in keep}
    return f"{text} stdout={out.get('stdout', '')[:2000]!r} stderr={out.get('stderr', '')[:300]!r} compile={str(out.get('compile'))[:300]}"


def both(*checks: Callable[[dict[str, Any]], None]) -> Check:
    def run(out: dict[str, Any], followed: Followed) -> None:
        for check in checks:
            check(out)

    return run


def where(predicate: Callable[[dict[str, Any]], bool], what: str) -> Callable[[dict[str, Any]], None]:
    def check(out: dict[str, Any]) -> None:
        assert predicate(out), f"expected {what}; {summary(out)}"

    return check


def plus(first: Check, *more: Check) -> Check:
    def run(out: dict[str, Any], followed: Followed) -> None:
        for check in (first, *more):
            check(out, followed)

    return run


def sha256_of(path: str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def compile_failed(out: dict[str, Any]) -> None:
    assert out["outcome"] == "compile_error", summary(out)
    assert out["exitCode"] is None and out["stdout"] == ""
    assert len(out["compile"]["output"].encode()) <= 64 * 1024 + 100


# ---------------------------------------------------------------- harness actions


def _kill_nsjail_of(marker: str) -> Callable[[Stack, Followed], None]:
    """G2: SIGKILL the nsjail supervising the program whose command line holds `marker`."""

    def act(stack: Stack, followed: Followed) -> None:
        deadline = time.monotonic() + 10
        while "running" not in followed.text("stdout"):
            assert time.monotonic() < deadline, "program never started"
            time.sleep(0.02)
        gate = None
        while gate is None:
            assert time.monotonic() < deadline, "program not found in this stack's cgroups"
            # The program itself, not one of its forks: its parent is the gate.
            parents = {_ppid(pid) for pid in _programs_of(stack, marker)} - {-1}
            gate = next((pid for pid in parents if _cmdline(Path(f"/proc/{pid}")).startswith(b"/.coderunner/gate")), None)
            time.sleep(0.01)
        nsjail = _ppid(gate)
        assert b"nsjail" in _cmdline(Path(f"/proc/{nsjail}")), _cmdline(Path(f"/proc/{nsjail}"))
        os.kill(nsjail, signal.SIGKILL)

    return act


# What harness actions saw while a job ran, by job id, for its check.
SEEN: dict[str, dict[str, Any]] = {}


def _root_signals_while_held(stack: Stack, followed: Followed) -> None:
    """D13: root's count of queued signals (which every jail's count adds to), read while
    the program holds every signal it could queue."""
    deadline = time.monotonic() + 20
    while "mq_open" not in followed.text("stdout"):
        assert time.monotonic() < deadline, "the program never reported"
        time.sleep(0.02)
    status = Path("/proc/self/status").read_text()
    SEEN[followed.job["jobId"]] = {"root_sigq": int(status.split("SigQ:")[1].split("/")[0])}


def _root_budget_kept(out: dict[str, Any], followed: Followed) -> None:
    held = SEEN[followed.job["jobId"]]["root_sigq"]
    assert held <= 256 + 64, f"root had {held} signals queued while one jail held its own; {summary(out)}"


def _programs_of(stack: Stack, marker: str) -> dict[int, list[str]]:
    """Processes whose command line starts with `marker` and that sit in this stack's
    cgroups (other stacks on the host run the same programs), with their cgroup lines."""
    found = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and _cmdline(p).startswith(marker.encode()):
            try:
                lines = (p / "cgroup").read_text().splitlines()
            except OSError:
                continue
            if any(line.split(":", 2)[2].startswith(f"/{stack.deployment}/") for line in lines):
                found[int(p.name)] = lines
    return found


def _watch_pids_events(marker: str) -> Callable[[Stack, Followed], None]:
    """A1: read the pids cgroup's `pids.events` while the program whose command line starts
    with `marker` runs (the cgroup is gone once the job ends): `max` counts the forks the
    limit refused."""

    def act(stack: Stack, followed: Followed) -> None:
        v2_root, v1_roots = cgroup_mounts(Path("/proc/self/mounts").read_text())
        deadline = time.monotonic() + 10
        events: Path | None = None
        while events is None:
            assert time.monotonic() < deadline, "program never started"
            for lines in _programs_of(stack, marker).values():
                events = _pids_events_file(lines, v2_root, v1_roots)
                break
            else:
                time.sleep(0.02)
        seen = SEEN.setdefault(followed.job["jobId"], {})
        seen["pids.events"] = str(events)
        while time.monotonic() < deadline:
            try:
                text = events.read_text()
            except FileNotFoundError:
                break  # the job ended and its cgroup went
            seen["pids.events max"] = int(dict(line.split() for line in text.splitlines()).get("max", 0))
            if seen["pids.events max"] > 0:
                break
            time.sleep(0.05)

    return act


def _pids_events_file(lines: list[str], v2_root: Path | None, v1_roots: dict[str, Path]) -> Path:
    """The pids.events of a process's pids cgroup (v1 pids, else the cgroup2 one)."""
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(",") and "pids" in v1_roots:
            return v1_roots["pids"] / path.lstrip("/") / "pids.events"
        if controllers == "" and v2_root is not None and (v2_root / path.lstrip("/") / "pids.events").exists():
            return v2_root / path.lstrip("/") / "pids.events"
    raise AssertionError(f"no pids cgroup in {lines}")


def _watch_compile_memory(marker: str) -> Callable[[Stack, Followed], None]:
    """F3: the memory cgroup of the compiler process whose command line starts with
    `marker`: its limit, and the highest usage seen until it is gone."""

    def act(stack: Stack, followed: Followed) -> None:
        v2_root, v1_roots = cgroup_mounts(Path("/proc/self/mounts").read_text())
        deadline = time.monotonic() + 15
        folder: Path | None = None
        while folder is None:
            assert time.monotonic() < deadline, "the compiler never started"
            for lines in _programs_of(stack, marker).values():
                for line in lines:
                    _, controllers, path = line.split(":", 2)
                    if "memory" in controllers.split(",") and "memory" in v1_roots:
                        folder = v1_roots["memory"] / path.lstrip("/")
                    elif controllers == "" and v2_root is not None and "memory" not in v1_roots:
                        folder = v2_root / path.lstrip("/")
                break
            else:
                time.sleep(0.01)
        v1 = "memory" in v1_roots
        seen = SEEN.setdefault(followed.job["jobId"], {})
        try:
            limit = (folder / ("memory.limit_in_bytes" if v1 else "memory.max")).read_text().strip()
            seen["compile memory limit"] = int(limit) if limit.isdigit() else 1 << 62
            usage = folder / ("memory.max_usage_in_bytes" if v1 else "memory.current")
            while time.monotonic() < deadline:
                seen["compile memory peak"] = max(seen.get("compile memory peak", 0), int(usage.read_text()))
                time.sleep(0.02)
        except (FileNotFoundError, ProcessLookupError):
            pass  # the compile ended and its cgroup went

    return act


def compile_memory_limit_hit(mib: int) -> Check:
    """F3: the compile was ended by its own memory limit (`mib`, the manifest's), reached."""

    def check(out: dict[str, Any], followed: Followed) -> None:
        seen = SEEN.get(followed.job["jobId"], {})
        limit, peak = seen.get("compile memory limit"), seen.get("compile memory peak", 0)
        assert limit is not None and limit <= (mib + 64) << 20, f"the compile's memory limit: {seen}; {summary(out)}"
        assert peak >= 0.9 * limit, f"the compile never neared its memory limit: {seen}; {summary(out)}"
        assert out["compile"]["timedOut"] is False, summary(out)

    return check


def pids_limit_hit(out: dict[str, Any], followed: Followed) -> None:
    seen = SEEN.get(followed.job["jobId"], {})
    assert seen.get("pids.events max", 0) > 0, f"the pids cgroup never refused a fork: {seen}; {summary(out)}"
    assert "Resource temporarily unavailable" in out["stderr"], f"bash saw no EAGAIN from fork; {summary(out)}"


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    """The parent's pid, or -1 when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return -1
    return int(stat[stat.rindex(")") + 2 :].split()[1])


# ---------------------------------------------------------------- the catalogue

# A world-readable file of the host's /etc (made for the run): /etc/shadow's mode alone
# makes it unreadable to a job's uid whether or not the jail shows it.
# (One fixed name: a run killed before its teardown leaves one file behind, which the next
# run overwrites and removes.)
HOST_CANARY = "/etc/coderunner-test-canary"
HOST_CANARY_TOKEN = "host-canary-" + os.urandom(8).hex()

D1_PY = r"""
import os
paths = ["HOST_CANARY", "/etc/shadow", "/etc/passwd", "/root/.ssh/id_rsa", "/proc/1/environ", "/proc/self/environ",
         "/proc/kallsyms", "/sys/fs/cgroup/memory/memory.limit_in_bytes", "/dev/mem", "/dev/kmsg", "/dev/sda",
         "/var/run/docker.sock", "/run/redis/redis.sock"]
for p in paths:
    try:
        with open(p, "rb") as f:
            print("READ", p, f.read(160))
    except OSError as e:
        print("deny", p, e.strerror)
for p in ("/proc/sys/kernel/core_pattern", "/etc/hosts", "/usr/bin/env", "/x"):
    try:
        open(p, "ab").close()
        print("WRITABLE", p)
    except OSError as e:
        print("ro", p, e.strerror)
import base64
import hashlib
with open("/etc/passwd", "rb") as f:
    print("PASSWD", hashlib.sha256(f.read()).hexdigest())
print("ENV", sorted(os.environ))
""".replace("HOST_CANARY", HOST_CANARY)

# D14: look for another job's workspace everywhere the jail can list: the file tree (its
# own workspace aside) and the roots and working folders of every process it can see.
HUNT_PY = r"""
import os
hits, procs = [], 0
for root, dirs, files in os.walk("/"):
    if root in ("/proc", "/sys", "/workspace"):
        dirs[:] = []
        continue
    hits += [os.path.join(root, f) for f in files if f == "canary.txt"]
for pid in filter(str.isdigit, os.listdir("/proc")):
    procs += 1
    for where in ("root", "cwd"):
        try:
            hits += [f"/proc/{pid}/{where}/{f}" for f in os.listdir(f"/proc/{pid}/{where}") if f == "canary.txt"]
        except OSError:
            pass
print("hits", hits)
print("procs", procs)
"""

# Only loopback targets: that nothing beyond loopback is reachable follows from the
# namespace checks (a network of its own whose only interface is a loopback that is down).
D3_PY = r"""
import socket
for host, port in [("127.0.0.1", 6379), ("::1", 6379), ("127.0.0.1", 80), ("localhost", 443)]:
    try:
        socket.create_connection((host, port), timeout=2).close()
        print("CONNECTED", host, port)
    except OSError as e:
        print("blocked", host, port, e.errno)
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"\0" * 12, ("127.0.0.1", 53))
    print("UDP SENT")
except OSError as e:
    print("udp blocked")
# The namespace itself, not only seccomp's refusal of inet sockets: whose network is this,
# which interfaces does it have, and is loopback up (SIOCGIFFLAGS works on a unix socket).
import fcntl, os, struct
print("NETNS", os.readlink("/proc/self/ns/net"))
with open("/proc/net/dev") as f:
    print("IFACES", ",".join(line.split(":")[0].strip() for line in f.readlines()[2:]))
with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
    print("LO_FLAGS", struct.unpack("16sH14x", fcntl.ioctl(s, 0x8913, struct.pack("16sH14x", b"lo", 0)))[1])
"""

D3_C = r"""
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <netinet/in.h>
#include <linux/netlink.h>
int main(void) {
    printf("raw %d\n", socket(AF_INET, SOCK_RAW, IPPROTO_ICMP));
    printf("packet %d\n", socket(AF_PACKET, SOCK_RAW, 0));
    printf("netlink %d\n", socket(AF_NETLINK, SOCK_RAW, NETLINK_ROUTE));
    printf("vsock %d\n", socket(40, SOCK_STREAM, 0));
    printf("tcp %d\n", socket(AF_INET, SOCK_STREAM, 0));
    /* A pair of a family runs that family's kernel code too (netlink, vsock: their create
       functions; TIPC implements pairs outright where its module can load). */
    int pair[2];
    /* Refused by the filter (EPERM) before the family is even looked up: without it, each
       fails too, but only after its family's code ran (EOPNOTSUPP, ENODEV...). */
    errno = 0; printf("pair-inet %d", socketpair(AF_INET, SOCK_STREAM, 0, pair)); printf(" errno %d\n", errno);
    errno = 0; printf("pair-netlink %d", socketpair(AF_NETLINK, SOCK_RAW, 0, pair)); printf(" errno %d\n", errno);
    errno = 0; printf("pair-vsock %d", socketpair(40, SOCK_DGRAM, 0, pair)); printf(" errno %d\n", errno);
    errno = 0; printf("pair-tipc %d", socketpair(30, SOCK_STREAM, 0, pair)); printf(" errno %d\n", errno);
    printf("pair-unix-works %d\n", socketpair(AF_UNIX, SOCK_STREAM, 0, pair) + 1);
    /* The harness listens on this abstract name in the host's network namespace (abstract
       names belong to a network namespace): only the jail's own keeps it out of reach. */
    int u = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = { .sun_family = AF_UNIX };
    memcpy(a.sun_path, "\0ABSTRACT_NAME", ABSTRACT_LEN);
    errno = 0; printf("abstract %d", connect(u, (struct sockaddr *)&a, sizeof(sa_family_t) + ABSTRACT_LEN));
    printf(" errno %d\n", errno);
    return 0;
}
"""

# A name of this run's own (another run's harness may hold the same one at once).
ABSTRACT_NAME = "cr-listening-" + os.urandom(4).hex()
D3_C = D3_C.replace("ABSTRACT_NAME", ABSTRACT_NAME).replace("ABSTRACT_LEN", str(1 + len(ABSTRACT_NAME)))

D4_C = r"""
#include <stdio.h>
#include <unistd.h>
#include <sys/prctl.h>
int main(void) {
    printf("uid=%d euid=%d nnp=%d\n", getuid(), geteuid(), prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0));
    printf("setuid(0)=%d setgid(0)=%d\n", setuid(0), setgid(0));
    char l[256]; FILE *f = fopen("/proc/self/status", "r");
    while (f && fgets(l, sizeof l, f)) if (l[0] == 'C' && l[1] == 'a') fputs(l, stdout);
    fflush(stdout);
    execl("/usr/bin/sudo", "sudo", "-n", "id", (char *)NULL);
    perror("exec sudo");
    return 0;
}
"""

D4_PY = r"""
import resource as r
print("MEMLOCK", *r.getrlimit(r.RLIMIT_MEMLOCK))
for name in ("RLIMIT_NOFILE", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_CORE"):
    k = getattr(r, name); soft, hard = r.getrlimit(k)
    try:
        r.setrlimit(k, (r.RLIM_INFINITY, r.RLIM_INFINITY)); print(name, "RAISED")
    except (ValueError, OSError):
        print(name, soft, hard, "refused")
"""

# The seccomp policy's KILL list (sandbox-profiles/base.cfg) with x86-64 numbers, written out
# here rather than read from the profile, so a call dropped from the policy is a failure
# here (test_d5_probes_every_kill_listed_call keeps the two lists the same). kafel calls
# umount2 `umount`, and names open_tree_attr (467) only by number.
KILL_LISTED = {
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "kexec_load": 246, "kexec_file_load": 320,
    "init_module": 175, "finit_module": 313, "delete_module": 176, "bpf": 321, "perf_event_open": 298,
    "userfaultfd": 323, "add_key": 248, "request_key": 249, "keyctl": 250, "mount": 165, "umount": 166,
    "pivot_root": 155, "chroot": 161, "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431,
    "fsmount": 432, "fspick": 433, "mount_setattr": 442, "SYSCALL[467]": 467, "swapon": 167, "swapoff": 168, "reboot": 169, "acct": 163,
    "quotactl": 179, "setns": 308, "open_by_handle_at": 304, "name_to_handle_at": 303, "syslog": 103,
    "settimeofday": 164, "adjtimex": 159, "clock_adjtime": 305, "iopl": 172, "ioperm": 173, "modify_ldt": 154,
}  # fmt: skip

# Each KILL-listed call in a child of its own (all-zero arguments: harmless, and refused by
# the kernel, should the filter ever let one through); the parent reports how each child
# ended. The ERRNO-listed calls are made by the parent, which must survive them.
D5_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>
static const struct { const char *name; long nr; } KILL_LISTED[] = { CALLS };
static void probe(const char *name, long r) {
    printf("%s %ld %s\n", name, r, r < 0 ? strerror(errno) : "SUCCEEDED");
    fflush(stdout);
}
int main(void) {
    probe("io_uring_setup", syscall(425, 8, NULL));
    probe("shmget", syscall(SYS_shmget, 0, 4096, 01000 | 0600));
    probe("msgget", syscall(SYS_msgget, 0, 01000 | 0600));
    for (size_t i = 0; i < sizeof KILL_LISTED / sizeof KILL_LISTED[0]; i++) {
        fflush(stdout);
        pid_t child = fork();
        if (child < 0) { printf("%s fork failed: %s\n", KILL_LISTED[i].name, strerror(errno)); continue; }
        if (child == 0) {
            long r = syscall(KILL_LISTED[i].nr, 0L, 0L, 0L, 0L, 0L, 0L);
            printf("%s returned %ld %s\n", KILL_LISTED[i].name, r, r < 0 ? strerror(errno) : "SUCCEEDED");
            fflush(stdout);
            _exit(0);
        }
        int status;
        if (waitpid(child, &status, 0) != child) { printf("%s wait failed\n", KILL_LISTED[i].name); continue; }
        if (WIFSIGNALED(status))
            printf("%s killed by %s\n", KILL_LISTED[i].name, WTERMSIG(status) == SIGSYS ? "SIGSYS" : strsignal(WTERMSIG(status)));
        else
            printf("%s exited %d\n", KILL_LISTED[i].name, WEXITSTATUS(status));
    }
    printf("done\n");
    return 0;
}
""".replace("CALLS", ", ".join(f'{{"{name}", {nr}}}' for name, nr in KILL_LISTED.items()))


D5_THREAD_C = r"""
#include <pthread.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>
static void *probe(void *arg) { (void)arg; syscall(321, 0L, 0L, 0L); return NULL; }
int main(void) {
    printf("probing\n");
    fflush(stdout);
    pthread_t t;
    pthread_create(&t, NULL, probe, NULL);
    pthread_join(t, NULL);
    sleep(1);
    printf("main thread survived bpf in a thread\n");
    return 0;
}
"""


# clone3's flags sit in a struct the filter cannot read, so clone3 is refused outright
# (ENOSYS, runtimes fall back to clone); clone is refused (EPERM) when it asks for a new
# namespace. A nested user namespace is the way into most kernel privilege escalations.
D6_CLONE_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {
    unsigned long long args[8] = {0};
    args[0] = CLONE_NEWUSER | CLONE_NEWNET;
    args[4] = SIGCHLD;
    errno = 0;
    long r = syscall(435, args, sizeof args);
    if (r == 0) _exit(0);
    printf("clone3 %ld %d\n", r, errno);
    errno = 0;
    r = syscall(SYS_clone, CLONE_NEWUSER | SIGCHLD, 0L, 0L, 0L, 0L);
    if (r == 0) _exit(0);
    printf("clone %ld %d\n", r, errno);
    return 0;
}
"""

# The rest of the ERRNO list, each refused with EPERM (D5 makes the first three).
D5_ERRNO_C = r"""
#include <errno.h>
#include <stdio.h>
#include <sys/syscall.h>
#include <unistd.h>
#define PROBE(name, ...) do { errno = 0; long r = syscall(__VA_ARGS__); printf("%s %ld %d\n", name, r, errno); } while (0)
int main(void) {
    PROBE("semget", SYS_semget, 0L, 1L, 01000 | 0600);
    PROBE("io_uring_enter", 426, 0L, 0L, 0L, 0L, 0L);
    PROBE("io_uring_register", 427, 0L, 0L, 0L, 0L);
    /* Legacy AIO: its contexts are counted host-wide (fs.aio-max-nr), one job could take all. */
    PROBE("io_setup", 206, 65536L, 0L);
    PROBE("io_destroy", 207, 0L);
    PROBE("io_getevents", 208, 0L, 0L, 0L, 0L, 0L);
    PROBE("io_submit", 209, 0L, 0L, 0L);
    PROBE("io_cancel", 210, 0L, 0L, 0L);
    PROBE("io_pgetevents", 333, 0L, 0L, 0L, 0L, 0L, 0L);
    PROBE("inotify_init1", SYS_inotify_init1, 0L);
    PROBE("fanotify_init", SYS_fanotify_init, 0L, 0L);
    PROBE("unshare", SYS_unshare, 0x10000000L);
    /* NUMA placement, and calls only privileged or legacy code makes (as Docker's default). */
    PROBE("mbind", 237, 0L, 0L, 0L, 0L, 0L, 0L);
    PROBE("set_mempolicy", 238, 0L, 0L, 0L);
    PROBE("get_mempolicy", 239, 0L, 0L, 0L, 0L, 0L);
    PROBE("migrate_pages", 256, 0L, 0L, 0L, 0L);
    PROBE("move_pages", 279, 0L, 0L, 0L, 0L, 0L, 0L);
    PROBE("set_mempolicy_home_node", 450, 0L, 0L, 0L, 0L);
    PROBE("kcmp", 312, 0L, 0L, 0L, 0L, 0L);
    PROBE("uselib", 134, 0L);
    PROBE("ustat", 136, 0L, 0L);
    PROBE("sysfs", 139, 3L);
    PROBE("vhangup", 153);
    PROBE("lookup_dcookie", 212, 0L, 0L, 0L);
    PROBE("clock_settime", 227, 0L, 0L);
    PROBE("quotactl_fd", 443, 0L, 0L, 0L, 0L);
    PROBE("personality-no-aslr", 135, 0x0040000L);
    /* Asking for the current persona is allowed (and it is plain Linux). */
    PROBE("personality-query", 135, 0xffffffffL);
    return 0;
}
"""

# What the jail's mounts allow, by statvfs flags (ST_RDONLY 1, ST_NOSUID 2, ST_NODEV 4,
# ST_NOEXEC 8): a bind left writable would be caught here, not only by file permissions.
MOUNT_FLAGS_PY = r"""
import os
for path in ("/", "/usr", "/bin", "/lib", "/etc/passwd", "/etc/hosts", "/proc", "/usr/local/etc",
             "/tmp", "/dev/shm", "/workspace", "/dev"):
    print(path, os.statvfs(path).f_flag & 15)
print("DEV", sorted(os.listdir("/dev")))
print("LINKS", sorted((name, os.readlink("/dev/" + name)) for name in os.listdir("/dev") if os.path.islink("/dev/" + name)))
# Every mount at or beneath a read-only bind must be read-only too (a bind carries submounts).
for line in open("/proc/self/mountinfo"):
    point, options = line.split()[4], line.split()[5].split(",")
    if point.split("/")[1] in ("usr", "bin", "lib", "lib64") and "rw" in options:
        print("WRITABLE", point)
"""

# Every namespace its own, the cgroup view empty of host names, the uid map to one
# unprivileged outside uid.
NAMESPACES_PY = r"""
import os
for ns in ("cgroup", "ipc", "mnt", "net", "pid", "user", "uts"):
    print("NS", ns, os.readlink("/proc/self/ns/" + ns))
print("CGROUP", open("/proc/self/cgroup").read().strip().replace("\n", "|"))
print("UIDMAP", " ".join(open("/proc/self/uid_map").read().split()))
print("GIDMAP", " ".join(open("/proc/self/gid_map").read().split()))
"""

# The worker reads how a jail ended from the gate's status socket and nsjail's own exit and
# log, never from the program's output: nsjail's log phrases, written by the program,
# change nothing.
FORGED_SUPERVISOR_SH = (
    "for s in 'exited with status: 137' 'terminated with signal: SIGKILL (9)' 'run time >= time limit'; do\n"
    "  echo \"[I][2026-01-01T00:00:00+0000] pid=1 ($s)\"; echo \"$s\" >&2\n"
    "done\nexit 0\n"
)


def host_namespace(name: str) -> str:
    return os.readlink(f"/proc/self/ns/{name}")


def namespaces_are_the_jails_own(out: dict[str, Any]) -> None:
    lines = out["stdout"].splitlines()
    seen = {line.split()[1]: line.split()[2] for line in lines if line.startswith("NS ")}
    assert len(seen) == 7 and all(link != host_namespace(ns) for ns, link in seen.items()), f"shared: {seen}"
    cgroup = next(line for line in lines if line.startswith("CGROUP "))
    assert "coderunner" not in cgroup and "jobs" not in cgroup, cgroup
    for name in ("UIDMAP", "GIDMAP"):
        inside, outside, count = next(line for line in lines if line.startswith(name)).split()[1:]
        # One id, the jail's 65534, onto a stack's job id (blocks start at 100000): never 0.
        assert (inside, count) == ("65534", "1") and int(outside) >= 100000, f"{name} {inside} {outside} {count}"


def d5_every_kill_listed_call_killed(out: dict[str, Any]) -> None:
    lines = out["stdout"].splitlines()
    assert lines[:3] == [
        "io_uring_setup -1 Operation not permitted",
        "shmget -1 Operation not permitted",
        "msgget -1 Operation not permitted",
    ], f"ERRNO-listed calls refused; {summary(out)}"
    reports: dict[str, list[str]] = {}
    for line in lines[3:]:
        name, _, what = line.partition(" ")
        reports.setdefault(name, []).append(what)
    survived = {name: "; ".join(reports.get(name, ["no report"])) for name in KILL_LISTED if reports.get(name) != ["killed by SIGSYS"]}
    assert not survived, f"KILL-listed calls not killed by SIGSYS: {survived}"
    assert lines[3:] == [*(f"{name} killed by SIGSYS" for name in KILL_LISTED), "done"], summary(out)


D6_C = r"""
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <sys/mount.h>
#include <unistd.h>
int main(void) {
    printf("unshare %d\n", unshare(CLONE_NEWUSER | CLONE_NEWNS)); fflush(stdout);
    printf("mount %d\n", mount("x", "/tmp", "tmpfs", 0, NULL)); fflush(stdout);
    return 0;
}
"""

D8_C = r"""
#include <signal.h>
#include <stdio.h>
#include <unistd.h>
int main(void) {
    printf("kill(-1) = %d\n", kill(-1, SIGKILL));
    int hit = 0;
    for (pid_t p = 1; p < (1 << 20); p++)
        if (p != getpid() && kill(p, SIGKILL) == 0) hit++;
    printf("signalled %d\n", hit);
    return 0;
}
"""

ZOMBIES_C = r"""
#include <stdio.h>
#include <unistd.h>
int main(void) {
    int n = 0;
    for (;;) { pid_t p = fork(); if (p == 0) _exit(0); if (p < 0) break; n++; }
    printf("zombies=%d\n", n);
    return 0;
}
"""

BALLOON_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int main(int argc, char **argv) {
    size_t n = (size_t)8 << 30;
    char *p = malloc(n);
    printf("malloc %s\n", p ? "ok" : "failed");
    fflush(stdout);
    if (p && TOUCH) for (size_t i = 0; i < n; i += 4096) ((volatile char *)p)[i] = 1;
    return p ? p[n / 2] : 0;
}
"""

# B9: socket buffers. Each child fills the send buffers of socket pairs until its descriptors
# run out: about 230 KB a socket, some 390 MB in all, which the job's processes do not hold as
# resident memory. The children that are still alive at the end held theirs at the same time
# (they sleep 4 s after filling them); the parent adds up what those sent. Unless the kernel
# charges the buffers to the job's cgroup, all 28 live and hold 390 MB past its limit.
SOCKET_BUFFERS_C = r"""
#include <stdio.h>
#include <string.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/wait.h>
int main(void) {
    static char buf[65536];
    memset(buf, 'x', sizeof buf);
    int report[2];
    if (pipe(report) != 0) return 1;
    printf("forking\n");
    fflush(stdout);
    for (int k = 0; k < 28; k++) {
        if (fork() == 0) {
            close(report[0]);
            long n = 0;
            for (int i = 0; i < 30; i++) {
                int sv[2];
                if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) break;
                for (int j = 0; j < 2; j++) {
                    fcntl(sv[j], F_SETFL, O_NONBLOCK);
                    ssize_t w;
                    while ((w = send(sv[j], buf, sizeof buf, 0)) > 0) n += w;
                }
            }
            char line[48];
            int len = snprintf(line, sizeof line, "%d %ld\n", (int)getpid(), n);
            write(report[1], line, len);
            sleep(4);
            _exit(0);
        }
    }
    close(report[1]);
    long pids[28], sent[28], held = 0;
    int reports = 0, survivors = 0;
    FILE *in = fdopen(report[0], "r");
    while (reports < 28 && fscanf(in, "%ld %ld", &pids[reports], &sent[reports]) == 2) reports++;
    int status;
    pid_t pid;
    while ((pid = wait(&status)) > 0) {
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) continue;
        survivors++;
        for (int i = 0; i < reports; i++) if (pids[i] == pid) held += sent[i];
    }
    printf("%ld %d\n", held, survivors);
    return 0;
}
"""

# B10: a child past the memory limit while its parent goes on. v2's group OOM kill ends the
# whole job; v1 kills only the child, and the worker ends the rest (the same verdict).
CHILD_BALLOON_PY = """\
import subprocess, sys, time
r = subprocess.run([sys.executable, "-c", "hog = []\\nwhile True: hog.append(b'x' * (16 << 20))"])
print("child ended", r.returncode, flush=True)
time.sleep(1.5)
print("the parent survived")
"""

CHILD_BALLOON_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/wait.h>
int main(void) {
    pid_t child = fork();
    if (child == 0) {
        for (;;) { char *p = malloc(16 << 20); if (p) memset(p, 1, 16 << 20); }
    }
    int status;
    waitpid(child, &status, 0);
    printf("child ended by signal %d\n", WIFSIGNALED(status) ? WTERMSIG(status) : 0);
    return 0;
}
"""

HUGE_FILE_C = r"""
#include <stdio.h>
int main(void) {
    static char buf[1 << 20];
    FILE *f = fopen("big.bin", "wb");
    if (!f) { perror("fopen"); return 1; }
    for (;;) { if (fwrite(buf, 1, sizeof buf, f) != sizeof buf) { perror("fwrite"); return 1; } fflush(f); }
}
"""

RUST_SPIN = r"""
use std::thread;
fn main() {
    let hs: Vec<_> = (0..8).map(|_| thread::spawn(|| while std::hint::black_box(true) { std::hint::spin_loop(); })).collect();
    for h in hs { h.join().unwrap(); }
}
"""

JAVA_THREADS = r"""
public class Main {
    public static void main(String[] args) {
        int n = 0;
        try {
            while (true) {
                Thread t = new Thread(() -> { try { Thread.sleep(Long.MAX_VALUE); } catch (InterruptedException e) { } });
                t.setDaemon(true); t.start(); n++;
            }
        } catch (Throwable e) { System.out.println("threads=" + n + " " + e); }
    }
}
"""

JAVA_HEAP = r"""
import java.util.ArrayList;
public class Main {
    public static void main(String[] a) {
        ArrayList<long[]> keep = new ArrayList<>();
        while (true) keep.add(new long[1 << 20]);
    }
}
"""

TEMPLATE_BOMB = r"""
template <class T, int N> struct X { static constexpr long v = X<X<T, N - 1>, N - 1>::v + X<T*, N - 1>::v; };
template <class T> struct X<T, 0> { static constexpr long v = 1; };
int main() { return X<int, 40>::v == 0; }
"""

RUST_CONST_EVAL_BOMB = "const N: u64 = { let mut i = 0u64; while i < u64::MAX { i += 1; } i };\nfn main() { println!(\"{}\", N); }\n"
MACRO_BOMB = "\n".join(
    ["#define D0(x) x x"] + [f"#define D{i}(x) D{i - 1}(D{i - 1}(x))" for i in range(1, 6)] + ["int main(void) { D5(;) return 0; }"]
)

# F4: warnings, which -fmax-errors does not count: about 600 KB of diagnostics from a
# compile that succeeds (the cap must cut them, in the result and in the live events).
WARNING_FLOOD_C = "\n".join(
    ['#define W _Pragma("GCC warning \\"flood flood flood flood\\"")']
    + ["#define W1 W W W W W W W W W W"]
    + [f"#define W{i} " + " ".join([f"W{i - 1}"] * 10) for i in range(2, 5)]
    + ["int main(void) { W4 return 0; }", ""]
)
COMPILE_MARKER = "\n[compiler output truncated at 64 KiB]\n"


def compile_output_capped(out: dict[str, Any], followed: Followed) -> None:
    log = out["compile"]["output"]
    assert log.endswith(COMPILE_MARKER) and len(log.encode()) <= 64 * 1024 + len(COMPILE_MARKER), summary(out)
    live = "".join(payload["chunk"] for name, payload in followed.events if name == "compile_output")
    assert live == log, f"live compile_output ({len(live)} chars) is not the result's log ({len(log)})"


DIAG_FLOOD = "\n".join(
    ["#define E1 int; int; int; int; int; int; int; int; int; int;"]
    + [f"#define E{i} " + " ".join([f"E{i - 1}"] * 10) for i in range(2, 5)]
    + ["E4 E4 E4 E4 E4 E4 E4 E4 E4 E4", "int main() {}"]
)

HOSTILE_NAMES_PY = r"""
import os
for i in range(300):
    open(f"out\n{i}\x1b[2J\u202e.txt", "w").close()
for _ in range(3000):
    os.mkdir("d")
    os.chdir("d")
print("deep")
"""

CONTROL_SEQUENCES = "\x1b]0;owned\x07\x1b[2J\x1b[H\x1b[31mRED\x1b[0m\rHIDDEN\r\x1b[2K\x1b]8;;https://example.invalid\x1b\\click\x1b]8;;\x1b\\\n"

GATE_FDS_PY = r"""
import errno, os
opened, refused = 0, set()
for n in range(64):
    try:
        os.close(os.open(f"/proc/1/fd/{n}", os.O_WRONLY))
        opened += 1
    except OSError as e:
        refused.add(errno.errorcode[e.errno])
try:
    os.listdir("/proc/1/fd")
    listed = "listed"
except OSError as e:
    listed = errno.errorcode[e.errno]
print(opened, ",".join(sorted(refused)), listed, os.getpid(), sep="|")
"""

# gcc's compiler proper, where the F3 macro bomb spends its memory.
CC1 = subprocess.run(["gcc", "-print-prog-name=cc1"], capture_output=True, text=True, check=False).stdout.strip() or "cc1"

# B5: 1 MiB files, then empty ones, until the place refuses more.
FLOOD_PY = (
    "import os\nn = 0\ntry:\n    while True:\n        with open(f'{where}/blk{{n}}', 'wb') as f:\n"
    "            f.write(os.urandom(1 << 20))\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)\n"
)
INODE_FLOOD_SH = 'cd {where} || exit 1\ni=0; while : > "f$i"; do i=$((i+1)); done 2>/dev/null; echo "created $i files"\n'

CASES = [
    # ---- A. CPU, time, process table
    Case("A1-bash-fork-bomb", "bash", "b(){ b | b & }; b; sleep 30\n",
         plus(both(expect(outcome="timed_out", timedOut=True, idleTimedOut=False)), pids_limit_hit),
         during=_watch_pids_events("/bin/bash\0main.sh")),
    Case("A1-c-zombie-farm", "c", ZOMBIES_C,
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: 20 <= int(o["stdout"].split("=")[1]) <= 32, "pids capped near 31 children"))),
    Case("A3-rust-threads-spin", "rust", RUST_SPIN,
         both(expect(outcome="timed_out", timedOut=True, signal="SIGKILL", killedBy="cpu"),
              where(lambda o: 1900 <= o["cpuMs"] <= 2600, "CPU clock at ~2 s of CPU, not xN"),
              # cpu.cfs_quota_us gives one core: 8 spinning threads get at most the wall time
              # (plus one 100 ms CFS period); two free cores would give twice the wall time.
              where(lambda o: o["cpuMs"] <= 1.1 * o["durationMs"] + 100, "one core: CPU no more than wall"))),
    Case("A4-python-silent-sleeper", "python", "import time; time.sleep(10**9)\n",
         both(expect(outcome="idle_timed_out", idleTimedOut=True, timedOut=False, killedBy="idle"),
              where(lambda o: 3900 <= o["durationMs"] <= 5000 and o["cpuMs"] < 500, "idle clock at ~4 s"))),
    Case("A4-node-silent-interval", "javascript", "setInterval(() => {}, 1 << 30);\n",
         both(expect(outcome="idle_timed_out", idleTimedOut=True, timedOut=False))),
    Case("A4-bash-chatty-sleeper", "bash", "while :; do printf .; sleep 1; done\n",
         both(expect(outcome="timed_out", timedOut=True, idleTimedOut=False, killedBy="wall"),
              where(lambda o: 7900 <= o["durationMs"] <= 9000 and o["stdout"].startswith("......."), "wall clock at ~8 s"))),
    Case("A5-python-ignores-signals", "python",
         "import signal\nfor s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGXCPU):\n"
         "    signal.signal(s, signal.SIG_IGN)\nwhile True:\n    pass\n",
         both(expect(outcome="timed_out", timedOut=True, signal="SIGKILL"),
              where(lambda o: 1900 <= o["cpuMs"] <= 2600, "CPU clock"))),
    Case("A7-bash-background-child", "bash", "( trap '' HUP TERM INT; exec sleep 100000 ) &\necho started\n",
         both(expect(outcome="completed", exitCode=0, stdout="started\n"),
              where(lambda o: o["durationMs"] < 1000, "no wait for the background child"))),
    Case("A7-python-double-fork-daemon", "python",
         "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
         "        for fd in (0, 1, 2):\n            os.close(fd)\n        while True:\n            time.sleep(1)\n"
         "    os._exit(0)\nprint('parent done')\n",
         both(expect(outcome="completed", exitCode=0, stdout="parent done\n"),
              where(lambda o: o["durationMs"] < 1000, "the daemon does not hold the job"))),
    Case("A8-java-thread-bomb", "java", JAVA_THREADS,
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: "threads=" in o["stdout"] and "OutOfMemoryError" in o["stdout"], "caught thread exhaustion")),
         limits={"pids": 64, "memoryMb": 256}),
    # ---- B. memory, disk, descriptors
    Case("B1-python-balloon", "python", 'hog = []\nwhile True:\n    hog.append(b"\\x01" * (16 << 20))\n',
         both(expect(outcome="memory_exceeded", signal="SIGKILL", timedOut=False, killedBy="memory"),
              where(lambda o: 100 * 1024 < o["memoryKb"] <= 128 * 1024 + MEMORY_SLACK_KB, "peak at the limit, not past it"))),
    Case("B1-c-untouched-malloc", "c", BALLOON_C.replace("TOUCH", "0"),
         both(expect(outcome="completed", exitCode=0, stdout="malloc ok\n"))),
    Case("B1-c-touched-malloc", "c", BALLOON_C.replace("TOUCH", "1"),
         both(expect(outcome="memory_exceeded", signal="SIGKILL"))),
    # V8's heap is capped below the job's memory (the manifest's --max-old-space-size), so
    # V8 itself gives up, with its own message, long before the cgroup would kill it: a
    # memory failure all the same (the manifest's heap_limit knows V8's last words).
    Case("B2-node-v8-heap", "javascript", "const k = []; for (;;) k.push(new Array(1 << 20).fill(1.5));\n",
         both(expect(outcome="memory_exceeded", killedBy="memory", exitCode=None, signal="SIGABRT", timedOut=False),
              where(lambda o: "JavaScript heap out of memory" in o["stderr"], "V8's own message"),
              where(lambda o: o["memoryKb"] < 120 * 1024, "V8's cap, below the cgroup's limit"))),
    Case("B2-node-off-heap", "javascript", "const k = []; for (;;) k.push(Buffer.alloc(16 << 20, 1));\n",
         both(expect(outcome="memory_exceeded", signal="SIGKILL"))),
    Case("B3-java-heap", "java", JAVA_HEAP,
         both(expect(outcome="memory_exceeded", killedBy="memory", exitCode=1),
              where(lambda o: "OutOfMemoryError: Java heap space" in o["stderr"], "the JVM's own message")),
         limits={"pids": 64}),
    Case("B4-c-huge-file", "c", HUGE_FILE_C,
         both(expect(outcome="completed", signal="SIGXFSZ"))),
    Case("B5-bash-inode-flood", "bash", 'cd /tmp || exit 1\ni=0; while : > "f$i"; do i=$((i+1)); done; echo "created $i files"\n',
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: 900 <= int(o["stdout"].split()[1]) <= 1024, "stops at the inode cap"))),
    Case("B5-python-tmpfs-flood", "python",
         'import os\nn = 0\ntry:\n    while True:\n        with open(f"/tmp/blk{n}", "wb") as f:\n'
         '            f.write(os.urandom(1 << 20))\n        n += 1\nexcept OSError as e:\n    print(n, e.errno)\n',
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: o["stdout"].split()[1] == "28" and int(o["stdout"].split()[0]) <= 16, "ENOSPC at 16 MiB"))),
    # The job's own workspace (64 MiB, 4,096 inodes) and /dev/shm (16 MiB, 256) are capped
    # by their tmpfs, not only by the memory limit (256 MiB here, past both): without their
    # size= and nr_inodes= the floods would run on to memory_exceeded or past the caps.
    Case("B5-python-workspace-flood", "python", FLOOD_PY.format(where="."),
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: o["stdout"].split()[1] == "28" and 56 <= int(o["stdout"].split()[0]) <= 64, "ENOSPC at 64 MiB")),
         limits={"memoryMb": 256}),
    Case("B5-bash-workspace-inode-flood", "bash", INODE_FLOOD_SH.format(where="."),
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: 4000 <= int(o["stdout"].split()[1]) <= 4096, "stops at the workspace's inode cap")),
         limits={"memoryMb": 256}),
    Case("B5-python-shm-flood", "python", FLOOD_PY.format(where="/dev/shm"),
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: o["stdout"].split()[1] == "28" and 12 <= int(o["stdout"].split()[0]) <= 16, "ENOSPC at 16 MiB")),
         limits={"memoryMb": 256}),
    Case("B5-bash-shm-inode-flood", "bash", INODE_FLOOD_SH.format(where="/dev/shm"),
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: 200 <= int(o["stdout"].split()[1]) <= 256, "stops at /dev/shm's inode cap")),
         limits={"memoryMb": 256}),
    Case("B6-python-fd-exhaustion", "python",
         'fds = []\ntry:\n    while True:\n        fds.append(open("/dev/null"))\nexcept OSError as e:\n    print(len(fds), e.errno)\n',
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: o["stdout"].split()[1] == "24" and 50 <= int(o["stdout"].split()[0]) <= 64, "EMFILE near 64"))),
    Case("B9-c-socket-buffers", "c", SOCKET_BUFFERS_C,
         # (Charged, the kernel's OOM killer ends children at the limit, and the job with them;
         # or, failing the sends, leaves the survivors holding no more than the limit.)
         # (Every child lives, or the job ended: a send that fails at the limit ends no child.)
         both(where(lambda o: o["outcome"] == "memory_exceeded"
                    or (len(words := o["stdout"].split()) == 3 and int(words[1]) <= 132 << 20 and words[2] == "28"),
                    "socket buffers charged to the job (killed at its limit), not to the host")),
         limits={"idleMs": 7000}),
    Case("B10-python-child-balloon", "python", CHILD_BALLOON_PY,
         both(expect(outcome="memory_exceeded", killedBy="memory", signal="SIGKILL"),
              where(lambda o: "survived" not in o["stdout"], "the whole job ended at the child's OOM kill"))),
    # (Within milliseconds, before the worker's first look at its OOM counter on v1.)
    Case("B10-c-child-balloon-parent-exits", "c", CHILD_BALLOON_C,
         both(expect(outcome="memory_exceeded", killedBy="memory"))),
    Case("B8-python-hostile-names-and-depth", "python", HOSTILE_NAMES_PY,
         both(expect(outcome="completed", exitCode=0, stdout="deep\n"))),
    # ---- C. output and stdin
    Case("C1-python-stdout-flood", "python", 'while True:\n    print("A" * 4095)\n',
         both(expect(outcome="timed_out", truncated=True),
              where(lambda o: len(o["stdout"].encode()) + len(o["stderr"].encode()) == 512 * 1024, "exactly the budget"))),
    Case("C1-cpp-stderr-flood-no-newline", "cpp",
         "#include <iostream>\n#include <string>\nint main() { std::string s(1 << 20, 'E'); for (;;) std::cerr << s; }\n",
         both(expect(outcome="timed_out", truncated=True, stdout=""),
              where(lambda o: o["stderr"] == "E" * (512 * 1024), "exactly the budget, line-less"))),
    Case("C3-python-terminal-sequences", "python",
         f"import sys\nsys.stdout.write({CONTROL_SEQUENCES!r})\nsys.stderr.write('\\x1b[6n\\x1b[?1049h\\n')\n",
         both(expect(outcome="completed", exitCode=0, stdout=CONTROL_SEQUENCES, stderr="\x1b[6n\x1b[?1049h\n"))),
    Case("C4a-python-ignores-big-stdin", "python", "print('never reads stdin')\n",
         both(expect(outcome="completed", exitCode=0, stdout="never reads stdin\n"),
              where(lambda o: o["durationMs"] < 2000, "quick")),
         stdin="x" * (1024 * 1024 - 1) + "\n"),
    Case("C4b-c-getchar-without-stdin", "c", "#include <stdio.h>\nint main(void) { int c = getchar(); printf(\"%d\\n\", c); return 0; }\n",
         both(expect(outcome="completed", exitCode=0, stdout="-1\n"))),
    Case("C4c-python-echo-256k", "python", "import sys\nfor line in sys.stdin:\n    sys.stdout.write(line)\n",
         both(expect(outcome="completed", exitCode=0, truncated=False),
              where(lambda o: o["stdout"] == "".join(f"{i:07d}\n" for i in range(32768)), "byte-exact echo")),
         stdin="".join(f"{i:07d}\n" for i in range(32768))),
    Case("C5-c-invalid-utf8-and-nul", "c",
         '#include <stdio.h>\nint main(void) { fwrite("a\\0b\\xff\\xfe\\xe2\\x82", 1, 7, stdout); return 0; }\n',
         both(expect(outcome="completed", exitCode=0, stdoutEncoding="base64"),
              where(lambda o: __import__("base64").b64decode(o["stdout"]) == b"a\x00b\xff\xfe\xe2\x82", "exact bytes kept"))),
    # ---- D. confinement
    Case("D1-python-host-secrets", "python", D1_PY,
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: all(not line.startswith("WRITABLE") for line in o["stdout"].splitlines()), "nothing writable"),
              where(lambda o: [line.split()[1] for line in o["stdout"].splitlines() if line.startswith("READ")]
                    == ["/etc/passwd", "/proc/self/environ", "/proc/kallsyms"], "only jail-provided files readable"),
              where(lambda o: "READ /proc/kallsyms b''" in o["stdout"], "kernel symbols masked"),
              where(lambda o: f"deny {HOST_CANARY} No such file or directory\n" in o["stdout"], "the host's /etc not shown"),
              # The path alone proves nothing: a bind of the host's file reads just as well.
              where(lambda o: f"PASSWD {sha256_of('/etc/passwd')}\n" not in o["stdout"], "/etc/passwd is not the host's"),
              where(lambda o: "sandbox:x:65534:" in next(ln for ln in o["stdout"].splitlines() if ln.startswith("READ /etc/passwd")),
                    "/etc/passwd is the jail's own"),
              where(lambda o: "REDIS" not in o["stdout"] and "TOKEN" not in o["stdout"] and "SECRET" not in o["stdout"], "no secrets"),
              where(lambda o: o["stdout"].rstrip().endswith(
                  "['HOME', 'LANG', 'LC_ALL', 'PATH', 'PYTHONDONTWRITEBYTECODE', 'PYTHONIOENCODING', 'PYTHONUNBUFFERED', 'TMPDIR']"),
                  "environment is the allow-list"))),
    Case("D2-bash-process-view", "bash",
         'for p in /proc/[0-9]*; do printf "%s " "${p#/proc/}"; done; echo; hostname; id -u; cat /proc/1/cmdline | tr "\\0" " "; echo\n',
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: o["stdout"].splitlines()[1:3] == ["sandbox", "65534"], "hostname sandbox, uid 65534"),
              where(lambda o: len(o["stdout"].splitlines()[0].split()) <= 4, "only the job's own processes"),
              where(lambda o: "gate" in o["stdout"].splitlines()[3], "pid 1 is the gate"))),
    Case("D3-python-network", "python", D3_PY,
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: "CONNECTED" not in o["stdout"] and "udp blocked" in o["stdout"], "no network at all"),
              where(lambda o: "\nNETNS net:[" in o["stdout"] and f"\nNETNS {os.readlink('/proc/self/ns/net')}\n" not in o["stdout"],
                    "a network namespace of its own, not the host's"),
              where(lambda o: "\nIFACES lo\n" in o["stdout"], "only a loopback interface"),
              where(lambda o: (m := re.search(r"\nLO_FLAGS (\d+)\n", o["stdout"])) is not None and int(m[1]) & 1 == 0,
                    "loopback down (IFF_UP clear)"))),
    Case("D3-c-socket-families", "c", D3_C,
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: "pair-unix-works 1\n" in o["stdout"], "unix socket pairs work"),
              where(lambda o: all(line.endswith(" -1") for line in o["stdout"].splitlines()
                                  if not line.startswith(("pair-", "abstract "))),
                    "every other family refused"),
              where(lambda o: "abstract -1 errno 111\n" in o["stdout"], "the host's abstract socket out of reach (refused)"),
              where(lambda o: sum(line.endswith(" -1 errno 1") for line in o["stdout"].splitlines()) == 4,
                    "and every pair of one, by the filter"))),
    Case("D4-c-privilege", "c", D4_C,
         both(expect(outcome="completed"),
              where(lambda o: o["stdout"].startswith("uid=65534 euid=65534 nnp=1\nsetuid(0)=-1 setgid(0)=-1\n"), "unprivileged, no new privs"),
              # Every set, the bounding one too (nothing a later exec could regain), and all
              # five read: a set missing from the output cannot pass for an empty one.
              where(lambda o: {line.split()[0]: line.split()[1] for line in o["stdout"].splitlines() if line.startswith("Cap")}
                    == dict.fromkeys(("CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"), "0000000000000000"),
                    "no capabilities in any set"))),
    Case("D4-python-rlimits", "python", D4_PY,
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: "RAISED" not in o["stdout"] and o["stdout"].count("refused") == 4, "finite limits cannot be raised"),
              where(lambda o: o["stdout"].startswith("MEMLOCK 0 0\n"), "no memory can be locked"),
              # Exactly 1 byte: no core file, and no core_pattern pipe helper either.
              where(lambda o: "RLIMIT_CORE 1 1 refused\n" in o["stdout"], "no core dump of any kind"))),
    Case("D5-c-kernel-surfaces", "c", D5_C,
         both(expect(outcome="completed", exitCode=0, signal=None), d5_every_kill_listed_call_killed)),
    Case("D5-c-killed-call-in-a-thread", "c", D5_THREAD_C,
         # A kill-listed call from a throwaway thread ends the whole program, not the thread.
         both(expect(outcome="completed", signal="SIGSYS", stdout="probing\n"))),
    Case("D6-c-namespaces-and-mounts", "c", D6_C,
         both(expect(outcome="completed", signal="SIGSYS", stdout="unshare -1\n"))),
    Case("D7-c-32bit-syscall-abi", "c",
         "#include <stdio.h>\nint main(void) { long r;\n"
         "  __asm__ volatile (\"int $0x80\" : \"=a\"(r) : \"a\"(20) : \"memory\");\n"
         "  printf(\"int80 %ld\\n\", r); return 0; }\n",
         # A 32-bit system call would dodge a filter written for x86-64 numbers; the
         # filter's architecture check kills it instead.
         both(expect(outcome="completed", signal="SIGSYS", stdout=""))),
    Case("D7-c-x32-syscall-abi", "c",
         "#include <stdio.h>\n#include <unistd.h>\n#include <sys/syscall.h>\n"
         "int main(void) { puts(\"probing\"); fflush(stdout);\n"
         "  long r = syscall(0x40000000L | SYS_getpid);\n  printf(\"x32 %ld\\n\", r); return 0; }\n",
         # x32 numbers (bit 30 set) reach the same kernel code as x86-64 ones but match no
         # rule of a filter keyed on x86-64 numbers; the gate's own filter kills them, on
         # kernels that serve x32 and on those that would answer ENOSYS alike.
         both(expect(outcome="completed", signal="SIGSYS", stdout="probing\n"))),
    Case("D8-c-signal-everything", "c", D8_C,
         both(expect(outcome="completed", exitCode=0),
              # Its namespace holds only itself and the gate (pid 1: kill() "succeeds" but the
              # kernel drops the signal, and the job ended normally, so the gate lived).
              where(lambda o: o["stdout"].endswith("signalled 1\n"), "no process outside the job")),
         limits={"cpuMs": 6000, "wallTimeMs": 8000}),
    Case("D10-bash-exec-from-writable", "bash",
         'cp /bin/true /tmp/t && chmod +x /tmp/t && /tmp/t; echo "tmp exec rc=$?"\n'
         "printf '#!/bin/sh\\necho hi\\n' > ./s.sh && chmod +x ./s.sh && ./s.sh; echo \"workspace exec rc=$?\"\n",
         both(expect(outcome="completed"),
              where(lambda o: "tmp exec rc=126" in o["stdout"] and "hi\nworkspace exec rc=0" in o["stdout"], "noexec /tmp, exec workspace"))),
    # ---- F. compile stage
    Case("F2-cpp-include-host-files", "cpp", '#include "/etc/shadow"\n#include "/proc/self/environ"\nint main() {}\n',
         both(compile_failed, where(lambda o: "root:" not in o["compile"]["output"], "no host secrets in diagnostics"))),
    Case("F2-c-include-a-readable-host-file", "c", f'#include "{HOST_CANARY}"\nint main(void) {{ return 0; }}\n',
         both(compile_failed,
              where(lambda o: "No such file or directory" in o["compile"]["output"], "the host's /etc not shown to the compiler"),
              where(lambda o: HOST_CANARY_TOKEN not in o["compile"]["output"], "no host file's content in diagnostics"))),
    Case("F2-rust-include-host-files", "rust",
         'const SHADOW: &[u8] = include_bytes!("/etc/shadow");\nfn main() { println!("{}", SHADOW.len()); }\n',
         both(compile_failed)),
    Case("F3-c-macro-bomb", "c", MACRO_BOMB, plus(both(compile_failed), compile_memory_limit_hit(512)),
         during=_watch_compile_memory(CC1 + "\0")),
    # (Its clock or its memory limit, whichever it reaches first: that depends on the host's
    # load. The clock kills the whole compile; the memory limit's OOM kill may take cc1plus
    # alone, and g++ then exits 1 saying so.)
    Case("F3-cpp-template-bomb", "cpp", TEMPLATE_BOMB,
         both(compile_failed,
              where(lambda o: o["compile"]["signal"] == "SIGKILL"
                    or "Killed signal terminated program cc1plus" in o["compile"]["output"],
                    "the compile's clock or memory limit ended it"))),
    Case("F4-cpp-diagnostic-flood", "cpp", DIAG_FLOOD,
         both(compile_failed, where(lambda o: o["compile"]["exitCode"] not in (0, None), "compiler said no"))),
    Case("F4-c-warning-flood", "c", WARNING_FLOOD_C,
         lambda out, followed: (expect(outcome="completed", exitCode=0)(out), compile_output_capped(out, followed))),
    Case("F6-java-parser-bomb", "java",
         "public class Main { static int x = " + "(" * 50000 + "1" + ")" * 50000 + "; public static void main(String[] a) {} }\n",
         both(compile_failed)),
    Case("F6-rust-const-eval-bomb", "rust", RUST_CONST_EVAL_BOMB,
         both(compile_failed,
              where(lambda o: "constant evaluation is taking a long time" in o["compile"]["output"], "rustc's own const-eval error"),
              where(lambda o: o["compile"]["timedOut"] is False, "rustc stopped by itself"))),
    # With rustc's lint allowed nothing in the compiler stops it: the compile clock must.
    Case("F6-rust-const-eval-bomb-lint-allowed", "rust", "#![allow(long_running_const_eval)]\n" + RUST_CONST_EVAL_BOMB,
         both(compile_failed,
              where(lambda o: o["compile"]["timedOut"] is True and o["compile"]["signal"] == "SIGKILL", "the compile clock ended rustc"))),
    Case("F1-c-include-dev-urandom", "c", '#include "/dev/urandom"\nint main(void) { return 0; }\n',
         both(compile_failed)),
    Case("F5-c-giant-object-file", "c", "char big[1 << 30] = {1};\nint main(int argc, char **argv) { return big[argc * 4096]; }\n",
         both(compile_failed, where(lambda o: "File size limit exceeded" in o["compile"]["output"], "the compile's file size limit"))),
    Case("D6-c-clone-into-namespaces", "c", D6_CLONE_C,
         both(expect(outcome="completed", exitCode=0, stdout="clone3 -1 38\nclone -1 1\n"))),
    Case("D5-c-errno-listed-calls", "c", D5_ERRNO_C,
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: [line.split(" ", 1)[1] for line in o["stdout"].splitlines()] == ["-1 1"] * 27 + ["0 0"],
                    "each refused with EPERM; the persona query answered"))),
    # R12, directly: the gate (the jail's pid 1, which reports the program's end to the
    # worker over its status socket) is not dumpable, so the program can neither list nor
    # open its descriptors to forge a report. (D1's /proc/1/environ shows it only in passing.)
    Case("R12-python-gate-descriptors", "python", GATE_FDS_PY,
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: o["stdout"].split("|")[:3] == ["0", "EACCES", "EACCES"], "no descriptor of the gate reachable"),
              where(lambda o: o["stdout"].split("|")[3].strip() != "1", "the program is not the jail's pid 1"))),
    Case("D1-python-mount-flags", "python", MOUNT_FLAGS_PY,
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: all(f"{p} {f}\n" in o["stdout"] for p, f in [
                  ("/", 1), *((p, 1 | 2 | 4) for p in ("/usr", "/bin", "/lib")), ("/usr/local/etc", 1 | 2 | 4 | 8),
                  ("/proc", 1 | 2 | 4 | 8), ("/tmp", 2 | 4 | 8), ("/dev/shm", 2 | 4 | 8), ("/workspace", 2 | 4),
                  ("/dev", 2 | 8)]),
                    "read-only binds, noexec scratch, nosuid+nodev workspace, nosuid+noexec /dev"),
              where(lambda o: "WRITABLE" not in o["stdout"], "no writable mount beneath a read-only bind"),
              where(lambda o: re.search(r"^/etc/(passwd|hosts) [1357]$", o["stdout"], re.M) is not None
                    and "/etc/passwd 0\n" not in o["stdout"] and "/etc/hosts 0\n" not in o["stdout"],
                    "the synthetic identity files are read-only"),
              where(lambda o: "DEV ['fd', 'null', 'random', 'shm', 'stderr', 'stdin', 'stdout', 'urandom', 'zero']\n"
                    in o["stdout"], "a /dev of five entries and the links to a process's own descriptors"),
              where(lambda o: "LINKS [('fd', '/proc/self/fd'), ('stderr', '/proc/self/fd/2'), ('stdin', '/proc/self/fd/0'), "
                    "('stdout', '/proc/self/fd/1')]\n" in o["stdout"], "each link into the process's own /proc"))),
    Case("D2-python-namespaces-and-ids", "python", NAMESPACES_PY,
         both(expect(outcome="completed", exitCode=0), namespaces_are_the_jails_own)),
    Case("G1-bash-forged-supervisor-lines", "bash", FORGED_SUPERVISOR_SH,
         both(expect(outcome="completed", exitCode=0, signal=None, timedOut=False),
              where(lambda o: "killedBy" not in o, "no clock or kill claimed"))),
    # rustc reads an included file to its end (gcc trusts the size, 0 for /proc files), so
    # the compiler's own environment becomes the program's text.
    Case("F2-rust-compile-environment", "rust",
         'const ENV: &str = include_str!("/proc/self/environ");\nfn main() { print!("{}", ENV.replace(\'\\0\', "\\n")); }\n',
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: "PATH=" in o["stdout"], "the compiler's environment, read"),
              where(lambda o: not re.search(r"PUSHER|REDIS|SECRET|TOKEN|CALLBACK|API", o["stdout"]),
                    "holds nothing of the worker's"))),
    # ---- more process-table and descriptor abuse
    Case("A6-bash-stops-itself", "bash", "sleep 1000 &\nkill -STOP $!\necho stopping\nkill -STOP $$\necho never\n",
         both(expect(outcome="idle_timed_out", killedBy="idle", stdout="stopping\n"))),
    Case("D11-python-inherited-descriptors", "python", "import os\nprint(sorted(os.listdir('/proc/self/fd')))\n",
         both(expect(outcome="completed", stdout="['0', '1', '2', '3']\n"))),
    Case("D12-python-inotify-instances", "python",
         "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
         "print(libc.inotify_init1(0), ctypes.get_errno())\n",
         # Each instance would count against root's inotify quota on the host.
         both(expect(outcome="completed", exitCode=0, stdout="-1 1\n"))),
    # Queued signals and message queues count against root's budget on the host (every
    # jail's user namespace is root's): each jail has a small one of its own.
    Case("D13-c-signal-and-message-queue-budget", "c", SIGNAL_BUDGET_C,
         plus(both(expect(outcome="completed", exitCode=0),
                   where(lambda o: re.search(r"^queued ([0-9]+) errno 11$", o["stdout"], re.M) is not None
                         and int(re.search(r"^queued ([0-9]+)", o["stdout"], re.M)[1]) <= 256, "at most 256 signals queued"),
                   where(lambda o: "mq_open -1 errno 24\n" in o["stdout"], "no message queue")),
              _root_budget_kept)),
    # HOME is the workspace: go would read a submitted .config/go/env and take its GOFLAGS
    # (-toolexec would run the job's own program inside the compile; -ldflags shows it).
    Case("F3-go-environment-file", "go", 'package main\n\nimport "fmt"\n\nvar injected = "no"\n\nfunc main() { fmt.Println(injected) }\n',
         both(expect(outcome="completed", exitCode=0, stdout="no\n")),
         body={"files": [{"name": "main.go", "content": 'package main\n\nimport "fmt"\n\nvar injected = "no"\n\nfunc main() { fmt.Println(injected) }\n'},
                         {"name": ".config/go/env", "content": "GOFLAGS=-ldflags=-X=main.injected=yes\n"}]}),
    # The neighbour (invariants.Neighbour) keeps canary.txt in its workspace while this runs:
    # nothing the jail can list leads to it, by the file tree or through another process.
    # Walking every file the jail can see (about 255,000 here) prints nothing until the end:
    # 0.6 s warm, 3.6 s with a cold cache, and once 14 s and 2 s of CPU under the whole suite's
    # load. Limits of its own: the walk is not what is tested.
    Case("D14-python-hunt-other-workspaces", "python", HUNT_PY,
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: o["stdout"].startswith("hits []\nprocs ") and int(o["stdout"].split()[-1]) <= 3,
                    "no other workspace, and only its own processes")),
         limits={"idleMs": 90000, "wallTimeMs": 120000, "cpuMs": 60000}),
    # ---- G. supervisor faults
    Case("G2-nsjail-killed-mid-run", "bash", "echo running; sleep 100000 & while :; do :; done\n",
         both(where(lambda o: o["outcome"] in ("lost", "killed") and o["durationMs"] < 5000, "ends cleanly, no hang"))),
]
CASES[-1].during = _kill_nsjail_of("/bin/bash\0main.sh")
next(c for c in CASES if c.id.startswith("D13-")).during = _root_signals_while_held


@pytest.fixture(scope="module")
def hostile_stack() -> Iterator[Stack]:
    # Three slots: the neighbour (I4's canary in another job's workspace) holds one while a
    # hostile job and its compile use the others.
    with Stack(extra_env={"WORKER_MAX_SANDBOXES": "3", "LOG_LEVEL": "INFO"}) as stack:
        yield stack


@pytest.fixture(scope="module", autouse=True)
def host_canary() -> Iterator[Path]:
    """D1's and F2's target: a file of the host's /etc anyone may read."""
    canary = Path(HOST_CANARY)
    canary.write_text(f"int {HOST_CANARY_TOKEN.replace('-', '_')};\n{HOST_CANARY_TOKEN}\n")
    canary.chmod(0o644)
    atexit.register(canary.unlink, missing_ok=True)  # (also when a fixture's teardown never runs)
    yield canary
    canary.unlink(missing_ok=True)


@pytest.fixture(scope="module", autouse=True)
def host_abstract_listener() -> Iterator[socket.socket]:
    """D3's target: a listening abstract socket in the host's network namespace."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + ABSTRACT_NAME)
    listener.listen(4096)  # (never accepted: a jail that could reach it must not block on a full backlog)
    listener.setblocking(False)
    yield listener
    listener.close()


@pytest.fixture(scope="module")
def watch(hostile_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> HostWatch:
    return HostWatch(hostile_stack, tmp_path_factory.mktemp("canaries"))


@pytest.fixture(scope="module")
def clients(hostile_stack: Stack) -> Iterator[tuple[Api, Realtime]]:
    api, realtime = Api(hostile_stack), Realtime(hostile_stack)
    yield api, realtime
    realtime.close()
    api.close()


def test_a_process_that_only_looks_like_a_gate_is_not_taken_for_one(hostile_stack: Stack, watch: HostWatch) -> None:
    # A job uid's process whose command line says "/.coderunner/gate" (any process can write
    # that over its own) is a leftover to the invariants, not a parked gate.
    deadline = time.monotonic() + 15
    while not watch.gate_pids():  # (slots are rebuilt after each job)
        assert time.monotonic() < deadline, "the stack never had a parked gate"
        time.sleep(0.05)
    uid = min(watch.uids)
    fake = subprocess.Popen(["/bin/bash", "-c", "exec -a /.coderunner/gate /bin/sleep 30"], user=uid, group=uid)
    try:
        deadline = time.monotonic() + 5
        while not Path(f"/proc/{fake.pid}/cmdline").read_bytes().startswith(b"/.coderunner/gate\0"):
            assert time.monotonic() < deadline, "the disguise never took"
            time.sleep(0.01)
        seen = watch.gate_pids()
        assert fake.pid not in seen
        assert seen, "the real parked gates are no longer recognised"  # (slots rebuilt since have new pids)
    finally:
        fake.kill()
        fake.wait()


def test_catalogue_is_large_enough() -> None:
    assert len(CASES) >= 25
    assert len({c.language for c in CASES}) >= 6


def test_d5_probes_every_kill_listed_call() -> None:
    """D5 probes exactly the profile's KILL list: a call added to the policy gets a probe."""
    lines = [
        line.split('"')[1]
        for line in (REPO_ROOT / "sandbox-profiles" / "base.cfg").read_text().splitlines()
        if line.startswith("seccomp_string:")
    ]  # fmt: skip
    policy = " ".join(lines)
    kill_block = policy[policy.index("KILL_PROCESS {") + len("KILL_PROCESS {") :]
    kill_block = kill_block[: kill_block.index("}")]
    assert {name.strip() for name in kill_block.split(",") if name.strip()} == set(KILL_LISTED)


def check_events(api: Api, followed: Followed, result_at: float) -> None:
    """Exactly one result, live; the live events are seq 0..n in order, with no hole, and
    identical to the durable log."""
    log = api.replay(followed.job, timeout_s=15)
    time.sleep(max(0.0, result_at + 0.3 - time.monotonic()))  # a duplicate result would come in this window
    live = list(followed.events)
    names = [name for name, _ in live]
    assert names.count("result") == 1, f"{names.count('result')} results live"
    seqs = [payload["seq"] for _, payload in live]
    assert seqs == list(range(len(live))), f"live seqs not 0..n in order: {seqs[:20]}... ({len(seqs)} events)"
    assert [payload["seq"] for _, payload in log] == list(range(len(log))), "durable log not 0..n"
    assert live == log, f"live events differ from the durable log ({len(live)} live, {len(log)} logged)"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_program(case: Case, hostile_stack: Stack, watch: HostWatch, clients: tuple[Api, Realtime]) -> None:
    api, realtime = clients
    base = watch.baseline()
    neighbour = Neighbour(api, realtime)
    try:
        limits = {**LIMITS, **case.limits}
        body: dict[str, Any] = {
            "language": case.language,
            "files": [{"name": FILE[case.language], "content": case.code}],
            "limits": limits,
            "collectOutput": True,
        }
        body["stdin"] = case.stdin
        body.update(case.body)
        job = api.execute(body)
        followed = realtime.follow(job)
        api.start(job)
        if case.during is not None:
            case.during(hostile_stack, followed)
        followed.wait_result(timeout_s=60)
        result_at = time.monotonic()
        response = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "5000"})
        assert response.status_code == 200, response.text
        out = response.json()
        check_result_shape(out, limits["wallTimeMs"])
        assert out["memoryKb"] <= limits["memoryMb"] * 1024 + MEMORY_SLACK_KB, f"peak memory past the limit; {summary(out)}"
        if out["outcome"] == "memory_exceeded":  # its own limit, never the deployment's ceiling
            assert "message" not in out, f"blamed on the ceiling; {summary(out)}"
        case.check(out, followed)
        check_events(api, followed, result_at)
        neighbour.check()
        watch.settle(base)
    finally:
        neighbour.end()
    check_trivial_job(api, realtime)


# The last call number base.cfg's policy was reviewed against; the gate's filter (gate.c,
# REVIEWED_SYSCALL_MAX) answers ENOSYS past it.
REVIEWED_SYSCALL_MAX = 469
ALLOW = 0x7FFF0000
ENOSYS = ERRNO | 38


BURN_C = r"""
#include <stdio.h>
#include <time.h>
static double cpu_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
    return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}
int main(void) {
    volatile unsigned long x = 0;
    while (cpu_ms() < BURN) x++;
    printf("burned %.1f\n", cpu_ms());
    return 0;
}
"""


def test_a_program_past_its_cpu_budget_is_never_completed(hostile_stack: Stack, clients: tuple[Api, Realtime]) -> None:
    # Ending a few ms past cpuMs, between two reads of the CPU clock, was `completed` (with a
    # cpuMs figure over the limit) or `timed_out`, by the reads' timing: 4 of 6 completed.
    api, _ = clients
    seen = []
    for burn in (1002, 1004, 1008):
        body = {
            "language": "c",
            "collectOutput": True,
            "limits": {**LIMITS, "cpuMs": 1000},
            "files": [{"name": "main.c", "content": BURN_C.replace("BURN", str(burn))}],
        }
        job = api.execute(body)
        api.start(job)
        out = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "20000"}).json()
        seen.append((burn, out["outcome"], out["cpuMs"], out.get("killedBy")))
    assert all(outcome == "timed_out" and killed_by == "cpu" for _b, outcome, _c, killed_by in seen), seen


def test_verdict_resolves_filters_as_the_kernel_does() -> None:
    # installed_filters lists the oldest filter first; on equal actions the kernel keeps
    # the newest filter's result (its errno), and across actions the strictest wins.
    def ret(value: int) -> list[tuple[int, int, int, int]]:
        return [(0x06, 0, 0, value)]  # RET value

    older, newer = ret(ERRNO | 1), ret(ERRNO | 2)
    assert verdict([older, newer], 0) == ERRNO | 2
    assert verdict([ret(KILL_PROCESS), newer], 0) == KILL_PROCESS
    assert verdict([older, ret(ALLOW)], 0) == ERRNO | 1


def test_jail_filter_stack(hostile_stack: Stack, clients: tuple[Api, Realtime]) -> None:
    """The seccomp filters a job's program really runs under, read from the kernel and run
    for every call number a behavioural probe cannot reach on this kernel: numbers past
    the reviewed ones get ENOSYS, the whole x32 range and every 32-bit call die, and the
    kafel policy below still decides the reviewed numbers."""
    assert f"#define REVIEWED_SYSCALL_MAX {REVIEWED_SYSCALL_MAX}\n" in (REPO_ROOT / "worker/isolation/gate.c").read_text()
    assert f"calls up to {REVIEWED_SYSCALL_MAX} (" in (REPO_ROOT / "sandbox-profiles/base.cfg").read_text()
    api, realtime = clients
    job = api.execute({"language": "bash", "files": [{"name": "main.sh", "content": "echo running; exec sleep 29.5\n"}],
                       "limits": LIMITS})  # fmt: skip
    followed = realtime.follow(job)
    api.start(job)
    deadline = time.monotonic() + 10
    while not (programs := _programs_of(hostile_stack, "sleep\x0029.5")):
        assert time.monotonic() < deadline, "the job's program never showed up"
        time.sleep(0.02)
    try:
        filters = installed_filters(next(iter(programs)))
    finally:
        api.post(f"/v1/jobs/{job['jobId']}/kill")
        followed.wait_result(timeout_s=20)

    def action(nr: int, **kw: Any) -> int:
        return verdict(filters, nr, **kw)

    # Reviewed numbers: kafel's policy decides (a sample of each kind).
    assert action(0) == action(1) == action(39) == ALLOW  # read, write, getpid
    assert action(101) == action(321) == action(467) == KILL_PROCESS  # ptrace, bpf, open_tree_attr
    assert action(41, args=(2,)) == ERRNO | 1 and action(41, args=(1,)) == ALLOW  # socket: AF_INET, AF_UNIX
    assert action(435) == ENOSYS  # clone3
    # What reaches past the jail into the host's caches and disks: told it worked, not done.
    assert action(162) == action(306) == ERRNO | 0  # sync, syncfs
    assert action(221, args=(3, 0, 0, 4)) == ERRNO | 0  # fadvise64 DONTNEED
    assert action(221, args=(3, 0, 0, 2)) == action(221, args=(3, 0, 0, 3)) == ALLOW  # SEQUENTIAL, WILLNEED
    assert action(28, args=(0, 4096, 20)) == action(28, args=(0, 4096, 21)) == ERRNO | 0  # madvise COLD, PAGEOUT
    assert action(28, args=(0, 4096, 4)) == action(28, args=(0, 4096, 8)) == ALLOW  # DONTNEED, FREE (malloc's)
    # Past the reviewed numbers, up to where x32's begin, and the negative ones.
    for nr in [*range(REVIEWED_SYSCALL_MAX + 1, 1024), 4096, 0x3FFFFFFF, 0x80000000, 0xFFFFFFFF]:
        assert action(nr) == ENOSYS, f"call {nr:#x}: {action(nr):#x}"
    # Every x32 call, whatever its x86-64 twin.
    for nr in [*(0x40000000 | n for n in range(0, 1024)), 0x7FFFFFFF]:
        assert action(nr) == KILL_PROCESS, f"x32 call {nr:#x}: {action(nr):#x}"
    # The 32-bit ABI, whatever the number.
    for nr in (0, 1, 20, 26, 102, 310):
        assert action(nr, arch=AUDIT_ARCH_I386) == KILL_PROCESS


def _cached_pages(path: str) -> tuple[int, int]:
    """(pages of the file in the page cache, pages it has): mincore on a mapping of it, which
    itself brings none in."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            pages = -(-size // mmap.PAGESIZE)
            vector = ctypes.create_string_buffer(pages)
            assert libc.mincore(addr, size, vector) == 0, os.strerror(ctypes.get_errno())
            return sum(byte & 1 for byte in vector.raw), pages
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def test_a_program_cannot_drop_the_shared_page_cache(hostile_stack: Stack, clients: tuple[Api, Realtime]) -> None:
    """Review: fadvise's DONTNEED on a toolchain file every job reads dropped its pages from
    the host's cache (other jobs then start cold, reading from disk), and sync reached the
    host's disks. The program is told both worked; the file stays cached."""
    shared = "/usr/lib/python3.11/turtle.py"  # (read, never mapped: the cache alone holds it)
    Path(shared).read_bytes()
    cached, pages = _cached_pages(shared)
    assert cached == pages > 10
    api, realtime = clients
    code = (
        f"import os\nfd = os.open({shared!r}, os.O_RDONLY)\nos.read(fd, 1 << 20)\n"
        "os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)\nimport ctypes\nassert ctypes.CDLL(None).syncfs(fd) == 0\n"
        "os.sync()\nprint('told it worked')\n"
    )
    job = api.execute({"language": "python", "files": [{"name": "main.py", "content": code}], "limits": LIMITS})
    followed = realtime.follow(job)
    api.start(job)
    result = followed.wait_result(timeout_s=60)
    assert (result["outcome"], followed.text("stdout")) == ("completed", "told it worked\n"), followed.summary()
    assert _cached_pages(shared) == (pages, pages)


EVIL_PROCESSOR_JAVA = """
import java.util.Set;
import javax.annotation.processing.*;
import javax.lang.model.SourceVersion;
import javax.lang.model.element.TypeElement;

@SupportedAnnotationTypes("*")
public class Evil extends AbstractProcessor {
    @Override public synchronized void init(ProcessingEnvironment env) {
        super.init(env);
        System.err.println("PROCESSOR RAN IN JAVAC");
    }
    @Override public boolean process(Set<? extends TypeElement> annotations, RoundEnvironment round) { return false; }
    @Override public SourceVersion getSupportedSourceVersion() { return SourceVersion.latest(); }
}
"""


def test_f4_javac_runs_no_submitted_annotation_processor(
    hostile_stack: Stack, clients: tuple[Api, Realtime], tmp_path: Path
) -> None:
    # A class file beside the source, named in META-INF/services: javac on its default class
    # path (the workspace) would load it and run it inside the compile.
    (tmp_path / "Evil.java").write_text(EVIL_PROCESSOR_JAVA)
    subprocess.run(["javac", "-d", str(tmp_path), str(tmp_path / "Evil.java")], check=True, capture_output=True)
    evil = base64.b64encode((tmp_path / "Evil.class").read_bytes()).decode()
    api, realtime = clients
    job = api.execute({
        "language": "java",
        "files": [
            {"name": "Main.java", "content": 'public class Main { public static void main(String[] a) { System.out.println("hi"); } }\n'},
            {"name": "Evil.class", "content": evil, "encoding": "base64"},
            {"name": "META-INF/services/javax.annotation.processing.Processor", "content": "Evil\n"},
        ],
        "collectOutput": True,
    })  # fmt: skip
    followed = realtime.follow(job)
    api.start(job)
    result = followed.wait_result(timeout_s=60)
    assert result["outcome"] == "completed", result
    assert "PROCESSOR RAN" not in (result.get("compile") or {}).get("output", ""), result["compile"]
    assert api.get(f"/v1/jobs/{job['jobId']}/output").json()["stdout"] == "hi\n"


def test_what_a_program_writes_or_names_reaches_the_service_logs_only_escaped(
    hostile_stack: Stack, clients: tuple[Api, Realtime]
) -> None:
    """C3/B8's other half: terminal sequences a program prints, and the files it names, may
    reach an operator's terminal through the worker's and the API's logs. None may arrive raw
    (an escape, a bidi override, a line break that forges a log line)."""
    api, realtime = clients
    for language, code in (("python", HOSTILE_NAMES_PY), ("python", f"import sys\nsys.stdout.write({CONTROL_SEQUENCES!r})\n")):
        job = api.execute({"language": language, "files": [{"name": "main.py", "content": code}], "limits": LIMITS})
        followed = realtime.follow(job)
        api.start(job)
        followed.wait_result(timeout_s=60)
    time.sleep(0.5)  # (the logs are written as it goes)
    for name in ("worker", "api"):
        text = hostile_stack.log(name)
        for raw in ("\x1b", "\u202e", "\x07", "owned"):
            assert raw not in text, f"{name} log holds {raw!r} raw: {text[text.index(raw) - 200 : text.index(raw) + 100]!r}"
