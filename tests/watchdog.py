"""A watchdog for the suite: a test still going past TEST_WATCHDOG_S ends the run, named.

pytest-timeout's alarm fires once, in whichever phase a test is in, and pytest's own
faulthandler plugin cancels any pending dump on every failure (for pdb's sake). So a test
that failed and then hung in its teardown (a loop's shutdown waiting on a task that will not
end) held the suite, and would hold CI, for good, with no word of which test it was. Past
TEST_WATCHDOG_S for one test, setup to teardown, the test's name, its pending asyncio tasks
and every thread's stack go to the terminal, and the run ends with 1. Registered through
tests/conftest.py; 0 turns it off, and so does --pdb.
"""

from __future__ import annotations

import asyncio
import faulthandler
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

__all__ = ["pytest_configure", "pytest_exception_interact", "pytest_runtest_protocol", "pytest_unconfigure"]

WATCHDOG_S = float(os.environ.get("TEST_WATCHDOG_S", "480"))
# faulthandler's own dump comes this long after the timer's: the timer's names the test and
# its tasks, but needs the GIL; faulthandler's is for a hang that never lets go of it.
BACKUP_AFTER_S = 5.0

_OUT = pytest.StashKey[Any]()
_DEADLINE = pytest.StashKey[float]()


def pytest_configure(config: pytest.Config) -> None:
    # (The terminal's stderr, copied now: while a test runs, pytest's capture holds fd 2.)
    config.stash[_OUT] = os.fdopen(os.dup(2), "w")


def pytest_unconfigure(config: pytest.Config) -> None:
    out = config.stash.get(_OUT, None)
    if out is not None:
        out.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if WATCHDOG_S <= 0 or item.config.getoption("usepdb", False):
        yield
        return
    out = item.config.stash[_OUT]
    timer = threading.Timer(WATCHDOG_S, _end_the_run, (out, item.nodeid))
    timer.daemon = True
    timer.start()
    item.stash[_DEADLINE] = time.monotonic() + WATCHDOG_S
    faulthandler.dump_traceback_later(WATCHDOG_S + BACKUP_AFTER_S, exit=True, file=out)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        timer.cancel()


@pytest.hookimpl(trylast=True)
def pytest_exception_interact(node: pytest.Item | pytest.Collector) -> None:
    # (After the faulthandler plugin's cancel: a failed test is where a hung teardown comes.)
    deadline = node.stash.get(_DEADLINE, None)
    if deadline is not None:
        left_s = max(deadline - time.monotonic(), 0.0)
        faulthandler.dump_traceback_later(left_s + BACKUP_AFTER_S, exit=True, file=node.config.stash[_OUT])


def _end_the_run(out: Any, nodeid: str) -> None:
    try:
        out.write(f"\nwatchdog: {nodeid} has run for {WATCHDOG_S:g} s, setup to teardown\n")
        # A hung loop shows only its select() in the threads' stacks: what it waits for is
        # in its tasks.
        for task in _pending_tasks():
            out.write(f"pending: {task!r}\n")
            task.print_stack(limit=12, file=out)
        out.write("every thread's stack:\n")
        out.flush()
        faulthandler.dump_traceback(out, all_threads=True)
        out.flush()
    finally:
        os._exit(1)


def _pending_tasks() -> list[asyncio.Task[Any]]:
    """Every loop's unfinished tasks, read from this thread (asyncio.all_tasks wants a
    running loop, or one loop's name); the sets are read again if a thread changed one
    meanwhile, as asyncio.all_tasks does."""
    # (3.11 keeps them in _all_tasks; 3.12 on in _scheduled_tasks and _eager_tasks.)
    sources = [getattr(asyncio.tasks, name, ()) for name in ("_all_tasks", "_scheduled_tasks", "_eager_tasks")]
    for _ in range(1000):
        try:
            return [task for source in sources for task in list(source) if not task.done()]
        except RuntimeError:
            continue
    return []
