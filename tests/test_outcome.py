"""The verdict table of worker/job/outcome.py, branch by branch (pure: no stack, no jail).

Each case builds the facts a step could end with (which clock fired, what the gate or
nsjail reported, the cgroup's OOM counter) by hand and checks the whole verdict, so a
refactor that reorders the table or drops a field is caught here, not by a hostile
program hours later.
"""

from __future__ import annotations

import pytest

from shared.manifest import HeapLimit
from shared.messages import CompileInfo, Outcome
from worker.isolation.jail import JailExit
from worker.job.outcome import (
    CEILING_MESSAGE,
    RunVerdict,
    compile_info,
    compile_succeeded,
    judge_compile_failure,
    judge_run,
)
from worker.job.output import CompileOutput, StreamTail
from worker.job.supervise import StepFacts


def exited(
    code: int | None = None, sig: str | None = None, backstop: bool = False, errors: list[str] | None = None
) -> JailExit:
    return JailExit(exit_code=code, signal=sig, backstop_fired=backstop, errors=errors or [])


def facts(exit_info: JailExit, fired: str | None = None, oom_kills: int = 0, ceiling_oom: bool = False) -> StepFacts:
    return StepFacts(
        exit=exit_info, fired=fired, duration_ms=1234, cpu_ms=567, memory_kb=8910, oom_kills=oom_kills, ceiling_oom=ceiling_oom
    )


COMPLETED = RunVerdict(Outcome.COMPLETED)
KILLED = RunVerdict(Outcome.KILLED, killed_by="user")
WALL = RunVerdict(Outcome.TIMED_OUT, timed_out=True, killed_by="wall")
CPU = RunVerdict(Outcome.TIMED_OUT, timed_out=True, killed_by="cpu")
IDLE = RunVerdict(Outcome.IDLE_TIMED_OUT, idle_timed_out=True, killed_by="idle")
MEMORY = RunVerdict(Outcome.MEMORY_EXCEEDED, killed_by="memory")
CEILING = RunVerdict(Outcome.MEMORY_EXCEEDED, killed_by="memory", message=CEILING_MESSAGE)

# ---------------------------------------------------------------- judge_run

