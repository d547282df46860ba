"""Chaos run: many clients, a fleet of workers killed at random, Redis restarted once.

A private stack with `--workers` workers under the stack's supervisor (a worker that dies
is restarted with backoff) and Redis with its append-only file (`appendfsync everysec`).
`--clients` client threads, each with ONE reused HTTP client, submit `--jobs` short Python
programs between them (with an Idempotency-Key, so a retried submit never makes a second
job), start each right after submitting it and read its events from the durable log over
SSE (resuming with `?after=` when the stream breaks); `--followers` of them also follow
every job live with a Pusher client (pysher). Meanwhile a loop SIGKILLs a random worker
every few seconds and, once `--redis-at` of the jobs were submitted, restarts Redis.

Then it settles and checks, from Redis and the worker logs:
  - every job reached a terminal state (must be 0 without one);
  - no program was launched twice: one `stage{running}` at most per job in its durable
    log, one "run <i>" line at most in its stdout, and at most one worker log line naming
    a run of it (a finished run's `job <id>: <outcome> exit=` or a reaper's `marked lost`);
  - exactly one `result` per job, in the log and (followers) live;
and prints a summary table.

    .venv/bin/python bench/chaos.py                       # 500 jobs, 8 clients, 3 workers
    .venv/bin/python bench/chaos.py --jobs 100 --json bench/results/chaos.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import re
import secrets
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launcher.stack import Stack
from shared.paths import REPO_ROOT
from tests.helpers import Followed, Realtime, py_job

TERMINAL = {"done", "killed", "error", "expired", "lost"}
RETRY_FOR_S = 90.0


@dataclass
class Track:
    index: int
    sleep_ms: int
    job_id: str | None = None
    submitted_at: float = 0.0
    ended_at: float = 0.0
    sse_outcome: str | None = None
    sse_results: int = 0
    sse_reconnects: int = 0
    live_results: int | None = None  # followers only
    live_matches_log: bool | None = None
    errors: list[str] = field(default_factory=list)

    def program(self) -> str:
        return f"import time\nprint('run {self.index}', flush=True)\ntime.sleep({self.sleep_ms / 1000})\nprint('done {self.index}')\n"

    def expected_stdout(self) -> str:
        return f"run {self.index}\ndone {self.index}\n"


class Tally:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def add(self, what: str, n: int = 1) -> None:
        with self.lock:
            self.counts[what] += n


def _retry_after(response: httpx.Response) -> float:
    try:
        return max(0.05, float(response.json().get("retryAfterMs", 500)) / 1000)
    except Exception:
        return 0.5


def call(http: httpx.Client, tally: Tally, method: str, path: str, ok: set[int], **kwargs: Any) -> httpx.Response:
    """One API call, retried on 503, 429 and broken connections (Redis restarting, a busy
    queue) for up to RETRY_FOR_S."""
    deadline = time.monotonic() + RETRY_FOR_S
    while True:
        try:
            response = http.request(method, path, **kwargs)
            if response.status_code in ok:
                return response
            if response.status_code in (429, 503) and time.monotonic() < deadline:
                tally.add(f"{method} {path.split('/')[-1] or path} -> {response.status_code} (retried)")
                time.sleep(_retry_after(response))
                continue
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text[:200]}")
        except httpx.TransportError as exc:
            if time.monotonic() >= deadline:
                raise
            tally.add(f"{method} {path.split('/')[-1]} -> {type(exc).__name__} (retried)")
            time.sleep(0.3)


def read_events(http: httpx.Client, tally: Tally, track: Track, timeout_s: float) -> list[tuple[str, dict[str, Any]]]:
    """Every event of the job from the durable log (SSE) until its result, resuming after
    the last seq seen whenever the stream breaks."""
    events: list[tuple[str, dict[str, Any]]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        after = events[-1][1]["seq"] if events else None
        params = {} if after is None else {"after": str(after)}
        try:
            with http.stream("GET", f"/v1/jobs/{track.job_id}/events", params=params, timeout=httpx.Timeout(10, read=60)) as r:
                if r.status_code in (429, 503):
                    tally.add(f"GET events -> {r.status_code} (retried)")
                    r.read()
                    time.sleep(_retry_after(r))
                    continue
                if r.status_code != 200:
                    raise RuntimeError(f"events: {r.status_code} {r.read()[:200]!r}")
                name = data = None
                for line in r.iter_lines():
                    if line.startswith("event: "):
                        name = line[7:]
                    elif line.startswith("data: "):
                        data = json.loads(line[6:])
                    elif line == "" and name is not None:
                        events.append((name, data))  # type: ignore[arg-type]
                        if name == "result":
                            return events
                        name = data = None
        except httpx.TransportError:
            pass
        track.sse_reconnects += 1
        tally.add("GET events -> stream broke (resumed)")
        time.sleep(0.3)
    track.errors.append("no result over SSE in time")
    return events


def client(
    number: int, stack: Stack, tracks: list[Track], next_index: Any, run_id: str, follow: bool, tally: Tally,
    submitted: list[int],
) -> None:  # fmt: skip
    http = httpx.Client(base_url=stack.api_url, headers={"Authorization": f"Bearer {stack.api_token}"}, timeout=15)
    rt = Realtime(stack) if follow else None
    try:
        while True:
            with tally.lock:
                i = next(next_index)
            if i >= len(tracks):
                return
            track = tracks[i]
            try:
                track.submitted_at = time.monotonic()
                response = call(
                    http, tally, "POST", "/v1/execute", {200, 202},
                    json=py_job(track.program()), headers={"Idempotency-Key": f"chaos-{run_id}-{i}"},
                )  # fmt: skip
                job = response.json()
                track.job_id = job["jobId"]
                with tally.lock:
                    submitted[0] += 1
                followed: Followed | None = None
                if rt is not None:
                    try:
                        followed = rt.follow(job, timeout_s=5)
                    except Exception as exc:
                        track.errors.append(f"live follow failed: {exc}")
                call(http, tally, "POST", f"/v1/jobs/{track.job_id}/start", {202})
                events = read_events(http, tally, track, timeout_s=180)
                track.ended_at = time.monotonic()
                results = [p for n, p in events if n == "result"]
                track.sse_results = len(results)
                track.sse_outcome = results[-1]["outcome"] if results else None
                if track.sse_outcome == "completed":
                    stdout = "".join(p["chunk"] for n, p in events if n == "stdout")
                    if stdout != track.expected_stdout():
                        track.errors.append(f"stdout {stdout!r}")
                if followed is not None and rt is not None:
                    followed.finished.wait(5)
                    time.sleep(0.2)  # room for a second result, should there be one
                    live = followed.results()
                    track.live_results = len(live)
                    track.live_matches_log = bool(live) and live[0] == results[-1]
                    rt.pusher.unsubscribe(job["channel"])
            except Exception as exc:
                track.errors.append(f"client {number}: {exc!r}")
    finally:
        if rt is not None:
            rt.close()
        http.close()


def chaos(
    stack: Stack, stop: threading.Event, rng: random.Random, kill_every: tuple[float, float], redis_due: threading.Event,
    redis_down_s: float, redis_sig: int, record: dict[str, Any],
) -> None:  # fmt: skip
    kills: list[dict[str, Any]] = record.setdefault("kills", [])
    t0 = record["t0"]
    while not stop.wait(rng.uniform(*kill_every)):
        if redis_due.is_set() and "redis_restart" not in record:
            at = time.monotonic() - t0
            unreachable = stack.restart("redis", down_s=redis_down_s, sig=redis_sig)
            record["redis_restart"] = {"at_s": round(at, 1), "unreachable_s": round(unreachable, 2)}
            print(f"[{at:6.1f}s] redis restarted ({signal.Signals(redis_sig).name}, unreachable {unreachable:.2f} s)", flush=True)
            continue
        with stack._lock:
            alive = [n for n in stack.worker_names() if stack.procs[n].poll() is None]
        if not alive:
            continue
        victim = rng.choice(alive)
        worker_id = stack.worker_ids[victim]
        stack.kill_worker(victim, signal.SIGKILL)
        at = time.monotonic() - t0
        kills.append({"at_s": round(at, 1), "name": victim, "id": worker_id})
        print(f"[{at:6.1f}s] SIGKILL {victim} ({worker_id})", flush=True)


FINISH_LINE = re.compile(r"job (\S+): (\w+) exit=")
LOST_LINE = re.compile(r"job (\S+): worker (\S+) lost it after the program started; marked lost")
FENCED_LINE = re.compile(r"job (\S+): lease lost to another worker")
REQUEUED_LINE = re.compile(r"job (\S+): its program had not started; re-queued")


def analyse(stack: Stack, tracks: list[Track]) -> dict[str, Any]:
    """What Redis and the worker logs say about every job."""
    logs = "\n".join(stack.log(name) for name in stack.worker_names())
    finished = Counter(m.group(1) for m in FINISH_LINE.finditer(logs))
    lost_lines = Counter(m.group(1) for m in LOST_LINE.finditer(logs))
    fenced = Counter(m.group(1) for m in FENCED_LINE.finditer(logs))
    requeued = Counter(m.group(1) for m in REQUEUED_LINE.finditer(logs))
    states: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    no_terminal: list[str] = []
    twice_running: list[str] = []
    twice_stdout: list[str] = []
    twice_in_logs: list[str] = []
    results_not_one: list[str] = []
    gaps: list[str] = []
    with stack.redis() as redis:
        for track in tracks:
            if track.job_id is None:
                continue
            job_id = track.job_id
            status = {k.decode(): v.decode() for k, v in redis.hgetall(f"job:{job_id}:status").items()}
            state = status.get("state", "<missing>")
            states[state] += 1
            if state not in TERMINAL:
                no_terminal.append(job_id)
            else:
                outcomes[json.loads(status["result"])["outcome"]] += 1
            log = redis.xrange(f"job:{job_id}:events")
            seqs = [int(f[b"seq"]) for _, f in log]
            if seqs != list(range(len(seqs))):
                gaps.append(job_id)
            names = [f[b"name"].decode() for _, f in log]
            running = sum(1 for _, f in log if f[b"name"] == b"stage" and json.loads(f[b"data"])["phase"] == "running")
            stdout = "".join(f[b"chunk"].decode() for _, f in log if f[b"name"] == b"stdout")
            if running > 1:
                twice_running.append(job_id)
            if stdout.count(f"run {track.index}\n") > 1:
                twice_stdout.append(job_id)
            if finished[job_id] + lost_lines[job_id] > 1:
                twice_in_logs.append(job_id)
            if names.count("result") != 1:
                results_not_one.append(job_id)
        leftovers = {
            "queue": redis.llen("jobs:queue"),
            "claims": sum(redis.llen(k) for k in redis.scan_iter("worker:*:claimed")),
        }
    return {
        "states": dict(states),
        "outcomes": dict(outcomes),
        "no_terminal": no_terminal,
        "launched_twice_stage_running": twice_running,
        "launched_twice_stdout": twice_stdout,
        "launched_twice_worker_logs": twice_in_logs,
        "results_not_exactly_one": results_not_one,
        "seq_gaps": gaps,
        "log_lines": {
            "finished_runs": sum(finished.values()),
            "marked_lost": sum(lost_lines.values()),
            "fenced_off": sum(fenced.values()),
            "requeued_unstarted": sum(requeued.values()),
        },
        "leftovers": leftovers,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=500)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--followers", type=int, default=2, help="clients that also follow live with pysher")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--slots", type=int, default=2, help="WORKER_MAX_SANDBOXES of each worker")
    parser.add_argument("--heartbeat-ms", type=int, default=500)
    parser.add_argument("--lease-ms", type=int, default=3000)
    parser.add_argument("--kill-every", type=float, nargs=2, default=(2.0, 5.0), metavar=("MIN_S", "MAX_S"))
    parser.add_argument("--redis-at", type=float, default=0.4, help="restart Redis once this share of jobs was submitted")
    parser.add_argument("--redis-down-s", type=float, default=1.0)
    parser.add_argument("--redis-signal", choices=("TERM", "KILL"), default="TERM")
    parser.add_argument("--settle-s", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()

    seed = args.seed if args.seed is not None else secrets.randbelow(2**31)
    rng = random.Random(seed)
    run_id = secrets.token_hex(4)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    log_dir = REPO_ROOT / "bench" / "results" / f"chaos-{stamp}"
    stack = Stack(
        workers=args.workers,
        supervise=True,
        redis_persistence=True,
        log_dir=log_dir,
        extra_env={
            "WORKER_MAX_SANDBOXES": str(args.slots),
            "WORKER_HEARTBEAT_MS": str(args.heartbeat_ms),
            "WORKER_LEASE_TTL_MS": str(args.lease_ms),
            "LOG_LEVEL": "INFO",
        },
    )
    print(f"chaos: seed {seed}, logs in {log_dir}", flush=True)
    stack.start(timeout_s=60)
    tracks = [Track(index=i, sleep_ms=rng.randint(50, 500)) for i in range(args.jobs)]
    tally = Tally()
    submitted = [0]
    next_index = itertools.count()
    stop = threading.Event()
    redis_due = threading.Event()
    record: dict[str, Any] = {"t0": time.monotonic()}
    try:
        t0 = record["t0"]
        threads = [
            threading.Thread(
                target=client,
                args=(n, stack, tracks, next_index, run_id, n < args.followers, tally, submitted),
                name=f"client-{n}",
                daemon=True,
            )
            for n in range(args.clients)
        ]
        chaos_thread = threading.Thread(
            target=chaos,
            args=(stack, stop, rng, tuple(args.kill_every), redis_due, args.redis_down_s,
                  getattr(signal, f"SIG{args.redis_signal}"), record),
            daemon=True,
        )  # fmt: skip
        for t in threads:
            t.start()
        chaos_thread.start()
        last_report = 0.0
        while any(t.is_alive() for t in threads):
            time.sleep(0.2)
            if submitted[0] >= args.redis_at * args.jobs:
                redis_due.set()
            now = time.monotonic() - t0
            if now - last_report >= 10:
                last_report = now
                done = sum(1 for t in tracks if t.ended_at)
                print(f"[{now:6.1f}s] submitted {submitted[0]}, ended {done}", flush=True)
            if submitted[0] >= args.jobs and not stop.is_set():
                stop.set()  # every job is in: no more kills, let the fleet settle
                print(f"[{now:6.1f}s] all jobs submitted; chaos stops", flush=True)
        stop.set()
        chaos_thread.join(60)
        clients_done = time.monotonic() - t0
        # Settle: every job must reach a terminal state.
        deadline = time.monotonic() + args.settle_s
        while time.monotonic() < deadline:
            with stack.redis() as redis:
                pending = [
                    t.job_id for t in tracks
                    if t.job_id and (redis.hget(f"job:{t.job_id}:status", "state") or b"").decode() not in TERMINAL
                ]  # fmt: skip
            if not pending:
                break
            time.sleep(0.5)
        wall = time.monotonic() - t0
        found = analyse(stack, tracks)
    finally:
        stop.set()
        stack.cleanup()  # the logs stay in log_dir

    restarts = list(stack.restarts)
    live_tracked = [t for t in tracks if t.live_results is not None]
    figures = {
        "seed": seed,
        "jobs": args.jobs,
        "clients": args.clients,
        "followers": args.followers,
        "workers": args.workers,
        "slots_per_worker": args.slots,
        "heartbeat_ms": args.heartbeat_ms,
        "lease_ms": args.lease_ms,
        "submitted": sum(1 for t in tracks if t.job_id),
        "results_received_sse": sum(1 for t in tracks if t.sse_results >= 1),
        "sse_results_per_job_max": max((t.sse_results for t in tracks), default=0),
        "no_terminal_state": len(found["no_terminal"]),
        "launched_twice": len(
            set(found["launched_twice_stage_running"])
            | set(found["launched_twice_stdout"])
            | set(found["launched_twice_worker_logs"])
        ),
        "launched_twice_detail": {
            "stage_running": len(found["launched_twice_stage_running"]),
            "stdout_marker": len(found["launched_twice_stdout"]),
            "worker_logs": len(found["launched_twice_worker_logs"]),
        },
        "results_not_exactly_one": len(found["results_not_exactly_one"]),
        "seq_gaps": len(found["seq_gaps"]),
        "outcomes": found["outcomes"],
        "lost": found["outcomes"].get("lost", 0),
        "states": found["states"],
        "completed_with_wrong_stdout": sum(1 for t in tracks if any(e.startswith("stdout") for e in t.errors)),
        "client_errors": sum(1 for t in tracks if t.errors and not all(e.startswith("stdout") for e in t.errors)),
        "live_followed": len(live_tracked),
        "live_result_missing": sum(1 for t in live_tracked if t.live_results == 0),
        "live_result_twice": sum(1 for t in live_tracked if (t.live_results or 0) > 1),
        "live_result_differs_from_log": sum(1 for t in live_tracked if t.live_results and not t.live_matches_log),
        "worker_kills": len(record.get("kills", [])),
        "worker_restarts": sum(1 for r in restarts if r.new_id),
        "longest_restart_delay_s": max((r.delay_s for r in restarts), default=0.0),
        "redis_restart": record.get("redis_restart"),
        "worker_log_lines": found["log_lines"],
        "leftovers_after_settle": found["leftovers"],
        "retries": dict(tally.counts),
        "clients_done_s": round(clients_done, 1),
        "wall_s": round(wall, 1),
        "logs": str(log_dir),
    }
    examples = {k: found[k][:5] for k in ("no_terminal", "launched_twice_stage_running", "launched_twice_worker_logs",
                                          "results_not_exactly_one", "seq_gaps") if found[k]}  # fmt: skip
    errors = [(t.index, t.job_id, t.errors) for t in tracks if t.errors][:10]
    figures["examples"] = examples
    figures["first_client_errors"] = errors

    rows = [
        ("jobs submitted", figures["submitted"]),
        ("results received (SSE)", figures["results_received_sse"]),
        ("jobs with no terminal state after settle", figures["no_terminal_state"]),
        ("jobs launched twice", f"{figures['launched_twice']}  (stage{{running}} x2: {len(found['launched_twice_stage_running'])}, "
                                f"stdout marker x2: {len(found['launched_twice_stdout'])}, worker logs x2: {len(found['launched_twice_worker_logs'])})"),
        ("jobs without exactly one result in the log", figures["results_not_exactly_one"]),
        ("jobs with a seq gap in the log", figures["seq_gaps"]),
        ("outcomes", ", ".join(f"{k} {v}" for k, v in sorted(figures["outcomes"].items()))),
        ("lost", figures["lost"]),
        ("completed with wrong stdout", figures["completed_with_wrong_stdout"]),
        ("jobs with client errors", figures["client_errors"]),
        ("followed live: result missing / twice / differs", f"{figures['live_followed']} jobs: {figures['live_result_missing']} / "
                                                            f"{figures['live_result_twice']} / {figures['live_result_differs_from_log']}"),
        ("workers SIGKILLed / restarted", f"{figures['worker_kills']} / {figures['worker_restarts']} (longest backoff {figures['longest_restart_delay_s']} s)"),
        ("redis restart", figures["redis_restart"]),
        ("worker log lines", figures["worker_log_lines"]),
        ("queue / claims left", figures["leftovers_after_settle"]),
        ("client retries", sum(tally.counts.values())),
        ("wall time", f"{figures['wall_s']} s (clients done at {figures['clients_done_s']} s)"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    print("\nchaos summary")
    print("-" * (width + 40))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    print("-" * (width + 40))
    if tally.counts:
        print("retries by kind: " + ", ".join(f"{k}: {v}" for k, v in sorted(tally.counts.items())))
    if examples:
        print("examples: " + json.dumps(examples))
    if errors:
        print("client errors (first 10): " + json.dumps(errors)[:3000])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2, default=lambda o: asdict(o)))
    ok = figures["no_terminal_state"] == 0 and figures["launched_twice"] == 0 and figures["results_not_exactly_one"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
