"""Grading one C submission against many cases: one test batch, separate jobs, Piston.

Issue 6's benchmark: the same C program (it reads two numbers and prints their sum) is
graded against --cases cases (default 50) in three ways, on this machine in one run:

  (a) batch     one job with `tests` (one case per input, `compare: "exact"`,
                `collectOutput: true`): POST /v1/execute … POST /v1/jobs/:id/start …
                GET /v1/jobs/:id/output?waitMs=… answered. The program is compiled once and
                each case runs in a fresh jail; every case's verdict must be `accepted`, and
                the summary `{passed: N, failed: 0, skipped: 0, verdict: accepted}`.
  (b) jobs      N separate C jobs, each compiling the same source with one case's stdin
                (`collectOutput: true`), from --clients threads (default 4) that each own
                one kept-open connection (bench/keepalive.py) and loop execute → start → GET /output?waitMs
                over a shared list of cases; every job must end `completed`, exit 0, with
                the case's expected stdout.
  (c) Piston    only when PISTON_URL is set: the same --clients threads, each with its own
                keep-alive client, POST /api/v2/execute once per case (language "c",
                version PISTON_C_VERSION, default "*"), each answer checked like (b).
                Unset, (c) is left out (the run says so); there is no bare-nsjail stand-in.

For each series and repetition:
  wall      the first request sent … the last answer received (s).
  host CPU  busy jiffies of /proc/stat (user + nice + system + irq + softirq, every CPU)
            over the series plus --settle-s seconds after its last answer (so the worker's
            clean-up and the refilling of its warm pool count), minus this benchmark's own
            CPU (bench/cpu.py, as bench/hotpath.py does). For our stack it is also split
            into worker, api, soketi, redis, jails (the deployment's cgroup) and other.
            Everything else running on the machine lands in it too: the `background` line
            (host CPU per second with nothing submitted, sampled before each repetition)
            says how much that was.

The series run interleaved: in each of --reps repetitions (default 3) every series runs
once, in the order a, b, c on even repetitions and c, b, a on odd ones; the table shows
min / median / max over the repetitions and each median against (a)'s. After the timed
window of (a), its events are replayed (GET /v1/jobs/:id/events, not timed) to count the
`test_result` events and their verdicts, and to check the program was compiled once.

    .venv/bin/python bench/grading.py                        # 3 repetitions of 50 cases
    .venv/bin/python bench/grading.py --reps 1 --cases 10    # a quick check that it runs
    PISTON_URL=http://127.0.0.1:2000 .venv/bin/python bench/grading.py --json bench/results/grading.json

A failed check (a verdict other than accepted, a wrong stdout, a failed request) is listed
under the table and makes the script exit 1.
"""

from __future__ import annotations

import argparse
import functools
import json
import queue
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
from bench.baselines import Piston, piston_from_env
from bench.common import api_client
from bench.keepalive import KeepAliveHttp
from launcher.stack import Stack, StackError
from tests.helpers import Api

PROGRAM = r"""
#include <stdio.h>
int main(void) {
    long a, b;
    if (scanf("%ld %ld", &a, &b) != 2) return 2;
    printf("%ld\n", a + b);
    return 0;
}
"""
LIMITS = {"wallTimeMs": 5000, "cpuMs": 2000}
OUTPUT_WAIT_MS = 60000  # the API's longest long-poll; a longer wait polls again
SERIES_TIMEOUT_S = 600.0
CLIENT_TIMEOUT_S = OUTPUT_WAIT_MS / 1000 + 15  # a long-poll, and time for its answer
ENDED = {"done", "killed", "error", "expired", "lost"}
STACK_PARTS = ("worker", "api", "soketi", "redis", "jails")


@dataclass(frozen=True)
class Case:
    name: str
    stdin: str
    expected: str


def make_cases(n: int) -> list[Case]:
    cases = []
    for i in range(n):
        a, b = i * 37 + 1, (i * i) % 1000 - 500
        cases.append(Case(f"case {i + 1}", f"{a} {b}\n", f"{a + b}\n"))
    return cases


