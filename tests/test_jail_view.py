"""What a jailed program can learn about the host from /proc: not the kernel command line,
no host path of the worker's own (work root, deployment, sandbox names), no host-wide
activity or boot id; and none of the host's configuration under /usr/local/etc."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.helpers import Api, Realtime, py_job, run_job

pytestmark = [pytest.mark.stack, pytest.mark.sandbox]

PROBE = """
print(repr(open('/proc/cmdline').read()))
print(open('/proc/self/mountinfo').read())
"""


MASKED = ["/proc/interrupts", "/proc/softirqs", "/proc/diskstats", "/proc/vmstat", "/proc/zoneinfo", "/proc/buddyinfo",
          "/proc/sys/kernel/random/boot_id",
          # how many cgroups (sandboxes) and open files the host has; its disks and build
          "/proc/cgroups", "/proc/sys/fs/file-nr", "/proc/sys/fs/inode-nr", "/proc/partitions", "/proc/config.gz"]  # fmt: skip
HOST_VIEW = f"""
import os
import time
for path in {MASKED!r}:
    print(path, len(open(path, "rb").read()))
for folder in ("/proc/pressure", "/usr/local/etc"):
    print(folder, sorted(os.listdir(folder)) if os.path.isdir(folder) else "absent")
"""


def _stdout_of(api: Api, realtime: Realtime, code: str) -> str:
    """Run `code` (Python) to completion; its whole stdout."""
    result, followed = run_job(api, realtime, py_job(code, collectOutput=True))
    assert result["outcome"] == "completed"
    return str(api.get(f"/v1/jobs/{followed.job['jobId']}/output", params={"waitMs": "5000"}).json()["stdout"])


def test_no_host_wide_activity_boot_id_or_host_configuration(api: Api, realtime: Realtime) -> None:
    out = _stdout_of(api, realtime, HOST_VIEW)
    for path in MASKED:
        if Path(path).exists():  # what the host has, the jail must read as empty
            assert Path(path).read_bytes() and f"{path} 0\n" in out, out
    for folder in ("/proc/pressure", "/usr/local/etc"):
        assert f"{folder} []\n" in out or f"{folder} absent\n" in out, out
        if Path(folder).is_dir() and os.listdir(folder):
            assert f"{folder} []\n" in out, out  # the host's has files; the jail's is empty


def test_proc_shows_no_kernel_command_line_and_no_worker_paths(api: Api, realtime: Realtime) -> None:
    out = _stdout_of(api, realtime, PROBE)
    first, _, mountinfo = out.partition("\n")
    assert first == "''", "the jail reads the host's kernel command line"
    assert Path("/proc/cmdline").read_text().strip()  # the host has one to hide
    deployment = api.stack.deployment
    assert deployment not in mountinfo and "/run/" not in mountinfo, mountinfo
    assert " /.coderunner/gate " in mountinfo  # the gate is there, bound from its own tmpfs


def test_no_other_host_user_can_read_a_jobs_workspace(api: Api) -> None:
    # The work root is traversable (0711) and sandbox names are guessable: the workspace
    # itself must be its jail user's alone.
    root = Path(f"/run/{api.stack.deployment}")
    deadline = time.monotonic() + 30
    while True:
        mounted = [line.split()[1] for line in Path("/proc/self/mounts").read_text().splitlines() if line.startswith("coderunner-ws ")]
        workspaces = [Path(p) for p in mounted if Path(p).parent == root]
        if workspaces or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert workspaces, "no warm workspace to look at"
    for workspace in workspaces:
        info = workspace.stat()
        assert info.st_uid != 0 and info.st_mode & 0o777 == 0o700, (workspace, oct(info.st_mode))
