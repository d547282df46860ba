"""The Redis side of callbacks: take a due delivery, report how an attempt went, read the body.

A delivery is queued by the very script that writes its job's result (CALLBACK_DUE_LUA in
shared/callbacks.py): `callbacks:due` scores the job id with the time it is due, and the
job's callback record (`job:<id>:callback`) holds its URL and delivery state.

Taking a delivery counts an attempt and moves it a lease ahead in the due set, under a
claim token; only the holder of that token may report on the attempt. A sender that dies
mid-attempt leaves the delivery due again once the lease runs out, and another sender takes
it (the next attempt). So delivery is at least once: a receiver may see a job's result more
than once, always with the same body.

Taking one also books a place at its receiver (the record's `host`, `host:port`) for the
lease, up to a bound across all senders. Past it, the delivery is put off without an
attempt counted: due again when the receiver's first lease runs out, or at once when a
report ends one of its attempts (which pulls the longest-waiting one forward).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal

import msgspec
from redis.asyncio import Redis

from leanredis.scripts import OomTolerantScript
from shared import keys
from shared.codec import decode_stored
from shared.eventlog import LoggedStreams
from shared.messages import Outcome, ResultCallback, ResultEvent, RunResult, RunResultCallback, output_without_run
from shared.runresult import OutputGone, run_result_pieces

__all__ = ["CallbackBody", "Deliveries", "Delivery", "ResultGone"]

# KEYS: due set, callback record. ARGV: job id, now ms, lease ms, claim token, the host key
# prefix, the most deliveries in flight to one receiver (0: no bound).
# Returns false (not due, or nothing to send any more: then it leaves the due set), 0 (its
# receiver has its bound in flight: put off until one of those attempts ends, or the first
# lease there runs out should its sender have died), or {attempt, url, collect, ended at
# ms}. Sent again with the same token (its reply lost), it answers the same attempt.
_TAKE = """
local cb = redis.call('HMGET', KEYS[2], 'url', 'collect', 'state', 'endedAtMs', 'claim', 'attempts', 'host')
if cb[5] == ARGV[4] then return {tonumber(cb[6]), cb[1], cb[2] or '', cb[4]} end
local now = tonumber(ARGV[2])
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) > now then return false end
if (not cb[1]) or cb[3] ~= 'pending' or (not cb[4]) then
  redis.call('ZREM', KEYS[1], ARGV[1])
  return false
end
local lease_ms = tonumber(ARGV[3])
if tonumber(ARGV[6]) > 0 then
  local held = ARGV[5] .. (cb[7] or cb[1])
  local waiting = held .. ':waiting'
  redis.call('ZREMRANGEBYSCORE', held, '-inf', now)
  if redis.call('ZCARD', held) >= tonumber(ARGV[6]) then
    local first = redis.call('ZRANGE', held, 0, 0, 'WITHSCORES')
    redis.call('ZADD', KEYS[1], first[2], ARGV[1])
    redis.call('ZADD', waiting, 'NX', score, ARGV[1])
    redis.call('PEXPIRE', waiting, lease_ms)
    return 0
  end
  redis.call('ZADD', held, now + lease_ms, ARGV[1])
  if redis.call('PTTL', held) < lease_ms then redis.call('PEXPIRE', held, lease_ms) end
  redis.call('ZREM', waiting, ARGV[1])
