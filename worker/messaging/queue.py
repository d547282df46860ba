"""The worker's side of Redis: claim, advance, finish, hand back, heartbeat and reap.

A claim moves the job id atomically from `jobs:queue` into this worker's own claimed
list (BLMOVE), so a worker that dies between pop and record leaves the id where a reaper
finds it. Every claim bumps the job's `attempt`; every write a worker makes checks that
number first (fencing), so a worker that lost its lease can no longer touch the job.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Iterable

import msgspec
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from leanredis.scripts import OomTolerantScript
from shared import keys
from shared.blobs import HOLD_LUA
from shared.callbacks import CALLBACK_DUE_LUA
from shared.codec import decode_stored, encode
from shared.eventlog import RESULT_LANDED_LUA, entry_json
from shared.grading import batch_ended_early
from shared.messages import (
    MAX_TESTS,
    CaseFacts,
    JobSpec,
    JobState,
    Outcome,
    StageEvent,
    TestCase,
    TestResultEvent,
    WorkerInfo,
    result_template,
    result_without_run,
)

__all__ = [
    "QUEUED_STAGE", "Advanced", "Claim", "Fenced", "LivePublish", "LogAhead", "StoredFrame", "WorkerQueue",
    "WorkerSuperseded", "Written", "now_ms",
]

log = logging.getLogger(__name__)

_TERMINAL_LUA = "local terminal = {done=true, killed=true, error=true, expired=true, lost=true}\n"


# KEYS: status, spec, claimed, start flag, events, the worker's liveness key, the job's
# callback record, its stdin stream. ARGV: worker id, job id, now ms, the `stage{queued}` event's JSON, the
# record's ttl s, this process's incarnation.
# A job's first claim also logs that event (seq 0), so claiming costs one round trip, not two.
# Run twice (its reply lost with a connection), the second run finds the job parked by this
# worker and answers the same claim without taking another attempt (or logging again).
_CLAIM = """
-- Claim only what is still in our claimed list: a claim whose round trip outlasted two
-- upkeeps has been re-queued as a stray meanwhile, and is another worker's to take.
if not redis.call('LPOS', KEYS[3], ARGV[2]) then return false end
-- Nor once another process holds our id (we froze past the lease and it took over): it
-- owns the claimed list now, and our claim would share its attempt.
local holder = redis.call('GET', KEYS[6])
if holder and holder ~= ARGV[6] then return false end
local state = redis.call('HGET', KEYS[1], 'state')
local spec = redis.call('GET', KEYS[2])
local again = state == 'parked' and redis.call('HGET', KEYS[1], 'worker') == ARGV[1]
if (not again) and ((not state) or (not spec) or state ~= 'queued') then
  redis.call('LREM', KEYS[3], 1, ARGV[2])
  return false
end
local attempt
if again then
  attempt = tonumber(redis.call('HGET', KEYS[1], 'attempt'))
else
  attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
  redis.call('HSET', KEYS[1], 'state', 'parked', 'worker', ARGV[1], 'updatedAtMs', ARGV[3])
  -- The record's life (JOB_RECORD_TTL, checked to outlast a warm-up and the longest run)
  -- counts from here again: time spent in a backed-up queue must not expire it mid-run,
  -- which would leave the job with no result at all.
  for _, key in ipairs({KEYS[1], KEYS[2], KEYS[7], KEYS[8]}) do
    if redis.call('TTL', key) < tonumber(ARGV[5]) then redis.call('EXPIRE', key, ARGV[5]) end
  end
end
local seq = redis.call('HGET', KEYS[1], 'nextSeq') or '0'
local logged = 0
if seq == '0' then
  redis.call('XADD', KEYS[5], '*', 'seq', 0, 'name', 'stage', 'data', ARGV[4])
  redis.call('HSET', KEYS[1], 'nextSeq', 1)
  redis.call('EXPIRE', KEYS[5], ARGV[5])
  seq, logged = '1', 1
end
local start = redis.call('EXISTS', KEYS[4])
local kill = redis.call('HGET', KEYS[1], 'kill') == '1' and 1 or 0
local handovers = redis.call('HGET', KEYS[1], 'handovers') or '0'
local frames = redis.call('HGET', KEYS[1], 'stdinFrames') or '0'
local live = redis.call('HGET', KEYS[1], 'liveSeq') or '0'
return {attempt, seq, spec, start, kill, handovers, logged, frames, live}
"""

# KEYS: the worker's liveness key, the workers hash, its claimed list, its unpublished set.
# ARGV: worker id, this process's incarnation, then the jobs whose owed result went to soketi
# since the last beat.
_UNREGISTER = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[2] then return 0 end  -- another process has our id: all is its
-- Results its lanes delivered since the last beat: not owed (a claim left stuck keeps the set).
if #ARGV > 2 then redis.call('SREM', KEYS[4], unpack(ARGV, 3)) end
redis.call('DEL', KEYS[1])
if redis.call('LLEN', KEYS[3]) == 0 then
  redis.call('HDEL', KEYS[2], ARGV[1])
  -- (Its lanes are closed: what they did not deliver, no reaper would come for.)
  redis.call('DEL', KEYS[4])
end
return 1
"""

# KEYS: a worker's liveness key, its unpublished set. ARGV: '1' when it was judged dead. Its
# jobs whose result is owed live (none of a dead one that holds its lease again).
_OWED_LIVE = """
if ARGV[1] == '1' and redis.call('EXISTS', KEYS[1]) == 1 then return {} end
return redis.call('SMEMBERS', KEYS[2])
"""

# KEYS: the worker's liveness key, workers, its claimed list. ARGV: its id. Forgets a dead
# worker only if it is still dead and holds no claim, in one step: one that came back to life
# meanwhile (a stall past its lease) keeps its entry, so its next claims are still walked.
_FORGET_DEAD = """
if redis.call('EXISTS', KEYS[1]) == 0 and redis.call('LLEN', KEYS[3]) == 0 then
  return redis.call('HDEL', KEYS[2], ARGV[1])
end
return 0
"""

# How many delivered jobs one heartbeat takes off the unpublished set (the rest: the next).
MAX_DELIVERED_PER_BEAT = 1000
# The most bytes of a blob one command asks for (see WorkerQueue.blobs).
BLOB_PIECE_BYTES = 1 << 20

# What a job's first claim logs as seq 0.
QUEUED_STAGE = msgspec.json.encode(StageEvent(phase="queued", seq=0))

