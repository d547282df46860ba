"""Results owed live that a job's lane surely did not get to soketi, sent again from the log.

A followed job's result is owed live until the worker says it went (its heartbeat takes the
job off its unpublished set: keys.worker_unpublished_key). A lane whose result soketi never
had (shed while soketi was paused after a failure, or refused) used to say it went all the
same when it closed: a client that stayed subscribed then waited for a result that no one
would ever publish. Such a result stays owed here instead: it is read from the job's log and
sent on a lane of its own after RETRY_S[0], then again with longer pauses, until soketi has
it; past the last pause the worker stops owing it (the log and GET /output still have it,
and a client that subscribes again is sent it by the API). Should the worker die meanwhile,
whoever reaps it publishes the result, as for any result still owed.

A result that may have reached soketi (a request that timed out) is never sent again here:
a client acts on a result once.
"""

from __future__ import annotations

import asyncio
import logging

from shared import keys
from worker.messaging.publisher import Publisher
from worker.messaging.queue import WorkerQueue

__all__ = ["RETRY_S", "OwedResults"]

log = logging.getLogger(__name__)

# Pauses before each attempt, in seconds: about a minute in all.
RETRY_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0)


class OwedResults:
    def __init__(self, queue: WorkerQueue, publisher: Publisher, lane_timeout_s: float) -> None:
        self._queue = queue
        self._publisher = publisher
        self._lane_timeout_s = lane_timeout_s
        # job id -> (loop time of its next attempt, attempts made)
        self._owed: dict[str, tuple[float, int]] = {}
        self._wakeup = asyncio.Event()
        self.sent_again = 0

    def __len__(self) -> int:
        return len(self._owed)

    def owe(self, job_id: str) -> None:
        """`job_id`'s result did not reach soketi: send it again from the log, soon."""
        self._owed[job_id] = (asyncio.get_running_loop().time() + RETRY_S[0], 0)
        self._wakeup.set()

    async def run(self) -> None:
        """Send owed results as they come due, until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            self._wakeup.clear()
            now = loop.time()
            due = [job_id for job_id, (at, _) in self._owed.items() if at <= now]
            for job_id in due:
                await self._attempt(job_id)
            if due:
                continue
            wait = min((at for at, _ in self._owed.values()), default=now + 3600.0) - loop.time()
            if wait > 0:
                try:
                    await asyncio.wait_for(self._wakeup.wait(), wait)
                except TimeoutError:
                    pass

    async def _attempt(self, job_id: str) -> None:
        _, attempts = self._owed[job_id]
        attempts += 1
        try:
            result = await self._queue.last_result(job_id)
        except Exception as exc:  # (Redis away: the next attempt reads again)
            log.info("job %s: owed result could not be read (%s); trying again", job_id, exc)
            went = False
        else:
            went = result is None or await self._send(job_id, result)  # (none: its log expired)
        if not went and attempts < len(RETRY_S):
            self._owed[job_id] = (asyncio.get_running_loop().time() + RETRY_S[attempts], attempts)
            return
        if not went:
            log.warning("job %s: its result could not be published live after %d attempts", job_id, attempts)
        del self._owed[job_id]
        self._queue.delivered(job_id)  # (sent, or given up: its log and GET /output have it)

    async def _send(self, job_id: str, result: bytes) -> bool:
        lane = self._publisher.lane(keys.realtime_channel(job_id))
        lane.send("result", result)
        await lane.close(self._lane_timeout_s)
        self.sent_again += not lane.result_lost
        return not lane.result_lost
