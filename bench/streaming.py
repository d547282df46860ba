"""Output at the program's speed: `for i in range(200000): print(i)` (1.3 MB) with a live
subscriber, start → the `result` at the subscriber, next to the same program under bare
nsjail with its output piped (the floor), interleaved (the side that goes first alternates),
three repetitions; min / median / max of each repetition's p50.

    .venv/bin/python bench/streaming.py [-n 5] [--reps 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import KeepAliveRealtime, pct
from bench.latency import bench_bare
from launcher.stack import Stack
from tests.helpers import Api, Realtime, py_job

LINES = 200000
PROGRAM = f"for i in range({LINES}): print(i)\n"
EXPECTED = "".join(f"{i}\n" for i in range(LINES))


def _stack_runs(api: Api, rt: Realtime, n: int) -> list[float]:
    times = []
    for _ in range(n):
        job = api.execute(py_job(PROGRAM, limits={"outputKb": 4096}))
        followed = rt.follow(job)
        t0 = time.perf_counter()
        api.start(job)
        result = followed.wait_result(timeout_s=60)
        times.append((time.perf_counter() - t0) * 1000)
        if result["outcome"] != "completed" or followed.text("stdout") != EXPECTED:
            raise SystemExit(f"streaming job misbehaved: {result}")
        rt.pusher.unsubscribe(job["channel"])
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    stack = Stack(extra_env={"WORKER_MAX_SANDBOXES": "2", "LOG_LEVEL": "WARNING"})
    stack.start()
    api = Api(stack)
    rt = KeepAliveRealtime(stack, api)
    rows: dict[str, list[float]] = {"stack": [], "bare nsjail": []}
    try:
        _stack_runs(api, rt, 1)  # warm-up
        for rep in range(args.reps):
            # Alternate which side goes first, so a drift of the machine does not favour one.
            if rep % 2:
                bare = bench_bare(args.n, 1, sandboxed=True, program=PROGRAM, expect=EXPECTED.encode())
                ours = _stack_runs(api, rt, args.n)
            else:
                ours = _stack_runs(api, rt, args.n)
                bare = bench_bare(args.n, 1, sandboxed=True, program=PROGRAM, expect=EXPECTED.encode())
            rows["stack"].append(pct(ours, 50))
            rows["bare nsjail"].append(pct(bare, 50))
            print(f"rep {rep + 1}: start→result at a live subscriber p50 {pct(ours, 50):.0f} ms; "
                  f"bare nsjail piped p50 {pct(bare, 50):.0f} ms", flush=True)  # fmt: skip
    finally:
        rt.close()
        api.close()
        stack.cleanup()
    for name, values in rows.items():
        print(f"{name:12s} p50 min {min(values):.0f} / median {statistics.median(values):.0f} / max {max(values):.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
