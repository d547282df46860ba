"""Test batches: the program is compiled once, then each case runs in a fresh jail.

Every case gets a sandbox of its own (a warm one from the pool; the first case uses the
sandbox the program was compiled in), with the job's files and whatever the compile left
copied in, the case's args and stdin (then EOF), and the job's limits and clocks. No file,
process or memory carries from one case to the next: each sandbox is destroyed after its
case. Cases run side by side up to the worker's ready sandboxes (one at a time under
`stopOnFirstFailure`, where each case decides whether the next one runs). Each case ends
in one `test_result` event; shared/grading.py turns its facts into a verdict.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable
from dataclasses import dataclass

from shared.grading import TestVerdict, batch_verdict, case_verdict
from shared.limits import Limits
from shared.manifest import Manifest, expand_argv
from shared.messages import (
    CaseFacts,
    CaseOutput,
    CtrlMessage,
    JobSpec,
    Outcome,
    TestCase,
    TestResultEvent,
    TestSummary,
)
from worker.isolation.jail import Program
from worker.isolation.pool import SandboxPool
from worker.isolation.sandbox import Sandbox
from worker.job.events import JobEvents
from worker.job.outcome import judge_run
from worker.job.output import output_encoding
from worker.job.supervise import Activity, Clocks, StepFacts, supervise

__all__ = ["BatchResult", "facts_only", "run_batch"]

log = logging.getLogger(__name__)

# At most this many cases of one job at once, whatever the worker's free slots.
MAX_PARALLEL = 4


@dataclass
class BatchResult:
    cases: list[CaseOutput]
    summary: TestSummary
    killed: bool
    duration_ms: int
    cpu_ms: int
    memory_kb: int


class _CaseOutput:
    """stdout and stderr of one case, together at most `limit` bytes (the job's outputKb)."""

    def __init__(self, limit: int) -> None:
        self.left = limit
        self.truncated = False
        self.data = {"stdout": bytearray(), "stderr": bytearray()}

    def sink(self, stream: str) -> Callable[[bytes], object]:
        async def feed(data: bytes) -> None:
            if len(data) > self.left:
                data, self.truncated = data[: self.left], True
            self.left -= len(data)
            self.data[stream] += data

        return feed


def _text(data: bytes) -> tuple[str, str]:
    encoding = output_encoding(data)
    return (data.decode() if encoding == "utf8" else base64.b64encode(data).decode()), encoding


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
) -> BatchResult:
    """Run every case of `spec.tests`; `first` (already loaded) serves case 0 and is
    destroyed like every other case's sandbox (the caller must not reuse it)."""
    tests: list[TestCase] = spec.tests or []
    limits: Limits = spec.limits
    results: list[CaseOutput | None] = [None] * len(tests)
    stop = asyncio.Event()  # a kill, or a failure under stopOnFirstFailure
    killed = False
    running: list[asyncio.Queue[object]] = []
    loop = asyncio.get_running_loop()
    started = loop.time()
    totals = {"cpu": 0, "memory": 0}

    def program(case: TestCase) -> Program:
        argv = expand_argv(manifest.run, entry=entry, sources=sources, args=case.args, memory_mb=limits.memory_mb)
        return Program(argv=argv, env=dict(manifest.env), **program_rlimits, adoptable=adoptable)

    async def forward_kills() -> None:
        nonlocal killed
        while True:
            message = await ctrl.get()
            if message.type == "kill":
                killed = True
                stop.set()
                for inbox in running:
                    inbox.put_nowait(message)

    async def one(index: int, case: TestCase, sandbox: Sandbox | None) -> None:
        prog = program(case)
        if sandbox is None:
            # A worker whose builds all fail ends this case internal_error, not never.
            sandbox = await pool.take_unless_failing(prog, spec.language)
            try:
                await sandbox.load(files, limits, prog, executable)
            except BaseException:
                pool.give_back(sandbox)
                raise
        if stop.is_set():
            # A kill (or a failure under stopOnFirstFailure) came while this case waited for
            # its sandbox: it is not run, so it is not left running past the kill.
            pool.give_back(sandbox)
            return
        inbox: asyncio.Queue[object] = asyncio.Queue()
        running.append(inbox)
        output = _CaseOutput(limits.output_kb * 1024)
        stdin = (case.stdin or "").encode()

        async def feed(_activity: Activity) -> None:
            writer = sandbox.jail.proc.stdin
            assert writer is not None
            try:
                if stdin:
                    writer.write(stdin)
                    await writer.drain()
                writer.close()
            except (BrokenPipeError, ConnectionResetError):
                pass  # the program stopped reading its input

        try:
            facts: StepFacts = await supervise(
                sandbox.jail,
                sandbox.cgroup,
                prog,
                Clocks(wall_ms=limits.wall_time_ms, cpu_ms=limits.cpu_ms, idle_ms=limits.idle_ms),
                [(sandbox.jail.stdout, output.sink("stdout")), (sandbox.jail.stderr, output.sink("stderr"))],
                inbox,
                feed_stdin=feed,
            )
        finally:
            running.remove(inbox)
            pool.give_back(sandbox)
        facts.memory_kb = max(0, facts.memory_kb - sandbox.memory_base_bytes // 1024)
        verdict_of_run = judge_run(facts)
        signal = facts.exit.signal
        if verdict_of_run.outcome == Outcome.KILLED and signal is None:
            signal = "SIGKILL"
        stdout = bytes(output.data["stdout"])
        verdict = case_verdict(
            outcome=verdict_of_run.outcome.value,
            exit_code=facts.exit.exit_code,
            signal=signal,
            killed_by=verdict_of_run.killed_by,
            truncated=output.truncated,
            stdout=stdout,
            expected=case.expected_output,
            compare=spec.compare,
        )
        totals["cpu"] += facts.cpu_ms
        totals["memory"] = max(totals["memory"], facts.memory_kb)
        base = {
            "index": index,
            "name": case.name,
            "outcome": verdict_of_run.outcome,
            "verdict": verdict.value,
            "exit_code": facts.exit.exit_code if signal is None else None,
            "signal": signal,
            "duration_ms": facts.duration_ms,
            "cpu_ms": facts.cpu_ms,
            "memory_kb": facts.memory_kb,
            "killed_by": verdict_of_run.killed_by,
            "truncated": output.truncated,
        }
        out_text, out_enc = _text(stdout if keep_output else b"")
        err_text, err_enc = _text(bytes(output.data["stderr"]) if keep_output else b"")
        results[index] = CaseOutput(
            **base,
            stdout=out_text,
            stderr=err_text,
            stdout_encoding=out_enc,
            stderr_encoding=err_enc,  # type: ignore[arg-type]
        )
        await events.emit([("test_result", lambda seq: TestResultEvent(**base, seq=seq))])  # type: ignore[arg-type]
        if spec.stop_on_first_failure and verdict is not TestVerdict.ACCEPTED:
            stop.set()

    width = 1 if spec.stop_on_first_failure else max(1, min(MAX_PARALLEL, pool.ready + 1))
    gate = asyncio.Semaphore(width)
    kills = asyncio.create_task(forward_kills(), name=f"batch-kills:{spec.job_id}")

    first_taken = False

    async def guarded(index: int, case: TestCase) -> None:
        nonlocal first_taken
        async with gate:
            if stop.is_set():
                return
            if index == 0:
                first_taken = True  # from here on, case 0 gives it back
            await one(index, case, first if index == 0 else None)

    try:
        tasks = [asyncio.create_task(guarded(i, case)) for i, case in enumerate(tests)]
        done = await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        kills.cancel()
        await asyncio.gather(kills, return_exceptions=True)
        if not first_taken:
            pool.give_back(first)
    failures = [(i, o) for i, o in enumerate(done) if isinstance(o, BaseException)]
    for index, failure in failures:
        log.error("job %s: test case %d failed in the worker: %r", spec.job_id, index, failure)

    broken = {index for index, _ in failures}
    cases = [
        results[index]
        or (
            _not_run(index, case, Outcome.INTERNAL_ERROR, TestVerdict.INTERNAL_ERROR)
            if index in broken
            else _not_run(index, case, Outcome.KILLED if killed else Outcome.COMPLETED, TestVerdict.SKIPPED)
        )
        for index, case in enumerate(tests)
    ]
    verdicts = [TestVerdict(c.verdict) for c in cases]
    summary = TestSummary(
        passed=sum(v is TestVerdict.ACCEPTED for v in verdicts),
        failed=sum(v not in (TestVerdict.ACCEPTED, TestVerdict.SKIPPED) for v in verdicts),
        skipped=sum(v is TestVerdict.SKIPPED for v in verdicts),
        verdict=batch_verdict(verdicts).value,
    )
    return BatchResult(
        cases=cases,
        summary=summary,
        killed=killed,
        duration_ms=round((loop.time() - started) * 1000),
        cpu_ms=totals["cpu"],
        memory_kb=totals["memory"],
    )


def _not_run(index: int, case: TestCase, outcome: Outcome, verdict: TestVerdict) -> CaseOutput:
    """A case with no facts of its own: skipped, or lost to a failure of the worker."""
    return CaseOutput(
        index=index,
        name=case.name,
        outcome=outcome,
        verdict=verdict.value,
        exit_code=None,
        signal=None,
        duration_ms=0,
        cpu_ms=0,
        memory_kb=0,
        stdout="",
        stderr="",
    )


def facts_only(cases: list[CaseOutput]) -> list[CaseFacts]:
    """The cases as the result event carries them (without their output)."""
    fields = CaseFacts.__struct_fields__
    return [CaseFacts(**{f: getattr(c, f) for f in fields}) for c in cases]
