"""Redis key and channel names: the only place they are spelled.

Seed-product names are kept (`jobs:queue`, `job:<id>:spec`, `job:<id>:status`,
`job:<id>:output`, `ctrl:<id>`, `stdin:<id>`, `start:<id>`) so operators can read both.
"""

from __future__ import annotations

import hashlib

__all__ = [
    "CALLBACKS_DUE",
    "CALLBACK_HOST_PREFIX",
    "CHANNEL_PREFIX",
    "DATASET",
    "ENDED_COUNTS",
    "NOW_MS_LUA",
    "OUTCOME_OF_LUA",
    "QUEUE",
    "UNSTARTED_BACK_LUA",
    "UNSTARTED_GONE_LUA",
    "WORKERS",
    "artifact_data_key",
    "artifacts_key",
    "blob_index_key",
    "blob_key",
    "blob_prefix",
    "callback_key",
    "ctrl_channel",
    "done_key",
    "events_key",
    "idempotency_key",
    "job_id_from_channel",
    "output_key",
    "output_stream_key",
    "owner_jobs_key",
    "realtime_channel",
    "retained_key",
    "retained_sizes_key",
    "spec_key",
    "start_flag_key",
    "status_key",
    "stdin_channel",
    "stdin_key",
    "stdin_rate_key",
    "stdin_requests_key",
    "unstarted_key",
    "unstarted_sizes_key",
    "worker_alive_key",
    "worker_claimed_key",
]

QUEUE = "jobs:queue"
# Hash: worker id -> WorkerInfo (JSON). A worker is live while worker_alive_key exists.
WORKERS = "workers"
CHANNEL_PREFIX = "private-run-"
# Sorted set: job id -> when its callback is next due (ms). A sender that takes one moves it
# a lease ahead, so a sender that dies leaves it due again for another.
CALLBACKS_DUE = "callbacks:due"
# Built by the delivery scripts from a callback record's `host` (`host:port`), so a record's
# receiver is known only inside them. `<prefix><host>`: sorted set, job id -> when the lease
# of its attempt in flight there ends. `<prefix><host>:waiting`: sorted set, job id -> when it
# was due, for deliveries put off because that host had CALLBACK_MAX_PER_HOST in flight.
CALLBACK_HOST_PREFIX = "callbacks:host:"
# Hash: terminal state -> how many jobs ended in it, ever (counted by the scripts that end
# jobs; served by GET /metrics).
ENDED_COUNTS = "stats:ended"
# String: a random token the first heartbeat after the data was lost sets (a Redis restarted
# without persistence, or flushed). A token that changes between two heartbeats is a break
# in Redis's answers, as a stall is (worker/messaging/continuity.py): every lease is gone.
DATASET = "workers:dataset"


def spec_key(job_id: str) -> str:
    return f"job:{job_id}:spec"


def status_key(job_id: str) -> str:
    return f"job:{job_id}:status"


def events_key(job_id: str) -> str:
    return f"job:{job_id}:events"


def done_key(job_id: str) -> str:
    """A stream that gets one entry when the job's result is logged (see RESULT_LANDED_LUA)."""
    return f"job:{job_id}:done"


def callback_key(job_id: str) -> str:
    """Hash: the job's callback (url, collect) and its delivery state (state, attempts, ...)."""
    return f"job:{job_id}:callback"


def artifacts_key(job_id: str) -> str:
    """Hash: artifact number -> its metadata (JSON); kept as long as the job's result."""
    return f"job:{job_id}:artifacts"


def artifact_data_key(job_id: str, index: int) -> str:
    """The exact bytes of one artifact."""
    return f"job:{job_id}:artifact:{index}"


def output_key(job_id: str) -> str:
    return f"job:{job_id}:output"


def stdin_key(job_id: str) -> str:
    """Stream of the job's accepted stdin frames (durable; the worker reads it by id)."""
    return f"job:{job_id}:stdin"


def stdin_rate_key(job_id: str) -> str:
    """List of the arrival times (ms) of the job's most recent stdin frames."""
    return f"job:{job_id}:stdin:rate"


def retained_key(owner: str) -> str:
    """Sorted set of an API principal's finished jobs that keep output, scored by expiry ms."""
    return f"owner:{owner}:retained"


def retained_sizes_key(owner: str) -> str:
    """Hash: job id -> output bytes it keeps, plus `_total` (the sum)."""
    return f"owner:{owner}:retained:bytes"


