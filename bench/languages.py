"""Per-language hello-world latency through the whole stack, next to the bare toolchain.

For each language: N sequential jobs (execute→result and start→result, with a real Pusher
client), then the same source built and run with the same compiler/interpreter directly on
the host, no sandbox, in the same run. The difference is what the sandbox and the service
add.

    .venv/bin/python bench/languages.py -n 20 [--json bench/results/languages.json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import summary, time_job
from launcher.stack import Stack
from tests.helpers import Api, Realtime

HELLO = "hello\n"
PROGRAMS: dict[str, tuple[str, str]] = {
    "python": ("main.py", "print('hello')\n"),
    "javascript": ("main.js", "console.log('hello');\n"),
    "ruby": ("main.rb", "puts 'hello'\n"),
    "bash": ("main.sh", "echo hello\n"),
    "c": ("main.c", '#include <stdio.h>\nint main(void) { puts("hello"); return 0; }\n'),
    "cpp": ("main.cpp", '#include <cstdio>\nint main() { std::puts("hello"); }\n'),
    "go": ("main.go", 'package main\nimport "fmt"\nfunc main() { fmt.Println("hello") }\n'),
    "rust": ("main.rs", 'fn main() { println!("hello"); }\n'),
    "java": ("Main.java", 'public class Main { public static void main(String[] a) { System.out.println("hello"); } }\n'),
}


@functools.cache
def rustc() -> str:
    found = shutil.which("rustc") or "/root/.cargo/bin/rustc"
    sysroot = subprocess.run([found, "--print", "sysroot"], capture_output=True, text=True, check=True).stdout.strip()
    return f"{sysroot}/bin/rustc"


def bare_steps(language: str) -> list[list[str]]:
    """The same build and run as the manifest, on the host, no sandbox."""
    src = PROGRAMS[language][0]
    steps = {
        "python": [["/usr/bin/python3", "-u", src]],
        "javascript": [["/usr/bin/node", src]],
        "ruby": [["/usr/bin/ruby", src]],
        "bash": [["/bin/bash", src]],
        "c": [["/usr/bin/gcc", "-std=gnu17", "-O2", "-pipe", "-o", "main", src, "-lm"], ["./main"]],
        "cpp": [["/usr/bin/g++", "-std=gnu++17", "-O2", "-pipe", "-o", "main", src, "-lm"], ["./main"]],
        "go": [["/usr/bin/go", "build", "-o", "main", src], ["./main"]],
        "rust": [["RUSTC", "--edition=2021", "-C", "opt-level=2", "-C", "debuginfo=0", "-o", "main", src], ["./main"]],
        "java": [["/usr/bin/javac", "-J-XX:+UseSerialGC", "-J-XX:TieredStopAtLevel=1", "-d", ".", src],
                 ["/usr/bin/java", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1", "-Xshare:auto", "-cp", ".", "Main"]],
    }[language]  # fmt: skip
    return [[rustc() if arg == "RUSTC" else arg for arg in step] for step in steps]


def bench_bare(language: str, n: int) -> list[float]:
    name, code = PROGRAMS[language]
    times: list[float] = []
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "GOCACHE": "/tmp/bench-go-cache", "GO111MODULE": "off"}
    for _ in range(n + 1):
        d = Path(tempfile.mkdtemp(prefix="bench-bare-"))
        (d / name).write_text(code)
        t0 = time.perf_counter()
        out = b""
        for step in bare_steps(language):
            out = subprocess.run(step, cwd=d, env=env, capture_output=True, check=True).stdout
        times.append((time.perf_counter() - t0) * 1000)
        shutil.rmtree(d)
        if out.decode() != HELLO:
            raise SystemExit(f"bare {language} printed {out!r}")
    return times[1:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=20)
    parser.add_argument("--only", nargs="*", default=list(PROGRAMS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    stack = Stack(extra_env={"LOG_LEVEL": "WARNING", "WORKER_MAX_SANDBOXES": "2"})
    stack.start()
    figures: dict[str, dict[str, object]] = {}
    try:
        api, rt = Api(stack), Realtime(stack)
        for language in args.only:
            name, code = PROGRAMS[language]
            body = {"language": language, "files": [{"name": name, "content": code}]}
            time_job(api, rt, body, HELLO)  # warm caches
            pairs = [time_job(api, rt, body, HELLO) for _ in range(args.n)]
            figures[language] = {
                "execute_to_result": summary([p[0] for p in pairs]),
                "start_to_result": summary([p[1] for p in pairs]),
            }
        rt.close()
        api.close()
    finally:
        stack.cleanup()
    for language in args.only:
        figures[language]["bare_toolchain"] = summary(bench_bare(language, args.n))

    print(f"{'language':<12}{'exec→res p50':>14}{'p90':>8}{'start→res p50':>15}{'p90':>8}{'bare p50':>10}{'overhead p50':>14}")
    for language, f in figures.items():
        e, s, b = f["execute_to_result"], f["start_to_result"], f["bare_toolchain"]
        overhead = round(s["p50_ms"] - b["p50_ms"], 1)  # type: ignore[index]
        f["overhead_start_to_result_p50_ms"] = overhead
        print(f"{language:<12}{e['p50_ms']:>14}{e['p90_ms']:>8}{s['p50_ms']:>15}{s['p90_ms']:>8}{b['p50_ms']:>10}{overhead:>14}")  # type: ignore[index]
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
