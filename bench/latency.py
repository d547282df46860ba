"""Latency benchmark: sequential `print(1)` jobs through the whole stack vs bare nsjail.

For each job it measures, with a real Pusher client (pysher):
    execute→result  POST /v1/execute sent … `result` event received (includes subscribing)
    start→result    POST /jobs/:id/start sent … `result` event received (what an IDE user feels)
and, in the same run on the same machine, the same program under bare nsjail with the same
profile (spawn … exit), and with no sandbox at all. The ratio full-stack / bare-nsjail is
the figure to watch.

    .venv/bin/python bench/latency.py            # starts a private stack
    .venv/bin/python bench/latency.py -n 200 --json bench/results/latest.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import KeepAliveRealtime, summary, time_job
from launcher.stack import Stack
from shared.paths import REPO_ROOT
from tests.helpers import Api, py_job

PROGRAM = "print(1)\n"


def bench_stack(stack: Stack, n: int, warmup: int) -> tuple[list[float], list[float]]:
    api = Api(stack)
    rt = KeepAliveRealtime(stack, api)
    execute_to_result: list[float] = []
    start_to_result: list[float] = []
    try:
        for i in range(n + warmup):
            total, from_start = time_job(api, rt, py_job(PROGRAM), "1\n")
            if i >= warmup:
                execute_to_result.append(total)
                start_to_result.append(from_start)
    finally:
        rt.close()
        api.close()
    return execute_to_result, start_to_result


def bare_workspace(program: str) -> Path:
    """A folder holding main.py, readable by the jail's nobody user."""
    workspace = Path(tempfile.mkdtemp(prefix="bench-ws-"))
    (workspace / "main.py").write_text(program)
    os.chmod(workspace, 0o755)
    return workspace


def stack_nsjail() -> str:
    """The nsjail our stacks' workers run, so both sides use one binary."""
    from shared.settings import Settings
    from worker.__main__ import find_nsjail

    return find_nsjail(Settings(nsjail_path=os.environ.get("NSJAIL_PATH", "")))


def bare_argv(workspace: Path, sandboxed: bool) -> list[str]:
    """Run workspace/main.py under the stack's nsjail with the jobs' profile, or with no sandbox."""
    if not sandboxed:
        return ["/usr/bin/python3", "-u", str(workspace / "main.py")]
    return [
        stack_nsjail(), "--config", str(REPO_ROOT / "sandbox-profiles" / "base.cfg"), "--quiet",
        "--user", "65534:65534:1", "--group", "65534:65534:1",
        "--bindmount", f"{workspace}:/workspace", "--time_limit", "30",
        "--env", "PYTHONUNBUFFERED=1", "--env", "PYTHONDONTWRITEBYTECODE=1",
        "--", "/usr/bin/python3", "-u", "main.py",
    ]  # fmt: skip


def bench_bare(n: int, warmup: int, sandboxed: bool, program: str = PROGRAM, expect: bytes = b"1\n") -> list[float]:
    """The same program under bare nsjail (same profile) or no sandbox, its output piped."""
    workspace = bare_workspace(program)
    argv = bare_argv(workspace, sandboxed)
    times: list[float] = []
    try:
        for i in range(n + warmup):
            t0 = time.perf_counter()
            out = subprocess.run(argv, capture_output=True, check=False)
            t1 = time.perf_counter()
            if out.stdout != expect:
                raise SystemExit(f"bare run misbehaved: {out}")
            if i >= warmup:
                times.append((t1 - t0) * 1000)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=100, help="measured jobs per series (default 100)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()

    stack = Stack(extra_env={"LOG_LEVEL": "WARNING"})
    stack.start()
    try:
        execute_to_result, start_to_result = bench_stack(stack, args.n, args.warmup)
    finally:
        stack.cleanup()
    bare_nsjail = bench_bare(args.n, args.warmup, sandboxed=True)
    bare_python = bench_bare(args.n, args.warmup, sandboxed=False)

    figures = {
        "jobs": args.n,
        "program": PROGRAM.strip(),
        "execute_to_result": summary(execute_to_result),
        "start_to_result": summary(start_to_result),
        "bare_nsjail": summary(bare_nsjail),
        "bare_python": summary(bare_python),
    }
    figures["ratio_start_to_result_vs_bare_nsjail_p50"] = round(
        figures["start_to_result"]["p50_ms"] / figures["bare_nsjail"]["p50_ms"], 2
    )
    print(f"{'series':<22}{'p50 ms':>10}{'p90 ms':>10}{'mean ms':>10}{'min ms':>10}")
    for name in ("execute_to_result", "start_to_result", "bare_nsjail", "bare_python"):
        s = figures[name]
        print(f"{name:<22}{s['p50_ms']:>10}{s['p90_ms']:>10}{s['mean_ms']:>10}{s['min_ms']:>10}")
    print(f"start→result / bare nsjail (p50): {figures['ratio_start_to_result_vs_bare_nsjail_p50']}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
