"""Test batches: compile once, each case in a fresh jail, one verdict per case."""

from __future__ import annotations

import asyncio
import base64
import signal
import time
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from shared.chunking import utf8_prefix
from shared.grading import TestVerdict as Verdict
from shared.grading import batch_verdict, case_verdict, cases_not_run, not_run_case, outputs_match
from shared.limits import DEFAULT_LIMITS
from shared.messages import CtrlMessage, FileSpec, JobSpec, Outcome, TestCase
from tests.conftest import StackFactory
from tests.helpers import Api, Followed, Realtime, run_job
from worker.isolation.jail import JailExit
from worker.isolation.sandbox import Uncharged
from worker.isolation.workspace import Packed
from worker.job import batch
from worker.job.supervise import StepFacts
from worker.messaging.queue import Fenced

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


def _lines_as_before(data: bytes) -> list[bytes]:
    lines = [line.rstrip() for line in data.replace(b"\r\n", b"\n").split(b"\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def test_comparing_piece_by_piece_judges_as_comparing_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # Random outputs of whitespace-heavy text, cut into pieces of a few bytes: every line
    # and token that straddles a cut must be judged as the whole-output rules would.
    import random

    from shared import grading

    rng = random.Random(7)
    alphabet = [b"a", b"b", b" ", b"\t", b"\n", b"\r", b"\r\n", b"\x0b", b"\x0c", b"\x1c", "\u00a0".encode()]
    for piece_bytes in (1, 3, 8, 64):
        monkeypatch.setattr(grading, "COMPARE_PIECE_BYTES", piece_bytes)
        for _ in range(400):
            actual = b"".join(rng.choice(alphabet) for _ in range(rng.randrange(40)))
            expected = b"".join(rng.choice(alphabet) for _ in range(rng.randrange(40)))
            if rng.random() < 0.5:  # often the same answer, spaced differently
                expected = b" \n".join(actual.split()) + b"\n" * rng.randrange(3)
            text = expected.decode()
            assert outputs_match(actual, text, "lines") == (_lines_as_before(actual) == _lines_as_before(expected))
            assert outputs_match(actual, text, "tokens") == (actual.split() == expected.split())


async def test_comparing_a_large_output_leaves_the_event_loop_free() -> None:
    # 16 MiB of short lines took half a second on the loop in one go (every other job's
    # clocks, kills and output waited it out); it now lets the loop in between pieces.
    actual = b"ab   \n" * (16 * 1024 * 1024 // 6)
    expected = "ab\n" * (16 * 1024 * 1024 // 6)
    gaps: list[float] = []

    async def ticker() -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(0.005)
            gaps.append(loop.time() - last)
            last = loop.time()

    ticking = asyncio.create_task(ticker())
    await asyncio.sleep(0.02)
    try:
        assert await batch.output_matches(actual, expected, "lines")
        assert await batch.output_matches(actual, expected, "tokens")
        assert not await batch.output_matches(actual, expected + "ab\n", "tokens")
    finally:
        ticking.cancel()
    assert max(gaps) < 0.1, max(gaps)


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


C_BIG = r"""
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>
static volatile char pad[12 << 20] = {1, [(12 << 20) - 1] = 2};  /* a 12 MiB program */
int main(void) {
    struct stat st;
    if (stat("/proc/self/exe", &st) != 0) return 2;
    if (access("made.txt", F_OK) == 0) { puts("dirty"); return 0; }
    FILE *f = fopen("made.txt", "w"); if (!f) return 4; fclose(f);
    printf("%d %o %d %d\n", pad[0] + pad[sizeof pad - 1], (int)(st.st_mode & 0777), st.st_uid == getuid(), st.st_size > (12 << 20));
    return 0;
}
"""


@pytest.mark.slow
def test_a_big_compiled_program_is_copied_into_every_case_whole_and_its_own(api: Api, realtime: Realtime) -> None:
    # Past PACKED_FROM_BYTES (8 MiB) the cases get their copy from a copier in a cgroup of
    # its own (test_jail_teardown checks the charge): each runs the whole program, mode 0755
    # and owned by the case, in a workspace it may write to, and no case's memory figure
    # holds the copy (case 0 runs where the compile left it).
    body = {"language": "c", "files": [{"name": "main.c", "content": C_BIG}], "tests": [{"expectedOutput": "3 755 1 1\n"}] * 3}
    result, followed = run(api, realtime, body | {"collectOutput": True})
    assert [case["verdict"] for case in result["tests"]] == ["accepted"] * 3, followed.summary()
    figures = [case["memoryKb"] for case in result["tests"]]
    assert max(figures) - min(figures) < 2048, figures


def test_a_silent_case_is_judged_by_its_wall_and_cpu_clocks_unless_it_names_an_idle_one(
    make_stack: StackFactory,
) -> None:
    # A case's input is given up front: one computing in silence for longer than the idle
    # window (here the server's 1 s maximum, 10 s by default) waits on nobody. It was ended
    # `idle_timed_out` well inside the wall and CPU limits it asked for.
    stack = make_stack(MAX_IDLE_MS="1000")
    api, rt = Api(stack), Realtime(stack)
    silent = {"language": "python", "files": [{"name": "main.py", "content": "import time\ntime.sleep(1.6)\nprint('done')\n"}]}
    try:
        result, followed = run(api, rt, {**silent, "tests": [{"expectedOutput": "done\n"}], "limits": {"wallTimeMs": 5000}})
        named, _ = run(api, rt, {**silent, "tests": [{"expectedOutput": "done\n"}], "limits": {"idleMs": 1000}})
    finally:
        api.close()
        rt.close()
    assert [case["verdict"] for case in result["tests"]] == ["accepted"], followed.summary()
    assert [(case["verdict"], case["killedBy"]) for case in named["tests"]] == [("time_limit_exceeded", "idle")]


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
    assert [case["outcome"] for case in result["tests"]] == ["completed", "completed", None]  # case 2 never ran
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
def test_a_case_that_fills_its_runtimes_heap_is_a_memory_limit_exceeded(api: Api, realtime: Realtime) -> None:
    # V8 gives up at its heap cap by itself (SIGABRT, its own words) before the cgroup would
    # kill it: a grader's verdict is still the memory limit, not a crash.
    body = {
        "language": "javascript",
        "files": [{"name": "main.js", "content": "const n = +require('fs').readFileSync(0, 'utf8');\n"
                   "const k = []; for (let i = 0; i < n; i++) k.push(new Array(1 << 20).fill(1.5));\nconsole.log('ok');\n"}],
        "limits": {"memoryMb": 128},
        "tests": [{"stdin": "1", "expectedOutput": "ok\n"}, {"stdin": "1000000"}],
    }  # fmt: skip
    result, _ = run(api, realtime, body)
    first, second = result["tests"]
    assert first["verdict"] == "accepted", result
    assert (second["outcome"], second["verdict"], second["signal"]) == ("memory_exceeded", "memory_limit_exceeded", "SIGABRT"), result


@pytest.mark.slow
def test_a_compile_error_ends_the_batch(api: Api, realtime: Realtime) -> None:
    body = c_batch([{"stdin": "1 1\n"}])
    body["files"] = [{"name": "main.c", "content": "int main( {"}]
    result, followed = run(api, realtime, body)
    assert result["outcome"] == "compile_error"
    assert not [1 for n, _ in followed.events if n == "test_result"]
    # No case ran, yet a grader reading the batch's verdict finds it, and every case.
    assert [case["verdict"] for case in result["tests"]] == ["compile_error"]
    assert result["summary"] == {"passed": 0, "failed": 1, "skipped": 0, "verdict": "compile_error"}


def test_a_compiled_program_too_deep_to_copy_is_a_compile_error(api: Api, realtime: Realtime) -> None:
    # Found by fuzzing: a Java package of 70 components compiles, but the classes it leaves
    # nest deeper than a batch copies into its cases (MAX_SNAPSHOT_DEPTH). That ended the
    # job internal_error, which says the platform failed and the job may be sent again.
    package = ".".join(["p"] * 70)
    source = f"package {package};\npublic class Main {{ public static void main(String[] a) {{ System.out.println(1); }} }}\n"
    body = {"language": "java", "files": [{"name": "Main.java", "content": source}], "tests": [{"expectedOutput": "1\n"}]}
    result, _ = run(api, realtime, body)
    assert result["outcome"] == "compile_error", result
    assert "nests folders deeper than 64" in result["message"] and result["compile"]["exitCode"] == 0
    assert [case["verdict"] for case in result["tests"]] == ["compile_error"]


@pytest.mark.slow
def test_a_batchs_kept_output_is_bounded_and_charged_to_its_owner(make_stack: StackFactory) -> None:
    # Three cases each write 100 000 bytes under outputKb 128: each verdict sees all of it,
    # the pullable result keeps a third of 128 KiB per case, and the owner's retained-output
    # ledger is charged for what is kept.
    stack = make_stack()
    api = Api(stack)
    body = {
        "language": "python",
        "files": [{"name": "main.py", "content": "import sys\nsys.stdout.write(input() * 100000)\n"}],
        "tests": [{"stdin": "x\n"}, {"stdin": "\x01\n"}, {"stdin": "y\n", "expectedOutput": "y" * 100000}],
        "limits": {"outputKb": 128},
        "collectOutput": True,
    }
    try:
        job = api.execute(body)
        api.start(job)
        result = api.get(f"/v1/jobs/{job['jobId']}/output", params={"waitMs": 30000}).json()
        share = 128 * 1024 // 3
        assert [case["verdict"] for case in result["tests"]] == ["accepted"] * 3
        plain, control, judged = result["tests"]
        assert plain["stdout"] == "x" * share and plain["outputCut"] and not plain.get("truncated")
        assert control["stdoutEncoding"] == "base64" and base64.b64decode(control["stdout"]) == b"\x01" * share
        assert judged["outputCut"]  # judged on all 100 000 bytes, kept in part
        with stack.redis() as redis:
            (ledger,) = redis.keys("owner:*:retained:bytes")
            assert int(redis.hget(ledger, "_total")) >= 3 * share
    finally:
        api.close()


def _start_looping_batch(api: Api, rt: Realtime) -> Followed:
    """Three cases one at a time, 20 s each: case 0 passes, case 1 loops, case 2 waits."""
    tests = [{"stdin": "1 1\n", "expectedOutput": "2\n"}, {"stdin": "0 1\n"}, {"stdin": "2 2\n"}]
    job = api.execute(c_batch(tests, limits={"wallTimeMs": 20000, "cpuMs": 20000}, stopOnFirstFailure=True))
    followed = rt.follow(job)
    api.start(job)
    return followed


@pytest.mark.slow
def test_a_batch_past_its_time_budget_ends_timed_out(make_stack: StackFactory) -> None:
    # Each case may run 20 s, but the batch as a whole has 2 s: the looping case 1 is stopped
    # there and case 2 never runs, so the batch holds the worker for its budget, not 40 s.
    stack = make_stack(WORKER_BATCH_WALL_MS="2000")
    api, rt = Api(stack), Realtime(stack)
    try:
        followed = _start_looping_batch(api, rt)
        result = followed.wait_result(timeout_s=20)
    finally:
        api.close()
        rt.close()
    assert (result["outcome"], result["killedBy"], result["timedOut"]) == ("timed_out", "wall", True)
    assert "time budget (2000 ms)" in result["message"]
    assert 1900 <= result["durationMs"] < 6000
    assert [(c["verdict"], c["outcome"]) for c in result["tests"]] == [
        ("accepted", "completed"), ("skipped", "timed_out"), ("skipped", "timed_out"),
    ]  # fmt: skip
    assert result["tests"][1]["killedBy"] == "wall" and result["summary"]["skipped"] == 2
    assert [name for name, _ in followed.events].count("test_result") == 2  # case 2 never ran


@pytest.mark.slow
def test_a_worker_stopping_mid_batch_keeps_the_verdicts_of_the_cases_that_ran(make_stack: StackFactory) -> None:
    # SIGTERM with a short grace while case 1 of 3 runs: case 0 keeps its verdict, the rest
    # are skipped, and the job says it was killed by the stop.
    stack = make_stack(WORKER_SHUTDOWN_GRACE_MS="300")
    api, rt = Api(stack), Realtime(stack)
    try:
        followed = _start_looping_batch(api, rt)
        deadline = time.monotonic() + 30
        while not [1 for n, _ in followed.events if n == "test_result"]:
            assert time.monotonic() < deadline, "case 0 never ended"
            time.sleep(0.05)
        time.sleep(0.3)  # case 1 (a loop) is running
        stack.stop_process("worker", signal.SIGTERM)
        result = followed.wait_result(timeout_s=20)
    finally:
        api.close()
        rt.close()
    assert result["outcome"] == "killed" and "shut down" in result["message"]
    assert [case["verdict"] for case in result["tests"]] == ["accepted", "skipped", "skipped"]
    assert result["summary"] == {"passed": 1, "failed": 0, "skipped": 2, "verdict": "skipped"}
    # Case 1 ran, and the stop ended it: reported as a kill's case is, with its event; case 2
    # never ran.
    ran, never = result["tests"][1], result["tests"][2]
    assert (ran["outcome"], ran["signal"], ran["killedBy"]) == ("killed", "SIGKILL", "user") and ran["durationMs"] >= 300, ran
    assert never["signal"] is None and never["durationMs"] == 0, never
    assert [p["index"] for n, p in followed.events if n == "test_result"] == [0, 1]


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
        self.uncharged = Uncharged()
        self.loaded: tuple[Any, ...] = ()
        self.copied: list[Packed] = []

    async def load(self, *args: Any) -> None:
        self.loaded = args

    async def copy_in(self, packed: Packed) -> None:
        self.copied.append(packed)


class _Pool:
    """One ready sandbox at the batch's start, then none until `free` is set."""

    ready = 1

    def __init__(self) -> None:
        self.free = asyncio.Event()
        self.waiting = asyncio.Event()
        self.given_back: list[str] = []

    def prime_for(self, _language: str) -> None:
        return None

    async def take_unless_failing(self, *_args: Any) -> _Sandbox:
        self.waiting.set()
        await self.free.wait()
        return _Sandbox("late")

    def give_back(self, sandbox: _Sandbox) -> None:
        self.given_back.append(sandbox.name)


@pytest.mark.parametrize("freed", [False, True], ids=["never-freed", "freed-with-the-kill"])
async def test_a_kill_reaches_a_case_still_waiting_for_its_sandbox(monkeypatch: pytest.MonkeyPatch, freed: bool) -> None:
    # Case 1 is let through (two may run at once) but finds no sandbox ready: another job
    # took it. A kill comes meanwhile: the wait ends with it (the batch's result is not held
    # until some other job gives a sandbox back), and a sandbox got as the kill came goes
    # back unused.
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
            spec=spec, manifest=SimpleNamespace(run=["python3", "{entry}"], env={}, heap_limit=None), entry="main.py",
            sources=["main.py"], program_rlimits={}, first=first, files=[], executable=frozenset(), pool=pool,
            events=events, ctrl=ctrl, keep_output=False, budget_ms=60000,
        )  # type: ignore[arg-type]
    )  # fmt: skip
    await asyncio.wait_for(pool.waiting.wait(), 5)
    ctrl.put_nowait(CtrlMessage(type="kill"))
    if freed:
        pool.free.set()  # (the take may end in the same turn as the kill)
    result = await asyncio.wait_for(task, 5)  # never freed: no sandbox comes, the kill ends it
    assert ran == ["first"]  # no sandbox ran case 1
    assert result.killed and [c.verdict for c in result.cases] == ["skipped", "skipped"]
    assert sorted(pool.given_back) in (["first"], ["first", "late"])


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
        ({"tests": [{"stdin": "1 2\n", "name": "case\x01one"}]}, "tests[0].name"),
    ],
)
def test_bad_batches_are_refused_naming_the_field(api: Api, change: dict[str, Any], field: str) -> None:
    body = {**c_batch([{"stdin": "1 1\n"}]), **change}
    response = api.post("/v1/execute", json=body)
    assert response.status_code == 400, response.text
    assert field in response.text


