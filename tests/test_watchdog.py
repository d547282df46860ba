"""The suite's watchdog (tests/conftest.py): a test still going past TEST_WATCHDOG_S ends the
run, named, with what it waits for, instead of holding the suite (and CI) for good."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Each fails at pytest-timeout's alarm (1 s) and then hangs in its teardown, which that alarm
# no longer covers: s58's hang had this shape.
HANGS = {
    "sleeping-teardown": """
        import time
        import pytest

        @pytest.fixture
        def stuck():
            yield
            time.sleep(120)

        @pytest.mark.timeout(1)
        def test_hangs(stuck):
            time.sleep(5)

        def test_never_reached():
            pass
    """,
    "task-that-will-not-end": """
        import asyncio
        import pytest

        async def stubborn():
            while True:
                try:
                    await asyncio.sleep(100)
                except asyncio.CancelledError:
                    continue

        @pytest.fixture
        async def stuck():
            yield asyncio.create_task(stubborn())

        @pytest.mark.timeout(1)
        async def test_hangs(stuck):
            await asyncio.sleep(5)

        def test_never_reached():
            pass
    """,
}


def _run(tmp_path: Path, source: str, watchdog_s: float) -> tuple[subprocess.CompletedProcess[str], float]:
    """pytest over `source` alone with the watchdog as its only plugin of ours, its ini and
    every conftest above `tmp_path` left out, and no PYTEST_* setting of the caller's."""
    (tmp_path / "test_hang.py").write_text(textwrap.dedent(source))
    argv = [
        sys.executable, "-m", "pytest", "-q", "-p", "tests.watchdog", "-p", "no:cacheprovider",
        "-c", os.devnull, "--rootdir", str(tmp_path), "--confcutdir", str(tmp_path),
        "-o", "asyncio_mode=auto", str(tmp_path / "test_hang.py"),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env["TEST_WATCHDOG_S"] = f"{watchdog_s:g}"
    began = time.monotonic()
    # (Without the watchdog each hung run would outlast this timeout: the test then fails.)
    run = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    return run, time.monotonic() - began


@pytest.mark.parametrize("source", HANGS.values(), ids=HANGS.keys())
def test_a_test_hung_in_its_teardown_ends_the_run_and_is_named(tmp_path: Path, source: str) -> None:
    run, took = _run(tmp_path, source, 4)
    said = run.stdout + run.stderr
    assert run.returncode == 1, said
    assert "watchdog: test_hang.py::test_hangs has run for 4 s, setup to teardown" in said
    assert "every thread's stack" in said and "_end_the_run" in said
    assert "test_never_reached" not in said and " passed" not in said  # the run ended there
    assert took < 8, f"the run took {took:.1f} s"  # (the timer's dump, not faulthandler's at 9 s)
    if "stubborn" in source:
        # What the hung loop waits for: the task, and the line it waits on.
        assert "pending: <Task" in said and "in stubborn" in said, said


def test_a_hang_that_keeps_the_gil_is_ended_by_the_backup(tmp_path: Path) -> None:
    # A regular expression backtracking for ever runs in one C call: no other thread gets
    # the GIL (the timer's cannot run), and no alarm of pytest-timeout's is set here.
    run, took = _run(tmp_path, """
        import re

        def test_hangs():
            re.match(r"(a|aa)+$", "a" * 80 + "b")
    """, 2)  # fmt: skip
    said = run.stdout + run.stderr
    assert run.returncode == 1, said
    assert "watchdog:" not in said  # (the timer never ran)
    assert "most recent call first" in said and "test_hang.py" in said and "in test_hangs" in said, said
    assert took < 20, f"the run took {took:.1f} s"


def test_tests_that_each_end_in_time_are_left_alone(tmp_path: Path) -> None:
    # Each test re-arms the watchdog: three of 1.5 s run past one 2.5 s watchdog in all.
    run, _ = _run(tmp_path, """
        import time
        import pytest

        @pytest.mark.parametrize("n", range(3))
        def test_in_time(n):
            time.sleep(1.5)
    """, 2.5)  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 passed" in run.stdout
