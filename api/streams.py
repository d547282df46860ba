"""Admission control for what blocks on Redis: `GET /v1/jobs/:id/events`, and
`GET /v1/jobs/:id/output?waitMs` while it waits.

Every open event stream may hold one connection of a bounded Redis pool (it blocks in
XREAD). Without a bound per caller, one job token could open the whole pool and every
other stream would wait for a connection, time out and break mid-stream. So a stream is
admitted, before any byte of it is sent, only while

- its job has fewer than `MAX_EVENT_STREAMS_PER_JOB` open streams (else `429`),
- its caller has fewer than `MAX_EVENT_STREAMS_PER_PRINCIPAL` (else `429`); the caller is
  the API token holder (its owner id) or a job token (its job id),
- and the process has fewer than `MAX_EVENT_STREAMS` in all (else `503`), so every admitted
  stream finds a free pooled connection.

The counts are per API process, like the pool they protect: behind a load balancer a
caller may hold the per-caller number on each process.

Waiting long-polls get the same rules from their own slots and their own pool
(`MAX_OUTPUT_WAITS`, `MAX_OUTPUT_WAITS_PER_PRINCIPAL`, the per-job bound shared), so no
number of them can take a connection from an event stream, nor one caller all of them.

What a job owner's streams send is paced too (`EventPace`, its token and its jobs' tokens
together): a stream costs the API about 10 us an event whatever its client does with it,
and a client reconnecting to replay a long log from the start, 32 streams at a time, could
keep an API process's loop busy for everyone.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator

from api.errors import ApiError
from shared.settings import Settings

__all__ = ["RETRY_AFTER_MS", "EventPace", "StreamSlot", "StreamSlots"]

# What a refused client is told to wait: streams end when their job does, so a short retry
# usually finds room.
RETRY_AFTER_MS = 2000


class StreamSlot:
    """One admitted stream; `release()` is idempotent."""

    def __init__(self, slots: StreamSlots, job_id: str, principal: str) -> None:
        self._slots = slots
        self.job_id = job_id
        self.principal = principal
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._slots._release(self)

    def hand_over(self) -> StreamSlot:
        """The same admission as a new slot, this one released without giving it back: for
        a holder whose own release runs before the one it hands to is done with it."""
        if not self._held:
            raise RuntimeError("a released slot cannot be handed over")
        self._held = False
        return StreamSlot(self._slots, self.job_id, self.principal)


class StreamSlots:
    def __init__(
        self, max_total: int, max_per_job: int, max_per_principal: int, what: str = "event streams", per: str = "job"
    ) -> None:
        self.max_total = max_total
        self.per = per
        self.max_per_job = max_per_job
        self.max_per_principal = max_per_principal
        self.what = what
        self.total = 0
        self._jobs: Counter[str] = Counter()
        self._principals: Counter[str] = Counter()

    @classmethod
    def event_streams(cls, settings: Settings) -> StreamSlots:
        return cls(settings.max_event_streams, settings.max_event_streams_per_job, settings.max_event_streams_per_principal)

    @classmethod
    def artifact_downloads(cls, settings: Settings) -> StreamSlots:
        per_job = settings.max_artifact_downloads_per_job
        return cls(settings.max_artifact_downloads, per_job, per_job, "artifact downloads")

    @classmethod
    def blob_uploads(cls, settings: Settings) -> StreamSlots:
        # Keyed by digest: one upload link replayed at once takes at most two.
        return cls(settings.max_blob_uploads, 2, settings.max_blob_uploads, "blob uploads", per="blob")

    @classmethod
    def output_waits(cls, settings: Settings) -> StreamSlots:
        return cls(
            settings.max_output_waits,
            settings.max_event_streams_per_job,
            settings.max_output_waits_per_principal,
            "waits for output and output being sent",
        )

    def acquire(self, job_id: str, principal: str) -> StreamSlot:
        """Admit one stream, or refuse it before any byte is sent.

        Raises:
            ApiError: 429 past the per-job or per-caller bound, 503 when the pool is full.
        """
        self.check(job_id, principal)
        self.total += 1
        self._jobs[job_id] += 1
        self._principals[principal] += 1
        return StreamSlot(self, job_id, principal)

    def check(self, job_id: str, principal: str) -> None:
        """Refuse as `acquire` would, taking nothing (what a HEAD of the stream answers)."""
        what = self.what
        if self._jobs[job_id] >= self.max_per_job:
            raise _refused(
                429, f"Too many {what} open for this {self.per} (at most {self.max_per_job}); close one or retry later"
            )
        if self._principals[principal] >= self.max_per_principal:
            raise _refused(
                429, f"Too many {what} open with this token (at most {self.max_per_principal}); close one or retry later"
            )
        if self.total >= self.max_total:
            raise _refused(503, f"All {self.max_total} {what} of this server are in use; retry shortly")

    def _release(self, slot: StreamSlot) -> None:
        self.total -= 1
        for counter, key in ((self._jobs, slot.job_id), (self._principals, slot.principal)):
            counter[key] -= 1
            if counter[key] <= 0:
                del counter[key]


def _refused(status: int, message: str) -> ApiError:
    return ApiError(
        status, message, headers={"Retry-After": str(-(-RETRY_AFTER_MS // 1000))}, retryAfterMs=RETRY_AFTER_MS
    )


class EventPace:
    """At most `per_s` events a second from the streams of one key (a job's owner) together,
    after a burst of as many (a bucket refilled at `per_s`): a stream past it waits before
    sending on, which the key's other streams then wait behind too. A job token's streams
    are paced by a bucket of their own first, at a CALLER_SHARE of that: one browser
    replaying a long log over and over takes at most that share of its owner's pace (with
    one API token, everyone's), not all of it. Per API process, like the slots."""

    CALLER_SHARE = 4

    def __init__(self, per_s: int) -> None:
        self.per_s = per_s
        self._buckets = _Buckets(per_s)
        self._callers = _Buckets(max(1, per_s // self.CALLER_SHARE))

    async def spend(self, key: str, events: int, caller: str | None = None) -> None:
        """Count `events` sent for `key`; `caller`, a job token's, spends its own share first."""
        if caller is not None:
            await self._callers.spend(caller, events)
        await self._buckets.spend(key, events)


class _Buckets:
    """Token buckets by key, each refilled at `per_s` up to as many."""

    # Keys remembered before those whose bucket has refilled are forgotten (looked for at
    # most once a second: a scan at every spend, with that many buckets still refilling,
    # would cost each spend the whole table).
    KEEP = 1024

    def __init__(self, per_s: int) -> None:
        self.per_s = per_s
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, when)
        self._pruned_at = 0.0

    def __len__(self) -> int:
        return len(self._buckets)

    def __iter__(self) -> Iterator[str]:
        return iter(self._buckets)

    def _refilled(self, key: str, now: float) -> float:
        tokens, at = self._buckets.get(key, (float(self.per_s), now))
        return min(float(self.per_s), tokens + (now - at) * self.per_s)

    async def spend(self, key: str, events: int) -> None:
        now = asyncio.get_running_loop().time()
        tokens = self._refilled(key, now) - events
        self._buckets[key] = (tokens, now)
        if len(self._buckets) > self.KEEP and now - self._pruned_at >= 1.0:
            self._pruned_at = now
            for refilled in [k for k in self._buckets if self._refilled(k, now) >= self.per_s]:
                del self._buckets[refilled]
        if tokens < 0:
            await asyncio.sleep(-tokens / self.per_s)
