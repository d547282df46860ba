"""Test batches: the program is compiled once, then each case runs in a fresh jail.

Every case gets a sandbox of its own (a warm one from the pool; the first case uses the
sandbox the program was compiled in), with the job's files and whatever the compile left
copied in, the case's args and stdin (then EOF), and the job's limits and clocks. No file,
process or memory carries from one case to the next: each sandbox is destroyed after its
case. Cases run side by side up to the worker's ready sandboxes (one at a time under
`stopOnFirstFailure`, where each case decides whether the next one runs). Each case ends
in one `test_result` event; shared/grading.py turns its facts into a verdict.

With collectOutput the result keeps each case's output, all cases together at most the
job's outputKb, split evenly (each case's verdict still sees the whole of what it wrote, up
to outputKb): a case's copy past its share is cut (`outputCut`). A case's output that JSON
would blow up (control bytes escape to six characters) is kept as base64.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from shared.chunking import utf8_prefix
from shared.grading import (
    COMPARE_PIECE_BYTES,
    CompareMode,
    TestVerdict,
    batch_summary,
    canonical_form,
    canonical_pieces,
    case_verdict,
    not_run_case,
    outputs_match,
)
from shared.limits import Limits
from shared.manifest import Manifest, expand_argv
from shared.messages import (
    CaseOutput,
    CtrlMessage,
    JobSpec,
    Outcome,
    TestCase,
    TestResultEvent,
    TestSummary,
)
from worker.isolation.jail import Program
from worker.isolation.memory import MemoryAdmission
from worker.isolation.pool import SandboxPool, call_off
from worker.isolation.sandbox import Sandbox
from worker.isolation.workspace import Packed
from worker.job.events import JobEvents
from worker.job.outcome import judge_run
from worker.job.output import StreamTail, output_encoding
from worker.job.stdin import write_to_program
from worker.job.supervise import Activity, Clocks, StepFacts, StepNotStarted, StepStopped, supervise
from worker.messaging.inbox import Inbox
from worker.messaging.queue import Fenced

__all__ = ["BatchProgress", "BatchResult", "run_batch", "summarize"]

log = logging.getLogger(__name__)

# At most this many cases of one job at once, whatever the worker's free slots.
MAX_PARALLEL = 4
# A case's stdin goes in pieces this big, each one that the program takes counting as a
# sign of life for the idle clock (as an IDE's stdin does).
STDIN_PIECE = 64 * 1024
# A case the worker's stop ended (or caught being judged) still gets its test_result event,
# waited for this long (the job's result follows it).
STOP_EMIT_S = 2.0


@dataclass
class BatchResult:
    cases: list[CaseOutput]
    summary: TestSummary
    killed: bool
    # The batch's time budget (WORKER_BATCH_WALL_MS) stopped cases or kept them from running.
    timed_out: bool
    duration_ms: int
    cpu_ms: int
    memory_kb: int


class BatchProgress:
    """What a batch has done so far: the caller keeps it, so that a worker stopping in
    mid-batch still reports the verdicts of the cases that ran (`summarize`)."""

    def __init__(self, tests: list[TestCase], started_at: float) -> None:
        self.tests = tests
        self.results: list[CaseOutput | None] = [None] * len(tests)
        self.broken: set[int] = set()  # cases lost to a failure of the worker
        self.started_at = started_at
        self.cpu_ms = 0
        self.memory_kb = 0
        # Why cases not run yet are skipped, the first of: "kill", "failure" (under
        # stopOnFirstFailure), "budget" (the batch's time ran out).
        self.stop_reason: str | None = None
        self.killed_cases = 0  # cases a kill ended while they ran
        self.budget_cases = 0  # cases the time budget ended while they ran


class _CaseOutput:
    """stdout and stderr of one case, together at most `limit` bytes (the job's outputKb)."""

    def __init__(self, limit: int) -> None:
        self.left = limit
        self.truncated = False
        self.data = {"stdout": bytearray(), "stderr": bytearray()}
        self.stderr_tail = StreamTail()

    def spent(self) -> bool:
        return self.truncated

    def sink(self, stream: str) -> Callable[[bytes], object]:
        async def feed(data: bytes) -> None:
            if stream == "stderr":
                self.stderr_tail.feed(data)
            if self.truncated:
                return  # (past the cut: dropped unseen, not copied once more each read)
            if len(data) > self.left:
                # Cut where the budget ends, but not inside a character (one begun in an
                # earlier read included): valid text stays valid, and is kept as text.
                held = self.data[stream]
                self.data[stream] = bytearray(utf8_prefix(bytes(held) + data, len(held) + self.left))
                self.truncated, self.left = True, 0  # (and nothing after the cut)
                return
            self.left -= len(data)
            self.data[stream] += data

        return feed


# What JSON writes as two characters; the other control bytes take six.
_SHORT_ESCAPES = b'\b\f\n\r\t"\\'
# Every byte that JSON writes as itself.
_PLAIN = bytes(b for b in range(256) if b >= 0x20 and b not in _SHORT_ESCAPES)


def _text(data: bytes) -> tuple[str, str]:
    encoding = output_encoding(data)
    if encoding == "utf8":
        escaped = len(data.translate(None, _PLAIN))
        short = len(data) - len(data.translate(None, _SHORT_ESCAPES))
        if short + 5 * (escaped - short) > len(data):
            # As text it would take more than twice its size (base64 takes 4/3); below that
            # (colour codes, say) it stays readable.
            encoding = "base64"
    return (data.decode() if encoding == "utf8" else base64.b64encode(data).decode()), encoding


def _kept(output: _CaseOutput, share: int) -> tuple[bytes, bytes, bool]:
    """The case's stdout and stderr as the result keeps them (together at most `share`
    bytes, stdout first), and whether that cut any."""
    stdout, stderr = bytes(output.data["stdout"]), bytes(output.data["stderr"])
    kept_out = utf8_prefix(stdout, share)
    kept_err = utf8_prefix(stderr, share - len(kept_out))
    return kept_out, kept_err, len(kept_out) + len(kept_err) < len(stdout) + len(stderr)


async def run_batch(
    *,
    spec: JobSpec,
    manifest: Manifest,
    entry: str,
    sources: list[str],
    program_rlimits: dict[str, int],
    adoptable: bool = True,
    first: Sandbox,
    files: list[tuple[str, bytes]],
    executable: frozenset[str],
    pool: SandboxPool,
    events: JobEvents,
    ctrl: asyncio.Queue[CtrlMessage],
    keep_output: bool,
    budget_ms: int,
    progress: BatchProgress | None = None,
    memory: MemoryAdmission | None = None,
    packed: Packed | None = None,
) -> BatchResult:
    """Run every case of `spec.tests`; `first` (already loaded) serves case 0 and is
    destroyed like every other case's sandbox (the caller must not reuse it). `budget_ms`
    after the batch began, the cases still running are stopped and the rest skipped.

    Every other case gets `files`, and `packed` (a big compiled program) copied in once its
    memory, and the copy's, is admitted (Sandbox.copy_in).

    Raises:
        Fenced: the job stopped being this worker's (its running cases are stopped first).
    """
    tests: list[TestCase] = spec.tests or []
    limits: Limits = spec.limits
    loop = asyncio.get_running_loop()
    if progress is None:
        progress = BatchProgress(tests, loop.time())
    results = progress.results
    stop = asyncio.Event()  # a kill, or a failure under stopOnFirstFailure
    running: list[asyncio.Queue[object]] = []
    share = limits.output_kb * 1024 // max(1, len(tests))

    def halt(reason: str) -> None:
        if progress.stop_reason is None:
            progress.stop_reason = reason
        stop.set()

    def program(case: TestCase) -> Program:
        argv = expand_argv(manifest.run, entry=entry, sources=sources, args=case.args, memory_mb=limits.memory_mb)
        return Program(argv=argv, env=dict(manifest.env), **program_rlimits, adoptable=adoptable)

    def stop_running(reason: str) -> None:
        halt(reason)
        for inbox in running:
            inbox.put_nowait(CtrlMessage(type="kill"))

    async def forward_kills() -> None:
        while True:
            message = await ctrl.get()
            if message.type == "kill":
                stop_running("kill")

    async def one(index: int, case: TestCase, sandbox: Sandbox | None) -> None:
        prog = program(case)
        # (`first` holds the compiled program already: the others get a copy.)
        copy_in = packed if sandbox is None else None
        if sandbox is None:
            # A worker whose builds all fail ends this case internal_error, not never. A kill
            # or the batch's budget ends the wait: a case stopped then takes no sandbox a
            # started job could have had (and the batch's result is not held up by it).
            sandbox = await _unless_stopped(stop, pool.take_unless_failing(prog, spec.language), pool)
            if sandbox is None:
                return
            try:
                await sandbox.load(files, limits, prog, executable, pool.prime_for(spec.language))
            except BaseException:
                pool.give_back(sandbox)
                raise
        if stop.is_set():
            # A kill (or a failure under stopOnFirstFailure) came while this case waited for
            # its sandbox: it is not run, so it is not left running past the kill.
            pool.give_back(sandbox)
            return
        inbox: Inbox[object] = Inbox()
        running.append(inbox)
        output = _CaseOutput(limits.output_kb * 1024)
        stdin = (case.stdin or "").encode()

        async def feed(activity: Activity) -> None:
            writer = sandbox.jail.proc.stdin
            assert writer is not None
            for at in range(0, len(stdin), STDIN_PIECE):
                if not await write_to_program(writer, stdin[at : at + STDIN_PIECE]):
                    return  # the program stopped reading its input, or its jail ended
                activity.touch()  # the program is reading its input: not idle
            writer.close()

        # The program's go (from supervise), so a case the stop ends as it runs counts its time
        # from there, not from a wait for memory before it.
        went_at: list[float] = []
        stopped_with_facts = False
        try:
            facts: StepFacts = await supervise(
                sandbox.jail,
                sandbox.cgroup,
                prog,
                Clocks(wall_ms=limits.wall_time_ms, cpu_ms=limits.cpu_ms, idle_ms=limits.idle_ms),
                [(sandbox.jail.stdout, output.sink("stdout")), (sandbox.jail.stderr, output.sink("stderr"))],
                inbox,
                feed_stdin=feed,
                memory=memory,
                uncharged=sandbox.uncharged,
                output_spent=output.spent,
                on_go=went_at.append,
                before_go=functools.partial(sandbox.copy_in, copy_in) if copy_in is not None else None,
                extra_memory_bytes=copy_in.charge_bytes if copy_in is not None else 0,
            )
        except StepNotStarted:
            raise  # (the stop came while it waited for memory: it never ran, and says so)
        except StepStopped as stopped:
            if stopped.facts is None:
                await stopped_as_it_ran(index, case, output, went_at, sandbox.uncharged.wall_ms)
                raise
            # Its program had ended, and its output was all read: judged as it ended.
            facts, stopped_with_facts = stopped.facts, True
        except asyncio.CancelledError:
            await stopped_as_it_ran(index, case, output, went_at, sandbox.uncharged.wall_ms)
            raise
        finally:
            running.remove(inbox)
            pool.give_back(sandbox)
        stopped_while_judging = stopped_with_facts
        heap = manifest.heap_limit
        verdict_of_run = judge_run(
            facts, heap is not None and heap.ran_out(facts.exit.exit_code, facts.exit.signal, output.stderr_tail.data)
        )
        outcome, killed_by = verdict_of_run.outcome, verdict_of_run.killed_by
        signal = facts.exit.signal
        if outcome == Outcome.KILLED and signal is None:
            signal = "SIGKILL"
        if killed_by == "user" and progress.stop_reason == "budget":
            # Stopped by the batch's clock, not by a user, and not for its own time: it is
            # not judged (skipped), and says which clock it was.
            outcome, killed_by = Outcome.TIMED_OUT, "wall"
            progress.budget_cases += 1
            verdict = TestVerdict.SKIPPED
        else:
            if killed_by == "user":
                progress.killed_cases += 1
            # The rules without the output first (with no expectation a case that gets past
            # them is accepted); the output then, compared with the loop let in between.
            verdict = case_verdict(
                outcome=outcome.value,
                exit_code=facts.exit.exit_code,
                signal=signal,
                killed_by=killed_by,
                truncated=output.truncated,
                stdout=b"",
                expected=None,
                compare=spec.compare,
            )
            if verdict is TestVerdict.ACCEPTED and case.expected_output is not None:
                stdout = bytes(output.data["stdout"])
                try:
                    matched = await output_matches(stdout, case.expected_output, spec.compare)
                except asyncio.CancelledError:
                    # The worker's stop, as the case was being judged: it ran to its end, so
                    # it is judged at once (on the loop: it is stopping) and kept, not lost.
                    matched = outputs_match(stdout, case.expected_output, spec.compare)
                    stopped_while_judging = True
                verdict = TestVerdict.ACCEPTED if matched else TestVerdict.WRONG_ANSWER
        progress.cpu_ms += facts.cpu_ms
        progress.memory_kb = max(progress.memory_kb, facts.memory_kb)
        base = {
            "index": index,
            "name": case.name,
            "outcome": outcome,
            "verdict": verdict.value,
            "exit_code": facts.exit.exit_code if signal is None else None,
            "signal": signal,
            "duration_ms": facts.duration_ms,
            "cpu_ms": facts.cpu_ms,
            "memory_kb": facts.memory_kb,
            "killed_by": killed_by,
            "truncated": output.truncated,
            "message": verdict_of_run.message if outcome is Outcome.MEMORY_EXCEEDED else None,
        }
        keep(index, base, output)
        del output  # (only the kept share outlives the case)
        if spec.stop_on_first_failure and verdict is not TestVerdict.ACCEPTED:
            halt("failure")  # (decided now, not once its event is written: that may take a while)
        if stopped_while_judging:
            await _emit_while_stopping(events, base)
            raise asyncio.CancelledError
        await events.emit([("test_result", lambda seq: TestResultEvent(**base, seq=seq))])  # type: ignore[arg-type]

    async def stopped_as_it_ran(index: int, case: TestCase, output: _CaseOutput, went_at: list[float], uncharged_ms: int) -> None:
        """The worker's stop ended the case as it ran (past the grace): it ran, and is
        reported as a kill's case is, with its wall time from its go (its other figures went
        with its sandbox) and its event, not as a case that never ran."""
        signal, killed_by = "SIGKILL", "user"
        base = {
            "index": index,
            "name": case.name,
            "outcome": Outcome.KILLED,
            "verdict": case_verdict(
                outcome=Outcome.KILLED.value, exit_code=None, signal=signal, killed_by=killed_by,
                truncated=output.truncated, stdout=b"", expected=None, compare=spec.compare,
            ).value,
            "exit_code": None,
            "signal": signal,
            "duration_ms": max(0, round((loop.time() - went_at[0]) * 1000) - uncharged_ms) if went_at else 0,
            "cpu_ms": 0,
            "memory_kb": 0,
            "killed_by": killed_by,
            "truncated": output.truncated,
            "message": None,
        }  # fmt: skip
        progress.killed_cases += 1
        keep(index, base, output)
        await _emit_while_stopping(events, base)

    def keep(index: int, base: dict[str, object], output: _CaseOutput) -> None:
        """The case's verdict and figures, with its share of the output, in the results."""
        kept_out, kept_err, cut = _kept(output, share) if keep_output else (b"", b"", False)
        out_text, out_enc = _text(kept_out)
        err_text, err_enc = _text(kept_err)
        results[index] = CaseOutput(
            **base,  # type: ignore[arg-type]
            stdout=out_text,
            stderr=err_text,
            stdout_encoding=out_enc,  # type: ignore[arg-type]
            stderr_encoding=err_enc,  # type: ignore[arg-type]
            output_cut=cut,
        )

    width = 1 if spec.stop_on_first_failure else max(1, min(MAX_PARALLEL, pool.ready + 1))
    gate = asyncio.Semaphore(width)
    kills = asyncio.create_task(forward_kills(), name=f"batch-kills:{spec.job_id}")
    budget = loop.call_at(progress.started_at + budget_ms / 1000, stop_running, "budget")

    first_taken = False
    fenced: list[Fenced] = []

    async def guarded(index: int, case: TestCase) -> None:
        nonlocal first_taken
        async with gate:
            if stop.is_set():
                return
            if index == 0:
                first_taken = True  # from here on, case 0 gives it back
            try:
                await one(index, case, first if index == 0 else None)
            except Fenced as exc:
                # The job is another worker's now: nothing more of it may run or be written.
                fenced.append(exc)
                halt("kill")
                for inbox in running:
                    inbox.put_nowait(CtrlMessage(type="kill"))
                raise
            except Exception:
                progress.broken.add(index)
                if spec.stop_on_first_failure and progress.results[index] is None:
                    # An internal_error case is a failure like any other; one judged already
                    # (its event's write failed) keeps its verdict, and halted if it failed.
                    halt("failure")
                raise

    try:
        tasks = [asyncio.create_task(guarded(i, case)) for i, case in enumerate(tests)]
        done = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        budget.cancel()
        kills.cancel()
        await asyncio.gather(kills, return_exceptions=True)
        if not first_taken:
            pool.give_back(first)
    if fenced:
        raise fenced[0]
    for index, failure in enumerate(done):
        if isinstance(failure, BaseException):
            log.error("job %s: test case %d failed in the worker: %r", spec.job_id, index, failure)
    return summarize(progress, now=loop.time())


# A case that never ran: killed or timed out (the batch's budget) with the job; under
# stopOnFirstFailure it has no outcome at all.
_NOT_RUN_OUTCOME = {"kill": Outcome.KILLED, "budget": Outcome.TIMED_OUT}


async def _emit_while_stopping(events: JobEvents, base: dict[str, object]) -> None:
    """A case's test_result as the worker stops, waited for at most STOP_EMIT_S. (The write
    goes on past that, holding the job's event order: the result, which comes after it,
    needs the same Redis anyway.)"""
    emit = asyncio.ensure_future(events.emit([("test_result", lambda seq: TestResultEvent(**base, seq=seq))]))  # type: ignore[arg-type]
    emit.add_done_callback(lambda done: done.cancelled() or done.exception())  # (seen: logged where it failed)
    await asyncio.wait({emit}, timeout=STOP_EMIT_S)


async def _unless_stopped(stop: asyncio.Event, take: Awaitable[Sandbox], pool: SandboxPool) -> Sandbox | None:
    """What `take` gives, or None once `stop` is set first (the take is called off; a
    sandbox it got all the same goes back)."""
    taking = asyncio.ensure_future(take)
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({taking, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            await call_off(taking, pool.give_back)
            return None
        return taking.result()
    except BaseException:
        await call_off(taking, pool.give_back)
        raise
    finally:
        stopped.cancel()


def summarize(progress: BatchProgress, now: float, stopped: bool = False) -> BatchResult:
    """The batch as it stands: every case's facts, the ones that did not run skipped (or
    internal_error, lost to the worker). `stopped`: the worker is stopping, and what had
    not finished was ended by that (a kill, as a user's would be)."""
    reason = progress.stop_reason or ("kill" if stopped else None)
    cases = [
        progress.results[index]
        or (
            not_run_case(index, case, Outcome.INTERNAL_ERROR, TestVerdict.INTERNAL_ERROR)
            if index in progress.broken
            else not_run_case(index, case, _NOT_RUN_OUTCOME.get(reason), TestVerdict.SKIPPED)
        )
        for index, case in enumerate(progress.tests)
    ]
    # Killed only if a kill changed something: a case it ended, or cases it kept from running
    # (a kill that came as the last case ended leaves every verdict as it was).
    unrun = any(progress.results[i] is None and i not in progress.broken for i in range(len(cases)))
    killed = progress.killed_cases > 0 or (reason == "kill" and unrun)
    return BatchResult(
        cases=cases,
        summary=batch_summary(cases),
        killed=killed,
        timed_out=not killed and (progress.budget_cases > 0 or (reason == "budget" and unrun)),
        duration_ms=round((now - progress.started_at) * 1000),
        cpu_ms=progress.cpu_ms,
        memory_kb=progress.memory_kb,
    )


async def output_matches(actual: bytes, expected: str, mode: CompareMode) -> bool:
    """`outputs_match`, letting the event loop in between pieces: a case's output may be
    16 MiB, half a second of comparing that other jobs' clocks, kills and output would wait
    out."""
    if mode == "exact" or len(actual) + len(expected) <= COMPARE_PIECE_BYTES:
        return outputs_match(actual, expected, mode)
    forms = []
    for data in (actual, expected.encode()):
        pieces = []
        for piece in canonical_pieces(data, mode):
            pieces.append(piece)
            await asyncio.sleep(0)
        forms.append(canonical_form(pieces, mode))
    return forms[0] == forms[1]
