"""The hot-path figures (issue 9), every row in one run, ours next to a baseline.

Rows (each repetition gives one figure per row and side; the table shows min / median / max
of those over the repetitions, and the ratio of the medians, ours / baseline):

  1  execute → result, IDE path, p50 ms: `print(1)` as an IDE runs it, POST /v1/execute
     sent … subscribed over a real Pusher client (pysher, channel auth included) … POST
     /start … the `result` event received. Baseline: Piston's POST /api/v2/execute sent …
     its response received; without Piston, a bare nsjail run (spawn … exit, output read).
     Row 1b, start → result, is the same jobs from POST /start on, next to bare nsjail.
  2  start → first stdout byte, p50 ms: POST /start sent … the first `stdout` event
     received (stamped in the Pusher client's thread). Baseline: bare nsjail spawn … the
     first byte read from its stdout pipe (Piston's execute does not stream).
     Rows 1 to 2 run their jobs back to back, each execute sent as the last result
     arrives: on a small host that keeps the CPU busy (every job's slot rebuilds its warm
     jail while the next job starts), so they measure a saturated worker. Rows 1p and 2p
     (execute → result, start → first byte) run the same jobs --pace-ms apart, as one IDE
     user clicking Run, next to bare nsjail runs paced the same way.
  3  grader throughput, jobs/s, for each --clients count (4 and 8): every client thread owns
     one kept-open connection (bench/keepalive.py) and loops POST /v1/execute (`collectOutput: true`) → POST
     /v1/jobs/:id/start → GET /v1/jobs/:id/output?waitMs=30000 (no WebSocket), checking
     the stdout; jobs completed within --duration seconds after --warmup-s seconds.
     Baseline: the same threads and loop posting to Piston, or each running bare nsjail.
  4  host CPU per job, ms, during the first throughput run: busy jiffies of /proc/stat over
     the measured window minus this benchmark's own CPU, divided by the jobs completed;
     for our stack also split into worker, api, soketi, redis (their processes' own CPU),
     jails (the deployment's cgroup counter) and other (see bench/cpu.py).
  5  start → result with --parked unstarted jobs parked, p50 ms: the row-1 job's start →
     result while that many jobs (submitted, never started) wait on the same worker;
     baseline: the same series on the idle worker, in the same repetition.
  6  `for i in range(200000): print(i)` (1.3 MB) with a live subscriber, p50 ms: POST
     /start … the `result` at the subscriber, every line checked. Baseline: the same program
     under bare nsjail with its output piped (always: the goal is stated against it).

Baseline: set PISTON_URL to a running Piston (its /api/v2 API, with a python runtime), e.g.

    PISTON_URL=http://127.0.0.1:2000 make bench

and rows 1, 3 and 4 are put next to it (PISTON_PYTHON_VERSION picks its python, default
"*"). Unset, the baseline is bare nsjail with the jobs' sandbox profile. If PISTON_URL is
set and nothing answers there, the run stops instead of quietly comparing with something
else.

Every series runs against one private stack (default settings), interleaved: in each
repetition, every row runs ours and then its baseline, the order flipped in odd
repetitions so a drift of the machine favours neither side.

    .venv/bin/python bench/hotpath.py                      # 3 repetitions, a few minutes
    .venv/bin/python bench/hotpath.py --json bench/results/hotpath.json
    .venv/bin/python bench/hotpath.py --reps 1 --jobs 5 --duration 3 --warmup-s 1 \\
        --stream-runs 1 --clients 4          # a quick smoke run
    .venv/bin/python bench/hotpath.py --only latency,throughput
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import cpu
from bench.baselines import Bare, Piston, piston_from_env
from bench.common import KeepAliveRealtime, api_client, first_arrival, pct
from bench.keepalive import KeepAliveHttp, Reply
from bench.streaming import EXPECTED as STREAM_EXPECTED
from bench.streaming import PROGRAM as STREAM_PROGRAM
from bench.streaming import _stack_runs as stream_runs
from launcher.stack import Stack
from tests.helpers import Api, py_job

PROGRAM = "print(1)\n"
EXPECT = "1\n"
SERIES = ("latency", "parked", "throughput", "streaming")
ENDED = {"done", "killed", "error", "expired", "lost"}
OUTPUT_WAIT_MS = 30000
INF = float("inf")


@dataclass
class Row:
    """One line of the table: a figure per repetition for us and for the baseline."""

    label: str
    unit: str
    goal: str
    baseline_name: str
    ours: list[float] = field(default_factory=list)
    baseline: list[float] = field(default_factory=list)


@dataclass
class Bench:
    """Everything the series share: the stack, its clients and the baselines."""

    args: argparse.Namespace
    stack: Stack
    api: Api  # for what is not timed
    http: KeepAliveHttp  # for the timed requests: a lean client, the API token by default
    rt: KeepAliveRealtime
    bare: Bare
    bare_stream: Bare
    piston: Piston | None
    piston_client: KeepAliveHttp | None
    rows: dict[str, Row] = field(default_factory=dict)
    cpu_runs: dict[str, dict[str, list[dict[str, float]]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def row(self, key: str, label: str, unit: str, goal: str, baseline_name: str) -> Row:
        return self.rows.setdefault(key, Row(label, unit, goal, baseline_name))


# A pause before each side: what the side before it left behind (our worker rebuilding its
# warm jails and removing cgroups, some 20 ms of CPU a slot) is not charged to the next.
SETTLE_S = 0.5


def interleaved(rep: int, *sides: Callable[[], None]) -> None:
    """Run each side once, in order on even repetitions and reversed on odd ones."""
    for side in sides if rep % 2 == 0 else reversed(sides):
        time.sleep(SETTLE_S)
        side()


# ---------------------------------------------------------------- rows 1, 1b, 2 and 5


def ide_job(b: Bench, timeout_s: float = 60) -> dict[str, float]:
    """One `print(1)` driven like an IDE: execute, subscribe, start, wait for the result."""
    t0 = time.perf_counter()
    job = _answer(b.http.post("/v1/execute", json=py_job(PROGRAM)), 202, "execute")
    followed = b.rt.follow(job)
    first = first_arrival(b.rt, job["channel"], "stdout")
    t1 = time.perf_counter()
    token = {"Authorization": f"Bearer {job['jobToken']}"}
    _answer(b.http.post(f"/v1/jobs/{job['jobId']}/start", headers=token), 202, "start")
    try:
        result = followed.wait_result(timeout_s)
    except AssertionError as exc:
        # Counted as infinitely slow (so it weighs on the percentiles) and named in the notes.
        b.api.post(f"/v1/jobs/{job['jobId']}/kill")
        b.rt.pusher.unsubscribe(job["channel"])
        b.notes.append(f"an IDE job gave no single result in {timeout_s:g} s: {str(exc)[:200]}")
        return {"execute_result": INF, "start_result": INF, "start_first_stdout": INF}
    t2 = time.perf_counter()
    if result["outcome"] != "completed" or followed.text("stdout") != EXPECT or not first:
        raise SystemExit(f"job misbehaved: {result} {followed.summary()}")
    b.rt.pusher.unsubscribe(job["channel"])
    return {
        "execute_result": (t2 - t0) * 1000,
        "start_result": (t2 - t1) * 1000,
        "start_first_stdout": (first[0] - t1) * 1000,
    }


def p50s(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: pct([run[key] for run in runs], 50) for key in runs[0]}


def series_latency(b: Bench, rep: int) -> None:
    n = b.args.jobs
    base_name = "Piston" if b.piston else "bare nsjail"
    exec_row = b.row("1", "execute → result, IDE path, p50", "ms", "≤ 0.6x Piston", base_name)
    start_row = b.row("1b", "start → result, p50", "ms", "", "bare nsjail")
    first_row = b.row("2", "start → first stdout byte, p50", "ms", "≤ 5 ms", "bare nsjail")

    pace_s = b.args.pace_ms / 1000
    if pace_s:
        apart = f"jobs {b.args.pace_ms} ms apart"
        paced_exec_row = b.row("1p", f"execute → result, IDE path, {apart}, p50", "ms", "", "bare nsjail")
        paced_first_row = b.row("2p", f"start → first stdout byte, {apart}, p50", "ms", "", "bare nsjail")

    def paced(run: Callable[[], Any]) -> Any:
        time.sleep(pace_s)
        return run()

    def ours() -> None:
        figures = p50s([ide_job(b) for _ in range(n)])
        exec_row.ours.append(figures["execute_result"])
        start_row.ours.append(figures["start_result"])
        first_row.ours.append(figures["start_first_stdout"])
        if pace_s:
            figures = p50s([paced(lambda: ide_job(b)) for _ in range(n)])
            paced_exec_row.ours.append(figures["execute_result"])
            paced_first_row.ours.append(figures["start_first_stdout"])

    def bare() -> None:
        runs = [b.bare.run() for _ in range(n)]
        first_row.baseline.append(pct([r[0] for r in runs], 50))
        start_row.baseline.append(pct([r[1] for r in runs], 50))
        if b.piston is None:
            exec_row.baseline.append(pct([r[1] for r in runs], 50))
        if pace_s:
            runs = [paced(b.bare.run) for _ in range(n)]
            paced_first_row.baseline.append(pct([r[0] for r in runs], 50))
            paced_exec_row.baseline.append(pct([r[1] for r in runs], 50))

    def piston() -> None:
        assert b.piston is not None and b.piston_client is not None
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            b.piston.run(b.piston_client, PROGRAM, EXPECT)
            times.append((time.perf_counter() - t0) * 1000)
        exec_row.baseline.append(pct(times, 50))

    interleaved(rep, ours, bare, *([piston] if b.piston else []))


def park(b: Bench, count: int, timeout_s: float = 30) -> list[dict[str, Any]]:
    """Submit `count` jobs and never start them; wait until the worker reports them parked."""
    jobs = [b.api.execute(py_job("print('never')\n")) for _ in range(count)]
    waiting = list(jobs)
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        waiting = [job for job in waiting if b.api.status(job)["state"] != "parked"]
        if waiting:
            time.sleep(0.1)
    if waiting:
        states = sorted({b.api.status(job)["state"] for job in waiting})
        b.notes.append(f"row 5: {len(waiting)} of {count} jobs not parked after {timeout_s:.0f} s (states {states})")
    return jobs


def unpark(b: Bench, jobs: list[dict[str, Any]]) -> None:
    """Kill the parked jobs and wait until each has ended, so later rows run on an idle stack."""
    for job in jobs:
        b.api.post(f"/v1/jobs/{job['jobId']}/kill")
    for job in jobs:
        b.api.wait_state(job, ENDED, timeout_s=30)


def series_parked(b: Bench, rep: int) -> None:
    row = b.row("5", f"start → result, {b.args.parked} parked, p50", "ms", "runs at once", "idle worker")
    timeout_s = b.args.parked_timeout

    def starts() -> float:
        return pct([ide_job(b, timeout_s)["start_result"] for _ in range(b.args.jobs)], 50)

    def with_parked() -> None:
        jobs = park(b, b.args.parked)
        try:
            row.ours.append(starts())
            # Row 5 runs at the default warm-up (30 s), as the row does: a slow run
            # could see parked jobs expire before the started ones are timed, and say so.
            gone = sum(b.api.status(job)["state"] != "parked" for job in jobs)
            if gone:
                b.notes.append(f"row 5: {gone} of {len(jobs)} jobs were no longer parked when the started jobs had been timed")
        finally:
            unpark(b, jobs)

    interleaved(rep, with_parked, lambda: row.baseline.append(starts()))


# ---------------------------------------------------------------- rows 3 and 4


@dataclass
class Throughput:
    jobs: int
    seconds: float
    errors: list[str]
    cpu_ms: dict[str, float]

    @property
    def per_s(self) -> float:
        return self.jobs / self.seconds


def throughput(
    clients: int,
    make_client: Callable[[], Any],
    run_one: Callable[[Any], object],
    args: argparse.Namespace,
    groups: Callable[[], dict[str, list[int]]] = dict,
    deployment: str | None = None,
) -> Throughput:
    """`clients` threads, each with its own client, loop `run_one`; count what ends in the window.

    The same loop drives every side; only `run_one` (and its client) differs.
    """
    stop = threading.Event()
    finished: list[float] = []  # completion instants; list.append is atomic
    errors: list[str] = []

    def loop() -> None:
        client = make_client()
        try:
            while not stop.is_set():
                try:
                    run_one(client)
                except Exception as exc:  # counted and reported, the run goes on
                    errors.append(repr(exc)[:300])
                    time.sleep(0.1)
                else:
                    finished.append(time.perf_counter())
        finally:
            if client is not None:
                client.close()

    threads = [threading.Thread(target=loop, name=f"bench-client-{i}", daemon=True) for i in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(args.warmup_s)
    before = cpu.snapshot(groups(), deployment)
    time.sleep(args.duration)
    after = cpu.snapshot(groups(), deployment)
    stop.set()
    for thread in threads:
        thread.join(OUTPUT_WAIT_MS / 1000 + 15)
    jobs = sum(1 for at in finished if before.at <= at <= after.at)
    return Throughput(jobs, after.at - before.at, errors, cpu.per_job_ms(before, after, jobs))


def background_ms_per_s(seconds: float) -> float:
    """Host CPU while nothing of ours runs (idle stack, other users): to read row 4 against."""
    before = cpu.snapshot()
    time.sleep(seconds)
    after = cpu.snapshot()
    return (after.host_ms - before.host_ms - (after.client_ms - before.client_ms)) / (after.at - before.at)


def _answer(response: Reply, status: int, what: str) -> Any:
    """The JSON of a reply with `status`; RuntimeError (a failed job) for any other."""
    if response.status_code != status:
        raise RuntimeError(f"{what}: {response.status_code} {response.text[:200]}")
    return response.json()


def grader_job(client: KeepAliveHttp) -> None:
    """A grader's job: execute with collectOutput, start, long-poll the output; no WebSocket."""
    job_id = _answer(client.post("/v1/execute", json=py_job(PROGRAM, collectOutput=True)), 202, "execute")["jobId"]
    _answer(client.post(f"/v1/jobs/{job_id}/start"), 202, "start")
    output = _answer(client.get(f"/v1/jobs/{job_id}/output", params={"waitMs": str(OUTPUT_WAIT_MS)}), 200, "output")
    if output.get("stdout") != EXPECT or output.get("outcome") != "completed":
        why = output.get("message") or f"stdout {output.get('stdout')!r}"
        raise RuntimeError(f"grader job {job_id} ended {output.get('outcome')}: {why}")


