"""The hostile-program suite (SANDBOX.md §3): each program must end in its exact verdict,
and after each one the host invariants I1-I9 must hold.

Limits follow the catalogue's test profile so every clock is distinguishable:
wall 8 s, idle 4 s, CPU 2 s, 128 MiB, 32 pids (Java 64), 512 KiB of output.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from launcher.stack import Stack
from tests.helpers import Api, Followed, Realtime
from tests.invariants import HostWatch, check_result_shape, check_trivial_job

pytestmark = [pytest.mark.stack, pytest.mark.sandbox, pytest.mark.slow]

LIMITS = {"wallTimeMs": 8000, "idleMs": 4000, "cpuMs": 2000, "memoryMb": 128, "pids": 32, "outputKb": 512}
FILE = {"python": "main.py", "javascript": "main.js", "c": "main.c", "cpp": "main.cpp", "rust": "main.rs",
        "java": "Main.java", "bash": "main.sh", "go": "main.go", "ruby": "main.rb"}  # fmt: skip

Check = Callable[[dict[str, Any], Followed], None]


@dataclass
class Case:
    id: str
    language: str
    code: str
    check: Check
    stdin: str | None = None
    limits: dict[str, int] = field(default_factory=dict)
    # A harness action while the program runs (gets the stack and the followed job).
    during: Callable[[Stack, Followed], None] | None = None

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
        program = next(
            int(p.name) for p in Path("/proc").iterdir()
            if p.name.isdigit() and _cmdline(p).startswith(marker.encode())
        )  # fmt: skip
        gate = _ppid(program)
        nsjail = _ppid(gate)
        assert b"nsjail" in _cmdline(Path(f"/proc/{nsjail}")), _cmdline(Path(f"/proc/{nsjail}"))
        os.kill(nsjail, signal.SIGKILL)

    return act


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


def _ppid(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


# ---------------------------------------------------------------- the catalogue

D1_PY = r"""
import os
paths = ["/etc/shadow", "/etc/passwd", "/root/.ssh/id_rsa", "/proc/1/environ", "/proc/self/environ",
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
print("ENV", sorted(os.environ))
"""

D3_PY = r"""
import socket
for host, port in [("127.0.0.1", 6379), ("::1", 6379), ("169.254.169.254", 80), ("1.1.1.1", 443)]:
    try:
        socket.create_connection((host, port), timeout=2).close()
        print("CONNECTED", host, port)
    except OSError as e:
        print("blocked", host, port, e.errno)
try:
    print("DNS", socket.getaddrinfo("example.com", 443)[:1])
except OSError as e:
    print("dns blocked")
"""

D3_C = r"""
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
    int u = socket(AF_UNIX, SOCK_STREAM, 0);
    struct sockaddr_un a = { .sun_family = AF_UNIX };
    memcpy(a.sun_path, "\0probe", 6);
    printf("abstract %d\n", connect(u, (struct sockaddr *)&a, sizeof(sa_family_t) + 6));
    return 0;
}
"""

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
for name in ("RLIMIT_NOFILE", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_CORE"):
    k = getattr(r, name); soft, hard = r.getrlimit(k)
    try:
        r.setrlimit(k, (r.RLIM_INFINITY, r.RLIM_INFINITY)); print(name, "RAISED")
    except (ValueError, OSError):
        print(name, soft, hard, "refused")
"""

