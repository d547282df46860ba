"""The API's side of Redis: enqueue jobs, read their status, deliver start signals.

Keys come from shared.keys and payloads from shared.codec; multi-key changes are Lua
scripts so a reader never sees half a job.
"""

from __future__ import annotations

import asyncio
import base64
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import msgspec
from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError, ResponseError

from api.quota import RETAINED_OUTPUT_LUA
from leanredis.scripts import OomRefusedScript, OomTolerantScript
from shared import keys
from shared.callbacks import CALLBACK_DUE_LUA, parse_callback_url
from shared.codec import decode_stored, encode
from shared.eventlog import RESULT_LANDED_LUA, LoggedStreams, entry_json
from shared.messages import (
    TERMINAL_STATES,
    CallbackState,
    CallbackStatus,
    CtrlMessage,
    JobReceipt,
    JobSpec,
    JobState,
    JobStatus,
    Outcome,
    ResultEvent,
    WorkerInfo,
    result_template,
    result_without_run,
)

__all__ = ["EnqueueAnswer", "JobStore", "KillAnswer", "ReceiptCursor", "ScriptCall", "StdinAnswer", "StoredStatus"]

_TERMINAL_LUA = "local terminal = {done=true, killed=true, error=true, expired=true, lost=true}\n"


# KEYS: queue, spec, status, the owner's unstarted set, the owner's job index, the job's
# callback record, the owner's retained-output ledger and its sizes (api/quota.py), the sizes
# of the owner's unstarted specs, and (only with an Idempotency-Key) the key's record. ARGV:
# max depth, spec json, now ms, ttl s, job id, language, version, owner, max unstarted jobs
# per owner, index ttl s, index cutoff ms (older entries are certainly expired), the
# Idempotency-Key, sha256 of the request body, the callback URL ('' for none), '1' when the
# callback carries the output, '1' for a test batch (its stdin is per case: the job's own is
# closed from the start), the most output bytes the owner's finished jobs may keep (0: no
# bound), a test batch's number of cases ('' for none), the spec's bytes, the most bytes the
# owner's unstarted specs may hold (0: no bound), the callback's receiver (`host:port`).
# Returns 1 (queued), 0 (queue full), -1 (the owner has too many jobs waiting for start),
# {4, bytes kept, ms until the first of them expires} (the owner's finished jobs keep too much output),
# {5, bytes held} (the owner's unstarted jobs hold too much input),
# {2, job id} (the key names a live job made from the same body) or {3, job id} (from another).
# A job id is new for every request, so a record that exists already (or a key record naming
# this very id) is this script's own earlier run whose reply was lost: it must not be queued
# twice. A key record whose job has expired is free again.
_ENQUEUE = (
    _TERMINAL_LUA
    + RETAINED_OUTPUT_LUA
    + keys.NOW_MS_LUA
    + """
if KEYS[10] then
  local rec = redis.call('HMGET', KEYS[10], 'jobId', 'bodySha256')
  if rec[1] == ARGV[5] then return 1 end
  if rec[1] and redis.call('EXISTS', 'job:' .. rec[1] .. ':status') == 1 then
    if rec[2] == ARGV[13] then return {2, rec[1]} end
    return {3, rec[1]}
  end
end
if redis.call('EXISTS', KEYS[3]) == 1 then return 1 end
if tonumber(ARGV[17]) > 0 then
  -- By Redis's clock, as the workers score the ledger: the hosts' clocks may disagree.
  local now = now_ms()
  local kept, first = retained_output(KEYS[7], KEYS[8], now)
  if kept >= tonumber(ARGV[17]) then return {4, kept, first == '0' and 0 or math.max(0, tonumber(first) - now)} end
end
if redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
-- The owner's unstarted jobs, by count and by the bytes of their specs (a job alone is
-- always let in, however big: the request's own bound covers it).
local cap, size, max_bytes = tonumber(ARGV[9]), tonumber(ARGV[19]), tonumber(ARGV[20])
local function too_much(held)
  return max_bytes > 0 and held > 0 and held + size > max_bytes
end
local held = tonumber(redis.call('HGET', KEYS[9], '_total') or '0')
local function recount_due()
  -- By Redis's clock: one API process's fast clock would have stamped a count ahead of the
  -- others', which then believed a stale total until they caught up with it. (A stamp
  -- ahead of Redis's clock, an older API's, is taken as due.)
  local counted = tonumber(redis.call('HGET', KEYS[9], '_countedAtMs') or '0')
  local now = now_ms()
  return now - counted >= 1000 or counted > now
end
if (redis.call('ZCARD', KEYS[4]) >= cap or too_much(held)) and recount_due() then
  -- Jobs leave the index as they start or end (unstarted_gone). What that missed (an older
  -- API's jobs, with no sizes kept) is healed here by counting them all again: at most once
  -- a second, or a client held at its cap would have each refusal cost a look at every job.
  held = 0
  local kept = {}
  for _, id in ipairs(redis.call('ZRANGE', KEYS[4], 0, -1)) do
    local st = redis.call('HMGET', 'job:' .. id .. ':status', 'state', 'started')
    if (not st[1]) or terminal[st[1]] or st[1] == 'starting' or st[1] == 'running' or st[2] == '1' then
      redis.call('ZREM', KEYS[4], id)
    else
      local bytes = tonumber(redis.call('HGET', KEYS[9], id) or '0')
      kept[#kept + 1] = {id, bytes}
      held = held + bytes
    end
  end
  redis.call('DEL', KEYS[9])
  -- One HSET a job: unpacking them all at once would pass Lua's stack limit (8000 values)
  -- for a MAX_PARKED_PER_PRINCIPAL in the thousands.
  for _, entry in ipairs(kept) do redis.call('HSET', KEYS[9], entry[1], entry[2]) end
  if #kept > 0 then
    redis.call('HSET', KEYS[9], '_total', held, '_countedAtMs', now_ms())
    redis.call('EXPIRE', KEYS[9], ARGV[4])
  end
end
if redis.call('ZCARD', KEYS[4]) >= cap then return -1 end
if too_much(held) then return {5, held} end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[4])
redis.call('HSET', KEYS[3], 'state', 'queued', 'updatedAtMs', ARGV[3], 'attempt', 0, 'nextSeq', 0,
           'language', ARGV[6], 'version', ARGV[7], 'owner', ARGV[8], 'createdAtMs', ARGV[3])
if KEYS[10] then
  redis.call('HSET', KEYS[3], 'idempotencyKey', ARGV[12])
  redis.call('DEL', KEYS[10])
  redis.call('HSET', KEYS[10], 'jobId', ARGV[5], 'bodySha256', ARGV[13])
  -- As long as the job's record can live (its result's time counts from its end, which may
  -- come late): the key stands for the job while the job has a record, then is free.
  redis.call('EXPIRE', KEYS[10], ARGV[10])
end
if ARGV[14] ~= '' then
  redis.call('HSET', KEYS[3], 'callback', '1')
  redis.call('DEL', KEYS[6])
  redis.call('HSET', KEYS[6], 'url', ARGV[14], 'collect', ARGV[15], 'state', 'pending', 'attempts', 0,
             'createdAtMs', ARGV[3], 'host', ARGV[21])
  redis.call('EXPIRE', KEYS[6], ARGV[4])
end
-- Read by GET /output: a collecting job that ends before a worker stored any output
-- (killed in the queue, lost) still has its verdict to pull, and a wait for the output of
-- a job that does not collect it ends at once.
redis.call('HSET', KEYS[3], 'collect', ARGV[15] == '1' and '1' or '0')
if ARGV[18] ~= '' then
  -- A test batch of this many cases (a kill in the queue then reads the spec for them).
  redis.call('HSET', KEYS[3], 'tests', ARGV[18])
end
if ARGV[16] == '1' then
  -- EOF comes with the job (closeStdin, the default with up-front stdin) or there is no
  -- job stdin at all (a test batch: each case has its own): a later frame could never
  -- reach the program, so it is refused rather than accepted and dropped.
  redis.call('HSET', KEYS[3], 'stdinClosed', '1')
end
redis.call('EXPIRE', KEYS[3], ARGV[4])
redis.call('ZADD', KEYS[4], ARGV[3], ARGV[5])
redis.call('EXPIRE', KEYS[4], ARGV[4])
redis.call('HSET', KEYS[9], ARGV[5], size)
redis.call('HINCRBY', KEYS[9], '_total', size)
redis.call('EXPIRE', KEYS[9], ARGV[4])
redis.call('ZADD', KEYS[5], ARGV[3], ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', '(' .. ARGV[11])
redis.call('EXPIRE', KEYS[5], ARGV[10])
redis.call('LPUSH', KEYS[1], ARGV[5])
return 1
"""
)

