"""Compile (or just load) while parked: a job borrows a spare warm sandbox before its start.

An IDE user of C or Java otherwise waits for the compiler after pressing Run. While the
job is parked (claimed, no start yet), it may borrow a sandbox nobody else needs (plain,
or primed with a runtime its run can adopt, such as a waiting JVM)
(the pool lends only when no started job waits and one slot stays free for started
jobs), write its files and compile there. Its events are recorded, not logged: at start
they are logged and published in order (the compile stage, its output), and a compile
still under way streams live from then on and can be killed like any compile. The run
follows in the same sandbox, so nothing a client sees changes except the wait. A failed
compile gives its sandbox back at once and keeps its verdict for the start.

An interpreted job has nothing to compile, but its files and limits can still go in before
start, so its start only releases the gate. It borrows only a sandbox that is ready at
that moment (it never waits for one, nor has one rebuilt for it): loading costs a started
job a millisecond or two, not worth holding a slot for.

A parked job whose sandbox a started job needs (none ready) is recalled: its compile is
stopped, its sandbox destroyed (the slot rebuilds), and it compiles (or loads) after its
start like any other. A kill, an expiry or a hand-back while parked discards the borrowed
sandbox; so does its jail's end (the job then compiles, or loads, after its start).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Awaitable, Callable

from shared.messages import CompileInfo, CtrlMessage
from worker.isolation.jail import JailError, Program
from worker.isolation.pool import SandboxPool
from worker.isolation.sandbox import Sandbox
from worker.job.outcome import compile_succeeded
from worker.job.supervise import StepFacts
from worker.messaging.inbox import next_item
from worker.tasks import cancel_and_wait

__all__ = ["Precompile", "PrecompileState", "RecordedEvents"]

log = logging.getLogger(__name__)


class RecordedEvents:
    """Stands in for JobEvents while parked: keeps a compile's events, in order, for start.

    At start, `forward_to` logs what was recorded and sends everything after it straight on,
    so a compile still under way streams live from then on.
    """

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self._calls: list[tuple[str, object]] = []
        self._target = None
        self._lock = asyncio.Lock()
        self.sent = False  # anything went on to the job's events (a client may have seen it)
        # Set at the job's start (forward_to): its compile is no longer speculative.
        self.started = asyncio.Event()

    async def stage(self, phase: str) -> None:
        async with self._lock:
            if self._target is not None:
                self.sent = True
                await self._target.stage(phase)
            else:
                self._calls.append(("stage", phase))

    async def chunk_runs(self, runs: list[tuple[str, str]]) -> None:
        if not runs:
            return
        async with self._lock:
            if self._target is not None:
                self.sent = True
                await self._target.chunk_runs(runs)
            else:
                self._calls.append(("chunks", list(runs)))

    async def forward_to(self, events) -> None:  # type: ignore[no-untyped-def]
        """Log (and, once live, publish) what was recorded, in order; then pass all on."""
        async with self._lock:
            calls, self._calls = self._calls, []
            self.sent = self.sent or bool(calls)
            for kind, arg in calls:
                if kind == "stage":
                    await events.stage(arg)
                else:
                    await events.chunk_runs(arg)
            self._target = events
            self.started.set()


class PrecompileState(enum.Enum):
    WAITING = "waiting"  # for a spare sandbox
    COMPILING = "compiling"
    COMPILED = "compiled"  # success; the sandbox is held for the run
    LOADED = "loaded"  # nothing to compile: files and limits are in, the sandbox is held
    FAILED = "failed"  # the compile's verdict is kept; the sandbox is given back
    GONE = "gone"  # recalled, or broke: the job compiles after start


Load = Callable[[Sandbox], Awaitable[None]]
Compile = Callable[[asyncio.Queue[CtrlMessage], Sandbox, RecordedEvents], Awaitable[tuple[StepFacts, CompileInfo]]]


class Precompile:
    """`compile_` None: only load (an interpreted job)."""

    def __init__(
        self, job_id: str, pool: SandboxPool, load: Load, compile_: Compile | None, program: Program, language: str
    ) -> None:
        self.job_id = job_id
        self._pool = pool
        self._load = load
        self._compile = compile_
        self._program = program
        self._language = language
        self.events = RecordedEvents(job_id)
        self.state = PrecompileState.WAITING
        self.sandbox: Sandbox | None = None
        self.facts: tuple[StepFacts, CompileInfo] | None = None
        self._failure: Exception | None = None
        self._settling = False  # (from here the start decides what a jail's end means)
        # The compile's own control queue: a kill after start reaches it here.
        self._inbox: asyncio.Queue[CtrlMessage] = asyncio.Queue()
        self._task = asyncio.create_task(self._work(), name=f"precompile:{job_id}")

    def _recall(self) -> None:
        if self.state is PrecompileState.WAITING and not self._task.done():
            # Lent a sandbox, but recalled in the same turn, before this resumed to use it:
            # cancelled, the borrow hands the sandbox on (to the started job that recalled it).
            self._task.cancel()
            self.state = PrecompileState.GONE
            return
        if self.state in (PrecompileState.COMPILING, PrecompileState.COMPILED, PrecompileState.LOADED):
            log.info("job %s: a started job needs the sandbox; compiling after start instead", self.job_id)
            self._task.cancel()
            self.state = PrecompileState.GONE
            if self.sandbox is not None and self._task.done():
                self._release()

    async def _work(self) -> None:
        try:
            if self._compile is None:
                self.sandbox = self._pool.lend_ready(self._recall, self._program, self._language)
                if self.sandbox is None:
                    self.state = PrecompileState.GONE
                    return
            else:
                self.sandbox = await self._pool.borrow(self._recall, self._program, self._language)
            self.state = PrecompileState.COMPILING
            await self._load(self.sandbox)
            if self._given_back():
                self._release()  # (a recall's: it leaves the release to this task)
                return
            if self._compile is None:
                self.state = PrecompileState.LOADED
                log.info("job %s: loaded while parked", self.job_id)
                self._watch_the_jail()
                return
            facts = await self._compile(self._inbox, self.sandbox, self.events)
            if self._given_back():
                self._release()  # (a recall's: it leaves the release to this task)
                return
        except asyncio.CancelledError:
            self.state = PrecompileState.GONE
            self._release()
            raise
        except Exception as exc:
            log.exception("job %s: compiling while parked failed", self.job_id)
            self._failure = exc
            self.state = PrecompileState.GONE
            self._release()
            return
        self.facts = facts
        log.info("job %s: compiled while parked (%d ms)", self.job_id, facts[0].duration_ms)
        if compile_succeeded(facts[0]):
            self.state = PrecompileState.COMPILED
            self._watch_the_jail()
        else:
            self.state = PrecompileState.FAILED
            self._release()

    def _given_back(self) -> bool:
        """Whether the sandbox went back while the load or the compile went on (a recall, a
        kill or an expiry whose cancel came too late for them, the step having swallowed
        it): what they did is not this job's any more."""
        return self.state is PrecompileState.GONE or self.sandbox is None

    def _watch_the_jail(self) -> None:
        assert self.sandbox is not None
        self.sandbox.jail.ended.add_done_callback(self._jail_ended)

    def _jail_ended(self, ended: object) -> None:
        """The held sandbox's jail ended while the job waited (the host's OOM killer, say):
        give it back now, so its slot rebuilds, and the job compiles (or loads) after start
        like a recalled one. (Its compile's events were only recorded: nothing went out.)

        Removing this callback (`_release`, `take`) does not stop one already scheduled (a
        future's callbacks run a turn after it is set): each call checks that the sandbox it
        was about is still the one held, and that the start has not begun."""
        if self.sandbox is None or ended is not self.sandbox.jail.ended:
            return  # (that sandbox went back, or went to the started job, meanwhile)
        if self._settling or self.state not in (PrecompileState.COMPILED, PrecompileState.LOADED):
            return  # started: `settle` decides (its recorded events may be going out already)
        log.warning("job %s: the sandbox it %s in while parked has ended", self.job_id, self.state.value)
        self.state = PrecompileState.GONE
        self._release()

    async def load_within(self, timeout_s: float) -> None:
        """Give a load under way (an interpreted job's; never a compile) up to `timeout_s`
        to end. Nothing is cancelled, and the job's control messages are not read: a kill
        meanwhile waits in its queue for `settle` and the run."""
        if self._compile is None and self.state is PrecompileState.COMPILING:
            await asyncio.wait({self._task}, timeout=timeout_s)

    def _release(self) -> None:
        if self.sandbox is not None:
            sandbox, self.sandbox = self.sandbox, None
            sandbox.jail.ended.remove_done_callback(self._jail_ended)
            self._pool.give_back(sandbox)

    async def settle(self, ctrl: asyncio.Queue[CtrlMessage], events) -> str:  # type: ignore[no-untyped-def]
        """At start: the compile's events go to `events` (live from now on) and a compile
        under way is waited for, a kill reaching it as it would after start. Returns the
        final state's value: "compiled", "loaded", "failed" (a kill included) or "gone"
        (nothing was sent on: the job compiles after start, as after a break before any of
        its events went on). A compile that breaks once some of its events went on raises
        what broke it."""
        self._settling = True
        if self._held_jail_ended():
            # Ended before the start, its give-back not yet run (it comes a turn later).
            return await self._drop_ended_sandbox()
        if self.state in (PrecompileState.WAITING, PrecompileState.GONE):
            # Never got a sandbox, or gave it back: compile after start as usual (what a
            # recalled compile recorded is dropped with it).
            await self.discard()
            return "gone"
        if self.sandbox is not None:
            self._pool.keep(self.sandbox)  # the job has started: no recall from here on
        await self.events.forward_to(events)
        kept: list[CtrlMessage] = []
        while not self._task.done():
            message = next_item(ctrl)
            try:
                done, _ = await asyncio.wait({self._task, message}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not message.done():
                    message.cancel()  # the compile ended first, or this wait was cancelled
            if message in done:
                if message.result().type == "kill":
                    # A compile sees it now; a load is short, and the run sees it next.
                    (self._inbox.put_nowait if self._compile is not None else kept.append)(message.result())
                continue
            if message.done() and not message.cancelled():
                kept.append(message.result())
        while not self._inbox.empty():
            # A kill sent on to a compile that ended before it could act on it.
            kept.append(self._inbox.get_nowait())
        for message in kept:
            ctrl.put_nowait(message)  # keep a kill for the run to see
        if self._failure is not None and self.events.sent:
            # Its events went out: compiling again would show the client the compile twice.
            # The job ends as a compile that breaks after start does.
            raise self._failure
        if self._held_jail_ended():
            # Ended as the job started, while the recorded compile went out (or still ran).
            return await self._drop_ended_sandbox()
        if self.state in (PrecompileState.COMPILED, PrecompileState.LOADED) and self.sandbox is not None:
            return self.state.value
        return "failed" if self.state is PrecompileState.FAILED else "gone"

    async def _drop_ended_sandbox(self) -> str:
        """The held sandbox's jail ended. With nothing of its compile sent on, "gone": the
        job loads or compiles again after start. Its compile's events sent, compiling again
        would show the client the compile twice, so the job fails as the platform's."""
        log.warning("job %s: the sandbox it %s in while parked has ended", self.job_id, self.state.value)
        sent = self.events.sent
        await self.discard()
        if sent:
            raise JailError("the sandbox the job was compiled in ended before it could run")
        return "gone"

    def _held_jail_ended(self) -> bool:
        return (
            self.state in (PrecompileState.COMPILED, PrecompileState.LOADED)
            and self.sandbox is not None
            and self.sandbox.jail.ended.done()
        )

    def take(self) -> Sandbox:
        """The sandbox the compile ran in, now the started job's."""
        assert self.sandbox is not None
        sandbox, self.sandbox = self.sandbox, None
        sandbox.jail.ended.remove_done_callback(self._jail_ended)
        return sandbox

    async def discard(self) -> None:
        """The job will not use what was compiled (killed, expired, handed back)."""
        await cancel_and_wait([self._task])
        self.state = PrecompileState.GONE
        if self._task.done():
            self._release()
        else:
            # A step that outlived the bounded wait (a load queued behind slow work on the
            # isolation threads: it finishes whatever the cancel says) may still write into
            # the sandbox. Given back now, it would be torn down and its slot rebuilt at the
            # same mount point and uid, where that load's files would land in the next job's
            # workspace: it goes back once the step is over.
            self._task.add_done_callback(lambda _task: self._release())