# ---------------------------------------------------------------- our API


def submit(client: KeepAliveHttp, body: dict[str, Any]) -> str:
    """POST /v1/execute (waiting out a 429 as its retryAfterMs says) and POST /start; the job id."""
    for _ in range(100):
        response = client.post("/v1/execute", json=body)
        if response.status_code != 429:
            break
        time.sleep(response.json().get("retryAfterMs", 100) / 1000)
    if response.status_code != 202:
        raise RuntimeError(f"execute: {response.status_code} {response.text[:300]}")
    job_id = str(response.json()["jobId"])
    response = client.post(f"/v1/jobs/{job_id}/start")
    if response.status_code != 202:
        raise RuntimeError(f"start {job_id}: {response.status_code} {response.text[:300]}")
    return job_id


def wait_output(client: KeepAliveHttp, job_id: str, timeout_s: float = SERIES_TIMEOUT_S) -> dict[str, Any]:
    """GET /v1/jobs/:id/output?waitMs=… until the RunResult is there (404 while it is not)."""
    deadline = time.monotonic() + timeout_s
    while True:
        left_ms = int((deadline - time.monotonic()) * 1000)
        if left_ms <= 0:
            raise RuntimeError(f"job {job_id}: no output within {timeout_s:.0f} s")
        wait = str(min(OUTPUT_WAIT_MS, left_ms))
        response = client.get(f"/v1/jobs/{job_id}/output", params={"waitMs": wait})
        if response.status_code == 200:
            return response.json()  # type: ignore[no-any-return]
        if response.status_code != 404:
            raise RuntimeError(f"output {job_id}: {response.status_code} {response.text[:300]}")
        status = client.get(f"/v1/jobs/{job_id}").json()
        if status.get("state") in ENDED:
            raise RuntimeError(
                f"job {job_id} ended {status.get('state')} without a pullable output: {str(status)[:300]}"
            )


def batch_body(cases: list[Case]) -> dict[str, Any]:
    return {
        "language": "c",
        "files": [{"name": "main.c", "content": PROGRAM}],
        "tests": [{"name": c.name, "stdin": c.stdin, "expectedOutput": c.expected} for c in cases],
        "compare": "exact",
        "limits": LIMITS,
        "collectOutput": True,
    }


def single_body(case: Case) -> dict[str, Any]:
    return {
        "language": "c",
        "files": [{"name": "main.c", "content": PROGRAM}],
        "stdin": case.stdin,
        "limits": LIMITS,
        "collectOutput": True,
    }


def check_batch(output: dict[str, Any], cases: list[Case]) -> tuple[int, list[str]]:
    """How many cases the RunResult says were accepted, and what was wrong with it."""
    problems: list[str] = []
    tests = output.get("tests") or []
    if output.get("outcome") != "completed":
        problems.append(f"batch outcome {output.get('outcome')!r}: {output.get('message') or ''}")
    if len(tests) != len(cases):
        problems.append(f"batch result has {len(tests)} cases, sent {len(cases)}")
    accepted = 0
    for index, case in enumerate(cases):
        got = next((t for t in tests if t.get("index") == index), None)
        if got is None:
            problems.append(f"{case.name}: missing from the result")
            continue
        verdict = got.get("verdict")
        accepted += verdict == "accepted"
        facts = {k: got.get(k) for k in ("outcome", "exitCode", "signal", "killedBy")}
        if verdict != "accepted":
            problems.append(
                f"{case.name}: verdict {verdict!r} (stdin {case.stdin!r}, expected {case.expected!r}, stdout {got.get('stdout')!r}, {facts})"
            )
        elif got.get("stdout") != case.expected:
            problems.append(f"{case.name}: accepted but stdout {got.get('stdout')!r} is not {case.expected!r}")
        if got.get("name") != case.name:
            problems.append(f"{case.name}: came back named {got.get('name')!r}")
    summary = output.get("summary")
    want = {"passed": len(cases), "failed": 0, "skipped": 0, "verdict": "accepted"}
    if summary != want:
        problems.append(f"batch summary {summary}, expected {want}")
    return accepted, problems


