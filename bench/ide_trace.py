"""Where an IDE job's milliseconds go: a hop-by-hop trace of sequential `print(1)` jobs.

latency.py says how long execute → result takes; this says which hop took it. Each job is
driven as an IDE drives it (execute, channel auth, subscribe, start, wait for the result
event) with the client's clock stamped at every step, while a Redis MONITOR connection
stamps, with the server's clock (the same host's), the writes that mark the job's way
through the worker: its `running` stage, its first output, its result. Both clocks are
wall clocks on one machine, so the hops between them line up to a few microseconds.

    .venv/bin/python bench/ide_trace.py              # 100 jobs back to back, a private stack
    .venv/bin/python bench/ide_trace.py --pace-ms 150 --raw 1

MONITOR costs Redis (and so the job) a little: compare traces with traces, and take the
headline figures from latency.py or hotpath.py. `--raw N` prints the first N jobs' Redis
commands as MONITOR saw them, to see what a hop holds.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import KeepAliveRealtime, api_client, pct
from bench.hotpath import EXPECT, PROGRAM, _answer
from bench.keepalive import KeepAliveHttp
from launcher.stack import Stack
from tests.helpers import py_job

HOPS = (
    ("execute", "execute_sent", "execute_answered"),
    ("channel auth", "auth_sent", "auth_answered"),
    ("subscribe", "auth_answered", "subscribed"),
    ("start request", "start_sent", "start_answered"),
    ("start → running logged", "start_sent", "running_logged"),
    ("running → stdout logged", "running_logged", "stdout_logged"),
    ("stdout logged → at client", "stdout_logged", "stdout_seen"),
    ("stdout logged → result logged", "stdout_logged", "result_logged"),
    ("result logged → at client", "result_logged", "result_seen"),
    ("start → result", "start_sent", "result_seen"),
    ("execute → result", "execute_sent", "result_seen"),
)


class Monitor:
    """A Redis MONITOR connection on its own thread: (server time, command words) per
    command, kept for the commands that name a job being traced."""

    def __init__(self, host: str, port: int, password: str) -> None:
        self._sock = socket.create_connection((host, port))
        secret = password.encode()
        self._sock.sendall(b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n" % (len(secret), secret))
        self._file = self._sock.makefile("rb")
        if self._file.readline().strip() != b"+OK":
            raise SystemExit("Redis refused the stack's password")
        self._sock.sendall(b"MONITOR\r\n")
        if self._file.readline().strip() != b"+OK":
            raise SystemExit("MONITOR was refused")
        self.lines: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        for raw in self._file:
            line = raw.decode(errors="replace").rstrip("\r\n")
            if not line.startswith("+"):
                continue
            stamp, _, rest = line[1:].partition(" ")
            with self._lock:
                self.lines.append((float(stamp), rest))

    def of(self, job_id: str) -> list[tuple[float, str]]:
        with self._lock:
            return [(stamp, rest) for stamp, rest in self.lines if job_id in rest]

    def close(self) -> None:
        self._sock.close()


def _words(rest: str) -> list[str]:
    # `[0 127.0.0.1:5555] "EVALSHA" "abc" "2" ...`: the quoted words, unescaped enough to match.
    return [word.strip('"') for word in rest.split('" "')]


def logged_marks(lines: list[tuple[float, str]]) -> dict[str, float]:
    """When the job's `running` stage, its first stdout and its result reached Redis."""
    marks: dict[str, float] = {}
    for stamp, rest in lines:
        words = _words(rest)
        if "running" in words:
            marks.setdefault("running_logged", stamp)
        if any("stdout" in word for word in words) and "running_logged" in marks:
            marks.setdefault("stdout_logged", stamp)
        if any("outcome" in word for word in words):
            marks.setdefault("result_logged", stamp)
    return marks


