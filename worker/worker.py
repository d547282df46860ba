"""The worker process: N sandbox slots, one claimer, upkeep (heartbeat + reaper), clean stop.

Every free slot holds a ready sandbox (a jail parked at its gate); the claimer only takes a
job when a slot with a ready sandbox is free, and a slot re-arms itself with a fresh
sandbox as soon as its job is over.

Stop is two-staged: the first SIGTERM/SIGINT stops claiming, hands parked jobs back to
the queue (start flags kept) and lets running jobs finish within the grace period; a
second signal, or the end of the grace period, cancels what is left (each cancelled run
still writes its one result).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import keys
from shared.messages import WorkerInfo
from shared.settings import Settings
from worker.context import WorkerContext
from worker.control import ControlBus
from worker.janitor import sweep_orphans
from worker.publisher import Publisher
from worker.queue import WorkerQueue, now_ms
from worker.run import JobRun
from worker.runtimes import Runtime
from worker.sandbox import MAX_IDLE_S, Sandbox, SandboxFactory

__all__ = ["Worker", "WorkerIdInUse"]

log = logging.getLogger(__name__)

CLAIM_POLL_S = 1.0

# A dropped connection is re-dialled and the command retried before anything fails; a job's
# events and result must survive a Redis blip, not end the job.
_RECONNECTING: dict[str, Any] = {
    "retry": Retry(ExponentialBackoff(cap=1.0, base=0.02), 8),
    "retry_on_error": [RedisConnectionError, RedisTimeoutError],
}


class WorkerIdInUse(Exception):
    """Another live worker holds this worker's id."""