def test_batch_refusals_name_the_field_itself(api: Api) -> None:
    """A closeStdin in a batch, and a case's args for a language that takes none, are named
    as what they are (the first was sent to tests[].stdin and tests[].args, which have no
    closeStdin; the second named the whole of `tests`)."""
    response = api.post("/v1/execute", json={**c_batch([{"stdin": "1 1\n"}]), "closeStdin": True})
    assert response.status_code == 400 and response.json()["details"][0]["field"] == "closeStdin", response.text
    assert "tests[]" not in response.json()["error"]
    sql = {"language": "sqlite", "files": [{"name": "main.sql", "content": "select 1;"}]}
    response = api.post("/v1/execute", json={**sql, "tests": [{}, {"args": ["x"]}]})
    assert response.status_code == 400, response.text
    assert response.json()["details"] == [{"field": "tests[1].args", "path": "tests.1.args", "message": "are not supported for sqlite"}]


@pytest.mark.parametrize(("change", "field"), [({"compare": "lines"}, "compare"), ({"stopOnFirstFailure": False}, "stopOnFirstFailure")])
def test_batch_options_without_tests_are_refused(api: Api, change: dict[str, Any], field: str) -> None:
    # Judging options on a job that has no cases would silently judge nothing.
    body = {key: value for key, value in c_batch([{"stdin": "1 1\n"}]).items() if key != "tests"}
    response = api.post("/v1/execute", json={**body, **change})
    assert response.status_code == 400, response.text
    assert response.json()["details"][0]["field"] == field
    assert "tests" in response.json()["details"][0]["message"]


