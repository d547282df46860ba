"""What every job run shares with its worker, built once at start-up."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from shared.settings import Settings
from worker.isolation.pool import SandboxPool
from worker.isolation.sandbox import SandboxFactory
from worker.job.blobs import SharedBlobs
from worker.messaging.control import ControlBus
from worker.messaging.flagsweep import FlagSweep
from worker.messaging.owed import OwedResults
from worker.messaging.publisher import Publisher
from worker.messaging.queue import WorkerQueue
from worker.runtimes import Runtime

__all__ = ["WorkerContext"]


async def _answers_always() -> bool:
    return True


@dataclass
class WorkerContext:
    settings: Settings
    queue: WorkerQueue
    control: ControlBus
    publisher: Publisher
    sandboxes: SandboxFactory
    pool: SandboxPool
    runtimes: dict[str, Runtime]
    # Reads the stored flags of every parked job at once (see worker.messaging.flagsweep).
    flag_sweep: FlagSweep
    # Results a job's lane surely did not get to soketi, sent again from the log (None: a
    # context of a test without one; the lane's word is then taken).
    owed_results: OwedResults | None = None
    # Set on SIGTERM: parked jobs go back to the queue, nothing new is claimed.
    stopping: asyncio.Event = field(default_factory=asyncio.Event)
    # loop.time() at which the stop's grace for running jobs ends (0: no grace given).
    grace_ends_at: float = 0.0
    # Set on the second signal: stop now; what cannot be written at once is left for recovery.
    hard_stop: asyncio.Event = field(default_factory=asyncio.Event)
    # loop.time() before which the claimer takes nothing: set after handing on a job this
    # worker cannot run, so it does not take the same job straight back again and again.
    claim_paused_until: float = 0.0
    # Tells this process's callback sender that a delivery was queued (no-op without one).
    callback_due: Callable[[], None] = lambda: None
    # Uploaded blobs' bytes, one copy for all the jobs that name each (worker.job.blobs).
    blobs: SharedBlobs = field(default_factory=SharedBlobs)
    # Whether Redis answers now, asked without retries: a stop's last writes are left to
    # recovery when it does not (worker.messaging.probe).
    redis_answers: Callable[[], Awaitable[bool]] = _answers_always
