"""Many jobs at once on few slots: each gets exactly one result with its own output."""

from __future__ import annotations

import os
import time

import pytest

from tests.helpers import Api, Realtime, py_job

pytestmark = [pytest.mark.stack, pytest.mark.sandbox, pytest.mark.slow]


def test_twenty_jobs_on_four_slots(api: Api, realtime: Realtime) -> None:
    # Each program prints its own marker on both streams, more than one chunk's worth on
    # stdout, and exits with its own code, so any cross-talk between jobs would show.
    jobs = []
    for i in range(20):
        code = (
            "import sys, time\n"
            f"sys.stdout.write('job-{i}:' + 'x' * 9000 + '\\n')\n"
            f"print('err-{i}', file=sys.stderr)\n"
            "time.sleep(0.2)\n"
            f"sys.exit({i})\n"
        )
        jobs.append(api.execute(py_job(code)))
    followed = [realtime.follow(job) for job in jobs]
    for job in jobs:
        assert api.start(job).status_code == 202
    results = [f.wait_result(timeout_s=60) for f in followed]
    time.sleep(0.5)
    for i, (f, result) in enumerate(zip(followed, results, strict=True)):
        assert len(f.results()) == 1, f"job {i} got {len(f.results())} results"
        assert result["outcome"] == "completed"
        assert result["exitCode"] == i
        assert f.text("stdout") == f"job-{i}:" + "x" * 9000 + "\n"
        assert f.text("stderr") == f"err-{i}\n"
        assert all(len(p["chunk"].encode()) <= 8192 for n, p in f.events if n == "stdout")
        # stage{queued} is published at claim time and may precede this late subscription
        # (the durable log keeps it); everything after start must have arrived, once each.
        seqs = sorted(p["seq"] for _, p in f.events)
        assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) and seqs[0] in (0, 1)
    for job in jobs:
        assert api.status(job)["state"] == "done"


def test_parallel_jobs_near_their_memory_limit_do_not_hurt_each_other(api: Api, realtime: Realtime) -> None:
    # G2: each job touches 80 % of its 128 MiB; with per-job cgroups none is OOM-killed
    # however many run side by side.
    code = "b = bytearray(100 * 1024 * 1024)\nfor i in range(0, len(b), 4096):\n    b[i] = 1\nprint('ok')\n"
    jobs = [api.execute(py_job(code, limits={"memoryMb": 128})) for _ in range(8)]
    followed = [realtime.follow(job) for job in jobs]
    for job in jobs:
        api.start(job)
    for f in followed:
        result = f.wait_result(timeout_s=60)
        assert result["outcome"] == "completed" and result["exitCode"] == 0, result
        # A prestarted runtime's own memory is taken off the peak, as read before start; the
        # kernel charges memory to a cgroup in per-CPU batches (64 pages a CPU), so either
        # reading may be off by that much.
        fuzz_kb = 64 * 4 * (os.cpu_count() or 1)
        assert 100 * 1024 - fuzz_kb <= result["memoryKb"] <= 128 * 1024
        assert f.text("stdout") == "ok\n"
