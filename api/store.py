"""The API's side of Redis: enqueue jobs, read their status, deliver start signals.

Keys come from shared.keys and payloads from shared.codec; multi-key changes are Lua
scripts so a reader never sees half a job.
"""

from __future__ import annotations

import time

import msgspec
from redis.asyncio import Redis

from shared import keys
from shared.codec import decode_stored, encode
from shared.messages import CtrlMessage, JobSpec, JobState, JobStatus, ResultEvent, WorkerInfo

__all__ = ["JobStore", "StoredStatus"]

# KEYS: queue, spec, status. ARGV: max depth, spec json, now ms, ttl s, job id, language, version, owner.
_ENQUEUE = """
if redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[4])
redis.call('HSET', KEYS[3], 'state', 'queued', 'updatedAtMs', ARGV[3], 'attempt', 0, 'nextSeq', 0,
           'language', ARGV[6], 'version', ARGV[7], 'owner', ARGV[8])
redis.call('EXPIRE', KEYS[3], ARGV[4])
redis.call('LPUSH', KEYS[1], ARGV[5])
return 1
"""

_STATUS_FIELDS = ("state", "updatedAtMs", "language", "version", "owner", "result", "started")


class StoredStatus(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    state: JobState
    updated_at_ms: int
    language: str
    version: str
    owner: str
    started: bool
    result: ResultEvent | None

    def view(self) -> JobStatus:
        return JobStatus(
            job_id=self.job_id,
            channel=keys.realtime_channel(self.job_id),
            language=self.language,
            version=self.version,
            state=self.state,
            updated_at_ms=self.updated_at_ms,
            result=self.result,
        )


class JobStore:
    def __init__(self, redis: Redis, record_ttl_s: int, streams: Redis | None = None) -> None:
        self._redis = redis
        self._streams = streams or redis
        self._record_ttl_s = record_ttl_s
        self._enqueue = redis.register_script(_ENQUEUE)

    async def enqueue(self, spec: JobSpec, max_depth: int) -> bool:
        """Store the job and queue it; False (nothing written) when the queue is full."""
        done = await self._enqueue(
            keys=[keys.QUEUE, keys.spec_key(spec.job_id), keys.status_key(spec.job_id)],
            args=[
                max_depth,
                encode(spec),
                spec.created_at_ms,
                self._record_ttl_s,
                spec.job_id,
                spec.language,
                spec.version,
                spec.owner,
            ],
        )
        return bool(done)

    async def status(self, job_id: str) -> StoredStatus | None:
        values = await self._redis.hmget(keys.status_key(job_id), _STATUS_FIELDS)
        state, updated, language, version, owner, result, started = values
        if state is None:
            return None
        return StoredStatus(
            job_id=job_id,
            state=JobState(state.decode()),
            updated_at_ms=int(updated or 0),
            language=(language or b"").decode(),
            version=(version or b"").decode(),
            owner=(owner or b"").decode(),
            started=started == b"1",
            result=decode_stored(ResultEvent, result) if result else None,
        )

    async def send_start(self, job_id: str) -> None:
        """Durable start: the flag first (a worker checks it on claim), then the live message."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.start_flag_key(job_id), b"1", ex=self._record_ttl_s)
            pipe.publish(keys.ctrl_channel(job_id), encode(CtrlMessage(type="start")))
            await pipe.execute()

    async def live_workers(self) -> list[WorkerInfo]:
        """Workers that advertise runtimes and still hold their liveness key."""
        raw = await self._redis.hgetall(keys.WORKERS)
        if not raw:
            return []
        ids = [wid.decode() for wid in raw]
        async with self._redis.pipeline(transaction=False) as pipe:
            for wid in ids:
                pipe.exists(keys.worker_alive_key(wid))
            alive = await pipe.execute()
        return [decode_stored(WorkerInfo, raw[wid.encode()]) for wid, ok in zip(ids, alive, strict=False) if ok]

    async def known_workers(self) -> list[WorkerInfo]:
        raw = await self._redis.hgetall(keys.WORKERS)
        return [decode_stored(WorkerInfo, value) for value in raw.values()]

    async def events(self, job_id: str, after_stream_id: str, block_ms: int | None) -> list[tuple[str, int, str, bytes]]:
        """Entries of the job's durable log after a stream id: (stream id, seq, name, data).

        With `block_ms`, waits up to that long for the first new entry.
        """
        key = keys.events_key(job_id)
        if block_ms is None:
            raw = await self._redis.xrange(key, min=f"({after_stream_id}" if after_stream_id != "0" else "-", count=500)
        else:
            answer = await self._streams.xread({key: after_stream_id}, count=500, block=block_ms)
            raw = answer[0][1] if answer else []
        return [
            (entry_id.decode(), int(fields[b"seq"]), fields[b"name"].decode(), fields[b"data"])
            for entry_id, fields in raw
        ]

    async def output(self, job_id: str) -> bytes | None:
        """The stored RunResult JSON (jobs with collectOutput), or None."""
        raw = await self._redis.get(keys.output_key(job_id))
        return bytes(raw) if raw is not None else None


def now_ms() -> int:
    return time.time_ns() // 1_000_000
