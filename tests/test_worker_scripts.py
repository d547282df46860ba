"""Every state-changing Lua script of the worker may run twice: redis-py re-sends a command
whose reply was lost with its connection. Each test runs a worker operation for real, then
sends its script again with the very same keys and args, against a real redis-server, and
checks that Redis holds what one run leaves (every key, its contents and its TTL).
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from api.store import JobStore
from leanredis import LeanRedis
from shared import keys
from shared.eventlog import COMPACT_MAX_ENTRIES
from shared.limits import Limits
from shared.messages import CompileInfo, CtrlMessage, JobState, Outcome, TestCase, WorkerInfo, result_without_run
from shared.messages import TestResultEvent as CaseVerdictEvent  # (not a test class)
from shared.settings import load_settings
from tests.test_api_scripts import RECORD_TTL_S, RESULT_TTL_S, _spec, assert_same_state, redis_stack, snapshot
from worker.isolation.jail import JailExit, Program
from worker.isolation.janitor import _declare
from worker.isolation.memory import UNBOUNDED_BYTES, MemoryAdmission
from worker.isolation.sandbox import Uncharged
from worker.job.artifacts import RedisArtifactStore
from worker.job.batch import BatchProgress
from worker.job.run import JobRun, Plan
from worker.job.supervise import StepFacts
from worker.messaging.control import UNSUBSCRIBE_WITHIN_S, ControlBus
from worker.messaging.flagsweep import BATCH, FlagSweep
from worker.messaging.queue import QUEUED_STAGE, Advanced, Fenced, LivePublish, LogAhead, WorkerQueue, WorkerSuperseded
from worker.worker import Worker

pytestmark = [pytest.mark.stack]

__all__ = ["redis_stack"]  # the module-scoped stack fixture, shared with the API's script tests


# What a short stream takes once compacted (shared.eventlog.RESULT_LANDED_LUA), and what a
# new one took before: Redis 7 gives each stream node 4 KiB up front.
COMPACT_BYTES = 1500
UNCOMPACTED_BYTES = 4096


class Recorded:
    """A registered script that remembers how it was called, to send the same call again."""

    def __init__(self, script: Any) -> None:
        self.script = script
        self.calls: list[tuple[list[Any], list[Any]]] = []

    async def __call__(self, keys: list[Any], args: list[Any]) -> Any:
        self.calls.append((keys, args))
        return await self.script(keys=keys, args=args)

    async def again(self) -> Any:
        keys_, args = self.calls[-1]
        return await self.script(keys=keys_, args=args)


# Both clients the services use: redis-py's own, and its pipelined LeanRedis (leanredis/).
@pytest.fixture(params=[Redis, LeanRedis], ids=["redis-py", "lean"])
async def redis(request: pytest.FixtureRequest, redis_stack) -> AsyncIterator[Redis]:  # type: ignore[no-untyped-def]
    client = request.param.from_url(redis_stack.redis_url)
    await client.flushdb()
    yield client
    await client.aclose()


@pytest.fixture
def queue(redis: Redis) -> WorkerQueue:
    q = WorkerQueue(redis, "w-" + uuid.uuid4().hex[:8], RECORD_TTL_S, RESULT_TTL_S)
    for name in ("_claim", "_advance", "_finish", "_hand_back", "_reap", "_stdin_written"):
        setattr(q, name, Recorded(getattr(q, name)))
    return q


async def _claimed(redis: Redis, queue: WorkerQueue) -> Any:
    spec = _spec()
    answer = await JobStore(redis, RECORD_TTL_S).enqueue(spec, 100, 100, RESULT_TTL_S)
    assert answer.outcome == "queued"
    claim = await queue.claim(1.0, 0.0)
    assert claim is not None and claim.spec.job_id == spec.job_id
    return claim


async def test_claim_sent_twice_takes_one_attempt(redis: Redis, queue: WorkerQueue) -> None:
    claim = await _claimed(redis, queue)
    after_one = await snapshot(redis)
    again = await queue._claim.again()  # type: ignore[attr-defined]
    assert again is not None and int(again[0]) == claim.attempt == 1
    assert_same_state(after_one, await snapshot(redis))
    assert await redis.hget(keys.status_key(claim.spec.job_id), "state") == b"parked"
    assert await redis.lrange(keys.worker_claimed_key(queue.worker_id), 0, -1) == [claim.spec.job_id.encode()]
    # The first claim logged stage{queued} as seq 0, once.
    assert claim.logged_queued and claim.next_seq == 1
    logged = await redis.xrange(keys.events_key(claim.spec.job_id))
    assert [(f[b"seq"], f[b"name"], f[b"data"]) for _, f in logged] == [(b"0", b"stage", QUEUED_STAGE)]
    assert QUEUED_STAGE == b'{"phase":"queued","seq":0}'


async def test_a_claim_re_queued_as_a_stray_before_its_script_ran_is_not_taken(redis: Redis, queue: WorkerQueue) -> None:
    # The claim's script round trip outlasted two upkeeps (a reply lost, re-sent): the id
    # was recovered as a stray meanwhile, out of our list and back on the queue. The script
    # must not claim it then, or it would run here while in no claimed list and queued too.
    spec = _spec()
    assert (await JobStore(redis, RECORD_TTL_S).enqueue(spec, 100, 100, RESULT_TTL_S)).outcome == "queued"
    real = queue._claim
    recovered: list[Any] = []

    async def late(keys: list[Any], args: list[Any]) -> Any:
        recovered.extend(await queue.recover_claims(queue.worker_id, only={spec.job_id}))
        return await real(keys=keys, args=args)

    queue._claim = late  # type: ignore[assignment]
    assert await queue.claim(1.0, 0.0) is None
    assert recovered == []  # never started: re-queued, not lost
    assert await redis.lrange(keys.worker_claimed_key(queue.worker_id), 0, -1) == []
    assert await redis.lrange(keys.QUEUE, 0, -1) == [spec.job_id.encode()]
    assert await redis.hget(keys.status_key(spec.job_id), "state") == b"queued"
    queue._claim = real
    claim = await queue.claim(1.0, 0.0)  # claimed afresh, as any worker would
    assert claim is not None and claim.spec.job_id == spec.job_id


async def test_advance_sent_twice_appends_once(redis: Redis, queue: WorkerQueue) -> None:
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    events = [(1, "stage", "data", b'{"phase":"running","seq":1}'), (2, "stdout", "chunk", b"hello\n")]
    await queue.advance(job, claim.attempt, events, state=JobState.RUNNING, started=True)
    after_one = await snapshot(redis)
    assert await queue._advance.again() == [1, 0]  # type: ignore[attr-defined]
    assert_same_state(after_one, await snapshot(redis))
    assert [int(f[b"seq"]) for _, f in await redis.xrange(keys.events_key(job))] == [0, 1, 2]
    # The next batch still goes in.
    await queue.advance(job, claim.attempt, [(3, "stdout", "chunk", b"more\n")])
    assert await redis.xlen(keys.events_key(job)) == 4


async def test_an_append_publishes_what_it_logged_in_order_and_once(redis: Redis, queue: WorkerQueue) -> None:
    # A LivePublish rides on the append: its messages reach the adapter's subscribers in
    # order, after the append, and a re-run of the same append (its reply lost) tells how
    # many went out without sending any again.
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    listener = redis.pubsub()
    await listener.subscribe("adapter")
    await listener.get_message(timeout=1.0)  # (the subscription's confirmation)

    async def heard() -> list[bytes]:
        out = []
        while (message := await listener.get_message(timeout=0.2)) is not None:
            out.append(message["data"])
        return out

    events = [(1, "stage", "data", b'{"phase":"running","seq":1}'), (2, "stdout", "chunk", b"hi\n")]
    publish = LivePublish("adapter", only_if_followed=False, logged=[b"m0"], messages=[b"m1", b"m2"])
    answer = await queue.advance(job, claim.attempt, events, state=JobState.RUNNING, started=True, publish=publish)
    assert answer == Advanced(heard=False, published=3)
    assert await heard() == [b"m0", b"m1", b"m2"]
    after_one = await snapshot(redis)
    assert await queue._advance.again() == [1, 3]  # type: ignore[attr-defined]
    assert_same_state(after_one, await snapshot(redis))
    assert await heard() == []
    # Only if followed: nothing goes out without the audience mark, all once it is there.
    followed = LivePublish("adapter", only_if_followed=True, logged=[], messages=[b"m3"])
    answer = await queue.advance(job, claim.attempt, [(3, "stdout", "chunk", b"a")], publish=followed)
    assert answer == Advanced(heard=False, published=0) and await heard() == []
    await redis.set(keys.audience_key(job), "1")
    followed = LivePublish("adapter", only_if_followed=True, logged=[], messages=[b"m4"])
    answer = await queue.advance(job, claim.attempt, [(4, "stdout", "chunk", b"b")], publish=followed)
    assert answer == Advanced(heard=True, published=1) and await heard() == [b"m4"]
    # A channel nobody listens to: the first message reaches nobody, and the script stops.
    await listener.unsubscribe("adapter")
    assert (await listener.get_message(timeout=1.0) or {}).get("type") == "unsubscribe"
    await listener.aclose()
    nobody = LivePublish("adapter", only_if_followed=False, logged=[], messages=[b"m5", b"m6"])
    answer = await queue.advance(job, claim.attempt, [(5, "stdout", "chunk", b"c"), (6, "stdout", "chunk", b"d")], publish=nobody)
    assert answer.published == 0
    assert [int(f[b"seq"]) for _, f in await redis.xrange(keys.events_key(job))] == [0, 1, 2, 3, 4, 5, 6]
    # Fenced off: neither logged nor published.
    with pytest.raises(Fenced):
        await queue.advance(job, claim.attempt + 1, [(7, "stdout", "chunk", b"e")], publish=followed)


async def test_finish_refuses_a_seq_the_log_already_holds(redis: Redis, queue: WorkerQueue) -> None:
    # A worker cancelled while an append was in flight does not know the append landed: its
    # count says the result is seq 1, the log already holds 1 and 2.
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    await queue.advance(job, claim.attempt, [(1, "stdout", "chunk", b"a\n"), (2, "stdout", "chunk", b"b\n")])
    before = await snapshot(redis)
    with pytest.raises(LogAhead) as ahead:
        await queue.finish(job, claim.attempt, JobState.DONE, 1, b'{"seq":1}', None)
    assert ahead.value.next_seq == 3
    assert_same_state(before, await snapshot(redis))  # nothing written
    assert await queue.finish(job, claim.attempt, JobState.DONE, 3, b'{"seq":3}', None)
    log = [(int(f[b"seq"]), f[b"name"]) for _, f in await redis.xrange(keys.events_key(job))]
    assert log == [(0, b"stage"), (1, b"stdout"), (2, b"stdout"), (3, b"result")]


async def test_a_finish_gives_the_jobs_artifacts_the_results_lifetime(redis: Redis, queue: WorkerQueue) -> None:
    """Artifacts are stored when collected; the result may be written minutes later (Redis
    away in between, FINISH_RETRY_S). They must not expire before it: links that 404 beside
    a result that lists them."""
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    store = RedisArtifactStore(redis)
    for index in range(2):
        assert await store.put(job, claim.attempt, index, b'{"name":"a"}', b"bytes", 5)  # (collected long ago)
    assert await queue.finish(job, claim.attempt, JobState.DONE, 1, b'{"seq":1}', None, artifacts=2)
    for key in (keys.artifacts_key(job), keys.artifact_data_key(job, 0), keys.artifact_data_key(job, 1)):
        assert RESULT_TTL_S <= await redis.ttl(key) <= RESULT_TTL_S + 60, key


async def test_the_retained_output_ledger_runs_on_redis_clock(
    redis: Redis, queue: WorkerQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker whose clock runs an hour fast scores its finished job's output by Redis's
    clock all the same: its owner is not held to output that has already expired."""
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    monkeypatch.setattr("worker.messaging.queue.now_ms", lambda: int(time.time() * 1000) + 3_600_000)
    await queue.finish(job, claim.attempt, JobState.DONE, 1, b'{"seq":1}', None, owner=claim.spec.owner, kept_bytes=500)
    seconds, micros = await redis.time()
    redis_now = seconds * 1000 + micros // 1000
    expires = await redis.zscore(keys.retained_key(claim.spec.owner), job)
    assert expires is not None and abs(expires - (redis_now + RESULT_TTL_S * 1000)) < 5_000, expires - redis_now


class _Lane:
    """What a job publishes live, recorded (no soketi)."""

    followed = True
    adapter = None

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def send(self, name: str, data: bytes) -> None:
        self.sent.append((name, data))

    def wants_audience(self) -> bool:
        return False

    def knows_nobody_follows(self) -> bool:
        return False

    def learned_audience(self, present: bool) -> None:
        pass

    async def close(self, timeout_s: float = 0.0) -> None:
        pass


async def _answers() -> bool:
    """A worker's probe finding Redis there (worker.messaging.probe)."""
    return True


def _job_run(
    queue: WorkerQueue, claim: Any, lane: _Lane | None = None, hard_stop: bool = False, redis_answers: bool = True
) -> JobRun:
    """A JobRun on a real queue, its live events recorded in `lane`: what _finish and the
    park/hand-back paths use of a worker, without sandboxes or soketi."""
    stop = asyncio.Event()
    if hard_stop:
        stop.set()

    async def answers() -> bool:
        return redis_answers

    ctx = SimpleNamespace(
        queue=queue,
        publisher=SimpleNamespace(lane=lambda _channel: lane or _Lane()),
        settings=SimpleNamespace(pusher_max_payload_kb=100, pusher_timeout_ms=1000),
        hard_stop=stop,
        redis_answers=answers,
    )
    return JobRun(ctx, claim, None)  # type: ignore[arg-type]


async def test_a_result_whose_numbering_waits_on_an_append_survives_a_cancel(redis: Redis, queue: WorkerQueue) -> None:
    # The worker's second signal cancels a job just as it finishes, while an append (retrying
    # through a Redis blip) holds the events lock the result's seq is taken under. The result
    # must still be written: a cancel there used to leave the job to recovery, ended `lost`.
    claim = await _claimed(redis, queue)
    run = _job_run(queue, claim)
    await run.events._lock.acquire()  # the append in flight
    finishing = asyncio.create_task(run._finish(Outcome.COMPLETED, result_without_run(Outcome.COMPLETED, None)))
    await asyncio.sleep(0.05)
    finishing.cancel()
    asyncio.get_running_loop().call_later(0.1, run.events._lock.release)  # the append lands
    with pytest.raises(asyncio.CancelledError):
        await finishing
    status = await redis.hgetall(keys.status_key(claim.spec.job_id))
    assert status[b"state"] == b"done" and json.loads(status[b"result"])["outcome"] == "completed", status


async def test_an_interpreted_batch_started_as_its_worker_stops_goes_back_to_the_queue_whole(
    redis: Redis, queue: WorkerQueue
) -> None:
    # Its start came, then the worker's SIGTERM while it said `starting`. A compiled job
    # in that spot goes back to the queue (the grace may not hold its program); a batch of
    # Python cases began its cases all the same, and the grace's end cut them off: the job
    # ended `killed` by a stop its client had nothing to do with.
    spec = msgspec.structs.replace(_spec(), tests=[TestCase(name="a"), TestCase(name="b")])
    assert (await JobStore(redis, RECORD_TTL_S).enqueue(spec, 100, 100, RESULT_TTL_S)).outcome == "queued"
    claim = await queue.claim(1.0, 0.0)
    assert claim is not None and claim.spec.job_id == spec.job_id
    run = _job_run(queue, claim)
    stopping = asyncio.Event()
    run.ctx.stopping = stopping
    run.ctx.grace_ends_at = asyncio.get_running_loop().time() + 3600
    run.ctx.pool = SimpleNamespace(slots=1)
    run.ctx.flag_sweep = SimpleNamespace(add=lambda *_a, **_k: None, discard=lambda *_a: None)
    run.ctx.control = SimpleNamespace(generation=0, unsubscribe=lambda _sub: asyncio.sleep(0))
    run.sub = SimpleNamespace(ctrl=asyncio.Queue(), stdin=None, generation=0)  # type: ignore[assignment]
    plan = SimpleNamespace(compile=None, run=Program(argv=["python3", "main.py"], env={}), files=[])
    ran: list[str] = []

    async def nothing(*_args: Any, **_kwargs: Any) -> None:
        return None

    async def park(_ctrl: Any) -> str:
        stopping.set()  # (the SIGTERM comes right behind the start)
        return "start"

    async def acquire(*_args: Any, **_kwargs: Any) -> str:
        run.sandbox = object()  # type: ignore[assignment]
        return "start"

    async def run_batch(*_args: Any) -> None:
        ran.append("cases")

    run._manifest = lambda: None  # type: ignore[method-assign]
    run._plan = lambda _manifest, _blobs: plan  # type: ignore[method-assign,assignment,return-value]
    run._blobs = nothing  # type: ignore[method-assign,assignment]
    run._drop_spec_contents = lambda: None  # type: ignore[method-assign]
    run._park = park  # type: ignore[method-assign]
    run._acquire_sandbox = acquire  # type: ignore[method-assign]
    run._load = nothing  # type: ignore[method-assign]
    run._destroy = nothing  # type: ignore[method-assign]
    run._run_batch = run_batch  # type: ignore[method-assign]
    await run.execute()
    assert ran == []
    status = await redis.hgetall(keys.status_key(spec.job_id))
    assert status[b"state"] == b"queued" and b"result" not in status and status.get(b"started") is None
    assert await redis.lrange(keys.QUEUE, 0, -1) == [spec.job_id.encode()]


