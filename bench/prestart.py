"""Prestarted runtimes as an IDE feels them, per language, next to the same stack without.

For each language with a prestart shim (Python, JavaScript, Ruby), sequential IDE jobs
printing one line: POST /v1/execute, subscribe (pysher, channel auth included), a short
pause as a person's click would leave, POST /start, then
    start → first stdout   POST /start sent … the first `stdout` event received
    start → result         POST /start sent … the `result` event received
on two private stacks with default settings: one as shipped (WORKER_PRESTART follows the
language; slots prime for the language of their last job) and one with WORKER_PRESTART=off
(every job execs its interpreter fresh in a warm jail). Each repetition runs every
language on both stacks, the order flipped in odd repetitions; the table gives min /
median / max of the per-repetition p50s.

    .venv/bin/python bench/prestart.py                       # 3 repetitions, 25 jobs each
    .venv/bin/python bench/prestart.py --only javascript --jobs 40 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import KeepAliveRealtime, first_arrival, pct
from launcher.stack import Stack
from tests.helpers import Api

PROGRAMS = {
    "python": ("main.py", "print(1)\n"),
    "javascript": ("main.js", "console.log(1)\n"),
    "ruby": ("main.rb", "puts 1\n"),
}
EXPECT = "1\n"
# Between subscribing and starting: an IDE's Run click follows the page's submit by more.
PAUSE_S = 0.05
WARMUP_JOBS = 4


class Side:
    def __init__(self, name: str, prestart: str) -> None:
        self.name = name
        self.stack = Stack(extra_env={"WORKER_PRESTART": prestart})
        self.stack.start()
        self.api = Api(self.stack)
        self.rt = KeepAliveRealtime(self.stack, self.api)

    def close(self) -> None:
        self.rt.close()
        self.api.close()
        self.stack.cleanup()


def ide_job(side: Side, language: str, timeout_s: float = 60) -> tuple[float, float]:
    name, content = PROGRAMS[language]
    job = side.api.execute({"language": language, "files": [{"name": name, "content": content}]})
    followed = side.rt.follow(job)
    first = first_arrival(side.rt, job["channel"], "stdout")
    time.sleep(PAUSE_S)
    t0 = time.perf_counter()
    side.api.start(job)
    result = followed.wait_result(timeout_s)
    t1 = time.perf_counter()
    side.rt.pusher.unsubscribe(job["channel"])
    if result["outcome"] != "completed" or followed.text("stdout") != EXPECT or not first:
        raise SystemExit(f"{language} job misbehaved on {side.name}: {result} {followed.summary()}")
    return (first[0] - t0) * 1000, (t1 - t0) * 1000


def series(side: Side, language: str, jobs: int) -> dict[str, float]:
    for _ in range(WARMUP_JOBS):  # the slots follow this language from here on
        ide_job(side, language)
    runs = [ide_job(side, language) for _ in range(jobs)]
    return {"first_stdout": pct([r[0] for r in runs], 50), "result": pct([r[1] for r in runs], 50)}


def spread(values: list[float]) -> str:
    return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=25, help="measured jobs per language, side and repetition")
    parser.add_argument("--only", nargs="*", default=list(PROGRAMS), choices=list(PROGRAMS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    sides = [Side("prestarted", "python"), Side("off", "off")]
    figures: dict[str, dict[str, dict[str, list[float]]]] = {
        language: {side.name: {"first_stdout": [], "result": []} for side in sides} for language in args.only
    }
    try:
        for rep in range(args.reps):
            for language in args.only:
                for side in sides if rep % 2 == 0 else reversed(sides):
                    for key, value in series(side, language, args.jobs).items():
                        figures[language][side.name][key].append(value)
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
    finally:
        for side in sides:
            side.close()

    print(f"\n{'language':<12} {'figure (p50, ms)':<24} {'prestarted min/med/max':>24} {'off min/med/max':>24}  ratio")
    for language, by_side in figures.items():
        for key, label in (("first_stdout", "start → first stdout"), ("result", "start → result")):
            on, off = by_side["prestarted"][key], by_side["off"][key]
            ratio = statistics.median(on) / statistics.median(off)
            print(f"{language:<12} {label:<24} {spread(on):>24} {spread(off):>24}  {ratio:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
