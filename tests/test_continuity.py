"""Judging other workers dead: only on leases that lapsed while Redis answered.

A lease also lapses for every live worker when Redis stalls (frozen, swapped out, cut off).
The unit tests drive `RedisContinuity` by hand; the last test freezes a real redis-server
while a reaper's liveness read is in flight, which is how a live worker's running job was
once declared lost and its jail killed.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from redis.asyncio import Redis

from shared import keys
from shared.errors import ConfigError
from shared.settings import load_settings
from tests.conftest import StackFactory
from tests.test_api_scripts import RECORD_TTL_S, RESULT_TTL_S, redis_stack
from tests.test_worker_scripts import _claimed, queue, redis
from worker.isolation.cgroups import CgroupLayout, CgroupMode
from worker.isolation.janitor import (
    LIVE_TIMING_S,
    STALE_TIMING_S,
    _declare,
    _declared,
    _forget,
    _live_workers,
    _owners,
    _prune_timings,
    _remove,
    sweep_orphans,
)
from worker.isolation.memory import UNBOUNDED_BYTES, MemoryAdmission
from worker.isolation.sandbox import owner_of
from worker.messaging.continuity import RedisContinuity
from worker.messaging.queue import WorkerQueue
from worker.tasks import cancel_and_wait, raise_if_cancelled
from worker.worker import Worker, command_redis

__all__ = ["queue", "redis", "redis_stack"]  # fixtures shared with the script tests

INTERVAL_S = 0.1
LEASE_S = 1.0
DATASET = b"dataset-1"


async def _answers(continuity: RedisContinuity, seconds: float, dataset: bytes = DATASET) -> None:
    """Heartbeats answered at once, every interval, for `seconds`."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        continuity.answered(loop.time(), dataset)
        await asyncio.sleep(INTERVAL_S)


async def _judging() -> tuple[RedisContinuity, int]:
    """A record whose heartbeats were answered for a lease: it may judge, with this token."""
    continuity = RedisContinuity(INTERVAL_S, LEASE_S)
    await _answers(continuity, LEASE_S + INTERVAL_S)
    token = continuity.judging()
    assert token is not None
    return continuity, token


async def test_nobody_is_judged_before_redis_has_answered_for_a_lease() -> None:
    continuity = RedisContinuity(INTERVAL_S, LEASE_S)
    assert continuity.judging() is None
    await _answers(continuity, LEASE_S / 2)
    assert continuity.judging() is None
    await _answers(continuity, LEASE_S / 2 + INTERVAL_S)
    assert continuity.judging() == 0


@pytest.mark.parametrize("broken_by", ["a failed beat", "a gap between answers", "a new dataset"])
async def test_a_break_starts_the_lease_of_answers_again(broken_by: str) -> None:
    loop = asyncio.get_running_loop()
    continuity, token = await _judging()
    sent_at = loop.time()
    if broken_by == "a failed beat":
        continuity.failed(sent_at)
    elif broken_by == "a gap between answers":
        await asyncio.sleep(continuity.max_gap_s + INTERVAL_S)  # Redis answered nothing
        continuity.answered(sent_at, DATASET)
    else:  # Redis restarted without its data, and answered again at once
        continuity.answered(sent_at, b"dataset-2")
    assert continuity.judging() is None
    assert continuity.breaks == token + 1
    assert not await continuity.held(token, after=sent_at - 1)
    await _answers(continuity, LEASE_S + INTERVAL_S, b"dataset-2" if broken_by == "a new dataset" else DATASET)
    assert continuity.judging() == token + 1


async def test_a_read_counts_once_a_beat_sent_after_it_came_back_without_a_break() -> None:
    loop = asyncio.get_running_loop()
    continuity, token = await _judging()
    read_at = loop.time()
    held = asyncio.create_task(continuity.held(token, after=read_at))
    continuity.answered(read_at - 0.01, DATASET)  # a beat sent before the read: not enough
    await asyncio.sleep(INTERVAL_S)
    assert not held.done()
    continuity.answered(loop.time(), DATASET)
    assert await asyncio.wait_for(held, 1)