# Read only. KEYS: an Idempotency-Key's record. ARGV: sha256 of the request body.
# Returns false (no live job under the key) or {1 (same body) or 0 (another), job id}.
_IDEMPOTENT_LOOKUP = """
local rec = redis.call('HMGET', KEYS[1], 'jobId', 'bodySha256')
if (not rec[1]) or redis.call('EXISTS', 'job:' .. rec[1] .. ':status') == 0 then return false end
return {rec[2] == ARGV[1] and 1 or 0, rec[1]}
"""

# One page of an owner's receipts, newest first. Ids whose status record has expired are
# dropped from the index on the way (a write that is the same however often it runs).
# KEYS: the owner's job index. ARGV: cursor score ('+inf' for the first page), cursor job id
# ('' for none: entries with the cursor's score and an id not below it were on earlier pages),
# most receipts to return, most index entries to look at, wanted states (',done,lost,' form;
# '' for every state).
# Returns {next cursor score or '', next cursor id or '', then 9 strings per job: id, index
# score, state, updatedAtMs, createdAtMs, language, version, outcome, idempotency key}.
_RECEIPTS = keys.OUTCOME_OF_LUA + """
local max, after = ARGV[1], ARGV[2]
local maxn = tonumber(max)
local limit, budget, want = tonumber(ARGV[3]), tonumber(ARGV[4]), ARGV[5]
local out = {'', ''}
local gone = {}
local found, looked, offset = 0, 0, 0
local done = false
while not done do
  local batch = redis.call('ZREVRANGEBYSCORE', KEYS[1], max, '-inf', 'WITHSCORES', 'LIMIT', offset, 100)
  if #batch == 0 then break end
  offset = offset + #batch / 2
  for i = 1, #batch, 2 do
    local id, score = batch[i], batch[i + 1]
    if after == '' or tonumber(score) < maxn or id < after then
      looked = looked + 1
      local status = 'job:' .. id .. ':status'
      local st = redis.call('HMGET', status, 'state', 'updatedAtMs', 'createdAtMs', 'language', 'version',
                            'idempotencyKey', 'outcome')
      if not st[1] then
        gone[#gone + 1] = id
      elseif want == '' or string.find(want, ',' .. st[1] .. ',', 1, true) then
        local outcome = st[7]
        if not outcome then
          -- (a record whose result was written before results kept their outcome beside them)
          local result = redis.call('HGET', status, 'result')
          outcome = result and outcome_of(result) or ''
        end
        local n = #out
        out[n + 1], out[n + 2], out[n + 3], out[n + 4], out[n + 5] = id, score, st[1], st[2] or '', st[3] or ''
        out[n + 6], out[n + 7], out[n + 8], out[n + 9] = st[4] or '', st[5] or '', outcome, st[6] or ''
        found = found + 1
      end
      if found >= limit or looked >= budget then
        -- A cursor only when something follows.
        local more = i + 2 <= #batch
        if not more then
          more = #redis.call('ZREVRANGEBYSCORE', KEYS[1], max, '-inf', 'LIMIT', offset, 1) > 0
        end
        if more then out[1], out[2] = score, id end
        done = true
        break
      end
    end
  end
end
if #gone > 0 then redis.call('ZREM', KEYS[1], unpack(gone)) end
return out
"""

# Store one accepted stdin frame (or the EOF frame) and notify the job's worker.
# KEYS: status, stdin stream, rate list, recent request ids. ARGV: bytes, kind
# ('data'|'close'), max frames per window, window ms, max pending bytes, ttl s, notification
# JSON before n, its JSON between n and the stream id, channel, request id, how many request
# ids to remember, how long (s).
# Returns {1, n} or {0, reason, detail}: reason 'ended' (detail: state), 'closed', 'rate'
# (detail: ms until a frame is allowed again), 'cap' (detail: bytes pending).
# A request id that stored a frame already (this script re-sent after its reply was lost)
# gets that frame's answer again and changes nothing, whatever happened to the job since.
_STDIN = (
    _TERMINAL_LUA
    + keys.NOW_MS_LUA
    + """
local earlier = redis.call('ZSCORE', KEYS[4], ARGV[10])
if earlier then return {1, tonumber(earlier)} end
local state = redis.call('HGET', KEYS[1], 'state')
if (not state) or terminal[state] then return {0, 'ended', state or ''} end
if redis.call('HGET', KEYS[1], 'stdinClosed') == '1' then return {0, 'closed', ''} end
-- An empty frame (the seed SDK's sendStdin(id, "")) is answered as any frame would be, and
-- stores nothing: it would reach the program as nothing.
if ARGV[2] ~= 'close' and #ARGV[1] == 0 then return {1, -1} end
-- Redis's clock, not the API's: the rate list is shared by every API process, whose clocks
-- may disagree.
local now = now_ms()
local max_frames = tonumber(ARGV[3])
local window = tonumber(ARGV[4])
-- EOF is never rate limited: it comes once and must not be lost behind a burst.
if ARGV[2] ~= 'close' and redis.call('LLEN', KEYS[3]) >= max_frames then
  local oldest = tonumber(redis.call('LINDEX', KEYS[3], max_frames - 1))
  if now - oldest < window then return {0, 'rate', window - (now - oldest)} end
end
local accepted = tonumber(redis.call('HGET', KEYS[1], 'stdinAccepted') or '0')
local written = tonumber(redis.call('HGET', KEYS[1], 'stdinWritten') or '0')
local pending = accepted - written
if pending + #ARGV[1] > tonumber(ARGV[5]) then return {0, 'cap', pending} end
if ARGV[2] ~= 'close' then
  redis.call('LPUSH', KEYS[3], now)
  redis.call('LTRIM', KEYS[3], 0, max_frames - 1)
  redis.call('PEXPIRE', KEYS[3], window)
end
local n = redis.call('HINCRBY', KEYS[1], 'stdinFrames', 1) - 1
redis.call('HINCRBY', KEYS[1], 'stdinAccepted', #ARGV[1])
if ARGV[2] == 'close' then redis.call('HSET', KEYS[1], 'stdinClosed', '1') end
local id = redis.call('XADD', KEYS[2], '*', 'n', n, 'kind', ARGV[2], 'data', ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[6])
redis.call('ZADD', KEYS[4], n, ARGV[10])
redis.call('ZREMRANGEBYRANK', KEYS[4], 0, -(tonumber(ARGV[11]) + 1))
redis.call('EXPIRE', KEYS[4], ARGV[12])
redis.call('PUBLISH', ARGV[9], ARGV[7] .. n .. ARGV[8] .. id .. '"}')
return {1, n}
"""
)

# KEYS: the stored output (its result), the stdout and stderr streams, the status. ARGV: how many
# bytes of each stream to bring along (most outputs are small: their bytes come in the same trip
# as the result), 1 to bring the job's state too.
_OUTPUT_LOOK = """
local found = {
  redis.call('GET', KEYS[1]),
  redis.call('EXISTS', KEYS[2]),
  redis.call('GETRANGE', KEYS[2], 0, ARGV[1]),
  redis.call('GETRANGE', KEYS[3], 0, ARGV[1]),
}
if ARGV[2] == '1' then found[5] = redis.call('HGET', KEYS[4], 'state') end
return found
"""

