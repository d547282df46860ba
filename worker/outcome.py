"""How a step's facts become a verdict (pure; the table is unit-tested).

The exit code alone cannot tell a timeout from an OOM kill (both are SIGKILL), so the
verdict comes from channels the program cannot write: which of the worker's clocks fired,
nsjail's log on the worker's own pipe, and the cgroup's OOM-kill counter.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.messages import CompileInfo, Outcome
from worker.supervise import StepFacts

__all__ = ["RunVerdict", "compile_info", "compile_succeeded", "judge_run"]


@dataclass(frozen=True)
class RunVerdict:
    outcome: Outcome
    timed_out: bool
    idle_timed_out: bool
    message: str | None = None


def judge_run(facts: StepFacts) -> RunVerdict:
    exit_info = facts.exit
    # nsjail's own time limit is only a backstop; if it ever fires, it is still a timeout.
    timed_out = facts.fired in ("wall", "cpu") or (facts.fired is None and exit_info.backstop_fired)
    if facts.fired == "user":
        return RunVerdict(Outcome.KILLED, False, False)
    if timed_out:
        return RunVerdict(Outcome.TIMED_OUT, True, False)
    if facts.fired == "idle":
        return RunVerdict(Outcome.IDLE_TIMED_OUT, False, True)
    if facts.oom_kills > 0 and exit_info.signal == "SIGKILL":
        return RunVerdict(Outcome.MEMORY_EXCEEDED, False, False)
    if exit_info.exit_code is None and exit_info.signal is None:
        return RunVerdict(Outcome.INTERNAL_ERROR, False, False, "sandbox failure: " + "; ".join(exit_info.errors))
    return RunVerdict(Outcome.COMPLETED, False, False)


def compile_succeeded(facts: StepFacts) -> bool:
    return facts.fired is None and facts.exit.signal is None and facts.exit.exit_code == 0


def compile_info(facts: StepFacts, output: str) -> CompileInfo:
    timed_out = facts.fired in ("wall", "cpu") or facts.exit.backstop_fired
    return CompileInfo(
        exit_code=facts.exit.exit_code,
        signal=facts.exit.signal,
        timed_out=timed_out,
        duration_ms=facts.duration_ms,
        output=output,
    )
