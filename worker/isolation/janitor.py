"""Clean up after workers that died on this host: their jails, cgroups and workspaces.

A worker killed with SIGKILL takes its jails' processes with it (enter.c), but leaves their
cgroups and workspace mounts; a worker frozen past its lease leaves everything. Sandbox
names start with the owning worker's id, so any worker on the host can find them: the
sandboxes of a worker judged dead (its lease lapsed while Redis was answering, which the
caller decides) are killed and removed. Live workers' sandboxes (this one's included) are
never touched, so several workers can share a host.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection
from pathlib import Path

from worker.isolation.cgroups import CgroupLayout
from worker.isolation.offload import off_loop
from worker.isolation.sandbox import owner_of
from worker.isolation.workspace import detach_workspace

__all__ = [
    "declare_timing",
    "declared_timings",
    "forget_timing",
    "live_workers_here",
    "prune_timings",
    "sandbox_owners",
    "sweep_orphans",
]

log = logging.getLogger(__name__)

# Where each worker on the host declares its lease settings (`<work root>/.timings/<id>`,
# "<lease ms> <heartbeat ms>"): after Redis lost its data, the workers list no longer says
# how long another worker on this host may go between renewals, but this folder still does.
_TIMINGS = ".timings"


def _created(layout: CgroupLayout, work_root: Path, name: str, cgroups: Collection[str] = ()) -> float:
    """When a sandbox was made: the newest timestamp of its cgroups, or at least the time in
    its name (`<worker>.<slot>.<n>`, n counting on from the factory's start in ms). A slot's
    workspace folder (named alike, but with no cgroups of its name among `cgroups`: it is
    kept between the slot's sandboxes) is as young as the youngest sandbox of its slot
    there, whose tmpfs is the one on it.

    Never its workspace's timestamp: the job owns the tmpfs root (a `touch -d 2100-01-01
    /workspace` would make the sandbox look forever young, and no sweep would remove it).
    """
    slot = name.rsplit(".", 1)[0]
    counter = name.rsplit(".", 1)[-1]
    stamps = [int(counter) / 1000 if counter.isdigit() else 0.0]
    siblings = [] if name in cgroups else [c for c in cgroups if c.rsplit(".", 1)[0] == slot]
    for other in [name, *siblings]:
        for path in layout.job(other).paths():
            try:
                stamps.append(path.stat().st_mtime)
            except OSError:
                continue
    return max(stamps)


def _scan(layout: CgroupLayout, work_root: Path) -> tuple[set[str], set[str]]:
    """Names of every job cgroup and workspace on the host."""
    workspaces = {p.name for p in work_root.iterdir() if p.is_dir()} if work_root.is_dir() else set()
    return layout.job_ids(), workspaces


def _remove(
    layout: CgroupLayout, work_root: Path, cgroups: set[str], workspaces: set[str], min_age_s: float, me: str
) -> set[str]:
    """Kill and remove the given sandboxes (others' only once older than `min_age_s`);
    those whose cgroups are gone now (one whose processes will not leave is tried again
    next round, and counts as not removed)."""
    now = time.time()
    orphans = {
        name
        for name in cgroups | workspaces
        if owner_of(name) == me or now - _created(layout, work_root, name, cgroups) >= min_age_s
    }
    for name in orphans & cgroups:
        cgroup = layout.job(name)
        cgroup.kill()
        if not cgroup.remove_blocking(timeout_s=2.0):
            orphans.discard(name)
    if orphans & workspaces:
        mounts = Path("/proc/self/mounts").read_text()
        for name in orphans & workspaces:
            detach_workspace(work_root / name, mounts)
    return orphans


def _owners(layout: CgroupLayout, work_root: Path, me: str, min_age_s: float) -> set[str]:
    cgroups, workspaces = _scan(layout, work_root)
    now = time.time()
    return {
        owner
        for name in cgroups | workspaces
        if (owner := owner_of(name)) not in (None, me) and now - _created(layout, work_root, name, cgroups) >= min_age_s
    }


async def sandbox_owners(layout: CgroupLayout, work_root: Path, me: str, min_age_s: float = 0.0) -> set[str]:
    """The ids of the other workers with a sandbox on this host at least `min_age_s` old:
    those whose sandboxes `sweep_orphans` would remove, were they dead."""
    return await off_loop(_owners, layout, work_root, me, min_age_s)


async def sweep_orphans(
    layout: CgroupLayout,
    work_root: Path,
    me: str,
    dead: Collection[str] = (),
    min_age_s: float = 0.0,
    starting: bool = False,
) -> int:
    """Kill and remove the sandboxes of the `dead` workers; returns how many.

    Sandboxes of `me` (this worker) are left alone, except when `starting`: before the first
    job, every sandbox carrying this id belongs to a killed previous incarnation with the
    same WORKER_ID. Others' sandboxes younger than `min_age_s` are left alone too: a worker
    that is starting builds its self-test sandbox before it first heartbeats.
    """
    cgroups, workspaces = await off_loop(_scan, layout, work_root)
    owners = set(dead) - {me} | ({me} if starting else set())
    candidates = {name for name in cgroups | workspaces if owner_of(name) in owners}
    orphans = await off_loop(_remove, layout, work_root, candidates & cgroups, candidates & workspaces, min_age_s, me)
    if orphans:
        log.warning("removed %d sandbox(es) of dead workers: %s", len(orphans), ", ".join(sorted(orphans)))
    # A dead worker's declared settings go with its last sandbox (not its own: it lives on).
    cleared = owners - {me} - {owner_of(name) for name in candidates - orphans}
    if cleared:
        await forget_timing(work_root, cleared)
    return len(orphans)


def _timing_path(work_root: Path | None, worker_id: str) -> Path | None:
    if work_root is None or not worker_id or "/" in worker_id or worker_id.startswith("."):
        return None
    return work_root / _TIMINGS / worker_id


def _declare(work_root: Path | None, worker_id: str, lease_ms: int, heartbeat_ms: int) -> None:
    path = _timing_path(work_root, worker_id)
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{worker_id}.partial")
    partial.write_text(f"{lease_ms} {heartbeat_ms}\n")
    partial.replace(path)


def _declared(work_root: Path, worker_ids: Collection[str]) -> dict[str, tuple[int, int]]:
    found: dict[str, tuple[int, int]] = {}
    for worker_id in worker_ids:
        path = _timing_path(work_root, worker_id)
        try:
            lease_ms, heartbeat_ms = (int(v) for v in path.read_text().split()) if path is not None else (0, 0)
        except (OSError, ValueError):
            continue
        if 0 < heartbeat_ms < lease_ms:
            found[worker_id] = (lease_ms, heartbeat_ms)
    return found


def _forget(work_root: Path | None, worker_ids: Collection[str]) -> None:
    for worker_id in worker_ids:
        path = _timing_path(work_root, worker_id)
        try:
            if path is not None:
                path.unlink(missing_ok=True)
        except OSError as exc:  # (a leftover file only makes a later judge wait longer)
            log.warning("could not remove %s: %s", path, exc)


# A declaration not rewritten for this long (or for three of the heartbeats it declares, if
# that is longer) is a dead worker's: a live one rewrites its own every upkeep round. It goes
# unless its worker still owns a sandbox here (the sweep of its last one takes it then). So
# does a write a crash left half-done.
STALE_TIMING_S = 3600.0


def _unwritten_for(path: str, now: float, at_least_s: float) -> bool:
    """Whether the declaration at `path` has not been rewritten for `at_least_s`, nor for
    three of the heartbeats it declares. Raises FileNotFoundError when it is gone, and
    OSError, ValueError or IndexError when it cannot be read as one."""
    age = now - os.stat(path, follow_symlinks=False).st_mtime
    if age < at_least_s:
        return False
    with open(path, "rb") as f:
        heartbeat_ms = int(f.read(64).split()[1])
    return age >= 3 * heartbeat_ms / 1000


def _stale(path: str, now: float) -> bool:
    try:
        return _unwritten_for(path, now, STALE_TIMING_S)
    except FileNotFoundError:
        return False
    except (OSError, ValueError, IndexError):
        return True  # junk, or a partial write: nobody reads it


def _prune_timings(work_root: Path | None, keep: Collection[str], now: float) -> list[str]:
    if work_root is None:
        return []
    folder = work_root / _TIMINGS
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    for entry in entries:
        # Judged twice, the second time just before the removal: a worker that restarted
        # under the id meanwhile has rewritten it (a removal it races still comes back with
        # its next round).
        if entry.name in keep or not _stale(entry.path, now) or not _stale(entry.path, time.time()):
            continue
        try:
            os.unlink(entry.path)
        except OSError:
            continue  # (gone meanwhile, or kept: a later round tries again)
        removed.append(entry.name)
    return removed


async def prune_timings(work_root: Path | None, keep: Collection[str]) -> None:
    """Remove the lease declarations of workers gone from this host long ago (one killed
    with no sandbox left has nobody to sweep its declaration away), but never those of
    `keep` (this worker, and every owner of a sandbox here)."""
    removed = await off_loop(_prune_timings, work_root, keep, time.time())
    if removed:
        log.info("removed %d stale lease declaration(s) of workers gone from this host: %s", len(removed), ", ".join(sorted(removed)))


async def declare_timing(work_root: Path | None, worker_id: str, lease_ms: int, heartbeat_ms: int) -> None:
    """Declare this worker's lease settings to the other workers on this host (if that
    fails, they judge it by their own settings, as before such files existed)."""
    try:
        await off_loop(_declare, work_root, worker_id, lease_ms, heartbeat_ms)
    except OSError as exc:
        log.warning("could not declare this worker's lease settings on the host: %s", exc)


async def declared_timings(work_root: Path | None, worker_ids: Collection[str]) -> dict[str, tuple[int, int]]:
    """The (lease ms, heartbeat ms) that those of `worker_ids` on this host declared."""
    if work_root is None or not worker_ids:
        return {}
    return await off_loop(_declared, work_root, worker_ids)


# A declaration rewritten this recently (or within three of the heartbeats it declares, if
# longer) is a live worker's: each rewrites its own every upkeep round.
LIVE_TIMING_S = 60.0


def _live_workers(work_root: Path, now: float) -> int:
    try:
        entries = list(os.scandir(work_root / _TIMINGS))
    except OSError:
        return 1
    live = 0
    for entry in entries:
        if entry.name.startswith("."):
            continue  # a write under way
        try:
            live += not _unwritten_for(entry.path, now, LIVE_TIMING_S)
        except (OSError, ValueError, IndexError):
            continue
    return max(1, live)


async def live_workers_here(work_root: Path | None) -> int:
    """How many workers run on this host (at least this one), by their lease declarations:
    they all put their jobs under one memory ceiling (see worker/isolation/memory.py)."""
    if work_root is None:
        return 1
    return await off_loop(_live_workers, work_root, time.time())


async def forget_timing(work_root: Path | None, worker_ids: Collection[str]) -> None:
    await off_loop(_forget, work_root, worker_ids)
