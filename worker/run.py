"""The life of one claimed job: load, park, start, run under the clocks, report once.

    claim (with the slot's ready sandbox) ─ subscribe ─ stage{queued} ─ load files + limits
      └─ park: wait for start (durable flag or ctrl message) ≤ warm-up
    start ─ starting ─ stage{running} (started=1 in Redis first) ─ go ─ stream ─ exit
    kill the cgroup ─ read counters ─ one result (atomic, fenced) ─ destroy the sandbox

The jail was built before the job existed (worker/sandbox.py), so start→first byte is one
pipe write plus the program's own start-up. Exactly one result is written by `_finish`; every
path out of `execute` goes through it, except losing the job to another worker (Fenced),
where writing anything would be wrong.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import msgspec

from shared import keys
from shared.errors import ValidationError
from shared.manifest import expand_argv
from shared.messages import (
    OUTCOME_STATE,
    CtrlMessage,
    JobSpec,
    JobState,
    Outcome,
    ResultEvent,
    RunResult,
)
from shared.validation import decode_files
from worker.context import WorkerContext
from worker.events import JobEvents
from worker.jail import Jail, JailExit, Program
from worker.output import OutputBudget, exact_text
from worker.queue import Claim, Fenced
from worker.sandbox import Sandbox
from worker.workspace import WorkspaceError

__all__ = ["JobRun"]

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()

CPU_POLL_S = 0.05
READ_SIZE = 65536
EXIT_GRACE_S = 5.0
FINISH_RETRY_S = 30.0


class PlatformError(Exception):
    """The platform failed before user code ran (becomes outcome internal_error)."""


@dataclass
class RunFacts:
    """What the supervision of a run observed."""

    exit: JailExit
    fired: str | None  # "wall" | "cpu" | "idle" | "user" | None
    duration_ms: int
    cpu_ms: int
    memory_kb: int
    oom_kills: int


class JobRun:
    def __init__(self, ctx: WorkerContext, claim: Claim, sandbox: Sandbox) -> None:
        self.ctx = ctx
        self.claim = claim
        self.spec: JobSpec = claim.spec
        self.job_id = claim.spec.job_id
        self.sandbox = sandbox
        self.lane = ctx.publisher.lane(keys.realtime_channel(self.job_id))
        self.events = JobEvents(ctx.queue, self.lane, self.job_id, claim.attempt, claim.next_seq)
        self._destroyed = False
        self.budget = OutputBudget(claim.spec.limits.output_kb * 1024, keep_bytes=claim.spec.collect_output)
        self._finished = False

    # ------------------------------------------------------------------ entry point

    async def execute(self) -> None:
        loop = asyncio.get_running_loop()
        sub = None
        try:
            sub = await self.ctx.control.subscribe(self.job_id)
            await self.events.stage("queued")
            try:
                program = self._load()
            except (PlatformError, ValidationError, WorkspaceError, OSError) as exc:
                log.error("job %s: cannot load the job into its sandbox: %s", self.job_id, exc)
                await self._destroy()
                await self._finish_without_run(Outcome.INTERNAL_ERROR, f"sandbox preparation failed: {exc}")
                return
            signal = await self._park(sub.queue, loop.time)
            if signal != "start":
                await self._destroy()
                if signal == "handback":
                    if await self.ctx.queue.hand_back(self.job_id, self.claim.attempt):
                        log.info("job %s: handed back to the queue (worker stopping)", self.job_id)
                    self._finished = True
                elif signal == "kill":
                    await self._finish_without_run(Outcome.KILLED, "killed before it started")
                else:
                    await self._finish_without_run(Outcome.EXPIRED, None)
                return
            await self.events.state(JobState.STARTING)
            facts = await self._run(sub.queue, program)
            # Every process is dead already (killed, counters read); removing the cgroups and
            # the workspace happens right after the result, off the user's critical path.
            await self._finish_run(facts)
        except Fenced:
            log.warning("job %s: lease lost to another worker; abandoning without a result", self.job_id)
            self._finished = True
        except asyncio.CancelledError:
            await asyncio.shield(self._abort("the worker shut down before the program finished"))
            raise
        except Exception:
            log.exception("job %s: unexpected failure", self.job_id)
            await asyncio.shield(self._abort("internal error in the worker"))
        finally:
            if not self._destroyed:
                await asyncio.shield(self._destroy())
            if sub is not None:
                await self.ctx.control.unsubscribe(sub)
            await self.lane.close(timeout_s=self.ctx.settings.pusher_timeout_ms / 1000 + 1)

    # ------------------------------------------------------------------ park

    async def _park(self, inbox: asyncio.Queue[object], clock: object) -> str:
        """Wait for start. Returns "start", "expired", "kill" or "handback"."""
        loop = asyncio.get_running_loop()
        if self.claim.start_flag or await self.ctx.queue.start_flag(self.job_id):
            return "start"
        deadline = self.claim.claimed_at + self.ctx.settings.worker_warmup_ms / 1000
        stopping = asyncio.ensure_future(self.ctx.stopping.wait())
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    # One last look: a start may have landed while the subscription was busy.
                    return "start" if await self.ctx.queue.start_flag(self.job_id) else "expired"
                getter = asyncio.ensure_future(inbox.get())
                done, _ = await asyncio.wait({getter, stopping}, timeout=min(left, 1.0), return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    item = getter.result()
                    if isinstance(item, CtrlMessage) and item.type == "start":
                        return "start"
                    if isinstance(item, CtrlMessage) and item.type == "kill":
                        return "kill"
                    continue
                getter.cancel()
                if stopping in done:
                    return "handback"
                # Periodic re-check of the durable flag covers a dropped pub/sub connection.
                if await self.ctx.queue.start_flag(self.job_id):
                    return "start"
        finally:
            stopping.cancel()

    # ------------------------------------------------------------------ load

    def _load(self) -> Program:
        """Put the job's files and limits into the ready sandbox; returns what to exec on start."""
        spec = self.spec
        runtime = self.ctx.runtimes.get(spec.language)
        if runtime is None:
            raise PlatformError(f"language {spec.language} is not offered by this worker")
        if spec.version and spec.version != runtime.version:
            raise PlatformError(f"{spec.language} {spec.version} is not available here (this worker has {runtime.version})")
        files = decode_files(spec.files, self.ctx.settings.max_files_bytes)
        manifest = runtime.manifest
        self.sandbox.load(files, spec.limits)
        names = [name for name, _ in files]
        entry = names[0]
        sources = [n for n in names if any(n.endswith(ext) for ext in manifest.source_extensions)] or [entry]
        argv = expand_argv(manifest.run, entry=entry, sources=sources, args=spec.args, memory_mb=spec.limits.memory_mb)
        return Program(argv=argv, env=dict(manifest.env), **self.ctx.sandboxes.program_rlimits(spec.limits))

    # ------------------------------------------------------------------ run

    async def _run(self, inbox: asyncio.Queue[object], program: Program) -> RunFacts:
        jail, cgroup, limits = self.sandbox.jail, self.sandbox.cgroup, self.spec.limits
        loop = asyncio.get_running_loop()

        await self.events.stage("running", state=JobState.RUNNING, started=True)
        cpu_base = cgroup.cpu_us()
        jail.go(program)
        go_at = loop.time()
        self._last_activity = go_at
        stdin_task = asyncio.create_task(self._feed_stdin(jail), name=f"stdin:{self.job_id}")
        readers = [
            asyncio.create_task(self._pump(jail.stdout, "stdout"), name=f"stdout:{self.job_id}"),
            asyncio.create_task(self._pump(jail.stderr, "stderr"), name=f"stderr:{self.job_id}"),
        ]
        exit_task = asyncio.create_task(jail.wait(), name=f"exit:{self.job_id}")
        inbox_task: asyncio.Future[object] = asyncio.ensure_future(inbox.get())
        fired: str | None = None
        ended_at = go_at
        try:
            while True:
                now = loop.time()
                cpu_used_us = cgroup.cpu_us() - cpu_base
                if now - go_at >= limits.wall_time_ms / 1000:
                    fired = "wall"
                elif cpu_used_us >= limits.cpu_ms * 1000:
                    fired = "cpu"
                elif now - self._last_activity >= limits.idle_ms / 1000:
                    fired = "idle"
                if fired:
                    ended_at = now
                    cgroup.kill()
                    break
                timeout = min(
                    go_at + limits.wall_time_ms / 1000 - now,
                    self._last_activity + limits.idle_ms / 1000 - now,
                    CPU_POLL_S,
                )
                done, _ = await asyncio.wait({exit_task, inbox_task}, timeout=max(timeout, 0.001), return_when=asyncio.FIRST_COMPLETED)
                if exit_task in done:
                    ended_at = loop.time()
                    break
                if inbox_task in done:
                    item = inbox_task.result()
                    inbox_task = asyncio.ensure_future(inbox.get())
                    if isinstance(item, CtrlMessage) and item.type == "kill":
                        fired = "user"
                        ended_at = loop.time()
                        cgroup.kill()
                        break
        finally:
            inbox_task.cancel()

        # Whatever ended the run, nothing of the job may outlive it.
        cgroup.kill()
        try:
            exit_info = await asyncio.wait_for(asyncio.shield(exit_task), EXIT_GRACE_S)
        except TimeoutError:
            log.error("job %s: nsjail did not exit after the kill; killing it", self.job_id)
            jail.terminate_supervisor()
            exit_info = await exit_task
        await asyncio.wait(readers, timeout=EXIT_GRACE_S)
        for task in (*readers, stdin_task):
            task.cancel()
        await asyncio.gather(*readers, stdin_task, return_exceptions=True)
        for stream in ("stdout", "stderr"):
            await self.events.chunks(stream, self.budget.flush(stream))

        counters = cgroup.counters()
        return RunFacts(
            exit=exit_info,
            fired=fired,
            duration_ms=max(0, round((ended_at - go_at) * 1000)),
            cpu_ms=max(0, (counters.cpu_us - cpu_base) // 1000),
            memory_kb=counters.memory_peak_bytes // 1024,
            oom_kills=counters.oom_kills,
        )

    async def _pump(self, reader: asyncio.StreamReader | None, stream: str) -> None:
        assert reader is not None
        loop = asyncio.get_running_loop()
        while True:
            data = await reader.read(READ_SIZE)
            if not data:
                return
            self._last_activity = loop.time()
            await self.events.chunks(stream, self.budget.feed(stream, data))

    async def _feed_stdin(self, jail: Jail) -> None:
        writer = jail.proc.stdin
        assert writer is not None
        try:
            if self.spec.stdin:
                writer.write(self.spec.stdin.encode())
                await writer.drain()
            writer.close()
            await writer.wait_closed()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the program exited without reading its input: not an error

    # ------------------------------------------------------------------ finish

    async def _destroy(self) -> None:
        """Kill and remove everything the job had: processes, cgroups, workspace."""
        if not self._destroyed:
            self._destroyed = True
            await self.sandbox.destroy()

    def _result(self, facts: RunFacts) -> tuple[Outcome, ResultEvent]:
        exit_info = facts.exit
        timed_out = facts.fired in ("wall", "cpu") or (exit_info.backstop_fired and facts.fired is None)
        idle = facts.fired == "idle"
        message = None
        if facts.fired == "user":
            outcome = Outcome.KILLED
        elif timed_out:
            outcome = Outcome.TIMED_OUT
        elif idle:
            outcome = Outcome.IDLE_TIMED_OUT
        elif facts.oom_kills > 0 and exit_info.signal == "SIGKILL":
            outcome = Outcome.MEMORY_EXCEEDED
        elif exit_info.exit_code is None and exit_info.signal is None:
            outcome = Outcome.INTERNAL_ERROR
            message = "sandbox failure: " + "; ".join(exit_info.errors)
        else:
            outcome = Outcome.COMPLETED
        event = ResultEvent(
            exit_code=exit_info.exit_code,
            signal=exit_info.signal,
            timed_out=timed_out,
            idle_timed_out=idle,
            truncated=self.budget.truncated,
            duration_ms=facts.duration_ms,
            cpu_ms=facts.cpu_ms,
            memory_kb=facts.memory_kb,
            outcome=outcome,
            compile=None,
            seq=0,
            message=message,
        )
        return outcome, event

    async def _finish_run(self, facts: RunFacts) -> None:
        outcome, event = self._result(facts)
        await self._finish(outcome, event)

    async def _finish_without_run(self, outcome: Outcome, message: str | None) -> None:
        event = ResultEvent(
            exit_code=None,
            signal=None,
            timed_out=False,
            idle_timed_out=False,
            truncated=False,
            duration_ms=0,
            cpu_ms=0,
            memory_kb=0,
            outcome=outcome,
            compile=None,
            seq=0,
            message=message if outcome is not Outcome.EXPIRED else None,
        )
        await self._finish(outcome, event)

    async def _finish(self, outcome: Outcome, event: ResultEvent) -> None:
        if self._finished:
            return
        self._finished = True
        seq = self.events.take_result_seq()
        event = msgspec.structs.replace(event, seq=seq)
        result_json = _encoder.encode(event)
        output_json = _encoder.encode(self._run_result(event)) if self.spec.collect_output else None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FINISH_RETRY_S
        delay = 0.1
        while True:
            try:
                written = await self.ctx.queue.finish(
                    self.job_id, self.claim.attempt, OUTCOME_STATE[outcome], seq, result_json, output_json
                )
                break
            except (ConnectionError, OSError, TimeoutError) as exc:
                if loop.time() > deadline:
                    log.error("job %s: could not store the result: %s", self.job_id, exc)
                    return
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
        if written:
            self.events.publish("result", result_json)
            log.info(
                "job %s: %s exit=%s signal=%s %dms cpu=%dms mem=%dKiB",
                self.job_id, outcome.value, event.exit_code, event.signal, event.duration_ms, event.cpu_ms, event.memory_kb,
            )  # fmt: skip
        else:
            log.warning("job %s: result not written (lease lost or job already ended)", self.job_id)

    def _run_result(self, event: ResultEvent) -> RunResult:
        stdout, stdout_encoding = exact_text(bytes(self.budget.data["stdout"]))
        stderr, stderr_encoding = exact_text(bytes(self.budget.data["stderr"]))
        return RunResult(
            exit_code=event.exit_code,
            signal=event.signal,
            timed_out=event.timed_out,
            idle_timed_out=event.idle_timed_out,
            truncated=event.truncated,
            duration_ms=event.duration_ms,
            cpu_ms=event.cpu_ms,
            memory_kb=event.memory_kb,
            outcome=event.outcome,
            compile=event.compile,
            stdout=stdout,
            stderr=stderr,
            stdout_encoding=stdout_encoding,  # type: ignore[arg-type]
            stderr_encoding=stderr_encoding,  # type: ignore[arg-type]
            message=event.message,
        )

    async def _abort(self, message: str) -> None:
        try:
            await self._destroy()
        except Exception:
            log.exception("job %s: teardown failed", self.job_id)
        if not self._finished:
            try:
                await self._finish_without_run(Outcome.INTERNAL_ERROR, message)
            except Exception:
                log.exception("job %s: could not record the failure", self.job_id)

