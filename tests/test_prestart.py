"""Prestarted runtimes: a warm jail holds the language's interpreter already started, and
on start runs the job's entry file exactly as the language's plain `run` command would.

Every comparison runs the same program on a stack with prestart (the default) and on one
with WORKER_PRESTART=off, and checks through /proc/self/cmdline that the first really
ran in a prestarted runtime and the second did not, so none of these can pass by the
prestart quietly not happening. (The hostile suite's Python cases also run prestarted,
since jobs with default limits adopt the waiting runtime.)
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import statistics
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from launcher.stack import Stack
from tests.helpers import Api, compiled_shims, py_job

pytestmark = pytest.mark.slow

SHIM = "/.coderunner/prestart/"
# Java's shim is compiled at start-up and started by its class name, from the workspace.
JAVA_SHIM = compiled_shims()["java"]

PY_PROBE = r"""
import os, sys, resource
print("argv", sys.argv)
print("orig_argv", sys.orig_argv)
print("path", sys.path[0], len(sys.path))
print("main", __file__, __name__, __spec__, type(__loader__).__name__, __package__, __doc__,
      sys.modules["__main__"] is sys.modules[__name__])
print("globals", sorted(globals()))
print("flags", sys.flags)
print("cwd", os.getcwd())
print("env", sorted(os.environ.items()))
print("rlimits", [resource.getrlimit(r) for r in (resource.RLIMIT_CPU, resource.RLIMIT_FSIZE, resource.RLIMIT_NOFILE)])
print("fds", sorted(os.listdir("/proc/self/fd")))
print("stdin", repr(sys.stdin.readline()), sys.stdout.write_through, sys.stdin.encoding)
print("cmdline", open("/proc/self/cmdline", "rb").read())
def fail():
    raise ValueError("boom")
fail()
"""

JS_PROBE = r"""
const fs = require('fs');
console.log('argv', JSON.stringify(process.argv.slice(1)), JSON.stringify(process.execArgv));
console.log('main', require.main === module, __filename, module.id, JSON.stringify(module.paths));
console.log('cwd', process.cwd());
console.log('env', JSON.stringify(Object.entries(process.env).sort()));
console.log('cmdline', JSON.stringify(fs.readFileSync('/proc/self/cmdline', 'latin1')));
process.stdin.once('data', (d) => {
  console.log('stdin', JSON.stringify(String(d)));
  (function fail() { throw new TypeError('boom'); })();
});
"""


RB_PROBE = r"""# frozen_string_literal: true
p ARGV, $0, __FILE__, __dir__, __FILE__ == $0, ENV.to_h.sort, Process.getrlimit(:FSIZE), Process.getrlimit(:NOFILE)
p local_variables, self.to_s, DATA.read, "lit".frozen?
p $stdin.gets
File.readlines("/proc/self/mountinfo").grep(/prestart/).each { |line| puts "mount #{line.split[4]}" }
def fail_now = raise(ArgumentError, "boom")
fail_now
__END__
the data
"""


def run(api: Api, body: dict[str, Any]) -> dict[str, Any]:
    job = api.execute({**body, "collectOutput": True})
    api.start(job)
    out = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "20000"}).json()
    assert out.get("outcome"), out
    return out


def prestarted(out: dict[str, Any]) -> bool:
    return SHIM in out["stdout"] or f" {JAVA_SHIM}" in out["stdout"]


def without_cmdline(out: dict[str, Any]) -> str:
    return "".join(line for line in out["stdout"].splitlines(keepends=True) if not line.startswith("cmdline"))


def without_mounts(out: dict[str, Any]) -> str:
    return "".join(line for line in out["stdout"].splitlines(keepends=True) if not line.startswith("mount "))


def js_job(code: str, **extra: Any) -> dict[str, Any]:
    return {"language": "javascript", "files": [{"name": "main.js", "content": code}], **extra}


@pytest.fixture(scope="module")
def stacks() -> Iterator[tuple[Api, Api]]:
    """A stack with prestart (the default) and one with WORKER_PRESTART=off."""
    built = [Stack(extra_env={"WORKER_MAX_SANDBOXES": "2", **env}) for env in ({}, {"WORKER_PRESTART": "off"})]
    try:
        for stack in built:
            stack.start()
        apis = Api(built[0]), Api(built[1])
        yield apis
        for api in apis:
            api.close()
    finally:
        for stack in built:
            stack.cleanup()


def until_prestarted(api: Api, body: dict[str, Any], tries: int = 6) -> dict[str, Any]:
    """Run `body` until it lands in a prestarted runtime (a slot primes for the language of
    its last job, so the first job of a new language may get a plain jail)."""
    for _ in range(tries):
        out = run(api, body)
        if prestarted(out):
            return out
    raise AssertionError(f"never ran prestarted: {out}")


def test_python_runs_as_the_plain_command_would(stacks: tuple[Api, Api]) -> None:
    warm, plain = stacks
    body = py_job(PY_PROBE, args=["a b", "--x"], stdin="first line\nsecond\n")
    fast = until_prestarted(warm, body)
    slow = run(plain, body)
    assert not prestarted(slow), slow["stdout"]
    assert without_cmdline(fast) == without_cmdline(slow)
    assert fast["stderr"] == slow["stderr"]
    assert fast["stderr"].startswith('Traceback (most recent call last):\n  File "/workspace/main.py"'), fast["stderr"]
    assert (fast["outcome"], fast["exitCode"]) == (slow["outcome"], slow["exitCode"]) == ("completed", 1)


PY_MEMORY = r"""
print("cmdline", open("/proc/self/cmdline", "rb").read())
held = []
for n in range(1, 65):
    held.append(b"\x01" * (1 << 20))
    print("held", n, flush=True)
