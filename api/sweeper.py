"""What an API process does now and then for live delivery that a request could not finish.

Two gaps a request leaves, each closed by a sweep every REALTIME_SWEEP_MS in every API
process:

- **Owed publishes.** The API publishes a result itself in a few cases: a kill that ended a
  queued job, a late subscriber's replay, an ended job's result sent again to a new first
  subscriber (api/webhooks.py). It does so after answering, and a process that dies in
  between would leave the follower without a result for good. The script that ends the job
  (or takes the replay) also puts a debt of that one publish on keys.API_UNPUBLISHED
  (api.store.OwedPublish); the publish confirms it when its turn comes and takes it off
  once soketi took the result. One left there past its time (the process died, soketi was
  away or took far too long) is taken by the next sweep of any API process (moved to
  keys.API_UNPUBLISHED_TAKEN, so a late owner leaves it), which publishes the job's result
  from its log; if soketi does not take it, the sweep's lease runs out and a sweep tries
  again, until the log expires. A follower then sees a gap in `seq` and reads the log. (A
  result whose request timed out may have gone all the same: then it goes twice, where
  before it was lost.)
- **Lost webhooks.** Workers publish a job's events only once its audience is marked, and a
  subscription signed outside the API is marked only by soketi's `channel_occupied` webhook,
  which soketi sends once and never again: one that found the API down or restarting is
  lost, and so was every live event of that job. The sweep asks soketi which job channels
  have subscribers and marks those that stay unmarked across two sweeps (one sweep apart:
  a webhook on its way lands first, and its replay is not sent twice), as the webhook
  would have, replay included.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from api.realtime import RealtimePublisher
from api.store import JobStore
from shared import keys

__all__ = ["RealtimeSweeper"]

log = logging.getLogger(__name__)


class RealtimeSweeper:
    def __init__(self, store: JobStore, realtime: RealtimePublisher, interval_ms: int) -> None:
        self._store = store
        self._realtime = realtime
        self._interval_s = interval_ms / 1000
        # Occupied job channels the last sweep found unmarked, and those known marked.
        self._unmarked: set[str] = set()
        self._marked: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._interval_s > 0:
            self._task = asyncio.create_task(self._run())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception as exc:  # (Redis or soketi away a moment: the next sweep retries)
                log.warning("realtime sweep failed: %s", exc)
            await asyncio.sleep(self._interval_s)

    async def sweep(self) -> None:
        await self.publish_owed()
        await self.mark_unheard()

    async def publish_owed(self) -> None:
        for debt, entry in await self._store.take_owed_publishes():
            job_id = debt.split(":", 1)[0]
            if entry is not None and entry[0] == "result":
                log.info("job %s: publishing the result an API process owed its channel", job_id)
                if not await self._realtime.publish(keys.realtime_channel(job_id), [entry]):
                    continue  # (taken for a while: then any sweep tries again)
            await self._store.settle_owed(debt, taken=True)

    async def mark_unheard(self) -> None:
        occupied = await self._realtime.occupied_jobs()
        if occupied is None:
            return
        # A mark, once there, stays as long as its job's record: only channels not known
        # marked are looked up, so an IDE's thousand open channels cost one look each, once.
        now = set(occupied)
        new = now - self._marked
        unmarked = set(await self._store.unmarked(sorted(new)))
        marking = unmarked & self._unmarked
        for job_id in sorted(marking):
            log.info("job %s: followed with no audience mark (a lost webhook): marking it", job_id)
            missed = await self._store.mark_subscribed(job_id, unmarked_only=True)
            if missed.events:
                self._realtime.publish_soon(keys.realtime_channel(job_id), missed)
        self._marked = (self._marked & now) | (new - unmarked) | marking
        self._unmarked = unmarked - marking