def blob_key(owner: str, digest: str) -> str:
    """String: the bytes of a blob a principal uploaded (`digest` is its sha256, hex), with a TTL."""
    return f"{blob_prefix(owner)}{digest}"


def blob_prefix(owner: str) -> str:
    """What every blob key of `owner` starts with (the index's scripts add the digest)."""
    return f"blob:{owner}:"


def blob_index_key(owner: str) -> str:
    """Hash: digest -> size of each blob the principal keeps (entries outlive expired blobs
    until the next upload prunes them)."""
    return f"owner:{owner}:blobs"


def unstarted_key(owner: str) -> str:
    """Sorted set of an API principal's jobs that have not started yet (queued or parked)."""
    return f"owner:{owner}:unstarted"


def unstarted_sizes_key(owner: str) -> str:
    """Hash: job id -> bytes of its stored spec, for each job in `unstarted_key`, and `_total`:
    what the principal's jobs not yet started hold in Redis (bounded by MAX_UNSTARTED_INPUT_MB)."""
    return f"owner:{owner}:unstarted:sizes"


_UNSTARTED_HEAD, _UNSTARTED_TAIL = unstarted_key("\n").split("\n")
_SIZES_TAIL = unstarted_sizes_key("\n").split("\n")[1]
_STATUS_HEAD, _STATUS_TAIL = status_key("\n").split("\n")

# Lua: unstarted_gone(status key) takes the job out of its owner's unstarted index, and its
# spec's bytes off the index's total, once a worker marks it starting or running or it ends,
# so the next execute sees the room at once (the enqueue script's recount only heals what
# this missed). Not at the client's start: a started job still waiting in the queue holds
# its input in Redis like a parked one. Safe to run twice.
UNSTARTED_GONE_LUA = f"""
local function unstarted_gone(status)
  local owner = redis.call('HGET', status, 'owner')
  local id = string.sub(status, {len(_STATUS_HEAD) + 1}, {-len(_STATUS_TAIL) - 1})
  if not owner then return end
  if redis.call('ZREM', '{_UNSTARTED_HEAD}' .. owner .. '{_UNSTARTED_TAIL}', id) == 0 then return end
  local sizes = '{_UNSTARTED_HEAD}' .. owner .. '{_SIZES_TAIL}'
  local bytes = tonumber(redis.call('HGET', sizes, id) or '0')
  if redis.call('HDEL', sizes, id) == 1 and bytes > 0 and redis.call('EXISTS', sizes) == 1 then
    redis.call('HINCRBY', sizes, '_total', -bytes)
  end
end
"""

# Lua: unstarted_back(status key, spec key, ttl s) puts a job that goes back to the queue
# unstarted (a worker handed it back, or a dead one's was re-queued) in its owner's index
# again, with its spec's bytes, if it had left it (it was marked starting): a started job
# waiting in the queue holds its input like a parked one, and the recount never adds a job
# back. The index and sizes live at least `ttl` from here, as an enqueue leaves them.
UNSTARTED_BACK_LUA = f"""
local function unstarted_back(status, spec, ttl)
  local st = redis.call('HMGET', status, 'owner', 'createdAtMs')
  if not st[1] then return end
  local id = string.sub(status, {len(_STATUS_HEAD) + 1}, {-len(_STATUS_TAIL) - 1})
  local index = '{_UNSTARTED_HEAD}' .. st[1] .. '{_UNSTARTED_TAIL}'
  if redis.call('ZADD', index, 'NX', tonumber(st[2] or '0') or 0, id) == 0 then return end
  local sizes = '{_UNSTARTED_HEAD}' .. st[1] .. '{_SIZES_TAIL}'
  local bytes = redis.call('STRLEN', spec)
  redis.call('HSET', sizes, id, bytes)
  redis.call('HINCRBY', sizes, '_total', bytes)
  for _, key in ipairs({{index, sizes}}) do
    if redis.call('TTL', key) < tonumber(ttl) then redis.call('EXPIRE', key, ttl) end
  end
end
"""


