"""Restart-on-failure for a stack's workers, the way a process manager would do it.

A worker that exits with a failure (a non-zero status or a signal) is started again after
a backoff delay: 0.5 s, doubling on every further failure up to 10 s, and back to 0.5 s
once an incarnation stayed up for 30 s. So a crash-looping worker (Redis gone, a broken
host) costs one start every 10 s, never a hot loop, and a worker killed now and then comes
back at once. A worker that exits with status 0 stopped on purpose and stays stopped.

Each incarnation gets a fresh WORKER_ID: the dead one's claims and sandboxes are recovered
by the fleet once its lease expires, exactly as for a worker that died on another host.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

__all__ = ["Backoff", "Restart", "describe_exit"]


@dataclass
class Backoff:
    """Delays before restarting one worker after each failure."""

    first_s: float = 0.5
    cap_s: float = 10.0
    reset_after_s: float = 30.0
    _next_s: float = 0.0

    def __post_init__(self) -> None:
        self._next_s = self.first_s

    def delay(self, uptime_s: float) -> float:
        """The wait before the next start, given how long the incarnation that died ran."""
        if uptime_s >= self.reset_after_s:
            self._next_s = self.first_s
        delay = self._next_s
        self._next_s = min(self._next_s * 2, self.cap_s)
        return delay


@dataclass
class Restart:
    """One failure of a supervised worker and what the supervisor did about it."""

    name: str
    old_id: str
    returncode: int
    uptime_s: float
    delay_s: float
    died_at: float  # time.monotonic()
    new_id: str = ""
    restarted_at: float = 0.0  # time.monotonic(); 0 while waiting


def describe_exit(returncode: int) -> str:
    """`killed by SIGKILL`, `exited with status 3`, ..."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"