async def test_a_read_answered_after_a_stall_does_not_count() -> None:
    # The read was sent, Redis froze, and its answer came back first after the stall; the
    # beat that was in flight meanwhile comes back after it, with the gap that is the break.
    loop = asyncio.get_running_loop()
    continuity, token = await _judging()
    stalled_beat = loop.time()
    await asyncio.sleep(LEASE_S + INTERVAL_S)  # the stall
    held = asyncio.create_task(continuity.held(token, after=loop.time()))
    continuity.answered(stalled_beat, DATASET)
    await asyncio.sleep(0)
    continuity.answered(loop.time(), DATASET)
    assert not await asyncio.wait_for(held, 1)


async def test_a_read_without_a_beat_after_it_never_counts() -> None:
    loop = asyncio.get_running_loop()
    continuity, token = await _judging()
    started = loop.time()
    assert not await continuity.held(token, after=started)
    assert loop.time() - started >= LEASE_S * 0.9  # gave up after a lease


async def test_a_worker_with_other_settings_is_judged_by_the_gaps_the_record_saw() -> None:
    continuity, token = await _judging()  # answers every 0.1 s for a lease (1 s)
    loop = asyncio.get_running_loop()
    now = loop.time()
    assert continuity.may_judge(LEASE_S, INTERVAL_S, now)  # its own settings
    assert continuity.may_judge(0.8, INTERVAL_S, now)  # its peers call a gap of 0.65 s a break: none seen
    assert continuity.may_judge(10 * LEASE_S, INTERVAL_S, now)
    assert not continuity.may_judge(0.2, INTERVAL_S, now)  # 0.05 s: every gap is one
    assert not continuity.may_judge(6.0, 2.0, now)  # may not have renewed since the record began
    assert not continuity.may_judge(LEASE_S, INTERVAL_S, now - 2)  # a look from before it began
    # A gap of 0.45 s is no break for a 1 s lease, but one for a 0.5 s lease's peers (0.35 s).
    await asyncio.sleep(0.45)
    continuity.answered(loop.time(), DATASET)
    assert continuity.judging() == token
    assert continuity.may_judge(LEASE_S, INTERVAL_S, loop.time())
    assert not continuity.may_judge(0.5, INTERVAL_S, loop.time())
    # Once it lies more than that lease before the look, it no longer counts.
    await _answers(continuity, 0.7)
    assert continuity.may_judge(0.5, INTERVAL_S, loop.time())
    # A break starts the count again.
    continuity.failed(loop.time())
    assert not continuity.may_judge(LEASE_S, INTERVAL_S, loop.time())
    await _answers(continuity, LEASE_S + INTERVAL_S)
    assert continuity.may_judge(0.5, INTERVAL_S, loop.time())


