"""Parked capacity: start→result of a started job while 1,000 unstarted jobs are parked on
the same worker, next to the same on an idle worker (issue: park for free, run at once).

    .venv/bin/python bench/parked.py [--parked 1000] [-n 30] [--reps 3]

Each repetition starts one stack with one worker (2 slots), warms it up with 30 jobs, and
measures n started jobs on the idle worker and n beside `--parked` parked jobs (submitted,
never started). The two series take turns going first: odd repetitions park first, measure,
kill every parked job and wait until each has ended, then measure the idle worker; so
neither side is always the colder one. It also reports the worker's resident memory with
and without the parked jobs, and fails if fewer than `--parked` jobs were parked.
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


ENDED = {"done", "killed", "error", "expired", "lost"}


def _count_parked(stack: Stack, jobs: list[dict[str, str]]) -> int:
    with stack.redis() as redis:
        pipe = redis.pipeline(transaction=False)
        for job in jobs:
            pipe.hget(f"job:{job['jobId']}:status", "state")
        return sum(state == b"parked" for state in pipe.execute())


def _wait_parked(stack: Stack, jobs: list[dict[str, str]], timeout_s: float = 120) -> int:
    """How many of `jobs` are parked, once all are (or `timeout_s` has passed)."""
    deadline = time.monotonic() + timeout_s
    while (count := _count_parked(stack, jobs)) < len(jobs) and time.monotonic() < deadline:
        time.sleep(0.1)
    return count


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
            "WORKER_MAX_PARKED": str(args.parked + 100),
        })  # fmt: skip
        stack.start()
        api = Api(stack)
        rt = KeepAliveRealtime(stack, api)
        try:
            worker = stack.procs["worker"].pid
            _series(api, rt, 30)  # warm-up
            idle_first = rep % 2 == 0
            if idle_first:
                idle = _series(api, rt, args.n)
                rss_idle = _rss_kb(worker)
            t0 = time.monotonic()
            parked = [api.execute(py_job("print('never')")) for _ in range(args.parked)]
            count = _wait_parked(stack, parked)
            took = time.monotonic() - t0
            busy = _series(api, rt, args.n)
            rss_parked = _rss_kb(worker)
            still = _count_parked(stack, parked)
            if min(count, still) < args.parked:
                raise SystemExit(f"rep {rep + 1}: only {count} of {args.parked} jobs parked ({still} still parked after the series)")
            if not idle_first:
                for job in parked:
                    api.post(f"/v1/jobs/{job['jobId']}/kill")
                for job in parked:
                    api.wait_state(job, ENDED, timeout_s=60)
                idle = _series(api, rt, args.n)
                rss_idle = _rss_kb(worker)
            rows["idle"].append(pct(idle, 50))
            rows["parked"].append(pct(busy, 50))
            order = "idle first" if idle_first else "parked first"
            print(f"rep {rep + 1} ({order}): {count} parked in {took:.1f}s; start→result p50 idle {pct(idle, 50):.1f} ms "
                  f"(p90 {pct(idle, 90):.1f}), with {count} parked {pct(busy, 50):.1f} ms (p90 {pct(busy, 90):.1f}); "
                  f"worker RSS {rss_idle / 1024:.0f} (idle) and {rss_parked / 1024:.0f} MiB (parked)", flush=True)  # fmt: skip
        finally:
            rt.close()
            api.close()
            stack.cleanup()
    for name, values in rows.items():
        print(f"start→result p50, {name:6s}: min {min(values):.1f} / median {statistics.median(values):.1f} / max {max(values):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
