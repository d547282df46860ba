"""The callback sender: a task beside the worker that POSTs finished jobs' results.

It runs in every worker process (off the jobs' path: its own Redis connection, its own
HTTP client, at most CALLBACK_CONCURRENCY deliveries at once) and takes due deliveries
from the shared due set, so whichever worker is free sends, and a worker that dies leaves
its deliveries to the others (see deliveries.py). Each attempt is signed afresh:

    X-Coderunner-Timestamp: <Unix seconds>
    X-Coderunner-Signature: sha256=<hex HMAC-SHA256(CALLBACK_SECRET, "<timestamp>.<body>")>
    X-Coderunner-Delivery:  <jobId>:<attempt>

A 2xx answer delivers it. Anything else (another status, no answer within
CALLBACK_TIMEOUT_MS, no connection) is retried after CALLBACK_BACKOFF_MS, doubling up to
CALLBACK_BACKOFF_MAX_MS, until CALLBACK_RETRY_FOR_S after the job ended; then it has
failed. A host that resolves to a refused address fails at once.

One receiver (host and port) has at most CALLBACK_MAX_PER_HOST attempts in flight across
every sender: a receiver that never answers holds those, and the other receivers' deliveries
go out beside them. Its other deliveries wait, uncounted, for one of its attempts to end.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from leanredis import LeanRedis
from shared import callbacks
from shared.errors import ValidationError
from shared.settings import Settings
from worker.callbacks.deliveries import Deliveries, Delivery, ResultGone
from worker.callbacks.send import AttemptFailed, Refused, Resolver, checked, new_client, post
from worker.tasks import cancel_and_wait, raise_if_cancelled

__all__ = ["CallbackSender", "callback_sender"]

log = logging.getLogger(__name__)

# How often the due set is looked at when nothing is due sooner and nothing woke the
# sender: deliveries this worker queues, and the end of its own attempts, wake it at once,
# so the poll only finds those queued elsewhere (by the API, or by busier senders).
POLL_S = 1.0
# A taken delivery is held this long past the attempt's own time limit before another
# sender may take it again (time to report, and for the clocks of two hosts to differ).
LEASE_MARGIN_MS = 5000
COMMAND_TIMEOUT_S = 5.0
_RECONNECTING: dict[str, Any] = {
    "retry": Retry(ExponentialBackoff(cap=1.0, base=0.02), 6),
    "retry_on_error": [RedisConnectionError, RedisTimeoutError],
}


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class CallbackSender:
    def __init__(self, settings: Settings, redis: Redis, client: httpx.AsyncClient, sender_id: str) -> None:
        self.settings = settings
        self.deliveries = Deliveries(redis)
        self.client = client
        self.resolver = Resolver()
        self.sender_id = sender_id
        self._lease_ms = settings.callback_timeout_ms + LEASE_MARGIN_MS
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._woken = asyncio.Event()
        self.delivered = 0
        self.failed = 0
        self.retried = 0

    def wake(self) -> None:
        """A delivery may be due now (a result with a callback was just stored): look at once."""
        self._woken.set()

    async def run(self) -> None:
        """Take and send due deliveries until cancelled."""
        pause = POLL_S
        while True:
            raise_if_cancelled()
            self._woken.clear()
            try:
                pause = await self._round()
            except RedisError as exc:
                log.warning("callbacks: Redis unavailable (%s); trying again shortly", exc)
                pause = 1.0
            except Exception:
                # Never let one bad round end the sender for the rest of the worker's life.
                log.exception("callbacks: sender round failed; trying again shortly")
                pause = 1.0
            if not self._woken.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._woken.wait(), pause)

    async def _round(self) -> float:
        free = self.settings.callback_concurrency - len(self._inflight)
        if free <= 0:
            return POLL_S
        now = now_ms()
        due, upcoming = await self.deliveries.due_and_next(now, free + len(self._inflight))
        taken = put_off = False
        for job_id in due:
            if job_id in self._inflight or free <= 0:
                continue
            token = f"{self.sender_id}:{uuid.uuid4().hex[:12]}"
            # The lease counts from its own claim: earlier claims of the round may have been slow.
            delivery = await self.deliveries.take(
                job_id, now_ms(), self._lease_ms, token, self.settings.callback_max_per_host
            )
            if delivery == "put off":
                put_off = True
                continue
            if delivery is None:
                continue
            free -= 1
            taken = True
            task = asyncio.create_task(self._deliver(delivery), name=f"callback-{job_id}")
            self._inflight[job_id] = task
            task.add_done_callback(lambda _t, job_id=job_id: self._attempt_over(job_id))
        if put_off and free > 0:
            # Those moved past now, out of the way of the ones behind them: look again at once.
            return 0.0
        if taken:
            upcoming = await self.deliveries.next_due_ms()  # what was taken is leased now
        elif due:
            # Due, yet none could be taken: ours still in flight past their lease (their
            # scores stay at or before now), or held by other senders. Nothing changes for
            # us before they end: poll, do not spin.
            return POLL_S
        if upcoming is None:
            return POLL_S
        return min(POLL_S, max(0.0, (upcoming - now_ms()) / 1000))

    def _attempt_over(self, job_id: str) -> None:
        # A slot is free, and a retry may already be due (a zero backoff, or a long attempt).
        self._inflight.pop(job_id, None)
        self.wake()

    async def stop(self) -> None:
        await cancel_and_wait(list(self._inflight.values()))
        self.resolver.close()

    async def _deliver(self, delivery: Delivery) -> None:
        try:
            await self._attempt(delivery)
        except asyncio.CancelledError:
            raise
        except Exception:
            # Its report failed (Redis away): held until its lease runs out, then taken again.
            log.exception("job %s: callback attempt %d could not be reported", delivery.job_id, delivery.attempt)

    async def _attempt(self, delivery: Delivery) -> None:
        settings = self.settings
        job_id = delivery.job_id
        status: int | None = None
        heard: list[int] = []
        # Over LEASE_MARGIN_MS before the lease ends, whenever the claim's answer came: a
        # delivery still being sent when another sender may take it goes out twice.
        left_ms = min(settings.callback_timeout_ms, delivery.leased_at_ms + settings.callback_timeout_ms - now_ms())
        try:
            if left_ms <= 0:
                raise TimeoutError
            async with asyncio.timeout(left_ms / 1000):
                status = await self._send(delivery, heard.append)
        except (Refused, ValidationError, ResultGone) as exc:
            why = f"refused: {exc}" if not isinstance(exc, ResultGone) else "the job's result has expired"
            log.warning("job %s: callback given up: %s", job_id, why)
            self.failed += 1
            await self.deliveries.report(delivery, "failed", now_ms(), error=why)
            return
        except (AttemptFailed, TimeoutError) as exc:
            # The deadline fell while a body was read: the status had come, and it stands.
            status = heard[0] if heard else None
            error = (
                str(exc) if isinstance(exc, AttemptFailed) else f"no answer within {settings.callback_timeout_ms} ms"
            )
            if isinstance(exc, AttemptFailed) and exc.where:
                log.info("job %s: callback attempt %d: %s (%s)", job_id, delivery.attempt, error, exc.where)
        except Exception as exc:
            # Ours, not the receiver's (the stored result unreadable, Redis failing while it
            # is read): an attempt like any other, so the window still ends it.
            log.exception("job %s: callback attempt %d failed unexpectedly", job_id, delivery.attempt)
            error = f"the sender failed: {type(exc).__name__}"
        if status is not None:
            if 200 <= status < 300:
                self.delivered += 1
                log.info("job %s: callback delivered (attempt %d, HTTP %d)", job_id, delivery.attempt, status)
                await self.deliveries.report(delivery, "delivered", now_ms(), status=status)
                return
            error = f"HTTP {status}"
        now = now_ms()
        delay = callbacks.retry_delay_ms(
            delivery.attempt, settings.callback_backoff_ms, settings.callback_backoff_max_ms
        )
        if now + delay > delivery.ended_at_ms + settings.callback_window_s * 1000:
            self.failed += 1
            log.warning("job %s: callback failed after %d attempts (%s)", job_id, delivery.attempt, error)
            await self.deliveries.report(delivery, "failed", now, status=status, error=error)
            return
        self.retried += 1
        log.info("job %s: callback attempt %d failed (%s); next in %d ms", job_id, delivery.attempt, error, delay)
        await self.deliveries.report(delivery, "retry", now, next_attempt_ms=now + delay, status=status, error=error)

    async def _send(self, delivery: Delivery, answered: Callable[[int], None]) -> int:
        settings = self.settings
        # The URL was checked at submit; the settings may have changed since, so again.
        target = callbacks.parse_callback_url(delivery.url, settings.callback_allow_http)
        addresses = checked(target, await self.resolver.resolve(target), settings.callback_allow_private)
        body = await self.deliveries.body(delivery)
        timestamp_s = int(time.time())
        mac = callbacks.signer(settings.callback_secret, timestamp_s)
        size = 0
        async for piece in body.pieces():
            mac.update(piece)
            size += len(piece)
        headers = {
            "Content-Type": "application/json",
            "Content-Length": str(size),
            callbacks.SIGNATURE_HEADER: callbacks.signature(mac),
            callbacks.TIMESTAMP_HEADER: str(timestamp_s),
            callbacks.DELIVERY_HEADER: f"{delivery.job_id}:{delivery.attempt}",
            callbacks.JOB_HEADER: delivery.job_id,
            callbacks.ATTEMPT_HEADER: str(delivery.attempt),
        }
        return await post(self.client, target, addresses, headers, body.pieces, answered)


@contextlib.asynccontextmanager
async def callback_sender(settings: Settings, sender_id: str) -> AsyncIterator[CallbackSender | None]:
    """Run a sender for as long as the block runs (none without CALLBACK_SECRET)."""
    if not settings.callback_secret:
        log.warning("CALLBACK_SECRET is not set: this worker sends no callbacks")
        yield None
        return
    redis = LeanRedis.from_url(
        settings.redis_url,
        socket_timeout=COMMAND_TIMEOUT_S,
        socket_connect_timeout=COMMAND_TIMEOUT_S,
        **_RECONNECTING,
    )
    client = new_client(settings)
    sender = CallbackSender(settings, redis, client, sender_id)
    task = asyncio.create_task(sender.run(), name="callback-sender")
    try:
        yield sender
    finally:
        await cancel_and_wait([task])
        await sender.stop()
        log.info(
            "callbacks: %d delivered, %d failed, %d attempts to retry", sender.delivered, sender.failed, sender.retried
        )
        await client.aclose()
        await redis.aclose()
