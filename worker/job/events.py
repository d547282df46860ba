"""A job's event stream: numbering (`seq`), durable append to Redis, then the live publish.

Redis is the source of truth, so an event is appended to the job's log (fenced by the
claim's attempt) before it is handed to soketi. One lock keeps numbering and appending in
the same order when stdout and stderr race.

Nothing is published before the start-handshake completes: a client subscribes and then
starts, so an event published earlier (`stage{queued}` at claim) would reach nobody and
leave a hole at the front of its sequence. Until `go_live()` events only go to the log;
`go_live()` publishes the whole log so far, in order, then every later event as it comes.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from typing import Any

import msgspec
from redis.exceptions import RedisError

from shared.messages import ChunkEvent, JobState, StageEvent
from worker.messaging.publisher import JobLane
from worker.messaging.queue import Advanced, LivePublish, LogAhead, WorkerQueue
from worker.tasks import cancel_and_wait

__all__ = ["JobEvents"]

log = logging.getLogger(__name__)
_encoder = msgspec.json.Encoder()
# How long a job waits out Redis being unreachable before it gives up on an event.
REDIS_OUTAGE_S = 300.0


# What Redis spends on a log entry besides the text or JSON in it (its id, `seq` and `name`,
# the stream's own structure): 29-39 B measured for entries of 1-100 B with Redis 7.0, and
# 41 B for a short log of 430 entries of a few bytes (the stream's own structure spread over
# fewer entries); its allocator rounds big ones up (1,000 B and 8 KiB entries took 1.29
# times their text, 4,000 B 1.09). Counted on the owner's retained-output ledger with each
# entry as this much plus 30 % of its text: counting the text alone, a program alternating
# one-byte writes between its two streams (one event each) kept ten times what its ledger said.
LOG_ENTRY_BYTES = 48


def logged_bytes(payload: int) -> int:
    """What the ledger counts for a log entry of `payload` bytes (at or above what Redis keeps)."""
    return payload + payload * 3 // 10 + LOG_ENTRY_BYTES


class JobEvents:
    def __init__(
        self,
        queue: WorkerQueue,
        lane: JobLane,
        job_id: str,
        attempt: int,
        next_seq: int,
        logged: list[tuple[int, str, bytes]] | None = None,
        published_before: int = 0,
    ) -> None:
        self._queue = queue
        self._lane = lane
        self.job_id = job_id
        self.attempt = attempt
        self.next_seq = next_seq
        self._lock = asyncio.Lock()
        self.live = False
        # A go_live held back a moment (go_live_within), and the task its timer started.
        self._live_timer: asyncio.TimerHandle | None = None
        self._live_task: asyncio.Task[None] | None = None
        # Events this worker logged before go_live (`logged`: by its claim). An earlier claim
        # of the same job (handed back before it started) may have logged some too: then the
        # log is read instead.
        self._backlog: list[tuple[int, str, bytes]] = list(logged or [])
        self._log_has_more = next_seq > len(self._backlog)
        # An earlier claim that went live published the log up to here (not again).
        self._published_before = published_before
        # What this worker put in the log, as Redis keeps it (see LOG_ENTRY_BYTES).
        self.stored_bytes = 0

    async def _advance(
        self,
        stored: list[tuple[int, str, str, bytes]],
        state: JobState | None,
        started: bool,
        publish: LivePublish | None = None,
    ) -> Advanced:
        """Append to the log, waiting out a Redis outage (up to REDIS_OUTAGE_S).

        The program goes on meanwhile (its pipe fills, then it blocks on output); losing
        Redis for a while must not end a healthy job. A re-sent append is harmless: the
        script appends only if the log's next seq is the one being written.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REDIS_OUTAGE_S
        delay = 0.1
        token = secrets.token_hex(8)  # the same on every retry: a retry that finds it landed stops
        while True:
            try:
                # The lane's "is anyone following?" rides along when it wants an answer.
                ask = self._lane.wants_audience() and publish is None
                answer = await self._queue.advance(
                    self.job_id, self.attempt, stored, state=state, started=started, audience=ask, token=token,
                    publish=publish,
                )  # fmt: skip
                if ask:
                    self._lane.learned_audience(answer.heard)
                return answer
            except (RedisError, OSError) as exc:
                if loop.time() + delay > deadline:
                    raise
                log.warning("job %s: logging events failed (%s); retrying in %.1fs", self.job_id, exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def go_live(self) -> None:
        """Publish every logged event so far, in seq order, and every later one as it comes.

        The result is never published from the log, only by its writer (publish()), once: a
        job that ends without having gone live does so after its result is in the log, and a
        held go_live whose timer fires while the result is being stored reads a log that may
        already hold it.
        """
        async with self._lock:
            await self._go_live_locked()

    def _stop_hold_timer(self) -> None:
        if self._live_timer is not None:
            self._live_timer.cancel()
            self._live_timer = None

    async def _go_live_locked(self) -> None:
        self._stop_hold_timer()
        if self.live:
            return
        if self._published_before >= self.next_seq:
            backlog = []  # an earlier claim published all of it (a re-claim after a hand-back)
        else:
            backlog = await self._read_log() if self._log_has_more else self._backlog
        for seq, name, data in backlog:
            if name != "result" and seq >= self._published_before:  # (the result: see go_live)
                self._lane.send(name, data)
        self._backlog = []
        self.live = True

    @property
    def published_to(self) -> int:
        """The log's events before this seq have gone to the live lane (or an earlier claim
        published them), so a hand-back tells the next claim to start there. A lane that
        never knew of a follower published nothing (it may still hold events for one that
        is on the way): the next claim starts where this one did."""
        return self.next_seq if self.live and self._lane.followed else self._published_before

    def go_live_within(self, hold_s: float) -> None:
        """Go live with the first output logged, or `hold_s` from now, whichever comes first.

        At start the backlog is a stage event or two, and a prestarted program's first
        output follows within a millisecond or two: published apart, the output waits for
        soketi to answer the stages' request (soketi answers only once it has pushed them),
        and the two requests compete with the program for this machine's CPU. Held back a
        moment, both go out as one request. Nothing is reordered: the backlog goes first.
        """
        if self.live or self._live_timer is not None or (self._live_task is not None and not self._live_task.done()):
            return  # (live, or going live already)
        self._live_timer = asyncio.get_running_loop().call_later(hold_s, self._live_timer_fired)

    async def go_live_at_start(self, hold_s: float) -> None:
        """go_live_within(hold_s), unless the append just made (the running stage's) told the
        lane that nobody follows: a grader's job, nearly always. Its events then go to the
        lane now, which keeps them for a follower who may still come; holding them back
        would only cost a timer and a task, as its first output seldom comes within the
        hold on a busy worker. (Not when the backlog must be read from the log first, a
        job claimed again: that read must not delay the program's start.)"""
        if self._lane.knows_nobody_follows() and not self._log_has_more:
            await self.go_live()
        else:
            self.go_live_within(hold_s)

    async def drop_hold(self) -> None:
        """The job is over: a held go_live that has not happened will not (a job that ended
        went live with its result; one lost to another worker publishes nothing more)."""
        self._stop_hold_timer()
        if self._live_task is not None:
            await cancel_and_wait([self._live_task])

    def _live_timer_fired(self) -> None:
        self._live_timer = None
        self._live_task = asyncio.create_task(self._go_live_quietly(), name=f"live:{self.job_id}")

    async def _go_live_quietly(self) -> None:
        try:
            await self.go_live()
        except (RedisError, OSError) as exc:
            # The result still goes live (JobRun._finish); only the early publish is lost.
            log.warning("job %s: could not publish its event log yet: %s", self.job_id, exc)

    async def emit(
        self,
        items: list[tuple[str, Callable[[int], Any]]],
        state: JobState | None = None,
        started: bool = False,
    ) -> None:
        """Append events (each built from its seq) and optionally move the job's state.

        Raises:
            Fenced: the job is no longer this worker's.
        """
        async with self._lock:
            while True:
                encoded: list[tuple[int, str, bytes]] = []
                stored: list[tuple[int, str, str, bytes]] = []
                seq = self.next_seq
                stored_bytes = 0
                for name, build in items:
                    event = build(seq)
                    data = _encoder.encode(event)
                    encoded.append((seq, name, data))
                    if isinstance(event, ChunkEvent):
                        raw = event.chunk.encode()
                        stored.append((seq, name, "chunk", raw))
                    else:
                        stored.append((seq, name, "data", data))
                    stored_bytes += logged_bytes(len(stored[-1][3]))
                    seq += 1
                ends_hold = self._live_timer is not None and any(kind == "chunk" for _, _, kind, _ in stored)
                publish, offered = self._publish_with_append(encoded, ends_hold)
                try:
                    answer = await self._advance(stored, state, started, publish)
                except LogAhead as ahead:
                    # An append whose caller was cancelled after sending it did land (its
                    # events are in the log, and live only if it published them itself):
                    # number these after it.
                    log.warning("job %s: the log is at seq %d, not %d; renumbering", self.job_id, ahead.next_seq, self.next_seq)
                    self.next_seq = ahead.next_seq
                    self._log_has_more = True  # (the backlog lacks what landed: go_live reads the log)
                    continue
                break
            self.stored_bytes += stored_bytes
            self.next_seq = seq
            if publish is not None:
                if not self.live:  # (the hold ended with this append, which published the backlog)
                    self._stop_hold_timer()
                    self._backlog = []
                    self.live = True
                went = offered[: answer.published]
                self._lane.published_directly(len(went), sum(len(data) for _, _, data in went), answer.heard)
                for _, name, data in offered[answer.published :]:
                    self._lane.send(name, data)
                return
            if not self.live:
                self._backlog += encoded
                if ends_hold:
                    await self._go_live_locked()  # a held go_live: the first output ends the hold
                return
            for _, name, data in encoded:
                self._lane.send(name, data)

    def _publish_with_append(
        self, encoded: list[tuple[int, str, bytes]], ends_hold: bool
    ) -> tuple[LivePublish | None, list[tuple[int, str, bytes]]]:
        """What the append of `encoded` may PUBLISH itself (see JobLane.direct_mode), saving
        the live view a round trip to Redis: these events once the job is live, or, when they
        end a held go_live, the backlog before them too. Returns the LivePublish, if any, and
        the events it offers, in order."""
        if self._lane.adapter is None or not encoded:
            return None, []
        if self.live:
            logged: list[tuple[int, str, bytes]] = []
        elif ends_hold and not self._log_has_more:
            backlog = [] if self._published_before >= self.next_seq else self._backlog
            logged = [event for event in backlog if event[1] != "result" and event[0] >= self._published_before]
        else:
            return None, []
        publish = self._live_publish(logged, encoded)
        return (publish, logged + encoded) if publish is not None else (None, [])

    def _live_publish(
        self, logged: list[tuple[int, str, bytes]], appended: list[tuple[int, str, bytes]]
    ) -> LivePublish | None:
        """The LivePublish of these events, if the lane lets a script publish them now."""
        adapter = self._lane.adapter
        if adapter is None:
            return None  # (events go over HTTP: no script publishes them)
        mode = self._lane.direct_mode(sum(len(data) for _, _, data in logged + appended))
        if mode is None:
            return None
        return LivePublish(
            channel=adapter,
            only_if_followed=mode == "followed",
            logged=[self._lane.adapter_message(name, data) for _, name, data in logged],
            messages=[self._lane.adapter_message(name, data) for _, name, data in appended],
        )

    async def _read_log(self) -> list[tuple[int, str, bytes]]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + REDIS_OUTAGE_S
        while True:
            try:
                return await self._queue.event_log(self.job_id)
            except (RedisError, OSError):
                if loop.time() > deadline:
                    raise
                await asyncio.sleep(0.5)

    async def stage(self, phase: str, state: JobState | None = None, started: bool = False) -> None:
        await self.emit([("stage", lambda seq: StageEvent(phase=phase, seq=seq))], state=state, started=started)  # type: ignore[arg-type]

    async def chunk_runs(self, runs: list[tuple[str, str]]) -> None:
        """Append output chunks of any kinds, in this order, as one batch."""
        if runs:
            await self.emit([(name, lambda seq, t=text: ChunkEvent(chunk=t, seq=seq)) for name, text in runs])

    async def state(self, state: JobState, started: bool = False) -> None:
        await self.emit([], state=state, started=started)

    async def take_result_seq(self) -> int:
        """The seq of the terminal result (written by the finishing script, not by emit)."""
        async with self._lock:
            seq = self.next_seq
            self.next_seq += 1
            return seq

    def result_seq_from(self, next_seq: int) -> int:
        """The log is further than this count says (an append whose answer never came did
        land): the result takes the log's next seq."""
        self.next_seq = next_seq + 1
        return next_seq

    def result_publish(self, result_json: bytes) -> LivePublish | None:
        """What the result's write may PUBLISH itself (see JobLane.direct_mode): only when the
        job is live already (a job that ends without going live publishes its log first)."""
        return self._live_publish([], [(self.next_seq - 1, "result", result_json)]) if self.live else None

    def published_result(self, result_json: bytes) -> None:
        """The result's write published it, and soketi heard it."""
        self._lane.published_directly(1, len(result_json), True)

    def publish(self, name: str, data: bytes, heard: bool = False) -> None:
        """Publish an event another script logged (the result); the caller went live first.
        `heard`: the script saw that someone follows the job. The lane's own answer may be
        up to a second old, and a client who subscribed since (its status then said the job
        was still running) waits for this event."""
        if heard:
            self._lane.learned_audience(True)
        self._lane.send(name, data)
