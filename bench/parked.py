"""Parked capacity: start→result of a started job while 1,000 unstarted jobs are parked on
the same worker, next to the same on an idle worker (issue: park for free, run at once).

    .venv/bin/python bench/parked.py [--parked 1000] [-n 30] [--reps 3]

Each repetition starts one stack with one worker (2 slots), measures n started jobs on
the idle worker, parks `--parked` jobs (submitted, never started), measures n more, and
also reports the worker's resident memory with and without the parked jobs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import KeepAliveRealtime, pct, time_job
from launcher.stack import Stack
from tests.helpers import Api, Realtime, py_job


def _rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _series(api: Api, rt: Realtime, n: int) -> list[float]:
    return [time_job(api, rt, py_job("print(1)\n"), "1\n")[1] for _ in range(n)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parked", type=int, default=1000)
    parser.add_argument("-n", type=int, default=30)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    rows: dict[str, list[float]] = {"idle": [], "parked": []}
    for rep in range(args.reps):
        stack = Stack(extra_env={
            "WORKER_MAX_SANDBOXES": "2", "LOG_LEVEL": "WARNING", "WORKER_WARMUP_MS": "600000",
            "MAX_PARKED_PER_PRINCIPAL": str(args.parked + 100), "MAX_QUEUE_DEPTH": str(args.parked + 100),
        })  # fmt: skip
        stack.start()
        api = Api(stack)
        rt = KeepAliveRealtime(stack, api)
        try:
            worker = stack.procs["worker"].pid
            _series(api, rt, 5)  # warm-up
            idle = _series(api, rt, args.n)
            rss_idle = _rss_kb(worker)
            t0 = time.monotonic()
            parked = [api.execute(py_job("print('never')")) for _ in range(args.parked)]
            with stack.redis() as redis:
                while True:
                    states = [redis.hget(f"job:{j['jobId']}:status", "state") for j in parked[-10:]]
                    if all(s == b"parked" for s in states):
                        break
                    time.sleep(0.1)
                count = sum(1 for j in parked if redis.hget(f"job:{j['jobId']}:status", "state") == b"parked")
            took = time.monotonic() - t0
            busy = _series(api, rt, args.n)
            rss_parked = _rss_kb(worker)
            rows["idle"].append(pct(idle, 50))
            rows["parked"].append(pct(busy, 50))
            print(f"rep {rep + 1}: {count} parked in {took:.1f}s; start→result p50 idle {pct(idle, 50):.1f} ms "
                  f"(p90 {pct(idle, 90):.1f}), with {count} parked {pct(busy, 50):.1f} ms (p90 {pct(busy, 90):.1f}); "
                  f"worker RSS {rss_idle / 1024:.0f} → {rss_parked / 1024:.0f} MiB", flush=True)  # fmt: skip
        finally:
            rt.close()
            api.close()
            stack.cleanup()
    for name, values in rows.items():
        print(f"start→result p50, {name:6s}: min {min(values):.1f} / median {statistics.median(values):.1f} / max {max(values):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
