"""Fixtures: real stacks (redis-server, soketi, API, worker) as child process groups."""

from __future__ import annotations

import asyncio
import faulthandler
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from launcher.stack import Stack
from tests.helpers import Api, Realtime

StackFactory = Callable[..., Stack]

# pytest-timeout's alarm fires once, in whichever phase a test is in: a teardown that then
# hangs (a loop's shutdown waiting on a task that will not end) held the suite, and would
# hold CI, for good. Past this long for one test, setup to teardown, the test is named,
# every thread's stack goes to the terminal, and the run ends, failed.
WATCHDOG_S = float(os.environ.get("TEST_WATCHDOG_S", "480"))


def pytest_configure(config: pytest.Config) -> None:
    # (The terminal's stderr, copied now: while a test runs, pytest's capture holds fd 2.)
    config.stash[_WATCHDOG_OUT] = os.fdopen(os.dup(2), "w")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    out = item.config.stash[_WATCHDOG_OUT]
    watchdog = threading.Timer(WATCHDOG_S, _end_the_run, (out, item.nodeid))
    watchdog.daemon = True
    watchdog.start()
    item.stash[_WATCHDOG_DEADLINE] = time.monotonic() + WATCHDOG_S
    # (A hang that never lets go of the GIL stops the timer's thread, not faulthandler's.)
    faulthandler.dump_traceback_later(WATCHDOG_S + 10, exit=True, file=out)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        watchdog.cancel()


@pytest.hookimpl(trylast=True)
def pytest_exception_interact(node: pytest.Item | pytest.Collector) -> None:
    # pytest's faulthandler plugin cancels every pending dump on a failure (for pdb's sake),
    # and a failed test is where a hung teardown comes: armed again for what is left.
    deadline = node.stash.get(_WATCHDOG_DEADLINE, None)
    if deadline is not None:
        out = node.config.stash[_WATCHDOG_OUT]
        faulthandler.dump_traceback_later(max(deadline - time.monotonic(), 0) + 10, exit=True, file=out)


def _end_the_run(out: Any, nodeid: str) -> None:
    out.write(f"\nwatchdog: {nodeid} has run for {WATCHDOG_S:g} s, setup to teardown\n")
    # A hung loop shows only its select() in the threads' stacks: what it waits for is in
    # its tasks. (Read from this thread while the loop's waits, which is all it does then.)
    try:
        pending = [task for task in list(getattr(asyncio.tasks, "_all_tasks", ())) if not task.done()]
    except RuntimeError:  # (the set changed while being read: the loop is not hung after all)
        pending = []
    for task in pending:
        out.write(f"pending: {task!r}\n")
        task.print_stack(limit=12, file=out)
    out.write("every thread's stack:\n")
    faulthandler.dump_traceback(out, all_threads=True)
    out.flush()
    os._exit(1)


_WATCHDOG_OUT = pytest.StashKey[Any]()
_WATCHDOG_DEADLINE = pytest.StashKey[float]()


def _dump_logs(stack: Stack) -> None:
    assert stack.log_dir is not None
    for name in sorted(p.stem for p in stack.log_dir.glob("*.log")):
        text = stack.log(name)
        if text:
            print(f"----- {name} log (last 40 lines) -----")
            print("\n".join(text.splitlines()[-40:]))


@pytest.fixture(scope="session")
def stack() -> Iterator[Stack]:
    """The shared stack: 4 sandbox slots, default warm-up."""
    s = Stack(extra_env={"WORKER_MAX_SANDBOXES": "4", "LOG_LEVEL": "INFO"})
    s.start()
    try:
        yield s
    finally:
        if s.dead_children():
            _dump_logs(s)
        s.cleanup()


@contextmanager
def _stacks() -> Iterator[StackFactory]:
    """Start stacks on demand (Stack's arguments); every one is stopped at the end."""
    built: list[Stack] = []

    def start(**kwargs: Any) -> Stack:
        s = Stack(**kwargs)
        built.append(s)
        s.start()
        return s

    try:
        yield start
    finally:
        for s in built:
            if os.environ.get("CODERUNNER_TEST_LOGS"):
                _dump_logs(s)
            s.cleanup()


@pytest.fixture
def make_stack() -> Iterator[StackFactory]:
    """Build a private stack with its own settings; every one is stopped after the test."""
    with _stacks() as start:

        def build(with_worker: bool = True, **env: str) -> Stack:
            return start(extra_env={k: str(v) for k, v in env.items()}, with_worker=with_worker)

        yield build


@pytest.fixture
def make_fleet() -> Iterator[StackFactory]:
    """Like make_stack, for fault tests: `workers` workers, the stack's supervisor (restart
    workers that die; with `supervise_services`, soketi and the API too) on or off, Redis
    with or without its append-only file."""
    with _stacks() as start:

        def build(
            workers: int = 2,
            supervise: bool = True,
            redis_persistence: bool = False,
            supervise_services: bool = False,
            **env: str,
        ) -> Stack:
            return start(
                extra_env={k: str(v) for k, v in env.items()},
                workers=workers,
                supervise=supervise,
                redis_persistence=redis_persistence,
                supervise_services=supervise_services,
            )

        yield build


@pytest.fixture
def api(stack: Stack) -> Iterator[Api]:
    with Api(stack) as client:
        yield client


@pytest.fixture
def realtime(stack: Stack) -> Iterator[Realtime]:
    rt = Realtime(stack)
    yield rt
    rt.close()