# KEYS: status, start flag. ARGV: the owner the caller must match ('' when a job token
# already names this job), ttl s, ctrl channel, the start message.
# Returns {0} (unknown, or not the caller's), {1} (start stored and published, or already acted
# on), or {2, state, started} (the job has ended: nothing written). Stores the flag first (a
# worker checks it on claim), then publishes the live message; once the job is starting or
# running, its worker has had its start, and a repeat stores and publishes nothing (a flood
# of repeats cost the worker 64 µs each, unbounded).
_START = (
    _TERMINAL_LUA
    + """
local st = redis.call('HMGET', KEYS[1], 'state', 'owner', 'started', 'attempt', 'expiringAttempt')
if (not st[1]) or (ARGV[1] ~= '' and st[2] ~= ARGV[1]) then return {0} end
if terminal[st[1]] then return {2, st[1], st[3] or ''} end
-- Its worker's warm-up ran out and it took its last look at the start flag: it ends the
-- job expired now, so a start from here on is refused as that, not accepted and dropped.
if st[5] and st[5] == st[4] then return {2, 'expired', ''} end
if st[1] == 'starting' or st[1] == 'running' then return {1} end
redis.call('SET', KEYS[2], '1', 'EX', ARGV[2])
redis.call('PUBLISH', ARGV[3], ARGV[4])
return {1}
"""
)

# Puts `debt` ('<job id>:<what>', one per publish: see OwedPublish) on the API's owed
# publishes (keys.API_UNPUBLISHED), due `grace_ms` from now by Redis's clock; with `nx`, not
# if it is there already.
_OWE_PUBLISH_LUA = (
    keys.NOW_MS_LUA
    + """
local function owe_publish(key, debt, grace_ms, nx)
  local due = now_ms() + tonumber(grace_ms)
  if nx then redis.call('ZADD', key, 'NX', due, debt) else redis.call('ZADD', key, due, debt) end
end
"""
)

# KEYS: keys.API_UNPUBLISHED, keys.API_UNPUBLISHED_TAKEN. ARGV: lease ms, most to take.
# Those a sweep took whose lease ran out (it died, or soketi did not take them), leased again,
# at most half of `most` (so that new debts always get in, and retries too); then the owed
# publishes now due, moved to the taken set for the lease (their owner, should it still be
# about to send one, finds it gone and leaves it: OwedPublish.confirm). A due debt of the same
# name as one a sweep holds (a result resent within the gap, '<job id>:gap', owed again while
# the last one is being sent) waits where it is until that one is settled.
_TAKE_OWED = (
    keys.NOW_MS_LUA
    + """
local now = now_ms()
local until_ms = now + tonumber(ARGV[1])
local most = tonumber(ARGV[2])
local taken = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', 0, math.max(1, math.floor(most / 2)))
for _, debt in ipairs(taken) do redis.call('ZADD', KEYS[2], until_ms, debt) end
for _, debt in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, 2 * most)) do
  if #taken >= most then break end
  if not redis.call('ZSCORE', KEYS[2], debt) then
    redis.call('ZREM', KEYS[1], debt)
    redis.call('ZADD', KEYS[2], until_ms, debt)
    taken[#taken + 1] = debt
  end
end
return taken
"""
)

# KEYS: keys.API_UNPUBLISHED. ARGV: the debt, ms. 1 and the debt put off by `ms` if it is
# still owed there (no sweep took it), else 0.
_CONFIRM_OWED = (
    keys.NOW_MS_LUA
    + """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
redis.call('ZADD', KEYS[1], 'XX', now_ms() + tonumber(ARGV[2]), ARGV[1])
return 1
"""
)

# A kill request. A job still in the queue (no worker holds it) ends here and now; any other
# live job gets a durable kill flag (a worker checks it on claim and while it holds the job)
# and a live message on its control channel.
# KEYS: status, queue, events, spec, start flag, stdin stream, the job's callback record, the
# callbacks' due set, done, audience mark, ended counts, keys.API_UNPUBLISHED. ARGV: job id,
# now ms, ttl s, result JSON before seq, result JSON after seq, ctrl channel, ctrl message,
# request id, ms the caller has to publish what it owes.
# Returns {0, state} (already ended), {1} (flagged) or {2, seq, result, unpublished, heard}
# (ended here; `unpublished`: the log's earlier entries nobody published, each its
# field/value pairs then ''; `heard`: 1 when someone was allowed to subscribe, see
# keys.audience_key, and then the publish is owed ('<job id>:kill', see OwedPublish), else
# nothing need be published).
# The status remembers the request that ended the job (`killEndedBy`) and the last few that
# flagged it (`killRequests`), so this script re-sent after its reply was lost gives the same
# answer again and neither writes nor publishes anything twice.
_KILL = (
    _TERMINAL_LUA
    + _OWE_PUBLISH_LUA
    + CALLBACK_DUE_LUA
    + RESULT_LANDED_LUA
    + keys.UNSTARTED_GONE_LUA
    + keys.OUTCOME_OF_LUA
    + """
-- The job's log entries from its `liveSeq` up to seq `upto` (exclusive), as field/value pairs,
-- each entry ended by ''. A claim handed back before it went live logged its stage{queued}
-- and published nothing: those go out before the result. The log holds one entry per seq,
-- so they are its last entries.
local function unpublished(upto)
  local out = {}
  local live = tonumber(redis.call('HGET', KEYS[1], 'liveSeq') or '0')
  local n = tonumber(redis.call('HGET', KEYS[1], 'nextSeq') or '0') - live
  if upto <= live or n <= 0 then return out end
  local tail = redis.call('XREVRANGE', KEYS[3], '+', '-', 'COUNT', n)
  for i = #tail, 1, -1 do
    local fields = tail[i][2]
    local seq = -1
    for j = 1, #fields, 2 do if fields[j] == 'seq' then seq = tonumber(fields[j + 1]) end end
    if seq >= live and seq < upto then
      for j = 1, #fields do out[#out + 1] = fields[j] end
      out[#out + 1] = ''
    end
  end
  return out
end
local state = redis.call('HGET', KEYS[1], 'state')
if state then
  local mine = redis.call('HMGET', KEYS[1], 'killEndedBy', 'killRequests', 'nextSeq', 'result')
  if mine[1] == ARGV[8] then
    return {2, tonumber(mine[3]) - 1, mine[4], unpublished(tonumber(mine[3]) - 1), redis.call('EXISTS', KEYS[10])}
  end
  if string.find(' ' .. (mine[2] or '') .. ' ', ' ' .. ARGV[8] .. ' ', 1, true) then return {1} end
end
if (not state) or terminal[state] then return {0, state or ''} end
if state == 'queued' and redis.call('LREM', KEYS[2], 1, ARGV[1]) == 1 then
  local seq = tonumber(redis.call('HGET', KEYS[1], 'nextSeq') or '0')
  local data = ARGV[4] .. seq .. ARGV[5]
  local earlier = unpublished(seq)
  redis.call('XADD', KEYS[3], '*', 'seq', seq, 'name', 'result', 'data', data)
  redis.call('HINCRBY', KEYS[1], 'attempt', 1)
  redis.call('HSET', KEYS[1], 'state', 'killed', 'updatedAtMs', ARGV[2], 'result', data, 'nextSeq', seq + 1,
             'killEndedBy', ARGV[8], 'outcome', outcome_of(data))
  redis.call('EXPIRE', KEYS[1], ARGV[3])
  redis.call('EXPIRE', KEYS[3], ARGV[3])
  redis.call('DEL', KEYS[4])  -- its spec: an ended job's input is read no more
  redis.call('EXPIRE', KEYS[6], ARGV[3])
  redis.call('EXPIRE', KEYS[10], ARGV[3])
  redis.call('HINCRBY', KEYS[11], 'killed', 1)
  redis.call('DEL', KEYS[5])
  callback_due(KEYS[7], KEYS[8], ARGV[2], ARGV[3], ARGV[1])
  result_landed(KEYS[9], ARGV[3], KEYS[3], KEYS[6])
  unstarted_gone(KEYS[1])
  local heard = redis.call('EXISTS', KEYS[10])
  if heard == 1 then owe_publish(KEYS[12], ARGV[1] .. ':kill', ARGV[9], false) end
  return {2, seq, data, earlier, heard}
end
-- Its worker's warm-up ran out and it took its last look at the flags: it ends the job
-- expired now (as the start script says), so a kill is answered as that, not accepted and
-- then never shown in a `killed` result.
local marks = redis.call('HMGET', KEYS[1], 'attempt', 'expiringAttempt')
if marks[2] and marks[2] == marks[1] then return {0, 'expired'} end
local recent = {ARGV[8]}
for rid in string.gmatch(redis.call('HGET', KEYS[1], 'killRequests') or '', '%S+') do
  if #recent < 8 then recent[#recent + 1] = rid end
end
redis.call('HSET', KEYS[1], 'kill', '1', 'killRequests', table.concat(recent, ' '))
redis.call('PUBLISH', ARGV[6], ARGV[7])
return {1}
"""
)

