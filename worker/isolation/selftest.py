"""Start-up proof that this host can sandbox: one real jail through the real code path."""

from __future__ import annotations

import asyncio

from shared.limits import DEFAULT_LIMITS
from worker.isolation.jail import JailError, Program
from worker.isolation.offload import off_loop
from worker.isolation.sandbox import Sandbox, SandboxFactory
from worker.isolation.workspace import WorkspaceError

__all__ = ["SandboxUnavailable", "self_test"]


class SandboxUnavailable(Exception):
    """This host cannot run jobs safely; the message says what is missing."""


async def self_test(factory: SandboxFactory, owner: str, slot: int) -> None:
    """Build a sandbox, run a probe that checks the workspace is writable and the
    toolchain is not, and tear it down. Raises SandboxUnavailable with nsjail's reasons."""
    sandbox: Sandbox | None = None
    try:
        sandbox = await factory.prepare(owner, slot)
        probe = 'test -w /workspace && test ! -w /usr && test "$(cat probe)" = ok && [ "$(id -u)" = 65534 ] && [ $$ != 1 ] && exit 7'
        program = Program(argv=["/bin/sh", "-c", probe], env={})
        await sandbox.load([("probe", b"ok")], DEFAULT_LIMITS, program)
        sandbox.start(program)
        assert sandbox.jail.proc.stdin is not None
        sandbox.jail.proc.stdin.close()
        result = await asyncio.wait_for(sandbox.jail.wait(), 10)
        if result.exit_code != 7:
            raise SandboxUnavailable(
                f"a test jail did not behave (exit {result.exit_code}, signal {result.signal}): "
                + "; ".join(result.errors or sandbox.jail.error_lines())
            )
    except (JailError, WorkspaceError, OSError, TimeoutError) as exc:
        raise SandboxUnavailable(f"nsjail cannot build a jail here: {exc}") from None
    finally:
        if sandbox is not None:
            await sandbox.destroy()
        # Its slot (one past the last) is never used again: its workspace folder goes now,
        # not at the worker's stop, which a failed test or a check-only run never reaches.
        await off_loop(factory.remove_mount_points)