# KEYS: status, start flag. ARGV: attempt. The last look of a parked job whose warm-up ran
# out, at both durable signals: 2 if a kill came (it wins, as in every look at the flags), 1
# if its start came after all; else, for our own claim, the record says it is expiring (the
# API's start script then refuses a start as `expired`; a later claim has another attempt,
# which the mark does not hold for, so should this worker die now, _REAP ends the job
# `expired` rather than re-queue it), and 0.
_CLOSE_PARK = """
if redis.call('HGET', KEYS[1], 'kill') == '1' then return 2 end
if redis.call('EXISTS', KEYS[2]) == 1 then return 1 end
if redis.call('HGET', KEYS[1], 'attempt') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'expiringAttempt', ARGV[1])
end
return 0
"""

# KEYS: status, stdin stream. ARGV: attempt, bytes of stdin written to the program so far
# (absolute, so a retried write changes nothing), the stream id of the last frame written.
# Frames before that one are dropped: a started job never runs again, so nothing reads them,
# and a program that reads as fast as a client sends would otherwise let the stream grow by
# its whole input, however long the job runs.
_STDIN_WRITTEN = (
    _TERMINAL_LUA
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] or (not state) or terminal[state] then return 0 end
redis.call('HSET', KEYS[1], 'stdinWritten', ARGV[2])
redis.call('XTRIM', KEYS[2], 'MINID', ARGV[3])
return 1
"""
)

# KEYS: status, events, and (optional) the job's audience mark. ARGV: attempt, ttl s, new
# state or '', now ms, started ('1' or ''), the append's token, soketi's adapter channel (''
# publishes nothing), '1' to publish only when the audience mark is there, a count B, B
# adapter messages of events already logged, then (seq, name, field, value, message)
# quintuples: field 'data' (JSON) or 'chunk' (raw text; see shared/eventlog.py), message the
# event's adapter message or ''. Those messages are PUBLISHed in order after the append,
# stopping at the first that no soketi node heard. Returns 0 when fenced off or already
# finished, {3, next seq} when the log is already past the first seq (nothing done), else
# {heard, published}: heard 2 when the audience mark was asked for and is there, else 1;
# published how many messages went out (for a re-run of an append that had landed, how many
# went out when it did: the record keeps that count with the append's token).
_ADVANCE = (
    _TERMINAL_LUA
    + keys.UNSTARTED_GONE_LUA
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] or (not state) or terminal[state] then return 0 end
local heard = (KEYS[3] and redis.call('EXISTS', KEYS[3]) == 1) and 2 or 1
local first = 10 + tonumber(ARGV[9])
-- Append only if the log's next seq is the one being written. A re-run of this very append
-- (its reply lost with a connection; the same token) finds it there and changes nothing.
-- Any other append whose seqs the log has passed comes from a count that fell behind (an
-- earlier append its caller stopped waiting for did land): it is told where the log is.
local next_seq = tonumber(redis.call('HGET', KEYS[1], 'nextSeq') or '0')
if #ARGV >= first and tonumber(ARGV[first]) < next_seq then
  local last_append = redis.call('HMGET', KEYS[1], 'lastAppend', 'lastPublished')
  if last_append[1] == ARGV[6] then return {heard, tonumber(last_append[2] or '0')} end
  return {3, next_seq}
end
local last = nil
for i = first, #ARGV, 5 do
  redis.call('XADD', KEYS[2], '*', 'seq', ARGV[i], 'name', ARGV[i + 1], ARGV[i + 2], ARGV[i + 3])
  last = tonumber(ARGV[i])
end
if ARGV[3] ~= '' then redis.call('HSET', KEYS[1], 'state', ARGV[3], 'updatedAtMs', ARGV[4]) end
if ARGV[5] == '1' then redis.call('HSET', KEYS[1], 'started', '1') end
if ARGV[5] == '1' or ARGV[3] == 'starting' or ARGV[3] == 'running' then unstarted_gone(KEYS[1]) end
local published = 0
if ARGV[7] ~= '' and (ARGV[8] ~= '1' or heard == 2) then
  local function publish(message)
    if message == '' then return true end
    if redis.call('PUBLISH', ARGV[7], message) == 0 then return false end
    published = published + 1
    return true
  end
  local going = true
  for i = 10, first - 1 do
    going = publish(ARGV[i])
    if not going then break end
  end
  if going then
    for i = first + 4, #ARGV, 5 do
      if not publish(ARGV[i]) then break end
    end
  end
end
if last then
  redis.call('HSET', KEYS[1], 'nextSeq', last + 1, 'lastAppend', ARGV[6], 'lastPublished', published)
  redis.call('EXPIRE', KEYS[2], ARGV[2])
end
return {heard, published}
"""
)

