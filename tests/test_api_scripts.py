"""Every state-changing Lua script of the API may run twice: redis-py re-sends a command
whose reply was lost with its connection. Each test here runs a script twice on purpose,
with the very same keys and args, against a real redis-server, and checks that Redis holds
what one run leaves (every key, its contents and its TTL) and that nothing was published
twice. Each also has a control: the same two calls with a different request id (what the
scripts were before they remembered request ids) do change the state, so the check would
catch a script that is not idempotent.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import msgspec
import pytest
from redis.asyncio import Redis
from redis.exceptions import OutOfMemoryError

import api.store as store_module
from api.store import JobStore, ScriptCall
from api.streams import EventPace
from launcher.stack import Stack
from leanredis import LeanRedis
from shared import keys
from shared.limits import DEFAULT_LIMITS
from shared.messages import FileSpec, JobSpec, JobState
from shared.settings import load_settings
from worker.messaging.queue import _ADVANCE

pytestmark = [pytest.mark.stack]

RECORD_TTL_S = 86400
RESULT_TTL_S = 600


@pytest.fixture(scope="module")
def redis_stack() -> Iterator[Stack]:
    """A stack of its own without a worker: nothing claims what these tests queue."""
    with Stack(with_worker=False) as stack:
        yield stack


# Both clients the services use: redis-py's own, and its pipelined LeanRedis (leanredis/).
@pytest.fixture(params=[Redis, LeanRedis], ids=["redis-py", "lean"])
async def redis(request: pytest.FixtureRequest, redis_stack: Stack) -> AsyncIterator[Redis]:
    client = request.param.from_url(redis_stack.redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture
def store(redis: Redis) -> JobStore:
    return JobStore(redis, RECORD_TTL_S)


def _spec(owner: str = "owner-a") -> JobSpec:
    return JobSpec(
        job_id=uuid.uuid4().hex,
        language="python",
        version="3.11",
        files=[FileSpec(name="main.py", content="print(1)")],
        limits=DEFAULT_LIMITS,
        created_at_ms=1_700_000_000_000,
        owner=owner,
        close_stdin=False,
    )


async def snapshot(redis: Redis) -> dict[bytes, tuple[Any, ...]]:
    """Every key of the database: its type, its whole contents and its TTL (seconds)."""
    out: dict[bytes, tuple[Any, ...]] = {}
    async for key in redis.scan_iter(count=1000):
        kind = (await redis.type(key)).decode()
        if kind == "string":
            value: Any = await redis.get(key)
        elif kind == "hash":
            value = sorted((await redis.hgetall(key)).items())
        elif kind == "list":
            value = await redis.lrange(key, 0, -1)
        elif kind == "zset":
            value = await redis.zrange(key, 0, -1, withscores=True)
        elif kind == "stream":
            value = await redis.xrange(key)
        else:  # pragma: no cover - the API writes no other type
            value = kind
        out[key] = (kind, value, await redis.ttl(key))
    return out


def assert_same_state(first: dict[bytes, tuple[Any, ...]], second: dict[bytes, tuple[Any, ...]]) -> None:
    assert first.keys() == second.keys()
    for key, (kind, value, ttl) in first.items():
        kind2, value2, ttl2 = second[key]
        assert (kind, value) == (kind2, value2), key
        # A re-set TTL is the same TTL (a second may tick between the snapshots).
        assert (ttl < 0) == (ttl2 < 0) and abs(ttl - ttl2) <= 2, (key, ttl, ttl2)


async def twice(redis: Redis, call: ScriptCall) -> tuple[Any, Any, dict, dict]:  # type: ignore[type-arg]
    """Run the registered script object twice with the same keys and args (a lost reply and
    redis-py's re-send); the two answers and the state after each run."""
    first = await call.script(keys=call.keys, args=call.args)
    after_one = await snapshot(redis)
    second = await call.script(keys=call.keys, args=call.args)
    return first, second, after_one, await snapshot(redis)


class Published:
    """Messages published on some channels while the block runs."""

    def __init__(self, redis: Redis, *channels: str) -> None:
        self._pubsub = redis.pubsub()
        self._channels = channels
        self.messages: list[bytes] = []

    async def __aenter__(self) -> Published:
        await self._pubsub.subscribe(*self._channels)
        for _ in self._channels:  # the subscribe confirmations
            await self._pubsub.get_message(timeout=1)
        return self

    async def __aexit__(self, *exc: object) -> None:
        while (message := await self._pubsub.get_message(ignore_subscribe_messages=True, timeout=0.3)) is not None:
            self.messages.append(message["data"])
        await self._pubsub.aclose()


# ---------------------------------------------------------------- enqueue


async def test_enqueue_twice_queues_once(store: JobStore, redis: Redis) -> None:
    spec = _spec()
    call = store.enqueue_call(spec, 100, 100, RESULT_TTL_S)
    first, second, after_one, after_two = await twice(redis, call)
    assert first == second == 1
    assert_same_state(after_one, after_two)
    assert await redis.lrange(keys.QUEUE, 0, -1) == [spec.job_id.encode()]
    assert await redis.zrange(keys.owner_jobs_key(spec.owner), 0, -1) == [spec.job_id.encode()]
    assert await redis.zcard(keys.unstarted_key(spec.owner)) == 1
    # Control: a new request (a new job id) does queue a second job.
    other = store.enqueue_call(_spec(), 100, 100, RESULT_TTL_S)
    assert await store.run(other) == 1
    assert await redis.llen(keys.QUEUE) == 2


async def test_enqueue_with_a_key_twice_queues_once(store: JobStore, redis: Redis) -> None:
    spec = _spec()
    call = store.enqueue_call(spec, 100, 100, RESULT_TTL_S, "order-17", "a" * 64)
    first, second, after_one, after_two = await twice(redis, call)
    # The re-run is this request's own earlier run: "queued" again, not "an earlier job".
    assert first == second == 1
    assert_same_state(after_one, after_two)
    assert await redis.lrange(keys.QUEUE, 0, -1) == [spec.job_id.encode()]
    record = await redis.hgetall(keys.idempotency_key(spec.owner, "order-17"))
    assert record == {b"jobId": spec.job_id.encode(), b"bodySha256": b"a" * 64}
    # Control: another request with the same key and body gets the first job, writes nothing.
    later = _spec()
    answer = await store.enqueue(later, 100, 100, RESULT_TTL_S, "order-17", "a" * 64)
    assert (answer.outcome, answer.job_id) == ("existing", spec.job_id)
    assert_same_state(after_two, await snapshot(redis))


async def test_keys_are_per_owner_and_per_body(store: JobStore, redis: Redis) -> None:
    a = await store.enqueue(_spec("owner-a"), 100, 100, RESULT_TTL_S, "k", "1" * 64)
    b = await store.enqueue(_spec("owner-b"), 100, 100, RESULT_TTL_S, "k", "1" * 64)
    assert a.outcome == b.outcome == "queued" and a.job_id != b.job_id
    conflict = await store.enqueue(_spec("owner-a"), 100, 100, RESULT_TTL_S, "k", "2" * 64)
    assert (conflict.outcome, conflict.job_id) == ("conflict", a.job_id)
    assert await redis.llen(keys.QUEUE) == 2
    # Checked before the queue's cap: a retry of an accepted request is never a 429.
    again = await store.enqueue(_spec("owner-a"), 0, 0, RESULT_TTL_S, "k", "1" * 64)
    assert (again.outcome, again.job_id) == ("existing", a.job_id)
    assert await store.idempotent_job("owner-a", "k", "1" * 64) == again
    assert (await store.idempotent_job("owner-a", "k", "2" * 64)).outcome == "conflict"  # type: ignore[union-attr]
    assert await store.idempotent_job("owner-c", "k", "1" * 64) is None


async def test_key_records_live_as_long_as_the_job_record(store: JobStore, redis: Redis) -> None:
    # The job's record lives JOB_RECORD_TTL while unfinished, then RUN_RESULT_TTL from its
    # end: a job ending late has a record for up to both. Its key lives that long (the look-up
    # also wants the record), or a retry after the key's expiry would run the job twice.
    spec = _spec()
    await store.enqueue(spec, 100, 100, RESULT_TTL_S, "k", "1" * 64)
    record = keys.idempotency_key(spec.owner, "k")
    assert RECORD_TTL_S + RESULT_TTL_S - 2 <= await redis.ttl(record) <= RECORD_TTL_S + RESULT_TTL_S
    assert RECORD_TTL_S - 2 <= await redis.ttl(keys.status_key(spec.job_id)) <= RECORD_TTL_S
    index_ttl = await redis.ttl(keys.owner_jobs_key(spec.owner))
    assert RECORD_TTL_S + RESULT_TTL_S - 2 <= index_ttl <= RECORD_TTL_S + RESULT_TTL_S
    # The job's record expires (as the finish script's TTL makes it): the key is free again.
    await redis.delete(keys.status_key(spec.job_id))
    assert await store.idempotent_job(spec.owner, "k", "1" * 64) is None
    assert await store.idempotent_job(spec.owner, "k", "2" * 64) is None
    fresh = _spec()
    answer = await store.enqueue(fresh, 100, 100, RESULT_TTL_S, "k", "2" * 64)
    assert (answer.outcome, answer.job_id) == ("queued", fresh.job_id)
    assert (await redis.hgetall(record))[b"jobId"] == fresh.job_id.encode()


async def test_index_forgets_what_is_certainly_expired(store: JobStore, redis: Redis) -> None:
    old = _spec()
    await store.enqueue(old, 100, 100, RESULT_TTL_S)
    new = msgspec.structs.replace(_spec(), created_at_ms=old.created_at_ms + (RECORD_TTL_S + RESULT_TTL_S) * 1000 + 1)
    await store.enqueue(new, 100, 100, RESULT_TTL_S)
    assert await redis.zrange(keys.owner_jobs_key(old.owner), 0, -1) == [new.job_id.encode()]


async def test_enqueue_refuses_an_owner_over_its_retained_output(store: JobStore, redis: Redis) -> None:
    spec = _spec()
    seconds, micros = await redis.time()
    now = seconds * 1000 + micros // 1000  # (the ledger runs on Redis's clock, not the spec's)
    ledger, sizes = keys.retained_key(spec.owner), keys.retained_sizes_key(spec.owner)
    # Two finished jobs keep 600 bytes; the older one's result has already expired.
    await redis.zadd(ledger, {"old": now - 1, "new": now + 4000})
    await redis.hset(sizes, mapping={"old": 200, "new": 400, "_total": 600})

    answer = await store.enqueue(spec, 100, 100, RESULT_TTL_S, max_retained_bytes=400)
    assert (answer.outcome, answer.kept_bytes) == ("retained", 400)
    assert 3000 < answer.frees_in_ms <= 4000, answer.frees_in_ms  # (by Redis's clock, read since)
    assert not await redis.exists(keys.status_key(spec.job_id)) and not await redis.llen(keys.QUEUE)
    # The expired job was forgotten on the way, whatever the answer.
    assert await redis.zrange(ledger, 0, -1) == [b"new"] and await redis.hget(sizes, "old") is None

    assert (await store.enqueue(spec, 100, 100, RESULT_TTL_S, max_retained_bytes=401)).outcome == "queued"
    other = _spec()
    assert (await store.enqueue(other, 100, 100, RESULT_TTL_S)).outcome == "queued"  # 0: no bound


async def test_at_maxmemory_an_enqueue_is_refused_even_when_it_forgets_something_first(store: JobStore, redis: Redis) -> None:
    # Redis refuses a plain script only at its first write that may grow memory, and only
    # while the script has written nothing: forgetting an expired ledger entry first let the
    # whole job in past maxmemory.
    spec = _spec()
    ledger, sizes = keys.retained_key(spec.owner), keys.retained_sizes_key(spec.owner)
    await redis.zadd(ledger, {"old": spec.created_at_ms - 1})
    await redis.hset(sizes, mapping={"old": 200, "_total": 200})
    await redis.config_set("maxmemory", 1)  # below what it holds
    try:
        with pytest.raises(OutOfMemoryError):
            await store.enqueue(spec, 100, 100, RESULT_TTL_S, max_retained_bytes=10_000)
        with pytest.raises(OutOfMemoryError):
            await store.stdin(spec.job_id, b"x", False, 30, 65536)
    finally:
        await redis.config_set("maxmemory", 0)
    assert not await redis.exists(keys.status_key(spec.job_id)) and not await redis.llen(keys.QUEUE)
    assert await redis.zrange(ledger, 0, -1) == [b"old"]  # nothing of it ran
    assert (await store.enqueue(spec, 100, 100, RESULT_TTL_S, max_retained_bytes=10_000)).outcome == "queued"

    # The same for a blob: its upload forgets the owner's expired blobs first.
    from api.blobs import BlobStore

    blobs = BlobStore(redis, load_settings({"PUSHER_SECRET": "x"}))
    await redis.hset(keys.blob_index_key("owner-a"), "f" * 64, 100)  # its blob has expired
    await redis.config_set("maxmemory", 1)
    try:
        with pytest.raises(OutOfMemoryError):
            await blobs.put("owner-a", "a" * 64, b"x" * 100_000)
    finally:
        await redis.config_set("maxmemory", 0)
    assert not await redis.exists(keys.blob_key("owner-a", "a" * 64))


async def _advance(redis: Redis, job_id: str, state: str) -> None:
    """A worker's mark of the job's new state, as its claim would send it (attempt 0)."""
    answer = await redis.eval(
        _ADVANCE, 2, keys.status_key(job_id), keys.events_key(job_id), "0", 60, state, int(time.time() * 1000), "", "token",
        "", "", 0,
    )  # fmt: skip
    assert answer == [1, 0], answer


async def test_enqueue_bounds_the_input_an_owners_unstarted_jobs_hold(store: JobStore, redis: Redis) -> None:
    def big(owner: str = "owner-a") -> JobSpec:
        return msgspec.structs.replace(_spec(owner), files=[FileSpec(name="main.py", content="#" * 10_000)])

    size = len(msgspec.json.encode(big()))
    sizes = keys.unstarted_sizes_key("owner-a")
    first, second, third = big(), big(), big()
    for spec in (first, second):
        assert (await store.enqueue(spec, 100, 100, RESULT_TTL_S, max_unstarted_bytes=int(2.5 * size))).outcome == "queued"
    assert await redis.hget(sizes, "_total") == str(2 * size).encode()
    assert await redis.hget(sizes, first.job_id) == str(size).encode()
    assert 0 < await redis.ttl(sizes) <= RECORD_TTL_S

    answer = await store.enqueue(third, 100, 100, RESULT_TTL_S, max_unstarted_bytes=int(2.5 * size))
    assert (answer.outcome, answer.kept_bytes) == ("input", 2 * size)
    assert not await redis.exists(keys.status_key(third.job_id), keys.spec_key(third.job_id))
    assert await redis.llen(keys.QUEUE) == 2
    # Other owners hold their own; and a job alone is let in however big it is.
    alone = await store.enqueue(big("owner-b"), 100, 100, RESULT_TTL_S, max_unstarted_bytes=size // 2)
    assert alone.outcome == "queued"

    # A job started by its client but still in the queue holds its input all the same; once
    # a worker marks it starting, it no longer counts (marked twice is once).
    assert (await store.start(first.job_id, "owner-a")).outcome == "started"
    assert await redis.hget(sizes, "_total") == str(2 * size).encode()
    for _ in range(2):
        await _advance(redis, first.job_id, "starting")
    assert await redis.hget(sizes, "_total") == str(size).encode()
    assert await redis.hget(sizes, first.job_id) is None
    # What the index missed (here, a total drifted) the recount on a refusal heals, at most
    # once a second: within the second of the last one, the stored total is believed.
    await redis.hset(sizes, "_total", 10 * size)
    answer = await store.enqueue(third, 100, 100, RESULT_TTL_S, max_unstarted_bytes=int(2.5 * size))
    assert (answer.outcome, answer.kept_bytes) == ("input", 10 * size)
    await redis.hset(sizes, "_countedAtMs", 0)  # (as a second later)
    assert (await store.enqueue(third, 100, 100, RESULT_TTL_S, max_unstarted_bytes=int(2.5 * size))).outcome == "queued"
    assert await redis.hget(sizes, "_total") == str(2 * size).encode()
    assert set(await redis.zrange(keys.unstarted_key("owner-a"), 0, -1)) == {second.job_id.encode(), third.job_id.encode()}
    # The count is stamped by Redis's clock, not by the API's (a submit's time): an API 10
    # minutes fast stamped it ahead, and every other API believed a stale total for those
    # 10 minutes. A stamp found ahead of Redis's clock (an older API's) is due at once.
    redis_now_ms = int((await redis.time())[0]) * 1000
    fourth = msgspec.structs.replace(big(), created_at_ms=redis_now_ms + 600_000)
    await redis.hset(sizes, "_total", 10 * size)
    assert (await store.enqueue(fourth, 100, 100, RESULT_TTL_S, max_unstarted_bytes=int(2.5 * size))).outcome == "input"
    assert abs(int(await redis.hget(sizes, "_countedAtMs")) - redis_now_ms) < 60_000
    await redis.hset(sizes, "_total", 10 * size)
    await redis.hset(sizes, "_countedAtMs", redis_now_ms + 600_000)
    assert (await store.enqueue(fourth, 100, 100, RESULT_TTL_S, max_unstarted_bytes=int(2.5 * size))).outcome == "input"
    assert await redis.hget(sizes, "_total") == str(2 * size).encode()  # (healed: counted again)
    # 0: no bound.
    assert (await store.enqueue(big(), 100, 100, RESULT_TTL_S)).outcome == "queued"


async def test_the_input_recount_copes_with_thousands_of_unstarted_jobs(store: JobStore, redis: Redis) -> None:
    # A MAX_PARKED_PER_PRINCIPAL in the thousands: the recount must not hit Lua's stack limit.
    spec = _spec()
    ids = [f"parked-{i}" for i in range(5000)]
    async with redis.pipeline(transaction=False) as pipe:
        for i, job_id in enumerate(ids):
            pipe.hset(keys.status_key(job_id), "state", "parked")
            pipe.zadd(keys.unstarted_key(spec.owner), {job_id: i})
            pipe.hset(keys.unstarted_sizes_key(spec.owner), job_id, 100)
        pipe.hset(keys.unstarted_sizes_key(spec.owner), "_total", 500_000)
        await pipe.execute()
    answer = await store.enqueue(spec, 100, 10_000, RESULT_TTL_S, max_unstarted_bytes=500_000)
    assert (answer.outcome, answer.kept_bytes) == ("input", 500_000)
    assert await redis.hlen(keys.unstarted_sizes_key(spec.owner)) == 5002  # and _total, _countedAtMs


async def test_a_client_held_at_its_cap_is_refused_without_a_look_at_every_job(store: JobStore, redis: Redis) -> None:
    # Every refused execute counted the owner's 500 unstarted jobs again (500 HMGET and 500
    # HSET: 10 ms of Redis, against 64 us for an accepted one); jobs now leave the index as
    # they start or end, and the recount that heals what that missed runs once a second.
    specs = [_spec() for _ in range(501)]
    for spec in specs[:500]:
        assert (await store.enqueue(spec, 1000, 500, RESULT_TTL_S)).outcome == "queued"
    await redis.config_resetstat()
    for _ in range(10):
        assert (await store.enqueue(specs[500], 1000, 500, RESULT_TTL_S)).outcome == "unstarted"
    stats = await redis.info("commandstats")
    assert stats.get("cmdstat_hmget", {}).get("calls", 0) <= 500, stats.get("cmdstat_hmget")
    # A client's start alone makes no room (the job may still wait in the queue, holding
    # its input); a worker marking it running does, at once, without waiting for a recount.
    assert (await store.start(specs[0].job_id, "owner-a")).outcome == "started"
    assert (await store.enqueue(specs[500], 1000, 500, RESULT_TTL_S)).outcome == "unstarted"
    await _advance(redis, specs[0].job_id, "running")
    assert (await store.enqueue(specs[500], 1000, 500, RESULT_TTL_S)).outcome == "queued"


# ---------------------------------------------------------------- stdin


async def _running_job(store: JobStore, redis: Redis) -> str:
    spec = _spec()
    assert (await store.enqueue(spec, 100, 100, RESULT_TTL_S)).outcome == "queued"
    await redis.hset(keys.status_key(spec.job_id), mapping={"state": "running", "started": "1"})
    return spec.job_id


@pytest.mark.parametrize("close", [False, True], ids=["frame", "eof"])
async def test_stdin_twice_stores_one_frame(store: JobStore, redis: Redis, close: bool) -> None:
    job_id = await _running_job(store, redis)
    data = b"" if close else b"hello\n"
    call = store.stdin_call(job_id, data, close, 30, 65536, request_id="req-1")
    async with Published(redis, keys.stdin_channel(job_id)) as published:
        first, second, after_one, after_two = await twice(redis, call)
    assert first == second == [1, 0]
    assert_same_state(after_one, after_two)
    assert await redis.xlen(keys.stdin_key(job_id)) == 1
    status = await redis.hgetall(keys.status_key(job_id))
    assert status[b"stdinFrames"] == b"1" and status[b"stdinAccepted"] == str(len(data)).encode()
    assert len(published.messages) == 1
    # Control: the same bytes under another request id are another frame (and, after EOF,
    # refused): the snapshot comparison above would see a second run that wrote again.
    again = await store.run(call._replace(args=[*call.args[:9], "req-2", *call.args[10:]]))
    assert again == ([0, b"closed", b""] if close else [1, 1])


async def test_stdin_rerun_answers_the_same_after_the_job_ended(store: JobStore, redis: Redis) -> None:
    job_id = await _running_job(store, redis)
    call = store.stdin_call(job_id, b"x", False, 30, 65536, request_id="req-1")
    assert await store.run(call) == [1, 0]
    await redis.hset(keys.status_key(job_id), "state", "done")
    # The frame was accepted before the job ended; the lost reply must still say so.
    before = await snapshot(redis)
    assert await store.run(call) == [1, 0]
    assert_same_state(before, await snapshot(redis))
    fresh = await store.stdin(job_id, b"x", False, 30, 65536)
    assert fresh.refused == "ended"


async def test_stdin_rate_is_kept_on_redis_clock_whatever_the_api_processes_clocks(
    store: JobStore, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two API processes, one of them ten seconds ahead: their frames share one rate list,
    # and the one behind must not be told to wait eleven seconds for a one-second window.
    job_id = await _running_job(store, redis)
    real = store_module.now_ms
    monkeypatch.setattr(store_module, "now_ms", lambda: real() + 10_000)
    for _ in range(2):
        assert (await store.stdin(job_id, b"x", False, 2, 65536)).frame is not None
    monkeypatch.setattr(store_module, "now_ms", real)
    answer = await store.stdin(job_id, b"x", False, 2, 65536)
    assert answer.refused == "rate" and 0 < answer.retry_after_ms <= 1000, answer


async def test_stdin_request_ids_are_bounded(store: JobStore, redis: Redis) -> None:
    job_id = await _running_job(store, redis)
    for i in range(140):
        await redis.delete(keys.stdin_rate_key(job_id))
        await redis.hset(keys.status_key(job_id), "stdinWritten", i)
        assert (await store.stdin(job_id, b"x", False, 1, 65536, request_id=f"r{i}")).frame == i
    remembered = keys.stdin_requests_key(job_id)
    # At least two minutes of frames at the rate cap (here 1/s) and never fewer than 128.
    assert await redis.zcard(remembered) == 128
    assert await redis.zscore(remembered, "r139") == 139 and await redis.zscore(remembered, "r11") is None
    assert 0 < await redis.ttl(remembered) <= 120


# ---------------------------------------------------------------- kill


async def test_kill_of_a_queued_job_twice_ends_it_once(store: JobStore, redis: Redis) -> None:
    spec = _spec()
    await store.enqueue(spec, 100, 100, RESULT_TTL_S)
    await redis.xadd(keys.stdin_key(spec.job_id), {"n": 1, "kind": "data", "data": "x"})  # (stored while queued)
    call = store.kill_call(spec.job_id, RESULT_TTL_S, request_id="kill-1")
    async with Published(redis, keys.ctrl_channel(spec.job_id)) as published:
        first, second, after_one, after_two = await twice(redis, call)
    assert first[0] == 2 and first == second  # the re-run hands back the same result to publish
    assert first[3] == []  # never claimed: nothing logged before the result
    assert_same_state(after_one, after_two)
    events = await redis.xrange(keys.events_key(spec.job_id))
    assert [fields[b"name"] for _, fields in events] == [b"result"]
    assert await redis.xlen(keys.done_key(spec.job_id)) == 1
    assert 0 < await redis.ttl(keys.done_key(spec.job_id)) <= RESULT_TTL_S
    for key in (keys.events_key(spec.job_id), keys.done_key(spec.job_id), keys.stdin_key(spec.job_id)):
        assert await redis.memory_usage(key) < 1500  # compacted (shared.eventlog): 4.7 KB if not
    assert await redis.lrange(keys.QUEUE, 0, -1) == []
    assert await redis.hget(keys.status_key(spec.job_id), "state") == b"killed"
    assert not await redis.exists(keys.spec_key(spec.job_id))  # an ended job's input goes
    assert published.messages == []
    # Control: another kill request finds the job ended (the old script's answer to a re-run).
    assert await store.run(call._replace(args=[*call.args[:7], "kill-2"])) == [0, b"killed"]


@pytest.mark.parametrize("live_seq", [0, 1, 3])
async def test_kill_of_a_handed_back_job_returns_what_nobody_published(
    store: JobStore, redis: Redis, live_seq: int
) -> None:
    # A claim logged seq 0..2 and handed the job back; `liveSeq` says how far it had
    # published (a parked job: 0; one handed back while `starting`: all of it).
    spec = _spec()
    await store.enqueue(spec, 100, 100, RESULT_TTL_S)
    logged = [b'{"phase":"queued","seq":0}', b'{"phase":"compiling","seq":1}']
    for seq, data in enumerate(logged):
        await redis.xadd(keys.events_key(spec.job_id), {"seq": seq, "name": "stage", "data": data})
    await redis.xadd(keys.events_key(spec.job_id), {"seq": 2, "name": "compile_output", "chunk": 'a "b"\n'})
    await redis.hset(keys.status_key(spec.job_id), mapping={"nextSeq": 3, "liveSeq": live_seq})
    if live_seq == 1:
        await store.mark_audience(spec.job_id)  # someone was allowed to subscribe
    call = store.kill_call(spec.job_id, RESULT_TTL_S, request_id="kill-1")
    first, second, _, _ = await twice(redis, call)
    assert first == second and first[:2] == [2, 3] and first[4] == (1 if live_seq == 1 else 0)
    answer = await store.kill(spec.job_id, RESULT_TTL_S, request_id="kill-1")  # (a re-send: decoded)
    expected = [("stage", data) for data in logged] + [("compile_output", b'{"chunk":"a \\"b\\"\\n","seq":2}')]
    assert answer.unpublished == expected[live_seq:]
    assert answer.result is not None and b'"seq":3' in answer.result


async def test_a_late_subscription_to_an_ended_job_replays_its_log_once_within_bounds(
    store: JobStore, redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # soketi's webhook for a subscription signed outside the API lands after the job ended:
    # nobody published it live. The mark script takes the late-replay claim and returns the
    # log: its first entries within the bytes bound, then the result. Sent again with its
    # token (the reply lost), it answers the same; a second webhook (a new first subscriber:
    # a page reloaded) gets the result alone, unless the API signed that subscription while
    # the job ran (its webhook came late: the subscriber heard the result live).
    monkeypatch.setattr(store_module, "LATE_REPLAY_BYTES", 64 * 1024)
    spec = _spec()
    await store.enqueue(spec, 100, 100, RESULT_TTL_S)
    events = keys.events_key(spec.job_id)
    await redis.xadd(events, {"seq": 0, "name": "stage", "data": b'{"phase":"queued","seq":0}'})
    for seq in range(1, 21):  # 20 chunks of 8 KiB: 160 KiB of output
        await redis.xadd(events, {"seq": seq, "name": "stdout", "chunk": "x" * 8192})
    await redis.hset(keys.status_key(spec.job_id), "nextSeq", 21)
    assert (await store.kill(spec.job_id, RESULT_TTL_S)).result is not None  # the result: seq 21
    keys_ = [
        keys.status_key(spec.job_id), keys.audience_key(spec.job_id), keys.late_replay_key(spec.job_id), events,
        keys.signed_key(spec.job_id), keys.API_UNPUBLISHED, keys.resent_key(spec.job_id),
    ]  # fmt: skip
    args = [RECORD_TTL_S, store_module.LATE_REPLAY_ENTRIES, store_module.LATE_REPLAY_BYTES, "api:one", "", spec.job_id, 10_000, 500]
    first = await store._mark_subscribed(keys=keys_, args=args)
    replay = store_module._entries(first)
    seqs = [int(msgspec.json.decode(data)["seq"]) for _, data in replay]
    assert seqs == [0, 1, 2, 3, 4, 5, 6, 7, 21], seqs  # 64 KiB: the stage and 7 chunks, then the result
    assert replay[-1][0] == "result"
    assert await store._mark_subscribed(keys=keys_, args=args) == first  # re-sent: the same
    assert [name for name, _ in (await store.mark_subscribed(spec.job_id)).events] == ["result"]  # replayed already
    assert await redis.get(keys.late_replay_key(spec.job_id)) == b"api:one"
    await redis.set(keys.signed_key(spec.job_id), "1", ex=60)
    assert (await store.mark_subscribed(spec.job_id)).events == []
    assert not await redis.exists(keys.signed_key(spec.job_id))  # (consumed)


async def test_what_the_api_publishes_itself_is_owed_until_it_went_then_swept_once_due(store: JobStore, redis: Redis) -> None:
    # An API process killed a queued job someone follows, or took a late replay, and died
    # before publishing: the follower never heard the result. Each is now owed in Redis, one
    # debt per publish, until it went; once due, a sweep takes it (moved aside: its owner,
    # should it still be about to send, then leaves it) with the job's result from its log.
    followed, unheard, replayed = _spec(), _spec(), _spec()
    for spec in (followed, unheard, replayed):
        await store.enqueue(spec, 100, 100, RESULT_TTL_S)
    await store.mark_audience(followed.job_id)
    killed = await store.kill(followed.job_id, RESULT_TTL_S)
    assert killed.heard and killed.result is not None
    assert not (await store.kill(unheard.job_id, RESULT_TTL_S)).heard
    assert await store.take_owed_publishes() == []  # (not due yet)
    await store.kill(replayed.job_id, RESULT_TTL_S)
    replay = await store.mark_subscribed(replayed.job_id)
    assert [name for name, _ in replay.events] == ["result"]  # (the late replay)
    assert (await store.mark_subscribed(replayed.job_id, unmarked_only=True)).events == []  # (marked now: left alone)
    owed = sorted(debt.decode() for debt in await redis.zrange(keys.API_UNPUBLISHED, 0, -1))
    assert owed == sorted([f"{followed.job_id}:kill", replay.debt]) and replay.debt.startswith(f"{replayed.job_id}:api:")
    assert await replay.confirm(posts=1)
    await replay.settle()  # (it went)
    kill = store.owed_kill(followed.job_id, [])
    await redis.zadd(keys.API_UNPUBLISHED, {kill.debt: 0})  # (its process died, or is slow: due)
    assert await store.take_owed_publishes() == [(kill.debt, ("result", killed.result))]
    assert not await kill.confirm(posts=1)  # (its owner, late, leaves it to the sweep)
    assert await store.take_owed_publishes() == []  # (taken: leased to that sweep)
    await redis.zadd(keys.API_UNPUBLISHED_TAKEN, {kill.debt: 0})  # (that sweep died: its lease ran out)
    assert await store.take_owed_publishes() == [(kill.debt, ("result", killed.result))]
    await store.settle_owed(kill.debt, taken=True)
    assert await redis.zcard(keys.API_UNPUBLISHED) == 0 and await redis.zcard(keys.API_UNPUBLISHED_TAKEN) == 0


async def test_a_subscription_signed_as_its_job_ends_gets_the_result(store: JobStore, redis: Redis) -> None:
    # Review: channel-auth read the job running; the job then ended, its result written with
    # nobody marked (so published to nobody); then the mark and the note that this
    # subscription was signed while the job ran landed. The subscription's webhook took the
    # note for "heard it live" and sent nothing: the follower never learned how it ended.
    # The mark now looks at the state in its own script.
    spec = _spec()
    await store.enqueue(spec, 100, 100, RESULT_TTL_S)
    assert not (await store.kill(spec.job_id, RESULT_TTL_S)).heard  # (it ends, followed by nobody)
    await store.mark_audience(spec.job_id)  # (channel-auth, which had read it running)
    assert not await redis.exists(keys.signed_key(spec.job_id))
    replay = await store.mark_subscribed(spec.job_id)  # (the subscription's webhook)
    assert replay.events and replay.events[-1][0] == "result", replay.events


async def test_an_ended_jobs_result_goes_again_at_most_once_a_gap_and_one_sooner_is_owed(store: JobStore, redis: Redis) -> None:
    # New first subscribers of an ended job's channel (a client subscribing and unsubscribing in
    # a loop) each got the result published again, thousands a second. One within the gap now
    # gets nothing at once: it is owed, due when the gap is over, for a sweep to send; and
    # settling the publish in flight does not settle it.
    spec = _spec()
    await store.enqueue(spec, 100, 100, RESULT_TTL_S)
    await store.mark_audience(spec.job_id)
    await store.kill(spec.job_id, RESULT_TTL_S)
    await store.owed_kill(spec.job_id, []).settle()  # (the kill's own publish went)
    await store.forget_mark(spec.job_id)  # (a page reloaded: its subscription signed after the end)
    clock = await redis.time()
    before_ms = clock[0] * 1000 + clock[1] // 1000
    first = await store.mark_subscribed(spec.job_id)
    assert [name for name, _ in first.events] == ["result"]
    for _ in range(50):
        assert (await store.mark_subscribed(spec.job_id)).events == []
    await first.settle()  # (that one went)
    due = await redis.zscore(keys.API_UNPUBLISHED, f"{spec.job_id}:gap")
    assert due is not None and before_ms <= due <= before_ms + store_module.RESEND_GAP_MS + 50, (before_ms, due)
    assert await redis.zcard(keys.API_UNPUBLISHED) == 1
    await redis.delete(keys.resent_key(spec.job_id))  # (the gap is over)
    assert [name for name, _ in (await store.mark_subscribed(spec.job_id)).events] == ["result"]


async def test_a_sweep_leaves_a_debt_named_like_one_it_holds_and_retries_get_half_its_takes(store: JobStore, redis: Redis) -> None:
    # A review: a result resent within the gap is owed as '<job>:gap'; owed again while a sweep
    # held the last one, the next sweep's take merged the two, and the first sweep's settle
    # deleted both. And retries of publishes soketi did not take were taken only when fewer new
    # debts were due than a sweep takes: a subscribe loop over many ended jobs starved them.
    await redis.zadd(keys.API_UNPUBLISHED, {"j0:gap": 0})
    assert [debt for debt, _ in await store.take_owed_publishes()] == ["j0:gap"]
    await redis.zadd(keys.API_UNPUBLISHED, {"j0:gap": 0})  # (owed again meanwhile)
    assert await store.take_owed_publishes() == []  # (waits for the one held)
    await store.settle_owed("j0:gap", taken=True)
    assert [debt for debt, _ in await store.take_owed_publishes()] == ["j0:gap"]
    await store.settle_owed("j0:gap", taken=True)
    await redis.zadd(keys.API_UNPUBLISHED_TAKEN, {f"r{i}:kill": 0 for i in range(8)})  # (leases run out)
    await redis.zadd(keys.API_UNPUBLISHED, {f"n{i}:kill": 0 for i in range(8)})  # (new, due)
    taken = [debt for debt, _ in await store.take_owed_publishes(most=8)]
    assert sorted(d[0] for d in taken) == ["n"] * 4 + ["r"] * 4, taken


async def test_kill_flag_twice_publishes_once(store: JobStore, redis: Redis) -> None:
    spec = _spec()
    await store.enqueue(spec, 100, 100, RESULT_TTL_S)
    await redis.lrem(keys.QUEUE, 1, spec.job_id)
    await redis.hset(keys.status_key(spec.job_id), "state", "parked")  # a worker holds it
    call = store.kill_call(spec.job_id, RESULT_TTL_S, request_id="kill-1")
    async with Published(redis, keys.ctrl_channel(spec.job_id)) as published:
        first, second, after_one, after_two = await twice(redis, call)
        # The worker ends the job (killed) before the re-sent script arrives: still accepted.
        await redis.hset(keys.status_key(spec.job_id), "state", "killed")
        third = await store.run(call)
    assert first == second == third == [1]
    assert_same_state(after_one, after_two)
    assert await redis.hget(keys.status_key(spec.job_id), "kill") == b"1"
    assert published.messages == [b'{"type":"kill"}']
    # Control: a different request before the end flags and publishes again.
    await redis.hset(keys.status_key(spec.job_id), "state", "parked")
    async with Published(redis, keys.ctrl_channel(spec.job_id)) as published:
        assert await store.run(call._replace(args=[*call.args[:7], "kill-2"])) == [1]
    assert published.messages == [b'{"type":"kill"}']


async def test_kill_remembers_the_last_eight_requests(store: JobStore, redis: Redis) -> None:
    spec = _spec()
    await store.enqueue(spec, 100, 100, RESULT_TTL_S)
    await redis.lrem(keys.QUEUE, 1, spec.job_id)
    await redis.hset(keys.status_key(spec.job_id), "state", "running")
    for i in range(10):
        assert (await store.kill(spec.job_id, RESULT_TTL_S, request_id=f"k{i}")).ended_state is None
    remembered = (await redis.hget(keys.status_key(spec.job_id), "killRequests")).split()  # type: ignore[union-attr]
    assert remembered == [f"k{i}".encode() for i in range(9, 1, -1)]


# ---------------------------------------------------------------- receipts (trims the index)


async def test_receipts_script_twice_trims_once(store: JobStore, redis: Redis) -> None:
    specs = [_spec() for _ in range(3)]
    for spec in specs:
        await store.enqueue(spec, 100, 100, RESULT_TTL_S)
    await redis.delete(keys.status_key(specs[1].job_id))  # expired
    call = ScriptCall(store._receipts, [keys.owner_jobs_key("owner-a")], ["+inf", "", 50, 1000, ""])
    first, second, after_one, after_two = await twice(redis, call)
    assert first == second and len(first) == 2 + 2 * 9
    assert_same_state(after_one, after_two)
    assert await redis.zcard(keys.owner_jobs_key("owner-a")) == 2


async def test_receipts_read_the_outcome_kept_beside_the_result(store: JobStore, redis: Redis) -> None:
    # Amplification review: a page of receipts read each job's whole result (up to 100 KB
    # with a compile's log) inside one script to find its outcome: 200 such jobs blocked
    # Redis ~20 ms a page. The scripts that write a result keep its outcome beside it; a
    # record from before that still gets its outcome from the result.
    specs = [_spec() for _ in range(3)]
    for spec in specs:
        await store.enqueue(spec, 100, 100, RESULT_TTL_S)
    assert (await store.kill(specs[0].job_id, RESULT_TTL_S, request_id="k")).result is not None  # (ended in the queue)
    assert await redis.hget(keys.status_key(specs[0].job_id), "outcome") == b"killed"
    # (its result says otherwise, so the receipt shows which of the two was read)
    await redis.hset(keys.status_key(specs[1].job_id), mapping={
        "state": "done", "outcome": "compile_error", "result": '{"outcome":"completed","compile":"' + "x" * 90_000 + '"}',
    })  # fmt: skip
    await redis.hset(keys.status_key(specs[2].job_id), mapping={"state": "done", "result": '{"exitCode":0,"outcome":"completed"}'})
    found, _ = await store.receipts("owner-a", None, 10, None)
    outcomes = {receipt.job_id: receipt.outcome for receipt in found}
    assert outcomes == {specs[0].job_id: "killed", specs[1].job_id: "compile_error", specs[2].job_id: "completed"}


async def test_scripts_survive_concurrent_reruns(store: JobStore, redis: Redis) -> None:
    """Many copies of one stdin call at once (a retry storm) still store one frame."""
    job_id = await _running_job(store, redis)
    call = store.stdin_call(job_id, b"once", False, 30, 65536, request_id="storm")
    answers = await asyncio.gather(*(store.run(call) for _ in range(20)))
    assert all(answer == [1, 0] for answer in answers)
    assert await redis.xlen(keys.stdin_key(job_id)) == 1


# ---------------------------------------------------------------- start


async def test_start_checks_the_owner_and_stores_the_flag_once(store: JobStore, redis: Redis) -> None:
    spec = _spec("owner-a")
    await store.enqueue(spec, 100, 100, RESULT_TTL_S)
    job = spec.job_id
    assert (await store.start(uuid.uuid4().hex, "owner-a")).outcome == "unknown"
    assert (await store.start(job, "owner-b")).outcome == "unknown"  # not yours: as if unknown
    assert not await redis.exists(keys.start_flag_key(job))

    pubsub = redis.pubsub()
    await pubsub.subscribe(keys.ctrl_channel(job))
    assert (await pubsub.get_message(timeout=2))["type"] == "subscribe"  # type: ignore[index]
    assert (await store.start(job, "owner-a")).outcome == "started"
    assert (await store.start(job, "")).outcome == "started"  # a job token named it
    assert await redis.get(keys.start_flag_key(job)) == b"1"
    assert 0 < await redis.ttl(keys.start_flag_key(job)) <= RECORD_TTL_S
    messages = []
    while (message := await pubsub.get_message(timeout=0.2)) is not None:
        messages.append(message["data"])
    assert messages == [b'{"type":"start"}'] * 2
    # Amplification review: every repeat published to the worker, however long the job had
    # been running (3,800 a second on 4 connections: a quarter of the worker's loop). Once
    # its worker acted on the start, a repeat is accepted and publishes nothing.
    for state in ("starting", "running"):
        await redis.hset(keys.status_key(job), mapping={"state": state})
        assert (await store.start(job, "")).outcome == "started"
    assert await pubsub.get_message(timeout=0.2) is None
    await pubsub.aclose()

    await redis.hset(keys.status_key(job), mapping={"state": "killed"})
    await redis.delete(keys.start_flag_key(job))
    answer = await store.start(job, "owner-a")
    assert (answer.outcome, answer.state, answer.started) == ("ended", JobState.KILLED, False)
    assert not await redis.exists(keys.start_flag_key(job))  # nothing written for an ended job
    await redis.hset(keys.status_key(job), mapping={"state": "done", "started": "1"})
    answer = await store.start(job, "owner-a")
    assert (answer.outcome, answer.state, answer.started) == ("ended", JobState.DONE, True)


async def test_a_resume_finds_its_place_in_the_log_by_seq(redis: Redis, store: JobStore) -> None:
    # Ids grow with seq, in bursts that share a millisecond and across gaps of any length.
    job_id = uuid.uuid4().hex
    key = keys.events_key(job_id)
    assert await store.seek_events(job_id, 5) == "0"  # no log (yet)
    rng = random.Random(7)
    ms, ids = 1_700_000_000_000, []
    for seq in range(400):
        ms += rng.choice([0, 0, 0, 1, 2, 17, 1000, 86_400_000])
        ids.append((await redis.xadd(key, {"seq": seq, "name": "stdout", "data": b"x" * 64}, id=f"{ms}-{seq}")).decode())
    assert await store.seek_events(job_id, -1) == "0"
    for after in [*range(400), 400, 10_000]:
        found = await store.seek_events(job_id, after)
        assert found == ids[min(after, 399)], after
        entries = await store.events(job_id, found, None)
        assert [seq for _, seq, _, _ in entries][:1] == ([after + 1] if after < 399 else [])
    # Thousands of entries in one millisecond (one append's batch): found by halving too.
    burst = uuid.uuid4().hex
    burst_ids = [
        (await redis.xadd(keys.events_key(burst), {"seq": seq, "name": "stdout", "data": b"x"}, id=f"{ms + 5}-{seq}")).decode()
        for seq in range(3000)
    ]
    for after in (0, 1, 1499, 2998, 2999, 5000):
        assert await store.seek_events(burst, after) == burst_ids[min(after, 2999)], after
    # A log that starts past the seq (its first entries gone): everything follows.
    await redis.xdel(key, *ids[:10])
    assert await store.seek_events(job_id, 3) == "0"
    assert await store.seek_events(job_id, 10) == ids[10]


async def _a_log(redis: Redis, outputs: int, fields: dict[str, bytes]) -> str:
    """A new job's event log: `outputs` stdout entries with `fields`, then its result; its id."""
    job_id = uuid.uuid4().hex
    key = keys.events_key(job_id)
    for seq in range(outputs):
        await redis.xadd(key, {"seq": seq, "name": "stdout", **fields})
    await redis.xadd(key, {"seq": outputs, "name": "result", "data": b'{"outcome":"completed"}'})
    return job_id


UNPACED = EventPace(10**9)


async def test_an_sse_resume_reads_the_log_from_where_the_client_left_off(
    redis: Redis, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    from api.events import _stream

    job_id = await _a_log(redis, 300, {"data": b'{"chunk":"x"}'})
    read: list[int] = []
    events = store.events

    async def counted(job: str, after: str, block_ms: int | None) -> list[tuple[str, int, str, Any]]:
        found = await events(job, after, block_ms)
        read.extend(seq for _, seq, _, _ in found)
        return found

    monkeypatch.setattr(store, "events", counted)
    sent = [frame async for frame in _stream(store, job_id, 297, UNPACED, "c")]
    assert [frame.split(b"\n", 1)[0] for frame in sent] == [b"id: 298", b"id: 299", b"id: 300"]
    assert read == [298, 299, 300]  # not the 298 entries before them
    read.clear()
    assert len([frame async for frame in _stream(store, job_id, -1, UNPACED, "c")]) == 301
    assert read == list(range(301))


async def test_a_callers_event_streams_are_paced_together_and_apart_from_others(redis: Redis, store: JobStore) -> None:
    # Amplification audit: a stream costs the API ~10 us an event, and a client replaying a
    # long log from its start, 32 streams at a time and again, kept its loop busy for all.
    from api.events import _stream

    job_id = await _a_log(redis, 300, {"data": b'{"chunk":"x"}'})
    pace = EventPace(200)  # (301 events: a burst of 200, then 200 a second)

    async def replay(caller: str) -> float:
        loop = asyncio.get_running_loop()
        began = loop.time()
        assert len([frame async for frame in _stream(store, job_id, -1, pace, caller)]) == 301
        return loop.time() - began

    alone = await replay("a")
    apart = await asyncio.gather(replay("b"), replay("c"))
    together = await asyncio.gather(replay("d"), replay("d"))
    assert 0.4 <= alone < 1.5 and all(0.4 <= took < 1.5 for took in apart), (alone, apart)
    assert max(together) >= 1.9, together  # (602 events: 200, then 402 at 200 a second)


async def test_one_job_tokens_replays_take_only_its_share_of_the_owners_pace() -> None:
    """A browser replaying a long log over and over through its job token spends a bucket of
    its own first, at a quarter of the pace: the owner's bucket, which every other stream of
    the owner waits on, keeps three quarters for them. (Before, the token took all of it.)"""
    pace = EventPace(4000)
    loop = asyncio.get_running_loop()

    async def hog() -> None:
        while True:
            await pace.spend("owner", 64, "job:hog")

    hogging = asyncio.create_task(hog())
    try:
        await asyncio.sleep(0.5)
        began = loop.time()
        await pace.spend("owner", 64, "job:other")
        waited = loop.time() - began
    finally:
        hogging.cancel()
        await asyncio.gather(hogging, return_exceptions=True)
    assert waited < 0.05, waited
    # The hog itself was held to its share: a burst of 1,000, then 1,000 a second.
    assert pace._buckets._refilled("owner", loop.time()) > 2000


async def test_an_event_pace_forgets_refilled_keys_at_most_once_a_second(monkeypatch: pytest.MonkeyPatch) -> None:
    # (A scan at every spend, while more than KEEP buckets were refilling, cost each spend
    # the whole table.)
    from api.streams import _Buckets

    monkeypatch.setattr(_Buckets, "KEEP", 10)
    pace = EventPace(1000)
    for n in range(50):
        await pace.spend(f"job-token-{n}", 1)
    assert len(pace._buckets) == 50  # (none refilled at the first look; no second within 1 s)
    await asyncio.sleep(1.1)
    await pace.spend("owner", 1)
    assert list(pace._buckets) == ["owner"]


async def test_an_sse_catch_up_reads_a_big_log_a_bounded_piece_at_a_time(
    redis: Redis, store: JobStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 600 chunks of 8 KiB of control bytes: 4.7 MiB in the log, six times that as JSON. One
    # read of them all (and all of it made JSON at once) held that much per stream, for
    # each of the hundreds a process may serve, however slowly its client read.
    from api.events import _stream

    job_id = await _a_log(redis, 600, {"chunk": b"\x01" * 8192})
    read_bytes: list[int] = []
    events = store.events

    async def measured(job: str, after: str, block_ms: int | None) -> list[tuple[str, int, str, Any]]:
        found = await events(job, after, block_ms)
        # (What each entry holds when read: its fields, or its JSON made at once.)
        read_bytes.append(sum(len(held) if isinstance(held, bytes) else sum(map(len, held.values())) for *_, held in found))
        return found

    monkeypatch.setattr(store, "events", measured)
    frames = 0
    async for frame in _stream(store, job_id, -1, UNPACED, "c"):
        frames += 1
        if frames == 1:
            assert frame.startswith(b"id: 0\nevent: stdout\ndata: ") and frame.count(b"\\u0001") == 8192
    assert frames == 601
    assert max(read_bytes) <= 512 * 1024 + 4096, read_bytes
