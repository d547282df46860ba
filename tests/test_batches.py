"""Test batches: compile once, each case in a fresh jail, one verdict per case."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest

from shared.grading import TestVerdict as Verdict
from shared.grading import batch_verdict, case_verdict, outputs_match
from shared.limits import DEFAULT_LIMITS
from shared.messages import CtrlMessage, FileSpec, JobSpec, TestCase
from tests.helpers import Api, Realtime, run_job
from worker.isolation.jail import JailExit
from worker.job import batch
from worker.job.supervise import StepFacts

C_SUM = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
int main(int argc, char **argv) {
    if (access("left-behind", F_OK) == 0) { puts("dirty"); return 0; }
    FILE *f = fopen("left-behind", "w"); if (f) fclose(f);
    long a, b;
    if (scanf("%ld %ld", &a, &b) != 2) return 2;
    if (a < 0) return 3;                 /* a runtime error */
    if (a == 0) for (;;) {}              /* a time limit */
    if (argc > 1) printf("%s ", argv[1]);
    printf("%ld\n", a + b);
    return 0;
}
"""


def c_batch(tests: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "language": "c",
        "files": [{"name": "main.c", "content": C_SUM}],
        "tests": tests,
        "limits": {"wallTimeMs": 1500, "cpuMs": 1000},
        **extra,
    }