def trace_one(http: KeepAliveHttp, rt: KeepAliveRealtime) -> tuple[dict[str, float], str]:
    """One job as hotpath.py's row 1 drives it (the same lean client), stamped at each step."""
    marks: dict[str, float] = {}
    original_auth = rt._auth

    def stamped_auth(client: Any, channel: str) -> str:
        marks["auth_sent"] = time.time()
        answer = original_auth(client, channel)
        marks["auth_answered"] = time.time()
        return answer

    rt._auth = stamped_auth  # type: ignore[method-assign]
    try:
        marks["execute_sent"] = time.time()
        job = _answer(http.post("/v1/execute", json=py_job(PROGRAM)), 202, "execute")
        marks["execute_answered"] = time.time()
        followed = rt.follow(job)
        marks["subscribed"] = time.time()
    finally:
        rt._auth = original_auth  # type: ignore[method-assign]
    channel = rt.pusher.channels[job["channel"]]
    channel.bind("stdout", lambda _data: marks.setdefault("stdout_seen", time.time()))
    channel.bind("result", lambda _data: marks.setdefault("result_seen", time.time()))
    token = {"Authorization": f"Bearer {job['jobToken']}"}
    marks["start_sent"] = time.time()
    _answer(http.post(f"/v1/jobs/{job['jobId']}/start", headers=token), 202, "start")
    marks["start_answered"] = time.time()
    result = followed.wait_result(timeout_s=60)
    if result["outcome"] != "completed" or followed.text("stdout") != EXPECT:
        raise SystemExit(f"job misbehaved: {result} {followed.summary()}")
    rt.pusher.unsubscribe(job["channel"])
    return marks, job["jobId"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", type=int, default=100, help="traced jobs (default 100)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--pace-ms", type=float, default=0, help="pause between jobs (default: back to back)")
    parser.add_argument("--raw", type=int, default=0, help="print the first N jobs' Redis commands")
    parser.add_argument("--json", type=Path, help="also write each job's marks to this file")
    args = parser.parse_args()

    stack = Stack(extra_env={"LOG_LEVEL": "WARNING"})
    stack.start()
    traced: list[tuple[dict[str, float], str]] = []
    try:
        http = api_client(stack)
        rt = KeepAliveRealtime(stack, http)
        monitor = Monitor("127.0.0.1", stack.redis_port, stack.redis_password)
        try:
            for i in range(args.warmup + args.n):
                marks, job_id = trace_one(http, rt)
                if i >= args.warmup:
                    traced.append((marks, job_id))
                if args.pace_ms:
                    time.sleep(args.pace_ms / 1000)
            time.sleep(0.2)  # the last commands' MONITOR lines
            for marks, job_id in traced:
                marks.update(logged_marks(monitor.of(job_id)))
            for _, job_id in traced[: args.raw]:
                print(f"--- {job_id}")
                for stamp, rest in monitor.of(job_id):
                    print(f"{stamp:.6f} {rest[:300]}")
        finally:
            monitor.close()
            rt.close()
            http.close()
    finally:
        stack.cleanup()

    print(f"{len(traced)} jobs, {'paced ' + format(args.pace_ms, 'g') + ' ms' if args.pace_ms else 'back to back'}")
    print(f"{'hop':<32}{'p50 ms':>9}{'p90 ms':>9}{'min ms':>9}{'jobs':>6}")
    figures: dict[str, Any] = {}
    for name, start, end in HOPS:
        spans = [(m[end] - m[start]) * 1000 for m, _ in traced if start in m and end in m]
        if not spans:
            print(f"{name:<32}{'(not seen)':>27}")
            continue
        figures[name] = {"p50_ms": round(statistics.median(spans), 2), "p90_ms": round(pct(spans, 90), 2)}
        print(f"{name:<32}{statistics.median(spans):>9.2f}{pct(spans, 90):>9.2f}{min(spans):>9.2f}{len(spans):>6}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"hops": figures, "jobs": [m for m, _ in traced]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