RUN_TABLE = [
    # A kill request: killed, unless the program had already ended by itself with an exit code.
    ("user, program had exited 0 by itself", facts(exited(0), "user"), COMPLETED),
    ("user, program had exited 3 by itself", facts(exited(3), "user"), COMPLETED),
    ("user, program had exited by itself, OOM counted earlier", facts(exited(1), "user", oom_kills=1), COMPLETED),
    ("user, program had crashed by itself", facts(exited(sig="SIGSEGV"), "user"), COMPLETED),
    ("user, program had aborted by itself", facts(exited(sig="SIGABRT"), "user", oom_kills=1), COMPLETED),
    ("user, killed by the kill", facts(exited(sig="SIGKILL"), "user"), KILLED),
    ("user, gate killed, nothing reported", facts(exited(), "user"), KILLED),
    ("user, both an exit code and a signal", facts(exited(0, "SIGKILL"), "user"), KILLED),
    ("user wins over an OOM kill", facts(exited(sig="SIGKILL"), "user", oom_kills=2), KILLED),
    ("user wins over the backstop", facts(exited(sig="SIGKILL", backstop=True), "user"), KILLED),
    # The worker's wall and CPU clocks.
    ("wall", facts(exited(sig="SIGKILL"), "wall"), WALL),
    ("wall, even if the program exited 0 at the same moment", facts(exited(0), "wall"), WALL),
    ("wall wins over an OOM kill", facts(exited(sig="SIGKILL"), "wall", oom_kills=1), WALL),
    ("wall with nothing reported", facts(exited(), "wall"), WALL),
    ("cpu", facts(exited(sig="SIGKILL"), "cpu"), CPU),
    ("cpu wins over an OOM kill", facts(exited(sig="SIGKILL"), "cpu", oom_kills=1), CPU),
    ("cpu, the program's own SIGXCPU", facts(exited(sig="SIGXCPU"), "cpu"), CPU),
    # nsjail's backstop time limit: a wall timeout, but only when no clock of ours fired.
    ("backstop, no clock fired", facts(exited(sig="SIGKILL", backstop=True)), WALL),
    ("backstop, nothing reported (not an internal error)", facts(exited(backstop=True)), WALL),
    ("backstop wins over an OOM kill", facts(exited(sig="SIGKILL", backstop=True), oom_kills=1), WALL),
    ("backstop after the cpu clock stays cpu", facts(exited(sig="SIGKILL", backstop=True), "cpu"), CPU),
    ("backstop after the idle clock stays idle", facts(exited(sig="SIGKILL", backstop=True), "idle"), IDLE),
    # The idle clock.
    ("idle", facts(exited(sig="SIGKILL"), "idle"), IDLE),
    ("idle wins over an OOM kill", facts(exited(sig="SIGKILL"), "idle", oom_kills=1), IDLE),
    ("idle with nothing reported", facts(exited(), "idle"), IDLE),
    # The cgroup's OOM counter: memory only when the program died of SIGKILL.
    ("OOM kill", facts(exited(sig="SIGKILL"), oom_kills=1), MEMORY),
    ("several OOM kills", facts(exited(sig="SIGKILL"), oom_kills=7), MEMORY),
    # The deployment's ceiling on all jobs: the same verdict, and a message that says so.
    ("OOM kill under the job's own limit", facts(exited(sig="SIGKILL"), oom_kills=1, ceiling_oom=True), CEILING),
    ("ceiling OOM of a child, program exited 1", facts(exited(1), oom_kills=1, ceiling_oom=True), COMPLETED),
    ("wall wins over a ceiling OOM", facts(exited(sig="SIGKILL"), "wall", oom_kills=1, ceiling_oom=True), WALL),
    ("SIGKILL without an OOM kill is the program's own affair", facts(exited(sig="SIGKILL")), COMPLETED),
    ("OOM kill of a child, program exited 1", facts(exited(1), oom_kills=1), COMPLETED),
    ("OOM kill of a child, program aborted", facts(exited(sig="SIGABRT"), oom_kills=1), COMPLETED),
    # Without the kernel's group OOM kill (v1) the worker ends the rest of the job itself.
    ("the worker ended the job at an OOM kill", facts(exited(sig="SIGKILL"), "memory", oom_kills=1), MEMORY),
    ("OOM kill of a child, program exited before a tick", facts(exited(0), "memory", oom_kills=1), MEMORY),
    ("the worker ended it at a ceiling OOM", facts(exited(sig="SIGKILL"), "memory", oom_kills=1, ceiling_oom=True), CEILING),
    # Plain ends.
    ("exit 0", facts(exited(0)), COMPLETED),
    ("exit 1", facts(exited(1)), COMPLETED),
    ("exit 255", facts(exited(255)), COMPLETED),
    ("SIGSEGV", facts(exited(sig="SIGSEGV")), COMPLETED),
    ("SIGSYS (seccomp)", facts(exited(sig="SIGSYS")), COMPLETED),
    ("SIGXFSZ", facts(exited(sig="SIGXFSZ")), COMPLETED),
]


@pytest.mark.parametrize(("step", "verdict"), [(f, v) for _, f, v in RUN_TABLE], ids=[name for name, _, _ in RUN_TABLE])
def test_judge_run(step: StepFacts, verdict: RunVerdict) -> None:
    assert judge_run(step) == verdict


def test_nothing_reported_and_no_clock_is_a_sandbox_failure_with_nsjails_errors() -> None:
    verdict = judge_run(facts(exited(errors=["[E] mount failed", "[F] cannot continue"])))
    assert verdict == RunVerdict(
        Outcome.INTERNAL_ERROR, message="sandbox failure: [E] mount failed; [F] cannot continue"
    )


def test_nothing_reported_without_error_lines_is_still_a_sandbox_failure() -> None:
    verdict = judge_run(facts(exited(errors=["nsjail exited with 255"]), oom_kills=1))
    assert verdict == RunVerdict(Outcome.INTERNAL_ERROR, message="sandbox failure: nsjail exited with 255")
    assert judge_run(facts(exited())) == RunVerdict(Outcome.INTERNAL_ERROR, message="sandbox failure: ")


HEAP = MEMORY
HEAP_TABLE = [
    # The runtime gave up at its heap cap (its own last words: HeapLimit.ran_out).
    ("the runtime's heap ran out", facts(exited(1)), HEAP),
    ("the runtime's heap ran out with an abort", facts(exited(sig="SIGABRT")), HEAP),
    # Anything that ended it first is what ended it.
    ("a kill came first", facts(exited(sig="SIGKILL"), "user"), KILLED),
    ("a kill came as the runtime had given up", facts(exited(sig="SIGABRT"), "user"), HEAP),
    ("the wall clock came first", facts(exited(1), "wall"), WALL),
    ("the cgroup's OOM kill", facts(exited(sig="SIGKILL"), oom_kills=1), MEMORY),
]


