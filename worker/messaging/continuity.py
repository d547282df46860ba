"""Whether Redis has answered this worker without a break: what judging others dead needs.

A lease lapses when its worker dies, and also when Redis stops answering everyone for a
while (frozen, swapped out, cut off): after such a stall every live worker's lease has run
out at once, and they all renew within a heartbeat. So a missing liveness key means a dead
worker only when Redis answered this worker's heartbeats without a gap long enough to lapse
a live lease over the whole span that matters: from a lease before the key was read until a
heartbeat sent after the read came back. The last part is what makes a read that was sent
before a stall and answered after it harmless: the stall shows as a gap between this
worker's own heartbeats, and the beat in flight during it ends before the confirming one.
A Redis that restarted without its data (every lease gone at once) may answer again within
a beat: each heartbeat also reads the dataset token (shared.keys.DATASET), and a new one is
a break too.
"""

from __future__ import annotations

import asyncio
import collections

__all__ = ["GAP_HISTORY_S", "RedisContinuity"]

# How far back the record keeps each gap between answers (longer leases fall back to the
# longest gap since the last break).
GAP_HISTORY_S = 600.0


class RedisContinuity:
    """Kept by the heartbeat (`answered`, `failed`), asked by the upkeep (`judging`, `held`)."""

    def __init__(self, interval_s: float, lease_s: float) -> None:
        self._lease_s = lease_s
        self._interval_s = interval_s
        # A live worker renews about every interval, so only a stall of about a lease less
        # one interval lapses its lease: a gap between answers longer than that, with half an
        # interval's margin for its own beat's delay, is a break. The settings keep the lease
        # at three intervals or more, so an ordinary late beat is not one. (Every worker
        # computes this from its own settings; `may_judge` tells whether it serves another's.)
        self.max_gap_s = lease_s - 1.5 * interval_s
        self._since: float | None = None  # loop time of the first answer since the last break
        # Gaps between answers since then, as (loop time the gap ended, its length), for the
        # last GAP_HISTORY_S; the longest of all since the break stands in for older ones.
        self._gaps: collections.deque[tuple[float, float]] = collections.deque()
        self._trimmed_until = float("-inf")
        self._longest_gap_s = 0.0
        self._last_answer: float | None = None
        self._dataset: bytes | None = None
        self.breaks = 0
        # loop.time() at which the last beat to end was sent, and a wake-up for each end.
        self._last_sent = float("-inf")
        self._ended = asyncio.Event()

    def answered(self, sent_at: float, dataset: bytes) -> None:
        """A heartbeat sent at `sent_at` came back now, with Redis's dataset token."""
        now = asyncio.get_running_loop().time()
        gap = self._last_answer is None or now - self._last_answer > self.max_gap_s
        # A new token: Redis lost its data (every lease with it) and answers again.
        if gap or dataset != self._dataset:
            if self._since is not None:
                self.breaks += 1
            self._since = now
            self._forget_gaps()
        elif self._last_answer is not None:
            self._gaps.append((now, now - self._last_answer))
            self._longest_gap_s = max(self._longest_gap_s, now - self._last_answer)
            while self._gaps[0][0] < now - GAP_HISTORY_S:
                self._trimmed_until = self._gaps.popleft()[0]
        self._last_answer = now
        self._dataset = dataset
        self._beat_ended(sent_at)

    def failed(self, sent_at: float) -> None:
        """A heartbeat sent at `sent_at` failed or was abandoned."""
        if self._since is not None:
            self.breaks += 1
        self._since = self._last_answer = None
        self._forget_gaps()
        self._beat_ended(sent_at)

    def _forget_gaps(self) -> None:
        self._gaps.clear()
        self._trimmed_until = float("-inf")
        self._longest_gap_s = 0.0

    def _longest_gap_since(self, start: float) -> float:
        """The longest gap between answers that ended after loop time `start`."""
        if start < self._trimmed_until:
            return self._longest_gap_s  # (older than the history kept: the longest of all)
        return max((length for ended, length in self._gaps if ended > start), default=0.0)

    def _beat_ended(self, sent_at: float) -> None:
        self._last_sent = sent_at
        ended, self._ended = self._ended, asyncio.Event()
        ended.set()

    def may_judge(self, lease_s: float, interval_s: float, looked_at: float) -> bool:
        """Whether a worker that renews a lease of `lease_s` every `interval_s`, seen without
        its lease at loop time `looked_at` (after `held` said yes), may be judged dead. When
        its settings differ from ours (a fleet changing them), our break rule may not fit it.
        It may, if no gap between our answers over its lease before the look (and since) was
        one its own peers would call a break, and the last break lies far enough before the
        look for it to have renewed since (its interval and a half, and half of ours)."""
        since = self._since
        if since is None or since > looked_at:
            return False
        longest = self._longest_gap_since(looked_at - lease_s)
        return longest <= lease_s - 1.5 * interval_s and looked_at - since >= 1.5 * interval_s + self._interval_s / 2

    def judging(self) -> int | None:
        """A token for `held` when Redis has answered without a break for a whole lease (a
        live worker has renewed by then), else None: nobody may be judged dead yet."""
        since = self._since
        if since is None or asyncio.get_running_loop().time() - since < self._lease_s:
            return None
        return self.breaks

    async def held(self, token: int, after: float) -> bool:
        """Wait for a heartbeat sent after loop time `after` to end; whether Redis has had no
        break since `judging` gave `token`. Gives up (False) after a lease."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._lease_s
        while self._last_sent <= after:
            left = deadline - loop.time()
            if left <= 0:
                return False
            try:
                await asyncio.wait_for(self._ended.wait(), left)
            except TimeoutError:
                return False
        return self.breaks == token and self._since is not None