async def test_a_kill_that_comes_while_a_failing_worker_says_starting_ends_the_job_killed(
    redis: Redis, queue: WorkerQueue
) -> None:
    # A started job waits for a sandbox on a worker whose builds all fail. The kill came
    # while its `starting` was being written; the wait then saw the failing builds and gave
    # up as "broken", dropping the kill: the job could end internal_error, not killed.
    claim = await _claimed(redis, queue)
    run = _job_run(queue, claim)
    ctrl: asyncio.Queue[CtrlMessage] = asyncio.Queue()
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    run.ctx.stopping = asyncio.Event()
    run.ctx.pool = SimpleNamespace(
        take_ready=lambda *_a: None, take=lambda *_a: never, build_mark=lambda: 0, failing=lambda _mark: True,
        put_back=lambda _sandbox: None,
    )  # fmt: skip

    async def starting(*_args: Any, **_kwargs: Any) -> None:
        ctrl.put_nowait(CtrlMessage(type="kill"))
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    run.events.state = starting  # type: ignore[method-assign]
    run.events.go_live_within = lambda _s: None  # type: ignore[method-assign]
    signal = await asyncio.wait_for(run._acquire_sandbox(ctrl, Program(argv=["main"], env={}), quiet_s=0.0), 5)
    assert signal == "kill"


async def test_a_compile_the_sandbox_failed_ends_internal_error_not_compile_error(redis: Redis, queue: WorkerQueue) -> None:
    # A grader reads compile_error as the submission's fault; a jail that failed under the
    # compiler is the platform's, and the job is safe to submit again.
    claim = await _claimed(redis, queue)
    lane = _Lane()
    run = _job_run(queue, claim, lane)
    failed = StepFacts(
        exit=JailExit(None, None, False, ["nsjail: clone failed"]), fired=None, duration_ms=3, cpu_ms=0, memory_kb=0, oom_kills=0
    )
    compiled = CompileInfo(exit_code=None, signal=None, timed_out=False, duration_ms=3, output="")
    await run._finish_compile_failure(failed, compiled)
    result = json.loads((await redis.hget(keys.status_key(claim.spec.job_id), "result")) or b"{}")
    assert result["outcome"] == "internal_error", result
    assert result["message"] == "sandbox failure while compiling: nsjail: clone failed"
    assert result["compile"]["exitCode"] is None
    assert [name for name, _ in lane.sent].count("result") == 1 and lane.sent[-1][0] == "result"


async def test_a_compile_gets_an_idle_clock_only_where_its_manifest_sets_one(redis: Redis, queue: WorkerQueue) -> None:
    # Compilers work in silence: the default idle window (20 s) under a manifest's 30 s wall
    # would end a long javac or rustc as if it hung.
    from shared.limits import RequestedLimits
    from shared.paths import REPO_ROOT
    from worker.runtimes import load_manifests

    run = _job_run(queue, await _claimed(redis, queue))
    run.ctx.settings = SimpleNamespace(max_files_bytes=1 << 20)
    run.ctx.sandboxes = SimpleNamespace(program_rlimits=lambda *_a, **_k: {})
    java = next(m for m in load_manifests(REPO_ROOT / "sandbox-profiles") if m.language == "java")
    assert java.compile is not None and java.compile.limits.idle_ms is None and java.compile.limits.wall_time_ms == 30000
    said = msgspec.structs.replace(
        java, compile=msgspec.structs.replace(java.compile, limits=RequestedLimits(wall_time_ms=30000, idle_ms=5000))
    )
    for manifest, idle_ms in [(java, 30000), (said, 5000)]:
        plan = run._plan(manifest, {})
        assert plan.compile_limits is not None and plan.compile_limits.idle_ms == idle_ms


@pytest.mark.parametrize("go_live_ends", [True, False], ids=["go-live-lands", "go-live-hangs"])
async def test_a_result_stored_before_a_cancel_still_goes_out_live(
    redis: Redis, queue: WorkerQueue, monkeypatch: pytest.MonkeyPatch, go_live_ends: bool
) -> None:
    # The worker's second signal cancels a job whose result is stored while its parked
    # events are going live (a read of its log). The result used to stay unpublished: the
    # log and SSE had it, a live follower waited for ever.
    monkeypatch.setattr("worker.job.run.FINISH_ON_CANCEL_S", 0.3)
    claim = await _claimed(redis, queue)
    lane = _Lane()
    run = _job_run(queue, claim, lane)
    reading, release = asyncio.Event(), asyncio.Event()

    async def slow_go_live() -> None:
        reading.set()
        await release.wait()
        lane.send("stage", b"{}")  # what the log held before the result

    run.events.go_live = slow_go_live  # type: ignore[method-assign]
    finishing = asyncio.create_task(run._finish(Outcome.EXPIRED, result_without_run(Outcome.EXPIRED, None)))
    await asyncio.wait_for(reading.wait(), 5)
    finishing.cancel()
    if go_live_ends:
        asyncio.get_running_loop().call_later(0.05, release.set)
    with pytest.raises(asyncio.CancelledError):
        await finishing
    assert [name for name, _ in lane.sent] == (["stage", "result"] if go_live_ends else ["result"])
    assert await redis.hget(keys.status_key(claim.spec.job_id), "state") == b"expired"


async def test_a_worker_stopping_after_the_program_ended_reports_the_run_as_it_ended(
    redis: Redis, queue: WorkerQueue
) -> None:
    # The program exited by itself; the hard stop came while its last output or artifacts
    # were being stored. The verdict is the run's own, not `killed` by the shutdown.
    claim = await _claimed(redis, queue)
    run = _job_run(queue, claim)
    run._program_started = True
    exit_ = JailExit(exit_code=3, signal=None, backstop_fired=False)
    run._ran = (StepFacts(exit=exit_, fired=None, duration_ms=12, cpu_ms=5, memory_kb=2048, oom_kills=0), None)
    await run._cancelled()
    status = await redis.hgetall(keys.status_key(claim.spec.job_id))
    result = json.loads(status[b"result"])
    assert status[b"state"] == b"done" and result["outcome"] == "completed" and result["exitCode"] == 3, result


@pytest.mark.parametrize("ending", ["failure", "shutdown", "failure-plain"])
async def test_a_run_cut_short_reports_what_is_known_of_it(redis: Redis, queue: WorkerQueue, ending: str) -> None:
    # A worker failure, or a shutdown past the grace period, ends a program that had run for
    # a while, compiled, and had its output cut: the result says so rather than zeros. Its
    # time is the run's, not the teardown's that follows, and (review) leaves out a plain
    # jail's runtime start-up as a run's durationMs does.
    claim = await _claimed(redis, queue)
    run = _job_run(queue, claim)
    start_up_s = 0.0
    if ending == "failure-plain":
        ending, start_up_s = "failure", 0.3
        run.sandbox = SimpleNamespace(uncharged=Uncharged(wall_ms=300), jail=_stand_in_jail())  # type: ignore[assignment]
    run._compiled = CompileInfo(exit_code=0, signal=None, timed_out=False, duration_ms=40, output="ok\n")
    run._program_started = True
    run._program_started_at = asyncio.get_running_loop().time() - 0.4 - start_up_s
    run.budget.feed("stdout", b"x" * (claim.spec.limits.output_kb * 1024 + 1))

    async def slow_teardown() -> None:
        await asyncio.sleep(0.6)

    run._destroy = slow_teardown  # type: ignore[method-assign]
    if ending == "failure":
        await run._abort("internal error in the worker")
    else:
        await run._cancelled()
    result = json.loads(await redis.hget(keys.status_key(claim.spec.job_id), "result"))
    # Not internal_error (SPEC: "before user code ran", so safe to submit again): lost.
    assert result["outcome"] == ("lost" if ending == "failure" else "killed"), result
    assert result["truncated"] is True and 400 <= result["durationMs"] < (650 if start_up_s else 900), result
    assert result["compile"] == {"exitCode": 0, "signal": None, "timedOut": False, "durationMs": 40, "output": "ok\n"}


async def _collecting_run_on_a_stand_in_jail(redis: Redis, queue: WorkerQueue) -> tuple[Any, JobRun]:
    """A claimed collectOutput job's run, with a sandbox whose jail is only a name: for
    tests that put their own `supervise` in place and drive `_run` with it."""
    spec = msgspec.structs.replace(_spec(), collect_output=True)
    assert (await JobStore(redis, RECORD_TTL_S).enqueue(spec, 100, 100, RESULT_TTL_S)).outcome == "queued"
    claim = await queue.claim(1.0, 0.0)
    run = _job_run(queue, claim)
    run.ctx.sandboxes = SimpleNamespace(memory=None)  # type: ignore[attr-defined]
    run.sandbox = SimpleNamespace(jail=_stand_in_jail(), cgroup=None, uncharged=Uncharged())  # type: ignore[assignment]
    return claim, run


def _stand_in_jail() -> SimpleNamespace:
    """A jail that is only a name; `let_go` counts its calls in `let_gone`."""
    jail = SimpleNamespace(stdout=None, stderr=None, proc=SimpleNamespace(stdin=None), let_gone=0)

    def let_go() -> None:
        jail.let_gone += 1

    jail.let_go = let_go
    return jail


