"""Start-up proof that this host can sandbox: one real jail through the real code path."""

from __future__ import annotations

import asyncio
import uuid

from shared.settings import Settings
from worker.cgroups import CgroupLayout
from worker.context import SandboxConfig
from worker.jail import Jail, JailError, JailSpec
from worker.workspace import Workspace, WorkspaceError

__all__ = ["SandboxUnavailable", "self_test"]


class SandboxUnavailable(Exception):
    """This host cannot run jobs safely; the message says what is missing."""


async def self_test(sandbox: SandboxConfig, layout: CgroupLayout, settings: Settings) -> None:
    job_id = "selftest-" + uuid.uuid4().hex[:12]
    uid = settings.sandbox_uid_base + settings.worker_max_sandboxes  # a uid no job slot uses
    workspace = Workspace(sandbox.work_root, job_id, uid, uid)
    cgroup = layout.job(job_id)
    jail: Jail | None = None
    try:
        workspace.create(1024 * 1024, 64)
        cgroup.create(memory_bytes=64 * 1024 * 1024, pids=8)
        spec = JailSpec(
            argv=["/bin/sh", "-c", "test -w /workspace && test ! -w /usr && exit 7"],
            env={},
            workspace=workspace.path,
            uid=uid,
            gid=uid,
            extra_mounts=[],
            backstop_s=10,
            rlimit_cpu_s=5,
            rlimit_fsize_mb=1,
            rlimit_nofile=16,
        )
        jail = await Jail.launch(sandbox.nsjail, sandbox.profile("base"), spec, cgroup)
        await jail.wait_ready(sandbox.ready_timeout_s)
        jail.go()
        assert jail.proc.stdin is not None
        jail.proc.stdin.close()
        result = await asyncio.wait_for(jail.wait(), 10)
        if result.exit_code != 7:
            raise SandboxUnavailable(
                f"a test jail did not behave (exit {result.exit_code}, signal {result.signal}): "
                + "; ".join(result.errors or jail.error_lines())
            )
    except (TimeoutError, JailError, WorkspaceError, OSError) as exc:
        detail = "; ".join(jail.error_lines()) if jail is not None else ""
        raise SandboxUnavailable(f"nsjail cannot build a jail here: {exc} {detail}".strip()) from None
    finally:
        cgroup.kill()
        if jail is not None and jail.proc.returncode is None:
            jail.terminate_supervisor()
            await jail.proc.wait()
        await cgroup.remove()
        workspace.destroy()