# ---------------------------------------------------------------- run_batch with a stand-in jail


class _ReadyPool:
    """Sandboxes on demand; `broken` case names fail their load (a worker-side failure)."""

    ready = 4

    def __init__(self, broken: frozenset[str] = frozenset()) -> None:
        self.broken = broken
        self.given_back: list[str] = []
        self.taken = 0

    def prime_for(self, _language: str) -> None:
        return None

    async def take_unless_failing(self, *_args: Any) -> _Sandbox:
        self.taken += 1
        sandbox = _Sandbox(f"s{self.taken}")
        if sandbox.name in self.broken:

            async def fail(*_a: Any) -> None:
                raise OSError("no space left on device")

            sandbox.load = fail  # type: ignore[method-assign]
        return sandbox

    def give_back(self, sandbox: _Sandbox) -> None:
        self.given_back.append(sandbox.name)


def _spec(n: int, **extra: Any) -> JobSpec:
    return JobSpec(
        job_id="j", language="python", version="3", files=[FileSpec(name="main.py", content="")],
        limits=extra.pop("limits", DEFAULT_LIMITS), created_at_ms=0, tests=[TestCase(stdin="") for _ in range(n)], **extra,
    )  # fmt: skip


def _completed(**over: Any) -> StepFacts:
    return StepFacts(**{"exit": JailExit(0, None, False), "fired": None, "duration_ms": 1, "cpu_ms": 1,
                        "memory_kb": 0, "oom_kills": 0, **over})  # fmt: skip