def run(api: Api, rt: Realtime, body: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    return run_job(api, rt, body, timeout_s=60)


# ---------------------------------------------------------------- the rules, unit by unit


@pytest.mark.parametrize(
    ("actual", "expected", "mode", "same"),
    [
        ("3\n", "3\n", "exact", True),
        ("3\n", "3", "exact", False),
        ("3  \r\n\n\n", "3\n", "lines", True),
        (" 3\n", "3\n", "lines", False),
        ("1 2\n3", "1\n2 3\n", "tokens", True),
        ("1 2", "1 3", "tokens", False),
        ("1\t2\x0b3\x0c", "1 2 3", "tokens", True),
        # Whitespace is ASCII's: other Unicode spaces and separators are characters.
        ("1\u00a02", "1 2", "tokens", False),
        ("1\x1c2", "1 2", "tokens", False),
        ("3\x1f\u3000\n", "3\n", "lines", False),
        ("é\n", "é\n", "exact", True),
    ],
)
def test_comparison_modes(actual: str, expected: str, mode: str, same: bool) -> None:
    assert outputs_match(actual.encode(), expected, mode) is same  # type: ignore[arg-type]


def test_exact_comparison_is_of_the_bytes_written() -> None:
    # Bytes that are not UTF-8 never match text, not even its replacement character.
    assert not outputs_match(b"\xff\n", "\ufffd\n", "exact")
    assert not outputs_match(b"caf\xe9", "café", "exact")
    assert outputs_match("café".encode(), "café", "exact")


def _verdict(**over: Any) -> Verdict:
    facts = {
        "outcome": "completed", "exit_code": 0, "signal": None, "killed_by": None, "truncated": False,
        "stdout": b"3\n", "expected": "3\n", "compare": "exact",
    }  # fmt: skip
    return case_verdict(**{**facts, **over})


def test_verdict_rules_first_match_wins() -> None:
    assert _verdict() is Verdict.ACCEPTED
    assert _verdict(expected=None, stdout=b"anything") is Verdict.ACCEPTED
    assert _verdict(stdout=b"4\n") is Verdict.WRONG_ANSWER
    assert _verdict(exit_code=1) is Verdict.RUNTIME_ERROR
    assert _verdict(exit_code=None, signal="SIGSEGV") is Verdict.RUNTIME_ERROR
    assert _verdict(truncated=True, exit_code=1) is Verdict.OUTPUT_LIMIT_EXCEEDED
    assert _verdict(outcome="timed_out", killed_by="cpu", truncated=True) is Verdict.TIME_LIMIT_EXCEEDED
    assert _verdict(outcome="idle_timed_out", killed_by="idle") is Verdict.TIME_LIMIT_EXCEEDED
    assert _verdict(outcome="memory_exceeded", killed_by="memory") is Verdict.MEMORY_LIMIT_EXCEEDED
    assert _verdict(outcome="internal_error", exit_code=None) is Verdict.INTERNAL_ERROR
    assert _verdict(outcome="killed", killed_by="user") is Verdict.SKIPPED
    assert _verdict(outcome="compile_error") is Verdict.COMPILE_ERROR


def test_batch_verdict() -> None:
    A, W, S, T = Verdict.ACCEPTED, Verdict.WRONG_ANSWER, Verdict.SKIPPED, Verdict.TIME_LIMIT_EXCEEDED
    assert batch_verdict([A, A]) is A
    assert batch_verdict([A, T, W]) is T
    assert batch_verdict([A, W, S]) is W
    assert batch_verdict([S, S]) is S


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_a_c_batch_compiles_once_and_judges_every_case_in_a_fresh_jail(api: Api, realtime: Realtime) -> None:
    tests = [
        {"name": "sum", "stdin": "1 2\n", "expectedOutput": "3\n"},
        {"name": "wrong", "stdin": "2 2\n", "expectedOutput": "5\n"},
        {"name": "crash", "stdin": "-1 2\n", "expectedOutput": "1\n"},
        {"name": "loop", "stdin": "0 1\n", "expectedOutput": "1\n"},
        {"name": "args", "stdin": "5 5\n", "args": ["total:"], "expectedOutput": "total: 10\n"},
        {"name": "no expectation", "stdin": "7 1\n"},
    ]
    result, followed = run(api, realtime, c_batch(tests, collectOutput=True))
    assert result["outcome"] == "completed", followed.summary()
    phases = [p["phase"] for n, p in followed.events if n == "stage"]
    assert phases.count("compiling") == 1 and phases[-1] == "running", phases
    verdicts = [case["verdict"] for case in result["tests"]]
    assert verdicts == ["accepted", "wrong_answer", "runtime_error", "time_limit_exceeded", "accepted", "accepted"]
    assert result["tests"][2]["exitCode"] == 3 and result["tests"][3]["killedBy"] in ("wall", "cpu")
    assert result["summary"] == {"passed": 3, "failed": 3, "skipped": 0, "verdict": "wrong_answer"}
    # The result's own figures sum the batch up (README, Test batches).
    cases = result["tests"]
    assert result["exitCode"] is None and result["signal"] is None and "killedBy" not in result
    assert result["cpuMs"] == sum(case["cpuMs"] for case in cases)
    assert result["memoryKb"] == max(case["memoryKb"] for case in cases)
    assert result["durationMs"] >= max(case["durationMs"] for case in cases)
    live = sorted((p["index"], p["verdict"]) for n, p in followed.events if n == "test_result")
    assert live == list(enumerate(verdicts))
    seqs = sorted(p["seq"] for _, p in followed.events)
    assert seqs == list(range(len(seqs)))
    # The pullable result: every case's own output; no case saw another's file.
    out = api.get(f"/v1/jobs/{followed.job['jobId']}/output").json()
    assert [case["stdout"] for case in out["tests"]] == ["3\n", "4\n", "", "", "total: 10\n", "8\n"]
    assert "dirty" not in "".join(case["stdout"] for case in out["tests"])


def test_a_batch_has_no_stdin_to_send_to(api: Api) -> None:
    job = api.execute(c_batch([{"stdin": "1 1\n"}]))
    response = api.post(f"/v1/jobs/{job['jobId']}/stdin", json={"chunk": "more\n"})
    assert response.status_code == 409, response.text
    assert api.post(f"/v1/jobs/{job['jobId']}/kill").status_code == 202


@pytest.mark.slow
def test_stop_on_first_failure_skips_the_rest(api: Api, realtime: Realtime) -> None:
    tests = [
        {"stdin": "1 1\n", "expectedOutput": "2\n"},
        {"stdin": "1 1\n", "expectedOutput": "3\n"},
        {"stdin": "1 2\n", "expectedOutput": "3\n"},
    ]
    result, followed = run(api, realtime, c_batch(tests, stopOnFirstFailure=True))
    assert [case["verdict"] for case in result["tests"]] == ["accepted", "wrong_answer", "skipped"]
    assert result["summary"]["skipped"] == 1
    assert len([1 for n, _ in followed.events if n == "test_result"]) == 2


@pytest.mark.slow
def test_a_python_batch_compares_by_lines_and_tokens(api: Api, realtime: Realtime) -> None:
    body = {
        "language": "python",
        "files": [{"name": "main.py", "content": "n = int(input())\nfor i in range(n):\n    print(i, '  ')\n"}],
        "compare": "lines",
        "tests": [{"stdin": "2\n", "expectedOutput": "0\n1\n\n"}, {"stdin": "1\n", "expectedOutput": "1\n"}],
    }
    result, _ = run(api, realtime, body)
    assert [case["verdict"] for case in result["tests"]] == ["accepted", "wrong_answer"]
    result, _ = run(
        api, realtime, {**body, "compare": "tokens", "tests": [{"stdin": "3\n", "expectedOutput": "0 1 2"}]}
    )
    assert result["summary"]["verdict"] == "accepted"


@pytest.mark.slow
def test_a_compile_error_ends_the_batch(api: Api, realtime: Realtime) -> None:
    body = c_batch([{"stdin": "1 1\n"}])
    body["files"] = [{"name": "main.c", "content": "int main( {"}]
    result, followed = run(api, realtime, body)
    assert result["outcome"] == "compile_error"
    assert not [1 for n, _ in followed.events if n == "test_result"]


@pytest.mark.slow
def test_killing_a_batch_skips_what_did_not_run(api: Api, realtime: Realtime) -> None:
    tests = [{"stdin": "0 1\n"} for _ in range(6)]  # every case loops until its clock
    job = api.execute(c_batch(tests, limits={"wallTimeMs": 5000, "cpuMs": 5000}, stopOnFirstFailure=True))
    followed = realtime.follow(job)
    api.start(job)
    time.sleep(1.0)
    assert api.post(f"/v1/jobs/{job['jobId']}/kill").status_code == 202
    result = followed.wait_result(timeout_s=20)
    assert result["outcome"] == "killed" and result["killedBy"] == "user"
    assert {case["verdict"] for case in result["tests"]} == {"skipped"}


class _Sandbox:
    """What run_batch touches of a sandbox before it supervises the case."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.jail = SimpleNamespace(name=name, proc=SimpleNamespace(stdin=None), stdout=None, stderr=None)
        self.cgroup = None
        self.memory_base_bytes = 0

    async def load(self, *_args: Any) -> None:
        pass


class _Pool:
    """One ready sandbox at the batch's start, then none until `free` is set."""

    ready = 1

    def __init__(self) -> None:
        self.free = asyncio.Event()
        self.waiting = asyncio.Event()
        self.given_back: list[str] = []

    async def take_unless_failing(self, *_args: Any) -> _Sandbox:
        self.waiting.set()
        await self.free.wait()
        return _Sandbox("late")

    def give_back(self, sandbox: _Sandbox) -> None:
        self.given_back.append(sandbox.name)


async def test_a_kill_reaches_a_case_still_waiting_for_its_sandbox(monkeypatch: pytest.MonkeyPatch) -> None:
    # Case 1 is let through (two may run at once) but finds no sandbox ready: another job
    # took it. A kill comes meanwhile; the sandbox it gets afterwards must not run it.
    ran: list[str] = []

    async def supervise(jail: Any, cgroup: Any, program: Any, clocks: Any, pumps: Any, inbox: Any, **_: Any) -> StepFacts:
        ran.append(jail.name)
        await inbox.get()  # runs until the kill reaches it
        return StepFacts(exit=JailExit(None, "SIGKILL", False), fired="user", duration_ms=1, cpu_ms=1, memory_kb=0, oom_kills=0)

    monkeypatch.setattr(batch, "supervise", supervise)
    first, pool, ctrl = _Sandbox("first"), _Pool(), asyncio.Queue()
    spec = JobSpec(
        job_id="j", language="python", version="3", files=[FileSpec(name="main.py", content="")],
        limits=DEFAULT_LIMITS, created_at_ms=0, tests=[TestCase(stdin=""), TestCase(stdin="")],
    )  # fmt: skip
    events = SimpleNamespace(emit=lambda *_a, **_k: asyncio.sleep(0))
    task = asyncio.create_task(
        batch.run_batch(
            spec=spec, manifest=SimpleNamespace(run=["python3", "{entry}"], env={}), entry="main.py",
            sources=["main.py"], program_rlimits={}, first=first, files=[], executable=frozenset(), pool=pool,
            events=events, ctrl=ctrl, keep_output=False,
        )  # type: ignore[arg-type]
    )  # fmt: skip
    await asyncio.wait_for(pool.waiting.wait(), 5)
    ctrl.put_nowait(CtrlMessage(type="kill"))
    await asyncio.sleep(0.05)
    pool.free.set()
    result = await asyncio.wait_for(task, 5)
    assert ran == ["first"]  # the late sandbox never ran case 1
    assert result.killed and [c.verdict for c in result.cases] == ["skipped", "skipped"]
    assert sorted(pool.given_back) == ["first", "late"]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"tests": []}, "tests"),
        ({"tests": [{"stdin": "1"}] * 101}, "tests"),
        ({"stdin": "1 2\n"}, "stdin"),
        ({"args": ["x"]}, "args"),
        ({"tests": [{"stdin": 5}]}, "tests[0].stdin"),
        ({"tests": [{"bogus": 1}]}, "tests"),
        ({"compare": "fuzzy"}, "compare"),
    ],
)
def test_bad_batches_are_refused_naming_the_field(api: Api, change: dict[str, Any], field: str) -> None:
    body = {**c_batch([{"stdin": "1 1\n"}]), **change}
    response = api.post("/v1/execute", json=body)
    assert response.status_code == 400, response.text
    assert field in response.text
