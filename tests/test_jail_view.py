"""What a jailed program can learn about the host from /proc: not the kernel command line,
and no host path of the worker's own (work root, deployment, sandbox names)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import Api, Realtime, py_job

pytestmark = [pytest.mark.stack, pytest.mark.sandbox]

PROBE = """
print(repr(open('/proc/cmdline').read()))
print(open('/proc/self/mountinfo').read())
"""


def test_proc_shows_no_kernel_command_line_and_no_worker_paths(api: Api, realtime: Realtime) -> None:
    job = api.execute(py_job(PROBE, collectOutput=True))
    followed = realtime.follow(job)
    api.start(job)
    assert followed.wait_result()["outcome"] == "completed"
    out = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": "5000"}).json()["stdout"]
    first, _, mountinfo = out.partition("\n")
    assert first == "''", "the jail reads the host's kernel command line"
    assert Path("/proc/cmdline").read_text().strip()  # the host has one to hide
    deployment = api.stack.deployment
    assert deployment not in mountinfo and "/run/" not in mountinfo, mountinfo
    assert " /.coderunner/gate " in mountinfo  # the gate is there, bound from its own tmpfs