async def _run(
    spec: JobSpec, pool: Any, events: Any = None, ctrl: Any = None, keep_output: bool = False, budget_ms: int = 60000
) -> Any:
    return await batch.run_batch(
        spec=spec, manifest=SimpleNamespace(run=["python3", "{entry}"], env={}, heap_limit=None), entry="main.py",  # type: ignore[arg-type]
        sources=["main.py"], program_rlimits={}, first=_Sandbox("first"), files=[], executable=frozenset(),  # type: ignore[arg-type]
        pool=pool, events=events or SimpleNamespace(emit=lambda *_a, **_k: asyncio.sleep(0)),
        ctrl=ctrl or asyncio.Queue(), keep_output=keep_output, budget_ms=budget_ms,
    )  # fmt: skip


async def test_a_batch_keeps_at_most_outputkb_of_its_cases_output(monkeypatch: pytest.MonkeyPatch) -> None:
    # 4 cases may each write up to outputKb (their verdicts see all of it), but the result
    # keeps outputKb in all, a quarter each, stdout first; control bytes go as base64.
    written = {"first": (b"a" * 600, b"e" * 400), "s1": (b"b" * 100, b"f" * 100),
               "s2": (b"\x01" * 300, b""), "s3": (b"", b"")}  # fmt: skip

    async def supervise(jail: Any, cgroup: Any, program: Any, clocks: Any, pumps: Any, inbox: Any, **_: Any) -> StepFacts:
        for (_reader, sink), data in zip(pumps, written[jail.name], strict=True):
            await sink(data)
        return _completed()

    monkeypatch.setattr(batch, "supervise", supervise)
    limits = msgspec.structs.replace(DEFAULT_LIMITS, output_kb=1)
    result = await _run(_spec(4, limits=limits), _ReadyPool(), keep_output=True)
    first, small, control, empty = result.cases
    assert (first.stdout, first.stderr, first.output_cut) == ("a" * 256, "", True)
    assert (small.stdout, small.stderr, small.output_cut) == ("b" * 100, "f" * 100, False)
    assert control.stdout_encoding == "base64" and base64.b64decode(control.stdout) == b"\x01" * 256
    assert control.output_cut and not empty.output_cut and not first.truncated
    assert [c.verdict for c in result.cases] == ["accepted"] * 4