class Worker:
    def __init__(self, settings: Settings, worker_id: str, sandboxes: SandboxFactory, runtimes: dict[str, Runtime]) -> None:
        self.settings = settings
        self.worker_id = worker_id
        self.sandboxes = sandboxes
        self.runtimes = runtimes
        self._jobs: dict[asyncio.Task[None], str] = {}
        self._ready: asyncio.Queue[Sandbox] = asyncio.Queue()
        self._arming: set[asyncio.Task[None]] = set()
        # Ids in our claimed list with no task, seen at the previous upkeep. Only ids seen
        # twice are recovered, so a claim between BLMOVE and its task is never mistaken.
        self._suspects: set[str] = set()
        # The janitor leaves sandboxes younger than this alone (a neighbour's self-test).
        self._young_s = 2 * settings.worker_lease_ttl_ms / 1000
        self._signals = 0
        self._stopping = asyncio.Event()
        self._hard_stop = asyncio.Event()
        self.started_at_ms = now_ms()

    def info(self) -> WorkerInfo:
        return WorkerInfo(
            worker_id=self.worker_id,
            slots=self.settings.worker_max_sandboxes,
            runtimes=[r.info() for r in self.runtimes.values()],
            started_at_ms=self.started_at_ms,
        )

    async def run(self) -> None:
        settings = self.settings
        redis = Redis.from_url(settings.redis_url, health_check_interval=30, **_RECONNECTING)
        # Blocking claims get their own connection so they never delay other commands.
        claim_redis = Redis.from_url(settings.redis_url, socket_timeout=None, **_RECONNECTING)
        control = ControlBus(redis)
        publisher = Publisher(settings)
        queue = WorkerQueue(redis, self.worker_id, settings.job_record_ttl_s, settings.run_result_ttl_s)
        claim_queue = WorkerQueue(claim_redis, self.worker_id, settings.job_record_ttl_s, settings.run_result_ttl_s)
        ctx = WorkerContext(
            settings=settings,
            queue=queue,
            control=control,
            publisher=publisher,
            sandboxes=self.sandboxes,
            runtimes=self.runtimes,
            stopping=self._stopping,
        )
        self._install_signal_handlers(ctx)
        if await queue.alive(self.worker_id):
            raise WorkerIdInUse(f"another live worker already uses the id {self.worker_id!r} (WORKER_ID)")
        # A previous incarnation with the same id (WORKER_ID) that was killed: nobody else
        # reaps its claims or sweeps its sandboxes, because they carry our id.
        self._publish_results(ctx, await queue.recover_claims(self.worker_id))
        await sweep_orphans(
            redis, self.sandboxes.cgroups, self.sandboxes.work_root, me=self.worker_id, min_age_s=self._young_s, starting=True
        )
        await queue.heartbeat(self.info(), settings.worker_lease_ttl_ms)
        for slot in range(settings.worker_max_sandboxes):
            self._arm(slot)
        await control.start()
        background = [
            asyncio.create_task(self._heartbeat(ctx), name="heartbeat"),
            asyncio.create_task(self._upkeep(ctx), name="upkeep"),
        ]
        log.info(
            "worker %s ready: %d slots, languages: %s",
            self.worker_id,
            settings.worker_max_sandboxes,
            ", ".join(f"{r.manifest.language} {r.version}" for r in self.runtimes.values()) or "none",
        )
        try:
            await self._claim_loop(ctx, claim_queue)
        finally:
            # Running jobs always get their grace and their result, even if claiming failed.
            await self._drain(ctx)
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            await self._disarm()
            try:
                await queue.unregister()
            except RedisError:
                pass
            await control.aclose()
            await publisher.aclose()
            await claim_redis.aclose()
            await redis.aclose()
            log.info("worker %s stopped", self.worker_id)

    def _install_signal_handlers(self, ctx: WorkerContext) -> None:
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            self._signals += 1
            if self._signals == 1:
                log.info("signal %s: no new jobs; parked jobs go back to the queue; running jobs get %d ms",
                         signal.Signals(signum).name, self.settings.worker_shutdown_grace_ms)  # fmt: skip
                ctx.stopping.set()
            else:
                log.info("second signal: cancelling running jobs now")
                self._hard_stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(signum, on_signal, signum)
            except NotImplementedError:  # pragma: no cover - not on Linux
                pass

    # -- slots ----------------------------------------------------------------------

    def _arm(self, slot: int, delay_s: float = 0.0) -> None:
        """Build a fresh sandbox for `slot` in the background; it becomes claimable when ready."""

        async def arm() -> None:
            if delay_s:
                await asyncio.sleep(delay_s)
            try:
                sandbox = await self.sandboxes.prepare(self.worker_id, slot)
            except Exception as exc:
                log.error("slot %d: cannot build a sandbox (%s); retrying in 2s", slot, exc)
                self._arm(slot, delay_s=2.0)
                return
            self._ready.put_nowait(sandbox)

        task = asyncio.create_task(arm(), name=f"arm-slot-{slot}")
        self._arming.add(task)
        task.add_done_callback(self._arming.discard)

    async def _take_sandbox(self, stopping: asyncio.Future[object]) -> Sandbox | None:
        """The next ready sandbox (replacing one that sat idle too long), or None when stopping."""
        while True:
            getter = asyncio.ensure_future(self._ready.get())
            done, _ = await asyncio.wait({getter, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
                return None
            sandbox = getter.result()
            if sandbox.idle_s < MAX_IDLE_S and sandbox.jail.proc.returncode is None:
                return sandbox
            await sandbox.destroy()
            self._arm(sandbox.slot)

    async def _disarm(self) -> None:
        for task in list(self._arming):
            task.cancel()
        await asyncio.gather(*self._arming, return_exceptions=True)
        ready = [self._ready.get_nowait() for _ in range(self._ready.qsize())]
        await asyncio.gather(*(sandbox.destroy() for sandbox in ready), return_exceptions=True)

    async def _claim_loop(self, ctx: WorkerContext, claim_queue: WorkerQueue) -> None:
        loop = asyncio.get_running_loop()
        stopping = asyncio.ensure_future(ctx.stopping.wait())
        try:
            while not ctx.stopping.is_set():
                sandbox = await self._take_sandbox(stopping)
                if sandbox is None:
                    return
                try:
                    claim = await claim_queue.claim(CLAIM_POLL_S, loop.time())
                except RedisError as exc:
                    self._ready.put_nowait(sandbox)
                    log.warning("claim failed (%s); retrying", exc)
                    await asyncio.sleep(0.5)
                    continue
                except Exception:
                    # Never let one bad claim stop the worker; the stray-claim recovery in
                    # upkeep puts back whatever a failed claim left in our list.
                    self._ready.put_nowait(sandbox)
                    log.exception("claim failed unexpectedly; retrying")
                    await asyncio.sleep(0.5)
                    continue
                finally:
                    self._publish_results(ctx, claim_queue.orphan_results)
                    claim_queue.orphan_results = []
                if claim is None:
                    self._ready.put_nowait(sandbox)
                    continue
                run = JobRun(ctx, claim, sandbox)
                task = asyncio.create_task(run.execute(), name=f"job:{claim.spec.job_id}")
                self._jobs[task] = claim.spec.job_id
                task.add_done_callback(lambda t, slot=sandbox.slot: self._job_done(t, slot))
        finally:
            stopping.cancel()

    def _job_done(self, task: asyncio.Task[None], slot: int) -> None:
        self._jobs.pop(task, None)
        if not self._stopping.is_set():
            self._arm(slot)

    async def _drain(self, ctx: WorkerContext) -> None:
        if not self._jobs:
            return
        grace_s = self.settings.worker_shutdown_grace_ms / 1000
        hard = asyncio.ensure_future(self._hard_stop.wait())
        all_done = asyncio.ensure_future(asyncio.wait(set(self._jobs)))
        await asyncio.wait({hard, all_done}, timeout=grace_s, return_when=asyncio.FIRST_COMPLETED)
        hard.cancel()
        if self._jobs:
            log.warning("cancelling %d running jobs", len(self._jobs))
            for task in list(self._jobs):
                task.cancel()
            await asyncio.gather(*self._jobs, return_exceptions=True)
        all_done.cancel()

    async def _heartbeat(self, ctx: WorkerContext) -> None:
        """Keep the lease alive; nothing else shares this loop, so nothing can delay it."""
        interval_s = self.settings.worker_heartbeat_ms / 1000
        while True:
            try:
                await ctx.queue.heartbeat(self.info(), self.settings.worker_lease_ttl_ms)
            except Exception as exc:  # a failed beat is retried at the next interval
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(interval_s)

    async def _upkeep(self, ctx: WorkerContext) -> None:
        """Reap dead workers' claims, recover our own strays, remove dead workers' sandboxes."""
        interval_s = self.settings.worker_heartbeat_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            try:
                self._publish_results(ctx, await ctx.queue.reap_dead_workers())
                strays = set(await ctx.queue.claimed_ids(self.worker_id)) - set(self._jobs.values())
                confirmed, self._suspects = strays & self._suspects, strays - self._suspects
                if confirmed:
                    self._publish_results(ctx, await ctx.queue.recover_claims(self.worker_id, only=confirmed))
                await sweep_orphans(
                    ctx.queue.redis,
                    self.sandboxes.cgroups,
                    self.sandboxes.work_root,
                    me=self.worker_id,
                    min_age_s=self._young_s,
                )
            except Exception:
                log.exception("upkeep failed; trying again at the next interval")

    def _publish_results(self, ctx: WorkerContext, ended: list[tuple[str, bytes]]) -> None:
        """Publish results recovery wrote, without waiting for soketi."""
        for job_id, result in ended:
            lane = ctx.publisher.lane(keys.realtime_channel(job_id))
            lane.send("result", result)
            task = asyncio.create_task(lane.close(timeout_s=2.0))
            self._arming.add(task)  # keep a reference until it is done
            task.add_done_callback(self._arming.discard)