# KEYS: status, audience mark. ARGV: record ttl s (for a record without a TTL of its own).
_MARK_AUDIENCE = _TERMINAL_LUA + """
if terminal[redis.call('HGET', KEYS[1], 'state') or ''] then
  -- It ended since the caller looked (its result written with nobody marked, so published to
  -- nobody): no note that this subscription heard it live, so its webhook brings the result.
  redis.call('DEL', KEYS[3])
  return 0
end
local ttl = redis.call('TTL', KEYS[1])
if ttl <= 0 then ttl = tonumber(ARGV[1]) end
redis.call('SET', KEYS[2], '1', 'EX', ttl)
redis.call('SET', KEYS[3], '1', 'EX', ARGV[2])
return 1
"""

# A subscription soketi's webhook reports (signed outside the API, or by another API process).
# KEYS: status, audience mark, late-replay claim (keys.late_replay_key), events, signature,
# keys.API_UNPUBLISHED. ARGV: record ttl s (for a record without a TTL of its own), how many
# of the log's first entries to bring and how many bytes of them at most, this request's
# claim token ('api:…'), 'unmarked' to do nothing for a job already marked (the sweep's
# subscriptions, api/sweeper.py), the job id, ms until its publish is owed, the least ms
# between two results sent again (KEYS[7], keys.resent_key, marks the last). Whatever it
# returns to publish is owed ('<job id>:<token>') until the caller settles it (OwedPublish).
# Returns 0 (no such job), 1 (marked), or the log's entries to publish now, each its field/value
# pairs then '' (its first entries from `liveSeq` on, within both bounds, and its last, the
# result): the job ended before it was marked, so nobody published its events live, and this
# caller took the claim. Sent again with the same token (its reply lost), it answers the same.
# A job that ended once it was followed, or whose late replay went already, answers its last
# entry alone (the result): a new first subscriber of an ended job's channel (a page
# reloaded, a client that reconnected) learns how it ended, as nothing else would tell it;
# unless the API signed this subscription while the job ran (KEYS[5], consumed here: the
# webhook came late, and its subscriber heard the result live).
_MARK_SUBSCRIBED = (
    _TERMINAL_LUA
    + _OWE_PUBLISH_LUA
    + """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if redis.call('GET', KEYS[3]) ~= ARGV[4] then
  local ttl = redis.call('TTL', KEYS[1])
  if ttl <= 0 then ttl = tonumber(ARGV[1]) end
  local had = redis.call('EXISTS', KEYS[2])
  if had == 1 and ARGV[5] == 'unmarked' then return 1 end
  local signed = redis.call('DEL', KEYS[5]) == 1
  redis.call('SET', KEYS[2], '1', 'EX', ttl)
  if not terminal[redis.call('HGET', KEYS[1], 'state') or ''] then return 1 end
  if had == 1 or not redis.call('SET', KEYS[3], ARGV[4], 'NX', 'EX', ttl) then
    if signed then return 1 end
    local last = redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1)[1]
    if not last then return 1 end
    -- At most one such result a gap: a client subscribing and unsubscribing in a loop is a new
    -- first subscriber each time. One within it is owed (one such at a time), and a sweep
    -- sends it once the gap is over (api/sweeper.py).
    if not redis.call('SET', KEYS[7], '1', 'PX', ARGV[8], 'NX') then
      owe_publish(KEYS[6], ARGV[6] .. ':gap', math.max(0, redis.call('PTTL', KEYS[7])), true)
      return 1
    end
    local out = {}
    for j = 1, #last[2] do out[#out + 1] = last[2][j] end
    out[#out + 1] = ''
    owe_publish(KEYS[6], ARGV[6] .. ':' .. ARGV[4], ARGV[7], false)
    return out
  end
end
local live = tonumber(redis.call('HGET', KEYS[1], 'liveSeq') or '0')
local room = tonumber(ARGV[3])
local out = {}
local function seq_of(fields)
  for j = 1, #fields, 2 do if fields[j] == 'seq' then return tonumber(fields[j + 1]) end end
  return -1
end
local last = -1
-- Adds the entry; false once it would pass the bytes left (then nothing more but the result).
local function add(entry, always)
  local seq, size = seq_of(entry[2]), 0
  if seq < live or seq <= last then return true end
  for j = 2, #entry[2], 2 do size = size + #entry[2][j] end
  if size > room and not always then return false end
  for j = 1, #entry[2] do out[#out + 1] = entry[2][j] end
  out[#out + 1] = ''
  last, room = seq, room - size
  return true
end
for _, entry in ipairs(redis.call('XRANGE', KEYS[4], '-', '+', 'COUNT', ARGV[2])) do
  if not add(entry, false) then break end
end
local tail = redis.call('XREVRANGE', KEYS[4], '+', '-', 'COUNT', 1)[1]
if tail then add(tail, true) end
if #out > 0 then owe_publish(KEYS[6], ARGV[6] .. ':' .. ARGV[4], ARGV[7], false) end
return out
"""
)

# KEYS: the job's log. ARGV: a seq. The id of the log's last entry whose seq is at most that
# one ('0' when there is none). Ids grow with seq, so a binary search over the ids' times
# finds it in a few dozen one-entry looks, however long the log: a resume near the end of a
# long log no longer reads (and ships) every entry before it. Each look is one entry (a few
# KiB at most), and a few dozen looks cover any log.
_SEEK = """
local target = tonumber(ARGV[1])
local function seq_of(entry)
  local f = entry[2]
  for i = 1, #f, 2 do if f[i] == 'seq' then return tonumber(f[i + 1]) end end
  return -1
end
local function ms_of(id) return tonumber(string.match(id, '^(%d+)-')) end
local first = redis.call('XRANGE', KEYS[1], '-', '+', 'COUNT', 1)[1]
if not first or seq_of(first) > target then return '0' end
-- One binary search over a part of the entry ids (`part` of an id), from `lo` (at most the
-- target) to `bound` (from which on no entry is): `at(x)` is the first entry whose part is
-- x or more, within the range searched.
local function search(lo, bound, part, at)
  while part(lo) + 1 < bound do
    local mid = math.floor((part(lo) + bound) / 2)
    local e = at(mid)
    if e and part(e[1]) < bound and seq_of(e) <= target then lo = e[1] else bound = mid end
  end
  return lo
end
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
local lo = search(first[1], ms_of(last[1]) + 1, ms_of, function(mid)
  return redis.call('XRANGE', KEYS[1], string.format('%.0f', mid), '+', 'COUNT', 1)[1]
end)
-- Then over the id's second part, within lo's millisecond (one append writes a whole batch
-- of entries in one millisecond).
local ms = string.match(lo, '^(%d+)-')
local top = ms .. '-18446744073709551615'
local function n_of(id) return tonumber(string.match(id, '-(%d+)$')) end
last = redis.call('XREVRANGE', KEYS[1], top, ms .. '-0', 'COUNT', 1)[1]
lo = search(lo, n_of(last[1]) + 1, n_of, function(mid)
  return redis.call('XRANGE', KEYS[1], ms .. '-' .. string.format('%.0f', mid), top, 'COUNT', 1)[1]
end)
return lo
"""

_KILLED_BEFORE_START = result_template(result_without_run(Outcome.KILLED, "killed before it started"))

_CALLBACK_FIELDS = (
    "state", "attempts", "lastStatus", "lastError", "lastAttemptAtMs", "nextAttemptAtMs", "deliveredAtMs", "endedAtMs",
)  # fmt: skip
_STATUS_FIELDS = (
    "state", "updatedAtMs", "language", "version", "owner", "result", "started", "kill", "callback", "collect",
    "tests",
)  # fmt: skip


# Stored outputs up to this size (each stream) are read with the result and answered whole.
SMALL_OUTPUT_BYTES = 64 * 1024
# Log entries an event stream reads at once (see JobStore.events).
EVENTS_PER_READ = 64


