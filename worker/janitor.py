"""Clean up after workers that died on this host: their jails, cgroups and workspaces.

nsjail runs in its own session, so a worker killed with SIGKILL leaves its jails running.
Any worker on the same host finds them: a job cgroup or workspace whose job is not held by
a live worker is killed and removed. Jobs of live workers (including this one) are never
touched, so several workers can share a host.
"""

from __future__ import annotations

import logging
from pathlib import Path

from redis.asyncio import Redis

from shared import keys
from worker.cgroups import CgroupLayout
from worker.workspace import detach_workspace

__all__ = ["sweep_orphans"]

log = logging.getLogger(__name__)


async def _orphaned(redis: Redis, job_ids: set[str], mine: set[str]) -> set[str]:
    orphans: set[str] = set()
    for job_id in job_ids - mine:
        owner = await redis.hget(keys.status_key(job_id), "worker")
        if owner is None or not await redis.exists(keys.worker_alive_key(owner.decode())):
            orphans.add(job_id)
    return orphans


async def sweep_orphans(redis: Redis, layout: CgroupLayout, work_root: Path, mine: set[str]) -> int:
    """Kill and remove the leftovers of jobs no live worker holds; returns how many jobs."""
    local = {job_id for job_id in layout.job_ids() if keys.is_job_id(job_id)}
    workspaces = {p.name for p in work_root.iterdir() if keys.is_job_id(p.name)} if work_root.is_dir() else set()
    orphans = await _orphaned(redis, local | workspaces, mine)
    for job_id in orphans:
        cgroup = layout.job(job_id)
        cgroup.kill()
        await cgroup.remove(timeout_s=2.0)
    if orphans & workspaces:
        mounts = Path("/proc/self/mounts").read_text()
        for job_id in orphans & workspaces:
            detach_workspace(work_root / job_id, mounts)
    if orphans:
        log.warning("removed the leftovers of %d job(s) whose worker died: %s", len(orphans), ", ".join(sorted(orphans)))
    return len(orphans)
