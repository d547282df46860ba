"""The life of one claimed job: load, park, start, [compile], run under the clocks, report once.

    claim (with the slot's ready sandbox) ─ subscribe ─ stage{queued} (logged, not published)
      ├─ load files + limits; compiled languages: build the compile jail (while parked)
      └─ park: wait for start or kill (durable flags or ctrl messages) ≤ warm-up
    start ─ publish the log so far ─ starting ─ [stage{compiling} ─ compile_output… ─ stop on failure]
          ─ stage{running} (started=1 in Redis first) ─ go ─ stdout/stderr… (stdin fed) ─ exit
    kill the cgroup ─ read counters ─ one result (atomic, fenced) ─ destroy the sandbox

The run jail was built before the job existed (worker/isolation/sandbox.py), so start→first byte is
one pipe write plus the program's own start-up. Exactly one result is written by
`_finish`; every path out of `execute` goes through it, except losing the job to another
worker (Fenced), where writing anything would be wrong.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass

import msgspec
from msgspec import UNSET
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared import keys
from shared.artifacts import ArtifactEvent, ArtifactMeta, guess_mime_type, sign_artifact
from shared.blobs import parse_ref
from shared.errors import FieldError, ValidationError
from shared.grading import cases_not_run, result_facts
from shared.limits import COMPILE_DEFAULTS, Limits, with_overrides
from shared.manifest import HeapLimit, Manifest, entry_of, expand_argv, names_compiled_shim
from shared.messages import (
    OUTCOME_STATE,
    CaseOutput,
    CompileInfo,
    CtrlMessage,
    JobSpec,
    JobState,
    Outcome,
    ResultEvent,
    StdinFrame,
    StoredOutput,
    Verdict,
    result_without_run,
)
from shared.validation import decode_files
from worker.context import WorkerContext
from worker.isolation.jail import JailError, Program
from worker.isolation.offload import off_loop
from worker.isolation.pool import BUILD_CHECK_S, call_off
from worker.isolation.sandbox import Sandbox
from worker.isolation.workspace import Packed, SnapshotTooBig, WorkspaceError, pack_if_big
from worker.job.artifacts import RedisArtifactStore, collect_artifacts, top_level_names
from worker.job.batch import BatchProgress, BatchResult, run_batch, summarize
from worker.job.blobs import Blob
from worker.job.events import JobEvents, logged_bytes
from worker.job.flusher import OutputFlusher
from worker.job.outcome import compile_info, compile_succeeded, judge_compile_failure, judge_run
from worker.job.output import CompileOutput, OutputBudget, StreamTail, output_encoding
from worker.job.payload import fit_result
from worker.job.precompile import Precompile, PrecompileState, RecordedEvents
from worker.job.stdin import StdinFeed
from worker.job.supervise import Activity, Clocks, StepFacts, StepStopped, supervise
from worker.messaging.control import Subscription
from worker.messaging.inbox import next_item
from worker.messaging.queue import QUEUED_STAGE, Claim, Fenced, LogAhead, Written
from worker.tasks import cancel_and_wait

__all__ = ["JobRun"]

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()

# A produced result is kept trying for this long through a Redis outage (reconnecting with
# backoff); past it, the claim is left for the stray-claim recovery of this worker's upkeep.
FINISH_RETRY_S = 300.0
# A job cancelled (its worker stopping) while its result is being stored waits this long more.
FINISH_ON_CANCEL_S = 3.0


class PlatformError(Exception):
    """The platform failed before user code ran (becomes outcome internal_error)."""


class NotOfferedHere(PlatformError):
    """This worker lacks the job's language or version; another worker may have it."""


# A job no worker can run is handed around this many times before it ends internal_error.
MAX_HANDOVERS = 20
# A started job that gives up waiting on a worker whose sandbox builds all fail (see
# SandboxPool.failing) is handed to another worker up to this many times, then ends
# internal_error.
MAX_BROKEN_HANDOVERS = 3
# A job handed back after it went live waits at most this long for its events to be
# delivered first (see JobRun._deliver_before_hand_back).
HAND_BACK_FLUSH_S = 0.5
# After handing a job on, this worker claims nothing for this long, so the job reaches a
# worker that can run it instead of coming straight back.
HANDOVER_PAUSE_S = 1.0

# How soon a parked job whose warm-up ran out looks again when its last look failed.
CLOSE_PARK_RETRY_S = 1.0
# At start, the events logged while parked wait this long for the program's first output,
# to reach soketi with it in one request (see JobEvents.go_live_within).
LIVE_HOLD_S = 0.005
# How long a job started while its sandbox is being loaded waits for that load before it
# says `starting` (see execute): a load takes a few milliseconds here.
LOAD_WAIT_S = 0.2
# How long a started job that waits for a warm sandbox (a busy worker) stays `parked`
# before it says `starting` (see _acquire_sandbox): a saturated worker frees one about
# every job's run time, a few tens of milliseconds here.
QUIET_WAIT_S = 0.2


@dataclass(frozen=True)
class Plan:
    files: list[tuple[str, bytes]]
    run: Program
    manifest: Manifest
    entry: str
    sources: list[str]
    compile: Program | None = None
    compile_limits: Limits | None = None
    compile_output_kb: int = 64