end
local attempt = redis.call('HINCRBY', KEYS[2], 'attempts', 1)
redis.call('HSET', KEYS[2], 'claim', ARGV[4], 'lastAttemptAtMs', ARGV[2])
redis.call('HDEL', KEYS[2], 'nextAttemptAtMs')
redis.call('ZADD', KEYS[1], now + lease_ms, ARGV[1])
return {attempt, cb[1], cb[2] or '', cb[4]}
"""

# KEYS: due set, callback record. ARGV: job id, claim token, 'delivered' | 'retry' | 'failed',
# now ms, next attempt ms (retry), HTTP status ('' for none), error ('' for none), the host
# key prefix.
# Returns 1, or 0 when the token no longer holds the delivery (its lease ran out and another
# sender took it, or this report was already made). The attempt's place at its receiver is
# free again: the delivery put off there longest is due now.
_REPORT = """
local cb = redis.call('HMGET', KEYS[2], 'claim', 'host', 'url')
if cb[1] ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[2], 'claim')
local held = ARGV[8] .. (cb[2] or cb[3] or '')
if redis.call('ZREM', held, ARGV[1]) == 1 then
  for _ = 1, 16 do
    local next = redis.call('ZPOPMIN', held .. ':waiting')
    if not next[1] then break end
    local due = redis.call('ZSCORE', KEYS[1], next[1])
    if due then
      if tonumber(due) > tonumber(ARGV[4]) then redis.call('ZADD', KEYS[1], ARGV[4], next[1]) end
      break
    end
  end
end
if ARGV[6] ~= '' then redis.call('HSET', KEYS[2], 'lastStatus', ARGV[6]) else redis.call('HDEL', KEYS[2], 'lastStatus') end
if ARGV[7] ~= '' then redis.call('HSET', KEYS[2], 'lastError', ARGV[7]) else redis.call('HDEL', KEYS[2], 'lastError') end
if ARGV[3] == 'retry' then
  redis.call('HSET', KEYS[2], 'nextAttemptAtMs', ARGV[5])
  redis.call('ZADD', KEYS[1], ARGV[5], ARGV[1])
  return 1
end
if ARGV[3] == 'delivered' then
  redis.call('HSET', KEYS[2], 'state', 'delivered', 'deliveredAtMs', ARGV[4])
else
  redis.call('HSET', KEYS[2], 'state', 'failed')
end
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
"""


# KEYS: status, stored output, stdout stream. Returns {result, output, stdout stream exists}.
# A script, not MULTI: Redis refuses every command queued in MULTI at its maxmemory, reads too.
_BODY_LOOK = """
return {redis.call('HGET', KEYS[1], 'result'), redis.call('GET', KEYS[2]), redis.call('EXISTS', KEYS[3])}
"""

_encoder = msgspec.json.Encoder()


class ResultGone(Exception):
    """The job's result (or its output) has expired: there is nothing left to send."""


class Delivery(msgspec.Struct, frozen=True, kw_only=True):
    """One attempt at one job's callback, held under `token`."""

    job_id: str
    attempt: int
    url: str
    collect: bool
    ended_at_ms: int
    token: str
    leased_at_ms: int = 0  # the lease runs from here (its length: the sender's)


class CallbackBody:
    """A callback body that can be produced twice, byte for byte: once to sign (and count),
    once to send. A RunResult with its output is streamed from Redis in slices, never built
    whole; anything else is one small piece."""

    def __init__(
        self,
        redis: Redis,
        job_id: str,
        whole: bytes | None = None,
        meta: bytes | None = None,
        from_log: bool = False,
    ) -> None:
        self._redis = redis
        self._job_id = job_id
        self._whole = whole
        self._meta = meta
        # The output is read from the job's log (a lost job's: no worker stored it).
        self._from_log = from_log

    async def pieces(self) -> AsyncIterator[bytes]:
        if self._whole is not None:
            yield self._whole
            return
        assert self._meta is not None
        redis, job_id = self._redis, self._job_id

        async def read(stream: str, offset: int, size: int) -> bytes:
            return bytes(await redis.getrange(keys.output_stream_key(job_id, stream), offset, offset + size - 1))

        head = b'{"jobId":' + _encoder.encode(job_id) + b","
        reader = LoggedStreams(redis.xrange, keys.events_key(job_id)) if self._from_log else read
        try:
            async for piece in run_result_pieces(reader, self._meta, head):
                yield piece
        except OutputGone:
            raise ResultGone(job_id) from None  # (expired mid-read: nothing whole is left to send)


