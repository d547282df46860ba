"""What a fresh, fully isolated process costs on this machine: the floor under every job.

Issue 9 asks the hot path to reach "the physical floor of a fresh, fully isolated process".
This measures that floor without any of our service: nsjail (the stacks' binary) with the
jobs' profile running `print(1)` in Python and `/bin/true`, the same profile without its
/proc and /dev masks and without its network namespace (what those layers cost), and Python
on the host with no jail at all. Each variant runs `--runs` times in a row, the variants
interleaved, `--reps` times over; the figure is the host's busy CPU (/proc/stat, all cores,
idle and iowait left out) per run, so nsjail's own work, the kernel's namespace and mount
teardown and the process all count. Run alone on a quiet machine: everything else the host
does in the meantime counts too.

    .venv/bin/python bench/floor.py [--runs 60] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.latency import bare_argv, bare_workspace

_TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")
# Time for the kernel's deferred teardown of the last run (namespaces, mounts) to land in
# the series that caused it; the same pause is left out of every series' wall time.
_SETTLE_S = 0.3


def _busy_ms() -> float:
    fields = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) * _TICK_MS


def _without_masks(profile: str) -> str:
    """The profile without its /dev/null binds over /proc files (the masks)."""
    return "\n".join(
        line for line in profile.splitlines() if not (line.startswith("mount {") and 'src: "/dev/null" dst: "/proc' in line)
    )


def variants(workspace: Path, scratch: Path) -> dict[str, list[str]]:
    jailed = bare_argv(workspace, sandboxed=True)
    config = jailed.index("--config") + 1
    split = jailed.index("--")

    def jail(program: list[str], profile: str | None = None, extra: tuple[str, ...] = ()) -> list[str]:
        argv = [*jailed[:split], *extra, "--", *program]
        if profile is not None:
            argv[config] = profile
        return argv

    unmasked = scratch / "unmasked.cfg"
    unmasked.write_text(_without_masks(Path(jailed[config]).read_text()))
    return {
        "jail, python3 print(1)": jailed,
        "jail, python3 -S print(1) (no site)": jail(["/usr/bin/python3", "-S", "-u", "main.py"]),
        "jail, /bin/true": jail(["/bin/true"]),
        "jail without the masks, /bin/true": jail(["/bin/true"], profile=str(unmasked)),
        "jail without its network namespace, /bin/true": jail(["/bin/true"], extra=("--disable_clone_newnet",)),
        "no jail, python3 print(1)": bare_argv(workspace, sandboxed=False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=60, help="runs per variant and repetition")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    workspace = bare_workspace("print(1)\n")
    scratch = Path(tempfile.mkdtemp(prefix="bench-floor-"))
    try:
        series = variants(workspace, scratch)
        cpu: dict[str, list[float]] = {name: [] for name in series}
        wall: dict[str, list[float]] = {name: [] for name in series}
        for rep in range(args.reps):
            order = list(series) if rep % 2 == 0 else list(reversed(series))
            for name in order:
                argv = series[name]
                busy, started = _busy_ms(), time.perf_counter()
                for _ in range(args.runs):
                    out = subprocess.run(argv, capture_output=True, check=False)
                    if out.returncode != 0:
                        raise SystemExit(f"{name}: exited {out.returncode}: {out.stderr.decode(errors='replace')[-500:]}")
                time.sleep(_SETTLE_S)
                wall[name].append((time.perf_counter() - started - _SETTLE_S) * 1000 / args.runs)
                cpu[name].append((_busy_ms() - busy) / args.runs)
            print(f"rep {rep + 1}/{args.reps} done", file=sys.stderr)
    finally:
        shutil.rmtree(workspace, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)

    def spread(values: list[float]) -> str:
        return f"{min(values):.1f} / {statistics.median(values):.1f} / {max(values):.1f}"

    print(f"\nper run, min / median / max of {args.reps} repetitions of {args.runs} runs")
    print(f"{'variant':48s} {'host CPU (ms)':>20s} {'wall (ms)':>20s}")
    for name in series:
        print(f"{name:48s} {spread(cpu[name]):>20s} {spread(wall[name]):>20s}")


if __name__ == "__main__":
    main()
