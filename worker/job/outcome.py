"""How a step's facts become a verdict (pure; the table is unit-tested).

The exit code alone cannot tell a timeout from an OOM kill (both are SIGKILL), so the
verdict comes from channels the program cannot write: which of the worker's clocks fired,
the gate's report on its status socket (or, without one, nsjail's exit status and the jail's
age), and the cgroup's OOM-kill counter.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.messages import CompileInfo, Outcome
from worker.job.output import CompileOutput
from worker.job.supervise import StepFacts

__all__ = ["CEILING_MESSAGE", "RunVerdict", "compile_info", "compile_succeeded", "judge_compile_failure", "judge_run"]

# Said when the kernel ended a job that never reached its own limit: the ceiling on all jobs
# together ran out, or (no way to tell from here) the host's memory or a container's limit.
CEILING_MESSAGE = (
    "the kernel ended this job for lack of memory while it was still under its own memoryMb limit: "
    "the memory for all running jobs together (SANDBOX_MEMORY_TOTAL_MB) or the host's ran out"
)


@dataclass(frozen=True)
class RunVerdict:
    outcome: Outcome
    timed_out: bool = False
    idle_timed_out: bool = False
    killed_by: str | None = None
    message: str | None = None


def judge_run(facts: StepFacts, heap_ran_out: bool = False) -> RunVerdict:
    """`heap_ran_out`: the runtime's own last words say it gave up at its heap cap."""
    exit_info = facts.exit
    if facts.fired == "user":
        exited_itself = exit_info.exit_code is not None and exit_info.signal is None
        if not exited_itself and exit_info.signal in (None, "SIGKILL"):
            return RunVerdict(Outcome.KILLED, killed_by="user")
        # The program exited, or crashed (a kill is only ever SIGKILL), by itself in the
        # moment between the kill request and the kill: it was not killed, and saying so
        # would be wrong. It is judged as though no kill had come (its runtime's heap, say).
    if facts.fired in ("wall", "cpu"):
        return RunVerdict(Outcome.TIMED_OUT, timed_out=True, killed_by=facts.fired)
    if facts.fired is None and exit_info.backstop_fired:
        # nsjail's own time limit is only a backstop; if it ever fires, it is a wall timeout.
        return RunVerdict(Outcome.TIMED_OUT, timed_out=True, killed_by="wall")
    if facts.fired == "idle":
        return RunVerdict(Outcome.IDLE_TIMED_OUT, idle_timed_out=True, killed_by="idle")
    if facts.fired == "memory" or (facts.oom_kills > 0 and exit_info.signal == "SIGKILL"):
        return RunVerdict(Outcome.MEMORY_EXCEEDED, killed_by="memory", message=CEILING_MESSAGE if facts.ceiling_oom else None)
    if exit_info.exit_code is None and exit_info.signal is None:
        return RunVerdict(Outcome.INTERNAL_ERROR, message="sandbox failure: " + "; ".join(exit_info.errors))
    if heap_ran_out:
        # The program's own limit (the heap cap is part of memoryMb): no message, which is
        # for what the platform decided.
        return RunVerdict(Outcome.MEMORY_EXCEEDED, killed_by="memory")
    return RunVerdict(Outcome.COMPLETED)


def compile_succeeded(facts: StepFacts) -> bool:
    return facts.fired is None and facts.exit.signal is None and facts.exit.exit_code == 0


def judge_compile_failure(facts: StepFacts) -> RunVerdict:
    """The verdict of a job whose compile did not succeed. The submission's fault is a
    compile_error; a sandbox that failed, or the kernel's OOM killer at the ceiling on all
    jobs while the compiler was under its own limit, is the platform's: internal_error (the
    program never ran, so the job is safe to submit again)."""
    exit_info = facts.exit
    if facts.fired == "user":
        return RunVerdict(Outcome.KILLED, killed_by="user", message="killed while compiling")
    if facts.fired in (None, "memory") and not exit_info.backstop_fired:
        if exit_info.exit_code is None and exit_info.signal is None:
            return RunVerdict(Outcome.INTERNAL_ERROR, message="sandbox failure while compiling: " + "; ".join(exit_info.errors))
        if facts.oom_kills > 0 and facts.ceiling_oom:
            # (Whatever the driver did: on cgroup v1, with no group OOM kill, the kernel ends
            # a compiler's child and gcc or go exits 1 by itself.)
            return RunVerdict(Outcome.INTERNAL_ERROR, message="while compiling, " + CEILING_MESSAGE)
    return RunVerdict(Outcome.COMPILE_ERROR)


def compile_info(facts: StepFacts, output: CompileOutput) -> CompileInfo:
    # (A compile has no idle flag of its own: a compiler silent past idleMs timed out.)
    timed_out = facts.fired in ("wall", "cpu", "idle") or facts.exit.backstop_fired
    return CompileInfo(
        exit_code=facts.exit.exit_code,
        signal=facts.exit.signal,
        timed_out=timed_out,
        duration_ms=facts.duration_ms,
        output=output.text,
        stdout=output.stream_text("stdout"),
        stderr=output.stream_text("stderr"),
    )
