"""Interactive figures with pusher-js: stdin round trip and kill latency (issue: IDE loop).

    stdin round trip  POST /v1/jobs/:id/stdin sent … the program's echo of that line
                      arriving at a pusher-js subscriber (200 lines, paced under 30/s)
    kill latency      POST /v1/jobs/:id/kill sent … the `result` arriving (30 runs)

Each repetition runs both series against one private stack; the report gives p50/p90 per
repetition and min/median/max of those over the repetitions (this VM is noisy).

    .venv/bin/python bench/interactive.py [--reps 3] [--lines 200] [--kills 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import pct
from launcher.node import find_node
from launcher.stack import Stack
from shared.paths import REPO_ROOT


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--lines", type=int, default=200)
    parser.add_argument("--kills", type=int, default=30)
    args = parser.parse_args()
    stack = Stack(extra_env={"WORKER_MAX_SANDBOXES": "2", "LOG_LEVEL": "WARNING"})
    stack.start()
    rows: dict[str, list[tuple[float, float]]] = {"stdin": [], "kill": []}
    try:
        for rep in range(args.reps):
            done = subprocess.run(
                [find_node(), str(REPO_ROOT / "bench/interactive.mjs"), stack.api_url, stack.api_token,
                 str(args.lines), str(args.kills)],
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            if done.returncode != 0:
                print(done.stderr[-3000:], file=sys.stderr)
                return 1
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            for name in rows:
                samples = figures[name]
                rows[name].append((pct(samples, 50), pct(samples, 90)))
                print(f"rep {rep + 1}: {name:5s} n={len(samples)} p50={pct(samples, 50):.1f} ms p90={pct(samples, 90):.1f} ms "
                      f"min={min(samples):.1f} max={max(samples):.1f}", flush=True)  # fmt: skip
    finally:
        stack.cleanup()
    print("\nseries                 p50 min/median/max (ms)      p90 min/median/max (ms)")
    for name, label in (("stdin", "stdin round trip"), ("kill", "kill → result")):
        p50s = [r[0] for r in rows[name]]
        p90s = [r[1] for r in rows[name]]
        print(f"{label:22s} {min(p50s):6.1f} / {statistics.median(p50s):6.1f} / {max(p50s):6.1f}"
              f"      {min(p90s):6.1f} / {statistics.median(p90s):6.1f} / {max(p90s):6.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