@pytest.mark.parametrize(("step", "verdict"), [(f, v) for _, f, v in HEAP_TABLE], ids=[name for name, _, _ in HEAP_TABLE])
def test_judge_run_when_the_runtimes_heap_ran_out(step: StepFacts, verdict: RunVerdict) -> None:
    assert judge_run(step, heap_ran_out=True) == verdict


def test_a_runtimes_last_words_on_its_heap_are_recognised_only_with_its_exit() -> None:
    java = HeapLimit(messages=["java.lang.OutOfMemoryError: Java heap space"], exit_code=1)
    words = b'Exception in thread "main" java.lang.OutOfMemoryError: Java heap space\n\tat Main.main(Main.java:5)\n'
    assert java.ran_out(1, None, words)
    assert not java.ran_out(0, None, words)  # caught, and the program went on to exit 0
    assert not java.ran_out(None, "SIGKILL", words)
    assert not java.ran_out(1, None, b"java.lang.OutOfMemoryError: unable to create native thread")  # pids
    node = HeapLimit(messages=["JavaScript heap out of memory"], signal="SIGABRT")
    assert node.ran_out(None, "SIGABRT", b"FATAL ERROR: Reached heap limit Allocation failed - JavaScript heap out of memory\n")
    assert not node.ran_out(1, None, b"JavaScript heap out of memory")
    # The last words after any amount of output, whatever the budget kept.
    tail = StreamTail()
    tail.feed(b"x" * 100_000)
    for piece in (b"FATAL ERROR: Reached heap limit ", b"Allocation failed - JavaScript heap out of memory\n"):
        tail.feed(piece)
    assert node.ran_out(None, "SIGABRT", tail.data) and len(tail.data) == StreamTail.SIZE


def test_every_outcome_the_table_can_give_is_covered() -> None:
    given = {v.outcome for _, _, v in RUN_TABLE} | {Outcome.INTERNAL_ERROR}
    assert given == {
        Outcome.COMPLETED, Outcome.KILLED, Outcome.TIMED_OUT, Outcome.IDLE_TIMED_OUT, Outcome.MEMORY_EXCEEDED,
        Outcome.INTERNAL_ERROR,
    }  # fmt: skip


# ---------------------------------------------------------------- compile_succeeded

COMPILE_TABLE = [
    ("exit 0", facts(exited(0)), True),
    ("exit 1", facts(exited(1)), False),
    ("exit 0 but a signal too", facts(exited(0, "SIGKILL")), False),
    ("killed by a signal", facts(exited(sig="SIGSEGV")), False),
    ("nothing reported", facts(exited()), False),
    ("exit 0 as the wall clock fired", facts(exited(0), "wall"), False),
    ("exit 0 as the cpu clock fired", facts(exited(0), "cpu"), False),
    ("exit 0 as a kill request came", facts(exited(0), "user"), False),
    ("exit 0 as the idle clock fired", facts(exited(0), "idle"), False),
    ("OOM-killed compiler", facts(exited(sig="SIGKILL"), oom_kills=1), False),
    ("compiler's child OOM-killed, the driver ended by the worker", facts(exited(sig="SIGKILL"), "memory", oom_kills=1), False),
    ("compiler's child OOM-killed, the driver exited 0 before a tick", facts(exited(0), "memory", oom_kills=1), False),
]


@pytest.mark.parametrize(
    ("step", "ok"), [(f, ok) for _, f, ok in COMPILE_TABLE], ids=[name for name, _, _ in COMPILE_TABLE]
)
def test_compile_succeeded(step: StepFacts, ok: bool) -> None:
    assert compile_succeeded(step) is ok


# ---------------------------------------------------------------- judge_compile_failure

