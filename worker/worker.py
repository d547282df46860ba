"""The worker process: N sandbox slots, many parked jobs, one claimer, upkeep, clean stop.

Every slot keeps a ready sandbox (a jail parked at its gate) in the warm pool. Parked jobs
hold no sandbox, only a record and a subscription, so the claimer keeps claiming up to
WORKER_MAX_PARKED of them; a job takes a sandbox when its start arrives, and the slot
builds a fresh one as soon as that job is over. The claimer stops claiming while as many
started jobs wait for a sandbox as there are slots, so a busy worker leaves started work
in the queue for idle workers.

Stop is two-staged: the first SIGTERM/SIGINT stops claiming, hands parked jobs back to
the queue (start flags kept) and lets running jobs finish within the grace period; a
second signal, or the end of the grace period, cancels what is left (each cancelled run
still writes its one result).
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from leanredis import BlockingLeanRedis, LeanRedis
from shared import keys
from shared.limits import DEFAULT_LIMITS, with_overrides
from shared.messages import WorkerInfo, WorkerLoad
from shared.settings import JOB_CANCEL_WAIT_S, Settings
from worker.context import WorkerContext
from worker.isolation.janitor import (
    declare_timing,
    declared_timings,
    forget_timing,
    live_workers_here,
    prune_timings,
    sandbox_owners,
    sweep_orphans,
)
from worker.isolation.offload import off_loop
from worker.isolation.pool import SandboxPool
from worker.isolation.sandbox import Prime, SandboxFactory
from worker.job.run import JobRun
from worker.messaging.continuity import RedisContinuity
from worker.messaging.control import ControlBus, Subscription
from worker.messaging.flagsweep import FlagSweep
from worker.messaging.owed import OwedResults
from worker.messaging.probe import RedisProbe
from worker.messaging.publisher import Publisher
from worker.messaging.queue import Claim, WorkerQueue, WorkerSuperseded, now_ms
from worker.runtimes import Runtime
from worker.tasks import cancel_and_wait, raise_if_cancelled

__all__ = ["Worker", "WorkerIdInUse"]

log = logging.getLogger(__name__)

CLAIM_POLL_S = 1.0
COMMAND_TIMEOUT_S = 5.0
# How often upkeep looks for dead workers' stale lease declarations (janitor.prune_timings).
PRUNE_TIMINGS_EVERY_S = 300.0

# A dropped connection is re-dialled and the command retried before anything fails; a job's
# events and result must survive a Redis blip, not end the job.
_RECONNECTING: dict[str, Any] = {
    "retry": Retry(ExponentialBackoff(cap=1.0, base=0.02), 8),
    "retry_on_error": [RedisConnectionError, RedisTimeoutError],
}


def command_redis(url: str) -> LeanRedis:
    """The client of every command but the blocking claim: the heartbeat's, the upkeep's and
    the jobs', all on one connection."""
    return LeanRedis.from_url(
        url,
        health_check_interval=30,
        socket_timeout=COMMAND_TIMEOUT_S,
        socket_connect_timeout=COMMAND_TIMEOUT_S,
        **_RECONNECTING,
    )


class WorkerIdInUse(Exception):
    """Another live worker holds this worker's id."""