def stack_groups(stack: Stack) -> dict[str, list[int]]:
    """The root pids of each part of the stack, read afresh (a worker may have been restarted)."""
    groups: dict[str, list[int]] = {"worker": [stack.procs[name].pid for name in stack.worker_names()]}
    for name in ("api", "soketi", "redis"):
        groups[name] = [stack.procs[name].pid]
    return groups


def series_throughput(b: Bench, rep: int) -> None:
    for index, clients in enumerate(b.args.clients):
        throughput_pair(b, rep, clients, with_cpu_row=index == 0)


def throughput_pair(b: Bench, rep: int, clients: int, with_cpu_row: bool) -> None:
    """Our grader loop and the baseline's, `clients` threads each, one after the other."""
    base_name = "Piston" if b.piston else "bare nsjail"
    row = b.row(f"3.{clients}", f"grader throughput, {clients} clients", "jobs/s", "≥ 1.5x Piston", base_name)
    cpu_row = b.row("4", f"host CPU per job ({clients} clients)", "ms", "≤ 20 ms", base_name) if with_cpu_row else None
    tally = b.cpu_runs.setdefault(str(clients), {"ours": [], "baseline": [], "background": []})
    if b.args.idle_s > 0:
        tally["background"].append({"host_ms_per_s": round(background_ms_per_s(b.args.idle_s), 1)})

    def record(side: str, run: Throughput) -> None:
        getattr(row, side).append(run.per_s)
        if cpu_row is not None:
            getattr(cpu_row, side).append(run.cpu_ms["total"])
        tally[side].append(run.cpu_ms)
        if run.errors:
            b.notes.append(f"{clients} clients, {side}: {len(run.errors)} failed jobs, first: {run.errors[0]}")

    def make_client() -> KeepAliveHttp:
        return api_client(b.stack, timeout_s=OUTPUT_WAIT_MS / 1000 + 10)

    def ours() -> None:
        def groups() -> dict[str, list[int]]:
            return stack_groups(b.stack)

        run = throughput(clients, make_client, grader_job, b.args, groups, b.stack.deployment)
        if "jails" not in run.cpu_ms:
            b.notes.append(f"{clients} clients: no CPU counter found for the jails' cgroups: their CPU is in 'other'")
        record("ours", run)

    def theirs() -> None:
        piston = b.piston
        if piston is not None:
            record("baseline", throughput(clients, piston.client, lambda c: piston.run(c, PROGRAM, EXPECT), b.args))
        else:
            record("baseline", throughput(clients, lambda: None, b.bare.run, b.args))

    interleaved(rep, ours, theirs)