async def test_a_run_cut_short_stores_only_the_output_its_log_has(
    redis: Redis, queue: WorkerQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker's stop cancels a run while an append is in flight (Redis slow) and more
    # output waits behind it: the stored result (the budget's bytes) held text that the log
    # and the live view never did, as the waiting text was dropped.
    claim, run = await _collecting_run_on_a_stand_in_jail(redis, queue)
    hanging = asyncio.Event()

    async def supervise(jail: Any, cgroup: Any, program: Any, clocks: Any, pumps: Any, inbox: Any, on_go: Any, **_: Any) -> Any:
        on_go(asyncio.get_running_loop().time())  # (the program runs)
        on_stdout = pumps[0][1]
        await on_stdout(b"logged\n")
        await asyncio.sleep(0.1)
        await run.events._lock.acquire()  # an append in flight, answered in 0.2 s
        asyncio.get_running_loop().call_later(0.2, run.events._lock.release)
        await on_stdout(b"waiting behind it\n")
        hanging.set()
        await asyncio.Event().wait()

    monkeypatch.setattr("worker.job.run.supervise", supervise)
    running = asyncio.create_task(run._run(asyncio.Queue(), asyncio.Queue(), None))  # type: ignore[arg-type]
    await asyncio.wait_for(hanging.wait(), 5)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    await run._cancelled()
    job = claim.spec.job_id
    logged = b"".join(f[b"chunk"] for _, f in await redis.xrange(keys.events_key(job)) if f[b"name"] == b"stdout")
    assert await redis.get(keys.output_stream_key(job, "stdout")) == logged == b"logged\nwaiting behind it\n"
    assert await redis.hget(keys.status_key(job), "state") == b"killed"


async def test_a_stop_during_a_finished_runs_last_flush_keeps_its_verdict(
    redis: Redis, queue: WorkerQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The program exited by itself (code 3); the stop's cancel came while its last output
    # was being flushed, and that flush went through: its verdict is its own, not `killed`.
    claim, run = await _collecting_run_on_a_stand_in_jail(redis, queue)
    exit_ = JailExit(exit_code=3, signal=None, backstop_fired=False)

    async def supervise(jail: Any, cgroup: Any, program: Any, clocks: Any, pumps: Any, inbox: Any, **_: Any) -> Any:
        await run.events._lock.acquire()  # the last append will be in flight for 0.3 s
        asyncio.get_running_loop().call_later(0.3, run.events._lock.release)
        await pumps[0][1](b"last words\n")
        return StepFacts(exit=exit_, fired=None, duration_ms=12, cpu_ms=5, memory_kb=2048, oom_kills=0)

    monkeypatch.setattr("worker.job.run.supervise", supervise)
    running = asyncio.create_task(run._run(asyncio.Queue(), asyncio.Queue(), None))  # type: ignore[arg-type]
    await asyncio.sleep(0.1)  # supervise has returned; the flush waits on the append
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    await run._cancelled()
    job = claim.spec.job_id
    result = json.loads(await redis.hget(keys.status_key(job), "result"))
    assert (result["outcome"], result["exitCode"]) == ("completed", 3), result
    assert await redis.get(keys.output_stream_key(job, "stdout")) == b"last words\n"


async def test_a_runs_gate_is_let_go_as_its_result_is_written(redis: Redis, queue: WorkerQueue) -> None:
    # The jail's teardown waits for let_go (gate.c, linger): it comes as the result goes out,
    # its figures read, so it takes no CPU from them, nor waits for the write's answer.
    claim, run = await _collecting_run_on_a_stand_in_jail(redis, queue)
    jail = run.sandbox.jail  # type: ignore[union-attr]
    finish = queue.finish
    let_gone_at_write: list[int] = []

    async def finishing(*args: Any, **kwargs: Any) -> Any:
        let_gone_at_write.append(jail.let_gone)
        return await finish(*args, **kwargs)

    queue.finish = finishing  # type: ignore[method-assign]
    run._program_started = True
    exit_ = JailExit(exit_code=0, signal=None, backstop_fired=False)
    await run._finish_run(StepFacts(exit=exit_, fired=None, duration_ms=12, cpu_ms=5, memory_kb=2048, oom_kills=0), None)
    assert let_gone_at_write == [1] and jail.let_gone == 1
    result = json.loads(await redis.hget(keys.status_key(claim.spec.job_id), "result"))
    assert (result["outcome"], result["exitCode"]) == ("completed", 0), result


@pytest.mark.parametrize("step", ["ends", "breaks"])
async def test_a_compiles_gate_is_let_go_as_its_step_ends(
    redis: Redis, queue: WorkerQueue, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    # A compile jail's gate waits after its report (gate.c, linger) until it is let go: that
    # comes as the step ends, whatever ended it, before the compiler's last output is flushed,
    # not at the sandbox's destroy after the run.
    _, run = await _collecting_run_on_a_stand_in_jail(redis, queue)
    compile_jail = _stand_in_jail()
    run.sandbox.compile_jail, run.sandbox.compile_cgroup = compile_jail, SimpleNamespace()  # type: ignore[union-attr]
    let_gone_at_appends: list[int] = []
    chunk_runs = run.events.chunk_runs

    async def appending(runs: list[tuple[str, str]]) -> None:
        let_gone_at_appends.append(compile_jail.let_gone)
        await chunk_runs(runs)

    run.events.chunk_runs = appending  # type: ignore[method-assign]

    async def supervise(jail: Any, cgroup: Any, program: Any, clocks: Any, pumps: Any, inbox: Any, **_: Any) -> Any:
        assert jail is compile_jail
        # A character cut in two by the pipe: its first byte waits for the step's end.
        await pumps[1][1](b"main.c:1: warning: caf\xc3")
        if step == "breaks":
            raise OSError("the jail broke")
        return StepFacts(JailExit(exit_code=0, signal=None, backstop_fired=False), None, 5, 5, 1024, 0)

    monkeypatch.setattr("worker.job.run.supervise", supervise)
    limits = Limits(
        wall_time_ms=10000, idle_ms=5000, cpu_ms=10000, memory_mb=256, pids=64, output_kb=64,
        max_artifacts=0, max_artifact_bytes=0,
    )  # fmt: skip
    plan = Plan(
        files=[], run=Program(argv=["./main"], env={}), manifest=None, entry="main.c", sources=["main.c"],  # type: ignore[arg-type]
        compile=Program(argv=["cc", "main.c"], env={}), compile_limits=limits,
    )  # fmt: skip
    if step == "breaks":
        with pytest.raises(OSError, match="the jail broke"):
            await run._compile(asyncio.Queue(), plan)
    else:
        _, compiled = await run._compile(asyncio.Queue(), plan)
        assert compiled.output == "main.c:1: warning: caf\ufffd"
        assert let_gone_at_appends and let_gone_at_appends[-1] == 1, let_gone_at_appends  # (the last flush's)
    assert compile_jail.let_gone == 1


@pytest.mark.parametrize("failure", ["sandbox", "after the run"])
async def test_a_failure_once_the_program_ran_is_never_internal_error(
    redis: Redis, queue: WorkerQueue, failure: str
) -> None:
    # SPEC: internal_error says nothing of the program ran (safe to submit again). A sandbox
    # that failed under a running program ends the job lost; a failure after a program that
    # exited by itself (its artifacts, say) leaves the run's own verdict.
    claim = await _claimed(redis, queue)
    run = _job_run(queue, claim)
    run._program_started = True
    if failure == "sandbox":
        exit_ = JailExit(exit_code=None, signal=None, backstop_fired=False, errors=["nsjail exited with 255"])
        await run._finish_run(StepFacts(exit=exit_, fired=None, duration_ms=12, cpu_ms=5, memory_kb=2048, oom_kills=0), None)
    else:
        exit_ = JailExit(exit_code=3, signal=None, backstop_fired=False)
        run._ran = (StepFacts(exit=exit_, fired=None, duration_ms=12, cpu_ms=5, memory_kb=2048, oom_kills=0), None)
        await run._abort("internal error in the worker")
    result = json.loads(await redis.hget(keys.status_key(claim.spec.job_id), "result"))
    if failure == "sandbox":
        assert (result["outcome"], result["message"]) == ("lost", "sandbox failure: nsjail exited with 255"), result
    else:
        assert (result["outcome"], result["exitCode"]) == ("completed", 3), result


@pytest.mark.parametrize("where", ["before the go", "a batch under way"])
async def test_a_failure_between_the_running_mark_and_the_go_is_internal_error(
    redis: Redis, queue: WorkerQueue, where: str
) -> None:
    # Marked running (never handed back from there), then a failure before the program's go
    # (the mark's append given up in an outage, a cgroup read that failed): nothing of the
    # user's ran, so the job is safe to submit again, as a stop at that point is judged
    # (review: it ended `lost`). A batch whose cases had begun is lost.
    claim = await _claimed(redis, queue)
    run = _job_run(queue, claim)
    await run._mark_running()
    if where == "a batch under way":
        run._batch = BatchProgress([TestCase()], asyncio.get_running_loop().time())
    await run._abort("internal error in the worker")
    status = await redis.hgetall(keys.status_key(claim.spec.job_id))
    assert status[b"started"] == b"1"
    result = json.loads(status[b"result"])
    assert result["outcome"] == ("internal_error" if where == "before the go" else "lost"), result


async def test_a_job_whose_count_fell_behind_its_log_numbers_its_result_after_it(
    redis: Redis, queue: WorkerQueue
) -> None:
    claim = await _claimed(redis, queue)
    lane = _Lane()
    run = _job_run(queue, claim, lane)
    await run.events.go_live()
    # An append that landed although its caller was cancelled before the answer came.
    await queue.advance(claim.spec.job_id, claim.attempt, [(1, "stdout", "chunk", b"landed\n")])
    await run._finish(Outcome.KILLED, result_without_run(Outcome.KILLED, "the worker shut down"))
    log = [(int(f[b"seq"]), f[b"name"]) for _, f in await redis.xrange(keys.events_key(claim.spec.job_id))]
    assert log == [(0, b"stage"), (1, b"stdout"), (2, b"result")]
    published = [(name, json.loads(data)["seq"]) for name, data in lane.sent]
    assert published == [("stage", 0), ("result", 2)]
    status = await redis.hgetall(keys.status_key(claim.spec.job_id))
    assert status[b"state"] == b"killed" and json.loads(status[b"result"])["seq"] == 2


async def test_a_batch_that_loses_its_lease_before_running_leaves_its_sandbox_to_the_teardown(
    redis: Redis, queue: WorkerQueue
) -> None:
    claim = await _claimed(redis, queue)
    run = _job_run(queue, msgspec.structs.replace(claim, spec=msgspec.structs.replace(claim.spec, tests=[TestCase()])))
    sandbox = object()
    run.sandbox = sandbox  # type: ignore[assignment]
    await redis.hincrby(keys.status_key(claim.spec.job_id), "attempt", 1)  # another worker has it now
    plan = SimpleNamespace(compile=None, files=[])
    with pytest.raises(Fenced):
        await run._run_batch(asyncio.Queue(), plan, None)  # type: ignore[arg-type]
    # Still the job's to destroy (execute's finally does), not dropped on the floor.
    assert run.sandbox is sandbox and not run._destroyed


async def test_a_hand_back_that_redis_refuses_leaves_the_claim_for_recovery(
    redis: Redis, queue: WorkerQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = await _claimed(redis, queue)
    run = _job_run(queue, claim)

    async def unreachable(*_args: Any, **_kwargs: Any) -> bool:
        raise RedisConnectionError("Redis went away")

    monkeypatch.setattr(queue, "hand_back", unreachable)
    await run._end_unstarted("handback")  # a stopping worker's parked job
    # Not ended for it (no internal_error, start flag kept): still parked, still claimed by
    # this worker, where the stray-claim recovery finds it.
    status = await redis.hgetall(keys.status_key(claim.spec.job_id))
    assert status[b"state"] == b"parked" and b"result" not in status
    assert await redis.lrange(keys.worker_claimed_key(queue.worker_id), 0, -1) == [claim.spec.job_id.encode()]


@pytest.mark.parametrize("path", ["parked", "cancelled before its run"])
async def test_a_stopping_worker_that_redis_does_not_answer_leaves_its_unstarted_job_to_recovery(
    redis: Redis, queue: WorkerQueue, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    # Redis down or frozen at the stop (the worker's probe says so): no hand-back is tried
    # at all, where each used to wait out the client's retries, and the claim stays where
    # recovery finds it.
    claim = await _claimed(redis, queue)
    run = _job_run(queue, claim, redis_answers=False)
    tried: list[str] = []

    async def recorded(job_id: str, *_args: Any, **_kwargs: Any) -> bool:
        tried.append(job_id)
        return True

    monkeypatch.setattr(queue, "hand_back", recorded)
    if path == "parked":
        await run._end_unstarted("handback")
    else:
        await run._give_back_unstarted()
    assert tried == []
    status = await redis.hgetall(keys.status_key(claim.spec.job_id))
    assert status[b"state"] == b"parked" and b"result" not in status
    assert await redis.lrange(keys.worker_claimed_key(queue.worker_id), 0, -1) == [claim.spec.job_id.encode()]
    # Redis answering, the same paths hand it back as before.
    again = _job_run(queue, claim)
    if path == "parked":
        await again._end_unstarted("handback")
    else:
        await again._give_back_unstarted()
    assert tried == [claim.spec.job_id]


async def test_a_job_cancelled_while_its_result_is_retried_still_stores_and_publishes_it(
    redis: Redis, queue: WorkerQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    claim = await _claimed(redis, queue)
    lane = _Lane()
    run = _job_run(queue, claim, lane)
    await run.events.go_live()
    finish, failed = queue.finish, asyncio.Event()

    async def blip_once(*args: Any, **kwargs: Any) -> bool:
        if not failed.is_set():
            failed.set()
            raise RedisConnectionError("a blip")
        return await finish(*args, **kwargs)

    monkeypatch.setattr(queue, "finish", blip_once)
    task = asyncio.create_task(run._finish(Outcome.COMPLETED, result_without_run(Outcome.COMPLETED, None)))
    await asyncio.wait_for(failed.wait(), 5)  # now waiting to retry
    task.cancel()  # the worker's grace period is over
    with pytest.raises(asyncio.CancelledError):
        await task
    status = await redis.hgetall(keys.status_key(claim.spec.job_id))
    assert status[b"state"] == b"done" and json.loads(status[b"result"])["seq"] == 1
    assert [name for name, _ in lane.sent] == ["stage", "result"]


async def test_under_a_hard_stop_a_result_whose_answer_is_late_is_still_published(
    redis: Redis, queue: WorkerQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Told twice to stop, the worker gives a write 2 s and does not retry; a write that
    # landed but whose answer came late must not be taken for a failed one.
    claim = await _claimed(redis, queue)
    lane = _Lane()
    run = _job_run(queue, claim, lane, hard_stop=True)
    await run.events.go_live()
    finish = queue.finish

    async def late_answer(*args: Any, **kwargs: Any) -> bool:
        written = await finish(*args, **kwargs)
        await asyncio.sleep(3)  # the answer is lost on the way
        return written

    monkeypatch.setattr(queue, "finish", late_answer)
    await run._finish(Outcome.COMPLETED, result_without_run(Outcome.COMPLETED, None))
    assert (await redis.hget(keys.status_key(claim.spec.job_id), "state")) == b"done"
    assert [name for name, _ in lane.sent] == ["stage", "result"]


async def test_finish_says_whether_someone_follows_the_job(redis: Redis, queue: WorkerQueue) -> None:
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    await redis.set(keys.audience_key(job), "1", ex=60)  # a subscription was signed
    written = await queue.finish(job, claim.attempt, JobState.DONE, 1, b'{"seq":1}', None)
    assert written is not None and written.heard
    other = await _claimed(redis, queue)  # nobody subscribed to this one
    written = await queue.finish(other.spec.job_id, other.attempt, JobState.DONE, 1, b'{"seq":1}', None)
    assert written is not None and not written.heard


async def test_a_result_its_write_published_is_published_once_and_not_owed(redis: Redis, queue: WorkerQueue) -> None:
    # The lane was idle: the result's write PUBLISHes it. Heard by a soketi node, it is not
    # put on the worker's unpublished set (nothing is left to publish it again), and a
    # re-run of the write (its reply lost) publishes nothing more and says it went.
    followed, nobody_listens, unfollowed = [await _claimed(redis, queue) for _ in range(3)]
    for claim in (followed, nobody_listens):
        await redis.set(keys.audience_key(claim.spec.job_id), "1", ex=60)
    listener = redis.pubsub()
    await listener.subscribe("adapter")
    await listener.get_message(timeout=1.0)

    async def heard() -> list[bytes]:
        out = []
        while (message := await listener.get_message(timeout=0.2)) is not None:
            out.append(message["data"])
        return out

    unpublished = keys.worker_unpublished_key(queue.worker_id)
    publish = LivePublish("adapter", only_if_followed=True, logged=[], messages=[b"the result"])
    result = b'{"seq":1,"outcome":"completed"}'
    written = await queue.finish(followed.spec.job_id, followed.attempt, JobState.DONE, 1, result, None, publish=publish)
    assert written is not None and written.heard and written.published
    assert await heard() == [b"the result"]
    assert not await redis.exists(unpublished)
    after_one = await snapshot(redis)
    assert await queue._finish.again() == [3, 1]  # type: ignore[attr-defined]
    assert_same_state(after_one, await snapshot(redis))
    assert await heard() == []
    # Not followed: nothing is published (and nothing owed).
    written = await queue.finish(unfollowed.spec.job_id, unfollowed.attempt, JobState.DONE, 1, result, None, publish=publish)
    assert written is not None and not written.heard and not written.published
    assert await heard() == [] and not await redis.exists(unpublished)
    # Followed, but no soketi node listens: owed, as a result published by the lane is.
    await listener.unsubscribe("adapter")
    assert (await listener.get_message(timeout=1.0) or {}).get("type") == "unsubscribe"
    await listener.aclose()
    job = nobody_listens.spec.job_id
    written = await queue.finish(job, nobody_listens.attempt, JobState.DONE, 1, result, None, publish=publish)
    assert written is not None and written.heard and not written.published
    assert await redis.smembers(unpublished) == {job.encode()}
    assert await queue._finish.again() == [3, 0]  # type: ignore[attr-defined]
    assert await queue.stored_result(job) == (result, False)
    assert await queue.stored_result(followed.spec.job_id) == (result, True)


async def test_a_followed_jobs_result_is_owed_live_until_its_worker_says_it_went(redis: Redis, queue: WorkerQueue) -> None:
    # Stored, a followed job's result is on the worker's unpublished set (a grader's is not);
    # a heartbeat after delivered() takes it off; a reaper of a worker that died before that
    # takes the rest, each as its result event, and leaves nothing behind.
    followed, unfollowed, owed = [await _claimed(redis, queue) for _ in range(3)]
    for claim in (followed, owed):
        await redis.set(keys.audience_key(claim.spec.job_id), "1", ex=60)
    for claim in (followed, unfollowed, owed):
        job = claim.spec.job_id
        assert await queue.finish(job, claim.attempt, JobState.DONE, 1, b'{"seq":1,"outcome":"completed"}', None)
    unpublished = keys.worker_unpublished_key(queue.worker_id)
    assert await redis.smembers(unpublished) == {followed.spec.job_id.encode(), owed.spec.job_id.encode()}
    queue.delivered(followed.spec.job_id)
    await queue.heartbeat(_info(), 60_000)
    assert await redis.smembers(unpublished) == {owed.spec.job_id.encode()}
    assert await queue.take_unpublished(queue.worker_id) == []  # (it holds its lease: alive)
    await redis.delete(keys.worker_alive_key(queue.worker_id))  # it died
    # A reaper's round that fails reading the logs leaves them on the set for the next one
    # (the set was emptied first: the result was lost with the round).
    real_pipeline = queue.redis.pipeline

    def blip(*_a: Any, **_k: Any) -> Any:
        raise RedisConnectionError("blip")

    queue.redis.pipeline = blip  # type: ignore[method-assign]
    with pytest.raises(RedisConnectionError):
        await queue.take_unpublished(queue.worker_id)
    queue.redis.pipeline = real_pipeline  # type: ignore[method-assign]
    assert await redis.smembers(unpublished) == {owed.spec.job_id.encode()}
    assert await queue.take_unpublished(queue.worker_id) == [(owed.spec.job_id, b'{"seq":1,"outcome":"completed"}')]
    assert queue.take_recovered() == [(owed.spec.job_id, b'{"seq":1,"outcome":"completed"}')]
    assert not await redis.exists(unpublished)
    # A worker that stops with a claim left stuck keeps its set (a reaper comes for it), but
    # not what its lanes delivered since its last beat (they would go out twice).
    stuck, delivered_last = [await _claimed(redis, queue) for _ in range(2)]
    await redis.set(keys.audience_key(delivered_last.spec.job_id), "1", ex=60)
    job = delivered_last.spec.job_id
    assert await queue.finish(job, delivered_last.attempt, JobState.DONE, 1, b'{"seq":1}', None)
    queue.delivered(job)
    await queue.unregister()
    assert stuck.spec.job_id.encode() in await redis.lrange(keys.worker_claimed_key(queue.worker_id), 0, -1)
    assert not await redis.sismember(unpublished, job)


async def test_finish_sent_twice_writes_one_result(redis: Redis, queue: WorkerQueue) -> None:
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    result = b'{"outcome":"completed","seq":1}'
    assert await queue.finish(job, claim.attempt, JobState.DONE, 1, result, b'{"x":1}', (b"out", b"err"), "owner-a", 10)
    after_one = await snapshot(redis)
    assert await queue._finish.again() == [1, 0]  # type: ignore[attr-defined]
    assert_same_state(after_one, await snapshot(redis))
    names = [f[b"name"] for _, f in await redis.xrange(keys.events_key(job))]
    assert names.count(b"result") == 1
    assert await redis.xlen(keys.done_key(job)) == 1  # what a waiting /output wakes on
    assert int(await redis.hget(keys.retained_sizes_key("owner-a"), "_total")) == 10
    assert await redis.hget(keys.status_key(job), "outcome") == b"completed"  # (what receipts read)


async def test_a_finished_jobs_short_log_and_done_stream_are_compacted_for_their_readers(
    redis: Redis, queue: WorkerQueue, redis_stack: Any
) -> None:
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    log_key, done_key = keys.events_key(job), keys.done_key(job)
    await queue.advance(job, claim.attempt, [(1, "stage", "data", b'{"phase":"running","seq":1}')], started=True)
    await queue.advance(job, claim.attempt, [(2, "stdout", "chunk", b"1\n")])
    assert await redis.memory_usage(log_key) >= UNCOMPACTED_BYTES  # (control: the slack is there)
    await redis.xadd(keys.stdin_key(job), {"n": 1, "kind": "data", "data": "x"})  # (as the API's stdin script)
    before = await redis.xrange(log_key)
    last_id = before[-1][0]
    # Readers blocked on both streams, as a waiting GET /output and a live event stream are.
    readers = [Redis.from_url(redis_stack.redis_url) for _ in range(2)]
    try:
        woke_done = asyncio.ensure_future(readers[0].xread({done_key: "0-0"}, count=1, block=5000))
        woke_log = asyncio.ensure_future(readers[1].xread({log_key: last_id}, block=5000))
        async with asyncio.timeout(5):
            while int((await redis.info("clients"))["blocked_clients"]) < 2:
                await asyncio.sleep(0.01)
        result = b'{"outcome":"completed","seq":3}'
        assert await queue.finish(job, claim.attempt, JobState.DONE, 3, result, None)
        async with asyncio.timeout(5):
            done_entries, log_entries = await woke_done, await woke_log
    finally:
        for reader in readers:
            await reader.aclose()
    assert done_entries[0][1][0][1] == {b"result": b"1"}
    assert log_entries[0][1][0][1][b"data"] == result
    after = await redis.xrange(log_key)
    assert after[:-1] == before and after[-1][1][b"name"] == b"result"  # ids and entries kept
    info = await redis.xinfo_stream(log_key)
    assert info["last-generated-id"] == after[-1][0] and info["entries-added"] == 4
    for key in (log_key, done_key, keys.stdin_key(job)):
        assert await redis.memory_usage(key) < COMPACT_BYTES, key
        assert RESULT_TTL_S - 5 < await redis.ttl(key) <= RESULT_TTL_S


async def test_a_long_log_is_not_compacted_and_a_redis_that_refuses_dump_still_takes_the_result(
    redis: Redis, queue: WorkerQueue, redis_stack: Any
) -> None:
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    chunks = [(seq, "stdout", "chunk", b"x\n") for seq in range(1, COMPACT_MAX_ENTRIES + 1)]
    await queue.advance(job, claim.attempt, chunks, started=True)
    assert await queue.finish(job, claim.attempt, JobState.DONE, len(chunks) + 1, b'{"seq":%d}' % (len(chunks) + 1), None)
    assert await redis.xlen(keys.events_key(job)) == COMPACT_MAX_ENTRIES + 2
    assert await redis.memory_usage(keys.events_key(job)) >= UNCOMPACTED_BYTES  # left as it was
    assert await redis.memory_usage(keys.done_key(job)) < COMPACT_BYTES

    # A deployment whose ACL (or managed Redis) refuses DUMP and RESTORE: nothing is
    # compacted, and nothing else changes.
    password = uuid.uuid4().hex
    await redis.execute_command("ACL", "SETUSER", "nodump", "on", f">{password}", "~*", "&*", "+@all", "-dump", "-restore")
    limited = Redis.from_url(f"redis://nodump:{password}@" + redis_stack.redis_url.split("@")[1])
    try:
        with pytest.raises(ResponseError):
            await limited.dump(keys.events_key(job))  # (control: it is refused)
        other = await _claimed(redis, queue)
        plain = WorkerQueue(limited, queue.worker_id, RECORD_TTL_S, RESULT_TTL_S)
        assert await plain.finish(other.spec.job_id, other.attempt, JobState.DONE, 1, b'{"seq":1}', None)
    finally:
        await limited.aclose()
        await redis.execute_command("ACL", "DELUSER", "nodump")
    assert [f[b"name"] for _, f in await redis.xrange(keys.events_key(other.spec.job_id))] == [b"stage", b"result"]
    assert await redis.hget(keys.status_key(other.spec.job_id), "state") == b"done"
    for key in (keys.events_key(other.spec.job_id), keys.done_key(other.spec.job_id)):
        assert await redis.memory_usage(key) >= UNCOMPACTED_BYTES


async def test_a_stale_finish_leaves_the_newer_claim_listed(redis: Redis, queue: WorkerQueue) -> None:
    # This worker stalled past its lease: its parked job went back to the queue and it
    # claimed the job again. The old run's finish (its warm-up ran out) writes nothing, and
    # must not take the new claim out of the list, or nobody would reap the job should this
    # worker die now.
    old = await _claimed(redis, queue)
    job = old.spec.job_id
    assert await queue.hand_back(job, old.attempt, to_back=True)
    new = await queue.claim(1.0, 0.0)
    assert new is not None and new.spec.job_id == job and new.attempt > old.attempt
    assert not await queue.finish(job, old.attempt, JobState.EXPIRED, 1, b'{"seq":1}', None)
    assert await redis.lrange(keys.worker_claimed_key(queue.worker_id), 0, -1) == [job.encode()]
    assert await redis.hget(keys.status_key(job), "state") == b"parked"


async def test_a_start_after_the_last_look_of_an_expiring_park_is_refused_not_dropped(redis: Redis, queue: WorkerQueue) -> None:
    store = JobStore(redis, RECORD_TTL_S)
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    # The warm-up ran out and no start came: from the last look on, a start is `expired`
    # (a 409), not a 202 for a job the worker is ending.
    assert await queue.close_park(job, claim.attempt) == "expired"
    answer = await store.start(job, "")
    assert (answer.outcome, answer.state, answer.started) == ("ended", JobState.EXPIRED, False)
    assert not await redis.exists(keys.start_flag_key(job))
    # Handed back to the queue, the next claim is another attempt, which the mark does not
    # hold for. (Had its worker died instead, the reaper ends it expired: see below.)
    assert await queue.hand_back(job, claim.attempt)
    again = await queue.claim(1.0, 0.0)
    assert again is not None and again.spec.job_id == job
    assert (await store.start(job, "")).outcome == "started"
    # A start that came before the last look is seen there: the job runs.
    other = await _claimed(redis, queue)
    assert (await store.start(other.spec.job_id, "")).outcome == "started"
    assert await queue.close_park(other.spec.job_id, other.attempt) == "start"
    # A kill that came too wins, as at every look at the flags.
    await redis.hset(keys.status_key(other.spec.job_id), "kill", "1")
    assert await queue.close_park(other.spec.job_id, other.attempt) == "kill"


async def test_a_kill_after_the_last_look_of_an_expiring_park_is_answered_expired(redis: Redis, queue: WorkerQueue) -> None:
    # A kill there was answered 202 and its flag set, but the worker ends the job expired
    # (or, dead, the reaper does): a kill's proof is a `killed` result, which never came.
    store = JobStore(redis, RECORD_TTL_S)
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    assert await queue.close_park(job, claim.attempt) == "expired"
    answer = await store.kill(job, RESULT_TTL_S)
    assert answer.ended_state == "expired" and answer.result is None
    assert await redis.hget(keys.status_key(job), "kill") is None
    # A later claim (another attempt) is killed as any parked job.
    assert await queue.hand_back(job, claim.attempt)
    again = await queue.claim(1.0, 0.0)
    assert again is not None and again.spec.job_id == job
    assert (await store.kill(job, RESULT_TTL_S)).ended_state is None
    assert await redis.hget(keys.status_key(job), "kill") == b"1"


@pytest.mark.parametrize("batch", [False, True])
async def test_a_job_whose_worker_died_as_its_warm_up_ran_out_ends_expired_not_requeued(
    redis: Redis, queue: WorkerQueue, batch: bool
) -> None:
    # Its claim took the last look at the start flag, so the API refuses a start as `expired`
    # from then on, and its worker died before it stored that. The reaper put it back in the
    # queue: the next claim, another attempt, lifted the refusal, and a client that tried its
    # start again after the 409 got a 202 and a run.
    store = JobStore(redis, RECORD_TTL_S)
    spec = msgspec.structs.replace(_spec(), tests=[TestCase(name="a"), TestCase()] if batch else [])
    assert (await store.enqueue(spec, 100, 100, RESULT_TTL_S)).outcome == "queued"
    claim = await queue.claim(1.0, 0.0)
    assert claim is not None and claim.spec.job_id == spec.job_id
    assert await queue.close_park(spec.job_id, claim.attempt) == "expired"
    reaper = WorkerQueue(redis, "w-reaper", RECORD_TTL_S, RESULT_TTL_S)
    ((job, raw),) = await reaper.reap_dead_workers([queue.worker_id])
    status = await redis.hgetall(keys.status_key(spec.job_id))
    assert job == spec.job_id and status[b"state"] == b"expired" and status[b"outcome"] == b"expired"
    assert await redis.lrange(keys.QUEUE, 0, -1) == []
    assert await redis.hget(keys.ENDED_COUNTS, "expired") == b"1" and not await redis.hexists(keys.ENDED_COUNTS, "lost")
    answer = await store.start(spec.job_id, "")
    assert (answer.outcome, answer.state) == ("ended", JobState.EXPIRED)
    names = [f[b"name"] for _, f in await redis.xrange(keys.events_key(spec.job_id))]
    assert names == [b"stage", b"result"]
    # The result its worker would have stored (another job, ended expired by the worker's path).
    twin = msgspec.structs.replace(spec, job_id=str(uuid.uuid4()))
    assert (await store.enqueue(twin, 100, 100, RESULT_TTL_S)).outcome == "queued"
    twin_claim = await queue.claim(1.0, 0.0)
    assert twin_claim is not None and twin_claim.spec.job_id == twin.job_id
    await _job_run(queue, twin_claim)._end_unstarted("expired")
    by_worker = json.loads(await redis.hget(keys.status_key(twin.job_id), "result"))
    assert by_worker["outcome"] == "expired" and json.loads(raw) == by_worker
    assert ("tests" in by_worker) is batch
    # The mark holds only for that claim: one handed back since is another attempt, and its
    # worker's death re-queues it as any unstarted job.
    other = await _claimed(redis, queue)
    assert await queue.close_park(other.spec.job_id, other.attempt) == "expired"
    assert await queue.hand_back(other.spec.job_id, other.attempt)
    again = await queue.claim(1.0, 0.0)
    assert again is not None and again.spec.job_id == other.spec.job_id
    assert await reaper.reap_dead_workers([queue.worker_id]) == []
    assert await redis.hget(keys.status_key(other.spec.job_id), "state") == b"queued"
    assert (await store.start(other.spec.job_id, "")).outcome == "started"


@pytest.mark.parametrize("back", ["handed back", "re-queued by a reaper"])
async def test_a_started_job_that_goes_back_to_the_queue_counts_again_as_unstarted(
    redis: Redis, queue: WorkerQueue, back: str
) -> None:
    # Marked starting, a job leaves its owner's count of unstarted jobs (and the bytes its
    # spec holds). Handed back before its program ran (its worker stopping mid-compile), or
    # re-queued from a dead worker, it waits in the queue with its input stored, but nothing
    # counted it again: a client could hold past MAX_PARKED_PER_PRINCIPAL and its byte bound.
    claim = await _claimed(redis, queue)
    job, owner = claim.spec.job_id, claim.spec.owner
    index, sizes = keys.unstarted_key(owner), keys.unstarted_sizes_key(owner)
    created = await redis.zscore(index, job)
    size = await redis.strlen(keys.spec_key(job))
    total = int(await redis.hget(sizes, "_total"))
    assert created is not None and size > 0 and total >= size
    await queue.advance(job, claim.attempt, [(1, "stage", "data", b'{"phase":"starting","seq":1}')], state=JobState.STARTING)
    assert await redis.zscore(index, job) is None and int(await redis.hget(sizes, "_total")) == total - size
    if back == "handed back":
        assert await queue.hand_back(job, claim.attempt)
    else:
        reaper = WorkerQueue(redis, "w-reaper", RECORD_TTL_S, RESULT_TTL_S)
        assert await reaper.reap_dead_workers([queue.worker_id]) == []
    assert await redis.hget(keys.status_key(job), "state") == b"queued"
    assert await redis.zscore(index, job) == created
    assert int(await redis.hget(sizes, job)) == size and int(await redis.hget(sizes, "_total")) == total
    assert await redis.ttl(index) > RECORD_TTL_S - 5 and await redis.ttl(sizes) > RECORD_TTL_S - 5
    # A parked job never left the count: going back does not count it twice.
    again = await queue.claim(1.0, 0.0)
    assert again is not None and again.spec.job_id == job
    assert await queue.hand_back(job, again.attempt)
    assert await redis.zcard(index) == 1 and int(await redis.hget(sizes, "_total")) == total


async def test_an_artifact_is_kept_only_for_the_claim_that_holds_the_job(redis: Redis, queue: WorkerQueue) -> None:
    store = RedisArtifactStore(redis)
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    await queue.advance(job, claim.attempt, [(1, "stage", "data", b'{"phase":"running","seq":1}')], state=JobState.RUNNING, started=True)
    assert await store.put(job, claim.attempt, 0, b'{"name":"a.png"}', b"png", 60)
    assert await redis.get(keys.artifact_data_key(job, 0)) == b"png"
    # Another claim holds it now (this worker stalled past its lease): nothing is attached.
    await redis.hincrby(keys.status_key(job), "attempt", 1)
    assert not await store.put(job, claim.attempt, 1, b'{"name":"b.png"}', b"png", 60)
    assert await redis.hkeys(keys.artifacts_key(job)) == [b"0"]  # (its bytes, unlisted, expire)


async def test_hand_back_sent_twice_queues_once(redis: Redis, queue: WorkerQueue) -> None:
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    assert await queue.hand_back(job, claim.attempt, to_back=True)
    after_one = await snapshot(redis)
    assert await queue._hand_back.again() == 0  # type: ignore[attr-defined]
    assert_same_state(after_one, await snapshot(redis))
    assert await redis.lrange(keys.QUEUE, 0, -1) == [job.encode()]
    assert await redis.hget(keys.status_key(job), "handovers") == b"1"


async def test_a_hand_back_keeps_how_far_the_jobs_log_was_published(redis: Redis, queue: WorkerQueue) -> None:
    # Its worker says how far it published (it went live at start, or never did); the record
    # keeps the furthest, and the next claim publishes only what comes after. A reap cannot
    # know what a dead worker published and leaves it as it was.
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    assert await queue.hand_back(job, claim.attempt, published_to=0)  # parked: nothing went out
    assert await redis.hget(keys.status_key(job), "liveSeq") in (None, b"0")
    claim = await queue.claim(1.0, 0.0)
    assert claim is not None and claim.live_seq == 0
    await queue.advance(job, claim.attempt, [(1, "stage", "data", b'{"phase":"compiling","seq":1}')], state=JobState.STARTING)
    assert await queue.hand_back(job, claim.attempt, published_to=2)  # live, stopped mid-compile
    for _ in range(2):
        claim = await queue.claim(1.0, 0.0)
        assert claim is not None and (claim.live_seq, claim.next_seq) == (2, 2)
        if _ == 0:
            assert await queue.hand_back(job, claim.attempt, published_to=0)  # parked again: kept
        else:
            assert await queue.recover_claims(queue.worker_id) == []  # re-queued by a reap: kept
        assert await redis.hget(keys.status_key(job), "state") == b"queued"
    assert await redis.hget(keys.status_key(job), "liveSeq") == b"2"


async def test_a_claim_gives_the_record_its_whole_life_again_after_a_long_wait_in_the_queue(
    redis: Redis, queue: WorkerQueue
) -> None:
    # JOB_RECORD_TTL is checked to outlast a warm-up and the longest run, counted from the
    # submit: a job that waited in a backed-up queue could lose its record mid-run and end
    # with no result at all (its finish fenced, its reap finding nothing).
    spec = _spec()
    assert (await JobStore(redis, RECORD_TTL_S).enqueue(spec, 100, 100, RESULT_TTL_S)).outcome == "queued"
    # Its stdin stream too: stdin sent before start would expire under the running job,
    # accepted (200) and never delivered.
    record = [keys.status_key(spec.job_id), keys.spec_key(spec.job_id), keys.callback_key(spec.job_id), keys.stdin_key(spec.job_id)]
    await redis.hset(record[2], "state", "pending")
    await redis.xadd(record[3], {"n": 0, "kind": "data", "data": b"42\n"})
    for key in record:
        await redis.expire(key, 5)  # (as if it had waited nearly its whole life)
    claim = await queue.claim(1.0, 0.0)
    assert claim is not None and claim.spec.job_id == spec.job_id
    assert [await redis.ttl(key) >= RECORD_TTL_S - 5 for key in record] == [True, True, True, True]


async def test_reap_sent_twice_recovers_once(redis: Redis, queue: WorkerQueue) -> None:
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    await queue.advance(job, claim.attempt, [(1, "stage", "data", b'{"phase":"running","seq":1}')], started=True)
    ended = await queue.recover_claims(queue.worker_id)
    assert [job_id for job_id, _ in ended] == [job]
    after_one = await snapshot(redis)
    # The same call again (its reply lost) answers as it did, so its result still goes out live.
    again = await queue._reap.again()  # type: ignore[attr-defined]
    assert again[0] == 2 and again[1] == 2 and bytes(again[2]) == ended[0][1]
    assert_same_state(after_one, await snapshot(redis))
    # Another recovery of the same claim (another call, another token) finds nothing to do.
    keys_, args = queue._reap.calls[-1]  # type: ignore[attr-defined]
    assert await queue._reap.script(keys=keys_, args=[*args[:7], "another"]) == 0  # type: ignore[attr-defined]
    names = [f[b"name"] for _, f in await redis.xrange(keys.events_key(job))]
    assert names.count(b"result") == 1
    assert await redis.xlen(keys.done_key(job)) == 1
    assert await redis.hget(keys.status_key(job), "outcome") == b"lost"
    for key in (keys.events_key(job), keys.done_key(job)):  # (compacted, as a finish's)
        assert await redis.memory_usage(key) < COMPACT_BYTES


async def test_a_reap_sent_again_after_its_worker_came_back_still_answers_that_it_ended_the_job(
    redis: Redis, queue: WorkerQueue
) -> None:
    # A dead worker's started job is ended lost, the reply is lost, and the worker renews its
    # lease before the client sends the script again. The second run answered "came back"
    # (3): the reaper stopped there and published nothing, and the worker's own finish was
    # fenced, so a follower never heard a result.
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    await queue.advance(job, claim.attempt, [(1, "stage", "data", b'{"phase":"running","seq":1}')], started=True)
    reaper = WorkerQueue(redis, "w-reaper", RECORD_TTL_S, RESULT_TTL_S)
    reaper._reap = Recorded(reaper._reap)  # type: ignore[method-assign]
    ended = await reaper.recover_claims(queue.worker_id, dead=True)
    assert [job_id for job_id, _ in ended] == [job]
    await redis.set(keys.worker_alive_key(queue.worker_id), "back")
    again = await reaper._reap.again()  # type: ignore[attr-defined]
    assert again[0] == 2 and bytes(again[2]) == ended[0][1], again
    names = [f[b"name"] for _, f in await redis.xrange(keys.events_key(job))]
    assert names.count(b"result") == 1


async def test_stdin_written_sent_twice_is_the_same_count_and_drops_the_written_frames(
    redis: Redis, queue: WorkerQueue
) -> None:
    claim = await _claimed(redis, queue)
    stream = keys.stdin_key(claim.spec.job_id)
    ids = [await redis.xadd(stream, {"n": n, "kind": "data", "data": "x" * 21}) for n in range(3)]
    await queue.stdin_written(claim.spec.job_id, claim.attempt, 42, ids[1].decode())
    after_one = await snapshot(redis)
    await queue._stdin_written.again()  # type: ignore[attr-defined]
    assert_same_state(after_one, await snapshot(redis))
    assert await redis.hget(keys.status_key(claim.spec.job_id), "stdinWritten") == b"42"
    # Frames before the last one written are gone; that one and the unwritten stay.
    assert [entry_id for entry_id, _ in await redis.xrange(stream)] == ids[1:]


async def test_a_stopping_worker_hands_back_claims_no_task_holds_and_leaves_the_rest_to_others(
    redis: Redis, queue: WorkerQueue
) -> None:
    # At shutdown a claim can outlive its task (a claim cut short by the stop, a hand-back
    # Redis refused). Upkeep has stopped by then, and unregistering used to drop the worker
    # from the list the others reap from: such a job stayed parked until its record expired.
    settings = load_settings({"REDIS_URL": "redis://unused", "PUSHER_SECRET": "x", "WORKER_PRESTART": "off"})
    worker = Worker(settings, queue.worker_id, SimpleNamespace(memory=MemoryAdmission(UNBOUNDED_BYTES)), {})  # type: ignore[arg-type]
    await queue.heartbeat(worker.info(), 60_000)
    orphan = await _claimed(redis, queue)  # claimed, and no task holds it
    held = await _claimed(redis, queue)  # its task would not end in time
    stuck = asyncio.create_task(asyncio.sleep(60))
    worker._jobs[stuck] = held.spec.job_id
    ctx = SimpleNamespace(queue=queue, publisher=SimpleNamespace(lane=lambda _channel: _Lane()), redis_answers=_answers)
    try:
        await worker._leave(ctx)  # type: ignore[arg-type]
    finally:
        stuck.cancel()
    assert await redis.hget(keys.status_key(orphan.spec.job_id), "state") == b"queued"
    assert await redis.lrange(keys.QUEUE, 0, -1) == [orphan.spec.job_id.encode()]
    assert await redis.lrange(keys.worker_claimed_key(queue.worker_id), 0, -1) == [held.spec.job_id.encode()]
    assert not await redis.exists(keys.worker_alive_key(queue.worker_id))
    assert await redis.hexists(keys.WORKERS, queue.worker_id)  # still listed: the others reap it
    other = WorkerQueue(redis, "w-other", RECORD_TTL_S, RESULT_TTL_S)
    assert await other.reap_dead_workers(await other.unleased(await other.listed_workers())) == []  # never started: re-queued, not lost
    assert await redis.hget(keys.status_key(held.spec.job_id), "state") == b"queued"
    assert not await redis.hexists(keys.WORKERS, queue.worker_id)

    # With nothing left claimed, leaving takes the worker off the list at once.
    await queue.heartbeat(worker.info(), 60_000)
    worker._jobs.clear()
    await worker._leave(ctx)  # type: ignore[arg-type]
    assert not await redis.hexists(keys.WORKERS, queue.worker_id)
    assert not await redis.exists(keys.worker_alive_key(queue.worker_id))


async def test_a_stopping_worker_that_redis_does_not_answer_writes_nothing_more(redis: Redis, queue: WorkerQueue) -> None:
    # Its probe found Redis down or frozen: leaving tries no write (each would wait out its
    # bound on retries), so the worker stays listed with its claim, for the others to reap.
    settings = load_settings({"REDIS_URL": "redis://unused", "PUSHER_SECRET": "x", "WORKER_PRESTART": "off"})
    worker = Worker(settings, queue.worker_id, SimpleNamespace(memory=MemoryAdmission(UNBOUNDED_BYTES)), {})  # type: ignore[arg-type]
    await queue.heartbeat(worker.info(), 60_000)
    orphan = await _claimed(redis, queue)

    async def away() -> bool:
        return False

    ctx = SimpleNamespace(queue=queue, publisher=SimpleNamespace(lane=lambda _channel: _Lane()), redis_answers=away)
    await worker._leave(ctx)  # type: ignore[arg-type]
    assert await redis.lrange(keys.worker_claimed_key(queue.worker_id), 0, -1) == [orphan.spec.job_id.encode()]
    assert await redis.exists(keys.worker_alive_key(queue.worker_id))
    assert await redis.hexists(keys.WORKERS, queue.worker_id)


async def test_a_stopping_worker_publishes_the_lost_results_it_recovers(redis: Redis, queue: WorkerQueue) -> None:
    # A started job whose result write failed under a hard stop: leaving ends it lost, and
    # its follower must still hear that result live.
    settings = load_settings({"REDIS_URL": "redis://unused", "PUSHER_SECRET": "x", "WORKER_PRESTART": "off"})
    worker = Worker(settings, queue.worker_id, SimpleNamespace(memory=MemoryAdmission(UNBOUNDED_BYTES)), {})  # type: ignore[arg-type]
    await queue.heartbeat(worker.info(), 60_000)
    started = await _claimed(redis, queue)
    job = started.spec.job_id
    await queue.advance(job, started.attempt, [(1, "stage", "data", b'{"phase":"running","seq":1}')], started=True)
    lanes: dict[str, _Lane] = {}
    ctx = SimpleNamespace(
        queue=queue,
        publisher=SimpleNamespace(lane=lambda channel: lanes.setdefault(channel, _Lane())),
        callback_due=lambda: None,
        redis_answers=_answers,
    )
    await worker._leave(ctx)  # type: ignore[arg-type]
    await asyncio.gather(*worker._background)
    assert await redis.hget(keys.status_key(job), "state") == b"lost"
    assert not await redis.exists(keys.spec_key(job))  # an ended job's input goes
    sent = lanes[keys.realtime_channel(job)].sent
    assert [(name, json.loads(data)["outcome"]) for name, data in sent] == [("result", "lost")]


async def test_one_worker_id_is_taken_by_one_of_two_workers_started_together(redis: Redis) -> None:
    first, second = (WorkerQueue(redis, "w-same", RECORD_TTL_S, RESULT_TTL_S) for _ in range(2))
    taken = await asyncio.gather(*(q.take_id(60_000) for q in (first, second, first, second)))
    # One of them has it; asking again, each gets the same answer (the lease is the winner's).
    assert taken[0] != taken[1] and taken[0:2] == taken[2:4], taken
    await redis.delete(keys.worker_alive_key("w-same"))  # gone (unregistered, or its lease ran out)
    assert await second.take_id(60_000)


async def test_a_worker_whose_id_taking_was_sent_again_has_its_id(redis: Redis) -> None:
    # The client sends a command again when the connection drops before the reply: the SET
    # that landed the first time then finds the key set, by this very worker (review: it
    # refused to start, WorkerIdInUse, and so did its restarts for a whole lease).
    queue = WorkerQueue(redis, "w-resent", RECORD_TTL_S, RESULT_TTL_S)
    await redis.set(keys.worker_alive_key("w-resent"), queue.incarnation, px=60_000)  # (the first send)
    assert await queue.take_id(60_000)
    assert not await WorkerQueue(redis, "w-resent", RECORD_TTL_S, RESULT_TTL_S).take_id(60_000)


def _info() -> WorkerInfo:
    return WorkerInfo(worker_id="w-twice", slots=1, runtimes=[], started_at_ms=0)


async def test_a_worker_taken_over_under_its_id_claims_and_renews_nothing_more(redis: Redis) -> None:
    # A process froze past its lease with an id just taken off the queue; a second process
    # under the same WORKER_ID took the id, recovered the claim and claimed the job again.
    # The first, thawed, used to claim the same job under the same attempt (both ran it),
    # and both then renewed one lease and recovered each other's claims as strays.
    first = WorkerQueue(redis, "w-twice", RECORD_TTL_S, RESULT_TTL_S)
    assert await first.take_id(60_000)
    assert (await JobStore(redis, RECORD_TTL_S).enqueue(_spec(), 100, 100, RESULT_TTL_S)).outcome == "queued"
    job = await first.take(1.0)
    assert job is not None
    await redis.delete(keys.worker_alive_key("w-twice"))  # the lease lapsed while it was frozen
    second = WorkerQueue(redis, "w-twice", RECORD_TTL_S, RESULT_TTL_S)
    assert await second.take_id(60_000)
    await second.recover_claims("w-twice")
    again = await second.claim(1.0, 0.0)
    assert again is not None and again.spec.job_id == job and again.attempt == 2
    assert await first.claim_taken(job, 0.0) is None  # thawed: not its claim any more
    with pytest.raises(WorkerSuperseded):
        await first.heartbeat(_info(), 60_000)
    await first.unregister()  # leaves the id, its listing and its claims to the second
    assert await redis.exists(keys.worker_alive_key("w-twice"))
    assert await second.claimed_ids("w-twice") == [job]
    await second.heartbeat(_info(), 60_000)
    status = await redis.hgetall(keys.status_key(job))
    assert status[b"attempt"] == b"2" and status[b"state"] == b"parked"
    # A lease that lapsed with nobody taking the id over is still the first's to renew.
    await redis.delete(keys.worker_alive_key("w-twice"))
    await second.heartbeat(_info(), 60_000)
    await second.unregister()
    assert not await redis.exists(keys.worker_alive_key("w-twice"))


async def test_a_worker_whose_heartbeat_finds_its_id_taken_over_stops_at_once_and_recovers_nothing(redis_stack: Any) -> None:
    settings = load_settings({"REDIS_URL": redis_stack.redis_url, "PUSHER_SECRET": "x", "WORKER_PRESTART": "off"})
    worker = Worker(settings, "w-twice", SimpleNamespace(memory=MemoryAdmission(UNBOUNDED_BYTES)), {})  # type: ignore[arg-type]

    async def superseded(*_args: Any) -> bytes:
        raise WorkerSuperseded("another process has taken over the worker id 'w-twice'")

    ctx = SimpleNamespace(queue=SimpleNamespace(heartbeat=superseded), stopping=asyncio.Event())
    worker.info = lambda: _info()  # type: ignore[method-assign]
    await asyncio.wait_for(worker._heartbeat(ctx), 3)  # type: ignore[arg-type]
    assert worker._superseded and ctx.stopping.is_set() and worker._hard_stop.is_set()
    # Its upkeep stops too: what it would take for its strays are the other's claims.
    await asyncio.wait_for(worker._upkeep(ctx), settings.worker_heartbeat_ms / 1000 + 3)  # type: ignore[arg-type]


async def test_a_worker_whose_start_fails_after_taking_its_id_gives_the_id_back(
    redis: Redis, redis_stack: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Between taking its id and its first heartbeat a worker recovers its own old claims
    # and sweeps its leftovers; when that fails, a restart under the same WORKER_ID must
    # not be refused for a whole lease as if a live worker held it.
    async def sweep_fails(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("the sweep failed")

    monkeypatch.setattr("worker.worker.sweep_orphans", sweep_fails)
    settings = load_settings({"REDIS_URL": redis_stack.redis_url, "PUSHER_SECRET": "x", "WORKER_PRESTART": "off"})
    sandboxes = SimpleNamespace(cgroups=None, work_root=None, memory=MemoryAdmission(UNBOUNDED_BYTES), remove_mount_points=lambda: None)
    worker = Worker(settings, "w-restarted", sandboxes, {})  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="the sweep failed"):
        await asyncio.wait_for(worker.run(), 10)
    assert not await redis.exists(keys.worker_alive_key("w-restarted"))
    assert not await redis.hexists(keys.WORKERS, "w-restarted")
    assert await WorkerQueue(redis, "w-restarted", RECORD_TTL_S, RESULT_TTL_S).take_id(60_000)


class _Counted:
    """Stands in for an async method of `owner`, counting its calls."""

    def __init__(self, owner: Any, name: str) -> None:
        self.calls = 0
        self._real = getattr(owner, name)
        setattr(owner, name, self)

    async def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return await self._real(*args)


async def _start_is_heard(redis: Redis, sub: Any, job_id: str) -> None:
    """A start published on the job's ctrl channel reaches `sub`."""
    assert await redis.publish(keys.ctrl_channel(job_id), b'{"type":"start"}') == 1
    assert (await asyncio.wait_for(sub.ctrl.get(), 3)).type == "start"


async def _claimed_run(redis: Redis, worker: Worker, ctx: Any, queue: WorkerQueue, started: bool = False) -> tuple[JobRun, Any]:
    """A job queued (and with `started`, started while still queued), then claimed as the
    worker's claimer does: its run and its subscription."""
    store = JobStore(redis, RECORD_TTL_S)
    spec = _spec()
    assert (await store.enqueue(spec, 100, 100, RESULT_TTL_S)).outcome == "queued"
    if started:
        assert (await store.start(spec.job_id, "owner-a")).outcome == "started"
    claimed = await worker._claim_one(ctx, queue)
    assert claimed is not None and claimed[1] is not None
    return JobRun(ctx, *claimed), claimed[1]


async def _replace_the_pubsub_connection(redis: Redis, ctx: Any) -> None:
    """Kill the worker's pub/sub connection; return once it has been replaced and the flag
    sweep at that replacement has come and gone."""
    seen = ctx.control.generation
    await redis.client_kill_filter(_type="pubsub")
    deadline = time.monotonic() + 3
    while ctx.control.generation == seen and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)


@pytest.fixture
async def claiming_worker(redis_stack: Any, queue: WorkerQueue) -> AsyncIterator[tuple[Worker, Any]]:
    """A Worker (no sandboxes) and the context its claims use: the queue, a real ControlBus."""
    settings = load_settings({"REDIS_URL": redis_stack.redis_url, "PUSHER_SECRET": "x", "WORKER_PRESTART": "off"})
    worker = Worker(settings, queue.worker_id, SimpleNamespace(memory=MemoryAdmission(UNBOUNDED_BYTES)), {})  # type: ignore[arg-type]
    bus_redis = LeanRedis.from_url(redis_stack.redis_url)
    control = ControlBus(bus_redis)
    await control.start()
    flag_sweep = FlagSweep(queue, control)
    sweeping = asyncio.create_task(flag_sweep.run())
    try:
        yield worker, SimpleNamespace(
            queue=queue,
            control=control,
            flag_sweep=flag_sweep,
            publisher=SimpleNamespace(lane=lambda _channel: _Lane()),
            settings=settings,
            stopping=asyncio.Event(),
        )
    finally:
        sweeping.cancel()
        await asyncio.gather(sweeping, return_exceptions=True)
        await control.aclose()
        await bus_redis.aclose()


async def test_a_start_landing_at_any_moment_of_a_claim_reaches_the_job(
    redis: Redis, queue: WorkerQueue, claiming_worker: tuple[Worker, Any]
) -> None:
    # The worker subscribes to a job's channels before its claim reads the stored flags, so
    # a start is either in the claim or published to the subscription, never in between
    # (the job reads no flags of its own on arrival).
    worker, ctx = claiming_worker
    store = JobStore(redis, RECORD_TTL_S)
    real = queue.claim_taken
    strays_seen: list[set[str]] = []

    async def claim_then(when: str, job_id: str, now: float) -> Any:
        strays_seen.append(await worker._strays(ctx))  # taken, in our list: not a stray
        if when == "before":
            assert (await store.start(job_id, "owner-a")).outcome == "started"
            assert (await store.stdin(job_id, b"early", False, 30, 65536)).frame == 0
        claim = await real(job_id, now)
        if when == "after":
            assert (await store.start(job_id, "owner-a")).outcome == "started"
        return claim

    for when in ("before", "after"):
        spec = _spec()
        assert (await store.enqueue(spec, 100, 100, RESULT_TTL_S)).outcome == "queued"
        queue.claim_taken = lambda job_id, now, when=when: claim_then(when, job_id, now)  # type: ignore[method-assign]
        claimed = await worker._claim_one(ctx, queue)
        assert claimed is not None
        claim, sub = claimed
        assert sub is not None and claim.spec.job_id == sub.job_id == spec.job_id
        assert spec.job_id not in strays_seen[-1]
        assert await redis.lrange(keys.worker_claimed_key(queue.worker_id), 0, 0) == [spec.job_id.encode()]
        if when == "before":
            assert claim.start_flag and claim.stdin_frames == 1
        else:
            assert not claim.start_flag and claim.stdin_frames == 0
            message = await asyncio.wait_for(sub.ctrl.get(), 5)
            assert message.type == "start"
        await ctx.control.unsubscribe(sub)


async def test_a_job_whose_subscription_failed_is_claimed_and_handed_back(
    redis: Redis, queue: WorkerQueue, claiming_worker: tuple[Worker, Any]
) -> None:
    worker, ctx = claiming_worker
    spec = _spec()
    assert (await JobStore(redis, RECORD_TTL_S).enqueue(spec, 100, 100, RESULT_TTL_S)).outcome == "queued"

    async def unconfirmed(job_id: str, timeout_s: float = 5.0) -> Any:
        raise TimeoutError

    ctx.control.subscribe = unconfirmed
    claimed = await worker._claim_one(ctx, queue)
    assert claimed is not None
    claim, sub = claimed
    assert sub is None and claim.attempt == 1
    await _job_run(queue, claim).execute()
    assert await redis.hget(keys.status_key(spec.job_id), "state") == b"queued"
    assert await redis.lrange(keys.QUEUE, 0, -1) == [spec.job_id.encode()]
    assert await redis.lrange(keys.worker_claimed_key(queue.worker_id), 0, -1) == []


async def test_a_claimed_id_that_vanished_leaves_no_subscription_behind(
    redis: Redis, queue: WorkerQueue, claiming_worker: tuple[Worker, Any]
) -> None:
    worker, ctx = claiming_worker
    await redis.lpush(keys.QUEUE, "no-such-job")
    assert await worker._claim_one(ctx, queue) is None
    assert ctx.control._subs == {}
    assert await redis.lrange(keys.worker_claimed_key(queue.worker_id), 0, -1) == []


async def test_a_started_jobs_lost_kill_is_found_by_the_sweep_and_its_start_flag_is_not_news(
    redis: Redis, redis_stack: Any, queue: WorkerQueue, claiming_worker: tuple[Worker, Any]
) -> None:
    # A started job's kill watch is an entry in the worker's flag sweep: no task, timer or
    # read of its own while the connection is healthy, its start flag (set: it started)
    # told to nobody, and a kill whose message was lost with the connection delivered.
    worker, ctx = claiming_worker
    run, sub = await _claimed_run(redis, worker, ctx, queue, started=True)
    swept = _Counted(queue, "flags_of")
    reads = _Counted(queue, "flags")  # a job's own
    ctrl: asyncio.Queue[Any] = asyncio.Queue()
    try:
        assert run._watch_kills(ctrl) is None and len(ctx.flag_sweep) == 1
        assert await ctx.flag_sweep.sweep() and swept.calls == 1
        assert ctrl.empty() and len(ctx.flag_sweep) == 1  # a start flag is no news to it
        await asyncio.sleep(1.0)
        assert reads.calls == 0 and ctrl.empty()
        # A kill whose message was lost: stored, never published; then the connection goes.
        await redis.hset(keys.status_key(run.job_id), "kill", "1")
        await redis.client_kill_filter(_type="pubsub")
        message = await asyncio.wait_for(ctrl.get(), 3)
        assert message.type == "kill" and swept.calls >= 2 and reads.calls == 0
        assert len(ctx.flag_sweep) == 0  # told once
    finally:
        ctx.flag_sweep.discard(run.job_id, ctrl)
        await ctx.control.unsubscribe(sub)

    # The connection replaced between the subscription and the watch: the sweep at that
    # replacement may have missed the job, so it reads its kill flag itself, once.
    run, sub = await _claimed_run(redis, worker, ctx, queue, started=True)
    await redis.hset(keys.status_key(run.job_id), "kill", "1")  # stored; its message lost
    await _replace_the_pubsub_connection(redis, ctx)
    ctrl = asyncio.Queue()
    try:
        reading = run._watch_kills(ctrl)
        assert reading is not None
        await asyncio.wait_for(reading, 3)
        message = await asyncio.wait_for(ctrl.get(), 1)
        assert message.type == "kill" and reads.calls == 1
    finally:
        ctx.flag_sweep.discard(run.job_id, ctrl)
        await ctx.control.unsubscribe(sub)


async def test_a_connection_watch_sees_each_replacement_once(
    redis: Redis, claiming_worker: tuple[Worker, Any]
) -> None:
    _worker, ctx = claiming_worker
    sub = await ctx.control.subscribe("watched")
    try:
        watch = ctx.control.watch(sub.generation)
        watch.look()  # whatever happened before the subscription was confirmed
        replacement = watch.look()
        assert replacement is not None
        await asyncio.sleep(0.3)
        assert not replacement.done() and watch.look() is replacement
        await redis.client_kill_filter(_type="pubsub")
        await asyncio.wait_for(asyncio.shield(replacement), 3)
        assert watch.look() is None and not watch.replaced()
        await _start_is_heard(redis, sub, "watched")  # subscribed again by then
        del watch, replacement  # (its look took a future for the next replacement)
        # Each watch waits on a future of its own (a shared one made every wait's end scan
        # the callbacks of all the others); the next replacement ends them all, and a
        # watch that is gone leaves nothing behind.
        others = len(ctx.control._waiting)  # (the worker's flag sweep watches too)
        watches = [ctx.control.watch(ctx.control.generation) for _ in range(100)]
        futures = [w.look() for w in watches]
        assert len({id(f) for f in futures}) == 100 and watches[0].look() is futures[0]
        del watches[50:], futures[50:]
        gc.collect()
        assert len(ctx.control._waiting) == others + 50
        await redis.client_kill_filter(_type="pubsub")
        await asyncio.wait_for(asyncio.gather(*(asyncio.shield(f) for f in futures)), 3)
        assert not any(f in ctx.control._waiting for f in futures) and all(w.look() is None for w in watches)
    finally:
        await ctx.control.unsubscribe(sub)


async def test_a_jobs_first_run_ending_late_leaves_its_second_claims_channels_alone(
    redis: Redis, claiming_worker: tuple[Worker, Any]
) -> None:
    # A job handed on (a worker without its runtime) can come straight back to this worker,
    # which subscribes for the new claim before the first run has finished unsubscribing.
    _worker, ctx = claiming_worker
    first = await ctx.control.subscribe("twice")
    second = await asyncio.wait_for(ctx.control.subscribe("twice"), 3)
    await ctx.control.unsubscribe(first)
    try:
        await _start_is_heard(redis, second, "twice")
    finally:
        await ctx.control.unsubscribe(second)
    assert ctx.control._subs == {}
    # (the UNSUBSCRIBE waits for a next SUBSCRIBE to go along with, or UNSUBSCRIBE_WITHIN_S)
    async with asyncio.timeout(UNSUBSCRIBE_WITHIN_S + 2):
        while (await redis.pubsub_numsub(keys.ctrl_channel("twice")))[0][1]:
            await asyncio.sleep(0.02)
    assert await redis.publish(keys.ctrl_channel("twice"), b'{"type":"start"}') == 0


async def test_nothing_is_taken_while_the_pubsub_connection_is_down(
    redis: Redis, queue: WorkerQueue, claiming_worker: tuple[Worker, Any]
) -> None:
    worker, ctx = claiming_worker
    spec = _spec()
    assert (await JobStore(redis, RECORD_TTL_S).enqueue(spec, 100, 100, RESULT_TTL_S)).outcome == "queued"
    real = ctx.control
    async def unconfirmed(job_id: str, timeout_s: float = 5.0) -> Any:
        raise TimeoutError  # what a subscription on a dead connection comes to, 5 s later

    down = SimpleNamespace(
        connected=False, next_replacement=lambda: asyncio.get_running_loop().create_future(), subscribe=unconfirmed
    )
    ctx.control = down
    started = time.monotonic()
    assert await worker._claim_one(ctx, queue) is None
    assert 0.9 <= time.monotonic() - started < 3  # waited for the connection, up to a poll
    assert await redis.lrange(keys.QUEUE, 0, -1) == [spec.job_id.encode()]  # left for others
    ctx.control = real
    assert real.connected
    claimed = await worker._claim_one(ctx, queue)
    assert claimed is not None and claimed[1] is not None
    await real.unsubscribe(claimed[1])


async def test_a_parked_job_reads_its_flags_only_when_its_claim_may_have_missed_a_start(
    redis: Redis, queue: WorkerQueue, claiming_worker: tuple[Worker, Any]
) -> None:
    worker, ctx = claiming_worker
    store = JobStore(redis, RECORD_TTL_S)
    swept = _Counted(queue, "flags_of")  # every read of flags: the sweep's, and a job's own
    reads = _Counted(queue, "flags")  # a job's own

    # Started while still queued: the claim says so, and the job goes on without a read.
    run, sub = await _claimed_run(redis, worker, ctx, queue, started=True)
    assert run.claim.start_flag
    assert await run._park(sub.ctrl) == "start" and reads.calls == 0
    await ctx.control.unsubscribe(sub)

    # Parked on a healthy connection: it waits for the message and reads nothing meanwhile.
    run, sub = await _claimed_run(redis, worker, ctx, queue)
    parking = asyncio.create_task(run._park(sub.ctrl))
    await asyncio.sleep(1.5)
    assert not parking.done() and reads.calls == 0
    assert (await store.start(run.job_id, "owner-a")).outcome == "started"
    assert await asyncio.wait_for(parking, 3) == "start" and reads.calls == 0
    await ctx.control.unsubscribe(sub)

    # A start whose message was lost with the connection: the sweep reads it (with every
    # parked job's flags) once the connection is back, and the job reads nothing itself.
    assert swept.calls == 0
    run, sub = await _claimed_run(redis, worker, ctx, queue)
    parking = asyncio.create_task(run._park(sub.ctrl))
    await asyncio.sleep(0.2)
    await redis.set(keys.start_flag_key(run.job_id), "1")  # stored; its message never came
    await redis.client_kill_filter(_type="pubsub")
    assert await asyncio.wait_for(parking, 3) == "start"
    assert swept.calls >= 1 and reads.calls == 0 and len(ctx.flag_sweep) == 0
    await ctx.control.unsubscribe(sub)

    # The connection replaced between the subscription and the park: the sweep at that
    # replacement ran before the job was parked, so the job reads its flags itself, once.
    run, sub = await _claimed_run(redis, worker, ctx, queue)
    await redis.set(keys.start_flag_key(run.job_id), "1")  # stored; its message lost with the old connection
    await _replace_the_pubsub_connection(redis, ctx)
    assert await asyncio.wait_for(run._park(sub.ctrl), 3) == "start" and reads.calls == 1
    await ctx.control.unsubscribe(sub)

    # A loss nothing noticed (a half-open connection): the periodic sweep finds it.
    ctx.flag_sweep = FlagSweep(queue, ctx.control, every_s=0.5)
    sweeping = asyncio.create_task(ctx.flag_sweep.run())
    try:
        run, sub = await _claimed_run(redis, worker, ctx, queue)
        parking = asyncio.create_task(run._park(sub.ctrl))
        await asyncio.sleep(0.1)
        assert len(ctx.flag_sweep) == 1
        await redis.hset(keys.status_key(run.job_id), "kill", "1")  # stored; no message
        assert await asyncio.wait_for(parking, 3) == "kill" and reads.calls == 1
        assert len(ctx.flag_sweep) == 0
        await ctx.control.unsubscribe(sub)
    finally:
        sweeping.cancel()
        await asyncio.gather(sweeping, return_exceptions=True)


async def test_a_parked_job_whose_last_look_fails_stays_parked_until_it_can_look(
    redis: Redis, queue: WorkerQueue, claiming_worker: tuple[Worker, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Its warm-up ran out while Redis could not be reached: without the expiring mark, a
    # start the API answers 202 meanwhile would be dropped by an "expired" result.
    worker, ctx = claiming_worker
    monkeypatch.setattr("worker.job.run.CLOSE_PARK_RETRY_S", 0.2)
    run, sub = await _claimed_run(redis, worker, ctx, queue)
    real, looks = queue.close_park, 0

    async def cut_off_once(job_id: str, attempt: int) -> str:
        nonlocal looks
        looks += 1
        if looks == 1:
            # Redis comes back just after: the start lands, and its message is lost.
            await redis.set(keys.start_flag_key(job_id), "1")
            raise RedisConnectionError("Connection reset by peer")
        return await real(job_id, attempt)

    queue.close_park = cut_off_once  # type: ignore[method-assign]
    run.claim = msgspec.structs.replace(run.claim, claimed_at=asyncio.get_running_loop().time() - 3600)
    try:
        assert await asyncio.wait_for(run._park(sub.ctrl), 3) == "start"
        assert looks >= 1  # (the flag sweep may find the start before the second look)
        assert await redis.hget(keys.status_key(run.job_id), "expiringAttempt") is None
    finally:
        await ctx.control.unsubscribe(sub)


async def test_one_sweep_reads_every_parked_jobs_flags_and_tells_only_those_with_one(
    redis: Redis, queue: WorkerQueue, claiming_worker: tuple[Worker, Any]
) -> None:
    _worker, ctx = claiming_worker
    sweep = FlagSweep(queue, ctx.control)
    trips = _Counted(queue, "flags_of")
    count = BATCH + 44
    inboxes = {f"swept-{n}": asyncio.Queue[CtrlMessage]() for n in range(count)}
    for job_id, inbox in inboxes.items():
        sweep.add(job_id, inbox)
    started, killed = {f"swept-{n}" for n in range(0, count, 7)}, {f"swept-{n}" for n in range(0, count, 5)}
    for job_id in started:
        await redis.set(keys.start_flag_key(job_id), "1")
    for job_id in killed:
        await redis.hset(keys.status_key(job_id), "kill", "1")
    await redis.hset(keys.status_key("swept-1"), "kill", "0")  # a record, no kill
    await sweep.sweep()
    assert trips.calls == 2  # BATCH jobs a trip
    told = {job_id: [inbox.get_nowait().type for _ in range(inbox.qsize())] for job_id, inbox in inboxes.items()}
    assert {j: t for j, t in told.items() if t} == {j: ["kill" if j in killed else "start"] for j in started | killed}
    assert len(sweep) == count - len(started | killed) <= BATCH  # each told once; the rest still watched
    await sweep.sweep()
    assert trips.calls == 3 and all(inbox.empty() for inbox in inboxes.values())
    # A job claimed again keeps its own entry when its first park ends late.
    first, second = asyncio.Queue[CtrlMessage](), asyncio.Queue[CtrlMessage]()
    sweep.add("again", first)
    sweep.add("again", second)
    sweep.discard("again", first)
    await redis.set(keys.start_flag_key("again"), "1")
    await sweep.sweep()
    assert first.empty() and second.get_nowait().type == "start"


async def test_a_sweep_that_fails_reads_the_other_batches_and_soon_tries_again(
    redis: Redis, queue: WorkerQueue, claiming_worker: tuple[Worker, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    _worker, ctx = claiming_worker
    failures: list[BaseException] = [RedisError("Redis is away"), RuntimeError("a bug"), RedisError("again")]
    real = queue.flags_of

    async def flaky(job_ids: list[str]) -> list[tuple[bool, bool]]:
        if failures and job_ids[0] != "later-0":
            raise failures.pop(0)
        return await real(job_ids)

    monkeypatch.setattr(queue, "flags_of", flaky)
    sweep = FlagSweep(queue, ctx.control, every_s=30)
    inboxes = {f"{name}-{n}": asyncio.Queue[CtrlMessage]() for name in ("first", "later") for n in range(BATCH)}
    for job_id, inbox in inboxes.items():
        sweep.add(job_id, inbox)
        await redis.set(keys.start_flag_key(job_id), "1")
    assert await sweep.sweep() is False  # the first batch failed ...
    assert all(inbox.qsize() == (job_id.startswith("later")) for job_id, inbox in inboxes.items())  # ... not the second
    sweeping = asyncio.create_task(sweep.run())
    sub = await ctx.control.subscribe("first-0")  # (a bus with no channels does not reconnect)
    try:
        await redis.client_kill_filter(_type="pubsub")  # a replacement: sweep now
        began = time.monotonic()
        # A bug (logged) and another Redis failure, each followed by a retry RETRY_S later
        # rather than every_s: the sweep goes on, and the first batch is told within seconds.
        await asyncio.wait_for(inboxes["first-0"].get(), 6)
        assert 1.5 < time.monotonic() - began < 6 and not failures and len(sweep) == 0
        assert not sweeping.done()
    finally:
        sweeping.cancel()
        await asyncio.gather(sweeping, return_exceptions=True)
        await ctx.control.unsubscribe(sub)


async def test_an_append_from_a_count_behind_the_log_is_renumbered_not_dropped(redis: Redis, queue: WorkerQueue) -> None:
    # An append landed although its caller was cancelled before the answer came (the flusher
    # aborted mid-write): the job's count stayed behind. Its next events must go in after
    # it, with their state change, not be taken for a re-send of the landed one and dropped,
    # even when they are as many as the landed ones.
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    lane = _Lane()
    run = _job_run(queue, claim, lane)
    await run.events.go_live()
    await queue.advance(job, claim.attempt, [(1, "compile_output", "chunk", b"landed\n")])
    await run.events.stage("running", state=JobState.RUNNING, started=True)
    log = [(int(f[b"seq"]), f[b"name"]) for _, f in await redis.xrange(keys.events_key(job))]
    assert log == [(0, b"stage"), (1, b"compile_output"), (2, b"stage")]
    status = await redis.hgetall(keys.status_key(job))
    assert status[b"state"] == b"running" and status[b"started"] == b"1" and status[b"nextSeq"] == b"3"
    assert [(name, json.loads(data)["seq"]) for name, data in lane.sent] == [("stage", 0), ("stage", 2)]
    # A retry of an append that did land (its reply lost) is still recognised as itself.
    assert await queue._advance.again() == [1, 0]  # type: ignore[attr-defined]
    assert await redis.xlen(keys.events_key(job)) == 3


async def test_a_worker_that_comes_back_while_it_is_reaped_stays_listed(redis: Redis, queue: WorkerQueue) -> None:
    # Worker W stalled past its lease; a reaper found it dead and recovered its claims. W
    # came back meanwhile (its heartbeat renewed the lease): the reaper must not drop it from
    # `workers`, or a job W claims next and dies with is never walked again.
    worker = Worker(load_settings({"PUSHER_SECRET": "x"}), queue.worker_id, SimpleNamespace(memory=MemoryAdmission(UNBOUNDED_BYTES)), {})  # type: ignore[arg-type]
    await queue.heartbeat(worker.info(), 60_000)
    await redis.delete(keys.worker_alive_key(queue.worker_id))  # the lease ran out
    reaper = WorkerQueue(redis, "w-reaper", RECORD_TTL_S, RESULT_TTL_S)
    real = reaper.recover_claims

    async def recover_as_w_returns(worker_id: str, only: set[str] | None = None, dead: bool = False) -> list[tuple[str, bytes]]:
        recovered = await real(worker_id, only, dead)
        await queue.heartbeat(worker.info(), 60_000)  # W is back
        return recovered

    reaper.recover_claims = recover_as_w_returns  # type: ignore[method-assign]
    assert await reaper.reap_dead_workers(await reaper.unleased(await reaper.listed_workers())) == []
    assert await redis.hexists(keys.WORKERS, queue.worker_id)


async def test_a_worker_that_comes_back_while_it_is_reaped_keeps_the_claims_not_reaped_yet(
    redis: Redis, queue: WorkerQueue
) -> None:
    # The reaper walks a dead worker's claims one round trip at a time. W came back midway
    # and started one of the claims not reaped yet: it used to be ended `lost` all the same,
    # and the real result fenced off.
    worker = Worker(load_settings({"PUSHER_SECRET": "x"}), queue.worker_id, SimpleNamespace(memory=MemoryAdmission(UNBOUNDED_BYTES)), {})  # type: ignore[arg-type]
    await queue.heartbeat(worker.info(), 60_000)
    first, second = await _claimed(redis, queue), await _claimed(redis, queue)
    await redis.delete(keys.worker_alive_key(queue.worker_id))  # the lease ran out
    reaper = WorkerQueue(redis, "w-reaper", RECORD_TTL_S, RESULT_TTL_S)
    real = reaper._recovery_templates
    walked: list[str] = []

    async def w_returns_after_the_first(job_id: str) -> tuple[tuple[bytes, bytes], tuple[bytes, bytes]]:
        walked.append(job_id)
        if len(walked) == 2:
            await queue.heartbeat(worker.info(), 60_000)  # W is back...
            await redis.hset(keys.status_key(job_id), "started", "1")  # ...and starts it
        return await real(job_id)

    reaper._recovery_templates = w_returns_after_the_first  # type: ignore[method-assign]
    assert await reaper.reap_dead_workers(["w-dead-then-back", queue.worker_id]) == []
    reaped, kept = (first, second) if walked[0] == first.spec.job_id else (second, first)
    assert await redis.hget(keys.status_key(reaped.spec.job_id), "state") == b"queued"
    status = await redis.hgetall(keys.status_key(kept.spec.job_id))
    assert status[b"state"] == b"parked" and status[b"attempt"] == str(kept.attempt).encode()
    assert await queue.claimed_ids(queue.worker_id) == [kept.spec.job_id]


async def test_a_heartbeat_reads_a_dataset_token_that_changes_only_when_redis_lost_its_data(
    redis: Redis, queue: WorkerQueue
) -> None:
    worker = Worker(load_settings({"PUSHER_SECRET": "x"}), queue.worker_id, SimpleNamespace(memory=MemoryAdmission(UNBOUNDED_BYTES)), {})  # type: ignore[arg-type]
    other = WorkerQueue(redis, "w-other", RECORD_TTL_S, RESULT_TTL_S)
    first = await queue.heartbeat(worker.info(), 60_000)
    assert len(first) == 16
    assert await other.heartbeat(worker.info(), 60_000) == first  # one token for every worker
    assert await queue.heartbeat(worker.info(), 60_000) == first
    await redis.flushdb()  # a Redis restarted without persistence
    second = await queue.heartbeat(worker.info(), 60_000)
    assert second != first and await other.heartbeat(worker.info(), 60_000) == second


async def test_a_worker_judged_dead_that_renewed_since_is_not_reaped(
    redis: Redis, queue: WorkerQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reaper acts on a read some time after it (a heartbeat confirms Redis did not stall
    # meanwhile): a worker that thawed and renewed its lease by then keeps its claims. So does
    # a sandbox owner never listed among the workers (one still starting).
    worker = Worker(load_settings({"PUSHER_SECRET": "x"}), queue.worker_id, SimpleNamespace(memory=MemoryAdmission(UNBOUNDED_BYTES)), {})  # type: ignore[arg-type]
    await queue.heartbeat(worker.info(), 60_000)
    claim = await _claimed(redis, queue)
    await redis.rpush(keys.worker_claimed_key("w-starting"), b"some-job")
    await redis.delete(keys.worker_alive_key(queue.worker_id))

    async def owners(*_args: Any) -> set[str]:
        return {"w-starting"}

    async def sweep(*_args: Any, **_kwargs: Any) -> int:
        return 0

    monkeypatch.setattr("worker.worker.sandbox_owners", owners)
    monkeypatch.setattr("worker.worker.sweep_orphans", sweep)
    reaping = Worker(load_settings({"PUSHER_SECRET": "x"}), "w-reaper", SimpleNamespace(cgroups=None, work_root=None, memory=MemoryAdmission(UNBOUNDED_BYTES)), {})  # type: ignore[arg-type]
    ctx = SimpleNamespace(queue=WorkerQueue(redis, "w-reaper", RECORD_TTL_S, RESULT_TTL_S))
    judged: list[set[str]] = []
    real_unleased = ctx.queue.unleased

    async def unleased(worker_ids: Any) -> set[str]:
        found = await real_unleased(worker_ids)
        judged.append(found)
        return found

    async def held_as_it_thaws(_token: int, after: float) -> bool:
        await queue.heartbeat(worker.info(), 60_000)  # back
        return True

    monkeypatch.setattr(ctx.queue, "unleased", unleased)
    monkeypatch.setattr(reaping.continuity, "judging", lambda: 0)
    monkeypatch.setattr(reaping.continuity, "held", held_as_it_thaws)
    await reaping._judge_others(ctx)  # type: ignore[arg-type]
    assert judged[0] == {queue.worker_id, "w-starting"}
    assert await redis.lrange(keys.worker_claimed_key(queue.worker_id), 0, -1) == [claim.spec.job_id.encode()]
    assert await redis.hexists(keys.WORKERS, queue.worker_id)
    assert await redis.lrange(keys.worker_claimed_key("w-starting"), 0, -1) == [b"some-job"]

    # Still gone at the last look: reaped.
    async def held(_token: int, after: float) -> bool:
        return True

    await redis.delete(keys.worker_alive_key(queue.worker_id))
    monkeypatch.setattr(reaping.continuity, "held", held)
    await reaping._judge_others(ctx)  # type: ignore[arg-type]
    assert await redis.lrange(keys.QUEUE, 0, -1) == [claim.spec.job_id.encode()]  # never started: re-queued
    assert not await redis.hexists(keys.WORKERS, queue.worker_id)
    assert await redis.lrange(keys.worker_claimed_key("w-starting"), 0, -1) == [b"some-job"]


def _confirmed_reaper(
    redis: Redis, monkeypatch: pytest.MonkeyPatch, owner: str, work_root: Path | None
) -> tuple[Worker, SimpleNamespace, list[set[str]]]:
    """A reaper on the default settings whose record may judge and whose every read is
    confirmed, with `owner` as the host's one other sandbox owner: the reaper, its context,
    and the list each sweep appends the workers it was given to."""
    swept: list[set[str]] = []

    async def owners(*_args: Any) -> set[str]:
        return {owner}

    async def sweep(*_args: Any, dead: Any = (), **_kwargs: Any) -> int:
        swept.append(set(dead))
        return 0

    async def held(_token: int, after: float) -> bool:
        return True

    monkeypatch.setattr("worker.worker.sandbox_owners", owners)
    monkeypatch.setattr("worker.worker.sweep_orphans", sweep)
    reaper = Worker(load_settings({"PUSHER_SECRET": "x"}), "w-reaper", SimpleNamespace(cgroups=None, work_root=work_root), {})  # type: ignore[arg-type]
    monkeypatch.setattr(reaper.continuity, "judging", lambda: 0)
    monkeypatch.setattr(reaper.continuity, "held", held)
    return reaper, SimpleNamespace(queue=WorkerQueue(redis, "w-reaper", RECORD_TTL_S, RESULT_TTL_S)), swept


async def test_a_worker_whose_lease_may_have_lapsed_in_a_gap_the_reaper_saw_is_left_alone(
    redis: Redis, queue: WorkerQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Mid-way through a settings change a fleet mixes leases. A reaper on 10 s / 2 s counts
    # only a gap over 7 s as a break; a gap of 4 s between its answers says nothing to
    # itself, but may be a stall that lapsed a 5 s lease renewed every second (whose peers
    # call 3.5 s a break). While such a gap lies within that lease before the look, it
    # leaves such a worker, claims and sandboxes, alone.
    short = load_settings({"PUSHER_SECRET": "x", "WORKER_LEASE_TTL_MS": "5000", "WORKER_HEARTBEAT_MS": "1000"})
    worker = Worker(short, queue.worker_id, SimpleNamespace(memory=MemoryAdmission(UNBOUNDED_BYTES)), {})  # type: ignore[arg-type]
    await queue.heartbeat(worker.info(), 60_000)
    claim = await _claimed(redis, queue)
    await redis.delete(keys.worker_alive_key(queue.worker_id))
    reaper, ctx, swept = _confirmed_reaper(redis, monkeypatch, queue.worker_id, work_root=None)
    record = reaper.continuity
    now = asyncio.get_running_loop().time()
    record._since = now - 30  # answered for 30 s without a break
    record._gaps.append((now - 1, 4.0))
    await reaper._judge_others(ctx)  # type: ignore[arg-type]
    assert await redis.lrange(keys.worker_claimed_key(queue.worker_id), 0, -1) == [claim.spec.job_id.encode()]
    assert await redis.hexists(keys.WORKERS, queue.worker_id)
    assert swept == []

    # Answers no more than 2 s apart: no stall could have lapsed its lease. Reaped and swept.
    record._gaps.clear()
    record._gaps.append((now - 1, 2.0))
    await reaper._judge_others(ctx)  # type: ignore[arg-type]
    assert await redis.lrange(keys.QUEUE, 0, -1) == [claim.spec.job_id.encode()]
    assert not await redis.hexists(keys.WORKERS, queue.worker_id)
    assert swept == [{queue.worker_id}]


async def test_an_unlisted_sandbox_owner_is_judged_by_the_settings_it_declared_on_the_host(
    redis: Redis, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Redis lost its data: the workers list is empty, and a live worker on 45 s / 15 s may not
    # renew for 15 s after it answers again (22.5 s, late). The reaper (10 s / 2 s) may judge
    # after 10 s of answers, but sweeps its sandboxes only once it could have renewed.
    owner = "w-slow"
    _declare(tmp_path, owner, 45_000, 15_000)
    reaper, ctx, swept = _confirmed_reaper(redis, monkeypatch, owner, work_root=tmp_path)
    record = reaper.continuity
    record._gaps.append((asyncio.get_running_loop().time() - 1, 2.0))
    record._since = asyncio.get_running_loop().time() - 20  # a lease of answers, and more
    await reaper._judge_others(ctx)  # type: ignore[arg-type]
    assert swept == []
    record._since = asyncio.get_running_loop().time() - 25
    await reaper._judge_others(ctx)  # type: ignore[arg-type]
    assert swept == [{owner}]


async def test_a_sandbox_owner_that_renews_before_the_sweep_keeps_its_sandboxes(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The sweep kills jails: it takes a last look at the owner's lease after the confirming
    # beat, and an owner that thawed and renewed meanwhile keeps its sandboxes.
    owner = "w-thawing"
    swept: list[set[str]] = []

    async def owners(*_args: Any) -> set[str]:
        return {owner}

    async def sweep(*_args: Any, dead: Any = (), **_kwargs: Any) -> int:
        swept.append(set(dead))
        return 0

    monkeypatch.setattr("worker.worker.sandbox_owners", owners)
    monkeypatch.setattr("worker.worker.sweep_orphans", sweep)
    worker = Worker(load_settings({"PUSHER_SECRET": "x"}), "w-reaper", SimpleNamespace(cgroups=None, work_root=None, memory=MemoryAdmission(UNBOUNDED_BYTES)), {})  # type: ignore[arg-type]
    ctx = SimpleNamespace(queue=WorkerQueue(redis, "w-reaper", RECORD_TTL_S, RESULT_TTL_S))

    async def held_as_it_thaws(_token: int, after: float) -> bool:
        await redis.set(keys.worker_alive_key(owner), b"1", px=60_000)
        return True

    monkeypatch.setattr(worker.continuity, "judging", lambda: 0)
    monkeypatch.setattr(worker.continuity, "held", held_as_it_thaws)
    await worker._judge_others(ctx)  # type: ignore[arg-type]
    assert swept == []

    async def held(_token: int, after: float) -> bool:
        return True

    await redis.delete(keys.worker_alive_key(owner))
    monkeypatch.setattr(worker.continuity, "held", held)
    await worker._judge_others(ctx)  # type: ignore[arg-type]
    assert swept == [{owner}]


@pytest.mark.parametrize("ending", ["finish", "reap", "kill"])
async def test_a_jobs_audience_mark_and_stdin_last_no_longer_than_its_result(
    redis: Redis, queue: WorkerQueue, ending: str
) -> None:
    # Set for the record's day when a client subscribed (and stdin sent): once the job ends,
    # by its worker, by recovery or by a kill in the queue, both go with its result.
    store = JobStore(redis, RECORD_TTL_S)
    if ending == "kill":
        spec = _spec()
        assert (await store.enqueue(spec, 100, 100, RESULT_TTL_S)).outcome == "queued"
        job = spec.job_id
    else:
        claim = await _claimed(redis, queue)
        job = claim.spec.job_id
    await store.mark_audience(job)
    await redis.xadd(keys.stdin_key(job), {"data": b"unread\n"})
    await redis.expire(keys.stdin_key(job), RECORD_TTL_S)
    if ending == "finish":
        await _job_run(queue, claim)._finish(Outcome.COMPLETED, result_without_run(Outcome.COMPLETED, None))
    elif ending == "reap":
        await queue.advance(job, claim.attempt, [(1, "stage", "data", b'{"phase":"running","seq":1}')], started=True)
        assert [job for job, _ in await queue.recover_claims(queue.worker_id)] == [job]
    else:
        assert (await store.kill(job, RESULT_TTL_S)).result is not None  # ended here, in the queue
    for key in (keys.audience_key(job), keys.stdin_key(job)):
        assert 0 < await redis.ttl(key) <= RESULT_TTL_S, key
    # A client that subscribes after the end (to read the result) does not renew it for a day.
    await store.mark_audience(job)
    assert 0 < await redis.ttl(keys.audience_key(job)) <= await redis.ttl(keys.status_key(job)) <= RESULT_TTL_S


async def test_a_job_renumbered_before_it_went_live_publishes_what_landed_too(redis: Redis, queue: WorkerQueue) -> None:
    # The append that landed unanswered is in the log, not in the backlog: going live must
    # read the log, or subscribers see a gap where it sits.
    claim = await _claimed(redis, queue)
    job = claim.spec.job_id
    lane = _Lane()
    run = _job_run(queue, claim, lane)
    await queue.advance(job, claim.attempt, [(1, "compile_output", "chunk", b"landed\n")])
    await run.events.stage("running", state=JobState.RUNNING, started=True)
    await run.events.go_live()
    assert [(name, json.loads(data)["seq"]) for name, data in lane.sent] == [
        ("stage", 0), ("compile_output", 1), ("stage", 2)
    ]


async def test_a_lost_batch_keeps_the_verdicts_its_log_holds_and_skips_the_rest(redis: Redis, queue: WorkerQueue) -> None:
    # Its worker died after case 0's verdict was logged: the lost result still lists every
    # case (case 0 as judged) and a summary, as a grader reads any batch's.
    spec = msgspec.structs.replace(_spec(), tests=[TestCase(name="first"), TestCase()])
    assert (await JobStore(redis, RECORD_TTL_S).enqueue(spec, 100, 100, RESULT_TTL_S)).outcome == "queued"
    claim = await queue.claim(1.0, 0.0)
    assert claim is not None and claim.spec.job_id == spec.job_id
    verdict = CaseVerdictEvent(
        index=0, name="first", outcome=Outcome.COMPLETED, verdict="accepted", exit_code=0, signal=None,
        duration_ms=5, cpu_ms=3, memory_kb=900, message="a message of its event's", seq=2,
    )  # fmt: skip
    await queue.advance(
        spec.job_id, claim.attempt,
        [(1, "stage", "data", b'{"phase":"running","seq":1}'), (2, "test_result", "data", msgspec.json.encode(verdict))],
        started=True,
    )  # fmt: skip
    ((job, raw),) = await queue.recover_claims(queue.worker_id)
    result = json.loads(raw)
    assert job == spec.job_id and result["outcome"] == "lost" and result["seq"] == 3
    assert [(c["index"], c["verdict"], c["outcome"]) for c in result["tests"]] == [(0, "accepted", "completed"), (1, "skipped", "lost")]
    assert result["summary"] == {"passed": 1, "failed": 0, "skipped": 1, "verdict": "skipped"}
    # A case's message stays in its event, out of the result (soketi's payload limit).
    assert "message" not in result["tests"][0], result["tests"][0]
    stored = json.loads(await redis.hget(keys.status_key(spec.job_id), "result"))
    assert stored == result


@pytest.mark.parametrize("batch", [False, True])
async def test_a_job_whose_spec_cannot_be_read_ends_in_the_shape_its_client_expects(
    redis: Redis, queue: WorkerQueue, batch: bool
) -> None:
    # A spec no worker can decode (a newer API's, a damaged key) ends internal_error at its
    # claim. A batch's result still lists each case and a summary, as a grader reads any.
    spec = msgspec.structs.replace(_spec(), tests=[TestCase(name="a"), TestCase(name="b")] if batch else [])
    assert (await JobStore(redis, RECORD_TTL_S).enqueue(spec, 100, 100, RESULT_TTL_S)).outcome == "queued"
    await redis.set(keys.spec_key(spec.job_id), b'{"not": "a spec"}', keepttl=True)
    assert await queue.claim(1.0, 0.0) is None
    ((job, raw),) = queue.take_recovered()
    result = json.loads(raw)
    assert job == spec.job_id and result["outcome"] == "internal_error" and "could not be read" in result["message"]
    assert await redis.hget(keys.status_key(spec.job_id), "state") == b"error"
    if batch:
        assert [(c["index"], c["verdict"], c["name"]) for c in result["tests"]] == [(0, "internal_error", None), (1, "internal_error", None)]
        assert result["summary"]["verdict"] == "internal_error" and result["summary"]["passed"] == 0
    else:
        assert "tests" not in result


async def test_an_unreadable_jobs_end_whose_reply_was_lost_is_published_by_the_upkeep(redis: Redis, queue: WorkerQueue) -> None:
    # The claim connection ends a job whose spec cannot be read. Its reply lost, only the
    # upkeep's queue was ever asked what its recoveries did: the result stayed unpublished.
    claim_queue = WorkerQueue(redis, queue.worker_id, RECORD_TTL_S, RESULT_TTL_S, queue.incarnation)
    claim_queue.share_recoveries(queue)
    spec = _spec()
    assert (await JobStore(redis, RECORD_TTL_S).enqueue(spec, 100, 100, RESULT_TTL_S)).outcome == "queued"
    await redis.set(keys.spec_key(spec.job_id), b'{"not": "a spec"}', keepttl=True)
    real = claim_queue._reap

    async def reply_lost(*args: Any, **kwargs: Any) -> Any:
        await real(*args, **kwargs)
        raise RedisConnectionError("Connection reset by peer")

    claim_queue._reap = reply_lost  # type: ignore[method-assign]
    with pytest.raises(RedisConnectionError):
        await claim_queue.claim(1.0, 0.0)
    assert claim_queue.take_recovered() == []
    ((job, raw),) = await queue.check_unanswered()  # the upkeep's round
    assert job == spec.job_id and json.loads(raw)["outcome"] == "internal_error"
    assert [j for j, _ in queue.take_recovered()] == [spec.job_id]


async def test_a_lost_batch_whose_spec_cannot_be_read_still_lists_its_cases(redis: Redis, queue: WorkerQueue) -> None:
    spec = msgspec.structs.replace(_spec(), tests=[TestCase(name="first"), TestCase()])
    assert (await JobStore(redis, RECORD_TTL_S).enqueue(spec, 100, 100, RESULT_TTL_S)).outcome == "queued"
    claim = await queue.claim(1.0, 0.0)
    assert claim is not None
    await queue.advance(spec.job_id, claim.attempt, [(1, "stage", "data", b'{"phase":"running","seq":1}')], started=True)
    await redis.set(keys.spec_key(spec.job_id), b"garbage", keepttl=True)
    ((_job, raw),) = await queue.recover_claims(queue.worker_id)
    result = json.loads(raw)
    assert result["outcome"] == "lost"
    assert [(c["index"], c["verdict"], c["outcome"]) for c in result["tests"]] == [(0, "skipped", "lost"), (1, "skipped", "lost")]
    assert result["summary"]["skipped"] == 2


@pytest.mark.parametrize("live", [False, True])
async def test_a_job_that_went_live_is_delivered_before_it_goes_back_to_the_queue(
    redis: Redis, queue: WorkerQueue, monkeypatch: pytest.MonkeyPatch, live: bool
) -> None:
    # Once back in the queue the next claim publishes from where this one ended: this
    # claim's events must be on the wire first, not overtaken by the next worker's.
    order: list[str] = []

    class SlowLane(_Lane):
        async def flush(self, timeout_s: float) -> bool:
            await asyncio.sleep(0.05)  # soketi answering a moment later
            order.append("delivered")
            return True

    claim = await _claimed(redis, queue)
    run = _job_run(queue, claim, SlowLane())
    handing_back = queue.hand_back

    async def hand_back(*args: Any, **kwargs: Any) -> bool:
        order.append(f"handed back, published to {kwargs.get('published_to')}")
        return await handing_back(*args, **kwargs)

    monkeypatch.setattr(queue, "hand_back", hand_back)
    if live:
        await run.events.go_live()
    else:
        run.events.go_live_within(10.0)  # held back when the stop came: never published
    await run._end_unstarted("handback")
    if live:
        assert order == ["delivered", "handed back, published to 1"]
    else:
        assert order == ["handed back, published to 0"] and not run.events.live


async def test_a_hand_back_stops_what_could_still_log_before_it_delivers(
    redis: Redis, queue: WorkerQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A stop while a started job waits for its compile from the park: the compile (and the
    # running stage's write) would go on logging events after the flush, to be delivered
    # after the next claim's. They stop first; only then is the log delivered and handed back.
    order: list[str] = []

    class Lane(_Lane):
        async def flush(self, timeout_s: float) -> bool:
            order.append("delivered")
            return True

    class Compiling:
        async def discard(self) -> None:
            order.append("compile stopped")

    async def still_logging() -> None:
        try:
            await asyncio.sleep(30)
        finally:
            order.append("stage stopped")

    claim = await _claimed(redis, queue)
    run = _job_run(queue, claim, Lane())
    run._precompile = Compiling()  # type: ignore[assignment]
    run._running_stage = asyncio.create_task(still_logging())
    handing_back = queue.hand_back

    async def hand_back(*args: Any, **kwargs: Any) -> bool:
        order.append("handed back")
        return await handing_back(*args, **kwargs)

    monkeypatch.setattr(queue, "hand_back", hand_back)
    await run.events.go_live()
    await asyncio.sleep(0)
    await run._give_back_unstarted()  # the stop's path for a job whose program never ran
    assert order == ["compile stopped", "stage stopped", "delivered", "handed back"]


async def test_results_recovered_in_a_round_that_failed_half_way_are_still_published(
    redis: Redis, queue: WorkerQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A dead worker held two started jobs. The reaper ends the first; the second's script runs
    # but its reply is lost and the retry fails too (Redis went away a moment). Both results
    # must still reach the live channel, once each: the first's had been dropped with the
    # failed round, the second's only ever sat in the log (its claim is gone, so no later
    # round would look at it again).
    jobs = []
    for _ in range(2):
        claim = await _claimed(redis, queue)
        await queue.advance(claim.spec.job_id, claim.attempt, [(1, "stage", "data", b'{"phase":"running","seq":1}')], started=True)
        jobs.append(claim.spec.job_id)
    settings = load_settings({"PUSHER_SECRET": "x", "WORKER_HEARTBEAT_MS": "50", "WORKER_LEASE_TTL_MS": "200"})
    reaper = WorkerQueue(redis, "w-reaper", RECORD_TTL_S, RESULT_TTL_S)
    real = reaper._reap
    calls: list[str] = []

    async def reply_lost_once(keys: list[Any], args: list[Any]) -> Any:
        answer = await real(keys=keys, args=args)
        calls.append(args[0])
        if args[0] == jobs[1] and calls.count(jobs[1]) == 1:
            raise RedisConnectionError("the connection dropped before the reply")
        return answer

    reaper._reap = reply_lost_once  # type: ignore[assignment]
    published: list[tuple[str, str, int]] = []

    class Lane:
        def __init__(self, channel: str) -> None:
            self.channel = channel

        def send(self, name: str, data: bytes) -> None:
            published.append((self.channel, name, json.loads(data)["seq"]))

        async def close(self, timeout_s: float) -> None:
            pass

    ctx = SimpleNamespace(queue=reaper, publisher=SimpleNamespace(lane=Lane), callback_due=lambda: None)

    async def no_sweep(*args: Any, **kwargs: Any) -> None:
        pass

    async def no_sandboxes(*args: Any, **kwargs: Any) -> set[str]:
        return set()

    monkeypatch.setattr("worker.worker.sweep_orphans", no_sweep)
    monkeypatch.setattr("worker.worker.sandbox_owners", no_sandboxes)
    worker = Worker(settings, "w-reaper", SimpleNamespace(cgroups=None, work_root=None, memory=MemoryAdmission(UNBOUNDED_BYTES)), {})  # type: ignore[arg-type]
    await queue.heartbeat(worker.info(), 60_000)
    await redis.delete(keys.worker_alive_key(queue.worker_id))  # its lease ran out
    # The reaper's own heartbeats are what let it judge others dead.
    beats = asyncio.create_task(worker._heartbeat(ctx))  # type: ignore[arg-type]
    upkeep = asyncio.create_task(worker._upkeep(ctx))  # type: ignore[arg-type]
    try:
        deadline = time.monotonic() + 5
        while len(published) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)  # a few more rounds: nothing is published twice
    finally:
        upkeep.cancel()
        beats.cancel()
    expected = sorted((keys.realtime_channel(job), "result", 2) for job in jobs)
    assert sorted(published) == expected, published
    for job in jobs:
        assert await redis.hget(keys.status_key(job), "state") == b"lost"


async def _stray_requeued_with_its_reply_lost_then_started(
    redis: Redis, queue: WorkerQueue
) -> tuple[str, Any, tuple[list[Any], list[Any]]]:
    """A claim of this worker's recovered as a stray (re-queued) with the reply lost, then
    claimed again into the same list and started: (its job id, the new claim, what the
    recovery sent: its keys and args)."""
    job = (await _claimed(redis, queue)).spec.job_id
    real = queue._reap
    sent: list[tuple[list[Any], list[Any]]] = []

    async def reply_lost(keys: list[Any], args: list[Any]) -> Any:
        sent.append((keys, args))
        await real(keys=keys, args=args)
        raise RedisConnectionError("the connection dropped before the reply")

    queue._reap = reply_lost  # type: ignore[assignment]
    try:
        with pytest.raises(RedisConnectionError):
            await queue.recover_claims(queue.worker_id, only={job})
    finally:
        queue._reap = real  # type: ignore[assignment]
    assert await redis.hget(keys.status_key(job), "state") == b"queued"
    again = await queue.claim(1.0, 0.0)
    assert again is not None and again.spec.job_id == job
    await queue.advance(job, again.attempt, [(again.next_seq, "stage", "data", b'{"phase":"running"}')], started=True)
    (call,) = sent
    return job, again, call


async def test_a_lost_reply_is_only_looked_up_never_run_again(redis: Redis, queue: WorkerQueue) -> None:
    # A stray re-queued by recovery whose reply was lost; the job is then claimed again into
    # the same list and started. Looking up the lost reply must not touch it: running the
    # recovery again would find the id in the list and end a healthy run `lost`.
    job, again, _ = await _stray_requeued_with_its_reply_lost_then_started(redis, queue)
    assert await queue.check_unanswered() == [] and queue.take_recovered() == []
    status = await redis.hgetall(keys.status_key(job))
    assert status[b"state"] != b"lost" and int(status[b"attempt"]) == again.attempt
    assert await redis.lrange(keys.worker_claimed_key(queue.worker_id), 0, -1) == [job.encode()]


async def test_a_recovery_sent_again_after_its_lost_reply_leaves_the_job_claimed_again(
    redis: Redis, queue: WorkerQueue
) -> None:
    # The same stray as above, but the client itself sends the script again (its retry on a
    # dropped connection), after the job was claimed into the same list and started (review):
    # the second run must answer as the first did and touch nothing, not end the run `lost`.
    job, again, (keys_sent, args_sent) = await _stray_requeued_with_its_reply_lost_then_started(redis, queue)
    assert await queue._reap(keys=keys_sent, args=args_sent) == 1  # (re-queued, as the first run did)
    status = await redis.hgetall(keys.status_key(job))
    assert status[b"state"] == b"parked" and status[b"started"] == b"1", status  # (not lost)
    assert int(status[b"attempt"]) == again.attempt and b"result" not in status
    assert await redis.lrange(keys.worker_claimed_key(queue.worker_id), 0, -1) == [job.encode()]
    assert await redis.llen(keys.QUEUE) == 0


async def test_the_lanes_audience_look_and_late_replay_claim(redis: Redis, redis_stack: Any) -> None:
    # The look reads the mark, then the claim: the API's webhook script sets both at once, so a
    # look that finds its mark finds its claim. The claim is the lane's by its token, so a SET
    # that landed but whose answer was lost (sent again: nil) is still this lane's.
    from worker.messaging.publisher import Publisher

    settings = load_settings({"REDIS_URL": redis_stack.redis_url, "PUSHER_SECRET": "x", "PUSHER_PUBLISH": "redis"})
    publisher = Publisher(settings, redis)
    job = "a" * 32
    channel = keys.realtime_channel(job)
    try:
        assert await publisher.occupied(channel) == "none"
        await redis.set(keys.audience_key(job), "1")
        assert await publisher.occupied(channel) == "present"
        assert await publisher.claim_late_replay(channel, "worker:one")
        assert await publisher.claim_late_replay(channel, "worker:one")  # the same, sent again
        assert not await publisher.claim_late_replay(channel, "worker:two")
        assert await publisher.occupied(channel) == "present"
        await redis.set(keys.late_replay_key(job), "api:x")
        assert await publisher.occupied(channel) == "replayed"
        assert not await publisher.claim_late_replay(channel, "worker:one")
    finally:
        await redis.delete(keys.audience_key(job), keys.late_replay_key(job))
        await publisher.aclose()