class Deliveries:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        # Run at Redis's maxmemory too: results stored then (allow-oom) queue deliveries.
        self._take = OomTolerantScript(redis, _TAKE)
        self._report = OomTolerantScript(redis, _REPORT)
        self._body_look = redis.register_script(_BODY_LOOK)

    async def due_and_next(self, now_ms: int, count: int) -> tuple[list[str], int | None]:
        """Up to `count` job ids whose callback is due (others may take them first), and when
        the earliest delivery is due (None: none queued), in one round trip: an idle sender
        asks five times a second."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrangebyscore(keys.CALLBACKS_DUE, "-inf", now_ms, start=0, num=count)
            pipe.zrange(keys.CALLBACKS_DUE, 0, 0, withscores=True)
            raw, first = await pipe.execute()
        return [item.decode() for item in raw], int(first[0][1]) if first else None

    async def next_due_ms(self) -> int | None:
        """When the earliest delivery is due (None: none queued)."""
        first = await self.redis.zrange(keys.CALLBACKS_DUE, 0, 0, withscores=True)
        return int(first[0][1]) if first else None

    async def take(
        self, job_id: str, now_ms: int, lease_ms: int, token: str, per_host: int = 0
    ) -> Delivery | Literal["put off"] | None:
        """Count an attempt at `job_id`'s callback and hold it for `lease_ms`; None when it is
        not due (any more) or has nothing left to send, "put off" when its receiver has
        `per_host` attempts in flight already (0: no bound)."""
        raw = await self._take(
            keys=[keys.CALLBACKS_DUE, keys.callback_key(job_id)],
            args=[job_id, now_ms, lease_ms, token, keys.CALLBACK_HOST_PREFIX, per_host],
        )
        if raw == 0:
            return "put off"
        if not raw:
            return None
        attempt, url, collect, ended = raw
        return Delivery(
            job_id=job_id,
            attempt=int(attempt),
            url=url.decode(),
            collect=collect == b"1",
            ended_at_ms=int(ended),
            token=token,
            leased_at_ms=now_ms,
        )

    async def report(
        self,
        delivery: Delivery,
        outcome: Literal["delivered", "retry", "failed"],
        now_ms: int,
        next_attempt_ms: int = 0,
        status: int | None = None,
        error: str = "",
    ) -> bool:
        """Record how the attempt went; False when this sender no longer held it."""
        done = await self._report(
            keys=[keys.CALLBACKS_DUE, keys.callback_key(delivery.job_id)],
            args=[
                delivery.job_id,
                delivery.token,
                outcome,
                now_ms,
                next_attempt_ms,
                status or "",
                error[:500],
                keys.CALLBACK_HOST_PREFIX,
            ],
        )
        return bool(done)

    async def body(self, delivery: Delivery) -> CallbackBody:
        """The body to POST: the RunResult (collectOutput) or the `result` event, with `jobId`.

        Raises:
            ResultGone: the job's records have expired.
        """
        job_id = delivery.job_id
        result, meta, apart = await self._body_look(
            keys=[keys.status_key(job_id), keys.output_key(job_id), keys.output_stream_key(job_id, "stdout")]
        )
        if result is None:
            raise ResultGone(job_id)
        if not delivery.collect:
            event = decode_stored(ResultEvent, result)
            return CallbackBody(
                self.redis, job_id, whole=_encoder.encode(ResultCallback(job_id=job_id, **_fields(event)))
            )
        if meta is not None and apart:
            return CallbackBody(self.redis, job_id, meta=bytes(meta))
        if meta is not None:
            # A RunResult stored whole (what workers before raw storage wrote).
            run = decode_stored(RunResult, meta)
        else:
            # The job ended before any output was stored (killed in the queue, lost, ...): a
            # lost job's program ran, and what it streamed is in its log (as GET /output has it).
            event = decode_stored(ResultEvent, result)
            meta = _encoder.encode(output_without_run(event))
            return CallbackBody(self.redis, job_id, meta=meta, from_log=event.outcome is Outcome.LOST)
        return CallbackBody(self.redis, job_id, whole=_encoder.encode(RunResultCallback(job_id=job_id, **_fields(run))))


def _fields(struct: msgspec.Struct) -> dict[str, object]:
    return {name: getattr(struct, name) for name in struct.__struct_fields__}