# ---------------------------------------------------------------- row 6


def series_streaming(b: Bench, rep: int) -> None:
    row = b.row("6", "200k lines (1.3 MB), live subscriber, p50", "ms", "≤ 2x bare nsjail", "bare nsjail")
    n = b.args.stream_runs

    def ours() -> None:
        row.ours.append(pct(stream_runs(b.api, b.rt, n), 50))

    def bare() -> None:
        row.baseline.append(pct([b.bare_stream.run()[1] for _ in range(n)], 50))

    interleaved(rep, ours, bare)


RUNNERS: dict[str, Callable[[Bench, int], None]] = {
    "latency": series_latency,
    "parked": series_parked,
    "throughput": series_throughput,
    "streaming": series_streaming,
}


# ---------------------------------------------------------------- report


def spread(values: list[float]) -> dict[str, float | None]:
    """min / median / max; a timed-out figure (inf) is null in JSON."""
    if not values:
        return {}
    figures = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    return {k: None if math.isinf(v) else round(v, 2) for k, v in figures.items()}


def _fmt(values: list[float]) -> str:
    if not values:
        return "-"
    s = spread(values)
    return " / ".join("timeout" if s[k] is None else f"{s[k]:.1f}" for k in ("min", "median", "max"))


def _ratio(row: Row) -> str:
    if not row.ours or not row.baseline:
        return "-"
    ours, base = statistics.median(row.ours), statistics.median(row.baseline)
    if math.isinf(ours) or base == 0:
        return "-"
    return f"{ours / base:.2f}x"


