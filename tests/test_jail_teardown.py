"""A real sandbox factory in this process: jails that fail half-way are taken apart whole.

The worker's own preflight builds the factory (self-test included), on a deployment of its
own, so these tests see exactly what a worker does; they need root, cgroups and nsjail.
"""

from __future__ import annotations

import errno
import os
import secrets
import time
from collections.abc import AsyncIterator

import pytest

from launcher.stack import remove_deployment
from shared.settings import load_settings
from tests.helpers import pids_with_cmdline
from worker.__main__ import preflight
from worker.isolation.cgroups import JobCgroup
from worker.isolation.jail import JailError
from worker.isolation.sandbox import SandboxFactory

pytestmark = [pytest.mark.sandbox]


@pytest.fixture
async def factory() -> AsyncIterator[SandboxFactory]:
    name = "coderunner-teardown-" + secrets.token_hex(3)
    settings = load_settings(
        {
            "PUSHER_SECRET": "x",
            "SANDBOX_CGROUP_NAME": name,
            "SANDBOX_WORK_ROOT": f"/run/{name}",
            "SANDBOX_UID_BASE": str(190000 + 10 * secrets.randbelow(1000)),
            "WORKER_MAX_SANDBOXES": "2",
        }
    )
    built, _runtimes = await preflight(settings, "teardown")
    try:
        yield built
    finally:
        if built.uid_lease is not None:
            built.uid_lease.close()
        remove_deployment(name)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


async def test_a_jail_that_cannot_leave_its_cgroups_fails_fast_and_leaves_nothing(
    factory: SandboxFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Moving nsjail out of the job's cgroups failed: the build must end with a JailError at
    # once (not at the ready timeout), and the jail, its pipes, its status pipe and its
    # cgroups must all go.
    sandbox = await factory.prepare("teardown", 0)  # warm the paths: descriptors opened once stay out of the count
    await sandbox.destroy()
    before = _open_fds()

    def refuse(self: JobCgroup, pid: int) -> None:
        raise OSError(errno.EBUSY, "refused by the test")

    monkeypatch.setattr(JobCgroup, "release_supervisor", refuse)
    started = time.monotonic()
    with pytest.raises(JailError, match="could not be moved out of the job's cgroups"):
        await factory.prepare("teardown", 0)
    assert time.monotonic() - started < factory.ready_timeout_s / 2
    assert _open_fds() == before
    assert pids_with_cmdline(b"nsjail", f"{factory.work_root}/".encode()) == []
    assert {n for n in factory.cgroups.job_ids() if n.startswith("teardown.")} == set()
    monkeypatch.undo()
    sandbox = await factory.prepare("teardown", 0)  # and the next one builds as usual
    await sandbox.destroy()
    assert _open_fds() == before