class StoredOutputFound(NamedTuple):
    """A collectOutput job's stored result: JSON, and whether the output bytes are stored
    apart (a StoredOutput; otherwise the JSON is a whole RunResult, what workers before raw
    storage wrote). `streams` holds both output streams whole when they are small."""

    meta: bytes
    apart: bool
    streams: tuple[bytes, bytes] | None


class StartAnswer(NamedTuple):
    """`started` (stored and published), `unknown` (no such job for this caller) or `ended`
    (with its state, and whether its program had started)."""

    outcome: Literal["started", "unknown", "ended"]
    state: JobState | None = None
    started: bool = False


class OutputSnapshot(NamedTuple):
    output: StoredOutputFound | None
    ended: bool


class StdinAnswer(msgspec.Struct, frozen=True):
    """What became of one stdin frame: accepted (`frame` set) or refused (`refused` says why)."""

    frame: int | None = None
    refused: str | None = None  # "ended" | "closed" | "rate" | "cap"
    state: str = ""
    retry_after_ms: int = 0
    pending_bytes: int = 0


class EnqueueAnswer(msgspec.Struct, frozen=True):
    """What became of an execute: `queued` (this job), `full` / `unstarted` / `input` /
    `retained` (nothing written: the queue, the owner's jobs waiting for start, the input
    they hold, or the output the owner's finished jobs keep, are at their cap), `existing` (the
    Idempotency-Key names a live job made from the same body: `job_id`) or `conflict` (made
    from another body: `job_id`)."""

    outcome: Literal["queued", "full", "unstarted", "input", "retained", "existing", "conflict"]
    job_id: str
    kept_bytes: int = 0
    frees_in_ms: int = 0


class ScriptCall(NamedTuple):
    """One run of a registered Lua script: running it again with the same keys and args is
    what redis-py does when a reply is lost with its connection (tests do it on purpose)."""

    script: AsyncScript | OomTolerantScript
    keys: list[str]
    args: list[Any]


class ReceiptCursor(NamedTuple):
    """Where a page of receipts ended: the last entry's creation ms (its index score) and id."""

    created_at_ms: int
    job_id: str


# How long, and how many, stdin request ids a job remembers: a re-sent script comes within
# seconds (7 tries of a 5 s socket timeout at most), so two minutes of frames at the
# rate cap is plenty.
STDIN_REQUESTS_KEPT_S = 120
# Index entries one receipts script looks at, and scripts one page may take.
_RECEIPT_BUDGET = 1000
_RECEIPT_ROUNDS = 5
_OUTCOME = re.compile(rb'"outcome":"([A-Za-z0-9_]+)"')
_RECEIPT_FIELDS = ("state", "updatedAtMs", "createdAtMs", "language", "version", "idempotencyKey", "owner", "result")


def _receipt(
    job_id: str, state: str, updated: str, created: str, language: str, version: str, outcome: str, key: str
) -> JobReceipt:
    job_state = JobState(state)
    ended = job_state in TERMINAL_STATES
    return JobReceipt(
        job_id=job_id,
        language=language,
        version=version,
        state=job_state,
        outcome=outcome or None,
        created_at_ms=int(float(created or 0)),
        updated_at_ms=int(updated or 0),
        ended_at_ms=int(updated or 0) if ended else None,
        idempotency_key=key or None,
        outcome_confirmed=(bool(outcome) and outcome != Outcome.LOST.value) if ended else None,
    )


class KillAnswer(msgspec.Struct, frozen=True):
    ended_state: str | None = None  # set when the job had ended already
    result: bytes | None = None  # set when the kill ended a queued job here
    # With `result`: the job's logged events nobody published yet, (name, JSON) in seq order.
    unpublished: list[tuple[str, bytes]] = []
    # With `result`: someone may follow the job (else nothing of it need be published).
    heard: bool = False


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
    # The job was submitted with a callbackUrl (its delivery state is read apart).
    has_callback: bool = False
    # A test batch of this many cases (0: not a batch, or enqueued before this was recorded).
    test_cases: int = 0
    # The job was submitted with collectOutput (None: enqueued before this was recorded).
    collects_output: bool | None = None

    def view(self, callback: CallbackStatus | None = None) -> JobStatus:
        return JobStatus(
            job_id=self.job_id,
            channel=keys.realtime_channel(self.job_id),
            language=self.language,
            version=self.version,
            state=self.state,
            updated_at_ms=self.updated_at_ms,
            result=self.result,
            kill_requested=self.kill_requested and self.state not in TERMINAL_STATES,
            callback=callback,
        )


# How many recent marks, and for how long, spare a webhook its script (longer than soketi takes
# to send the webhook of the subscription this process signed). Only while the signature is
# still in Redis: another API process that signs a reloaded page's subscription after the job
# ended deletes it (forget_mark), and that webhook must reach the script.
RECENT_MARKS = 4096
RECENT_MARK_S = 2.0
# How long the API's signature of a subscription vouches, to soketi's webhook for it, that
# its subscriber hears the job live (keys.signed_key): far longer than a subscription takes.
SIGNED_MARK_S = 60.0
# How many of a job's first log entries a late subscriber's replay brings, and how many bytes
# of them (soketi keeps 1 MiB for a subscriber; the lane keeps as much unheard), then its
# result: a client sees the gap in `seq` and reads the rest from the log.
LATE_REPLAY_ENTRIES = 256
LATE_REPLAY_BYTES = 256 * 1024
# The least time between two results sent again to new first subscribers of an ended job's
# channel (a page reloaded): one sooner goes when it is over, through a sweep.
RESEND_GAP_MS = 500
# How long an API process has to publish what it owes (a queued job's kill, a late replay)
# before a sweep of another process publishes the result instead, in soketi's timeouts
# (PUSHER_TIMEOUT_MS), besides one for each request the publish takes.
OWED_PUBLISH_TIMEOUTS = 5


@dataclass(frozen=True)
class OwedPublish:
    """Events a request of this process is to publish itself, owed in Redis until they went
    (keys.API_UNPUBLISHED, as `debt`: '<job id>:kill' or '<job id>:<the script's token>', one
    per publish, so that settling one never settles another). Nothing is owed when `debt` is
    ''. `confirm` just before sending (False: a sweep took it and sends the result itself),
    `settle` once soketi took the last event."""

    store: JobStore
    events: list[tuple[str, bytes]]
    debt: str

    async def confirm(self, posts: int) -> bool:
        return not self.debt or await self.store.confirm_owed(self.debt, posts)

    async def settle(self) -> None:
        if self.debt:
            await self.store.settle_owed(self.debt)


