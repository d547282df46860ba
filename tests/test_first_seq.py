"""A live client that subscribes and then starts sees every event from seq 0, with no hole.

Before this was true, `stage{queued}` (seq 0) was published at claim time, before the
client had subscribed, so live clients started at seq 1 and a page waiting for seq 0 hung.
Fifty runs with each real client: pysher (Python) and pusher-js (Node).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from launcher.node import find_node
from launcher.stack import Stack
from shared.paths import REPO_ROOT
from tests.helpers import Api, Realtime, py_job

pytestmark = [pytest.mark.stack, pytest.mark.sandbox, pytest.mark.slow]

RUNS = 50


def test_pysher_sees_seq_0_on_without_a_hole_50_times(api: Api, realtime: Realtime) -> None:
    for i in range(RUNS):
        job = api.execute(py_job(f"print({i})"))
        followed = realtime.follow(job)
        api.start(job)
        followed.wait_result()
        seqs = [p["seq"] for _, p in followed.events]
        assert seqs == list(range(len(seqs))), (i, followed.events)
        assert followed.events[0] == ("stage", {"phase": "queued", "seq": 0})
        assert followed.text("stdout") == f"{i}\n"
        realtime.pusher.unsubscribe(job["channel"])


def test_pusher_js_sees_seq_0_on_without_a_hole_50_times(stack: Stack) -> None:
    done = subprocess.run(
        [find_node(), str(REPO_ROOT / "clients/js/seq-check.mjs"), stack.api_url, stack.api_token, str(RUNS)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT / "clients/js",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(report) == RUNS
    for run in report:
        assert run["seqs"] == list(range(len(run["seqs"]))), run
        assert run["names"][0] == "stage" and run["names"][-1] == "result", run
        assert run["names"].count("result") == 1, run