class JobRun:
    def __init__(self, ctx: WorkerContext, claim: Claim, sub: Subscription | None) -> None:
        self.ctx = ctx
        self.claim = claim
        # The job's control channels, subscribed before the claim read its flags (None: the
        # subscription failed, and the job goes back to the queue).
        self.sub = sub
        self.spec: JobSpec = claim.spec
        self.job_id = claim.spec.job_id
        # Taken from the warm pool when the job starts; a parked job holds none.
        self.sandbox: Sandbox | None = None
        self.lane = ctx.publisher.lane(keys.realtime_channel(self.job_id))
        logged = [(0, "stage", QUEUED_STAGE)] if claim.logged_queued else []
        self.events = JobEvents(
            ctx.queue, self.lane, self.job_id, claim.attempt, claim.next_seq, logged, published_before=claim.live_seq
        )
        self.budget = OutputBudget(claim.spec.limits.output_kb * 1024, keep_bytes=claim.spec.collect_output)
        self._stderr_tail = StreamTail()
        # How the language's runtime says it gave up at its heap cap (from the plan's manifest).
        self._heap_limit: HeapLimit | None = None
        self._finished = False
        self._close_park_failed = False  # (logged once)
        self._destroyed = False
        self._compile_streams: CompileInfo | None = None
        self._batch_cases: list[CaseOutput] | None = None
        self._running_stage: asyncio.Task[None] | None = None
        # The compile (or load) while parked: it logs events of its own until discarded.
        self._precompile: Precompile | None = None
        self._artifacts: list[ArtifactMeta] = []
        self._held_blobs: list[Blob] = []
        self._artifacts_truncated = False
        # Set once stage{running} is logged: from then on the job must never run again.
        self._program_started = False
        self._program_started_at: float | None = None
        self._owes_result_live = False
        # What the run step ended with, once it has (and the compile's verdict): a worker
        # stopping after that still reports the run as it ended, not as killed.
        self._ran: tuple[StepFacts, CompileInfo | None] | None = None
        # A test batch under way (its cases so far), and the compile's verdict it follows.
        self._batch: BatchProgress | None = None
        self._compiled: CompileInfo | None = None

    # ------------------------------------------------------------------ entry point

    async def execute(self) -> None:
        sub = self.sub
        kill_watch: asyncio.Task[None] | None = None
        precompile: Precompile | None = None
        try:
            if sub is None:
                self._finished = True
                await self._hand_back()
                return
            if self.claim.kill_flag:
                await self._finish_without_run(Outcome.KILLED, "killed before it started")
                return
            try:
                manifest = self._manifest()
                plan = self._plan(manifest, await self._blobs())
                self._drop_spec_contents()
            except NotOfferedHere as exc:
                # A mixed fleet (a rolling upgrade, workers without some toolchain): let a
                # worker that has it take the job, unless it has gone round too often.
                if self.claim.handovers < MAX_HANDOVERS:
                    log.info("job %s: %s; handing it to another worker", self.job_id, exc)
                    self._finished = True
                    # Paused first, so this worker's claimer does not take the job straight back.
                    self.ctx.claim_paused_until = asyncio.get_running_loop().time() + HANDOVER_PAUSE_S
                    await self._hand_back(to_back=True)
                else:
                    await self._finish_without_run(Outcome.INTERNAL_ERROR, f"no worker could run it: {exc}")
                return
            except RedisError as exc:
                # Its uploaded files could not be read: another claim, here or elsewhere, may.
                log.warning("job %s: reading its uploaded files failed (%s); handing it back", self.job_id, exc)
                self._finished = True
                await self._hand_back(to_back=True)
                return
            except ValidationError as exc:
                log.error("job %s: its files cannot be prepared: %s", self.job_id, exc)
                await self._finish_without_run(Outcome.INTERNAL_ERROR, f"the job's files could not be prepared: {exc}")
                return
            except PlatformError as exc:
                log.error("job %s: cannot plan the job: %s", self.job_id, exc)
                await self._finish_without_run(Outcome.INTERNAL_ERROR, f"sandbox preparation failed: {exc}")
                return
            if self.ctx.pool.slots > 1 and not self.claim.start_flag and (plan.compile is not None or not self.spec.tests):
                # Compile, or (interpreted) just load, in a spare sandbox while parked (a job
                # started before its claim is not parked: it takes a sandbox as any started job).
                precompile = self._precompile = Precompile(
                    self.job_id,
                    self.ctx.pool,
                    lambda sandbox: self._load(plan, sandbox),
                    (lambda inbox, sandbox, events: self._compile(inbox, plan, sandbox, events))
                    if plan.compile is not None
                    else None,
                    plan.run,
                    self.spec.language,
                )
            signal = await self._park(sub.ctrl)
            if signal != "start":
                if precompile is not None:
                    await precompile.discard()
                await self._end_unstarted(signal)
                return
            # Fenced first: a worker that lost the job while parked (frozen past its lease)
            # must not publish anything of it. Then the client, which subscribed before it
            # started, sees every event from here on, starting with the ones logged while
            # the job was parked.
            early: str | None = None
            if precompile is not None:
                # A start sent right after its execute (a grader's) comes while the load is
                # still under way (a few milliseconds). Waiting that out lets the one fenced
                # write below take the job from parked to running, where `starting` first
                # was a round trip more to Redis for every such job; a load slower than
                # LOAD_WAIT_S says `starting` as before.
                await precompile.load_within(LOAD_WAIT_S)
            if precompile is not None and precompile.state is PrecompileState.LOADED:
                # Loaded while parked: nothing lies between start and run, so one fenced
                # write takes the job from parked straight to running (settle keeps the
                # sandbox first, so no started job can recall it meanwhile).
                early = await precompile.settle(sub.ctrl, self.events)
                if early == "loaded":
                    self.sandbox = precompile.take()
                    self._running_stage = asyncio.create_task(self._mark_running())
                    await self._running_stage
                    early = "ready"
            elif precompile is None and plan.compile is None and not self.spec.tests:
                # Nothing loaded for it while parked (started before its claim, as a grader's
                # job often is, or a worker of one slot). With a warm sandbox free, as above,
                # one fenced write takes the job from parked to running, here while its files
                # and limits go in; nothing is published before that write lands.
                self.sandbox = self.ctx.pool.take_ready(plan.run, self.spec.language)
                if self.sandbox is not None:
                    self._running_stage = asyncio.create_task(self._mark_running(then_go_live=True))
                    early = "taken"
            # Nothing to load or compile for it ahead of a sandbox (none was free for its
            # load while parked, or it started before its claim): it waits its turn saying
            # nothing, as a job that found a sandbox free says nothing before its running
            # write. Most such waits are short (a saturated worker's), and each would have
            # cost a fenced `starting` write; one that lasts QUIET_WAIT_S says it then.
            quiet = (
                early is None
                and plan.compile is None
                and not self.spec.tests
                and (precompile is None or precompile.state in (PrecompileState.WAITING, PrecompileState.GONE))
            )
            if quiet:
                if precompile is not None:
                    await precompile.discard()  # (what settle does with one that got nothing)
                early = "gone"
            else:
                if early not in ("ready", "taken"):
                    await self.events.state(JobState.STARTING)
                if early != "taken":  # (that one goes live once its running write lands)
                    self.events.go_live_within(LIVE_HOLD_S)
            kill_watch = self._watch_kills(sub.ctrl)
            if early is None:
                try:
                    early = await precompile.settle(sub.ctrl, self.events) if precompile is not None else "gone"
                except JailError as exc:  # its compile's sandbox ended while it was parked
                    log.error("job %s: %s", self.job_id, exc)
                    await self._finish_without_run(Outcome.INTERNAL_ERROR, f"sandbox failure: {exc}")
                    return
            if early == "loaded":  # the load was still under way at start
                assert precompile is not None
                self.sandbox = precompile.take()  # files and limits went in while parked
                self._running_stage = asyncio.create_task(self._mark_running())
            elif early == "gone":
                signal = await self._acquire_sandbox(sub.ctrl, plan.run, quiet_s=QUIET_WAIT_S if quiet else None)
                if signal == "broken":
                    await self._give_up_on_sandboxes()
                    return
                if signal != "start":
                    await self._end_unstarted(signal, "killed before it ran")
                    return
                if plan.compile is None and not self.spec.tests:
                    # Nothing comes between here and the run: log the running stage (a Redis
                    # round trip) while the files and limits go in, not after. A job that
                    # waited quietly goes live once that write lands (the fence, as "taken";
                    # one that said `starting` after all went live then, and this is a no-op).
                    self._running_stage = asyncio.create_task(self._mark_running(then_go_live=quiet))
            if early in ("gone", "taken"):
                try:
                    await self._load(plan)
                except (JailError, WorkspaceError, OSError) as exc:
                    log.error("job %s: cannot load the job into its sandbox: %s", self.job_id, exc)
                    await self._destroy()
                    await self._finish_without_run(Outcome.INTERNAL_ERROR, f"sandbox preparation failed: {exc}")
                    return
            compiled: CompileInfo | None = None
            if plan.compile is not None:
                if precompile is not None and early in ("compiled", "failed"):
                    # Compiled while parked (its events went out at start, in order).
                    if early == "compiled":
                        self.sandbox = precompile.take()
                    assert precompile.facts is not None
                    facts, self._compile_streams = precompile.facts
                else:
                    facts, self._compile_streams = await self._compile(sub.ctrl, plan)
                # The result event carries the interleaved log only (it is published, and
                # published payloads have a size limit); the pullable result has both streams.
                compiled = self._compiled = msgspec.structs.replace(self._compile_streams, stdout=None, stderr=None)
                if not compile_succeeded(facts):
                    await self._finish_compile_failure(facts, compiled)
                    return
                if self._grace_too_short():
                    # Compiled during the grace, with less of it left than the program may
                    # run: it has not begun, so it goes back to the queue to be compiled
                    # again and run whole elsewhere, not started here to be cut off (and
                    # judged killed) when the grace ends.
                    await self._end_unstarted("handback")
                    return
            if self.spec.tests:
                if self._grace_too_short():
                    # An interpreted batch started during the grace: as a compiled job above,
                    # nothing of it has begun, and it goes back to the queue whole.
                    await self._end_unstarted("handback")
                    return
                await self._run_batch(sub.ctrl, plan, compiled)
                return
            # What is in the workspace before the run is not an artifact: the submitted files,
            # plus (only after a compile, which may add some) whatever the listing shows (see
            # top_level_names: a listing this small is cheaper here than on a thread).
            before = (
                {name.split("/", 1)[0].encode() for name, _ in plan.files}
                if plan.compile is None
                else top_level_names(str(self.sandbox.workspace.path))
            )
            facts = await self._run(sub.ctrl, sub.stdin, plan.run, compiled)
            await self._keep_artifacts(before)
            # Every process is dead already (killed, counters read); removing the cgroups and
            # the workspace happens right after the result, off the user's critical path.
            await self._finish_run(facts, compiled)
        except Fenced:
            log.warning("job %s: lease lost to another worker; abandoning without a result", self.job_id)
            self._finished = True
        except asyncio.CancelledError:
            await asyncio.shield(self._cancelled())
            raise
        except Exception:
            log.exception("job %s: unexpected failure", self.job_id)
            await asyncio.shield(self._abort("internal error in the worker"))
        finally:
            try:
                if precompile is not None:
                    # Also when it holds nothing yet: one still waiting for a sandbox would
                    # otherwise go on to load or compile for a job that is over.
                    await asyncio.shield(precompile.discard())
                await self._discard(self._running_stage)
                await self._discard(kill_watch)
                if not self._destroyed:
                    await asyncio.shield(self._destroy())
            finally:
                # Its files' bytes go now, not when a collection finds the cycle the
                # precompile's callbacks make; a blob's shared copy with its last job.
                self._held_blobs.clear()
                self._precompile = None
                if sub is not None:
                    self.ctx.flag_sweep.discard(self.job_id, sub.ctrl)
                    await self.ctx.control.unsubscribe(sub)
                await self.events.drop_hold()
                await self.lane.close(timeout_s=self.ctx.settings.pusher_timeout_ms / 1000 + 1)
                if self._owes_result_live:
                    owed = self.ctx.owed_results
                    if self.lane.result_lost and owed is not None:
                        # soketi surely never had it (shed in a pause, refused): still owed,
                        # sent again from the log (worker/messaging/owed.py).
                        owed.owe(self.job_id)
                    else:
                        # Handed to soketi (or given up on by a live worker): should this worker
                        # die before, whoever reaps it publishes the result
                        # (keys.worker_unpublished_key).
                        self.ctx.queue.delivered(self.job_id)

    async def _cancelled(self) -> None:
        """Only a worker stopping cancels a job (after its grace period). A program that was
        still running was killed on purpose, by the operator, so the verdict is `killed`,
        not a failure; one that had ended by itself (only its output's last trip or its
        artifacts were cut short) keeps its own verdict; a job whose program never ran goes
        back to the queue instead."""
        if self._ran is not None:
            await self._finish_run(*self._ran)
        elif self._batch is not None:
            # The cases that ran keep their verdicts; the rest were ended by the stop.
            stopped = summarize(self._batch, asyncio.get_running_loop().time(), stopped=True)
            message = "the worker shut down before the batch finished" if stopped.killed else None
            try:
                await self._finish_batch(stopped, self._compiled, message)
            except Exception:
                log.exception("job %s: could not record the stopped batch", self.job_id)
        elif self._program_started and self._program_started_at is None:
            # Marked running (never handed back from there), but stopped before its go (in
            # the wait for memory): nothing of the user's ran, so it is safe to submit again.
            await self._abort("the worker shut down before the program was started; nothing of it ran", Outcome.INTERNAL_ERROR)
        elif self._program_started:
            await self._abort("the worker shut down before the program finished", Outcome.KILLED)
        else:
            await self._give_back_unstarted()

    async def _give_back_unstarted(self) -> None:
        """Hand a never-started job back, briefly; if Redis is away the claim stays in this
        worker's list, where recovery re-queues it (its program never ran)."""
        try:
            await self._destroy()
        except Exception:
            log.exception("job %s: teardown failed", self.job_id)
        if self._finished:
            return
        await self._deliver_before_hand_back()
        self._finished = True
        if not await self._redis_answers_at_stop():
            return
        try:
            await asyncio.wait_for(
                self.ctx.queue.hand_back(self.job_id, self.claim.attempt, published_to=self.events.published_to), 2.0
            )
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("job %s: could not hand it back (%s); recovery will re-queue it", self.job_id, exc)

    async def _redis_answers_at_stop(self) -> bool:
        """Whether a stopping worker's hand-back is worth trying (worker.messaging.probe);
        if not, the claim stays for recovery to re-queue."""
        if await self.ctx.redis_answers():
            return True
        log.warning("job %s: could not hand it back (Redis does not answer); recovery will re-queue it", self.job_id)
        return False

    async def _deliver_before_hand_back(self) -> None:
        """A job that went live has its events delivered before it goes back to the queue:
        the next claim (or the API's kill) publishes from where this one ended, and should
        not overtake it on the wire. Bounded (HAND_BACK_FLUSH_S): a slow soketi only loses
        that order, never the hand-back; what is left is still delivered, the lane stays
        open. What could still log events stops first, and a go_live still held back is
        dropped, so what the hand-back says was published stays true. Called before the job is marked finished: cancelled in here,
        the stop's own path still hands it back."""
        # Nothing of this claim may log more once the flush is under way: a compile still
        # running from the park (a stop during its settle), or the running stage's write.
        if self._precompile is not None:
            await asyncio.shield(self._precompile.discard())
        await self._discard(self._running_stage)
        await self.events.drop_hold()
        if self.events.live:
            await self.lane.flush(HAND_BACK_FLUSH_S)

    async def _hand_back(self, to_back: bool = False) -> bool:
        """Return the never-started job to the queue. Should Redis fail, the claim stays in
        this worker's list and the stray-claim recovery re-queues it: a job that did not
        run is never ended for it (nor its start flag dropped)."""
        try:
            return await self.ctx.queue.hand_back(
                self.job_id, self.claim.attempt, to_back=to_back, published_to=self.events.published_to
            )
        except (RedisError, OSError) as exc:
            log.warning("job %s: could not hand it back (%s); recovery will re-queue it", self.job_id, exc)
            return False

    async def _give_up_on_sandboxes(self) -> None:
        """This worker cannot build sandboxes: let another worker run the started job (its
        start flag stays), or end it internal_error once it has gone round enough."""
        error = self.ctx.pool.last_build_error
        log.error("job %s: no sandbox could be built here (%s)", self.job_id, error)
        if self.claim.handovers < MAX_BROKEN_HANDOVERS:
            await self._deliver_before_hand_back()  # (it had started: its log went live)
            self._finished = True
            # Paused first, so this worker's claimer does not take the job straight back.
            self.ctx.claim_paused_until = asyncio.get_running_loop().time() + HANDOVER_PAUSE_S
            await self._hand_back(to_back=True)
            return
        await self._finish_without_run(Outcome.INTERNAL_ERROR, f"sandbox preparation failed: {error}")

    async def _end_unstarted(self, signal: str, killed_message: str = "killed before it started") -> None:
        """End a job whose program never ran: handed back, killed or expired."""
        if signal == "handback":
            await self._deliver_before_hand_back()
            self._finished = True
            if await self._redis_answers_at_stop() and await self._hand_back():
                log.info("job %s: handed back to the queue (worker stopping)", self.job_id)
        elif signal == "kill":
            await self._finish_without_run(Outcome.KILLED, killed_message)
        else:
            await self._finish_without_run(Outcome.EXPIRED, None)

    async def _acquire_sandbox(self, ctrl: asyncio.Queue[CtrlMessage], program: Program, quiet_s: float | None = None) -> str:
        """Take a warm sandbox (first started, first served; one whose prestarted runtime
        can run `program` if there is one). Returns "start" once it holds one, "kill" if a
        kill came first, "handback" if the worker is stopping.

        `quiet_s`: the job has written nothing since its start; should no sandbox come in
        that long, it says `starting` (and goes live) then, and waits on.
        """
        pool = self.ctx.pool
        ready = pool.take_ready(program, self.spec.language)
        if ready is not None:
            # (What the wait below returns first when a sandbox is ready, before a kill or a
            # stop that came at the same time: without its three tasks.)
            self.sandbox = ready
            return "start"
        loop = asyncio.get_running_loop()
        say_at = loop.time() + quiet_s if quiet_s is not None else None
        take = asyncio.ensure_future(pool.take(program, self.spec.language))
        stopping = asyncio.ensure_future(self.ctx.stopping.wait())
        message: asyncio.Future[CtrlMessage] | None = None
        mark = pool.build_mark()
        taken = False
        try:
            while True:
                if message is None:
                    message = next_item(ctrl)
                # The timeout only looks at the pool's builds (and at saying `starting`); a
                # started job normally has its sandbox at once.
                timeout = BUILD_CHECK_S if say_at is None else max(0.0, min(BUILD_CHECK_S, say_at - loop.time()))
                done, _ = await asyncio.wait({take, stopping, message}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                if take in done:
                    message.cancel()
                    if message.done() and not message.cancelled():
                        ctrl.put_nowait(message.result())  # keep a kill for the run to see
                    self.sandbox = take.result()
                    taken = True
                    return "start"
                if message in done:
                    if message.result().type == "kill":
                        return "kill"
                    message = None
                if stopping in done:
                    return "handback"
                if say_at is not None and loop.time() >= say_at:
                    say_at = None
                    await self.events.state(JobState.STARTING)
                    self.events.go_live_within(LIVE_HOLD_S)
                if pool.failing(mark):
                    # Every sandbox this worker tried to build since the job began waiting
                    # failed (a full disk, a broken cgroup tree...): waiting on would leave
                    # the started job `starting` for as long as that lasts. A kill that came
                    # meanwhile (while `starting` was written) is what ends it, though.
                    if message.done() and not message.cancelled() and message.result().type == "kill":
                        return "kill"
                    return "broken"
        finally:
            stopping.cancel()
            if message is not None and not message.done():
                message.cancel()  # also when this wait itself was cancelled (the worker stopping)
            if not taken:
                await call_off(take, pool.put_back)

    def _watch_kills(self, ctrl: asyncio.Queue[CtrlMessage]) -> asyncio.Task[None] | None:
        """Have a stored kill flag turned into a kill message on `ctrl`, should the live one
        have been lost: the worker's FlagSweep reads it, with every other watched job's
        flags, when the pub/sub connection is replaced and every SWEEP_S besides (no task
        or timer of the job's own). A connection replaced since the subscription was made
        may have been swept before this job was watched: then the job reads its flag itself,
        once, in the task returned."""
        assert self.sub is not None
        self.ctx.flag_sweep.add(self.job_id, ctrl, kill_only=True)  # before the look below
        if self.ctx.control.generation == self.sub.generation:
            return None
        return asyncio.create_task(self._read_kill_flag(ctrl), name=f"kill-flag:{self.job_id}")

    async def _read_kill_flag(self, ctrl: asyncio.Queue[CtrlMessage]) -> None:
        # (A failed read is logged there, and the sweep reads the flag again.)
        if await self._durable_signal() == "kill":
            ctrl.put_nowait(CtrlMessage(type="kill"))

    @staticmethod
    async def _discard(task: asyncio.Task[None] | None) -> None:
        if task is not None:
            await cancel_and_wait([task])

    # ------------------------------------------------------------------ load

    async def _blobs(self) -> dict[str, bytes]:
        """The bytes of the uploaded blobs the spec's files name by `ref`, shared with the
        worker's other jobs that name them (worker/job/blobs.py). The API kept each alive for
        as long as the job's record lives.

        Raises:
            ValidationError: naming a file whose blob is gone, or whose stored bytes do not
                hash to its name (Redis is no trust boundary).
            RedisError: the blobs could not be read.
        """
        wanted = [(index, f.ref) for index, f in enumerate(self.spec.files) if f.ref is not UNSET]
        digests = [digest for _, ref in wanted if (digest := parse_ref(ref)) is not None]
        if not digests:
            return {}
        fetch = await self.ctx.blobs.get(self.ctx.queue, self.spec.owner, digests)
        for index, ref in wanted:
            digest = parse_ref(ref) or ""
            if digest in fetch.missing:
                why = "names a blob that is no longer stored (it expired, or Redis lost it): upload it again"
                raise ValidationError([FieldError(f"files[{index}].ref", why)])
            if digest in fetch.mismatched:
                raise ValidationError([FieldError(f"files[{index}].ref", "names a stored blob whose bytes do not match it")])
        # Held for as long as this job is: the shared copy lives while some job holds it.
        self._held_blobs = list(fetch.found.values())
        return {digest: blob.data for digest, blob in fetch.found.items()}

    def _drop_spec_contents(self) -> None:
        """Let go of the spec's copy of the files' contents once the plan holds their bytes:
        a parked job would otherwise hold each inline file twice (its JSON text, or base64,
        and its bytes) for as long as it waits. Nothing reads them again; a job handed back
        goes with the spec Redis keeps."""
        if any(f.content for f in self.spec.files):
            files = [msgspec.structs.replace(f, content="") for f in self.spec.files]
            self.spec = msgspec.structs.replace(self.spec, files=files)
            self.claim = msgspec.structs.replace(self.claim, spec=self.spec)

    def _manifest(self) -> Manifest:
        """The manifest of this job's runtime on this worker; refuses a language or version
        it lacks."""
        spec = self.spec
        runtime = self.ctx.runtimes.get(spec.language)
        if runtime is None:
            raise NotOfferedHere(f"language {spec.language} is not offered by this worker")
        if spec.version and spec.version != runtime.version:
            raise NotOfferedHere(f"{spec.language} {spec.version} is not available here (this worker has {runtime.version})")
        return runtime.manifest

    def _plan(self, manifest: Manifest, blobs: dict[str, bytes]) -> Plan:
        """What to exec for this job (no sandbox needed yet)."""
        spec = self.spec
        files = decode_files(spec.files, self.ctx.settings.max_files_bytes, blobs)
        self._heap_limit = manifest.heap_limit
        names = [name for name, _ in files]
        entry = entry_of(manifest, names)
        sources = [n for n in names if any(n.endswith(ext) for ext in manifest.source_extensions)] or [entry]
        factory = self.ctx.sandboxes
        run = Program(
            argv=expand_argv(manifest.run, entry=entry, sources=sources, args=spec.args, memory_mb=spec.limits.memory_mb),
            env=dict(manifest.env),
            **factory.program_rlimits(spec.limits),
            adoptable=not names_compiled_shim(manifest, files),
        )
        step = manifest.compile
        if step is None:
            return Plan(files=files, run=run, manifest=manifest, entry=entry, sources=sources)
        limits = with_overrides(COMPILE_DEFAULTS, step.limits)
        if step.limits.idle_ms is None:
            # Compilers work in silence: only a manifest that says so ends one for it.
            limits = msgspec.structs.replace(limits, idle_ms=limits.wall_time_ms)
        compile_program = Program(
            argv=expand_argv(step.argv, entry=entry, sources=sources, args=[], memory_mb=limits.memory_mb),
            env={**manifest.env, **step.env},
            **factory.program_rlimits(limits, compiler=True),
        )
        return Plan(
            files=files,
            run=run,
            manifest=manifest,
            entry=entry,
            sources=sources,
            compile=compile_program,
            compile_limits=limits,
            compile_output_kb=step.output_kb,
        )

    async def _load(self, plan: Plan, sandbox: Sandbox | None = None) -> None:
        """Put the job's files and limits into its sandbox; compiled languages get their
        compile jail over the same workspace."""
        sandbox = sandbox or self.sandbox
        assert sandbox is not None
        await sandbox.load(plan.files, self.spec.limits, plan.run, stand_in=self.ctx.pool.prime_for(self.spec.language))
        if plan.compile_limits is not None:
            await self.ctx.sandboxes.add_compile_jail(sandbox, self.ctx.queue.worker_id, plan.compile_limits)

    # ------------------------------------------------------------------ park

    async def _durable_signal(self) -> str | None:
        """"kill" or "start" from the stored flags (a kill wins), or None (also while Redis
        cannot be reached: the job stays parked and looks again)."""
        try:
            start, kill = await self.ctx.queue.flags(self.job_id)
        except (RedisError, OSError) as exc:
            log.warning("job %s: reading its start and kill flags failed: %s", self.job_id, exc)
            return None
        return "kill" if kill else "start" if start else None

    async def _close_park(self) -> str | None:
        """The last look at the durable signals: "kill" or "start" if either came after
        all, else "expired", with no start accepted any more (one that landed after the look
        would otherwise be answered 202 and dropped). None while Redis cannot be reached:
        the job cannot know no start was answered meanwhile, so it stays parked."""
        try:
            return await self.ctx.queue.close_park(self.job_id, self.claim.attempt)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            # (Once a job: a thousand parked jobs look again every second of an outage.)
            level = logging.DEBUG if self._close_park_failed else logging.WARNING
            log.log(level, "job %s: closing its warm-up failed (it stays parked): %s", self.job_id, exc)
            self._close_park_failed = True
            return None
        except RedisError as exc:
            # Not Redis being away (an ACL refusal, a damaged record): no retry would help.
            log.error("job %s: closing its warm-up failed: %s; it expires", self.job_id, exc)
            return "expired"

    async def _park(self, inbox: asyncio.Queue[CtrlMessage]) -> str:
        """Wait for start. Returns "start", "expired", "kill" or "handback".

        The live ctrl message is the fast path. The claim read the stored flags once the
        subscription was in place; from then on the worker's FlagSweep reads them, with
        every other parked job's in one round trip, whenever the pub/sub connection is
        replaced and every SWEEP_S besides, and puts a start or kill it finds in the inbox.
        A parked job wakes for nothing else, so a thousand of them cost the worker and
        Redis next to nothing.
        """
        loop = asyncio.get_running_loop()
        assert self.sub is not None
        if self.claim.start_flag:
            return "start"
        sweep = self.ctx.flag_sweep
        sweep.add(self.job_id, inbox)  # before the look below: no sweep from here on misses it
        deadline = self.claim.claimed_at + self.ctx.settings.worker_warmup_ms / 1000
        stopping = asyncio.ensure_future(self.ctx.stopping.wait())
        getter: asyncio.Future[CtrlMessage] | None = None
        try:
            if self.ctx.control.generation != self.sub.generation:
                # Replaced since the subscription, maybe before the claim read the flags:
                # what the old connection carried is lost, and no sweep has looked yet.
                signal = await self._durable_signal()
                if signal is not None:
                    return signal
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    # One last look: a start may have landed while the subscription was busy.
                    signal = await self._close_park()
                    if signal is not None:
                        return signal
                    deadline, left = loop.time() + CLOSE_PARK_RETRY_S, CLOSE_PARK_RETRY_S
                if getter is None:
                    getter = next_item(inbox)
                done, _ = await asyncio.wait({getter, stopping}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    item, getter = getter.result(), None
                    if item.type in ("start", "kill"):
                        return item.type
                    continue
                if stopping in done:
                    return "handback"
        finally:
            sweep.discard(self.job_id, inbox)
            stopping.cancel()
            if getter is not None:
                getter.cancel()

    # ------------------------------------------------------------------ compile

    async def _compile(
        self,
        inbox: asyncio.Queue[CtrlMessage],
        plan: Plan,
        sandbox: Sandbox | None = None,
        events: JobEvents | RecordedEvents | None = None,
    ) -> tuple[StepFacts, CompileInfo]:
        """Compile in `sandbox` (the job's), emitting to `events` (the job's; a recording
        when compiling while parked)."""
        assert plan.compile is not None and plan.compile_limits is not None
        sandbox = sandbox or self.sandbox
        events = events or self.events
        assert sandbox is not None
        jail, cgroup = sandbox.compile_jail, sandbox.compile_cgroup
        assert jail is not None and cgroup is not None
        await events.stage("compiling")
        output = CompileOutput(plan.compile_output_kb * 1024)

        flusher = OutputFlusher(events)

        async def on_stdout(data: bytes) -> None:
            flusher.add("compile_output", output.feed(data, "stdout"))
            await flusher.room()

        async def on_stderr(data: bytes) -> None:
            flusher.add("compile_output", output.feed(data, "stderr"))
            await flusher.room()

        async def close_stdin(_activity: Activity) -> None:
            if jail.proc.stdin is not None:
                jail.proc.stdin.close()

        limits = plan.compile_limits
        try:
            try:
                facts = await supervise(
                    jail,
                    cgroup,
                    plan.compile,
                    Clocks(wall_ms=limits.wall_time_ms, cpu_ms=limits.cpu_ms, idle_ms=limits.idle_ms),
                    [(jail.stdout, on_stdout), (jail.stderr, on_stderr)],
                    inbox,
                    feed_stdin=close_stdin,
                    sink=flusher.task,
                    memory=self.ctx.sandboxes.memory,
                    # Compiling while parked: the job may never start, so started jobs go
                    # first (until it starts).
                    parked_until=events.started if isinstance(events, RecordedEvents) else None,
                    output_spent=output.spent,
                )
            finally:
                jail.let_go()  # (its gate waits after its report: this jail has done its part)
            flusher.add("compile_output", output.flush())
            await flusher.close()
        finally:
            flusher.abort()
        return facts, compile_info(facts, output)

    async def _finish_compile_failure(self, facts: StepFacts, compiled: CompileInfo) -> None:
        verdict = judge_compile_failure(facts)
        if verdict.outcome is Outcome.INTERNAL_ERROR:
            log.error("job %s: %s", self.job_id, verdict.message)
        await self._finish(verdict.outcome, result_without_run(verdict.outcome, verdict.message, compiled))

    # ------------------------------------------------------------------ run

    def _grace_too_short(self) -> bool:
        """The worker is stopping, and what is left of its grace is less than the job's
        program may run (its wall clock; a batch's cases, several of them)."""
        if not self.ctx.stopping.is_set():
            return False
        if self.spec.tests:
            return True
        left_ms = (self.ctx.grace_ends_at - asyncio.get_running_loop().time()) * 1000
        return left_ms < self.spec.limits.wall_time_ms

    async def _mark_running(self, then_go_live: bool = False) -> None:
        """The running stage, and the record's `started` (never re-run from here on).
        `then_go_live`: no fenced write came before it at start (see execute)."""
        self._program_started = True  # from here on, never hand it back (it may have run)
        await self.events.stage("running", state=JobState.RUNNING, started=True)
        if then_go_live:
            await self.events.go_live_at_start(LIVE_HOLD_S)

    async def _run(
        self,
        inbox: asyncio.Queue[CtrlMessage],
        stdin: asyncio.Queue[StdinFrame],
        program: Program,
        compiled: CompileInfo | None = None,
    ) -> StepFacts:
        jail, limits = self.sandbox.jail, self.spec.limits
        if self._running_stage is not None:
            await self._running_stage  # started while the sandbox was loaded
        else:
            await self._mark_running()
        feed = StdinFeed(
            self.ctx.queue,
            self.job_id,
            self.claim.attempt,
            stdin,
            self.spec.stdin.encode() if self.spec.stdin else None,
            # EOF after the up-front input, if any: closeStdin (the API's default is to
            # close when stdin was given, keep open when it was not).
            close_after_upfront=self.spec.close_stdin,
            # Counted by the claim, with the subscription in place: any stored later is also
            # published to it, so with none the feeder reads the stream only when it must.
            stored_before=self.claim.stdin_frames,
            watch=self.ctx.control.watch(self.sub.generation) if self.sub is not None else None,
        )

        flusher = OutputFlusher(self.events)

        async def on_stdout(data: bytes) -> None:
            flusher.add("stdout", self.budget.feed("stdout", data))
            await flusher.room()

        async def on_stderr(data: bytes) -> None:
            self._stderr_tail.feed(data)
            flusher.add("stderr", self.budget.feed("stderr", data))
            await flusher.room()

        async def feed_stdin(activity: Activity) -> None:
            assert jail.proc.stdin is not None
            await feed.run(jail.proc.stdin, activity)

        def went(at: float) -> None:
            self._program_started_at = at

        facts: StepFacts | None = None
        try:
            facts = await supervise(
                jail,
                self.sandbox.cgroup,
                program,
                Clocks(wall_ms=limits.wall_time_ms, cpu_ms=limits.cpu_ms, idle_ms=limits.idle_ms),
                [(jail.stdout, on_stdout), (jail.stderr, on_stderr)],
                inbox,
                feed_stdin=feed_stdin,
                sink=flusher.task,
                memory=self.ctx.sandboxes.memory,
                # A prestarted runtime's own memory was there before start: not the job's
                # (nor is the start-up of a plain one's runtime: Sandbox.load).
                uncharged=self.sandbox.uncharged,
                output_spent=self.budget.spent,
                drain_on_stop_s=FINISH_ON_CANCEL_S,
                on_go=went,
            )
            for stream in ("stdout", "stderr"):
                flusher.add(stream, self.budget.flush(stream))
            await flusher.close()
            # Only now: a run whose last output never reached the log is not reported as if
            # all of it had (a cancel during this flush: see below).
            self._ran = (facts, compiled)
        except StepStopped as stopped:
            # The stop came once the program had ended, while its output was still being
            # handed over: with all of it read (facts), its flush below decides.
            facts = stopped.facts
            raise
        finally:
            feed.stop()
            if await self._settle_output(flusher) and facts is not None and self._ran is None:
                # The program had ended by itself, and the stop came during its last flush,
                # which went through all the same: the run keeps its own verdict.
                self._ran = (facts, compiled)
        assert facts is not None  # (supervise returned, or this was not reached)
        return facts

    async def _settle_output(self, flusher: OutputFlusher) -> bool:
        """A run cut short (cancelled by its worker's stop, or failed elsewhere) still logs
        what its budget kept, for a bounded time: the stored result is the budget's, and must
        hold no byte that its log and its live view did not. Whether all of it went (False
        when the flusher had stopped already)."""
        if flusher.task.done():
            return False
        for stream in ("stdout", "stderr"):
            flusher.add(stream, self.budget.flush(stream))
        return await asyncio.shield(flusher.drain(FINISH_ON_CANCEL_S))

    async def _keep_artifacts(self, before: set[bytes]) -> None:
        """Store the files the program left and announce each (before the result)."""
        assert self.sandbox is not None
        limits, settings = self.spec.limits, self.ctx.settings
        path = str(self.sandbox.workspace.path)
        try:
            # Most programs leave nothing new: then this one listing is all, with no trip to
            # the isolation threads (which read the files, when there are any).
            if not top_level_names(path) - before:
                return
            # maxArtifactBytes bounds all of them together, as in the seed product.
            total = min(limits.max_artifact_bytes, self.ctx.sandboxes.workspace_bytes)
            collected = await off_loop(collect_artifacts, path, before, limits.max_artifacts, total, total)
        except OSError as exc:
            log.warning("job %s: could not read its artifacts: %s", self.job_id, exc)
            return
        self._artifacts_truncated = collected.truncated
        if not collected.files:
            return
        # (Valid as long as the result: written later, at the latest FINISH_RETRY_S on.)
        expires = int(time.time()) + settings.run_result_ttl_s + int(FINISH_RETRY_S)
        store = RedisArtifactStore(self.ctx.queue.redis)
        kept: list[ArtifactMeta] = []
        try:
            for index, (name, data) in enumerate(collected.files):
                meta = ArtifactMeta(
                    name=name,
                    mime_type=guess_mime_type(name, data[:16]),
                    bytes=len(data),
                    url=sign_artifact(settings.pusher_secret, self.job_id, index, expires, settings.public_api_url),
                )
                if not await store.put(self.job_id, self.claim.attempt, index, _encoder.encode(meta), data, settings.run_result_ttl_s + 60):
                    raise Fenced(self.job_id)
                kept.append(meta)
        except RedisError as exc:
            log.warning("job %s: storing its artifacts failed: %s", self.job_id, exc)
            self._artifacts_truncated = True
        self._artifacts = kept
        await self.events.emit(
            [("artifact", lambda seq, m=meta: ArtifactEvent(**msgspec.structs.asdict(m), seq=seq)) for meta in kept]
        )

    async def _run_batch(self, ctrl: asyncio.Queue[CtrlMessage], plan: Plan, compiled: CompileInfo | None) -> None:
        """A test batch: every case in a fresh sandbox with what the compile left, judged."""
        self._compiled = compiled
        first = self.sandbox
        assert first is not None
        files, executable = plan.files, frozenset[str]()
        packed: Packed | None = None
        if plan.compile is not None:
            try:
                files, executable = await off_loop(first.workspace.snapshot, self.ctx.sandboxes.workspace_bytes)
                # A big one is copied into each case from one archive, charged under the ceiling.
                packed = await off_loop(pack_if_big, files, executable)
                if packed is not None:
                    files = []
            except SnapshotTooBig as exc:
                # (A Java package of 70 components, say: it compiled, but cannot be copied.)
                await self._finish_without_run(Outcome.COMPILE_ERROR, f"the compiled program cannot be copied into the test cases: {exc}")
                return
            except (WorkspaceError, OSError) as exc:
                await self._finish_without_run(Outcome.INTERNAL_ERROR, f"could not copy the compiled program: {exc}")
                return
        self._program_started = True
        await self.events.stage("running", state=JobState.RUNNING, started=True)
        # From here the batch gives every sandbox back itself, the first one included; until
        # here (a failure, a cancel, a lost lease) execute's own teardown destroys it.
        self.sandbox, self._destroyed = None, True
        self._batch = BatchProgress(self.spec.tests or [], asyncio.get_running_loop().time())
        batch = await run_batch(
            spec=self.spec,
            manifest=plan.manifest,
            entry=plan.entry,
            sources=plan.sources,
            program_rlimits=self.ctx.sandboxes.program_rlimits(self.spec.limits),
            adoptable=plan.run.adoptable,
            first=first,
            files=files,
            executable=executable,
            pool=self.ctx.pool,
            events=self.events,
            ctrl=ctrl,
            keep_output=self.spec.collect_output,
            budget_ms=self.ctx.settings.worker_batch_wall_ms,
            progress=self._batch,
            memory=self.ctx.sandboxes.memory,
            packed=packed,
        )
        await self._finish_batch(batch, compiled)

    async def _finish_batch(self, batch: BatchResult, compiled: CompileInfo | None, message: str | None = None) -> None:
        self._batch_cases = batch.cases
        outcome = Outcome.KILLED if batch.killed else Outcome.TIMED_OUT if batch.timed_out else Outcome.COMPLETED
        if batch.timed_out and message is None:
            budget_ms = self.ctx.settings.worker_batch_wall_ms
            message = f"the batch ran past its time budget ({budget_ms} ms): cases not done by then were skipped"
        event = ResultEvent(
            exit_code=None,
            signal="SIGKILL" if batch.killed or batch.timed_out else None,
            timed_out=batch.timed_out,
            idle_timed_out=False,
            truncated=any(case.truncated for case in batch.cases),
            duration_ms=batch.duration_ms,
            cpu_ms=batch.cpu_ms,
            memory_kb=batch.memory_kb,
            outcome=outcome,
            compile=compiled,
            seq=0,
            killed_by="user" if batch.killed else "wall" if batch.timed_out else None,
            message=message,
            summary=batch.summary,
            tests=result_facts(batch.cases),
        )
        await self._finish(outcome, event)

    # ------------------------------------------------------------------ finish

    async def _destroy(self) -> None:
        """Kill and remove everything the job had (processes, cgroups, workspace); its slot
        then builds the next sandbox."""
        if not self._destroyed and self.sandbox is not None:
            self._destroyed = True
            self.ctx.pool.retiring(self.sandbox.slot)
            try:
                await self.sandbox.destroy()
            finally:
                self.ctx.pool.rearm(self.sandbox.slot)

    async def _finish_run(self, facts: StepFacts, compiled: CompileInfo | None) -> None:
        heap = self._heap_limit
        verdict = judge_run(
            facts, heap is not None and heap.ran_out(facts.exit.exit_code, facts.exit.signal, self._stderr_tail.data)
        )
        if verdict.outcome is Outcome.INTERNAL_ERROR and facts.exit.program_ran:
            # The sandbox failed under a program that ran: it may have done its work, which
            # SPEC's internal_error ("before user code ran": safe to submit again) denies.
            # (A jail that failed before its exec, the gate's own failures, is internal_error.)
            verdict = dataclasses.replace(verdict, outcome=Outcome.LOST)
        signal = facts.exit.signal
        if verdict.outcome == Outcome.KILLED and signal is None:
            signal = "SIGKILL"  # the whole cgroup got SIGKILL; nsjail may only say the gate ended
        event = ResultEvent(
            exit_code=facts.exit.exit_code if signal is None else None,
            signal=signal,
            timed_out=verdict.timed_out,
            idle_timed_out=verdict.idle_timed_out,
            truncated=self.budget.truncated,
            duration_ms=facts.duration_ms,
            cpu_ms=facts.cpu_ms,
            memory_kb=facts.memory_kb,
            outcome=verdict.outcome,
            compile=compiled,
            seq=0,
            killed_by=verdict.killed_by,  # type: ignore[arg-type]
            message=verdict.message,
        )
        await self._finish(verdict.outcome, event)

    async def _finish_without_run(self, outcome: Outcome, message: str | None) -> None:
        await self._finish(outcome, self._result_so_far(outcome, message))

    async def _finish(self, outcome: Outcome, event: ResultEvent) -> None:
        if self._finished:
            return
        self._finished = True
        if self.spec.tests and event.tests is None:
            # A batch that ended before its cases ran (compile error, killed, expired, a
            # failure), or before they all did (a failure of the worker in mid-batch: the
            # cases that ran keep their verdicts): every case, and the summary, are there.
            ran = self._batch.results if self._batch is not None else ()
            self._batch_cases, summary = cases_not_run(self.spec.tests, outcome, ran)
            event = msgspec.structs.replace(event, tests=result_facts(self._batch_cases), summary=summary)
        # The seq is taken inside the shielded write: a cancel while it waits for the events
        # lock (an append retrying through a Redis blip) must not leave the job without a
        # result, ended `lost` by recovery.
        store = asyncio.ensure_future(self._store_result(outcome, event))
        cancelled = False
        try:
            stored = await asyncio.shield(store)
        except asyncio.CancelledError:
            # The worker is stopping and cancelled its jobs while this one's result was being
            # stored (retrying through a Redis blip): it gets a moment more, as each write
            # does under a hard stop, so the job ends with its result rather than `lost`.
            cancelled = True
            try:
                stored = await asyncio.wait_for(store, FINISH_ON_CANCEL_S)
            except (TimeoutError, Exception):
                log.error("job %s: the worker stopped before the result could be stored", self.job_id)
                raise asyncio.CancelledError from None
        if stored is not None:
            result_json, event, written = stored
            if self.spec.callback_url:
                self.ctx.callback_due()  # the result write queued its delivery
            # The result is stored: a cancel now (the worker told twice to stop) must not
            # keep it from its live followers. The log's earlier events get a moment to go
            # out first; the result goes out whatever happens to them.
            live = asyncio.ensure_future(self._go_live_with_result())
            try:
                await asyncio.shield(live)
            except asyncio.CancelledError:
                cancelled = True
                # Not wait_for: it waits out the cancel it sends, which a read retrying
                # through an outage may take long to honour.
                await asyncio.wait({live}, timeout=FINISH_ON_CANCEL_S)
                if not live.done():
                    live.cancel()
                    log.warning("job %s: its earlier events did not go live before the stop", self.job_id)
            finally:
                self._publish_result(outcome, result_json, event, written)
        if cancelled:
            raise asyncio.CancelledError

    async def _store_result(self, outcome: Outcome, event: ResultEvent) -> tuple[bytes, ResultEvent, Written] | None:
        """Number and write the result (retrying through Redis outages up to FINISH_RETRY_S).
        Returns its JSON, its event (the seq in it) and what the write said (whether anyone
        followed the job as it was written, and whether the write published the result),
        once written; None if it was not (the claim is then left to recovery, or the job is
        no longer this worker's)."""
        seq = await self.events.take_result_seq()
        output = (bytes(self.budget.data["stdout"]), bytes(self.budget.data["stderr"]))
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FINISH_RETRY_S
        delay = 0.1
        while True:
            event, result_json = fit_result(
                msgspec.structs.replace(event, seq=seq), self.ctx.settings.pusher_max_payload_kb * 1024
            )
            output_json = _encoder.encode(self._stored_output(event)) if self.spec.collect_output else None
            publish = self.events.result_publish(result_json)
            write = self.ctx.queue.finish(
                self.job_id,
                self.claim.attempt,
                OUTCOME_STATE[outcome],
                seq,
                result_json,
                output_json,
                output,
                owner=self.spec.owner,
                kept_bytes=self.events.stored_bytes
                # (the result: in the log and in the job's record)
                + logged_bytes(len(result_json)) + len(result_json)
                + (sum(map(len, output)) if output_json else 0)
                # (the pullable result's own JSON: a batch's cases keep their output in it)
                + (len(output_json) if output_json else 0)
                + sum(meta.bytes for meta in self._artifacts),
                publish=publish,
                artifacts=len(self._artifacts),
            )
            if self.sandbox is not None:
                # The jail's teardown (gate.c, linger) starts as the result goes out: after
                # the figures were read and the result built, beside its write and publish.
                self.sandbox.jail.let_go()
            try:
                # Told twice to stop, the worker gives each write a moment, not minutes.
                written = await (asyncio.wait_for(write, 2.0) if self.ctx.hard_stop.is_set() else write)
            except LogAhead as ahead:
                # An append this job stopped waiting for (cancelled mid-write) did land.
                log.warning("job %s: result seq %d is taken in the log; numbering it %d", self.job_id, seq, ahead.next_seq)
                seq = self.events.result_seq_from(ahead.next_seq)
                continue
            except (RedisError, OSError, TimeoutError) as exc:
                stored = await self._stored_already(result_json) if self.ctx.hard_stop.is_set() else None
                if stored is not None:
                    # The write landed and only its answer was lost or late: no retry comes
                    # under a hard stop to find that out, so look.
                    return result_json, event, Written(heard=True, published=stored)  # (heard: unknown, so publish)
                if loop.time() > deadline or self.ctx.hard_stop.is_set():
                    # The claim stays in this worker's list: whoever recovers it (this worker
                    # restarted with its id, or any other once this one's lease is gone)
                    # ends it `lost` if it had started, else queues it again.
                    log.error("job %s: could not store the result: %s", self.job_id, exc)
                    return None
                log.warning("job %s: storing the result failed (%s); retrying in %.1fs", self.job_id, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            if written is None:
                log.warning("job %s: result not written (lease lost or job already ended)", self.job_id)
                return None
            return result_json, event, written

    async def _stored_already(self, result_json: bytes) -> bool | None:
        """Whether the job's record holds this very result (one quick read): None if not (or
        unknown), else whether its write published it."""
        try:
            stored, published = await asyncio.wait_for(self.ctx.queue.stored_result(self.job_id), 1.0)
        except (RedisError, OSError, TimeoutError):
            return None
        return published if stored == result_json else None

    async def _go_live_with_result(self) -> None:
        """A job that ends without having started (expired, killed) has its parked events
        published now, before its result (which a second claim's log already holds: it is
        published by _publish_result, once)."""
        try:
            await self.events.go_live()
        except (RedisError, OSError) as exc:
            log.warning("job %s: could not read its event log to publish it: %s", self.job_id, exc)

    def _publish_result(self, outcome: Outcome, result_json: bytes, event: ResultEvent, written: Written) -> None:
        if written.published:
            self.events.published_result(result_json)
        else:
            self.events.publish("result", result_json, written.heard)
            # (The write put it on this worker's unpublished set: see the lane's close below.)
            self._owes_result_live = written.heard
        log.info(
            "job %s: %s exit=%s signal=%s %dms cpu=%dms mem=%dKiB",
            self.job_id, outcome.value, event.exit_code, event.signal, event.duration_ms, event.cpu_ms, event.memory_kb,
        )  # fmt: skip

    def _stored_output(self, event: ResultEvent) -> StoredOutput:
        shared = {f: getattr(event, f) for f in Verdict.__struct_fields__}
        if self._compile_streams is not None:
            shared["compile"] = self._compile_streams
        return StoredOutput(
            **shared,
            stdout_encoding=output_encoding(bytes(self.budget.data["stdout"])),
            stderr_encoding=output_encoding(bytes(self.budget.data["stderr"])),
            stdout_bytes=len(self.budget.data["stdout"]),
            stderr_bytes=len(self.budget.data["stderr"]),
            artifacts=[msgspec.to_builtins(meta) for meta in self._artifacts],
            artifacts_truncated=self._artifacts_truncated,
            tests=self._batch_cases,
            seq=event.seq,
        )

    async def _abort(self, message: str, outcome: Outcome | None = None) -> None:
        if outcome is None and self._ran is not None and not self._finished:
            # The program had ended by itself (what failed came after: its artifacts, its
            # result's write): its own verdict stands, if it can still be written.
            try:
                await self._finish_run(*self._ran)
            except Exception:
                log.exception("job %s: could not record its run", self.job_id)
            if self._finished:
                return  # (its sandbox goes in the run's own teardown)
        if outcome is None:
            # SPEC: internal_error says no user code ran, so the job is safe to submit again;
            # past the program's go (or a batch's first case) that is no longer true, and the
            # job is lost. Marked running is not enough: a failure between that mark and the
            # go (the mark's own append given up in an outage, a cgroup read before the go)
            # ran nothing of the user's, as a stop there is judged (_cancelled).
            ran = self._program_started_at is not None or self._batch is not None
            outcome = Outcome.LOST if ran else Outcome.INTERNAL_ERROR
        result = self._result_so_far(outcome, message)  # (its time: not the teardown's)
        try:
            await self._destroy()
        except Exception:
            log.exception("job %s: teardown failed", self.job_id)
        if not self._finished:
            try:
                await self._finish(outcome, result)
            except Exception:
                log.exception("job %s: could not record the failure", self.job_id)

    def _result_so_far(self, outcome: Outcome, message: str | None) -> ResultEvent:
        """The result of a job that ended (failed, killed, stopped) without a verdict of its
        run: what is known. A compile that ran is reported; a program that was launched ran
        for a while and may have had its output cut (its CPU and memory went with its
        sandbox's counters: 0); a batch has its finished cases' figures."""
        event = result_without_run(outcome, message, self._compiled)
        now = asyncio.get_running_loop().time()
        if self._batch is not None:
            ran = [case for case in self._batch.results if case is not None]
            return msgspec.structs.replace(
                event,
                duration_ms=max(0, round((now - self._batch.started_at) * 1000)),
                cpu_ms=self._batch.cpu_ms,
                memory_kb=self._batch.memory_kb,
                truncated=any(case.truncated for case in ran),
            )
        if self._program_started_at is None:
            return event
        ran_ms = round((now - self._program_started_at) * 1000)
        if self.sandbox is not None:
            ran_ms -= self.sandbox.uncharged.wall_ms  # (as supervise leaves it out: a plain jail's start-up)
        return msgspec.structs.replace(event, duration_ms=max(0, ran_ms), truncated=self.budget.truncated)