async def test_gaps_older_than_the_history_count_as_the_longest_since_the_break(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    for history_s, judged in ((600.0, True), (0.3, False)):
        monkeypatch.setattr("worker.messaging.continuity.GAP_HISTORY_S", history_s)
        continuity = RedisContinuity(INTERVAL_S, LEASE_S)
        await _answers(continuity, 0.5)
        await asyncio.sleep(0.45)  # no break (0.85 s is one), but past a 0.58 s lease's peers' 0.43 s
        continuity.answered(loop.time(), DATASET)
        await _answers(continuity, 0.75)
        # The gap ended over 0.58 s before this look: it counts only if the record cannot tell.
        assert continuity.may_judge(0.58, INTERVAL_S, loop.time()) is judged, history_s


@pytest.mark.stack
@pytest.mark.sandbox
def test_a_worker_declares_its_lease_settings_on_its_host_while_it_runs(make_stack: StackFactory) -> None:
    stack = make_stack(with_worker=False, WORKER_LEASE_TTL_MS="6000", WORKER_HEARTBEAT_MS="500")
    # A worker killed long ago with no sandbox left declared its settings here too.
    ghost = Path(f"/run/{stack.deployment}/.timings/w-ghost")
    ghost.parent.mkdir(parents=True)
    ghost.write_text("6000 500\n")
    os.utime(ghost, (time.time() - STALE_TIMING_S - 60,) * 2)
    stack.start_worker()
    name = stack.worker_names()[0]
    declared = Path(f"/run/{stack.deployment}/.timings/{stack.worker_ids[name]}")
    assert declared.read_text() == "6000 500\n"
    deadline = time.monotonic() + 10
    while ghost.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not ghost.exists(), "the stale declaration was not pruned"
    declared.unlink()  # as a sweep would, had this worker just restarted under a judged id
    deadline = time.monotonic() + 5
    while not declared.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert declared.read_text() == "6000 500\n", "declared again within an upkeep round"
    # Its slots' workspace folders (kept between their sandboxes) go with it too.
    folders = list(Path(f"/run/{stack.deployment}").glob(f"{stack.worker_ids[name]}.*"))
    assert folders and all(owner_of(folder.name) == stack.worker_ids[name] for folder in folders)
    stack.stop_process(name)
    assert not declared.exists()
    assert not [folder for folder in folders if folder.exists()]


def test_a_lease_shorter_than_three_heartbeats_is_refused() -> None:
    # A live worker renews about once an interval: with a shorter lease one late beat lapses
    # it, and a stall that lapses leases could hide between two beats.
    with pytest.raises(ConfigError, match="WORKER_LEASE_TTL_MS \\(2999\\) must be at least three times WORKER_HEARTBEAT_MS"):
        load_settings({"PUSHER_SECRET": "x", "WORKER_HEARTBEAT_MS": "1000", "WORKER_LEASE_TTL_MS": "2999"})
    assert load_settings({"PUSHER_SECRET": "x", "WORKER_HEARTBEAT_MS": "1000", "WORKER_LEASE_TTL_MS": "3000"})


def test_workers_declare_their_lease_settings_on_the_host(tmp_path: Path) -> None:
    _declare(tmp_path, "w-a", 10_000, 2_000)
    _declare(tmp_path, "w-b", 45_000, 15_000)
    _declare(tmp_path, "w-b", 45_000, 14_000)  # a restart with other settings replaces them
    (tmp_path / ".timings" / "w-junk").write_text("lots\n")
    (tmp_path / ".timings" / "w-absurd").write_text("1000 5000\n")  # a heartbeat past the lease
    _declare(tmp_path, "../escape", 1, 1)  # never a path outside the folder
    _declare(tmp_path, ".hidden", 1, 1)
    assert sorted(p.name for p in (tmp_path / ".timings").iterdir()) == ["w-a", "w-absurd", "w-b", "w-junk"]
    wanted = ["w-a", "w-b", "w-junk", "w-absurd", "w-never", "../escape"]
    assert _declared(tmp_path, wanted) == {"w-a": (10_000, 2_000), "w-b": (45_000, 14_000)}
    _forget(tmp_path, ["w-b", "w-never"])
    assert _declared(tmp_path, wanted) == {"w-a": (10_000, 2_000)}
    assert owner_of(".timings") is None  # the folder is no sandbox of anyone


def test_only_other_workers_sandboxes_old_enough_to_sweep_make_their_owner_a_candidate(tmp_path: Path) -> None:
    # What sandbox_owners reports is what sweep_orphans would remove, were the owner dead: a
    # round waits for its confirming beat only when there is something to do.
    layout = CgroupLayout(mode=CgroupMode.V2, name="deployment", v2=tmp_path / "cgroup")
    work_root = tmp_path / "work"
    now = time.time()
    made = {
        "w-old.0.1": now - 60,  # another worker's, old enough
        "w-young.0.1": now - 1,  # another worker's, just built (a neighbour's self-test)
        "w-me.0.1": now - 60,  # this worker's own
        "not-a-sandbox": now - 60,
    }
    for name, stamp in made.items():
        for folder in (work_root / name, tmp_path / "cgroup" / "deployment" / "jobs" / name):
            folder.mkdir(parents=True)
            os.utime(folder, (stamp, stamp))
    # A workspace alone (its cgroup already gone) still counts, by the time in its name.
    (work_root / "w-leftover.1.2").mkdir()
    # A job owns its workspace's root and may date it in the future: that never counts.
    for name in ("w-leftover.1.2", "w-old.0.1"):
        os.utime(work_root / name, (now + 1e9, now + 1e9))
    assert _owners(layout, work_root, "w-me", min_age_s=10) == {"w-old", "w-leftover"}
    assert _owners(layout, work_root, "w-me", min_age_s=0) == {"w-old", "w-young", "w-leftover"}
    # And the sweep, given them all as dead, removes exactly the sandboxes of those owners.
    others = {"w-old.0.1", "w-young.0.1", "w-leftover.1.2"}
    removed = _remove(layout, work_root, set(), others, 10, "w-me")
    assert {owner_of(name) for name in removed} == {"w-old", "w-leftover"}
    assert not (work_root / "w-old.0.1").exists() and (work_root / "w-young.0.1").exists()


async def test_a_dead_workers_copier_cgroup_is_swept_with_its_sandbox(tmp_path: Path) -> None:
    # A worker killed while a batch case's copier ran left `<sandbox>.copy` beside the case's
    # cgroup. Its name was no sandbox's to the janitor: it was never a candidate, and one
    # memory cgroup leaked for good each time.
    layout = CgroupLayout(mode=CgroupMode.V2, name="deployment", v2=tmp_path / "cgroup")
    work_root = tmp_path / "work"
    work_root.mkdir()
    jobs = tmp_path / "cgroup" / "deployment" / "jobs"
    old = time.time() - 60
    for name in ("w-dead.0.5", "w-dead.0.5.copy", "w-live.0.5.copy"):
        (jobs / name).mkdir(parents=True)
        os.utime(jobs / name, (old, old))
    assert owner_of("w-dead.0.5.copy") == "w-dead" and owner_of("w-dead.0.copy") is None
    assert await sweep_orphans(layout, work_root, "w-me", dead={"w-dead"}, min_age_s=10) == 2
    assert sorted(p.name for p in jobs.iterdir()) == ["w-live.0.5.copy"]


def test_a_slots_kept_workspace_folder_is_as_young_as_the_slots_youngest_sandbox(tmp_path: Path) -> None:
    # A slot's workspace folder is named when the slot first builds and kept between its
    # sandboxes: the tmpfs on it is its newest sandbox's, so its age is that sandbox's.
    layout = CgroupLayout(mode=CgroupMode.V2, name="deployment", v2=tmp_path / "cgroup")
    work_root = tmp_path / "work"
    now = time.time()
    jobs = tmp_path / "cgroup" / "deployment" / "jobs"
    (work_root / "w-busy.0.1").mkdir(parents=True)  # the folder: old by its name
    (jobs / "w-busy.0.7").mkdir(parents=True)  # the slot's sandbox, built just now
    (jobs / "w-idle.0.5").mkdir(parents=True)  # another worker's, long ago
    os.utime(jobs / "w-idle.0.5", (now - 60, now - 60))
    (work_root / "w-idle.0.1").mkdir()
    assert _owners(layout, work_root, "w-me", min_age_s=10) == {"w-idle"}
    removed = _remove(layout, work_root, {"w-busy.0.7", "w-idle.0.5"}, {"w-busy.0.1", "w-idle.0.1"}, 10, "w-me")
    assert removed == {"w-idle.0.5", "w-idle.0.1"}
    assert (work_root / "w-busy.0.1").exists() and not (work_root / "w-idle.0.1").exists()
    # A sandbox's own cgroups date it, not its slot's others (a compile jail's, a stale one).
    os.utime(jobs / "w-busy.0.7", (now - 60, now - 60))
    (jobs / "w-busy.0.8").mkdir()
    assert _remove(layout, work_root, {"w-busy.0.7"}, set(), 10, "w-me") == {"w-busy.0.7"}


async def test_a_sandbox_whose_cgroup_will_not_go_is_not_reported_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Processes that will not leave the cgroup (stuck in the kernel): the sweep said it had
    # removed the sandbox and dropped its dead worker's declared settings, then tried again
    # every round; the next round must still know the worker's settings.
    layout = CgroupLayout(mode=CgroupMode.V2, name="deployment", v2=tmp_path / "cgroup")
    work_root = tmp_path / "work"
    stamp = time.time() - 60
    for folder in (work_root / "w-dead.0.1", tmp_path / "cgroup" / "deployment" / "jobs" / "w-dead.0.1"):
        folder.mkdir(parents=True)
        os.utime(folder, (stamp, stamp))
    _declare(work_root, "w-dead", 10_000, 2_000)
    monkeypatch.setattr("worker.isolation.cgroups.JobCgroup.kill", lambda self: None)
    monkeypatch.setattr("worker.isolation.cgroups.JobCgroup.remove_blocking", lambda self, timeout_s=2.0: False)
    with caplog.at_level("WARNING", logger="worker.isolation.janitor"):
        assert await sweep_orphans(layout, work_root, "w-me", dead={"w-dead"}, min_age_s=10) == 0
    assert "removed" not in caplog.text
    assert _declared(work_root, ["w-dead"]) == {"w-dead": (10_000, 2_000)}
    assert (work_root / "w-dead.0.1").exists()  # its workspace waits with its cgroup


@dataclass(frozen=True)
class Staging:
    interval_s: float
    lease_s: float
    stall_s: float


# The reaper's beat in flight during the stall is abandoned after its 1 s timeout (a failed
# beat), or, in a stall shorter than that, answered with a gap longer than max_gap_s.
STAGINGS = {
    "beat-abandoned": Staging(interval_s=0.1, lease_s=1.0, stall_s=1.5),
    "gap-between-answers": Staging(interval_s=0.05, lease_s=0.8, stall_s=0.9),
}


@pytest.mark.stack
@pytest.mark.slow
@pytest.mark.parametrize("staging", STAGINGS.values(), ids=STAGINGS.keys())
async def test_a_live_workers_lease_read_across_a_redis_stall_is_not_acted_on(
    redis: Redis, queue: WorkerQueue, redis_stack: Any, monkeypatch: pytest.MonkeyPatch, staging: Staging
) -> None:
    # `queue` is a live worker with a started job and a sandbox on this host. A reaper's upkeep
    # sends its liveness read just as Redis freezes for longer than a lease; the read is
    # answered first after the stall, when the live worker's lease has lapsed (its renewal
    # comes after the read). The reaper must neither end the job lost nor sweep the sandbox.
    interval_ms, lease_ms = int(staging.interval_s * 1000), int(staging.lease_s * 1000)
    settings = load_settings(
        {"PUSHER_SECRET": "x", "WORKER_HEARTBEAT_MS": str(interval_ms), "WORKER_LEASE_TTL_MS": str(lease_ms),
         "WORKER_PRESTART": "off"}
    )  # fmt: skip
    assert staging.stall_s > staging.lease_s  # it lapses every lease
    live = Worker(settings, queue.worker_id, SimpleNamespace(memory=MemoryAdmission(UNBOUNDED_BYTES)), {})  # type: ignore[arg-type]
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    await queue.advance(job, claim.attempt, [(1, "stage", "data", b'{"phase":"running","seq":1}')], started=True)
    before = await redis.hgetall(keys.status_key(job))
    renewing, renewal = asyncio.Event(), asyncio.Lock()
    renewing.set()

    async def renew() -> None:
        while True:
            # (redis-py can swallow a cancel that lands mid-command: without this look, a
            # failed run's clean-up waited on this loop for good, until the watchdog.)
            raise_if_cancelled()
            await renewing.wait()
            async with renewal:
                if renewing.is_set():
                    await queue.heartbeat(live.info(), lease_ms)
            await asyncio.sleep(staging.interval_s)

    reaper_redis = command_redis(redis_stack.redis_url)  # the worker's own client, retries and all
    reaper = WorkerQueue(reaper_redis, "w-reaper", RECORD_TTL_S, RESULT_TTL_S)
    real_unleased = reaper.unleased
    reads: list[set[str]] = []

    async def unleased_across_a_stall(worker_ids: Iterable[str]) -> set[str]:
        if reads:
            dead = await real_unleased(worker_ids)
        else:
            redis_pid = redis_stack.procs["redis"].pid
            renewing.clear()
            async with renewal:  # none in flight: the live worker's next renewal comes after the read
                os.kill(redis_pid, signal.SIGSTOP)
                try:
                    read = asyncio.create_task(real_unleased(worker_ids))
                    await asyncio.sleep(staging.stall_s)
                finally:
                    os.kill(redis_pid, signal.SIGCONT)
                dead = await read
            # The live worker comes back a little late (its connection dropped, say): after a
            # last look taken at once, before a reaper that waits for its own next beat.
            asyncio.get_running_loop().call_later(3 * staging.interval_s, renewing.set)
        reads.append(dead)
        return dead

    reaper.unleased = unleased_across_a_stall  # type: ignore[method-assign]
    swept: list[set[str]] = []

    async def sweep(*args: Any, dead: Iterable[str] = (), **kwargs: Any) -> int:
        swept.append(set(dead))
        return 0

    async def owners(*args: Any) -> set[str]:
        return {queue.worker_id}

    monkeypatch.setattr("worker.worker.sweep_orphans", sweep)
    monkeypatch.setattr("worker.worker.sandbox_owners", owners)
    reaping = Worker(settings, "w-reaper", SimpleNamespace(cgroups=None, work_root=None, memory=MemoryAdmission(UNBOUNDED_BYTES)), {})  # type: ignore[arg-type]
    ctx = SimpleNamespace(queue=reaper, publisher=SimpleNamespace(lane=None), callback_due=lambda: None)
    tasks = [
        asyncio.create_task(renew()),
        asyncio.create_task(reaping._heartbeat(ctx)),  # type: ignore[arg-type]
        asyncio.create_task(reaping._upkeep(ctx)),  # type: ignore[arg-type]
    ]
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 15
        # The stalled read, then a few rounds once the reaper may judge again (a lease on).
        while len(reads) < 5 and loop.time() < deadline:
            await asyncio.sleep(staging.interval_s)
        assert reads[0] == {queue.worker_id}, "the read did not see the lapse: the stall was not staged"
        assert all(not dead for dead in reads[1:])
        assert swept == []
        assert await redis.hgetall(keys.status_key(job)) == before  # not ended lost
        assert await redis.lrange(keys.worker_claimed_key(queue.worker_id), 0, -1) == [job.encode()]
        assert await redis.hexists(keys.WORKERS, queue.worker_id)
    finally:
        await cancel_and_wait(tasks, timeout_s=5.0)
        await reaper_redis.aclose()


def test_stale_declarations_of_workers_gone_are_pruned(tmp_path: Path) -> None:
    # A worker killed with no sandbox left has nobody to sweep its declaration: one not
    # rewritten for an hour goes, unless its worker still owns a sandbox here.
    now = time.time()
    for worker_id in ("w-live", "w-gone", "w-owner", "w-me"):
        _declare(tmp_path, worker_id, 10_000, 2_000)
    _declare(tmp_path, "w-slow", 10_000_000, 2_000_000)  # beats every 2,000 s: three of them
    folder = tmp_path / ".timings"
    (folder / ".w-crashed.partial").write_text("10000 2")
    (folder / "w-junk").write_text("junk")
    for name in ("w-gone", "w-owner", "w-me", "w-slow", "w-junk", ".w-crashed.partial"):
        os.utime(folder / name, (now - STALE_TIMING_S - 5, now - STALE_TIMING_S - 5))
    os.utime(folder / "w-live", (now - STALE_TIMING_S + 60, now - STALE_TIMING_S + 60))  # rewritten lately
    removed = _prune_timings(tmp_path, {"w-owner", "w-me"}, now)
    assert sorted(removed) == [".w-crashed.partial", "w-gone", "w-junk"]
    assert sorted(p.name for p in folder.iterdir()) == ["w-live", "w-me", "w-owner", "w-slow"]
    assert _prune_timings(tmp_path / "nowhere", set(), now) == [] and _prune_timings(None, set(), now) == []


def test_the_workers_on_a_host_are_counted_by_their_fresh_declarations(tmp_path: Path) -> None:
    # They share the host's memory ceiling between them (worker/isolation/memory.py).
    folder = tmp_path / ".timings"
    assert _live_workers(tmp_path, time.time()) == 1  # none declared yet: this one
    now = time.time()
    for name, text, age in (
        ("w-fresh", "10000 2000\n", 1),
        ("w-slow-beats", "600000 100000\n", LIVE_TIMING_S + 60),  # three of its beats not yet over
        ("w-gone", "10000 2000\n", LIVE_TIMING_S + 60),
        ("w-junk", "lots\n", LIVE_TIMING_S + 60),
        (".w-new.partial", "10000 2000\n", 1),  # a write under way
    ):
        folder.mkdir(exist_ok=True)
        (folder / name).write_text(text)
        os.utime(folder / name, (now - age, now - age))
    assert _live_workers(tmp_path, now) == 2