def print_table(b: Bench) -> None:
    label_w = max(len(f"{r.label} ({r.unit})") for r in b.rows.values()) + 2
    head = f"{'row':<5}{'figure':<{label_w}}{'ours min / med / max':>24}  {'baseline min / med / max':>26}  {'vs':<13}{'ratio':>7}  goal"
    print(head)
    print("-" * len(head))
    for key, r in sorted(b.rows.items()):
        label = f"{r.label} ({r.unit})"
        print(f"{key:<5}{label:<{label_w}}{_fmt(r.ours):>24}  {_fmt(r.baseline):>26}  {r.baseline_name:<13}{_ratio(r):>7}  {r.goal}")
    for clients, sides in b.cpu_runs.items():
        for side, runs in sides.items():
            if not runs:
                continue
            if side == "background":
                parts = {k: statistics.median(run[k] for run in runs) for k in runs[0]}
                shown = ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
                print(f"background before the {clients}-client runs (nothing submitted, medians): {shown}")
            else:
                # The parts of one run, the one whose total is the median: medians taken part
                # by part would not add up to any run's total.
                middle = sorted(runs, key=lambda run: run["total"])[len(runs) // 2]
                shown = ", ".join(f"{k} {v:.1f}" for k, v in middle.items())
                print(f"CPU ms/job, {clients} clients, {side} (the run with the median total): {shown}")
    for note in b.notes:
        print(f"note: {note}")


# What the API and the worker run on (the stack starts them with this interpreter): a plain
# source build costs them several per cent more CPU than a distribution's optimised one.
INTERPRETER = f"Python {sys.version.split()[0]} ({sys.base_prefix})"


def to_json(b: Bench, baseline: str) -> dict[str, Any]:
    def clean(values: list[float]) -> list[float | None]:
        return [None if math.isinf(v) else round(v, 2) for v in values]

    return {
        "baseline": baseline,
        "interpreter": INTERPRETER,
        "settings": {k: v for k, v in vars(b.args).items() if k != "json"},
        "rows": {
            key: {
                "label": r.label, "unit": r.unit, "goal": r.goal, "baseline_name": r.baseline_name,
                "ours": clean(r.ours), "baseline": clean(r.baseline),
                "ours_spread": spread(r.ours), "baseline_spread": spread(r.baseline), "ratio_of_medians": _ratio(r),
            }
            for key, r in b.rows.items()
        },
        "cpu_ms_per_job": b.cpu_runs,
        "notes": b.notes,
    }


# ---------------------------------------------------------------- main


def warm_up(b: Bench, only: list[str]) -> None:
    """Caches, warm jails and connections, once before the measured repetitions."""
    for _ in range(3):
        ide_job(b)
        b.bare.run()
    if b.piston is not None and b.piston_client is not None:
        for _ in range(3):
            b.piston.run(b.piston_client, PROGRAM, EXPECT)
    if "streaming" in only:
        stream_runs(b.api, b.rt, 1)
        b.bare_stream.run()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument("--jobs", type=int, default=30, help="jobs per latency series and repetition (default 30)")
    parser.add_argument("--clients", type=lambda s: [int(c) for c in s.split(",")], default=[4, 8], help="default 4,8")
    parser.add_argument("--duration", type=float, default=15.0, help="measured seconds per throughput run")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="unmeasured seconds before each throughput run")
    parser.add_argument("--pace-ms", type=int, default=200, help="pause before each job of rows 1p and 2p (0: skip them)")
    parser.add_argument("--parked", type=int, default=50, help="unstarted jobs parked for row 5 (default 50)")
    parser.add_argument("--parked-timeout", type=float, default=60.0, help="row 5: a start → result longer is 'timeout'")
    parser.add_argument("--idle-s", type=float, default=2.0, help="seconds of background CPU measured before each throughput pair (0: skip)")
    parser.add_argument("--stream-runs", type=int, default=5, help="streaming runs per side and repetition")
    parser.add_argument("--only", type=lambda s: s.split(","), default=list(SERIES), help=f"some of {','.join(SERIES)}")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    unknown = set(args.only) - set(SERIES)
    if unknown:
        parser.error(f"--only takes {','.join(SERIES)}, not {','.join(sorted(unknown))}")
    return args