def check_single(output: dict[str, Any], case: Case, job_id: str) -> None:
    compile_info = output.get("compile") or {}
    if output.get("outcome") != "completed" or output.get("exitCode") != 0 or output.get("stdout") != case.expected:
        raise RuntimeError(
            f"job {job_id} ({case.name}): outcome {output.get('outcome')!r}, exit {output.get('exitCode')}, "
            f"stdout {output.get('stdout')!r} (expected {case.expected!r}), compile exit {compile_info.get('exitCode')}"
        )


def replay_batch(api: Api, job_id: str, cases: list[Case]) -> tuple[dict[str, int], int, list[str]]:
    """The batch's durable event log (after the timed window): test_result verdicts, compiles."""
    events = api.replay({"jobId": job_id}, timeout_s=60)
    verdicts: dict[str, int] = {}
    problems: list[str] = []
    seen = []
    for name, payload in events:
        if name == "test_result":
            verdicts[payload["verdict"]] = verdicts.get(payload["verdict"], 0) + 1
            seen.append(payload["index"])
    if sorted(seen) != list(range(len(cases))):
        problems.append(f"test_result events for indices {sorted(seen)}, expected 0..{len(cases) - 1} once each")
    results = [payload for name, payload in events if name == "result"]
    if len(results) != 1:
        problems.append(f"{len(results)} `result` events in the log, expected 1")
    else:
        live = [case.get("verdict") for case in sorted(results[0].get("tests") or [], key=lambda c: c.get("index", -1))]
        if live != ["accepted"] * len(cases):
            problems.append(f"the `result` event's tests: {live}")
        if (results[0].get("summary") or {}).get("verdict") != "accepted":
            problems.append(f"the `result` event's summary: {results[0].get('summary')}")
    compiles = sum(1 for name, payload in events if name == "stage" and payload.get("phase") == "compiling")
    if compiles != 1:
        problems.append(f"batch went through {compiles} `compiling` stages, expected 1")
    return verdicts, compiles, problems


# ---------------------------------------------------------------- Piston


def piston_run(piston: Piston, client: KeepAliveHttp, case: Case) -> None:
    """One case on Piston: a compile and a run per request, the run's stdout checked."""
    answer = piston.execute(client, "main.c", PROGRAM, case.stdin)
    compiled = answer.get("compile") or {}
    run = answer.get("run") or {}
    if compiled.get("code", 0) != 0 or run.get("code") != 0 or run.get("stdout") != case.expected:
        raise RuntimeError(f"Piston ({case.name}) misbehaved: compile {str(compiled)[:200]}, run {str(run)[:300]}")


# ---------------------------------------------------------------- series


@dataclass
class Run:
    wall_s: float
    cpu_ms: dict[str, float]  # total and (ours) its parts, for the whole series
    errors: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Bench:
    args: argparse.Namespace
    stack: Stack
    api: Api
    cases: list[Case]
    batch_client: KeepAliveHttp
    job_clients: list[KeepAliveHttp]
    piston: Piston | None
    piston_clients: list[KeepAliveHttp]
    runs: dict[str, list[Run]] = field(default_factory=dict)
    background: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def groups(self) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {"worker": [self.stack.procs[n].pid for n in self.stack.worker_names()]}
        for name in ("api", "soketi", "redis"):
            groups[name] = [self.stack.procs[name].pid]
        return groups


def measured(b: Bench, body: Callable[[], tuple[list[str], dict[str, Any]]], ours: bool) -> Run:
    """Time `body` (wall) and take the host CPU over it plus the settle time."""
    groups = b.groups() if ours else None
    deployment = b.stack.deployment if ours else None
    before = cpu.snapshot(groups, deployment)
    t0 = time.perf_counter()
    errors, extra = body()
    wall = time.perf_counter() - t0
    time.sleep(b.args.settle_s)
    after = cpu.snapshot(b.groups() if ours else None, deployment)
    return Run(wall, cpu.per_job_ms(before, after, 1), errors, extra)


