"""Fixtures: real stacks (redis-server, soketi, API, worker) as child process groups."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from launcher.stack import Stack
from tests.helpers import Api, Realtime
from tests.watchdog import (  # noqa: F401  (the suite's watchdog: see tests/watchdog.py)
    pytest_configure,
    pytest_exception_interact,
    pytest_runtest_protocol,
    pytest_unconfigure,
)

StackFactory = Callable[..., Stack]


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