"""


def in_a_plain_jail(warm: Api, body: dict[str, Any], burst: int = 6) -> list[dict[str, Any]]:
    """Run `body` on the prestarting stack until it lands in a plain jail: a worker whose
    started jobs wait side by side builds plain sandboxes for them (pool.py, _prime_now).
    Every run of the burst that did, at least one."""
    for _ in range(4):
        with concurrent.futures.ThreadPoolExecutor(burst) as pool:
            clients = [Api(warm.stack) for _ in range(burst)]
            outs = list(pool.map(lambda api: run(api, body), clients))
            for api in clients:
                api.close()
        plain = [out for out in outs if not prestarted(out)]
        if plain:
            return plain
    raise AssertionError("never ran in a plain jail")


def test_a_job_is_charged_alike_in_a_prestarted_or_a_plain_jail(stacks: tuple[Api, Api]) -> None:
    """Review: the same worker gives a Python job with memoryMb 32 room for 31-32 MiB of its
    own in a prestarted jail (its runtime's start-up not charged) and 27 in a plain one (a
    saturated worker builds those), so a program near its limit passed or failed by the
    pool's load; a trivial job's cpuMs was ~1 ms or ~13. A plain jail now leaves out what
    the language's prestarted runtimes measured their start-up at."""
    warm, _ = stacks
    memory = py_job(PY_MEMORY, limits={"memoryMb": 32})
    trivial = py_job("print('cmdline', open('/proc/self/cmdline', 'rb').read())")
    # (Prestarted first: after a burst, the worker builds plain for a second or so.)
    fast = {"memory": until_prestarted(warm, memory), "trivial": until_prestarted(warm, trivial)}
    # A burst's plain runs share two cores six ways, which adds to the CPU a runtime's
    # start-up takes beyond what it measured alone: the least charged of them is compared.
    slow = {
        "memory": in_a_plain_jail(warm, memory)[0],
        "trivial": min(in_a_plain_jail(warm, trivial), key=lambda out: out["cpuMs"]),
    }
    held = []
    for out in (fast["memory"], slow["memory"]):
        assert out["outcome"] == "memory_exceeded", out
        held.append(int(re.findall(r"^held (\d+)$", out["stdout"], re.M)[-1]))
    assert abs(held[0] - held[1]) <= 1, f"MiB held prestarted, plain: {held}"
    fast, slow = fast["trivial"], slow["trivial"]
    assert slow["cpuMs"] <= fast["cpuMs"] + 5, (fast["cpuMs"], slow["cpuMs"])
    assert slow["memoryKb"] <= fast["memoryKb"] + 1024, (fast["memoryKb"], slow["memoryKb"])


@pytest.mark.parametrize(
    "code",
    [
        "import sys\nsys.exit('bye')\n",
        "raise SystemExit(3)\n",
        "def broken(:\n",
        "import atexit, threading, time\natexit.register(print, 'at exit')\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n",
        "import pickle\nclass A: pass\nprint(len(pickle.dumps(A())) > 0)\n",
        "from __future__ import annotations\nx: int = 1\nprint(__annotations__)\n",
        "raise KeyboardInterrupt\n",
        "import atexit, threading, time\natexit.register(print, 'at exit')\n"
        "threading.Thread(target=lambda: (time.sleep(0.2), print('thread'))).start()\n"
        "class A:\n    def __del__(self): print('finalized')\na = A()\nraise KeyboardInterrupt\n",
        "import atexit, sys\n"
        "atexit.register(lambda: print(sys.last_type, sys.last_value, sys.last_traceback.tb_frame.f_code.co_filename))\n"
        "def fail(): raise ValueError('boom')\nfail()\n",
        "import sys\ndef hook(*exc): raise RuntimeError('the hook broke')\nsys.excepthook = hook\nraise ValueError('boom')\n",
        "import sys\nsys.excepthook = lambda *exc: print('hooked', exc[0].__name__, exc[2].tb_frame.f_code.co_filename)\n"
        "raise ValueError('boom')\n",
        "x = 1\nprint(x)\x00\n",
        "if 1:\n    x\x00 = 1\n",
    ],
    ids=[
        "exit-message",
        "exit-3",
        "syntax-error",
        "atexit-and-threads",
        "pickle-main",
        "future-import",
        "sigint",
        "sigint-after-shutdown",
        "sys-last-vars",
        "excepthook-raises",
        "excepthook-own",
        "nul-byte",
        "nul-byte-mid-line",
    ],
)
def test_python_exit_paths_match(stacks: tuple[Api, Api], code: str) -> None:
    warm, plain = stacks
    fast, slow = run(warm, py_job(code)), run(plain, py_job(code))
    for key in ("outcome", "exitCode", "signal", "stdout", "stderr"):
        assert fast.get(key) == slow.get(key), (key, fast, slow)