async def test_a_kill_after_every_case_ended_leaves_the_verdicts_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # Stop pressed as the last case's verdict was being written: no case was touched by it,
    # so the batch is not `killed`.
    async def supervise(*_a: Any, **_k: Any) -> StepFacts:
        return _completed()

    monkeypatch.setattr(batch, "supervise", supervise)
    ctrl: asyncio.Queue[CtrlMessage] = asyncio.Queue()
    emitted: list[int] = []

    async def emit(_events: Any) -> None:
        emitted.append(1)
        if len(emitted) == 2:  # the last case's test_result
            ctrl.put_nowait(CtrlMessage(type="kill"))
            await asyncio.sleep(0.01)

    spec = _spec(2, stop_on_first_failure=True)
    result = await _run(spec, _ReadyPool(), events=SimpleNamespace(emit=emit), ctrl=ctrl)
    assert not result.killed and result.summary.verdict == "accepted"


async def test_a_stop_while_a_finished_case_is_judged_keeps_its_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker's stop cancels the batch while a case that ran to its end has its large
    # output compared: it is judged at once and kept, not reported as never run.
    async def supervise(jail: Any, cgroup: Any, program: Any, clocks: Any, pumps: Any, inbox: Any, **_: Any) -> StepFacts:
        await pumps[0][1](b"ab \n" * 100_000)
        return _completed()

    judging = asyncio.Event()

    async def slow_matches(*_a: Any) -> bool:
        judging.set()
        await asyncio.Event().wait()
        return True

    monkeypatch.setattr(batch, "supervise", supervise)
    monkeypatch.setattr(batch, "output_matches", slow_matches)
    spec = msgspec.structs.replace(
        _spec(1, limits=msgspec.structs.replace(DEFAULT_LIMITS, output_kb=1024)),
        tests=[TestCase(stdin="", expected_output="ab\n" * 99_999 + "ab")],
        compare="lines",
    )
    progress = batch.BatchProgress(spec.tests or [], asyncio.get_running_loop().time())
    emitted: list[str] = []
    running = _running_batch(spec, progress, emitted)
    await asyncio.wait_for(judging.wait(), 5)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    case = progress.results[0]
    assert case is not None and case.verdict == "accepted", case
    # ...and it has its test_result event, as every case that ran (it had none before).
    assert emitted == ["test_result"]


class _RecordingEvents:
    def __init__(self, emitted: list[str]) -> None:
        self.emitted = emitted

    async def emit(self, events: list[tuple[str, Any]]) -> None:
        await asyncio.sleep(0)
        self.emitted += [name for name, _make in events]


def _running_batch(
    spec: JobSpec, progress: batch.BatchProgress, emitted: list[str], first: Any = None, memory: Any = None
) -> asyncio.Task[batch.BatchResult]:
    """run_batch over ready fake sandboxes, its events' names noted in `emitted`."""
    return asyncio.create_task(
        batch.run_batch(
            spec=spec, manifest=SimpleNamespace(run=["python3", "{entry}"], env={}, heap_limit=None), entry="main.py",  # type: ignore[arg-type]
            sources=["main.py"], program_rlimits={}, first=first or _Sandbox("first"), files=[], executable=frozenset(),
            pool=_ReadyPool(), events=_RecordingEvents(emitted),  # type: ignore[arg-type]
            ctrl=asyncio.Queue(), keep_output=False, budget_ms=60000, progress=progress, memory=memory,
        )
    )  # fmt: skip


async def test_a_case_the_workers_stop_ended_as_it_ran_is_reported_as_run_and_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # It was reported exactly as a case that never ran (no event, durationMs 0, no signal),
    # where a user's kill of a running case reports it run and killed. Its durationMs then
    # counted the step's wait for memory before its go too (0.3 s here, for 0.05 s of run).
    started = asyncio.Event()

    async def supervise(jail: Any, *_a: Any, on_go: Any = None, **_k: Any) -> StepFacts:
        if jail.name == "first":
            return _completed()
        await asyncio.sleep(0.3)  # waits for memory
        if on_go is not None:
            on_go(asyncio.get_running_loop().time())
        started.set()
        await asyncio.Event().wait()  # runs until the stop
        raise AssertionError("unreachable")

    monkeypatch.setattr(batch, "supervise", supervise)
    spec = _spec(3, stop_on_first_failure=True)
    progress = batch.BatchProgress(spec.tests or [], asyncio.get_running_loop().time())
    emitted: list[str] = []
    running = _running_batch(spec, progress, emitted)
    await asyncio.wait_for(started.wait(), 5)
    await asyncio.sleep(0.05)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert emitted == ["test_result", "test_result"]
    result = batch.summarize(progress, asyncio.get_running_loop().time(), stopped=True)
    ran, stopped, never = result.cases
    assert ran.verdict == "accepted"
    assert (stopped.outcome, stopped.signal, stopped.killed_by, stopped.verdict) == ("killed", "SIGKILL", "user", "skipped"), stopped
    assert 40 <= stopped.duration_ms < 250, stopped
    assert (never.outcome, never.signal, never.duration_ms) == ("killed", None, 0), never
    assert result.killed


