"""Test-case verdicts: how a case's facts and output become `accepted`, `wrong_answer`, ….

Pure functions over trusted facts only (outcome, exit code, signal, killedBy, truncated:
what the worker's clocks, the cgroup and the gate reported) and the captured stdout. The
rules, first match wins:

    compile_error           the program did not compile (every case)
    skipped                 the case did not run: an earlier case failed under
                            stopOnFirstFailure, or the job was killed or ended first
    internal_error          the platform failed while running the case
    memory_limit_exceeded   the memory limit ended it (killedBy "memory" / the cgroup's OOM)
    time_limit_exceeded     the wall, CPU or idle clock ended it
    output_limit_exceeded   it wrote more than outputKb (stdout and stderr together)
    runtime_error           it exited non-zero or was ended by a signal
    accepted                no expectedOutput was given, or stdout matches it under `compare`
    wrong_answer            stdout does not match expectedOutput under `compare`

Comparison modes, over the bytes the program wrote and the expected text's UTF-8 bytes
(whitespace is ASCII's: space, tab, newline, carriage return, vertical tab, form feed):
    exact    byte for byte
    lines    line by line, ignoring whitespace at the end of each line and blank lines at the
             end of the output; "\\r\\n" and "\\n" are the same line end
    tokens   the whitespace-separated tokens are equal
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import Literal

import msgspec

from shared.messages import (
    CaseFacts,
    CaseOutput,
    Outcome,
    ResultEvent,
    TestCase,
    TestSummary,
    case_facts,
    case_without_output,
    result_without_run,
)

__all__ = [
    "COMPARE_PIECE_BYTES",
    "CompareMode",
    "TestVerdict",
    "batch_ended_early",
    "batch_summary",
    "batch_verdict",
    "canonical_form",
    "canonical_pieces",
    "case_verdict",
    "cases_not_run",
    "killed_batch_before_start",
    "not_run_case",
    "outputs_match",
    "result_facts",
]

CompareMode = Literal["exact", "lines", "tokens"]


class TestVerdict(enum.StrEnum):
    ACCEPTED = "accepted"
    WRONG_ANSWER = "wrong_answer"
    TIME_LIMIT_EXCEEDED = "time_limit_exceeded"
    MEMORY_LIMIT_EXCEEDED = "memory_limit_exceeded"
    RUNTIME_ERROR = "runtime_error"
    OUTPUT_LIMIT_EXCEEDED = "output_limit_exceeded"
    COMPILE_ERROR = "compile_error"
    SKIPPED = "skipped"
    INTERNAL_ERROR = "internal_error"


# Outputs are brought to their canonical form a piece of about this size at a time, so a
# caller can let other work in between: a case may write 16 MiB, about 0.5 s of comparing.
COMPARE_PIECE_BYTES = 128 * 1024
# (bytes methods know only ASCII whitespace: U+00A0 or U+3000 in an answer is a character.)
_WHITESPACE = re.compile(rb"[ \t\n\r\x0b\x0c]")


def canonical_pieces(data: bytes, mode: Literal["lines", "tokens"]) -> Iterator[bytes]:
    """`data` in the canonical form of `mode`, piece by piece (join them with
    `canonical_form`): under `lines` every line right-stripped ("\r\n" ends a line like "\n",
    as the "\r" is stripped), under `tokens` the tokens one space apart. A piece ends at a
    line end (a whitespace byte for tokens), so no line or token is split between two."""
    size = len(data)
    start = 0
    while start < size:
        end = min(start + COMPARE_PIECE_BYTES, size)
        if end < size:
            if mode == "lines":
                cut = data.rfind(b"\n", start, end)
                if cut < 0:  # one long line: it ends at the next line end
                    cut = data.find(b"\n", end)
            else:
                cut = max(data.rfind(space, start, end) for space in (b" ", b"\t", b"\n", b"\r", b"\x0b", b"\x0c"))
                if cut < 0:
                    found = _WHITESPACE.search(data, end)
                    cut = found.start() if found else -1
            end = cut + 1 if cut >= 0 else size
        piece = data[start:end]
        yield b"\n".join([line.rstrip() for line in piece.split(b"\n")]) if mode == "lines" else b" ".join(piece.split())
        start = end


def canonical_form(pieces: Iterable[bytes], mode: Literal["lines", "tokens"]) -> bytes:
    """The pieces of `canonical_pieces` as one: blank lines at the end do not count."""
    if mode == "lines":
        return b"".join(pieces).rstrip(b"\n")
    return b" ".join(piece for piece in pieces if piece)


def outputs_match(actual: bytes, expected: str, mode: CompareMode) -> bool:
    wanted = expected.encode()
    if mode == "exact":
        return actual == wanted
    forms = (canonical_form(canonical_pieces(data, mode), mode) for data in (actual, wanted))
    return next(forms) == next(forms)


def case_verdict(
    *,
    outcome: str,
    exit_code: int | None,
    signal: str | None,
    killed_by: str | None,
    truncated: bool,
    stdout: bytes,
    expected: str | None,
    compare: CompareMode,
) -> TestVerdict:
    """The verdict of one case that ran (see the module docstring for the rules)."""
    if outcome == "compile_error":
        return TestVerdict.COMPILE_ERROR
    if outcome in ("killed", "expired", "lost") or killed_by == "user":
        return TestVerdict.SKIPPED
    if outcome == "internal_error":
        return TestVerdict.INTERNAL_ERROR
    if outcome == "memory_exceeded" or killed_by == "memory":
        return TestVerdict.MEMORY_LIMIT_EXCEEDED
    if outcome in ("timed_out", "idle_timed_out") or killed_by in ("wall", "cpu", "idle"):
        return TestVerdict.TIME_LIMIT_EXCEEDED
    if truncated:
        return TestVerdict.OUTPUT_LIMIT_EXCEEDED
    if signal is not None or exit_code != 0:
        return TestVerdict.RUNTIME_ERROR
    if expected is None or outputs_match(stdout, expected, compare):
        return TestVerdict.ACCEPTED
    return TestVerdict.WRONG_ANSWER


def batch_verdict(verdicts: list[TestVerdict]) -> TestVerdict:
    """The whole job's: accepted only when every case is; else the first case's (by index)
    that is neither accepted nor skipped."""
    for verdict in verdicts:
        if verdict not in (TestVerdict.ACCEPTED, TestVerdict.SKIPPED):
            return verdict
    return TestVerdict.ACCEPTED if all(v is TestVerdict.ACCEPTED for v in verdicts) else TestVerdict.SKIPPED


def batch_summary(cases: Sequence[CaseFacts]) -> TestSummary:
    verdicts = [TestVerdict(c.verdict) for c in cases]
    return TestSummary(
        passed=sum(v is TestVerdict.ACCEPTED for v in verdicts),
        failed=sum(v not in (TestVerdict.ACCEPTED, TestVerdict.SKIPPED) for v in verdicts),
        skipped=sum(v is TestVerdict.SKIPPED for v in verdicts),
        verdict=batch_verdict(verdicts).value,
    )


def not_run_case(index: int, case: TestCase, outcome: Outcome | None, verdict: TestVerdict) -> CaseOutput:
    """A case with no facts of its own: skipped, or lost to a failure of the platform."""
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


def result_facts(cases: Sequence[CaseFacts]) -> list[CaseFacts]:
    """The cases as the result event carries them: without their output, nor their message
    (each test_result event and /output have it), so the result still fits soketi's payload
    limit by construction (see worker/job/payload.py)."""
    return [msgspec.structs.replace(case_facts(c), message=None) if c.message else case_facts(c) for c in cases]


def batch_ended_early(
    tests: Sequence[TestCase], outcome: Outcome, message: str | None, ran: Sequence[CaseFacts | None] = ()
) -> ResultEvent:
    """The result of a batch ended by the platform before all of its cases ran (seq filled
    in by the script that writes it): the cases in `ran` (by index) keep their facts."""
    kept = [case_without_output(facts) if facts is not None else None for facts in ran]
    cases, summary = cases_not_run(tests, outcome, kept)
    result = result_without_run(outcome, message)
    return msgspec.structs.replace(result, tests=result_facts(cases), summary=summary)


def killed_batch_before_start(tests: Sequence[TestCase]) -> ResultEvent:
    """The result of a batch killed before any worker took it."""
    return batch_ended_early(tests, Outcome.KILLED, "killed before it started")


def cases_not_run(
    tests: Sequence[TestCase], outcome: Outcome, ran: Sequence[CaseOutput | None] = ()
) -> tuple[list[CaseOutput], TestSummary]:
    """The cases and summary of a batch that ended as `outcome` before all of its cases ran:
    those in `ran` keep their own facts; each other is compile_error after a failed compile,
    internal_error after a failure of the platform, and skipped otherwise (killed, expired)."""
    verdict = {
        Outcome.COMPILE_ERROR: TestVerdict.COMPILE_ERROR,
        Outcome.INTERNAL_ERROR: TestVerdict.INTERNAL_ERROR,
    }.get(outcome, TestVerdict.SKIPPED)
    cases = [
        (ran[index] if index < len(ran) else None) or not_run_case(index, case, outcome, verdict)
        for index, case in enumerate(tests)
    ]
    return cases, batch_summary(cases)