PY_DEPTH = r"""
def down(n):
    try:
        return down(n + 1)
    except RecursionError:
        return n
print("depth", down(0))
print("cmdline", open("/proc/self/cmdline", "rb").read())
"""


def test_python_recursion_room_is_nearly_a_plain_runs(stacks: tuple[Api, Api]) -> None:
    """The program runs from the shim's module frame through exec(): two calls below its
    own, where a plain run has none (three before, with a function of the shim's between)."""
    warm, plain = stacks
    fast, slow = until_prestarted(warm, py_job(PY_DEPTH)), run(plain, py_job(PY_DEPTH))
    assert not prestarted(slow), slow["stdout"]
    depth = [int(re.search(r"depth (\d+)", out["stdout"]).group(1)) for out in (fast, slow)]  # type: ignore[union-attr]
    assert depth[1] - 2 <= depth[0] <= depth[1], depth


PY_USER_SITE = r"""
import sys, usermod
print("cmdline", open("/proc/self/cmdline", "rb").read())
print(usermod.VALUE, [entry for entry in sys.path if "/workspace" in entry], sys.path.index(sys.path[-1]) == len(sys.path) - 1)
print(sys.path)
"""


def test_python_finds_the_jobs_user_site_packages(stacks: tuple[Api, Api]) -> None:
    """A job that brings ~/.local/lib/pythonX.Y/site-packages (HOME is the workspace) has it
    on sys.path where `python3 main.py` puts it, its .pth files read, though the waiting
    runtime's `site` ran before the job's files were there."""
    warm, plain = stacks
    version = subprocess.run(
        ["/usr/bin/python3", "-c", "import sys; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    site = f".local/lib/python{version}/site-packages"
    body = {
        "language": "python",
        "files": [
            {"name": "main.py", "content": PY_USER_SITE},
            {"name": f"{site}/usermod.py", "content": "VALUE = 'from the user site'\n"},
            {"name": f"{site}/extra.pth", "content": "/workspace/extra\n"},
            {"name": "extra/keep.txt", "content": "a folder for the .pth line\n"},
        ],
    }
    fast = until_prestarted(warm, body)
    slow = run(plain, body)
    assert not prestarted(slow), slow["stdout"]
    assert without_cmdline(fast) == without_cmdline(slow)
    assert "from the user site" in fast["stdout"] and "/workspace/extra" in fast["stdout"], fast["stdout"]
    assert fast["stderr"] == slow["stderr"] == "", fast["stderr"]


PY_FINALIZERS = r"""
import io, os, sys
class A:
    def __init__(self, name): self.name = name
    def __del__(self, write=os.write): write(1, f"del {self.name}\n".encode())
g = A("garbage"); g.me = g; del g
live = A("live cycle"); live.me = live
kept = A("global")
sys.kept = A("on sys")
io.kept = A("on io, in a cycle with it"); io.kept.io = io
print("cmdline", open("/proc/self/cmdline", "rb").read())
"""


def test_python_finalizers_run_at_exit_as_in_a_plain_run(stacks: tuple[Api, Api]) -> None:
    """The waiting runtime freezes its own objects out of the cyclic collector (its exit is
    then faster); the job's objects must still be finalized at exit as in a plain run,
    wherever they hang: in a cycle, in __main__, or on a module the runtime had loaded."""
    warm, plain = stacks
    fast = until_prestarted(warm, py_job(PY_FINALIZERS))
    slow = run(plain, py_job(PY_FINALIZERS))
    assert not prestarted(slow), slow["stdout"]
    assert without_cmdline(fast) == without_cmdline(slow)
    assert sorted(without_cmdline(fast).splitlines()) == [
        "del garbage", "del global", "del live cycle", "del on io, in a cycle with it", "del on sys"
    ], fast["stdout"]  # fmt: skip
    assert fast["stderr"] == slow["stderr"] == ""


def test_node_runs_as_the_plain_command_would(stacks: tuple[Api, Api]) -> None:
    warm, plain = stacks
    body = js_job(JS_PROBE, args=["a b", "--x"], stdin="first line\n")
    fast = until_prestarted(warm, body)
    slow = run(plain, body)
    assert not prestarted(slow), slow["stdout"]
    assert without_cmdline(fast) == without_cmdline(slow)
    # Node's report of the uncaught error: the same up to the user's own frames.
    user = [line for line in fast["stderr"].splitlines() if "node:internal" not in line and "prestart" not in line]
    plain_user = [line for line in slow["stderr"].splitlines() if "node:internal" not in line]
    assert user == plain_user, (fast["stderr"], slow["stderr"])
    assert "/workspace/main.js" in fast["stderr"].splitlines()[0]
    assert (fast["outcome"], fast["exitCode"]) == (slow["outcome"], slow["exitCode"]) == ("completed", 1)


JS_CMDLINE = "console.log('cmdline', JSON.stringify(require('fs').readFileSync('/proc/self/cmdline', 'latin1')));\n"


def without_bottom_frame(stderr: str) -> str:
    """Node's report without its last stack frame: Node's main-module runner in a plain run,
    its tick processor in a prestarted one (the shim hands the entry over from a tick)."""
    return re.sub(r"\n    at [^\n]*\n\nNode\.js ", "\n\nNode.js ", stderr)


@pytest.mark.parametrize(
    "code",
    [
        "throw new Error('top');\n",
        "function fail() { throw new TypeError('in a function'); }\nfail();\n",
        "async function fail() { throw new RangeError('rejected'); }\nfail();\n",
        "const e = new Error('kept');\nconsole.log(e.stack.split('\\n').length);\nthrow e;\n",
    ],
    ids=["top-level", "function", "unhandled-rejection", "stack-length"],
)
def test_node_uncaught_reports_show_no_shim_frames(stacks: tuple[Api, Api], code: str) -> None:
    """Node's report of an uncaught error or rejection is the plain run's, frame for frame:
    the shim's own frames (and the loader frames that ran the shim) are not below the
    program's. The one difference left is the name of Node's bottom frame."""
    warm, plain = stacks
    body = js_job(JS_CMDLINE + code)
    fast = until_prestarted(warm, body)
    slow = run(plain, body)
    assert not prestarted(slow), slow["stdout"]
    assert without_cmdline(fast) == without_cmdline(slow)
    assert "prestart" not in fast["stderr"], fast["stderr"]
    assert fast["stderr"].count("\n    at ") == slow["stderr"].count("\n    at "), (fast["stderr"], slow["stderr"])
    assert without_bottom_frame(fast["stderr"]) == without_bottom_frame(slow["stderr"]), (fast["stderr"], slow["stderr"])
    assert (fast["outcome"], fast["exitCode"]) == (slow["outcome"], slow["exitCode"]) == ("completed", 1)


JS_ORDER = JS_CMDLINE + r"""
process.nextTick(() => console.log('tick'));
Promise.resolve().then(() => console.log('promise'));
setImmediate(() => console.log('immediate'));
console.log('sync', require.main === module, module.id);
"""


def test_node_top_level_queues_run_in_the_plain_order(stacks: tuple[Api, Api]) -> None:
    """The entry runs from a tick: what its top level queues still runs in the plain order."""
    warm, plain = stacks
    fast, slow = until_prestarted(warm, js_job(JS_ORDER)), run(plain, js_job(JS_ORDER))
    assert not prestarted(slow), slow["stdout"]
    assert without_cmdline(fast) == without_cmdline(slow) == "sync true .\ntick\npromise\nimmediate\n"
    assert fast["stderr"] == slow["stderr"] == ""


def test_ruby_runs_as_the_plain_command_would(stacks: tuple[Api, Api]) -> None:
    warm, plain = stacks
    body = {"language": "ruby", "files": [{"name": "main.rb", "content": RB_PROBE}], "args": ["a b"], "stdin": "line\n"}
    fast = until_prestarted(warm, body)
    slow = run(plain, body)
    assert not prestarted(slow), slow["stdout"]
    # $0= rewrites Ruby's command line, so the mount of the shim is what shows it prestarted.
    assert without_mounts(fast) == without_mounts(slow)
    assert fast["stderr"] == slow["stderr"] and fast["stderr"].startswith("main.rb:6:in `fail_now'"), fast["stderr"]
    assert (fast["outcome"], fast["exitCode"]) == (slow["outcome"], slow["exitCode"]) == ("completed", 1)


RB_MOUNTS = 'File.readlines("/proc/self/mountinfo").grep(/prestart/).each { |line| puts "mount #{line.split[4]}" }\n'

RB_DATA_AND_CAUSES = RB_MOUNTS + r"""text = <<~T
__END__
T
=begin
__END__
=end
p text, Process.argv0
p DATA.class, DATA.external_encoding, DATA.pos, DATA.read, DATA.path
DATA.rewind
p DATA.read.lines.first
def inner = raise(ArgumentError, "inner")
def outer
  inner
rescue ArgumentError
  raise "wrap"
end
[1].each { [2].each { outer } }
__END__
the data
"""

RB_END_IN_A_HEREDOC = RB_MOUNTS + r"""text = <<~T
  before
__END__
  after
T
puts text
begin
  raise "in a rescue"
rescue
  [1].each { raise "again" }
end
"""


RB_DATA_IN_THE_SOURCE_ENCODING = "# encoding: ascii-8bit\n" + RB_MOUNTS + """p DATA.external_encoding, DATA.read
raise "done"
__END__
caf\u00e9
"""


@pytest.mark.parametrize(
    "code",
    [RB_DATA_AND_CAUSES, RB_END_IN_A_HEREDOC, RB_DATA_IN_THE_SOURCE_ENCODING],
    ids=["data-and-causes", "end-in-a-heredoc", "data-encoding"],
)
def test_ruby_blocks_causes_and_data_as_in_a_plain_run(stacks: tuple[Api, Api], code: str) -> None:
    """Backtraces of blocks and rescues say <main> and those of causes hold no shim frame,
    DATA is the script's own File past the __END__ the parser stopped at (not one in a
    heredoc or a =begin block), and Process.argv0 is the entry."""
    warm, plain = stacks
    body = {"language": "ruby", "files": [{"name": "main.rb", "content": code}]}
    fast = until_prestarted(warm, body)
    slow = run(plain, body)
    assert not prestarted(slow), slow["stdout"]
    assert without_mounts(fast) == without_mounts(slow)
    assert fast["stderr"] == slow["stderr"], (fast["stderr"], slow["stderr"])
    assert "<main>" in fast["stderr"] and "prestart" not in fast["stderr"], fast["stderr"]
    assert (fast["outcome"], fast["exitCode"]) == (slow["outcome"], slow["exitCode"]) == ("completed", 1)


JAVA_PROBE = r"""
import java.nio.file.*;
import java.util.*;
public class Main {
    public static void main(String[] args) throws Exception {
        System.out.println("args " + Arrays.toString(args) + " thread " + Thread.currentThread().getName());
        System.out.println("loader " + Main.class.getClassLoader().getName() + " cp " + System.getProperty("java.class.path"));
        System.out.println("env " + new TreeMap<>(System.getenv()));
        System.out.println("dir " + System.getProperty("user.dir") + " heap " + Runtime.getRuntime().maxMemory());
        System.out.println("stdin " + new Scanner(System.in).nextLine());
        System.out.println("cmdline " + new String(Files.readAllBytes(Path.of("/proc/self/cmdline"))).replace('\0', ' '));
        helper();
    }
    static void helper() { throw new IllegalStateException("boom"); }
}
"""


def test_java_runs_as_the_plain_command_would(stacks: tuple[Api, Api]) -> None:
    warm, plain = stacks
    body = {"language": "java", "files": [{"name": "Main.java", "content": JAVA_PROBE}], "args": ["a b"], "stdin": "line\n"}
    fast = until_prestarted(warm, body, tries=8)
    slow = run(plain, body)
    assert not prestarted(slow), slow["stdout"]
    assert without_cmdline(fast) == without_cmdline(slow)
    assert fast["stderr"] == slow["stderr"], (fast["stderr"], slow["stderr"])
    assert fast["stderr"].startswith('Exception in thread "main" java.lang.IllegalStateException: boom\n\tat Main.helper')
    assert (fast["outcome"], fast["exitCode"]) == (slow["outcome"], slow["exitCode"]) == ("completed", 1)
    assert fast["cpuMs"] < slow["cpuMs"], (fast["cpuMs"], slow["cpuMs"])


JAVA_CMDLINE = (
    'try { System.out.println("cmdline " + new String(java.nio.file.Files.readAllBytes(java.nio.file.Path.of("/proc/self/cmdline")))'
    ".replace('\\0', ' ')); } catch (java.io.IOException e) { throw new java.io.UncheckedIOException(e); }"
)

JAVA_STATIC_INIT_FAILS = """
public class Main {
    static { CMDLINE }
    static int x = 1 / Integer.parseInt("0");
    public static void main(String[] args) { System.out.println(x); }
}
""".replace("CMDLINE", JAVA_CMDLINE)

JAVA_WRAPPED = """
public class Main {
    static void inner() { throw new IllegalStateException("inner"); }
    public static void main(String[] args) {
        CMDLINE
        try { inner(); } catch (IllegalStateException e) { throw new RuntimeException("wrap", e); }
    }
}
""".replace("CMDLINE", JAVA_CMDLINE)


@pytest.mark.parametrize("code", [JAVA_STATIC_INIT_FAILS, JAVA_WRAPPED], ids=["static-initializer", "caused-by"])
def test_java_traces_hold_no_call_of_the_shim(stacks: tuple[Api, Api], code: str) -> None:
    """A failing static initializer and a wrapped exception's "Caused by:" print as in a
    plain run: no reflection frame or shim frame, and "... 1 more" where plain says so."""
    warm, plain = stacks
    body = {"language": "java", "files": [{"name": "Main.java", "content": code}]}
    fast = until_prestarted(warm, body, tries=8)
    slow = run(plain, body)
    assert not prestarted(slow), slow["stdout"]
    assert without_cmdline(fast) == without_cmdline(slow)
    assert fast["stderr"] == slow["stderr"], (fast["stderr"], slow["stderr"])
    assert "reflect" not in fast["stderr"] and JAVA_SHIM not in fast["stderr"], fast["stderr"]
    assert (fast["outcome"], fast["exitCode"]) == (slow["outcome"], slow["exitCode"]) == ("completed", 1)


@pytest.mark.parametrize(
    "main",
    ["public void main(String[] args) {}", "public static int main(String[] args) { return 0; }"],
    ids=["not-static", "not-void"],
)
def test_java_launcher_words_for_a_wrong_main(stacks: tuple[Api, Api], main: str) -> None:
    """The launcher's own message for a main that is not static or not void. Such a program
    prints nothing, so a prestarted run shows by its memory figure: what it added to the
    waiting VM (a few KiB) against a whole VM's."""
    warm, plain = stacks
    body = {"language": "java", "files": [{"name": "Main.java", "content": f"public class Main {{ {main} }}\n"}]}
    slow = run(plain, body)
    assert slow["memoryKb"] > 16 * 1024, slow
    for _ in range(8):
        fast = run(warm, body)
        if fast["memoryKb"] < 4 * 1024:
            break
    else:
        raise AssertionError(f"never ran prestarted: {fast}")
    for key in ("outcome", "exitCode", "stdout", "stderr"):
        assert fast.get(key) == slow.get(key), (key, fast, slow)
    assert slow["stderr"].startswith("Error: Main method "), slow["stderr"]


JAVA_SPIN = r"""
import java.nio.file.*;
public class Main {
    public static void main(String[] args) throws Exception {
        System.out.println("cmdline " + new String(Files.readAllBytes(Path.of("/proc/self/cmdline"))).replace('\0', ' '));
        System.out.flush();
        long x = 0;
        while (true) { x++; }
    }
}
"""


def test_a_prestarted_vm_times_out_on_its_cpu_clock_not_its_startup(stacks: tuple[Api, Api]) -> None:
    """A busy Java job ends on its CPU clock, warm or not ("timed_out", not "completed" by
    a SIGKILL). RLIMIT_CPU counts a process's CPU from its own start, and a warm VM once
    spent over a second starting (its shim compiled in source-file mode): the rlimit then
    fired first. test_worker_units covers the rlimit itself with a runtime that has spent
    its second."""
    warm, plain = stacks
    body = {"language": "java", "files": [{"name": "Main.java", "content": JAVA_SPIN}],
            "limits": {"cpuMs": 2000, "wallTimeMs": 20000}}  # fmt: skip
    for api, want_prestarted in ((warm, True), (plain, False)):
        out = until_prestarted(api, body, tries=8) if want_prestarted else run(api, body)
        assert prestarted(out) == want_prestarted, out["stdout"]
        assert (out["outcome"], out.get("killedBy"), out["signal"]) == ("timed_out", "cpu", "SIGKILL"), out
        assert out["cpuMs"] >= 2000, out


JAVA_STARTUP = r"""
import java.nio.file.*;
public class Main {
    public static void main(String[] args) throws Exception {
        String stat = Files.readString(Path.of("/proc/self/stat"));
        String[] f = stat.substring(stat.lastIndexOf(')') + 2).split(" ");
        System.out.println("ticks " + (Long.parseLong(f[11]) + Long.parseLong(f[12])));
        System.out.println("cmdline " + new String(Files.readAllBytes(Path.of("/proc/self/cmdline"))).replace('\0', ' '));
    }
}
"""


def test_a_warm_vm_started_on_a_compiled_shim(stacks: tuple[Api, Api]) -> None:
    """The JVM's shim is compiled once at worker start-up: a warm VM's start-up costs about
    what a plain VM's does (in the JDK's source-file mode it ran javac first, over a second
    of CPU), and the workspace holds only the job's own files."""
    warm, _ = stacks
    body = {"language": "java", "files": [{"name": "Main.java", "content": JAVA_STARTUP}]}
    out = until_prestarted(warm, body, tries=8)
    assert f"-cp . {JAVA_SHIM}" in out["stdout"], out["stdout"]
    ticks = int(re.search(r"ticks (\d+)", out["stdout"]).group(1))  # type: ignore[union-attr]
    assert ticks * 1000 // os.sysconf("SC_CLK_TCK") < 500, out["stdout"]
    # The shim's class left the workspace before the job's files went in.
    java_dir = {"language": "java", "files": [{"name": "Main.java", "content": JAVA_STARTUP.replace(
        'System.out.println("ticks "', 'System.out.println("files " + java.util.Arrays.toString(new java.io.File(".").list()));\n        System.out.println("ticks "')}]}  # fmt: skip
    seen = until_prestarted(warm, java_dir, tries=8)
    files = re.search(r"files \[(.*)\]", seen["stdout"]).group(1)  # type: ignore[union-attr]
    assert sorted(files.split(", ")) == ["Main.class", "Main.java"], seen["stdout"]


JAVA_NAMES_THE_SHIM = r"""
import java.nio.file.*;
public class Main {
    public static void main(String[] args) throws Exception {
        System.out.println("cmdline " + new String(Files.readAllBytes(Path.of("/proc/self/cmdline"))).replace('\0', ' '));
        System.out.println(SHIM.mine());
    }
}
class SHIM {
    static String mine() { return "the job's own class"; }
}
""".replace("SHIM", JAVA_SHIM)


def test_a_job_class_named_like_the_shim_is_its_own(stacks: tuple[Api, Api]) -> None:
    """The warm VM has loaded the shim's class, in the class loader the job's classes go to:
    a job class of the same name would resolve to the shim's (NoSuchMethodError). Such a job
    runs in a plain jail instead, even where one primed for Java is waiting."""
    warm, _ = stacks
    body = {"language": "java", "files": [{"name": "Main.java", "content": JAVA_NAMES_THE_SHIM}]}
    primes = {"language": "java", "files": [{"name": "Main.java", "content": JAVA_STARTUP}]}
    until_prestarted(warm, primes, tries=8)
    for _ in range(3):  # a slot primes for its last job's language: the next is Java again
        out = run(warm, body)
        assert (out["outcome"], out["exitCode"], out["stderr"]) == ("completed", 0, ""), out
        assert "the job's own class" in out["stdout"] and not prestarted(out), out["stdout"]
        until_prestarted(warm, primes, tries=8)


ENVIRON_PROBES = {
    "python": ("main.py", 'print("environ", open("/proc/self/environ", "rb").read())\n'
                          'print("cmdline", open("/proc/self/cmdline", "rb").read())\n'),
    "javascript": ("main.js", "const fs = require('fs');\n"
                              "console.log('environ', JSON.stringify(fs.readFileSync('/proc/self/environ', 'latin1')));\n"
                              "console.log('cmdline', JSON.stringify(fs.readFileSync('/proc/self/cmdline', 'latin1')));\n"),
    "ruby": ("main.rb", 'p File.binread("/proc/self/environ")\n' + RB_MOUNTS),
}  # fmt: skip


@pytest.mark.parametrize("language", sorted(ENVIRON_PROBES))
def test_the_environment_the_process_started_with_is_the_jobs(stacks: tuple[Api, Api], language: str) -> None:
    """/proc/self/environ (the environment the process was started with, which no process
    can change) is a plain run's: the worker passes nothing to the shim through it."""
    warm, plain = stacks
    name, code = ENVIRON_PROBES[language]
    body = {"language": language, "files": [{"name": name, "content": code}]}
    fast = until_prestarted(warm, body)
    slow = run(plain, body)
    assert not prestarted(slow), slow["stdout"]
    assert without_mounts({"stdout": without_cmdline(fast)}) == without_mounts({"stdout": without_cmdline(slow)})
    assert "PATH=" in fast["stdout"] and "CODERUNNER" not in fast["stdout"], fast["stdout"]
    assert fast["stderr"] == slow["stderr"] == "", fast["stderr"]


def test_time_and_memory_before_start_are_not_the_jobs(stacks: tuple[Api, Api]) -> None:
    warm, plain = stacks
    probe = py_job("print(1)\nprint(open('/proc/self/cmdline', 'rb').read())\n")
    fast = [until_prestarted(warm, probe) for _ in range(3)]
    slow = [run(plain, probe) for _ in range(3)]
    assert not any(prestarted(out) for out in slow)
    cpu = statistics.median(o["cpuMs"] for o in fast), statistics.median(o["cpuMs"] for o in slow)
    memory = statistics.median(o["memoryKb"] for o in fast), statistics.median(o["memoryKb"] for o in slow)
    assert cpu[0] < cpu[1], cpu
    assert memory[0] < memory[1] / 2, memory
    # The job's memory limit is still its own: a prestarted job cannot allocate past it.
    hog = run(warm, py_job("x = bytearray(90 * 1024 * 1024)\nprint('allocated')\n", limits={"memoryMb": 64}))
    assert hog["outcome"] != "completed" or "allocated" not in hog["stdout"], hog


def test_nothing_of_another_job_reaches_a_prestarted_one(stacks: tuple[Api, Api]) -> None:
    """A job leaves a secret everywhere it can; the next prestarted jobs find none of it,
    and see no process but their own (the other slots' waiting runtimes included)."""
    warm, _ = stacks
    left, right = "S3CR3T", uuid.uuid4().hex
    planted = run(
        warm,
        py_job(
            f"import os, subprocess\nSECRET = {left!r} + {right!r}\n"
            "open('/tmp/secret', 'w').write(SECRET)\nopen('/workspace/secret', 'w').write(SECRET)\n"
            "os.environ['SECRET'] = SECRET\nsubprocess.Popen(['sleep', '30'], start_new_session=True)\n"
            "print(open('/proc/self/cmdline', 'rb').read())\n"
        ),
    )
    assert planted["outcome"] == "completed", planted
    search = (
        "import gc, os, sys\n"
        "gc.unfreeze()\n"  # the waiting runtime froze its own objects: search those too
        f"needle = {left!r} + {right!r}\n"
        "found = []\n"
        "def look(value, where):\n"
        "    if isinstance(value, (str, bytes)) and value is not needle and needle in (value if isinstance(value, str) else value.decode('latin1')):\n"
        "        found.append(where)\n"
        "for obj in gc.get_objects():\n"
        "    items = obj.items() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple, set)) else ()\n"
        "    for item in items:\n"
        "        for value in (item if isinstance(obj, dict) else (item,)):\n"
        "            look(value, type(obj).__name__)\n"
        "frame = sys._getframe()\n"
        "while frame:\n"
        "    for value in frame.f_locals.values():\n"
        "        look(value, 'frame')\n"
        "    frame = frame.f_back\n"
        "for top in ('/tmp', '/workspace'):\n"
        "    for name in os.listdir(top):\n"
        "        try: look(open(os.path.join(top, name), 'rb').read(), top)\n"
        "        except OSError: pass\n"
        "look(open('/proc/self/environ', 'rb').read(), 'environ')\n"
        "pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())\n"
        "alive = []\n"
        "for pid in range(1, 4096):\n"
        "    try: os.kill(pid, 0); alive.append(pid)\n"
        "    except ProcessLookupError: pass\n"
        "    except PermissionError: alive.append(pid)\n"
        "print('found', found, 'pids', pids, 'alive', alive, 'me', os.getpid())\n"
        "print(open('/proc/self/cmdline', 'rb').read())\n"
    )
    for _ in range(4):
        out = until_prestarted(warm, py_job(search))
        assert out["outcome"] == "completed", out
        match = re.search(r"found \[(.*)\] pids \[(.*)\] alive \[(.*)\] me (\d+)", out["stdout"])
        assert match, out["stdout"]
        assert match.group(1) == "", out["stdout"]
        # The gate (pid 1) and the program: no other job's process, waiting or not.
        assert match.group(2) == match.group(3) == f"1, {match.group(4)}", out["stdout"]


def waiting_runtimes() -> list[int]:
    """Prestarted runtimes that have finished starting (on the shim's bytecode, python.toml's
    prestart_cache): blocked reading the frame on fd 0."""
    ps = subprocess.run(
        ["pgrep", "-f", f"^/usr/bin/python3 -u {SHIM}python\\.pyc$"], capture_output=True, text=True, check=False
    )
    waiting = []
    for pid in (int(p) for p in ps.stdout.split()):
        try:
            call = Path(f"/proc/{pid}/syscall").read_text().split()
        except OSError:
            continue
        if call[:2] == ["0", "0x0"]:  # read(0, ...)
            waiting.append(pid)
    return waiting


def test_a_waiting_runtime_holds_nothing_to_reach_it_by(stacks: tuple[Api, Api]) -> None:
    """From the host: each waiting runtime has only its three pipes open, no socket and no
    file, and lives in a network namespace of its own."""
    warm, _ = stacks
    until_prestarted(warm, py_job("print(open('/proc/self/cmdline', 'rb').read())\n"))
    # The slot that ran the job is priming its next runtime: look once one is waiting.
    deadline = time.monotonic() + 10
    while not (pids := waiting_runtimes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pids, "no waiting runtime found on the host"
    host_net = os.readlink("/proc/self/ns/net")
    checked = 0
    for pid in pids:
        try:
            fds = {fd: os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
            net = os.readlink(f"/proc/{pid}/ns/net")
        except FileNotFoundError:
            continue  # it took a job and ended meanwhile
        assert sorted(fds) == ["0", "1", "2"], fds
        assert all(target.startswith("pipe:") for target in fds.values()), fds
        assert net != host_net
        checked += 1
    assert checked, "every waiting runtime vanished before it could be looked at"
