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


@pytest.mark.parametrize("source", HANGS.values(), ids=HANGS.keys())
def test_a_test_hung_in_its_teardown_ends_the_run_and_is_named(tmp_path: Path, source: str) -> None:
    (tmp_path / "test_hang.py").write_text(textwrap.dedent(source))
    argv = [
        sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
        "-c", os.devnull, "--rootdir", str(tmp_path), "-o", "asyncio_mode=auto", str(tmp_path / "test_hang.py"),
    ]  # fmt: skip
    began = time.monotonic()
    # (Without the watchdog the run would outlast this timeout: the test then fails.)
    run = subprocess.run(argv, cwd=REPO, env={**os.environ, "TEST_WATCHDOG_S": "4"}, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - began
    said = run.stdout + run.stderr
    assert run.returncode == 1, said
    assert "watchdog: test_hang.py::test_hangs has run for 4 s, setup to teardown" in said
    assert "every thread's stack" in said and "_end_the_run" in said
    assert "test_never_reached" not in said and " passed" not in said  # the run ended there
    assert took < 30, f"the run took {took:.1f} s"
    if "stubborn" in source:
        # What the hung loop waits for: the task, and the line it waits on.
        assert "pending: <Task" in said and "in stubborn" in said, said