# KEYS: status, events, output, spec, start flag, claimed, stdin, stdout, stderr, the owner's
# retained set and sizes, the job's callback record, the callbacks' due set, done, the audience
# mark, the ended counts, this worker's unpublished set (keys.worker_unpublished_key), then
# the artifacts' hash and each artifact's bytes, when it left any. ARGV: attempt,
# ttl s, state, now ms, result json, seq, stored output json or '', job id, stdout, stderr,
# bytes of output this job keeps, soketi's adapter channel ('' publishes nothing), '1' to
# publish only when the audience mark is there, the result's adapter message. Returns 0 (not
# this worker's, or ended), {2, next seq} when the log holds the seq already, else {written,
# published}: written 3 when the audience mark is there, else 1; published 1 when the result
# was PUBLISHed here and a soketi node heard it (it is then not owed: see below).
_FINISH = (
    _TERMINAL_LUA
    + keys.NOW_MS_LUA
    + CALLBACK_DUE_LUA
    + RESULT_LANDED_LUA
    + keys.UNSTARTED_GONE_LUA
    + keys.OUTCOME_OF_LUA
    + """
local state = redis.call('HGET', KEYS[1], 'state')
local mine = redis.call('HGET', KEYS[1], 'attempt') == ARGV[1]
-- Written: 1, or 3 when someone follows the job (its audience mark), read here so that a
-- client who subscribed a moment ago gets the result live (see JobLane).
local written = redis.call('EXISTS', KEYS[15]) == 1 and 3 or 1
-- A followed job's result is owed live until the worker says it went (its heartbeat): should
-- the worker die first, whoever reaps it publishes it.
local function owed()
  if written == 3 then
    redis.call('SADD', KEYS[17], ARGV[8])
    redis.call('EXPIRE', KEYS[17], ARGV[2])
  end
end
if mine and state and terminal[state] and redis.call('HGET', KEYS[1], 'result') == ARGV[5] then
  -- Our own earlier write, whose reply was lost with the connection.
  redis.call('LREM', KEYS[6], 1, ARGV[8])
  if redis.call('HGET', KEYS[1], 'resultPublished') == '1' then return {written, 1} end
  owed()
  return {written, 0}
end
if (not mine) or (not state) or terminal[state] then
  -- Our claim's entry goes, but never a newer attempt's: a job reaped from this worker while
  -- it stalled may have been claimed again by it since.
  if mine or not state then redis.call('LREM', KEYS[6], 1, ARGV[8]) end
  return 0
end
-- The log is ahead of the worker's count (an append it gave up waiting for did land):
-- nothing is written, and the worker numbers the result again.
local next_seq = tonumber(redis.call('HGET', KEYS[1], 'nextSeq') or '0')
if tonumber(ARGV[6]) < next_seq then return {2, next_seq} end
redis.call('XADD', KEYS[2], '*', 'seq', ARGV[6], 'name', 'result', 'data', ARGV[5])
redis.call('HSET', KEYS[1], 'state', ARGV[3], 'updatedAtMs', ARGV[4], 'result', ARGV[5], 'nextSeq', tonumber(ARGV[6]) + 1,
           'outcome', outcome_of(ARGV[5]))
redis.call('HINCRBY', KEYS[16], ARGV[3], 1)
redis.call('HDEL', KEYS[1], 'worker')
if ARGV[7] ~= '' then
  redis.call('SET', KEYS[8], ARGV[9], 'EX', ARGV[2])
  redis.call('SET', KEYS[9], ARGV[10], 'EX', ARGV[2])
  redis.call('SET', KEYS[3], ARGV[7], 'EX', ARGV[2])
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
-- The spec goes now: nothing reads an ended job's input, which may be megabytes of files
-- (README, "What Redis keeps per job").
redis.call('DEL', KEYS[4])
redis.call('EXPIRE', KEYS[7], ARGV[2])
redis.call('EXPIRE', KEYS[15], ARGV[2])
redis.call('DEL', KEYS[5])
redis.call('LREM', KEYS[6], 1, ARGV[8])
callback_due(KEYS[12], KEYS[13], ARGV[4], ARGV[2], ARGV[8])
result_landed(KEYS[14], ARGV[2], KEYS[2], KEYS[7])
unstarted_gone(KEYS[1])
-- Its artifacts live as long as the result: they were stored (with this TTL) when collected,
-- which may have been minutes before this write when Redis was away in between.
for i = 18, #KEYS do redis.call('EXPIRE', KEYS[i], tonumber(ARGV[2]) + 60) end
-- What this job keeps in Redis until it expires, on its owner's ledger (see api/quota.py).
local kept = tonumber(ARGV[11])
if kept > 0 then
  -- Scored by Redis's clock, which expires the output and by which the API reads the ledger.
  redis.call('ZADD', KEYS[10], now_ms() + 1000 * tonumber(ARGV[2]), ARGV[8])
  redis.call('HSET', KEYS[11], ARGV[8], kept)
  redis.call('HINCRBY', KEYS[11], '_total', kept)
  redis.call('EXPIRE', KEYS[10], ARGV[2])
  redis.call('EXPIRE', KEYS[11], ARGV[2])
end
-- The result goes live from here when the worker asked (its lane idle): at once, and never
-- twice (a re-run finds resultPublished).
if ARGV[12] ~= '' and (ARGV[13] ~= '1' or written == 3) and redis.call('PUBLISH', ARGV[12], ARGV[14]) > 0 then
  redis.call('HSET', KEYS[1], 'resultPublished', '1')
  return {written, 1}
end
owed()
return {written, 0}
"""
)

# KEYS: the worker's liveness key, the workers list, the dataset token, its unpublished set.
# ARGV: lease ms, worker id, its WorkerInfo, a token for a Redis that has none (it lost its
# data), this process's incarnation, then the jobs whose owed result went to soketi since the
# last beat. 0 when another process holds the id (it took it over after our lease lapsed).
_HEARTBEAT = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[5] then return 0 end
if #ARGV > 5 then redis.call('SREM', KEYS[4], unpack(ARGV, 6)) end
redis.call('SET', KEYS[1], ARGV[5], 'PX', ARGV[1])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
redis.call('SET', KEYS[3], ARGV[4], 'NX')
return redis.call('GET', KEYS[3])
"""

# KEYS: status, claimed, queue, spec. ARGV: attempt, job id, now ms, "head" or "back", the seq
# its log was published up to (liveSeq only grows), the record's ttl s. A parked job goes back
# to the queue with its start flag untouched; one marked starting also goes back on its
# owner's count of unstarted jobs (keys.UNSTARTED_BACK_LUA).
_HAND_BACK = (
    _TERMINAL_LUA
    + keys.UNSTARTED_BACK_LUA
    + """
local state = redis.call('HGET', KEYS[1], 'state')
if redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] or (not state) or terminal[state]
   or redis.call('HGET', KEYS[1], 'started') == '1' then
  return 0
end
redis.call('HINCRBY', KEYS[1], 'attempt', 1)
if tonumber(ARGV[5]) > tonumber(redis.call('HGET', KEYS[1], 'liveSeq') or '0') then
  redis.call('HSET', KEYS[1], 'liveSeq', ARGV[5])
end
redis.call('HSET', KEYS[1], 'state', 'queued', 'updatedAtMs', ARGV[3])
redis.call('HDEL', KEYS[1], 'worker')
redis.call('LREM', KEYS[2], 1, ARGV[2])
unstarted_back(KEYS[1], KEYS[4], ARGV[6])
if ARGV[4] == 'back' then
  -- Counted apart from attempts, so MAX_HANDOVERS means hand-overs, not claims.
  redis.call('HINCRBY', KEYS[1], 'handovers', 1)
  redis.call('LPUSH', KEYS[3], ARGV[2])
else
  redis.call('RPUSH', KEYS[3], ARGV[2])
end
return 1
"""
)

# KEYS: status, the claimed list holding it, queue, events, spec, start flag, the job's
# callback record, the callbacks' due set, done, stdin stream, audience mark, ended counts,
# the claiming worker's liveness key. ARGV: job id, now ms, ttl s, result json before seq,
# result json after seq, terminal state, "requeue" or "end", the call's token, '1' when the
# claiming worker was judged dead, the `expired` result's json before and after seq, the
# record's ttl s (for the owner's count of unstarted jobs a re-queued one goes back on). With
# "requeue", a job whose program never started goes back to the queue, unless that claim had
# taken its last look at the start flag (see _CLOSE_PARK): then it ends `expired`, since the
# API refuses its start from then on; otherwise (or once started) it ends with the given result.
# Returns 1 (re-queued), {2, seq, data, state} (ended), 0 (not ours to touch any more), or 3
# (the worker judged dead holds its lease again: a stall it came back from; its claim stays).
_REAP = (
    _TERMINAL_LUA
    + CALLBACK_DUE_LUA
    + RESULT_LANDED_LUA
    + keys.UNSTARTED_GONE_LUA
    + keys.UNSTARTED_BACK_LUA
    + keys.OUTCOME_OF_LUA
    + """