# Lua: outcome_of(result JSON) is the result's `outcome`, kept beside it in the job's record
# (field `outcome`) by every script that writes a result, so a page of receipts reads a word
# a job, not its whole result (up to PUSHER_MAX_PAYLOAD_KB: a compile's log).
# Lua for scripts: now_ms(), Redis's clock in ms (the hosts' clocks may disagree: whatever
# several processes compare, or Redis expires, is timed by it).
NOW_MS_LUA = """
local function now_ms()
  local clock = redis.call('TIME')
  return tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
end
"""

OUTCOME_OF_LUA = """
local function outcome_of(result)
  return string.match(result, '"outcome":"([%w_]+)"') or ''
end
"""


def owner_jobs_key(owner: str) -> str:
    """Sorted set of an API principal's jobs (ids scored by creation ms): its receipts' index."""
    return f"owner:{owner}:jobs"


def idempotency_key(owner: str, key: str) -> str:
    """Hash {jobId, bodySha256}: the job an `Idempotency-Key` of this principal created.

    The client's key is hashed (sha256, hex) so any printable key makes a tidy key name.
    """
    return f"owner:{owner}:idem:{hashlib.sha256(key.encode()).hexdigest()}"


def stdin_requests_key(job_id: str) -> str:
    """Sorted set of the job's recent stdin request ids, scored by the frame number each got
    (a re-sent stdin script finds its earlier answer here instead of storing the frame twice)."""
    return f"job:{job_id}:stdin:requests"


def output_stream_key(job_id: str, stream: str) -> str:
    """The exact bytes of a collected stream (`stdout` or `stderr`), stored raw."""
    return f"job:{job_id}:{stream}"


def start_flag_key(job_id: str) -> str:
    return f"start:{job_id}"


def ctrl_channel(job_id: str) -> str:
    return f"ctrl:{job_id}"


def stdin_channel(job_id: str) -> str:
    return f"stdin:{job_id}"


def worker_alive_key(worker_id: str) -> str:
    return f"worker:{worker_id}:alive"


def worker_claimed_key(worker_id: str) -> str:
    return f"worker:{worker_id}:claimed"


def worker_unpublished_key(worker_id: str) -> str:
    """Jobs whose result this worker stored while someone followed them, and has not yet
    said were handed to soketi: should it die first, whoever reaps it publishes them."""
    return f"worker:{worker_id}:unpublished"


# Jobs whose result an API process is publishing itself (a kill that ended a queued job, a
# late subscriber's replay), by when (ms, Redis's clock) it should have gone: should the
# process die first, another API process (or it, restarted) publishes the result once due.
API_UNPUBLISHED = "api:unpublished"
# Of those, what a sweep took, until its lease runs out (then any sweep may take it again).
API_UNPUBLISHED_TAKEN = "api:unpublished:taken"


def realtime_channel(job_id: str) -> str:
    return f"{CHANNEL_PREFIX}{job_id}"


def late_replay_key(job_id: str) -> str:
    """Taken (SET NX) by whoever publishes the events a follower missed because its mark came
    after they went by (soketi's webhook, for a subscription signed outside the API, may
    come after a short job's events): the job's worker lane while it runs, or the API's
    webhook handler once the job has ended. One taker, so no event goes out twice."""
    return f"job:{job_id}:latereplay"


def audience_key(job_id: str) -> str:
    """Set by the API when it signs a subscription to the job's channel: only then can anyone
    be listening (soketi admits nobody to a private channel without that signature)."""
    return f"job:{job_id}:audience"


def signed_key(job_id: str) -> str:
    """A subscription to the job's channel was signed by the API (POST /v1/channel-auth) while
    the job ran, moments ago: soketi's webhook for it consumes this, and knows its subscriber
    heard the job live, whichever API process signed it."""
    return f"job:{job_id}:signed"


def resent_key(job_id: str) -> str:
    """Set for a moment when the API sends an ended job's result again to a new first
    subscriber of its channel: one more within it waits until it is gone."""
    return f"job:{job_id}:resent"


def job_id_from_channel(channel: str) -> str | None:
    """The job id of a `private-run-<id>` channel, or None for any other channel."""
    if not channel.startswith(CHANNEL_PREFIX):
        return None
    job_id = channel[len(CHANNEL_PREFIX) :]
    return job_id if is_job_id(job_id) else None


def is_job_id(value: str) -> bool:
    """Job ids are 32 lowercase hex digits (uuid4().hex)."""
    # (strip, in C: a generator over the 32 characters cost the API ~10 us a request.)
    return len(value) == 32 and not value.strip("0123456789abcdef")
