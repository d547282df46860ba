"""Interactive stdin: a job's accepted frames, written to its program in order, exactly once.

The API stores every accepted frame in the job's stdin stream, numbered n = 0, 1, 2 …, and
only then publishes it on `stdin:<id>`. The published copy is the fast path: a frame whose
n is the next one is written at once. A gap, a replaced pub/sub connection (either can
lose messages), or ten quiet seconds send the feeder to the stream, to read on from the
last frame it wrote; a frame below its cursor was written already and is skipped. So a
frame the API accepted reaches the program once, in order, whatever happened to pub/sub.

A `close` frame is EOF: the pipe is closed after every frame before it was written.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
from typing import Any

from redis.exceptions import RedisError

from shared.messages import StdinFrame
from worker.job.supervise import Activity
from worker.messaging.control import ConnectionWatch
from worker.messaging.inbox import next_item
from worker.messaging.queue import WorkerQueue

__all__ = ["StdinFeed", "write_to_program"]

log = logging.getLogger(__name__)

# How long a quiet feeder trusts a pub/sub connection that was not replaced before it
# looks at the stream itself (a safety net: a healthy connection loses nothing).
POLL_S = 10.0
BATCH = 64
# A count of written stdin that Redis did not take is tried again after this, doubling up
# to RECORD_RETRY_MAX_S, for as long as the step lasts.
RECORD_RETRY_S = 0.25
RECORD_RETRY_MAX_S = 5.0


async def write_to_program(writer: asyncio.StreamWriter, data: bytes) -> bool:
    """Write to the program's stdin; False once it takes nothing more. That is not an
    error: the program closed its stdin or exited, or its jail ended, which closes the
    pipe (worker/isolation/child.py) a little before the step stops its feeder. (uvloop,
    as the worker runs, raises RuntimeError for a write to a closed pipe where asyncio's
    own loop drops it.)"""
    if writer.is_closing():
        return False
    try:
        writer.write(data)
        await writer.drain()
    except (BrokenPipeError, ConnectionResetError, RuntimeError):
        return False
    return True


class StdinFeed:
    def __init__(
        self,
        queue: WorkerQueue,
        job_id: str,
        attempt: int,
        inbox: asyncio.Queue[StdinFrame],
        upfront: bytes | None,
        close_after_upfront: bool,
        stored_before: int | None = None,
        watch: ConnectionWatch | None = None,
    ) -> None:
        self._queue = queue
        self._job_id = job_id
        self._attempt = attempt
        self._inbox = inbox
        self._upfront = upfront
        self._close_after_upfront = close_after_upfront
        # Frames stored before the job's pub/sub subscription was in place (None: unknown).
        # Later ones are published to it too, so with none the stream is read only on a gap,
        # a replaced connection or a long quiet spell.
        self._stored_before = stored_before
        # Tells when the pub/sub connection was replaced (None: never known to be).
        self._watch = watch
        self.next_n = 0
        self.last_id: str | None = None
        self.written_bytes = 0
        # The program closed its stdin (or exited): later frames are consumed unwritten.
        self._broken = False
        self._stopped = False
        # What reached the program and is still to be recorded (bytes, through frame id),
        # and the task recording it: frames in hand never wait for Redis's answer.
        self._unrecorded: tuple[int, str] | None = None
        self._recorder: asyncio.Task[None] | None = None

    def stop(self) -> None:
        """The step is over: stop at the next chance, even if a cancellation was lost. What
        is still to be recorded no longer frees anything: its recording stops too."""
        self._stopped = True
        if self._recorder is not None:
            self._recorder.cancel()

    async def run(self, writer: asyncio.StreamWriter, activity: Activity) -> None:
        """Feed the program until EOF; cancelled when the step ends."""
        try:
            if self._upfront:
                await self._write(writer, self._upfront, activity)
            if self._close_after_upfront:
                return
            await self._follow(writer, activity)
        except BaseException:
            # The step is over: what is still to be recorded no longer frees anything.
            if self._recorder is not None:
                self._recorder.cancel()
            raise
        finally:
            self._close(writer)

    async def _follow(self, writer: asyncio.StreamWriter, activity: Activity) -> None:
        # One pending get at a time, waited on with asyncio.wait rather than wait_for: on
        # Python 3.11 a wait_for cancelled as its get completes can leave the task hanging.
        getter: asyncio.Future[StdinFrame] | None = None
        catch_up = self._stored_before != 0
        try:
            while not self._stopped:
                if catch_up:
                    try:
                        frames = await self._queue.stdin_frames(self._job_id, self.last_id, BATCH)
                    except RedisError as exc:
                        log.warning("job %s: reading stdin failed (%s); retrying", self._job_id, exc)
                        await asyncio.sleep(0.5)
                        continue
                    for frame in frames:
                        if frame.n < self.next_n:
                            continue
                        if await self._apply(writer, activity, frame.id, frame.kind, bytes(frame.data)):
                            return
                    catch_up = len(frames) == BATCH
                    if catch_up:
                        continue
                if getter is None:
                    getter = next_item(self._inbox)
                waits: set[asyncio.Future[Any]] = {getter}
                if self._watch is not None:
                    replacement = self._watch.look()
                    if replacement is None:
                        catch_up = True  # what came meanwhile is in the stream only
                        continue
                    waits.add(replacement)
                done, _ = await asyncio.wait(waits, timeout=POLL_S, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    if self._watch is not None:
                        self._watch.replaced()  # taken in: the read comes now
                    catch_up = True
                    continue
                message, getter = getter.result(), None
                if message.n < self.next_n:
                    continue  # written already (read from the stream before its message came)
                if message.n > self.next_n:
                    catch_up = True  # a message went missing: the stream has it
                    continue
                try:
                    data = base64.b64decode(message.data, validate=True)
                except (binascii.Error, ValueError):
                    catch_up = True
                    continue
                if await self._apply(writer, activity, message.id, message.kind, data):
                    return
        finally:
            if getter is not None:
                getter.cancel()

    async def _apply(self, writer: asyncio.StreamWriter, activity: Activity, frame_id: str, kind: str, data: bytes) -> bool:
        """Write one frame; True when it was EOF."""
        self.next_n += 1
        self.last_id = frame_id
        if kind == "close":
            return True
        await self._write(writer, data, activity)
        self.written_bytes += len(data)
        self._unrecorded = (self.written_bytes, frame_id)
        if self._recorder is None or self._recorder.done():
            self._recorder = asyncio.create_task(self._record(), name=f"stdin-written:{self._job_id}")
        return False

    async def _record(self) -> None:
        """Record what reached the program (frees the API's pending cap, trims the stream),
        the latest count only: a burst of frames costs one round trip or two, and a Redis
        that answers slowly never holds back a frame already in hand."""
        retry_s = RECORD_RETRY_S
        while self._unrecorded is not None:
            (written, through), self._unrecorded = self._unrecorded, None
            try:
                await self._queue.stdin_written(self._job_id, self._attempt, written, through)
            except (RedisError, OSError) as exc:
                # The bytes reached the program, but until the count is recorded the API
                # holds them as pending: past its cap it refuses the next frame, which the
                # program may be waiting for. So it is tried again (the latest count: one
                # that came meanwhile replaces it; each is absolute, so a repeat is harmless).
                if self._unrecorded is None:
                    self._unrecorded = (written, through)
                log.warning("job %s: recording written stdin failed (%s); again in %.2f s", self._job_id, exc, retry_s)
                await asyncio.sleep(retry_s)
                retry_s = min(2 * retry_s, RECORD_RETRY_MAX_S)
                continue
            except Exception:
                # (A task of its own: nothing would ever look at what it raised.)
                log.exception("job %s: recording written stdin failed", self._job_id)
            retry_s = RECORD_RETRY_S

    async def _write(self, writer: asyncio.StreamWriter, data: bytes, activity: Activity) -> None:
        if self._broken:
            return
        if not await write_to_program(writer, data):
            self._broken = True
            return
        activity.touch()

    @staticmethod
    def _close(writer: asyncio.StreamWriter) -> None:
        try:
            writer.close()
        except (BrokenPipeError, ConnectionResetError, RuntimeError):
            pass
