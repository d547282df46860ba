"""The API's side of Redis: enqueue jobs, read their status, deliver start signals.

Keys come from shared.keys and payloads from shared.codec; multi-key changes are Lua
scripts so a reader never sees half a job.
"""

from __future__ import annotations

import base64
import time

import msgspec
from redis.asyncio import Redis

from shared import keys
from shared.codec import decode_stored, encode
from shared.eventlog import entry_json
from shared.messages import (
    TERMINAL_STATES,
    CtrlMessage,
    JobSpec,
    JobState,
    JobStatus,
    Outcome,
    ResultEvent,
    WorkerInfo,
    result_template,
    result_without_run,
)

__all__ = ["JobStore", "KillAnswer", "StdinAnswer", "StoredStatus"]

_TERMINAL_LUA = "local terminal = {done=true, killed=true, error=true, expired=true, lost=true}\n"

# KEYS: queue, spec, status. ARGV: max depth, spec json, now ms, ttl s, job id, language, version, owner.
# KEYS: queue, spec, status, the owner's unstarted set. ARGV: max depth, spec json, now ms,
# ttl s, job id, language, version, owner, max unstarted jobs per owner.
# Returns 1 (queued), 0 (queue full) or -1 (the owner has too many jobs waiting for start).
# A job id is new for every request, so a record that exists already is this script's own
# earlier run whose reply was lost: it must not be queued twice.
_ENQUEUE = (
    _TERMINAL_LUA
    + """
if redis.call('EXISTS', KEYS[3]) == 1 then return 1 end
if redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
local cap = tonumber(ARGV[9])
if redis.call('ZCARD', KEYS[4]) >= cap then
  -- Forget the owner's jobs that started or ended since; only then judge.
  for _, id in ipairs(redis.call('ZRANGE', KEYS[4], 0, -1)) do
    local st = redis.call('HMGET', 'job:' .. id .. ':status', 'state', 'started')
    if (not st[1]) or terminal[st[1]] or st[1] == 'starting' or st[1] == 'running' or st[2] == '1' then
      redis.call('ZREM', KEYS[4], id)
    end
  end
  if redis.call('ZCARD', KEYS[4]) >= cap then return -1 end
end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[4])
redis.call('HSET', KEYS[3], 'state', 'queued', 'updatedAtMs', ARGV[3], 'attempt', 0, 'nextSeq', 0,
           'language', ARGV[6], 'version', ARGV[7], 'owner', ARGV[8])
redis.call('EXPIRE', KEYS[3], ARGV[4])
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[5])
redis.call('EXPIRE', KEYS[4], ARGV[4])
redis.call('LPUSH', KEYS[1], ARGV[5])
return 1
"""
)