class JobStore:
    def __init__(
        self,
        redis: Redis,
        record_ttl_s: int,
        streams: Redis | None = None,
        waits: Redis | None = None,
        publish_timeout_ms: int = 2000,
    ) -> None:
        self._redis = redis
        self._streams = streams or redis
        self._waits = waits or self._streams
        self._record_ttl_s = record_ttl_s
        # soketi's timeout (PUSHER_TIMEOUT_MS): how long a publish this process owes
        # (keys.API_UNPUBLISHED) stays its own, to finish or give up on, before another
        # process's sweep takes it, is counted in it (OWED_PUBLISH_TIMEOUTS).
        self._publish_timeout_ms = publish_timeout_ms
        self._owed_publish_ms = OWED_PUBLISH_TIMEOUTS * publish_timeout_ms
        # New input: refused at Redis's maxmemory (a 503), even when the script would delete
        # something (an expired ledger entry) before it writes.
        self._enqueue = OomRefusedScript(redis, _ENQUEUE)
        self._stdin = OomRefusedScript(redis, _STDIN)
        # A start, a kill and an audience mark act on a job already admitted: they run even
        # while Redis is at its maxmemory, where an execute or stdin is refused (a 503).
        self._kill = OomTolerantScript(redis, _KILL)
        self._mark_audience = OomTolerantScript(redis, _MARK_AUDIENCE)
        self._mark_subscribed = OomTolerantScript(redis, _MARK_SUBSCRIBED)
        self._start = OomTolerantScript(redis, _START)
        self._take_owed = OomTolerantScript(redis, _TAKE_OWED)
        self._confirm_owed = OomTolerantScript(redis, _CONFIRM_OWED)
        self._idempotent_lookup = redis.register_script(_IDEMPOTENT_LOOKUP)
        self._receipts = redis.register_script(_RECEIPTS)
        self._seek = redis.register_script(_SEEK)
        self._output_look = redis.register_script(_OUTPUT_LOOK)
        # Jobs whose audience this process marked lately (see mark_subscribed).
        self._recent_marks: OrderedDict[str, float] = OrderedDict()

    @staticmethod
    async def run(call: ScriptCall) -> Any:
        return await call.script(keys=call.keys, args=call.args)

    def enqueue_call(
        self,
        spec: JobSpec,
        max_depth: int,
        max_unstarted: int,
        result_ttl_s: int,
        idempotency_key: str | None = None,
        body_sha256: str = "",
        max_retained_bytes: int = 0,
        max_unstarted_bytes: int = 0,
    ) -> ScriptCall:
        # The owner's index outlives every job in it: a job's record lasts at most the record
        # TTL, then the result TTL once it ends.
        index_ttl_s = self._record_ttl_s + result_ttl_s
        stored = encode(spec)
        script_keys = [
            keys.QUEUE,
            keys.spec_key(spec.job_id),
            keys.status_key(spec.job_id),
            keys.unstarted_key(spec.owner),
            keys.owner_jobs_key(spec.owner),
            keys.callback_key(spec.job_id),
            keys.retained_key(spec.owner),
            keys.retained_sizes_key(spec.owner),
            keys.unstarted_sizes_key(spec.owner),
        ]
        if idempotency_key is not None:
            script_keys.append(keys.idempotency_key(spec.owner, idempotency_key))
        args = [
            max_depth,
            stored,
            spec.created_at_ms,
            self._record_ttl_s,
            spec.job_id,
            spec.language,
            spec.version,
            spec.owner,
            max_unstarted,
            index_ttl_s,
            spec.created_at_ms - index_ttl_s * 1000,
            idempotency_key or "",
            body_sha256,
            spec.callback_url or "",
            "1" if spec.collect_output else "",
            "1" if spec.tests or spec.close_stdin else "",
            max_retained_bytes,
            str(len(spec.tests)) if spec.tests else "",
            len(stored),
            max_unstarted_bytes,
            parse_callback_url(spec.callback_url, allow_http=True).host_key if spec.callback_url else "",
        ]
        return ScriptCall(self._enqueue, script_keys, args)

    async def enqueue(
        self,
        spec: JobSpec,
        max_depth: int,
        max_unstarted: int,
        result_ttl_s: int,
        idempotency_key: str | None = None,
        body_sha256: str = "",
        max_retained_bytes: int = 0,
        max_unstarted_bytes: int = 0,
    ) -> EnqueueAnswer:
        """Store the job, index it under its owner and queue it, in one script.

        With an Idempotency-Key, a live job the key made already is answered instead
        (`existing` for the same body, `conflict` for another), and nothing is written. With
        `max_retained_bytes`, an owner whose finished jobs keep that much output is refused
        (`retained`, with what it keeps and when the first of it expires). With
        `max_unstarted_bytes`, an owner whose jobs not yet started would hold more stored
        spec bytes than that with this one is refused (`input`, with what they hold), unless
        it has none: a job alone is always let in.
        """
        call = self.enqueue_call(
            spec,
            max_depth,
            max_unstarted,
            result_ttl_s,
            idempotency_key,
            body_sha256,
            max_retained_bytes,
            max_unstarted_bytes,
        )
        answer = await self.run(call)
        if isinstance(answer, list):
            if answer[0] == 5:
                return EnqueueAnswer("input", spec.job_id, kept_bytes=int(answer[1]))
            if answer[0] == 4:
                return EnqueueAnswer("retained", spec.job_id, kept_bytes=int(answer[1]), frees_in_ms=int(answer[2]))
            return EnqueueAnswer("existing" if answer[0] == 2 else "conflict", answer[1].decode())
        code = int(answer)
        return EnqueueAnswer("queued" if code == 1 else "full" if code == 0 else "unstarted", spec.job_id)

    async def idempotent_job(self, owner: str, idempotency_key: str, body_sha256: str) -> EnqueueAnswer | None:
        """The live job an Idempotency-Key of this owner made (`existing` when from the same
        body, `conflict` when from another), or None. A read; the enqueue script decides."""
        found = await self._idempotent_lookup(keys=[keys.idempotency_key(owner, idempotency_key)], args=[body_sha256])
        if not found:
            return None
        return EnqueueAnswer("existing" if found[0] == 1 else "conflict", found[1].decode())

    async def receipts(
        self, owner: str, cursor: ReceiptCursor | None, limit: int, states: frozenset[str] | None
    ) -> tuple[list[JobReceipt], ReceiptCursor | None]:
        """Up to `limit` of the owner's jobs after `cursor`, newest first, and the next cursor
        (None when nothing follows). Index entries of expired jobs are dropped on the way."""
        want = "," + ",".join(sorted(states)) + "," if states else ""
        found: list[JobReceipt] = []
        for _ in range(_RECEIPT_ROUNDS):
            raw = await self._receipts(
                keys=[keys.owner_jobs_key(owner)],
                args=[
                    str(cursor.created_at_ms) if cursor else "+inf",
                    cursor.job_id if cursor else "",
                    limit - len(found),
                    _RECEIPT_BUDGET,
                    want,
                ],
            )
            text = [item.decode() for item in raw]
            for i in range(2, len(text), 9):
                job_id, score, state, updated, created, language, version, outcome, key = text[i : i + 9]
                found.append(_receipt(job_id, state, updated, created or score, language, version, outcome, key))
            cursor = ReceiptCursor(int(float(text[0])), text[1]) if text[0] else None
            if cursor is None or len(found) >= limit:
                break
        return found, cursor

    async def receipt(self, job_id: str) -> JobReceipt | None:
        """One job's receipt (for a job-token holder), or None once its record has expired."""
        values = await self._redis.hmget(keys.status_key(job_id), _RECEIPT_FIELDS)
        state, updated, created, language, version, key, owner, result = values
        if state is None:
            return None
        if created is None:  # a job queued before receipts existed
            created = await self._redis.zscore(keys.owner_jobs_key((owner or b"").decode()), job_id) or updated or b"0"
        outcome = _OUTCOME.search(result) if result else None
        return _receipt(
            job_id,
            state.decode(),
            (updated or b"0").decode(),
            created.decode() if isinstance(created, bytes) else str(created),
            (language or b"").decode(),
            (version or b"").decode(),
            outcome.group(1).decode() if outcome else "",
            (key or b"").decode(),
        )

    async def status(self, job_id: str) -> StoredStatus | None:
        values = await self._redis.hmget(keys.status_key(job_id), _STATUS_FIELDS)
        state, updated, language, version, owner, result, started, kill, callback, collect, tests = values
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
            has_callback=callback == b"1",
            collects_output=None if collect is None else collect == b"1",
            test_cases=int(tests or 0),
        )

    async def artifact(self, job_id: str, index: int) -> tuple[bytes, int] | None:
        """An artifact's metadata (JSON) and size in bytes, or None once gone."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hget(keys.artifacts_key(job_id), str(index))
            pipe.exists(keys.artifact_data_key(job_id, index))
            pipe.strlen(keys.artifact_data_key(job_id, index))
            meta, exists, size = await pipe.execute()
        return None if meta is None or not exists else (meta, int(size))

    async def artifact_slice(self, job_id: str, index: int, offset: int, size: int) -> bytes:
        return bytes(await self._redis.getrange(keys.artifact_data_key(job_id, index), offset, offset + size - 1))

    async def callback(self, job_id: str) -> CallbackStatus | None:
        """The delivery state of the job's callback, or None (none, or its record expired)."""
        raw = await self._redis.hmget(keys.callback_key(job_id), _CALLBACK_FIELDS)
        state, attempts, last_status, last_error, last_at, next_at, delivered_at, ended_at = raw
        if state is None:
            return None
        pending = state == b"pending"

        def number(value: bytes | None) -> int | None:
            return int(value) if value else None

        return CallbackStatus(
            state=CallbackState(state.decode()),
            attempts=int(attempts or 0),
            last_status=number(last_status),
            last_error=last_error.decode(errors="replace") if last_error else None,
            last_attempt_at_ms=number(last_at),
            # Only once the job ended is an attempt due at all.
            next_attempt_at_ms=number(next_at) if pending and ended_at else None,
            delivered_at_ms=number(delivered_at),
        )

    async def mark_audience(self, job_id: str) -> None:
        """Someone may follow the job's channel from now on (see keys.audience_key). The mark
        lives as long as the job's record: a day while it runs, only what is left of its
        result's time once it ended (a client re-subscribing to read the result must not
        renew it for a day; the scripts that end a job shorten it likewise)."""
        marked = await self._mark_audience(
            keys=[keys.status_key(job_id), keys.audience_key(job_id), keys.signed_key(job_id)],
            args=[self._record_ttl_s, int(SIGNED_MARK_S)],
        )
        if marked == 0:
            # It ended since the caller read it running: as a subscription signed after the
            # end (forget_mark), so that its webhook brings the result.
            self._recent_marks.pop(job_id, None)
            return
        self._recent_marks[job_id] = time.monotonic()
        self._recent_marks.move_to_end(job_id)
        while len(self._recent_marks) > RECENT_MARKS:
            self._recent_marks.popitem(last=False)

    async def forget_mark(self, job_id: str) -> None:
        """A subscription to the job's channel is being signed after its end: soketi's webhook
        for it must reach mark_subscribed and be answered with the result, however recently an
        earlier subscription was signed (by this process or another: keys.signed_key)."""
        self._recent_marks.pop(job_id, None)
        await self._redis.delete(keys.signed_key(job_id))

    async def mark_subscribed(self, job_id: str, unmarked_only: bool = False) -> OwedPublish:
        """mark_audience, for a subscription soketi's webhook reports (for a job that has a
        record: a webhook may name any channel). Returns the events to publish now: those of
        a job that ended before the mark, which no worker published live (soketi sends the
        webhook as the subscription succeeds, so a short job may end before it lands). A job
        this process marked moments ago (its channel-auth, then soketi's webhook for the
        same subscription) is not written again while its signature stands: that webhook
        comes as the job starts, and a read costs the start less than the script's writes.

        With `unmarked_only`, a job already marked is left alone (the sweep's subscriptions,
        api/sweeper.py). What it returns is owed (keys.API_UNPUBLISHED) until its publish
        settles it.
        """
        marked_at = self._recent_marks.get(job_id)
        if (
            not unmarked_only
            and marked_at is not None
            and time.monotonic() - marked_at < RECENT_MARK_S
            and await self._redis.exists(keys.signed_key(job_id))
        ):
            return OwedPublish(self, [], "")
        token = f"api:{uuid.uuid4().hex}"
        answer = await self._mark_subscribed(
            keys=[
                keys.status_key(job_id), keys.audience_key(job_id), keys.late_replay_key(job_id), keys.events_key(job_id),
                keys.signed_key(job_id), keys.API_UNPUBLISHED, keys.resent_key(job_id),
            ],
            args=[
                self._record_ttl_s, LATE_REPLAY_ENTRIES, LATE_REPLAY_BYTES, token,
                "unmarked" if unmarked_only else "", job_id, self._owed_publish_ms, RESEND_GAP_MS,
            ],
        )  # fmt: skip
        if not isinstance(answer, list) or not answer:
            return OwedPublish(self, [], "")
        return OwedPublish(self, _entries(answer), f"{job_id}:{token}")

    def owed_kill(self, job_id: str, events: list[tuple[str, bytes]]) -> OwedPublish:
        """The publish a kill that ended a queued job someone follows owes (see _KILL)."""
        return OwedPublish(self, events, f"{job_id}:kill")

    async def confirm_owed(self, debt: str, posts: int) -> bool:
        """Whether `debt` is still this process's to send (no sweep took it); if so, it is put
        off by the time its publish may take, `posts` requests to soketi."""
        ms = self._owed_publish_ms + posts * self._publish_timeout_ms
        return bool(await self._confirm_owed(keys=[keys.API_UNPUBLISHED], args=[debt, ms]))

    async def settle_owed(self, debt: str, taken: bool = False) -> None:
        """`debt` went (`taken`: one a sweep took)."""
        await self._redis.zrem(keys.API_UNPUBLISHED_TAKEN if taken else keys.API_UNPUBLISHED, debt)

    async def take_owed_publishes(self, most: int = 8) -> list[tuple[str, tuple[str, bytes] | None]]:
        """Publishes owed by API processes and now due (their process died, or soketi did not
        take them), at most `most`, each taken for long enough to send them all one by one: the
        debt (settle_owed with `taken` once it went) and its job's last log entry (its result;
        None once the log has expired)."""
        lease_ms = 2 * self._owed_publish_ms + most * self._publish_timeout_ms
        taken = await self._take_owed(keys=[keys.API_UNPUBLISHED, keys.API_UNPUBLISHED_TAKEN], args=[lease_ms, most])
        debts = [raw.decode() for raw in taken]
        if not debts:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for debt in debts:
                pipe.xrevrange(keys.events_key(debt.split(":", 1)[0]), count=1)
            tails = await pipe.execute()
        owed: list[tuple[str, tuple[str, bytes] | None]] = []
        for debt, tail in zip(debts, tails, strict=True):
            entry = None
            if tail:
                fields = tail[0][1]
                entry = (fields[b"name"].decode(), entry_json(int(fields[b"seq"]), fields))
            owed.append((debt, entry))
        return owed

    async def unmarked(self, job_ids: list[str]) -> list[str]:
        """Those of `job_ids` whose audience is not marked."""
        if not job_ids:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.exists(keys.audience_key(job_id))
            marked = await pipe.execute()
        return [job_id for job_id, there in zip(job_ids, marked, strict=True) if not there]

    async def start(self, job_id: str, owner: str) -> StartAnswer:
        """Start the job if it is `owner`'s ('' when the caller's job token names it), in one
        script: the lookup, then the durable flag (a worker checks it on claim), then the live
        message."""
        answer = await self._start(
            keys=[keys.status_key(job_id), keys.start_flag_key(job_id)],
            args=[owner, self._record_ttl_s, keys.ctrl_channel(job_id), encode(CtrlMessage(type="start"))],
        )
        if answer[0] == 0:
            return StartAnswer("unknown")
        if answer[0] == 2:
            return StartAnswer("ended", JobState(answer[1].decode()), answer[2] == b"1")
        return StartAnswer("started")

    def stdin_call(
        self,
        job_id: str,
        data: bytes,
        close: bool,
        max_frames_per_s: int,
        max_pending_bytes: int,
        request_id: str | None = None,
    ) -> ScriptCall:
        head = b'{"kind":"%s","data":"%s","n":' % (b"close" if close else b"data", base64.b64encode(data))
        return ScriptCall(
            self._stdin,
            [
                keys.status_key(job_id),
                keys.stdin_key(job_id),
                keys.stdin_rate_key(job_id),
                keys.stdin_requests_key(job_id),
            ],
            [
                data,
                "close" if close else "data",
                max_frames_per_s,
                1000,
                max_pending_bytes,
                self._record_ttl_s,
                head,
                b',"id":"',
                keys.stdin_channel(job_id),
                request_id or uuid.uuid4().hex,
                max(128, max_frames_per_s * STDIN_REQUESTS_KEPT_S),
                STDIN_REQUESTS_KEPT_S,
            ],
        )

    async def stdin(
        self,
        job_id: str,
        data: bytes,
        close: bool,
        max_frames_per_s: int,
        max_pending_bytes: int,
        request_id: str | None = None,
    ) -> StdinAnswer:
        """Store one stdin frame durably (or the EOF frame) and notify the job's worker.

        `request_id` (a fresh one when None) names this request: the script remembers which
        frame each recent request stored, so a re-sent script stores nothing twice.
        """
        answer = await self.run(self.stdin_call(job_id, data, close, max_frames_per_s, max_pending_bytes, request_id))
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

    async def spec(self, job_id: str) -> JobSpec | None:
        raw = await self._redis.get(keys.spec_key(job_id))
        return decode_stored(JobSpec, raw) if raw is not None else None

    def kill_call(
        self, job_id: str, result_ttl_s: int, request_id: str | None = None, result: ResultEvent | None = None
    ) -> ScriptCall:
        """`result`: what the job ends with if it is still queued (default: killed before it
        started, with nothing else)."""
        template = _KILLED_BEFORE_START if result is None else result_template(result)
        return ScriptCall(
            self._kill,
            [
                keys.status_key(job_id),
                keys.QUEUE,
                keys.events_key(job_id),
                keys.spec_key(job_id),
                keys.start_flag_key(job_id),
                keys.stdin_key(job_id),
                keys.callback_key(job_id),
                keys.CALLBACKS_DUE,
                keys.done_key(job_id),
                keys.audience_key(job_id),
                keys.ENDED_COUNTS,
                keys.API_UNPUBLISHED,
            ],
            args=[
                job_id,
                now_ms(),
                result_ttl_s,
                template[0],
                template[1],
                keys.ctrl_channel(job_id),
                encode(CtrlMessage(type="kill")),
                request_id or uuid.uuid4().hex,
                self._owed_publish_ms,
            ],
        )

    async def kill(
        self, job_id: str, result_ttl_s: int, request_id: str | None = None, result: ResultEvent | None = None
    ) -> KillAnswer:
        """Ask for the job to be killed; a job no worker holds yet ends at once (with `result`,
        see kill_call).

        `request_id` (a fresh one when None) names this request, so a re-sent script gives
        its first answer again and writes nothing twice.
        """
        answer = await self.run(self.kill_call(job_id, result_ttl_s, request_id, result))
        if answer[0] == 0:
            return KillAnswer(ended_state=answer[1].decode())
        if answer[0] == 2:
            return KillAnswer(result=bytes(answer[2]), unpublished=_entries(answer[3]), heard=answer[4] == 1)
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

    async def fleet(self) -> tuple[int, int, list[tuple[WorkerInfo, int]], dict[str, int], tuple[int, int] | None]:
        """For GET /metrics: the queue's depth, the callbacks due, each live worker with the
        length of its claimed list, the jobs ended so far by terminal state, and Redis's
        memory (bytes used, and its maxmemory: 0 for none; None when Redis refuses INFO)."""
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.llen(keys.QUEUE)
            pipe.zcard(keys.CALLBACKS_DUE)
            pipe.hgetall(keys.WORKERS)
            pipe.hgetall(keys.ENDED_COUNTS)
            depth, due, workers, ended = await pipe.execute()
        ids = [wid.decode() for wid in workers]
        async with self._redis.pipeline(transaction=False) as pipe:
            for wid in ids:
                pipe.exists(keys.worker_alive_key(wid))
                pipe.llen(keys.worker_claimed_key(wid))
            answers = await pipe.execute()
        live = [
            (decode_stored(WorkerInfo, workers[wid.encode()]), int(claimed))
            for wid, alive, claimed in zip(ids, answers[::2], answers[1::2], strict=True)
            if alive
        ]
        try:
            memory = await self._redis.info("memory")
            used: tuple[int, int] | None = (int(memory["used_memory"]), int(memory.get("maxmemory", 0)))
        except (ResponseError, KeyError, ValueError):
            used = None  # INFO refused (an ACL without @dangerous, or renamed away): not shown
        return int(depth), int(due), live, {k.decode(): int(v) for k, v in ended.items()}, used

    async def known_workers(self) -> list[WorkerInfo]:
        raw = await self._redis.hgetall(keys.WORKERS)
        return [decode_stored(WorkerInfo, value) for value in raw.values()]

    async def reachable(self, timeout_s: float) -> bool:
        """Whether Redis answers a PING within `timeout_s` (its own connection's retries
        included): what a load balancer's readiness check asks."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._redis.ping()
        except (RedisError, OSError, TimeoutError):
            return False
        return True

    async def seek_events(self, job_id: str, after_seq: int) -> str:
        """The stream id of the job's last log entry with a seq of at most `after_seq` ("0"
        when none): `events(job_id, <it>, ...)` then starts right after `after_seq`."""
        found = await self._seek(keys=[keys.events_key(job_id)], args=[after_seq])
        return found.decode() if isinstance(found, bytes) else str(found)

    async def events(
        self, job_id: str, after_stream_id: str, block_ms: int | None
    ) -> list[tuple[str, int, str, Mapping[bytes, bytes]]]:
        """Entries of the job's durable log after a stream id: (stream id, seq, name, the
        entry's fields, which shared.eventlog.entry_json makes the payload of).

        With `block_ms`, waits up to that long for the first new entry. At most
        EVENTS_PER_READ: a read of 8 KiB chunks is then at most 512 KiB, whose JSON the
        caller makes one event at a time, as its client takes them.
        """
        key = keys.events_key(job_id)
        if block_ms is None:
            raw = await self._redis.xrange(
                key, min=f"({after_stream_id}" if after_stream_id != "0" else "-", count=EVENTS_PER_READ
            )
        else:
            answer = await self._streams.xread({key: after_stream_id}, count=EVENTS_PER_READ, block=block_ms)
            raw = answer[0][1] if answer else []
        return [(entry_id.decode(), int(fields[b"seq"]), fields[b"name"].decode(), fields) for entry_id, fields in raw]

    def logged_output(self, job_id: str) -> LoggedStreams:
        """The stdout and stderr the job's log holds (what went out live, within its outputKb),
        to read as a RunResult's body does (shared.eventlog.LoggedStreams)."""
        return LoggedStreams(self._redis.xrange, keys.events_key(job_id))

    async def output_snapshot(self, job_id: str) -> OutputSnapshot:
        """One atomic look for a waiting `/output`: the stored output if any, and whether the
        job has ended."""
        *found, state = await self._look_at_output(job_id, with_state=True)
        return OutputSnapshot(
            output=self._stored_output(*found),
            ended=state is None or JobState(state.decode()) in TERMINAL_STATES,
        )

    async def wait_for_result(self, job_id: str, block_ms: int) -> None:
        """Block until the job's result is logged (or `block_ms` passes).

        Every script that logs a result also adds the one entry of the job's done stream, so
        this read wakes then and only then; reading from the start, it returns at once for
        a result that landed before it began."""
        await self._waits.xread({keys.done_key(job_id): "0-0"}, count=1, block=max(1, block_ms))

    async def output(self, job_id: str) -> StoredOutputFound | None:
        """The stored result of a collectOutput job, or None (see StoredOutputFound)."""
        return self._stored_output(*await self._look_at_output(job_id, with_state=False))

    async def _look_at_output(self, job_id: str, with_state: bool) -> list[Any]:
        # A script, not MULTI/EXEC: a Redis at its maxmemory refuses every command queued in
        # a transaction, reads too, while a script that only reads always runs.
        return list(
            await self._output_look(
                keys=[
                    keys.output_key(job_id),
                    keys.output_stream_key(job_id, "stdout"),
                    keys.output_stream_key(job_id, "stderr"),
                    keys.status_key(job_id),
                ],
                args=[SMALL_OUTPUT_BYTES, 1 if with_state else 0],
            )
        )

    @staticmethod
    def _stored_output(raw: bytes | None, apart: int, stdout: bytes, stderr: bytes) -> StoredOutputFound | None:
        if raw is None:
            return None
        small = len(stdout) < SMALL_OUTPUT_BYTES and len(stderr) < SMALL_OUTPUT_BYTES
        return StoredOutputFound(bytes(raw), bool(apart), (bytes(stdout), bytes(stderr)) if apart and small else None)

    async def output_slice(self, job_id: str, stream: str, offset: int, size: int) -> bytes:
        """`size` bytes of a stored output stream from `offset` (fewer at its end)."""
        return bytes(await self._redis.getrange(keys.output_stream_key(job_id, stream), offset, offset + size - 1))


def _entries(flat: list[bytes]) -> list[tuple[str, bytes]]:
    """Log entries returned by a script as field/value pairs, each entry ended by '', as
    (name, event JSON)."""
    out: list[tuple[str, bytes]] = []
    fields: dict[bytes, bytes] = {}
    items = iter(flat)
    for item in items:
        if item == b"":
            out.append((fields[b"name"].decode(), entry_json(int(fields[b"seq"]), fields)))
            fields = {}
        else:
            fields[bytes(item)] = bytes(next(items))
    return out


def now_ms() -> int:
    return time.time_ns() // 1_000_000
