"""The worker process: N sandbox slots, one claimer, upkeep (heartbeat + reaper), clean stop.

Stop is two-staged: the first SIGTERM/SIGINT stops claiming, hands parked jobs back to
the queue (start flags kept) and lets running jobs finish within the grace period; a
second signal, or the end of the grace period, cancels what is left (each cancelled run
still writes its one result).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import uuid

from redis.asyncio import Redis
from redis.exceptions import RedisError

from shared import keys
from shared.messages import WorkerInfo
from shared.settings import Settings
from worker.cgroups import CgroupLayout
from worker.context import SandboxConfig, WorkerContext
from worker.control import ControlBus
from worker.janitor import sweep_orphans
from worker.publisher import Publisher
from worker.queue import WorkerQueue, now_ms
from worker.run import JobRun
from worker.runtimes import Runtime

__all__ = ["Worker"]

log = logging.getLogger(__name__)

CLAIM_POLL_S = 1.0


class Worker:
    def __init__(
        self, settings: Settings, cgroups: CgroupLayout, runtimes: dict[str, Runtime], sandbox: SandboxConfig
    ) -> None:
        self.settings = settings
        self.worker_id = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.cgroups = cgroups
        self.runtimes = runtimes
        self.sandbox = sandbox
        self._jobs: dict[asyncio.Task[None], str] = {}
        self._free_slots: asyncio.Queue[int] = asyncio.Queue()
        for slot in range(settings.worker_max_sandboxes):
            self._free_slots.put_nowait(slot)
        self._signals = 0
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
        redis = Redis.from_url(settings.redis_url, health_check_interval=30)
        # Blocking claims get their own connection so they never delay other commands.
        claim_redis = Redis.from_url(settings.redis_url, socket_timeout=None)
        control = ControlBus(redis)
        publisher = Publisher(settings)
        queue = WorkerQueue(redis, self.worker_id, settings.job_record_ttl_s, settings.run_result_ttl_s)
        claim_queue = WorkerQueue(claim_redis, self.worker_id, settings.job_record_ttl_s, settings.run_result_ttl_s)
        ctx = WorkerContext(
            settings=settings,
            queue=queue,
            control=control,
            publisher=publisher,
            cgroups=self.cgroups,
            runtimes=self.runtimes,
            sandbox=self.sandbox,
        )
        self._install_signal_handlers(ctx)
        await queue.heartbeat(self.info(), settings.worker_lease_ttl_ms)
        await sweep_orphans(redis, self.cgroups, self.sandbox.work_root, mine=set())
        await control.start()
        upkeep = asyncio.create_task(self._upkeep(ctx), name="upkeep")
        log.info(
            "worker %s ready: %d slots, languages: %s",
            self.worker_id,
            settings.worker_max_sandboxes,
            ", ".join(f"{r.manifest.language} {r.version}" for r in self.runtimes.values()) or "none",
        )
        try:
            await self._claim_loop(ctx, claim_queue)
            await self._drain(ctx)
        finally:
            upkeep.cancel()
            await asyncio.gather(upkeep, return_exceptions=True)
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

    async def _claim_loop(self, ctx: WorkerContext, claim_queue: WorkerQueue) -> None:
        loop = asyncio.get_running_loop()
        stopping = asyncio.ensure_future(ctx.stopping.wait())
        try:
            while not ctx.stopping.is_set():
                slot_get = asyncio.ensure_future(self._free_slots.get())
                done, _ = await asyncio.wait({slot_get, stopping}, return_when=asyncio.FIRST_COMPLETED)
                if slot_get not in done:
                    slot_get.cancel()
                    return
                slot = slot_get.result()
                try:
                    claim = await claim_queue.claim(CLAIM_POLL_S, loop.time())
                except RedisError as exc:
                    self._free_slots.put_nowait(slot)
                    log.warning("claim failed (%s); retrying", exc)
                    await asyncio.sleep(0.5)
                    continue
                if claim is None:
                    self._free_slots.put_nowait(slot)
                    continue
                run = JobRun(ctx, claim, slot)
                task = asyncio.create_task(run.execute(), name=f"job:{claim.spec.job_id}")
                self._jobs[task] = claim.spec.job_id
                task.add_done_callback(lambda t, s=slot: self._job_done(t, s))
        finally:
            stopping.cancel()

    def _job_done(self, task: asyncio.Task[None], slot: int) -> None:
        self._jobs.pop(task, None)
        self._free_slots.put_nowait(slot)

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

    async def _upkeep(self, ctx: WorkerContext) -> None:
        interval_s = self.settings.worker_heartbeat_ms / 1000
        while True:
            try:
                await ctx.queue.heartbeat(self.info(), self.settings.worker_lease_ttl_ms)
                lost = await ctx.queue.reap_dead_workers()
                for job_id, _seq, result in lost:
                    lane = ctx.publisher.lane(keys.realtime_channel(job_id))
                    lane.send("result", result)
                    await lane.close(timeout_s=2.0)
                await sweep_orphans(ctx.queue.redis, self.cgroups, self.sandbox.work_root, mine=set(self._jobs.values()))
            except RedisError as exc:
                log.warning("upkeep: redis error: %s", exc)
            await asyncio.sleep(interval_s)