# Store one accepted stdin frame (or the EOF frame) and notify the job's worker.
# KEYS: status, stdin stream, rate list. ARGV: now ms, bytes, kind ('data'|'close'),
# max frames per window, window ms, max pending bytes, ttl s, notification JSON before n,
# its JSON between n and the stream id, channel.
# Returns {1, n} or {0, reason, detail}: reason 'ended' (detail: state), 'closed', 'rate'
# (detail: ms until a frame is allowed again), 'cap' (detail: bytes pending).
_STDIN = (
    _TERMINAL_LUA
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if (not state) or terminal[state] then return {0, 'ended', state or ''} end
if redis.call('HGET', KEYS[1], 'stdinClosed') == '1' then return {0, 'closed', ''} end
local now = tonumber(ARGV[1])
local max_frames = tonumber(ARGV[4])
local window = tonumber(ARGV[5])
-- EOF is never rate limited: it comes once and must not be lost behind a burst.
if ARGV[3] ~= 'close' and redis.call('LLEN', KEYS[3]) >= max_frames then
  local oldest = tonumber(redis.call('LINDEX', KEYS[3], max_frames - 1))
  if now - oldest < window then return {0, 'rate', window - (now - oldest)} end
end
local accepted = tonumber(redis.call('HGET', KEYS[1], 'stdinAccepted') or '0')
local written = tonumber(redis.call('HGET', KEYS[1], 'stdinWritten') or '0')
local pending = accepted - written
if pending + #ARGV[2] > tonumber(ARGV[6]) then return {0, 'cap', pending} end
if ARGV[3] ~= 'close' then
  redis.call('LPUSH', KEYS[3], now)
  redis.call('LTRIM', KEYS[3], 0, max_frames - 1)
  redis.call('PEXPIRE', KEYS[3], window)
end
local n = redis.call('HINCRBY', KEYS[1], 'stdinFrames', 1) - 1
redis.call('HINCRBY', KEYS[1], 'stdinAccepted', #ARGV[2])
if ARGV[3] == 'close' then redis.call('HSET', KEYS[1], 'stdinClosed', '1') end
local id = redis.call('XADD', KEYS[2], '*', 'n', n, 'kind', ARGV[3], 'data', ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[7])
redis.call('PUBLISH', ARGV[10], ARGV[8] .. n .. ARGV[9] .. id .. '"}')
return {1, n}
"""
)

# A kill request. A job still in the queue (no worker holds it) ends here and now; any other
# live job gets a durable kill flag (a worker checks it on claim and while it holds the job)
# and a live message on its control channel.
# KEYS: status, queue, events, spec, start flag, stdin stream. ARGV: job id, now ms, ttl s,
# result JSON before seq, result JSON after seq, ctrl channel, ctrl message.
# Returns {0, state} (already ended), {1} (flagged) or {2, seq, result} (ended here).
_KILL = (
    _TERMINAL_LUA
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if (not state) or terminal[state] then return {0, state or ''} end
if state == 'queued' and redis.call('LREM', KEYS[2], 1, ARGV[1]) == 1 then
  local seq = tonumber(redis.call('HGET', KEYS[1], 'nextSeq') or '0')
  local data = ARGV[4] .. seq .. ARGV[5]
  redis.call('XADD', KEYS[3], '*', 'seq', seq, 'name', 'result', 'data', data)
  redis.call('HINCRBY', KEYS[1], 'attempt', 1)
  redis.call('HSET', KEYS[1], 'state', 'killed', 'updatedAtMs', ARGV[2], 'result', data, 'nextSeq', seq + 1)
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('EXPIRE', KEYS[3], ARGV[3])
  redis.call('EXPIRE', KEYS[4], ARGV[3])
  redis.call('EXPIRE', KEYS[6], ARGV[3])
  redis.call('DEL', KEYS[5])
  return {2, seq, data}
end
redis.call('HSET', KEYS[1], 'kill', '1')
redis.call('PUBLISH', ARGV[6], ARGV[7])
return {1}
"""
)

_KILLED_BEFORE_START = result_template(result_without_run(Outcome.KILLED, "killed before it started"))

_STATUS_FIELDS = ("state", "updatedAtMs", "language", "version", "owner", "result", "started", "kill")


class StdinAnswer(msgspec.Struct, frozen=True):
    """What became of one stdin frame: accepted (`frame` set) or refused (`refused` says why)."""

    frame: int | None = None
    refused: str | None = None  # "ended" | "closed" | "rate" | "cap"
    state: str = ""
    retry_after_ms: int = 0
    pending_bytes: int = 0


class KillAnswer(msgspec.Struct, frozen=True):
    ended_state: str | None = None  # set when the job had ended already
    result: bytes | None = None  # set when the kill ended a queued job here


class StoredStatus(msgspec.Struct, frozen=True, kw_only=True):
    job_id: str
    state: JobState
    updated_at_ms: int
    language: str
    version: str
    owner: str
    started: bool
    result: ResultEvent | None
    kill_requested: bool = False

    def view(self) -> JobStatus:
        return JobStatus(
            job_id=self.job_id,
            channel=keys.realtime_channel(self.job_id),
            language=self.language,
            version=self.version,
            state=self.state,
            updated_at_ms=self.updated_at_ms,
            result=self.result,
            kill_requested=self.kill_requested and self.state not in TERMINAL_STATES,
        )


class JobStore:
    def __init__(self, redis: Redis, record_ttl_s: int, streams: Redis | None = None) -> None:
        self._redis = redis
        self._streams = streams or redis
        self._record_ttl_s = record_ttl_s
        self._enqueue = redis.register_script(_ENQUEUE)
        self._stdin = redis.register_script(_STDIN)
        self._kill = redis.register_script(_KILL)

    async def enqueue(self, spec: JobSpec, max_depth: int, max_unstarted: int) -> int:
        """Store the job and queue it: 1; nothing written: 0 when the queue is full, -1 when
        the owner already has `max_unstarted` jobs waiting for start (queued or parked)."""
        done = await self._enqueue(
            keys=[keys.QUEUE, keys.spec_key(spec.job_id), keys.status_key(spec.job_id), keys.unstarted_key(spec.owner)],
            args=[
                max_depth,
                encode(spec),
                spec.created_at_ms,
                self._record_ttl_s,
                spec.job_id,
                spec.language,
                spec.version,
                spec.owner,
                max_unstarted,
            ],
        )
        return int(done)

    async def status(self, job_id: str) -> StoredStatus | None:
        values = await self._redis.hmget(keys.status_key(job_id), _STATUS_FIELDS)
        state, updated, language, version, owner, result, started, kill = values
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
            kill_requested=kill == b"1",
        )

    async def send_start(self, job_id: str) -> None:
        """Durable start: the flag first (a worker checks it on claim), then the live message."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(keys.start_flag_key(job_id), b"1", ex=self._record_ttl_s)
            pipe.publish(keys.ctrl_channel(job_id), encode(CtrlMessage(type="start")))
            await pipe.execute()

    async def stdin(
        self, job_id: str, data: bytes, close: bool, max_frames_per_s: int, max_pending_bytes: int
    ) -> StdinAnswer:
        """Store one stdin frame durably (or the EOF frame) and notify the job's worker."""
        head = b'{"kind":"%s","data":"%s","n":' % (b"close" if close else b"data", base64.b64encode(data))
        answer = await self._stdin(
            keys=[keys.status_key(job_id), keys.stdin_key(job_id), keys.stdin_rate_key(job_id)],
            args=[
                now_ms(),
                data,
                "close" if close else "data",
                max_frames_per_s,
                1000,
                max_pending_bytes,
                self._record_ttl_s,
                head,
                b',"id":"',
                keys.stdin_channel(job_id),
            ],
        )
        if answer[0] == 1:
            return StdinAnswer(frame=int(answer[1]))
        reason = answer[1].decode()
        detail = answer[2]
        if reason == "ended":
            return StdinAnswer(refused=reason, state=detail.decode())
        if reason == "rate":
            return StdinAnswer(refused=reason, retry_after_ms=max(1, int(detail)))
        if reason == "cap":
            return StdinAnswer(refused=reason, pending_bytes=int(detail))
        return StdinAnswer(refused=reason)

    async def kill(self, job_id: str, result_ttl_s: int) -> KillAnswer:
        """Ask for the job to be killed; a job no worker holds yet ends at once."""
        answer = await self._kill(
            keys=[
                keys.status_key(job_id),
                keys.QUEUE,
                keys.events_key(job_id),
                keys.spec_key(job_id),
                keys.start_flag_key(job_id),
                keys.stdin_key(job_id),
            ],
            args=[
                job_id,
                now_ms(),
                result_ttl_s,
                _KILLED_BEFORE_START[0],
                _KILLED_BEFORE_START[1],
                keys.ctrl_channel(job_id),
                encode(CtrlMessage(type="kill")),
            ],
        )
        if answer[0] == 0:
            return KillAnswer(ended_state=answer[1].decode())
        if answer[0] == 2:
            return KillAnswer(result=bytes(answer[2]))
        return KillAnswer()

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
        out = []
        for entry_id, fields in raw:
            seq = int(fields[b"seq"])
            out.append((entry_id.decode(), seq, fields[b"name"].decode(), entry_json(seq, fields)))
        return out

    async def output(self, job_id: str) -> tuple[bytes, bool] | None:
        """The stored result of a collectOutput job, or None: (JSON, raw), where `raw` says
        the output bytes are stored apart (a StoredOutput); otherwise the JSON is a whole
        RunResult (what workers before raw storage wrote)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.get(keys.output_key(job_id))
            pipe.exists(keys.output_stream_key(job_id, "stdout"))
            raw, apart = await pipe.execute()
        return (bytes(raw), bool(apart)) if raw is not None else None

    async def output_slice(self, job_id: str, stream: str, offset: int, size: int) -> bytes:
        """`size` bytes of a stored output stream from `offset` (fewer at its end)."""
        return bytes(await self._redis.getrange(keys.output_stream_key(job_id, stream), offset, offset + size - 1))


def now_ms() -> int:
    return time.time_ns() // 1_000_000