class Worker:
    def __init__(
        self,
        settings: Settings,
        worker_id: str,
        sandboxes: SandboxFactory,
        runtimes: dict[str, Runtime],
        callback_due: Callable[[], None] | None = None,
    ) -> None:
        self.settings = settings
        self._callback_due = callback_due
        self.worker_id = worker_id
        self.sandboxes = sandboxes
        self.runtimes = runtimes
        self._jobs: dict[asyncio.Task[None], str] = {}
        # The id being claimed (taken, not yet a job task): not a stray meanwhile.
        self._claiming: str | None = None
        primes = {} if settings.worker_prestart == "off" else _primes(sandboxes, runtimes)
        if settings.worker_prestart not in ("", "off", *primes):
            log.warning(
                "WORKER_PRESTART=%r: no prestarted runtime for that language here (it has: %s); none until a job names one",
                settings.worker_prestart, ", ".join(sorted(primes)) or "none",
            )  # fmt: skip
        self.pool = SandboxPool(
            sandboxes, worker_id, settings.worker_max_sandboxes, primes=primes, first_prime=settings.worker_prestart
        )
        self._background: set[asyncio.Task[None]] = set()
        self._job_ended = asyncio.Event()
        # Ids in our claimed list with no task, seen at the previous upkeep. Only ids seen
        # twice are recovered, so a claim between BLMOVE and its task is never mistaken.
        self._suspects: set[str] = set()
        # The janitor leaves sandboxes younger than this alone (a neighbour's self-test).
        self._young_s = 2 * settings.worker_lease_ttl_ms / 1000
        self._signals = 0
        self.continuity = RedisContinuity(settings.worker_heartbeat_ms / 1000, settings.worker_lease_ttl_ms / 1000)
        self._uncovered_warned: set[str] = set()
        # loop.time() of the last look for stale lease declarations (-inf: look in the first round).
        self._timings_pruned_at = float("-inf")
        self._timing = (settings.worker_lease_ttl_ms, settings.worker_heartbeat_ms)
        self._stopping = asyncio.Event()
        self._hard_stop = asyncio.Event()
        # Another process took this worker's id over (see _step_aside).
        self._superseded = False
        self.started_at_ms = now_ms()

    def info(self) -> WorkerInfo:
        pool = self.pool
        return WorkerInfo(
            worker_id=self.worker_id,
            slots=self.settings.worker_max_sandboxes,
            runtimes=[r.info() for r in self.runtimes.values()],
            started_at_ms=self.started_at_ms,
            lease_ttl_ms=self.settings.worker_lease_ttl_ms,
            heartbeat_ms=self.settings.worker_heartbeat_ms,
            load=WorkerLoad(
                jobs_claimed=len(self._jobs),
                jobs_waiting_for_sandbox=pool.waiting,
                sandboxes_ready=pool.ready,
                sandboxes_building=pool.building,
                sandboxes_in_use=pool.in_use,
                sandbox_builds_failed=pool.builds_failed,
                steps_waiting_for_memory=self.sandboxes.memory.waiting,
            ),
        )

    async def run(self) -> None:
        settings = self.settings
        # Every command has a deadline, so a half-open connection cannot hang a heartbeat,
        # an event or a result; the blocking claim gets its poll time on top.
        redis = command_redis(settings.redis_url)
        # Blocking claims get their own connection so they never delay other commands; a
        # claim cut short (a stop) closes it, so Redis drops the pending BLMOVE instead of
        # moving a job into our claimed list after we have left.
        claim_redis = BlockingLeanRedis.from_url(
            settings.redis_url,
            max_connections=1,
            socket_timeout=CLAIM_POLL_S + COMMAND_TIMEOUT_S,
            socket_connect_timeout=COMMAND_TIMEOUT_S,
            **_RECONNECTING,
        )
        control = ControlBus(redis)
        publisher = Publisher(settings, redis)
        queue = WorkerQueue(redis, self.worker_id, settings.job_record_ttl_s, settings.run_result_ttl_s)
        claim_queue = WorkerQueue(
            claim_redis, self.worker_id, settings.job_record_ttl_s, settings.run_result_ttl_s, queue.incarnation
        )
        claim_queue.share_recoveries(queue)
        ctx = WorkerContext(
            settings=settings,
            queue=queue,
            control=control,
            publisher=publisher,
            sandboxes=self.sandboxes,
            pool=self.pool,
            runtimes=self.runtimes,
            flag_sweep=FlagSweep(queue, control),
            owed_results=OwedResults(queue, publisher, settings.pusher_timeout_ms / 1000 + 1),
            stopping=self._stopping,
            hard_stop=self._hard_stop,
        )
        if self._callback_due is not None:
            ctx.callback_due = self._callback_due
        ctx.redis_answers = RedisProbe(redis).answers
        self._install_signal_handlers(ctx)
        if not await queue.take_id(settings.worker_lease_ttl_ms):
            await asyncio.gather(publisher.aclose(), claim_redis.aclose(), redis.aclose(), return_exceptions=True)
            raise WorkerIdInUse(f"another live worker already uses the id {self.worker_id!r} (WORKER_ID)")
        background: list[asyncio.Task[None]] = []
        # From here on the id is ours: whatever ends the run, even a failed start, gives it
        # back (else a restart under the same WORKER_ID is refused for a whole lease).
        try:
            # A previous incarnation with the same id (WORKER_ID) that was killed: nobody
            # else reaps its claims or sweeps its sandboxes, because they carry our id.
            try:
                await queue.recover_claims(self.worker_id)
                await queue.take_unpublished(self.worker_id, dead=False)
            finally:
                self._publish_results(ctx, queue.take_recovered())
            # Only this id's own leftovers now: whether other workers are dead can be judged
            # only once this worker has had Redis for a whole lease (see _upkeep).
            await sweep_orphans(self.sandboxes.cgroups, self.sandboxes.work_root, me=self.worker_id, starting=True)
            await declare_timing(self.sandboxes.work_root, self.worker_id, *self._timing)
            await self._share_memory()
            try:
                await queue.heartbeat(self.info(), settings.worker_lease_ttl_ms)
            except WorkerSuperseded as exc:
                self._step_aside(ctx, exc)
            self.pool.start()
            await control.start()
            background += [
                asyncio.create_task(self._heartbeat(ctx), name="heartbeat"),
                asyncio.create_task(self._upkeep(ctx), name="upkeep"),
                asyncio.create_task(ctx.flag_sweep.run(), name="flag-sweep"),
                asyncio.create_task(ctx.owed_results.run(), name="owed-results"),
            ]
            log.info(
                "worker %s ready: %d slots, languages: %s",
                self.worker_id,
                settings.worker_max_sandboxes,
                ", ".join(f"{r.manifest.language} {r.version}" for r in self.runtimes.values()) or "none",
            )
            await self._claim_until_stopping(ctx, claim_queue)
        finally:
            # Running jobs always get their grace and their result, even if claiming failed.
            await self._drain(ctx)
            await cancel_and_wait(background)
            await self.pool.close()
            await off_loop(self.sandboxes.remove_mount_points)
            # Bounded: a worker told twice to stop must stop even while Redis is away (its
            # lease then simply expires, and others recover its claims). One taken over
            # leaves everything under its id to the process that took it.
            if not self._superseded:
                await self._leave(ctx, timeout_s=2.0)
            await forget_timing(self.sandboxes.work_root, [self.worker_id])
            # Results the recovery wrote go out live before the publisher closes.
            await asyncio.gather(*self._background, return_exceptions=True)
            try:
                await asyncio.wait_for(control.aclose(), 2.0)
            except (RedisError, OSError, TimeoutError):
                pass
            await publisher.aclose()
            await claim_redis.aclose()
            await redis.aclose()
            log.info("worker %s stopped", self.worker_id)

    async def _leave(self, ctx: WorkerContext, timeout_s: float = 2.0) -> None:
        """Hand back what no task holds any more, then unregister.

        Claims can outlive their tasks: a claim cut short by the stop (its id moved, its
        reply never read), a parked job whose hand-back Redis refused, a result write that
        failed under a hard stop. Upkeep would have recovered them; it has stopped, so they
        are recovered here (never started: re-queued; started: lost). Whatever is still
        claimed after that (a job task that would not end) keeps this worker listed, so
        the others reap it once the liveness key is gone.
        """
        if not await ctx.redis_answers():
            return  # (each step would wait out its bound on retries: see RedisProbe)
        # (wait_for, not asyncio.timeout: on Debian's 3.11.2, which the venv runs on, a
        # timeout expiring in a task already cancelled once, as a run() cancelled into its
        # clean-up is, raises CancelledError, and the clean-up after this would be skipped.)
        try:
            await asyncio.wait_for(self._recover_strays(ctx), timeout_s)
        except (RedisError, OSError, TimeoutError):
            pass  # what is left is reaped by the others once the lease is gone
        # A bound of its own: a slow recovery must not keep the liveness key alive a lease.
        try:
            await asyncio.wait_for(ctx.queue.unregister(), timeout_s)
        except (RedisError, OSError, TimeoutError):
            pass

    async def _recover_strays(self, ctx: WorkerContext) -> None:
        await self._recover(ctx, await self._strays(ctx))

    async def _strays(self, ctx: WorkerContext) -> set[str]:
        """Ids in this worker's claimed list that no job task holds."""
        return set(await ctx.queue.claimed_ids(self.worker_id)) - set(self._jobs.values()) - {self._claiming}

    async def _recover(self, ctx: WorkerContext, strays: set[str]) -> None:
        """Recover these claims of ours (re-queued, or lost if started) and publish any result
        (also those of a recovery that failed half-way)."""
        if strays:
            try:
                await ctx.queue.recover_claims(self.worker_id, only=strays)
            finally:
                self._publish_results(ctx, ctx.queue.take_recovered())

    def _install_signal_handlers(self, ctx: WorkerContext) -> None:
        loop = asyncio.get_running_loop()

        def on_signal(signum: int) -> None:
            self._signals += 1
            if self._signals == 1:
                log.info("signal %s: no new jobs; parked jobs go back to the queue; running jobs get %d ms",
                         signal.Signals(signum).name, self.settings.worker_shutdown_grace_ms)  # fmt: skip
                ctx.grace_ends_at = loop.time() + self.settings.worker_shutdown_grace_ms / 1000
                ctx.stopping.set()
            else:
                log.info("second signal: cancelling running jobs now")
                self._hard_stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(signum, on_signal, signum)
            except NotImplementedError:  # pragma: no cover - not on Linux
                pass

    # -- claiming -------------------------------------------------------------------

    def _may_claim(self) -> bool:
        return len(self._jobs) < self.settings.worker_max_parked + self.pool.slots and self.pool.waiting < self.pool.slots

    async def _claim_until_stopping(self, ctx: WorkerContext, claim_queue: WorkerQueue) -> None:
        """Claim until the first signal, then stop at once: a claim waiting on an
        unresponsive Redis must not hold up the drain. A claim cut short leaves at most one
        id in this worker's claimed list, which recovery re-queues (it never started)."""
        claimer = asyncio.create_task(self._claim_loop(ctx, claim_queue), name="claimer")
        stopping = asyncio.ensure_future(ctx.stopping.wait())
        try:
            await asyncio.wait({claimer, stopping}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
            await cancel_and_wait([claimer])
        if claimer.done() and not claimer.cancelled() and claimer.exception() is not None:
            raise claimer.exception()  # type: ignore[misc]

    async def _claim_loop(self, ctx: WorkerContext, claim_queue: WorkerQueue) -> None:
        loop = asyncio.get_running_loop()
        stopping = asyncio.ensure_future(ctx.stopping.wait())
        try:
            while not ctx.stopping.is_set():
                raise_if_cancelled()
                pause_s = ctx.claim_paused_until - loop.time()
                if pause_s > 0:
                    await asyncio.wait({stopping}, timeout=pause_s)
                    continue
                if not self._may_claim():
                    # Full: wait until a job ends or a sandbox frees up.
                    self._job_ended.clear()
                    self.pool.changed.clear()
                    waits = {asyncio.ensure_future(self._job_ended.wait()), asyncio.ensure_future(self.pool.changed.wait())}
                    await asyncio.wait({*waits, stopping}, timeout=CLAIM_POLL_S, return_when=asyncio.FIRST_COMPLETED)
                    for w in waits:
                        w.cancel()
                    continue
                try:
                    claimed = await self._claim_one(ctx, claim_queue)
                except RedisError as exc:
                    log.warning("claim failed (%s); retrying", exc)
                    await asyncio.sleep(0.5)
                    continue
                except Exception:
                    # Never let one bad claim stop the worker; the stray-claim recovery in
                    # upkeep puts back whatever a failed claim left in our list.
                    log.exception("claim failed unexpectedly; retrying")
                    await asyncio.sleep(0.5)
                    continue
                finally:
                    self._publish_results(ctx, claim_queue.take_recovered())
                if claimed is None:
                    continue
                run = JobRun(ctx, *claimed)
                task = asyncio.create_task(run.execute(), name=f"job:{run.job_id}")
                self._jobs[task] = run.job_id
                task.add_done_callback(self._job_done)
                # Not kept while the loop waits (at the parked cap, say): the claim's spec holds
                # the job's inline files, which the job drops once it has planned them.
                del claimed, run, task
        finally:
            stopping.cancel()

    async def _claim_one(self, ctx: WorkerContext, claim_queue: WorkerQueue) -> tuple[Claim, Subscription | None] | None:
        """Take a job, subscribe to its control channels, then claim it.

        Subscribed before the claim reads the job's stored flags: a start stored earlier is
        in the claim, one published later reaches the job by pub/sub, and nothing needs
        reading again on arrival. A job whose subscription failed is claimed all the same
        and handed back by its run (no subscription: None). While the pub/sub connection is
        down nothing is taken (each claim would wait out its subscription, then go back).
        """
        if not ctx.control.connected:
            await asyncio.wait({ctx.control.next_replacement()}, timeout=CLAIM_POLL_S)
            return None
        job_id = await claim_queue.take(CLAIM_POLL_S)
        if job_id is None:
            return None
        self._claiming = job_id
        sub: Subscription | None = None
        try:
            try:
                sub = await ctx.control.subscribe(job_id)
            except (RedisError, TimeoutError) as exc:
                log.warning("job %s: cannot subscribe to its control channels (%s); handing it back", job_id, exc)
            claim = await claim_queue.claim_taken(job_id, asyncio.get_running_loop().time())
        except BaseException:
            if sub is not None:
                await ctx.control.unsubscribe(sub)
            raise
        finally:
            self._claiming = None
        if claim is None:
            if sub is not None:
                await ctx.control.unsubscribe(sub)
            return None
        return claim, sub

    def _job_done(self, task: asyncio.Task[None]) -> None:
        self._jobs.pop(task, None)
        self._job_ended.set()

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
            # Each cancelled job still writes its one result (briefly, under a hard stop).
            await cancel_and_wait(list(self._jobs), JOB_CANCEL_WAIT_S)
        all_done.cancel()

    async def _heartbeat(self, ctx: WorkerContext) -> None:
        """Keep the lease alive; nothing else shares this loop, so nothing can delay it.

        Each beat's answer or failure also tells `self.continuity` whether Redis has answered
        without a break, which judging other workers dead depends on (see `_upkeep`).
        """
        loop = asyncio.get_running_loop()
        interval_s = self.settings.worker_heartbeat_ms / 1000
        while True:
            raise_if_cancelled()
            sent_at = loop.time()
            try:
                # A beat that hangs (a half-open connection) is abandoned for the next one.
                dataset = await asyncio.wait_for(
                    ctx.queue.heartbeat(self.info(), self.settings.worker_lease_ttl_ms), max(interval_s, 1.0)
                )
                self.continuity.answered(sent_at, dataset)
            except WorkerSuperseded as exc:
                self._step_aside(ctx, exc)
                return
            except Exception as exc:  # a failed beat is retried at the next interval
                self.continuity.failed(sent_at)
                # (A beat given up on is a TimeoutError with no text of its own.)
                log.warning("heartbeat failed: %s", str(exc) or type(exc).__name__)
            await asyncio.sleep(interval_s)

    def _step_aside(self, ctx: WorkerContext, exc: WorkerSuperseded) -> None:
        """This process froze past its lease and another took its id over (same WORKER_ID):
        its claims are the other's now, so it claims nothing more, recovers nothing, and ends
        its jobs at once (their writes are fenced off already)."""
        log.error("%s (this process stalled past its lease): stopping, leaving everything to it", exc)
        self._superseded = True
        ctx.stopping.set()
        self._hard_stop.set()

    async def _upkeep(self, ctx: WorkerContext) -> None:
        """Reap dead workers' claims, recover our own strays, remove dead workers' sandboxes."""
        interval_s = self.settings.worker_heartbeat_ms / 1000
        while True:
            await asyncio.sleep(interval_s)
            raise_if_cancelled()
            if self._superseded:
                return  # (its strays are the other process's claims)
            try:
                # Again each round: a sweep may have taken it while this worker restarted
                # under the id of one judged dead.
                await declare_timing(self.sandboxes.work_root, self.worker_id, *self._timing)
                await self._share_memory()
                await ctx.queue.check_unanswered()
                strays = await self._strays(ctx)
                confirmed, self._suspects = strays & self._suspects, strays - self._suspects
                await self._recover(ctx, confirmed)
                await self._judge_others(ctx)
                await self._prune_declarations()
            except (RedisError, OSError, TimeoutError) as exc:
                # Redis away: expected, and said by every beat too; no traceback each round.
                log.warning("upkeep failed (%s); trying again at the next interval", str(exc) or type(exc).__name__)
            except Exception:
                log.exception("upkeep failed; trying again at the next interval")
            finally:
                # Also what a round that failed half-way had ended already.
                try:
                    self._publish_results(ctx, ctx.queue.take_recovered())
                except Exception:
                    log.exception("publishing recovered results failed")

    async def _judge_others(self, ctx: WorkerContext) -> None:
        """Reap the claims and remove the sandboxes of workers whose lease lapsed while Redis
        answered us without a break (a lease lapsed in an outage says nothing)."""
        token = self.continuity.judging()
        if token is None:
            return
        listed = await ctx.queue.listed_workers()
        owners = await sandbox_owners(self.sandboxes.cgroups, self.sandboxes.work_root, self.worker_id, self._young_s)
        dead = await ctx.queue.unleased(listed | owners)
        # The reads may have waited out a stall that lapsed every lease: act on them only
        # once a beat sent after them shows there was none (a wait of about one interval,
        # only in a round that finds someone to reap or sweep).
        if not dead or not await self.continuity.held(token, after=asyncio.get_running_loop().time()):
            return
        # A last look just before acting: a worker that renewed its lease since it was judged
        # (one that thawed) is alive after all.
        looked_at = asyncio.get_running_loop().time()
        dead = await ctx.queue.unleased(dead)
        dead -= await self._uncovered(ctx, dead, looked_at)
        await ctx.queue.reap_dead_workers(dead & listed)  # (a sandbox owner still starting has no claims)
        if dead:
            await sweep_orphans(
                self.sandboxes.cgroups, self.sandboxes.work_root, me=self.worker_id, dead=dead, min_age_s=self._young_s
            )

    async def _share_memory(self) -> None:
        """Admit steps against this worker's part of the host's memory ceiling: the workers
        on a host all write the same one (worker/isolation/memory.py)."""
        memory = self.sandboxes.memory
        workers = await live_workers_here(self.sandboxes.work_root)
        before = memory.capacity_bytes
        memory.share_with(workers)
        if memory.capacity_bytes != before:
            log.info("%d worker(s) on this host: this one runs steps of up to %d MiB of memory limits at once", workers, memory.capacity_bytes >> 20)

    async def _prune_declarations(self) -> None:
        """Now and then, remove the lease declarations of workers long gone from this host
        (janitor.prune_timings), keeping those of every worker with a sandbox here, however
        new."""
        now = asyncio.get_running_loop().time()
        if now < self._timings_pruned_at + PRUNE_TIMINGS_EVERY_S:
            return
        self._timings_pruned_at = now
        owners = await sandbox_owners(self.sandboxes.cgroups, self.sandboxes.work_root, self.worker_id)
        await prune_timings(self.sandboxes.work_root, owners | {self.worker_id})

    async def _uncovered(self, ctx: WorkerContext, worker_ids: set[str], looked_at: float) -> set[str]:
        """Those of `worker_ids` whose lease settings (from the workers list, else as declared
        on this host) differ from ours (a fleet changing them) in a way our record cannot vouch
        for yet: a Redis stall that lapses their lease might not have been a break for us, or
        they may not have renewed since the last one. They are judged again next round."""
        uncovered: set[str] = set()
        timings = await ctx.queue.worker_timings(worker_ids)
        # A sandbox owner that is not listed (Redis lost its data, or it has not heartbeaten
        # yet) may have declared its settings on this host.
        unknown = [wid for wid, timing in timings.items() if timing is None]
        timings.update(await declared_timings(self.sandboxes.work_root, unknown))
        for wid, timing in timings.items():
            own = (self.settings.worker_lease_ttl_ms, self.settings.worker_heartbeat_ms)
            if timing is None or timing == own or self.continuity.may_judge(timing[0] / 1000, timing[1] / 1000, looked_at):
                continue
            uncovered.add(wid)
            if wid not in self._uncovered_warned:
                self._uncovered_warned.add(wid)
                log.warning(
                    "worker %s looks dead; its WORKER_LEASE_TTL_MS=%d / WORKER_HEARTBEAT_MS=%d differ from ours (%d / %d) "
                    "and Redis has not answered us steadily enough to judge it yet",
                    wid, timing[0], timing[1], self.settings.worker_lease_ttl_ms, self.settings.worker_heartbeat_ms,
                )  # fmt: skip
        return uncovered

    def _publish_results(self, ctx: WorkerContext, ended: list[tuple[str, bytes]]) -> None:
        """Publish results recovery wrote, without waiting for soketi."""
        if ended:
            ctx.callback_due()  # any of them may have a callback queued
        for job_id, result in ended:
            lane = ctx.publisher.lane(keys.realtime_channel(job_id))
            lane.send("result", result)
            task = asyncio.create_task(lane.close(timeout_s=2.0))
            self._background.add(task)  # keep a reference until it is done
            task.add_done_callback(self._background.discard)


def _primes(factory: SandboxFactory, runtimes: dict[str, Runtime]) -> dict[str, Prime]:
    """The prestartable runtime of every language whose manifest has a shim, set up for a
    job with the language's default limits (jobs with other limits run from a plain jail)."""
    primes: dict[str, Prime] = {}
    for language, runtime in runtimes.items():
        m = runtime.manifest
        if m.prestart is None:
            continue
        prime = factory.prime_for(language, m.run, m.prestart, dict(m.env), with_overrides(DEFAULT_LIMITS, m.limits))
        if prime is not None:
            primes[language] = prime
    return primes