async def test_a_case_the_workers_stop_caught_waiting_for_memory_never_ran() -> None:
    # Its step was cancelled before the go, at the gate: it was reported as run and killed
    # (an event, SIGKILL, its wait as its durationMs) though nothing of it had run.
    from worker.isolation.memory import MemoryAdmission

    class Cgroup:
        memory_limit_bytes = 1 << 30
        oom_kills_whole_job = True

        def cpu_us(self) -> int:
            raise AssertionError("the gate was reached")

    first = _Sandbox("first")
    first.cgroup = Cgroup()  # type: ignore[assignment]
    memory = MemoryAdmission(2 << 30)
    assert memory.try_admit(memory.capacity_bytes)  # another job's step holds all of it
    spec = _spec(1)
    progress = batch.BatchProgress(spec.tests or [], asyncio.get_running_loop().time())
    emitted: list[str] = []
    running = _running_batch(spec, progress, emitted, first=first, memory=memory)
    for _ in range(100):
        await asyncio.sleep(0.01)
        if memory.waiting:
            break
    assert memory.waiting == 1
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert emitted == [] and progress.results[0] is None and progress.killed_cases == 0
    (case,) = batch.summarize(progress, asyncio.get_running_loop().time(), stopped=True).cases
    assert (case.outcome, case.signal, case.duration_ms, case.verdict) == ("killed", None, 0, "skipped"), case


def _batch_with_packed(spec: JobSpec, pool: Any, packed: Packed, emitted: list[str]) -> asyncio.Task[batch.BatchResult]:
    return asyncio.create_task(
        batch.run_batch(
            spec=spec, manifest=SimpleNamespace(run=["cc-out"], env={}, heap_limit=None), entry="main.c",  # type: ignore[arg-type]
            sources=["main.c"], program_rlimits={}, first=_Sandbox("first"), files=[], executable=frozenset(),  # type: ignore[arg-type]
            pool=pool, events=_RecordingEvents(emitted), ctrl=asyncio.Queue(), keep_output=False, budget_ms=60000,
            packed=packed,
        )
    )  # fmt: skip


async def test_every_case_but_the_first_gets_the_packed_program_copied_in_before_its_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The step holds the copy's charge of the ceiling on top of its limit, and the copy runs
    # once that is held, before the go; case 0 runs where the compile left it.
    sandboxes: dict[str, _Sandbox] = {}
    held: dict[str, int] = {}

    async def supervise(jail: Any, *_a: Any, before_go: Any = None, extra_memory_bytes: int = 0, **_k: Any) -> StepFacts:
        held[jail.name] = extra_memory_bytes
        if before_go is not None:
            await before_go()
        return _completed()

    class Pool(_ReadyPool):
        async def take_unless_failing(self, *args: Any) -> _Sandbox:
            sandbox = await super().take_unless_failing(*args)
            sandboxes[sandbox.name] = sandbox
            return sandbox

    monkeypatch.setattr(batch, "supervise", supervise)
    packed = Packed(archive=b"tar", charge_bytes=5 << 20)
    emitted: list[str] = []
    result = await _batch_with_packed(_spec(3), Pool(), packed, emitted)
    assert [case.verdict for case in result.cases] == ["accepted"] * 3
    assert sorted(sandboxes) == ["s1", "s2"] and held == {"first": 0, "s1": 5 << 20, "s2": 5 << 20}
    for sandbox in sandboxes.values():
        assert sandbox.copied == [packed] and sandbox.loaded[0] == []


async def test_a_case_the_workers_stop_caught_copying_its_program_in_never_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    # The copy comes before the go: a stop during it ends the case as one that never ran
    # (Sandbox.copy_in kills its copier then), the gate still shut.
    from worker.job import supervise as supervision

    copying = asyncio.Event()

    class Cgroup:
        memory_limit_bytes = 1 << 30
        oom_kills_whole_job = True

        def cpu_us(self) -> int:
            raise AssertionError("the gate was reached")

    class Pool(_ReadyPool):
        async def take_unless_failing(self, *args: Any) -> _Sandbox:
            sandbox = await super().take_unless_failing(*args)
            sandbox.cgroup = Cgroup()  # type: ignore[assignment]

            async def copy_in(packed: Packed) -> None:
                copying.set()
                await asyncio.sleep(0.3)

            sandbox.copy_in = copy_in  # type: ignore[method-assign]
            return sandbox

    async def supervise(jail: Any, *args: Any, **kwargs: Any) -> StepFacts:
        if jail.name == "first":
            return _completed()
        return await supervision.supervise(jail, *args, **kwargs)

    monkeypatch.setattr(batch, "supervise", supervise)
    spec = _spec(2)
    emitted: list[str] = []
    running = _batch_with_packed(spec, Pool(), Packed(archive=b"tar", charge_bytes=1), emitted)
    await asyncio.wait_for(copying.wait(), 5)
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    assert emitted == ["test_result"]  # case 0's only: case 1 is no run-and-killed case