-- This very script run again (its reply lost with a connection, the client sends it once
-- more) answers as it did and does nothing else: the job it re-queued may have been claimed
-- again since, into this same list (a worker's own stray), and started; and the result
-- of one it ended is still published live.
-- Before the look at the worker's lease: one that came back since the first run must not
-- turn its answer into "came back", or the result it ended the job with is never published.
local mine = redis.call('HMGET', KEYS[1], 'reapedBy', 'nextSeq', 'result', 'state')
if mine[1] == ARGV[8] .. '/requeued' then return 1 end
if mine[1] == ARGV[8] and mine[3] then return {2, tonumber(mine[2]) - 1, mine[3], mine[4]} end
if ARGV[9] == '1' and redis.call('EXISTS', KEYS[13]) == 1 then return 3 end
if redis.call('LREM', KEYS[2], 1, ARGV[1]) == 0 then return 0 end
local st = redis.call('HMGET', KEYS[1], 'state', 'started', 'attempt', 'expiringAttempt')
local state = st[1]
if (not state) or terminal[state] then return 0 end
local started = st[2] == '1'
local expiring = ARGV[7] == 'requeue' and (not started) and st[4] and st[4] == st[3]
redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('HDEL', KEYS[1], 'worker')
if ARGV[7] ~= 'requeue' or started or expiring then
  local before, after, ending = ARGV[4], ARGV[5], ARGV[6]
  if expiring then before, after, ending = ARGV[10], ARGV[11], 'expired' end
  local seq = tonumber(redis.call('HGET', KEYS[1], 'nextSeq') or '0')
  local data = before .. seq .. after
  redis.call('XADD', KEYS[4], '*', 'seq', seq, 'name', 'result', 'data', data)
  redis.call('HSET', KEYS[1], 'state', ending, 'updatedAtMs', ARGV[2], 'result', data, 'nextSeq', seq + 1,
             'reapedBy', ARGV[8], 'outcome', outcome_of(data))
  redis.call('HINCRBY', KEYS[12], ending, 1)
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('EXPIRE', KEYS[4], ARGV[3])
  redis.call('DEL', KEYS[5])  -- its spec: an ended job's input is read no more
  redis.call('EXPIRE', KEYS[10], ARGV[3])
  redis.call('EXPIRE', KEYS[11], ARGV[3])
  redis.call('DEL', KEYS[6])
  callback_due(KEYS[7], KEYS[8], ARGV[2], ARGV[3], ARGV[1])
  result_landed(KEYS[9], ARGV[3], KEYS[4], KEYS[10])
  unstarted_gone(KEYS[1])
  return {2, seq, data, ending}
end
redis.call('HSET', KEYS[1], 'state', 'queued', 'updatedAtMs', ARGV[2], 'reapedBy', ARGV[8] .. '/requeued')
unstarted_back(KEYS[1], KEYS[5], ARGV[12])
redis.call('RPUSH', KEYS[3], ARGV[1])
return 1
"""
)

# How many upkeep rounds a recovery whose reply never came is looked up again before it is
# given up (with an error in the log): Redis away for longer than this loses only the live
# copy of its result, which stays in the job's record and log.
MAX_RECOVERY_RETRIES = 100


# The results recovery writes, split around their seq (the script picks it), as a worker's
# own result_without_run would read.
LOST_MESSAGE = "the worker running this job vanished after the program started; it is not re-run"
_LOST = result_template(result_without_run(Outcome.LOST, LOST_MESSAGE))
# As its worker would have ended it (see _CLOSE_PARK): a job that never ran, with no message.
_EXPIRED = result_template(result_without_run(Outcome.EXPIRED, None))
UNREADABLE_MESSAGE = "the stored job could not be read by this worker"
_UNREADABLE = result_template(result_without_run(Outcome.INTERNAL_ERROR, UNREADABLE_MESSAGE))


def _result_at_end(last: list[tuple[bytes, dict[bytes, bytes]]]) -> bytes | None:
    """The `result` event (JSON) of a log's last entry (XREVRANGE ... COUNT 1), or None."""
    if last and last[0][1].get(b"name") == b"result":
        fields = last[0][1]
        return entry_json(int(fields[b"seq"]), fields)
    return None


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class Fenced(Exception):
    """This worker no longer holds the job (its lease was taken over, or the job ended)."""


class LivePublish(msgspec.Struct, frozen=True):
    """What an append also PUBLISHes to soketi's adapter `channel` (Publisher.adapter_message):
    `logged`, messages of events already in the log, then `messages`, one per appended event;
    with `only_if_followed`, only if the job's audience mark is there."""

    channel: str
    only_if_followed: bool
    logged: list[bytes]
    messages: list[bytes]


class Advanced(msgspec.Struct, frozen=True):
    """An append's answer: whether the audience mark was asked for and is there, and how many
    of its LivePublish messages went out (in order: the rest found no soketi node)."""

    heard: bool
    published: int = 0


class LogAhead(Exception):
    """The job's log already holds the seq a result was given: number it `next_seq`."""

    def __init__(self, next_seq: int) -> None:
        super().__init__(f"the log's next seq is {next_seq}")
        self.next_seq = next_seq


class Written(msgspec.Struct, frozen=True):
    """A result the job's record now holds; `heard`: someone followed the job as it landed;
    `published`: the write PUBLISHed it to soketi, which heard it."""

    heard: bool
    published: bool = False


class Claim(msgspec.Struct, frozen=True):
    spec: JobSpec
    attempt: int
    next_seq: int
    start_flag: bool
    claimed_at: float  # loop.time() of the claim
    kill_flag: bool = False
    handovers: int = 0  # times workers lacking its runtime passed it on
    # This claim logged the job's `stage{queued}` (seq 0, QUEUED_STAGE).
    logged_queued: bool = False
    # Stdin frames stored when the claim was made (its flags are read at the same moment).
    stdin_frames: int = 0
    # The log's events before this seq were published by an earlier claim, which handed the
    # job back after it went live (a worker stopped mid-compile): the next publishes only
    # what comes after, neither doubling what a follower saw nor leaving a gap. (A reaped
    # job's dead worker cannot say: its next claim may publish some events twice.)
    live_seq: int = 0


class StoredFrame(msgspec.Struct, frozen=True):
    """One entry of a job's stdin stream."""

    id: str
    n: int
    kind: str  # "data" | "close"
    data: bytes


class _CameBack(Exception):
    """A worker judged dead holds its lease again (a stall it came back from)."""


class WorkerSuperseded(Exception):
    """Another process holds this worker's id: this one froze past its lease and was taken
    over (same WORKER_ID). Everything under the id is the other's now."""


class WorkerQueue:
    def __init__(
        self, redis: Redis, worker_id: str, record_ttl_s: int, result_ttl_s: int, incarnation: str | None = None
    ) -> None:
        self.redis = redis
        self.worker_id = worker_id
        # What this process writes into its liveness key: a second process under the same
        # id (one that took it over once this one's lease lapsed) holds another.
        self.incarnation = incarnation or secrets.token_hex(8)
        self._claimed = keys.worker_claimed_key(worker_id)
        self._unpublished = keys.worker_unpublished_key(worker_id)
        # Jobs whose owed result went to soketi since the last beat (see delivered).
        self._delivered: list[str] = []
        self._record_ttl_s = record_ttl_s
        self._result_ttl_s = result_ttl_s
        # Each of these carries on work already admitted (or only deletes), so each runs even
        # while Redis is at its maxmemory: a full Redis stops new jobs at the API and leaves
        # the queued ones queued (the claim's BLMOVE waits for room), and the running ones end.
        self._claim = OomTolerantScript(redis, _CLAIM)
        self._stdin_written = OomTolerantScript(redis, _STDIN_WRITTEN)
        self._advance = OomTolerantScript(redis, _ADVANCE)
        self._finish = OomTolerantScript(redis, _FINISH)
        self._hand_back = OomTolerantScript(redis, _HAND_BACK)
        self._reap = OomTolerantScript(redis, _REAP)
        self._unregister = OomTolerantScript(redis, _UNREGISTER)
        self._forget_dead = OomTolerantScript(redis, _FORGET_DEAD)
        self._heartbeat = OomTolerantScript(redis, _HEARTBEAT)
        self._owed_live = OomTolerantScript(redis, _OWED_LIVE)
        self._close_park = OomTolerantScript(redis, _CLOSE_PARK)
        self._hold_blobs = OomTolerantScript(redis, HOLD_LUA)
        # Results this queue wrote outside a job's run (recovery, or a claim that ended an
        # unreadable job), for the worker to publish (take_recovered): kept here, not only
        # returned, so a later claim's failure in the same round cannot drop them.
        self._recovered: list[tuple[str, bytes]] = []
        # Recoveries whose call raised on the connection, by job, with their tokens: the
        # script may have run with its reply lost (check_unanswered reads what it did).
        self._unanswered: dict[str, str] = {}
        self._retries: dict[str, int] = {}

    # -- claiming --------------------------------------------------------------------

    async def claim(self, timeout_s: float, now: float) -> Claim | None:
        """Wait up to `timeout_s` for a job and claim it; None on timeout or when it vanished."""
        job_id = await self.take(timeout_s)
        return await self.claim_taken(job_id, now) if job_id is not None else None

    async def take(self, timeout_s: float) -> str | None:
        """Move the next queued id into this worker's claimed list (None on timeout).

        The job is not this worker's yet: `claim_taken` makes it so. Until then an id left
        in the list (a worker that died in between) is re-queued by recovery as a stray.
        """
        job_raw = await self.redis.blmove(keys.QUEUE, self._claimed, timeout_s, "RIGHT", "LEFT")
        return job_raw.decode() if job_raw is not None else None

    async def claim_taken(self, job_id: str, now: float) -> Claim | None:
        """Claim a taken id: its record, spec and durable signals, read in one step."""
        loaded = await self._claim(
            keys=[
                keys.status_key(job_id),
                keys.spec_key(job_id),
                self._claimed,
                keys.start_flag_key(job_id),
                keys.events_key(job_id),
                keys.worker_alive_key(self.worker_id),
                keys.callback_key(job_id),
                keys.stdin_key(job_id),
            ],
            args=[self.worker_id, job_id, now_ms(), QUEUED_STAGE, self._record_ttl_s, self.incarnation],
        )
        if not loaded:
            log.warning("job %s: claimed id had no queued record, or was re-queued meanwhile; dropped", job_id)
            return None
        attempt, seq, spec_raw, start, kill, handovers, logged, frames, live = loaded
        try:
            spec = decode_stored(JobSpec, spec_raw)
        except msgspec.MsgspecError as exc:
            log.error("job %s: stored spec is unreadable (%s); ending it", job_id, exc)
            template = await self._unreadable_template(job_id)
            await self._recover(self._claimed, job_id, "end", template, JobState.ERROR)  # (kept for take_recovered)
            return None
        return Claim(
            spec=spec,
            attempt=int(attempt),
            next_seq=int(seq),
            start_flag=bool(int(start)),
            claimed_at=now,
            kill_flag=bool(int(kill)),
            handovers=int(handovers),
            logged_queued=bool(int(logged)),
            stdin_frames=int(frames),
            live_seq=int(live),
        )

    async def flags(self, job_id: str) -> tuple[bool, bool]:
        """(start flag set, kill requested): the durable signals, for when pub/sub missed one."""
        return (await self.flags_of([job_id]))[0]

    async def close_park(self, job_id: str, attempt: int) -> str:
        """The warm-up of a parked job ran out: "kill" or "start" if either came after all,
        else "expired", and no start is accepted from now on (see _CLOSE_PARK)."""
        signal = await self._close_park(keys=[keys.status_key(job_id), keys.start_flag_key(job_id)], args=[attempt])
        return ("expired", "start", "kill")[int(signal)]

    async def flags_of(self, job_ids: list[str]) -> list[tuple[bool, bool]]:
        """flags() of each of `job_ids`, in one pipelined round trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.exists(keys.start_flag_key(job_id))
                pipe.hget(keys.status_key(job_id), "kill")
            replies = await pipe.execute()
        return [(bool(replies[i]), replies[i + 1] == b"1") for i in range(0, len(replies), 2)]

    # -- stdin -------------------------------------------------------------------------

    async def stdin_frames(self, job_id: str, after_id: str | None, count: int = 64) -> list[StoredFrame]:
        """Stored stdin frames after stream id `after_id` (all from the first when None)."""
        low = "-" if after_id is None else f"({after_id}"
        raw = await self.redis.xrange(keys.stdin_key(job_id), min=low, count=count)
        return [
            StoredFrame(id=entry_id.decode(), n=int(fields[b"n"]), kind=fields[b"kind"].decode(), data=fields[b"data"])
            for entry_id, fields in raw
        ]

    async def stdin_written(self, job_id: str, attempt: int, total_bytes: int, through_id: str) -> None:
        """Record how many accepted stdin bytes reached the program (frees the pending cap),
        the last of them in frame `through_id`; the frames before it are dropped."""
        await self._stdin_written(
            keys=[keys.status_key(job_id), keys.stdin_key(job_id)], args=[attempt, total_bytes, through_id]
        )

    async def event_log(self, job_id: str) -> list[tuple[int, str, bytes]]:
        """Every event in the job's durable log, as (seq, name, data)."""
        raw = await self.redis.xrange(keys.events_key(job_id))
        out = []
        for _, fields in raw:
            seq = int(fields[b"seq"])
            out.append((seq, fields[b"name"].decode(), entry_json(seq, fields)))
        return out

    # -- progress ----------------------------------------------------------------------

    async def advance(
        self,
        job_id: str,
        attempt: int,
        events: list[tuple[int, str, str, bytes]],
        state: JobState | None = None,
        started: bool = False,
        audience: bool = False,
        token: str = "",
        publish: LivePublish | None = None,
    ) -> Advanced:
        """Append events to the durable log and/or move the job's state, fenced by attempt.
        With `audience`, also tell whether the job's audience mark is set (else False).
        `token` names this append, the same on every retry of it (a new one if not given).
        With `publish`, the same script then PUBLISHes their adapter messages (see
        LivePublish): nothing is published unless it is logged, and never twice.

        Raises:
            Fenced: the job is no longer this worker's to write.
            LogAhead: the log is already past the first event's seq (nothing was written).
        """
        token = token or secrets.token_hex(8)
        args: list[object] = [
            attempt, self._record_ttl_s, state.value if state else "", now_ms(), "1" if started else "", token,
        ]  # fmt: skip
        if publish is None:
            args.extend(("", "", 0))
            messages: list[bytes] = [b""] * len(events)
        else:
            args.extend((publish.channel, "1" if publish.only_if_followed else "", len(publish.logged)))
            args.extend(publish.logged)
            messages = publish.messages
        for (seq, name, field, value), message in zip(events, messages, strict=True):
            args.extend((seq, name, field, value, message))
        script_keys = [keys.status_key(job_id), keys.events_key(job_id)]
        if audience or (publish is not None and publish.only_if_followed):
            script_keys.append(keys.audience_key(job_id))
        answer = await self._advance(keys=script_keys, args=args)
        if not answer:
            raise Fenced(job_id)
        if answer[0] == 3:
            raise LogAhead(int(answer[1]))
        return Advanced(heard=answer[0] == 2, published=int(answer[1]))

    async def finish(
        self,
        job_id: str,
        attempt: int,
        state: JobState,
        seq: int,
        result_json: bytes,
        output_json: bytes | None,
        output: tuple[bytes, bytes] = (b"", b""),
        owner: str = "",
        kept_bytes: int = 0,
        publish: LivePublish | None = None,
        artifacts: int = 0,
    ) -> Written | None:
        """Write the terminal state, the result event and the pullable output in one step.
        The job's `artifacts` (stored already) are given the result's lifetime.

        `output_json` is the StoredOutput; `output` the raw stdout and stderr beside it.
        `kept_bytes` (the output in the log and beside the result) goes on `owner`'s ledger
        of retained output until the job's records expire. With `publish` (its one message:
        the result's), the same step PUBLISHes the result to soketi's adapter. None: the job
        is not this worker's any more (or has ended).

        Raises:
            LogAhead: the log already holds `seq` (nothing was written).
        """
        answer = await self._finish(
            keys=[
                keys.status_key(job_id),
                keys.events_key(job_id),
                keys.output_key(job_id),
                keys.spec_key(job_id),
                keys.start_flag_key(job_id),
                self._claimed,
                keys.stdin_key(job_id),
                keys.output_stream_key(job_id, "stdout"),
                keys.output_stream_key(job_id, "stderr"),
                keys.retained_key(owner),
                keys.retained_sizes_key(owner),
                keys.callback_key(job_id),
                keys.CALLBACKS_DUE,
                keys.done_key(job_id),
                keys.audience_key(job_id),
                keys.ENDED_COUNTS,
                self._unpublished,
                *([keys.artifacts_key(job_id)] if artifacts else []),
                *(keys.artifact_data_key(job_id, index) for index in range(artifacts)),
            ],
            args=[
                attempt, self._result_ttl_s, state.value, now_ms(), result_json, seq, output_json or b"", job_id,
                output[0], output[1], kept_bytes if owner else 0,
                *(
                    (publish.channel, "1" if publish.only_if_followed else "", publish.messages[0])
                    if publish is not None
                    else ("", "", "")
                ),
            ],
        )
        if not answer:
            return None
        if answer[0] == 2:
            raise LogAhead(int(answer[1]))
        return Written(heard=answer[0] == 3, published=answer[1] == 1)

    async def stored_result(self, job_id: str) -> tuple[bytes | None, bool]:
        """The result JSON the job's record holds, if it has ended, and whether its write
        published it (see finish)."""
        result, published = await self.redis.hmget(keys.status_key(job_id), ["result", "resultPublished"])
        return result, published == b"1"

    async def hand_back(self, job_id: str, attempt: int, to_back: bool = False, published_to: int = 0) -> bool:
        """Return a job that never started to the queue, its start flag kept: to the head
        (it was next; a stopping worker), or to the back (this worker cannot run it).
        `published_to`: the log's events before this seq went to the job's live lane (see
        Claim.live_seq)."""
        ok = await self._hand_back(
            keys=[keys.status_key(job_id), self._claimed, keys.QUEUE, keys.spec_key(job_id)],
            args=[attempt, job_id, now_ms(), "back" if to_back else "head", published_to, self._record_ttl_s],
        )
        return bool(ok)

    # -- liveness ---------------------------------------------------------------------

    async def take_id(self, lease_ms: int) -> bool:
        """Take this worker's id for a first lease, unless a live worker holds it (one atomic
        SET NX: two workers started together with one WORKER_ID cannot both pass)."""
        alive = keys.worker_alive_key(self.worker_id)
        if await self.redis.set(alive, self.incarnation, px=lease_ms, nx=True):
            return True
        # The client sends a command again when its connection drops before the reply: a
        # SET that landed the first time then finds its own value, which is this worker's.
        return await self.redis.get(alive) == self.incarnation.encode()

    async def heartbeat(self, info: WorkerInfo, lease_ms: int) -> bytes:
        """Renew the lease; returns the dataset token (keys.DATASET), which changes when Redis
        lost its data.

        Raises:
            WorkerSuperseded: another process took the id over while this one's lease lapsed.
        """
        delivered = self._delivered[:MAX_DELIVERED_PER_BEAT]  # (taken off once the beat landed)
        dataset = await self._heartbeat(
            keys=[keys.worker_alive_key(self.worker_id), keys.WORKERS, keys.DATASET, self._unpublished],
            args=[lease_ms, self.worker_id, encode(info), secrets.token_hex(8), self.incarnation, *delivered],
        )
        if dataset == 0:
            raise WorkerSuperseded(f"another process has taken over the worker id {self.worker_id!r}")
        del self._delivered[: len(delivered)]
        return bytes(dataset)

    def delivered(self, job_id: str) -> None:
        """The job's owed result (finish said someone followed it) went to soketi, or was
        given up on by its lane: the next beat takes it off this worker's unpublished set."""
        self._delivered.append(job_id)

    async def last_result(self, job_id: str) -> bytes | None:
        """The job's `result` event as published (JSON), from the end of its log; None when
        the log holds none (it expired)."""
        return _result_at_end(await self.redis.xrevrange(keys.events_key(job_id), "+", "-", count=1))

    async def take_unpublished(self, worker_id: str, dead: bool = True) -> list[tuple[str, bytes]]:
        """The results `worker_id` stored for followers and never said it handed to soketi
        (it died first), as (job id, result event JSON), kept for the caller to publish
        (take_recovered) and then taken off its set. A follower may get one it already had
        (the worker died between its lane and its beat): a client skips it by `seq`. `dead`: nothing is taken from a worker that holds its lease again
        (a stall it came back from: its lanes still hold them)."""
        unpublished = keys.worker_unpublished_key(worker_id)
        ids = await self._owed_live(keys=[keys.worker_alive_key(worker_id), unpublished], args=["1" if dead else "0"])
        if not ids:
            return []
        job_ids = [raw.decode() for raw in ids]
        async with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.xrevrange(keys.events_key(job_id), "+", "-", count=1)
            lasts = await pipe.execute()
        owed: list[tuple[str, bytes]] = []
        for job_id, last in zip(job_ids, lasts, strict=True):
            if (result := _result_at_end(last)) is not None:
                owed.append((job_id, result))
        self._recovered += owed  # (published with the round's recovered results: take_recovered)
        # Only now off the set: a round that fails before this leaves them to the next one (at
        # worst a result published twice, which a client skips by seq; never one lost).
        await self.redis.srem(unpublished, *job_ids)
        return owed

    async def unregister(self) -> None:
        """Drop the liveness key; leave the workers list only with no claim left, so any
        claim still there is reaped by the others (they walk that list)."""
        delivered = self._delivered[:MAX_DELIVERED_PER_BEAT]
        await self._unregister(
            keys=[keys.worker_alive_key(self.worker_id), keys.WORKERS, self._claimed, self._unpublished],
            args=[self.worker_id, self.incarnation, *delivered],
        )
        del self._delivered[: len(delivered)]

    async def _recover(
        self,
        claimed: str,
        job_id: str,
        mode: str,
        template: tuple[bytes, bytes],
        state: JobState,
        dead_worker: str | None = None,
        expired: tuple[bytes, bytes] = _EXPIRED,
    ) -> tuple[str, bytes, str] | None:
        """Run the recovery script on one claim; returns (job id, result json, state) when it
        ended the job, and keeps the first two for take_recovered. `expired` is the result of a
        requeued job whose claim had closed its warm-up. Should the reply be lost,
        check_unanswered later reads whether this run ended the job.

        Raises:
            _CameBack: `dead_worker`, whose claim this is, holds its lease again.
        """
        token = secrets.token_hex(8)
        try:
            outcome = await self._reap(
                keys=[
                    keys.status_key(job_id),
                    claimed,
                    keys.QUEUE,
                    keys.events_key(job_id),
                    keys.spec_key(job_id),
                    keys.start_flag_key(job_id),
                    keys.callback_key(job_id),
                    keys.CALLBACKS_DUE,
                    keys.done_key(job_id),
                    keys.stdin_key(job_id),
                    keys.audience_key(job_id),
                    keys.ENDED_COUNTS,
                    keys.worker_alive_key(dead_worker or self.worker_id),
                ],
                # The token tells a re-sent run of this call (see _REAP) from another recovery.
                args=[
                    job_id, now_ms(), self._result_ttl_s, template[0], template[1], state.value, mode, token,
                    "1" if dead_worker else "0", expired[0], expired[1], self._record_ttl_s,
                ],
            )  # fmt: skip
        except (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError):
            self._unanswered[job_id] = token  # it may have run: see check_unanswered
            raise
        if isinstance(outcome, list):
            self._recovered.append((job_id, bytes(outcome[2])))
            return job_id, bytes(outcome[2]), bytes(outcome[3]).decode()
        if outcome == 3:
            raise _CameBack(dead_worker)
        if outcome == 1:
            log.warning("job %s: its program had not started; re-queued", job_id)
        return None

    async def check_unanswered(self) -> list[tuple[str, bytes]]:
        """For each recovery whose reply was lost: if that very run ended the job (its token
        is the record's `reapedBy`), its result, kept for take_recovered too. Only read, never
        run again: a run that did not happen, or re-queued the job, leaves the claim to the
        next rounds, which judge it afresh (it may have been claimed again meanwhile)."""
        ended = []
        for job_id, token in list(self._unanswered.items()):
            tries = self._retries[job_id] = self._retries.get(job_id, 0) + 1
            if tries > MAX_RECOVERY_RETRIES:
                log.error("job %s: its recovery never answered; its result is not published live", job_id)
                self._forget_recovery(job_id)
                continue
            reaped_by, result = await self.redis.hmget(keys.status_key(job_id), ["reapedBy", "result"])
            self._forget_recovery(job_id)
            if reaped_by is not None and reaped_by.decode() == token and result:
                self._recovered.append((job_id, bytes(result)))
                ended.append((job_id, bytes(result)))
        return ended

    def _forget_recovery(self, job_id: str) -> None:
        self._unanswered.pop(job_id, None)
        self._retries.pop(job_id, None)

    def take_recovered(self) -> list[tuple[str, bytes]]:
        """The results written outside a run since the last call, to publish live."""
        taken = self._recovered[:]
        self._recovered.clear()
        return taken

    def share_recoveries(self, other: WorkerQueue) -> None:
        """Keep the bookkeeping of recoveries in `other`'s (one worker, two connections: the
        claim's, which ends an unreadable job, and the upkeep's), so that the upkeep's
        check_unanswered also looks up a recovery of this one whose reply was lost."""
        self._recovered, self._unanswered, self._retries = other._recovered, other._unanswered, other._retries

    async def listed_workers(self) -> set[str]:
        """The ids in the workers list: every worker that has heartbeaten and not yet left
        or been reaped."""
        return {raw.decode() for raw in await self.redis.hkeys(keys.WORKERS)}

    async def blobs(self, owner: str, digests: list[str]) -> dict[str, bytes]:
        """The bytes of each of `digests` that `owner` keeps (uploaded blobs, `files[].ref`).

        Read BLOB_PIECE_BYTES at a time: this connection is pipelined and shared with every
        job's events and results and with the heartbeat, and one reply of 8 MiB would hold
        them all behind it. (A blob that expires midway reads short; its digest says so.)"""
        if not digests:
            return {}
        # Held first, as long as the job's record (which its claim has just renewed): should
        # the job be handed back, its next claim still finds them.
        sizes = await self._hold_blobs(
            keys=[keys.blob_index_key(owner)], args=[self._record_ttl_s + 60, keys.blob_prefix(owner), *digests]
        )
        found: dict[str, bytes] = {}
        for digest, size in zip(digests, sizes, strict=True):
            if int(size) < 0:
                continue
            key = keys.blob_key(owner, digest)
            pieces = [
                bytes(await self.redis.getrange(key, offset, offset + BLOB_PIECE_BYTES - 1))
                for offset in range(0, int(size), BLOB_PIECE_BYTES)
            ]
            found[digest] = b"".join(pieces)
        return found

    async def worker_timings(self, worker_ids: Iterable[str]) -> dict[str, tuple[int, int] | None]:
        """The (lease ms, heartbeat ms) each of `worker_ids` advertises in the workers list;
        None for one that is not listed, did not say (an older worker) or cannot be read, or
        whose figures make no sense."""
        ids = sorted(set(worker_ids))
        if not ids:
            return {}
        found: dict[str, tuple[int, int] | None] = {}
        for wid, raw in zip(ids, await self.redis.hmget(keys.WORKERS, ids), strict=True):
            try:
                info = decode_stored(WorkerInfo, raw) if raw is not None else None
            except (msgspec.DecodeError, msgspec.ValidationError):
                info = None
            lease_ms, heartbeat_ms = (info.lease_ttl_ms, info.heartbeat_ms) if info is not None else (None, None)
            sane = lease_ms is not None and heartbeat_ms is not None and 0 < heartbeat_ms < lease_ms
            found[wid] = (lease_ms, heartbeat_ms) if sane else None  # type: ignore[assignment]
        return found

    async def unleased(self, worker_ids: Iterable[str]) -> set[str]:
        """Those of `worker_ids` whose lease has lapsed (this worker's own excepted), in one
        round trip. Whether that means dead is the caller's judgement."""
        ids = sorted(set(worker_ids) - {self.worker_id})
        if not ids:
            return set()
        async with self.redis.pipeline(transaction=False) as pipe:
            for wid in ids:
                pipe.exists(keys.worker_alive_key(wid))
            alive = await pipe.execute()
        return {wid for wid, held in zip(ids, alive, strict=True) if not held}

    async def reap_dead_workers(self, worker_ids: Iterable[str]) -> list[tuple[str, bytes]]:
        """Recover the claims of `worker_ids`, listed workers judged dead (see `unleased`),
        and forget them.

        Jobs that never started go back to the queue; jobs whose program had started end as
        `lost`. Returns the `(job id, result json)` of every job it declared lost, and of
        every result such a worker owed its followers live (take_unpublished), so the caller
        can publish those results live.
        """
        lost: list[tuple[str, bytes]] = []
        for wid in sorted(worker_ids):
            lost += await self.recover_claims(wid, dead=True)
            lost += await self.take_unpublished(wid)
            await self._forget_dead(
                keys=[keys.worker_alive_key(wid), keys.WORKERS, keys.worker_claimed_key(wid)], args=[wid]
            )
        return lost

    async def _unreadable_template(self, job_id: str) -> tuple[bytes, bytes]:
        """The result of a job whose spec cannot be read. A test batch's still lists its cases
        (as many as its record says it has, with no names: those are in the spec), each an
        internal error, so a grader finds the same shape as for any batch."""
        count = await self._case_count(job_id)
        if not count:
            return _UNREADABLE
        return result_template(batch_ended_early([TestCase()] * count, Outcome.INTERNAL_ERROR, UNREADABLE_MESSAGE))

    async def _case_count(self, job_id: str) -> int:
        """How many cases the job's record says its batch has (0: not a batch)."""
        count = await self.redis.hget(keys.status_key(job_id), "tests")
        return min(int(count), MAX_TESTS) if count and count.isdigit() else 0

    async def _recovery_templates(self, job_id: str) -> tuple[tuple[bytes, bytes], tuple[bytes, bytes]]:
        """The `lost` result the job would end with, and the `expired` one (see _REAP). A test
        batch's lists every case: for `lost`, those whose test_result its log holds keep their
        verdicts, the rest are skipped (a grader finds its summary as for any batch). A spec
        or log that cannot be read gives the cases the record counts, all skipped: recovery
        must not fail for it."""
        count = await self._case_count(job_id)
        if not count:
            return _LOST, _EXPIRED
        try:
            raw = await self.redis.get(keys.spec_key(job_id))
            spec = decode_stored(JobSpec, raw) if raw is not None else None
            if spec is None or not spec.tests:
                raise ValueError("no spec with its cases")
            tests = spec.tests
            ran: list[CaseFacts | None] = [None] * len(tests)
            for _seq, name, data in await self.event_log(job_id):
                if name == "test_result":
                    event = decode_stored(TestResultEvent, data)
                    if 0 <= event.index < len(ran):
                        ran[event.index] = event
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            log.warning("job %s: its batch could not be read for its lost result (%s)", job_id, exc)
            tests, ran = [TestCase()] * count, []
        return (
            result_template(batch_ended_early(tests, Outcome.LOST, LOST_MESSAGE, ran)),
            result_template(batch_ended_early(tests, Outcome.EXPIRED, None)),
        )

    async def claimed_ids(self, worker_id: str) -> list[str]:
        return [raw.decode() for raw in await self.redis.lrange(keys.worker_claimed_key(worker_id), 0, -1)]

    async def recover_claims(
        self, worker_id: str, only: set[str] | None = None, dead: bool = False
    ) -> list[tuple[str, bytes]]:
        """Recover the claims in `worker_id`'s list (all, or `only` those).

        Used for dead workers (`dead`: each claim is left alone, and the rest with it, once
        the worker holds its lease again: it stalled and came back while it was reaped), for
        this worker's own previous incarnation (same WORKER_ID), and for this worker's own
        strays: ids a failed claim round trip left in its list.
        """
        claimed = keys.worker_claimed_key(worker_id)
        ended: list[tuple[str, bytes]] = []
        for job_id in await self.claimed_ids(worker_id):
            if only is not None and job_id not in only:
                continue
            lost, expired = await self._recovery_templates(job_id)
            try:
                result = await self._recover(
                    claimed, job_id, "requeue", lost, JobState.LOST, worker_id if dead else None, expired
                )
            except _CameBack:
                log.warning("worker %s holds its lease again: the rest of its claims are left to it", worker_id)
                break
            if result is not None:
                job, data, state = result
                if state == JobState.EXPIRED:
                    log.warning("job %s: worker %s lost it as its warm-up ran out; marked expired", job_id, worker_id)
                else:
                    log.warning("job %s: worker %s lost it after the program started; marked lost", job_id, worker_id)
                ended.append((job, data))
        return ended