D5_C = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
static void probe(const char *name, long r) {
    printf("%s %ld %s\n", name, r, r < 0 ? strerror(errno) : "SUCCEEDED");
    fflush(stdout);
}
int main(void) {
    probe("io_uring_setup", syscall(425, 8, NULL));
    probe("shmget", syscall(SYS_shmget, 0, 4096, 01000 | 0600));
    probe("msgget", syscall(SYS_msgget, 0, 01000 | 0600));
    probe("bpf", syscall(SYS_bpf, 0, NULL, 0));
    probe("never", 0);
    return 0;
}
"""

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

MACRO_BOMB = "\n".join(
    ["#define D0(x) x x"] + [f"#define D{i}(x) D{i - 1}(D{i - 1}(x))" for i in range(1, 6)] + ["int main(void) { D5(;) return 0; }"]
)

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

CASES = [
    # ---- A. CPU, time, process table
    Case("A1-bash-fork-bomb", "bash", "b(){ b | b & }; b; sleep 30\n",
         both(expect(outcome="timed_out", timedOut=True, idleTimedOut=False))),
    Case("A1-c-zombie-farm", "c", ZOMBIES_C,
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: 20 <= int(o["stdout"].split("=")[1]) <= 32, "pids capped near 31 children"))),
    Case("A3-rust-threads-spin", "rust", RUST_SPIN,
         both(expect(outcome="timed_out", timedOut=True, signal="SIGKILL", killedBy="cpu"),
              where(lambda o: 1900 <= o["cpuMs"] <= 2600, "CPU clock at ~2 s of CPU, not xN"),
              where(lambda o: o["durationMs"] < 4000, "one core: wall close to CPU"))),
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
              where(lambda o: o["memoryKb"] > 100 * 1024, "peak near the limit"))),
    Case("B1-c-untouched-malloc", "c", BALLOON_C.replace("TOUCH", "0"),
         both(expect(outcome="completed", exitCode=0, stdout="malloc ok\n"))),
    Case("B1-c-touched-malloc", "c", BALLOON_C.replace("TOUCH", "1"),
         both(expect(outcome="memory_exceeded", signal="SIGKILL"))),
    Case("B2-node-v8-heap", "javascript", "const k = []; for (;;) k.push(new Array(1 << 20).fill(1.5));\n",
         both(where(lambda o: o["outcome"] in ("completed", "memory_exceeded") and o["signal"] in ("SIGABRT", "SIGKILL")
                    and not o["timedOut"], "V8 or the cgroup ends it as a memory failure"))),
    Case("B2-node-off-heap", "javascript", "const k = []; for (;;) k.push(Buffer.alloc(16 << 20, 1));\n",
         both(expect(outcome="memory_exceeded", signal="SIGKILL"))),
    Case("B3-java-heap", "java", JAVA_HEAP,
         both(expect(outcome="completed", exitCode=1),
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
    Case("B6-python-fd-exhaustion", "python",
         'fds = []\ntry:\n    while True:\n        fds.append(open("/dev/null"))\nexcept OSError as e:\n    print(len(fds), e.errno)\n',
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: o["stdout"].split()[1] == "24" and 50 <= int(o["stdout"].split()[0]) <= 64, "EMFILE near 64"))),
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
              where(lambda o: "CONNECTED" not in o["stdout"] and "dns blocked" in o["stdout"], "no network at all"))),
    Case("D3-c-socket-families", "c", D3_C,
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: all(line.endswith(" -1") for line in o["stdout"].splitlines()), "every family refused"))),
    Case("D4-c-privilege", "c", D4_C,
         both(expect(outcome="completed"),
              where(lambda o: o["stdout"].startswith("uid=65534 euid=65534 nnp=1\nsetuid(0)=-1 setgid(0)=-1\n"), "unprivileged, no new privs"),
              where(lambda o: all(line.split()[1] == "0000000000000000" for line in o["stdout"].splitlines() if line.startswith("Cap") and not line.startswith("CapBnd")), "no capabilities"))),
    Case("D4-python-rlimits", "python", D4_PY,
         both(expect(outcome="completed", exitCode=0),
              where(lambda o: "RAISED" not in o["stdout"] and o["stdout"].count("refused") == 4, "finite limits cannot be raised"))),
    Case("D5-c-kernel-surfaces", "c", D5_C,
         both(expect(outcome="completed", signal="SIGSYS"),
              where(lambda o: o["stdout"].splitlines()[:3] == ["io_uring_setup -1 Operation not permitted",
                    "shmget -1 Operation not permitted", "msgget -1 Operation not permitted"], "ERRNO-listed calls refused"),
              where(lambda o: "bpf" not in o["stdout"] and "never" not in o["stdout"] and "SUCCEEDED" not in o["stdout"], "bpf kills"))),
    Case("D6-c-namespaces-and-mounts", "c", D6_C,
         both(expect(outcome="completed", signal="SIGSYS", stdout="unshare -1\n"))),
    Case("D7-c-32bit-syscall-abi", "c",
         "#include <stdio.h>\nint main(void) { long r;\n"
         "  __asm__ volatile (\"int $0x80\" : \"=a\"(r) : \"a\"(20) : \"memory\");\n"
         "  printf(\"int80 %ld\\n\", r); return 0; }\n",
         # A 32-bit system call would dodge a filter written for x86-64 numbers; the
         # filter's architecture check kills it instead.
         both(expect(outcome="completed", signal="SIGSYS", stdout=""))),
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
    Case("F2-rust-include-host-files", "rust",
         'const SHADOW: &[u8] = include_bytes!("/etc/shadow");\nfn main() { println!("{}", SHADOW.len()); }\n',
         both(compile_failed)),
    Case("F3-c-macro-bomb", "c", MACRO_BOMB, both(compile_failed)),
    Case("F3-cpp-template-bomb", "cpp", TEMPLATE_BOMB, both(compile_failed)),
    Case("F4-cpp-diagnostic-flood", "cpp", DIAG_FLOOD,
         both(compile_failed, where(lambda o: o["compile"]["exitCode"] not in (0, None), "compiler said no"))),
    Case("F6-java-parser-bomb", "java",
         "public class Main { static int x = " + "(" * 50000 + "1" + ")" * 50000 + "; public static void main(String[] a) {} }\n",
         both(compile_failed)),
    Case("F1-c-include-dev-urandom", "c", '#include "/dev/urandom"\nint main(void) { return 0; }\n',
         both(compile_failed)),
    Case("F5-c-giant-object-file", "c", "char big[1 << 30] = {1};\nint main(int argc, char **argv) { return big[argc * 4096]; }\n",
         both(compile_failed)),
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
    # ---- G. supervisor faults
    Case("G2-nsjail-killed-mid-run", "bash", "echo running; sleep 100000 & while :; do :; done\n",
         both(where(lambda o: o["outcome"] in ("internal_error", "killed") and o["durationMs"] < 5000, "ends cleanly, no hang"))),
]
CASES[-1].during = _kill_nsjail_of("/bin/bash\0main.sh")


@pytest.fixture(scope="module")
def hostile_stack() -> Iterator[Stack]:
    stack = Stack(extra_env={"WORKER_MAX_SANDBOXES": "2", "LOG_LEVEL": "INFO"})
    stack.start()
    try:
        yield stack
    finally:
        stack.cleanup()


@pytest.fixture(scope="module")
def watch(hostile_stack: Stack, tmp_path_factory: pytest.TempPathFactory) -> HostWatch:
    return HostWatch(hostile_stack, tmp_path_factory.mktemp("canaries"))


@pytest.fixture(scope="module")
def clients(hostile_stack: Stack) -> Iterator[tuple[Api, Realtime]]:
    api, realtime = Api(hostile_stack), Realtime(hostile_stack)
    yield api, realtime
    realtime.close()
    api.close()


def test_catalogue_is_large_enough() -> None:
    assert len(CASES) >= 25
    assert len({c.language for c in CASES}) >= 6


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_hostile_program(case: Case, hostile_stack: Stack, watch: HostWatch, clients: tuple[Api, Realtime]) -> None:
    api, realtime = clients
    base = watch.baseline()
    limits = {**LIMITS, **case.limits}
    body: dict[str, Any] = {
        "language": case.language,
        "files": [{"name": FILE[case.language], "content": case.code}],
        "limits": limits,
        "collectOutput": True,
    }
    if case.stdin is not None:
        body["stdin"] = case.stdin
    job = api.execute(body)
    followed = realtime.follow(job)
    api.start(job)
    if case.during is not None:
        case.during(hostile_stack, followed)
    followed.wait_result(timeout_s=60)
    response = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "5000"})
    assert response.status_code == 200, response.text
    out = response.json()
    check_result_shape(out, limits["wallTimeMs"])
    case.check(out, followed)
    watch.settle(base)
    check_trivial_job(api, realtime)
