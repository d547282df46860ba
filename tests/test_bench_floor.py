"""bench/floor.py still runs every variant it reports (one run each): a benchmark that
rots is found here, not on the day someone needs its figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.sandbox]

ROOT = Path(__file__).resolve().parent.parent


def test_the_floor_benchmark_runs_each_variant() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "floor.py"), "--runs", "1", "--reps", "1"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith(("jail", "no jail"))]
    assert len(rows) == 6, out.stdout
    for row in rows:
        # "<variant>  cpu-min / cpu-median / cpu-max  wall-min / wall-median / wall-max"; one
        # run can fall inside one clock tick of /proc/stat, so only the wall time must show.
        figures = row.split()[-10:]
        assert figures[1] == figures[3] == figures[6] == figures[8] == "/", row
        values = [float(figures[i]) for i in (0, 2, 4, 5, 7, 9)]
        assert min(values) >= 0 and values[4] > 0, row