def series_batch(b: Bench) -> Run:
    job: dict[str, str] = {}

    def body() -> tuple[list[str], dict[str, Any]]:
        job["id"] = job_id = submit(b.batch_client, batch_body(b.cases))
        output = wait_output(b.batch_client, job_id)
        accepted, problems = check_batch(output, b.cases)
        extra = {"job_id": job_id, "accepted": accepted, "worker_duration_ms": output.get("durationMs"),
                 "cases_cpu_ms": output.get("cpuMs")}  # fmt: skip
        return problems, extra

    try:
        run = measured(b, body, ours=True)
    except RuntimeError as exc:
        return Run(float("nan"), {"total": float("nan")}, [f"batch: {exc}"], {"accepted": 0})
    verdicts, compiles, problems = replay_batch(b.api, job["id"], b.cases)
    run.extra.update({"test_result_verdicts": verdicts, "compiles": compiles})
    run.errors.extend(problems)
    return run


def pooled(clients: list[Any], cases: list[Case], one: Callable[[Any, Case], None]) -> tuple[list[str], dict[str, Any]]:
    """One thread per client, each taking the next case until none is left."""
    todo: queue.SimpleQueue[Case] = queue.SimpleQueue()
    for case in cases:
        todo.put(case)
    errors: list[str] = []
    done: list[float] = []

    def loop(client: Any) -> None:
        while True:
            try:
                case = todo.get_nowait()
            except queue.Empty:
                return
            t0 = time.perf_counter()
            try:
                one(client, case)
            except Exception as exc:  # counted and reported, the others go on
                errors.append(repr(exc)[:400])
            else:
                done.append((time.perf_counter() - t0) * 1000)

    threads = [
        threading.Thread(target=loop, args=(c,), name=f"grading-client-{i}", daemon=True) for i, c in enumerate(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(SERIES_TIMEOUT_S)
    if any(thread.is_alive() for thread in threads):
        errors.append(f"a client thread was still busy after {SERIES_TIMEOUT_S:.0f} s")
    extra = {"ok": len(done), "per_case_p50_ms": round(statistics.median(done), 1) if done else None}
    return errors, extra


def one_job(client: KeepAliveHttp, case: Case) -> None:
    job_id = submit(client, single_body(case))
    check_single(wait_output(client, job_id), case, job_id)


def series_jobs(b: Bench) -> Run:
    return measured(b, lambda: pooled(b.job_clients, b.cases, one_job), ours=True)


def series_piston(b: Bench) -> Run:
    piston = b.piston
    assert piston is not None
    return measured(b, lambda: pooled(b.piston_clients, b.cases, functools.partial(piston_run, piston)), ours=False)


SERIES: dict[str, tuple[str, Callable[[Bench], Run]]] = {
    "a": ("(a) one batch job, compile once", series_batch),
    "b": ("(b) separate jobs, one compile each", series_jobs),
    "c": ("(c) Piston, one execute per case", series_piston),
}


def background_ms_per_s(seconds: float) -> float:
    before = cpu.snapshot()
    time.sleep(seconds)
    after = cpu.snapshot()
    return (after.host_ms - before.host_ms - (after.client_ms - before.client_ms)) / (after.at - before.at)


# ---------------------------------------------------------------- report


def _spread(values: list[float]) -> dict[str, float] | None:
    values = [v for v in values if v == v]  # without NaN (a failed series)
    if not values:
        return None
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def _rounded(spread: dict[str, float] | None) -> dict[str, float] | None:
    return None if spread is None else {k: round(v, 3) for k, v in spread.items()}


def _fmt(values: list[float], scale: float = 1.0, digits: int = 2) -> str:
    s = _spread(values)
    if s is None:
        return "-"
    return " / ".join(f"{s[k] * scale:.{digits}f}" for k in ("min", "median", "max"))


def _vs(values: list[float], reference: list[float]) -> str:
    mine, ref = _spread(values), _spread(reference)
    if mine is None or ref is None or ref["median"] == 0:
        return "-"
    return f"{mine['median'] / ref['median']:.2f}x"


def print_table(b: Bench) -> None:
    n = len(b.cases)
    walls = {key: [r.wall_s for r in runs] for key, runs in b.runs.items()}
    cpus = {key: [r.cpu_ms["total"] for r in runs] for key, runs in b.runs.items()}
    label_w = max(len(SERIES[key][0]) for key in b.runs) + 2
    head = (f"{'series':<{label_w}}{'wall s min / med / max':>26}  {'vs (a)':>7}  "
            f"{'host CPU s min / med / max':>28}  {'vs (a)':>7}  {'CPU ms/case':>11}")  # fmt: skip
    print(f"{n} cases, {b.args.reps} repetition(s), {b.args.clients} client threads for (b) and (c)")
    print(head)
    print("-" * len(head))
    for key in b.runs:
        cpu_med = _spread(cpus[key])
        per_case = f"{cpu_med['median'] / n:.1f}" if cpu_med else "-"
        print(
            f"{SERIES[key][0]:<{label_w}}{_fmt(walls[key]):>26}  {_vs(walls[key], walls['a']):>7}  "
            f"{_fmt(cpus[key], 1 / 1000):>28}  {_vs(cpus[key], cpus['a']):>7}  {per_case:>11}"
        )
    if b.piston is None:
        print("(c) Piston: left out, PISTON_URL is not set")
    for key in ("a", "b"):
        parts = [k for k in b.runs[key][0].cpu_ms if k != "total"] if b.runs.get(key) else []
        if parts:
            shown = ", ".join(f"{k} {statistics.median(r.cpu_ms[k] for r in b.runs[key]) / 1000:.2f}" for k in parts)
            stack_s = statistics.median(sum(r.cpu_ms[k] for k in STACK_PARTS if k in r.cpu_ms) for r in b.runs[key])
            print(
                f"CPU s of {SERIES[key][0][:3]} (medians): {shown}; the stack's own ({'+'.join(STACK_PARTS)}) {stack_s / 1000:.2f}"
            )
    for index, run in enumerate(b.runs.get("a", [])):
        verdicts = run.extra.get("test_result_verdicts", {})
        print(
            f"(a) rep {index + 1}: RunResult {run.extra.get('accepted', 0)}/{n} accepted; test_result events "
            f"{sum(verdicts.values())} ({', '.join(f'{v} {k}' for k, v in sorted(verdicts.items())) or 'none'}); "
            f"compiles {run.extra.get('compiles', '?')}; worker durationMs {run.extra.get('worker_duration_ms')}"
        )
    if b.background:
        print(
            f"background host CPU before each repetition, nothing submitted: {_fmt(b.background, 1, 0)} ms/s (min / med / max)"
        )
    for note in b.notes:
        print(f"note: {note}")
    failures = [(key, i, e) for key, runs in b.runs.items() for i, r in enumerate(runs) for e in r.errors]
    for key, index, error in failures[:30]:
        print(f"FAILED {SERIES[key][0][:3]} rep {index + 1}: {error}")
    if len(failures) > 30:
        print(f"… and {len(failures) - 30} more failures")


def to_json(b: Bench, baseline: str) -> dict[str, Any]:
    def clean(v: float) -> float | None:
        return None if v != v else round(v, 3)

    return {
        "baseline": baseline,
        "settings": {k: v for k, v in vars(b.args).items() if k != "json"},
        "cases": len(b.cases),
        "series": {
            key: {
                "label": SERIES[key][0],
                "wall_s": [clean(r.wall_s) for r in runs],
                "host_cpu_ms": [clean(r.cpu_ms["total"]) for r in runs],
                "wall_s_spread": _rounded(_spread([r.wall_s for r in runs])),
                "host_cpu_ms_spread": _rounded(_spread([r.cpu_ms["total"] for r in runs])),
                "cpu_ms_parts": [r.cpu_ms for r in runs],
                "checks": [r.extra for r in runs],
                "errors": [r.errors for r in runs],
            }
            for key, runs in b.runs.items()
        },
        "background_host_ms_per_s": [round(v, 1) for v in b.background],
        "notes": b.notes,
    }


# ---------------------------------------------------------------- main


def warm_up(b: Bench) -> None:
    """Unmeasured: the compiler's files in the page cache, warm jails, open connections."""
    few = b.cases[: min(4, len(b.cases))]
    job_id = submit(b.batch_client, batch_body(few))
    _, problems = check_batch(wait_output(b.batch_client, job_id), few)
    if problems:
        b.notes.append(f"warm-up batch: {problems[0]}")
    errors, _ = pooled(b.job_clients, b.cases[: len(b.job_clients)], one_job)
    if errors:
        b.notes.append(f"warm-up jobs: {errors[0]}")
    if b.piston is not None:
        piston = b.piston
        errors, _ = pooled(b.piston_clients, b.cases[: len(b.piston_clients)], functools.partial(piston_run, piston))
        if errors:
            raise SystemExit(f"Piston fails the warm-up: {errors[0]}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3, help="repetitions (default 3)")
    parser.add_argument("--cases", type=int, default=50, help="test cases, 1-100 (default 50)")
    parser.add_argument("--clients", type=int, default=4, help="client threads for (b) and (c) (default 4)")
    parser.add_argument(
        "--settle-s", type=float, default=1.0, help="CPU counted this long after a series' last answer (default 1)"
    )
    parser.add_argument(
        "--idle-s", type=float, default=2.0, help="background CPU sampled before each repetition (0: skip)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    if not 1 <= args.cases <= 100:
        parser.error("--cases takes 1 to 100 (the API's limit for one batch)")
    if args.reps < 1 or args.clients < 1:
        parser.error("--reps and --clients take at least 1")
    return args


def main() -> int:
    args = parse_args()
    piston = piston_from_env("c", "PISTON_C_VERSION")
    baseline = piston.describe() if piston else "none (PISTON_URL not set: series (c) left out)"
    print(f"Piston: {baseline}", flush=True)
    stack = Stack(extra_env={"LOG_LEVEL": "WARNING"})
    try:
        stack.start()
    except StackError as exc:
        logs = {name: stack.log(name)[-2000:] for name in ("worker", "api")}
        stack.cleanup()
        shown = "\n".join(f"--- {name}.log (end)\n{text}" for name, text in logs.items() if text)
        raise SystemExit(f"the stack did not start: {exc}\n{shown}") from None
    api = Api(stack)
    b = Bench(
        args, stack, api, make_cases(args.cases), api_client(stack, CLIENT_TIMEOUT_S),
        [api_client(stack, CLIENT_TIMEOUT_S) for _ in range(args.clients)],
        piston, [piston.client() for _ in range(args.clients)] if piston else [],
    )  # fmt: skip
    order = ["a", "b"] + (["c"] if piston else [])
    try:
        warm_up(b)
        for rep in range(args.reps):
            if args.idle_s > 0:
                b.background.append(background_ms_per_s(args.idle_s))
            for key in order if rep % 2 == 0 else list(reversed(order)):
                run = SERIES[key][1](b)
                b.runs.setdefault(key, []).append(run)
                status = f"{len(run.errors)} failed checks" if run.errors else "checks ok"
                print(f"rep {rep + 1}/{args.reps}: {SERIES[key][0]}: {run.wall_s:.2f} s, "
                      f"host CPU {run.cpu_ms['total'] / 1000:.2f} s, {status}", flush=True)  # fmt: skip
    finally:
        for client in [b.batch_client, *b.job_clients, *b.piston_clients]:
            client.close()
        api.close()
        stack.cleanup()
    b.runs = {key: b.runs[key] for key in order if key in b.runs}
    print()
    print_table(b)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(to_json(b, baseline), indent=2) + "\n")
    return 1 if any(r.errors for runs in b.runs.values() for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