COMPILE_ERROR = RunVerdict(Outcome.COMPILE_ERROR)
COMPILE_FAILURE_TABLE = [
    # The submission's fault: the compiler said no, crashed, ran out of its own time or memory.
    ("exit 1", facts(exited(1)), COMPILE_ERROR),
    ("compiler not found (the gate's 127)", facts(exited(127)), COMPILE_ERROR),
    ("compiler crashed", facts(exited(sig="SIGSEGV")), COMPILE_ERROR),
    ("wall", facts(exited(sig="SIGKILL"), "wall"), COMPILE_ERROR),
    ("cpu", facts(exited(sig="SIGKILL"), "cpu"), COMPILE_ERROR),
    ("idle", facts(exited(sig="SIGKILL"), "idle"), COMPILE_ERROR),
    ("backstop", facts(exited(sig="SIGKILL", backstop=True)), COMPILE_ERROR),
    ("its own memory limit", facts(exited(sig="SIGKILL"), oom_kills=1), COMPILE_ERROR),
    ("its own limit, the driver exited by itself", facts(exited(1), oom_kills=1), COMPILE_ERROR),
    ("its own limit, the rest ended by the worker", facts(exited(sig="SIGKILL"), "memory", oom_kills=1), COMPILE_ERROR),
    ("a clock fired with nothing reported", facts(exited(), "wall"), COMPILE_ERROR),
    # A kill request.
    ("user", facts(exited(sig="SIGKILL"), "user"), RunVerdict(Outcome.KILLED, killed_by="user", message="killed while compiling")),
    ("user, nothing reported", facts(exited(), "user"), RunVerdict(Outcome.KILLED, killed_by="user", message="killed while compiling")),
    # The platform's fault: the program never ran, so the job is safe to submit again.
    (
        "sandbox failure",
        facts(exited(errors=["nsjail: clone failed"])),
        RunVerdict(Outcome.INTERNAL_ERROR, message="sandbox failure while compiling: nsjail: clone failed"),
    ),
    (
        "the ceiling on all jobs",
        facts(exited(sig="SIGKILL"), oom_kills=1, ceiling_oom=True),
        RunVerdict(Outcome.INTERNAL_ERROR, message="while compiling, " + CEILING_MESSAGE),
    ),
    (
        "the ceiling, the rest ended by the worker (v1)",
        facts(exited(sig="SIGKILL"), "memory", oom_kills=1, ceiling_oom=True),
        RunVerdict(Outcome.INTERNAL_ERROR, message="while compiling, " + CEILING_MESSAGE),
    ),
    (
        "the ceiling, the driver exited by itself (v1: its child was the one killed)",
        facts(exited(1), oom_kills=1, ceiling_oom=True),
        RunVerdict(Outcome.INTERNAL_ERROR, message="while compiling, " + CEILING_MESSAGE),
    ),
]


@pytest.mark.parametrize(
    ("step", "verdict"), [(f, v) for _, f, v in COMPILE_FAILURE_TABLE], ids=[name for name, _, _ in COMPILE_FAILURE_TABLE]
)
def test_judge_compile_failure(step: StepFacts, verdict: RunVerdict) -> None:
    assert not compile_succeeded(step)
    assert judge_compile_failure(step) == verdict


# ---------------------------------------------------------------- compile_info


def _output(limit: int = 1024) -> CompileOutput:
    out = CompileOutput(limit)
    out.feed(b"main.c:1: warning\n", "stdout")
    out.feed(b"main.c:2: error\n", "stderr")
    out.feed(b"linking\n", "stdout")
    return out


@pytest.mark.parametrize(
    ("fired", "backstop", "timed_out"),
    [(None, False, False), ("wall", False, True), ("cpu", False, True), (None, True, True), ("user", False, False),
     ("idle", False, True), ("user", True, True)],
)  # fmt: skip
def test_compile_info_timed_out(fired: str | None, backstop: bool, timed_out: bool) -> None:
    info = compile_info(facts(exited(sig="SIGKILL", backstop=backstop), fired), _output())
    assert info.timed_out is timed_out


def test_compile_info_carries_the_facts_and_both_views_of_the_output() -> None:
    info = compile_info(facts(exited(1)), _output())
    assert info == CompileInfo(
        exit_code=1,
        signal=None,
        timed_out=False,
        duration_ms=1234,
        output="main.c:1: warning\nmain.c:2: error\nlinking\n",
        stdout="main.c:1: warning\nlinking\n",
        stderr="main.c:2: error\n",
    )
    signalled = compile_info(facts(exited(sig="SIGSEGV")), CompileOutput(1024))
    assert (signalled.exit_code, signalled.signal, signalled.output, signalled.stdout, signalled.stderr) == (
        None, "SIGSEGV", "", "", "",
    )  # fmt: skip


def test_compile_info_output_is_capped_with_one_marker() -> None:
    out = CompileOutput(1024)
    out.feed(b"e" * 1000, "stderr")
    out.feed(b"o" * 1000, "stdout")
    info = compile_info(facts(exited(1)), out)
    assert info.output == "e" * 1000 + "o" * 24 + "\n[compiler output truncated at 1 KiB]\n"
    assert info.stderr == "e" * 1000 and info.stdout == "o" * 1000