def _completing_every_case(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Cases end at once, exit 0; the names of the sandboxes they ran in, in order."""
    ran: list[str] = []

    async def supervise(jail: Any, *_a: Any, **_k: Any) -> StepFacts:
        ran.append(jail.name)
        return _completed()

    monkeypatch.setattr(batch, "supervise", supervise)
    return ran


async def test_under_stop_on_first_failure_a_case_lost_to_the_worker_stops_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ran = _completing_every_case(monkeypatch)
    result = await _run(_spec(3, stop_on_first_failure=True), _ReadyPool(broken=frozenset({"s1"})))
    assert ran == ["first"]  # case 2 never ran after case 1 was lost
    assert [c.verdict for c in result.cases] == ["accepted", "internal_error", "skipped"]
    assert not result.killed and result.summary.verdict == "internal_error"


async def test_under_stop_on_first_failure_an_accepted_case_whose_event_failed_stops_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Case 0 passed, then writing its test_result gave up (a long Redis outage): it keeps its
    # verdict, and the batch goes on; it used to skip the rest as if a case had failed.
    ran = _completing_every_case(monkeypatch)
    calls = 0

    async def emit(*_a: Any, **_k: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("Redis is away")

    result = await _run(_spec(3, stop_on_first_failure=True), _ReadyPool(), events=SimpleNamespace(emit=emit))
    assert ran == ["first", "s1", "s2"]
    assert [c.verdict for c in result.cases] == ["accepted"] * 3


async def test_output_past_a_cases_cut_is_dropped_unseen(monkeypatch: pytest.MonkeyPatch) -> None:
    # Past the cut nothing is copied again (each read used to copy the whole kept buffer
    # three times: milliseconds a read on the worker's loop at a big outputKb).
    cuts = 0
    prefix = batch.utf8_prefix

    def counting(data: bytes, size: int) -> bytes:
        nonlocal cuts
        cuts += 1
        return prefix(data, size)

    monkeypatch.setattr(batch, "utf8_prefix", counting)
    output = batch._CaseOutput(10)
    sink = output.sink("stdout")
    for _ in range(50):
        await sink(b"x" * 4)
    assert bytes(output.data["stdout"]) == b"x" * 10 and output.truncated and cuts == 1


async def test_a_batch_whose_job_is_taken_over_stops_its_cases_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    # The lease is lost while two cases run: writing case 0's verdict is refused (Fenced),
    # case 1 is stopped, and the batch raises rather than finishing a job not its own.
    stopped: list[str] = []
    second_runs = asyncio.Event()

    async def supervise(jail: Any, cgroup: Any, program: Any, clocks: Any, pumps: Any, inbox: Any, **_: Any) -> StepFacts:
        if jail.name == "first":
            await second_runs.wait()
            return _completed()
        second_runs.set()
        await inbox.get()
        stopped.append(jail.name)
        return _completed(exit=JailExit(None, "SIGKILL", False), fired="user")

    async def emit(_events: Any) -> None:
        raise Fenced("j")

    monkeypatch.setattr(batch, "supervise", supervise)
    with pytest.raises(Fenced):
        await asyncio.wait_for(_run(_spec(2), _ReadyPool(), events=SimpleNamespace(emit=emit)), 5)
    assert stopped == ["s1"]


async def test_a_cases_stdin_being_read_counts_as_activity(monkeypatch: pytest.MonkeyPatch) -> None:
    # A program that reads a large input slowly and prints nothing is not idle while it reads.
    touches: list[int] = []

    class Writer:
        def __init__(self) -> None:
            self.written = 0

        def write(self, data: bytes) -> None:
            self.written += len(data)

        async def drain(self) -> None:
            await asyncio.sleep(0)

        def close(self) -> None:
            pass

        def is_closing(self) -> bool:
            return False

    writer = Writer()

    async def supervise(jail: Any, cgroup: Any, program: Any, clocks: Any, pumps: Any, inbox: Any, feed_stdin: Any, **_: Any) -> StepFacts:
        activity = SimpleNamespace(touch=lambda: touches.append(writer.written))
        await feed_stdin(activity)
        return _completed()

    monkeypatch.setattr(batch, "supervise", supervise)
    first = _Sandbox("first")
    first.jail.proc.stdin = writer
    spec = JobSpec(
        job_id="j", language="python", version="3", files=[FileSpec(name="main.py", content="")],
        limits=DEFAULT_LIMITS, created_at_ms=0, tests=[TestCase(stdin="x" * (3 * batch.STDIN_PIECE))],
    )  # fmt: skip
    await batch.run_batch(
        spec=spec, manifest=SimpleNamespace(run=["python3", "{entry}"], env={}, heap_limit=None), entry="main.py",  # type: ignore[arg-type]
        sources=["main.py"], program_rlimits={}, first=first, files=[], executable=frozenset(),  # type: ignore[arg-type]
        pool=_ReadyPool(), events=SimpleNamespace(emit=lambda *_a, **_k: asyncio.sleep(0)),  # type: ignore[arg-type]
        ctrl=asyncio.Queue(), keep_output=False, budget_ms=60000,
    )  # fmt: skip
    assert touches == [batch.STDIN_PIECE, 2 * batch.STDIN_PIECE, 3 * batch.STDIN_PIECE]


async def test_a_batch_past_its_time_budget_stops_its_cases_and_skips_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    # Case 0 is quick, case 1 hangs (a kill ends it), case 2 waits its turn: at the budget,
    # case 1 is stopped (skipped, by the wall clock) and case 2 never runs.
    ran: list[str] = []

    async def supervise(jail: Any, cgroup: Any, program: Any, clocks: Any, pumps: Any, inbox: Any, **_: Any) -> StepFacts:
        ran.append(jail.name)
        if jail.name == "first":
            return _completed()
        await inbox.get()
        return _completed(exit=JailExit(None, "SIGKILL", False), fired="user")

    monkeypatch.setattr(batch, "supervise", supervise)
    result = await asyncio.wait_for(_run(_spec(3, stop_on_first_failure=True), _ReadyPool(), budget_ms=200), 5)
    assert ran == ["first", "s1"]
    assert [(c.verdict, c.outcome, c.killed_by) for c in result.cases] == [
        ("accepted", Outcome.COMPLETED, None), ("skipped", Outcome.TIMED_OUT, "wall"), ("skipped", Outcome.TIMED_OUT, None),
    ]  # fmt: skip
    assert result.timed_out and not result.killed and result.summary.skipped == 2


async def test_a_batch_that_ends_within_its_budget_is_not_timed_out(monkeypatch: pytest.MonkeyPatch) -> None:
    async def supervise(*_a: Any, **_k: Any) -> StepFacts:
        return _completed()

    monkeypatch.setattr(batch, "supervise", supervise)
    result = await _run(_spec(2), _ReadyPool(), budget_ms=50)
    await asyncio.sleep(0.1)  # the budget's timer is gone with the batch
    assert not result.timed_out and [c.verdict for c in result.cases] == ["accepted", "accepted"]


def test_a_batch_that_never_ran_lists_every_case() -> None:
    cases, summary = cases_not_run([TestCase(), TestCase(name="b")], Outcome.COMPILE_ERROR)
    assert [(c.index, c.name, c.verdict) for c in cases] == [(0, None, "compile_error"), (1, "b", "compile_error")]
    assert (summary.passed, summary.failed, summary.skipped, summary.verdict) == (0, 2, 0, "compile_error")
    cases, summary = cases_not_run([TestCase()], Outcome.KILLED)
    assert cases[0].verdict == "skipped" and summary.verdict == "skipped"
    # A failure of the worker in mid-batch: the cases that ran keep their verdicts.
    ran = not_run_case(0, TestCase(), Outcome.COMPLETED, Verdict.ACCEPTED)
    cases, summary = cases_not_run([TestCase(), TestCase()], Outcome.INTERNAL_ERROR, [ran, None])
    assert [c.verdict for c in cases] == ["accepted", "internal_error"] and summary.verdict == "internal_error"


def test_a_worker_stop_after_a_failure_stopped_the_batch_is_no_kill() -> None:
    # Under stopOnFirstFailure case 0 failed and decided the rest; the worker stopping then
    # changes nothing: not `killed`, and the skipped case never ran (no outcome of its own).
    progress = batch.BatchProgress([TestCase(), TestCase()], 0.0)
    progress.results[0] = not_run_case(0, TestCase(), Outcome.COMPLETED, Verdict.WRONG_ANSWER)
    progress.stop_reason = "failure"
    result = batch.summarize(progress, 1.0, stopped=True)
    assert not result.killed and result.cases[1].outcome is None
    assert result.summary.verdict == "wrong_answer"
    progress.stop_reason = None  # nothing had decided them: the stop did
    assert batch.summarize(progress, 1.0, stopped=True).killed


def test_a_cut_copy_never_ends_inside_a_character() -> None:
    text = "é".encode() * 1000
    assert utf8_prefix(text, 1001) == text[:1000] and batch._text(utf8_prefix(text, 1001))[1] == "utf8"
    assert utf8_prefix("a€b".encode(), 3) == b"a" and utf8_prefix("a€b".encode(), 4) == "a€".encode()
    assert utf8_prefix(b"\x80" * 5, 4) == b"\x80" * 4  # not UTF-8 at all: cut where asked
    assert utf8_prefix("a€".encode(), 9) == "a€".encode() and utf8_prefix("a€".encode()[:2], 9) == b"a\xe2"  # fits


def test_a_batch_killed_in_the_queue_lists_every_case(make_stack: StackFactory) -> None:
    stack = make_stack(with_worker=False)  # nobody claims it: the API's kill ends it
    api = Api(stack)
    try:
        job = api.execute(c_batch([{"stdin": "1 1\n", "name": "first"}, {"stdin": "2 2\n"}], collectOutput=True))
        assert api.post(f"/v1/jobs/{job['jobId']}/kill").status_code == 202
        result = api.wait_state(job, {"killed"}, timeout_s=10)["result"]
        assert [(c.get("name"), c["verdict"]) for c in result["tests"]] == [
            ("first", "skipped"), (None, "skipped")
        ]
        assert result["summary"] == {"passed": 0, "failed": 0, "skipped": 2, "verdict": "skipped"}
        pulled = api.get(f"/v1/jobs/{job['jobId']}/output").json()
        assert [c["verdict"] for c in pulled["tests"]] == ["skipped", "skipped"] and pulled["summary"]["skipped"] == 2
    finally:
        api.close()



async def test_a_batch_whose_kill_ends_it_in_the_queue_lists_every_case_whatever_state_was_read() -> None:
    # The kill route read `starting`, then the worker (stopping) handed the batch back to the
    # queue, where the kill ended it: with no case list, for a template was built only for a
    # state read as queued or parked. (The queue itself: test_a_batch_killed_in_the_queue_...)
    from api import routes
    from api.store import KillAnswer
    from shared.grading import killed_batch_before_start
    from shared.messages import JobState

    spec = _spec(2)
    asked: list[object] = []

    class Store:
        async def spec(self, _job_id: str) -> JobSpec:
            return spec

        async def kill(self, _job_id: str, _ttl_s: int, result: object = None) -> KillAnswer:
            asked.append(result)
            return KillAnswer(result=b"{}", heard=False)

    async def visible_job(_request: object) -> object:
        return SimpleNamespace(job_id="j", test_cases=2, state=JobState.STARTING)

    state = SimpleNamespace(store=Store(), settings=SimpleNamespace(run_result_ttl_s=60), visible_job=visible_job)
    request = SimpleNamespace(app=SimpleNamespace(state=SimpleNamespace(coderunner=state)))
    response = await routes.kill_job(request)  # type: ignore[arg-type]
    assert response.status_code == 202
    assert asked == [killed_batch_before_start(spec.tests or [])]