def main() -> int:
    args = parse_args()
    piston = piston_from_env()
    baseline = piston.describe() if piston else "bare nsjail, sandbox-profiles/base.cfg"
    print(f"baseline: {baseline}", flush=True)
    print(f"stack's interpreter: {INTERPRETER}", flush=True)
    stack = Stack(extra_env={"LOG_LEVEL": "WARNING"})
    stack.start()
    api = Api(stack)
    http = api_client(stack)
    rt = KeepAliveRealtime(stack, http)
    b = Bench(
        args, stack, api, http, rt, Bare(PROGRAM, EXPECT), Bare(STREAM_PROGRAM, STREAM_EXPECTED), piston,
        piston.client() if piston else None,
    )  # fmt: skip
    try:
        warm_up(b, args.only)
        for rep in range(args.reps):
            for name in SERIES:
                if name in args.only:
                    began = time.monotonic()
                    RUNNERS[name](b, rep)
                    print(f"rep {rep + 1}/{args.reps}: {name} done in {time.monotonic() - began:.0f} s", flush=True)
    finally:
        rt.close()
        api.close()
        http.close()
        if b.piston_client is not None:
            b.piston_client.close()
        stack.cleanup()
        b.bare.cleanup()
        b.bare_stream.cleanup()
    print()
    print_table(b)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(to_json(b, baseline), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
