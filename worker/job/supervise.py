"""Run one released jail under the clocks and collect what happened.

The same supervision serves the compile step and the run step:
    wall  — time since go, never resets
    cpu   — CPU of every process of the step, from its cgroup, polled every 100 ms, and
            every 50 ms once the step's CPU cap could have let it reach its budget (see
            cpu_clock_due_at)
    idle  — no output (and, for interactive runs, no stdin) for the window; a compile's
            only when its manifest sets `idleMs` (compilers work in silence)
The first clock to fire (or a kill request) SIGKILLs the whole cgroup. Output pumps read
until EOF so nothing the program wrote before dying is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from shared.messages import CtrlMessage
from worker.isolation.cgroups import CPU_PERIOD_US, JobCgroup
from worker.isolation.child import PipeReader
from worker.isolation.jail import BACKSTOP_MARGIN_S, Jail, JailExit, Program, cpu_backstop_room_s
from worker.isolation.memory import MemoryAdmission
from worker.isolation.offload import off_loop, off_loop_quick
from worker.isolation.sandbox import Uncharged
from worker.job.output import StreamTail
from worker.messaging.inbox import next_item
from worker.tasks import cancel_and_wait

__all__ = ["Activity", "Clocks", "StepFacts", "StepNotStarted", "StepStopped", "cpu_clock_due_at", "supervise"]

log = logging.getLogger(__name__)

# A step's program is started only if nsjail's own time limit leaves it its wall clock and
# this much more: past the span in which a SIGKILL of the gate is taken for the backstop's
# (Jail._backstop_fired), plus the clock's kill and the output's last reads.
BACKSTOP_ROOM_S = BACKSTOP_MARGIN_S + 10.0
# The CPU counter is read this often once the budget may be within reach, and CPU_CHECK_S
# before (SPEC: the CPU clock is polled at 100 ms or better).
CPU_POLL_S = 0.05
CPU_CHECK_S = 0.1
READ_SIZE = 65536
# After a read smaller than this, wait this long before reading again (see _pump).
COALESCE_BELOW = 8192
COALESCE_S = 0.002
# ... and this long while the step is chatty: its hand-overs come faster than a bucket of
# CHATTY_BURST refilled at CHATTY_REFILL_PER_S can pay for, until it holds half of that
# again. A program alternating tiny writes between its two streams makes an event of each
# (the two are never merged), up to ~1,000 a second, each 30-45 B of log in Redis and ~170 us
# of worker and Redis CPU besides its text (10 MB and a minute of CPU over a 300 s wall clock
# for a few KB of output); gathered, about 80 a second at most (two streams, an event each a
# hold), as many as a program paced at 80 writes a second makes either way (a rule of
# windows let one paced just under its threshold make 200). A bucket, not a count: a long
# interactive session is never slowed for what it printed long ago; a step is slowed only
# past 200 hand-overs plus 40 a second (what it prints at once is one hand-over or a few).
CHATTY_BURST = 200
CHATTY_REFILL_PER_S = 40
CHATTY_COALESCE_S = 0.025
# How long a read that ends mid-line waits for the rest of the line.
PARTIAL_LINE_S = 0.003
# Once a step's output budget is spent, what the program writes is read only to be dropped
# (the program keeps running: SPEC). Read 64 KiB a wake-up as it came, that cost the worker
# 94-98 % of a core for one program writing in a loop or splicing a file into its stdout
# (reading is the worker's CPU, not the job's). Now its pipes are widened to this and
# emptied once every DROP_TICK_S: up to ~100 MiB/s a stream at 100 wake-ups a second.
DROP_PIPE_BYTES = 1 << 20
DROP_TICK_S = 0.01
EXIT_GRACE_S = 5.0
CHILD_EXIT_S = 2.0

# CFS bandwidth hands runtime to each CPU's run queue in slices of this much (the kernel's
# sched_cfs_bandwidth_slice_us default), and a queue may keep what it holds into the next period.
CFS_SLICE_S = 0.005
_CPUS = os.cpu_count() or 1

OnData = Callable[[bytes], Awaitable[None]]
CHARGED_IN_FULL = Uncharged()


def cpu_clock_due_at(go_at: float, cpu_s: float, cap_cores: float | None) -> float:
    """The earliest moment a step released at `go_at` can have used `cpu_s` of CPU.

    Under a bandwidth cap of `cap_cores` a cgroup gets at most cap x period of runtime per
    period: over any stretch, cap x its length, plus what it may hold when the stretch
    begins (the current period's quota, the next one's if it refreshes at once, and a slice
    per CPU carried over). Until then the CPU clock cannot fire, and its counter (an rstat
    flush in the kernel per read) is read at the slower CPU_CHECK_S, which also bounds how
    late the clock fires on a kernel that keeps the cap less strictly than this assumes.
    Without a cap it can fire at any time.
    """
    if not cap_cores:
        return go_at
    ahead_s = 2 * cap_cores * CPU_PERIOD_US / 1e6 + _CPUS * CFS_SLICE_S
    return go_at + max(0.0, (cpu_s - ahead_s) / cap_cores)


@dataclass(frozen=True)
class Clocks:
    wall_ms: int
    cpu_ms: int
    idle_ms: int | None = None


class Activity:
    """When the program last showed signs of life (output, or input reaching it), and how
    many of its reads are being handed over right now (while the worker cannot take output
    away, the program is blocked writing, not idle)."""

    def __init__(self, now: float) -> None:
        self.last = now
        self.handing_over = 0
        self.handed_over = 0  # reads handed over so far
        self.chatty = False  # (see CHATTY_BURST)
        self._tokens = float(CHATTY_BURST)
        self._counted_at = now

    def touch(self) -> None:
        # (never earlier than it was: a plain jail's clock starts after its runtime's start-up)
        self.last = max(self.last, asyncio.get_running_loop().time())

    def count_hand_over(self) -> None:
        self.handed_over += 1
        now = asyncio.get_running_loop().time()
        tokens = min(CHATTY_BURST, self._tokens + max(0.0, now - self._counted_at) * CHATTY_REFILL_PER_S)
        self._counted_at = now
        if tokens < 1:
            self.chatty = True
        elif tokens >= CHATTY_BURST / 2:
            self.chatty = False
        self._tokens = max(0.0, tokens - 1)


@dataclass
class StepFacts:
    exit: JailExit
    fired: str | None  # "wall" | "cpu" | "idle" | "memory" | "user" | None
    duration_ms: int
    cpu_ms: int
    memory_kb: int
    oom_kills: int
    # The OOM kills were the deployment's ceiling on all jobs, not the job's own limit.
    ceiling_oom: bool = False


class StepStopped(asyncio.CancelledError):
    """The step was cancelled (its worker stopping) after its program had ended. `facts` are
    the step's when its pipes were read to their end before it gave up (so everything the
    program wrote was handed over), else None. A CancelledError, so a caller that does not
    look for it ends as cancelled as before."""

    def __init__(self, facts: StepFacts | None) -> None:
        super().__init__()
        self.facts = facts


class StepNotStarted(asyncio.CancelledError):
    """The step was cancelled before its program was started (while it waited for memory):
    nothing of it ran. A CancelledError, like StepStopped."""


class _Drops:
    """Whether what a step's pumps read now is only dropped: its output budget is spent and
    its program still runs (once it has ended, what is left in the pipes is read at once).
    `room` adds to the step's memory limit what a widened pipe may hold on top: the kernel
    charges a pipe's pages to its writer, and the widening is the worker's doing, not the
    program's (with 14 MiB of its own under memoryMb 16, a program flooding both streams
    was killed at its limit once its pipes were widened)."""

    def __init__(self, spent: Callable[[], bool], ended: asyncio.Future[None], cgroup: JobCgroup) -> None:
        self.spent = spent
        self.ended = ended
        self.cgroup = cgroup

    def now(self) -> bool:
        return not self.ended.done() and self.spent()

    async def room(self, size: int) -> bool:
        """Raise the step's memory limit by `size`; whether a pipe may be widened by that."""
        # (Past what the memory admission holds for the step: within the room it keeps a
        # slot for what is not a program's own, see memory.py.)
        try:
            await off_loop(self.cgroup.raise_memory_limit, size)
        except OSError as exc:
            log.warning("the memory limit could not be raised for a wider pipe: %s", exc)
            return False  # (the pipe stays as it is: drained slower)
        return True


class _Pumps:
    """A step's output pumps, handing over in one order.

    Each pump holds its pipe for a moment after a small read (to gather the next writes into
    one read) and waits a moment for the rest of a partial line; meanwhile the other stream
    may be read. What a pump could hand over is dated (bytes read by when they came to its
    reader, a held pipe's by when the hold began, a partial line by its first bytes), and
    before handing over, a pump first hands over what the other has from earlier: the
    lines a program printed stay ahead of the traceback it wrote to stderr after them.
    Writes to the two pipes that land within one gathering window still carry no order
    between them: two pipes keep none.
    """

    def __init__(self, drops: _Drops | None = None) -> None:
        self.lock = asyncio.Lock()
        self.members: list[_Pump] = []
        self.drops = drops


class _Pump:
    def __init__(self, reader: asyncio.StreamReader, on_data: OnData, activity: Activity) -> None:
        self.reader = reader
        self.on_data = on_data
        self.activity = activity
        self.in_hand = bytearray()  # read, not handed over yet (a partial line)
        self.in_hand_since = 0.0
        self.held_since: float | None = None  # in its gathering pause: its pipe held since then

    def earliest(self) -> float | None:
        """When the oldest of what this pump could hand over now came."""
        dates = [self.in_hand_since] if self.in_hand else []
        if isinstance(self.reader, PipeReader) and (buffered := self.reader.buffered_since()) is not None:
            dates.append(buffered)
        if self.held_since is not None:
            dates.append(self.held_since)
        return min(dates, default=None)

    def first_date(self) -> float | None:
        """When the oldest piece of what this pump could hand over came: its partial line,
        else what its reader has (see earliest)."""
        return self.in_hand_since if self.in_hand else self.earliest()

    def take_first(self, until: float | None) -> bytes:
        """What this pump has and has not handed over, oldest first: its partial line, and
        (or else) what its reader has buffered and its held pipe gathered (read here, the
        pipe still held), when that came before `until` (None: whenever). Safe whatever
        the pump waits on: its read() takes an emptied buffer for "nothing yet"."""
        data = bytes(self.in_hand)
        self.in_hand.clear()
        if data and until is not None:
            rest = self.earliest()
            if rest is None or rest >= until:
                return data
        if isinstance(self.reader, PipeReader):
            data += self.reader.take_gathered(READ_SIZE)[0]
            if self.held_since is not None:
                self.held_since = time.monotonic()  # (what comes next is newer)
        return data

    async def hand_over(self, data: bytes) -> None:
        activity = self.activity
        activity.touch()
        activity.handing_over += 1
        try:
            await self.on_data(data)
        finally:
            activity.handing_over -= 1
            activity.count_hand_over()
        activity.touch()  # the idle window starts once the worker took it, not before


async def _pump(
    reader: asyncio.StreamReader | None, on_data: OnData, activity: Activity, pumps: _Pumps | None = None
) -> None:
    if reader is None:
        return
    pumps = pumps or _Pumps()
    me = _Pump(reader, on_data, activity)
    pumps.members.append(me)
    while True:
        if pumps.drops is not None and pumps.drops.now() and isinstance(reader, PipeReader):
            if await _drain_dropped(me, pumps):
                return
            continue
        if isinstance(reader, PipeReader):
            reader.release()  # (held by the last turn of _drain_dropped, if any)
        data = await reader.read(READ_SIZE)
        if not data:
            if reader.at_eof():
                return
            continue  # (another pump took what had come: see _Pump.take_first)
        me.in_hand_since = reader.fed_at if isinstance(reader, PipeReader) else time.monotonic()
        me.in_hand += data
        at_end = await _rest_of_line(me)
        size = await _hand_over_in_order(me, pumps)
        if at_end:
            return
        if size >= COALESCE_BELOW:
            continue
        # A program writing line by line would wake the worker once per line; a moment's
        # pause, with the pipe's reading held, lets the pipe gather its next lines into one
        # read and one event (read here, still held: no wake-up of its own).
        if not isinstance(reader, PipeReader):
            await asyncio.sleep(_hold_s(activity))
            continue
        while True:
            me.held_since = time.monotonic()
            try:
                await reader.pause(_hold_s(activity), release=False)
                dated = me.earliest()
                gathered, ended = reader.take_gathered(READ_SIZE)
            finally:
                me.held_since = None
                reader.release()
            if gathered and dated is not None:
                me.in_hand_since = dated
                me.in_hand += gathered
                if not await _rest_of_line(me):
                    size = await _hand_over_in_order(me, pumps)
                    if not ended and size < COALESCE_BELOW and not (pumps.drops and pumps.drops.now()):
                        continue  # gather again
            if ended or reader.at_eof():
                await _hand_over_in_order(me, pumps)
                return
            break  # nothing came while held: wait for the next write with the pipe read


async def _drain_dropped(me: _Pump, pumps: _Pumps) -> bool:
    """One turn of reading what is only dropped: the pipe, widened, is held DROP_TICK_S and
    then read whole (so a program writing flat out blocks on a full pipe between turns, and
    the worker wakes 1/DROP_TICK_S times a second, not once per 64 KiB). A turn that finds
    nothing waits for the next write as usual. True at EOF."""
    reader, drops = me.reader, pumps.drops
    assert isinstance(reader, PipeReader) and drops is not None
    # (The step's memory grows first: the program fills a widened pipe at once.)
    added = reader.short_of(DROP_PIPE_BYTES)
    if added and await drops.room(added):
        reader.widen(DROP_PIPE_BYTES)
    # The pipe stays held from turn to turn (released, the transport would read it in
    # 64 KiB pieces meanwhile: most of a turn's cost); released when no more is dropped.
    me.held_since = time.monotonic()
    try:
        await reader.pause(DROP_TICK_S, release=False)
        # Only its end is handed over (what a stderr's last words need: StreamTail).
        tail, size, ended = reader.drop_gathered(StreamTail.SIZE)
    except BaseException:
        reader.release()
        raise
    finally:
        me.held_since = None
    if not size and not ended:
        reader.release()
        tail = await reader.read(DROP_PIPE_BYTES)
        ended = not tail and reader.at_eof()
    if me.in_hand:  # (what it had before the budget was spent, if anything: first)
        tail = bytes(me.in_hand) + tail
        me.in_hand.clear()
    if tail:
        async with pumps.lock:  # (nothing of it goes out, in any order)
            await me.hand_over(tail[-StreamTail.SIZE :])
    return ended or reader.at_eof()


def _hold_s(activity: Activity) -> float:
    return CHATTY_COALESCE_S if activity.chatty else COALESCE_S


async def _rest_of_line(me: _Pump) -> bool:
    """A small read that ends mid-line: wait a moment for the line's rest (print under -u
    writes the text and the "\n" apart), so a line goes in one event. True at EOF."""
    if len(me.in_hand) >= COALESCE_BELOW or me.in_hand.endswith(b"\n"):
        return False
    reader = me.reader
    if isinstance(reader, PipeReader):
        # The rest is read out in this same step, never left in a read of its own in flight
        # where another pump's _Pump.take_first could not see it.
        await reader.wait_buffered(PARTIAL_LINE_S)
        dated = reader.buffered_since()
        more, ended = reader.take_gathered(READ_SIZE - len(me.in_hand))
        if more and not me.in_hand:
            # (another pump took the start of the line meanwhile: the rest is dated anew)
            me.in_hand_since = dated if dated is not None else time.monotonic()
        me.in_hand += more
        return ended
    try:
        more = await asyncio.wait_for(reader.read(READ_SIZE - len(me.in_hand)), PARTIAL_LINE_S)
    except TimeoutError:
        return False
    me.in_hand += more
    return not more and reader.at_eof()


async def _hand_over_in_order(me: _Pump, pumps: _Pumps) -> int:
    """Hand over what `me` has, after what the other pumps have from earlier, piece by
    piece in the order they came; the size `me` handed over.

    `me`'s partial line always goes. What its reader gathered since goes with it only if
    no other pump has anything older: otherwise it waits for `me`'s next turn. (A hand-over
    can take long, the flusher full while Redis is slow, and both pipes are read meanwhile:
    taking all `me` had would put its later writes ahead of the other stream's earlier ones.)
    """
    handed = 0
    async with pumps.lock:
        mine = me.earliest()
        taken: list[_Pump] = []  # (one take a pump: what comes meanwhile waits for its turn)
        while True:
            dated = [(date, pump) for pump in pumps.members if pump not in taken and (date := pump.first_date()) is not None]
            if not dated:
                break
            date, pump = min(dated, key=lambda found: found[0])
            if pump is not me and not me.in_hand and mine is not None and date >= mine:
                break  # (nothing of the others' from before what `me` had)
            until = min((found for found, other in dated if other is not pump), default=None)
            data = pump.take_first(until)
            taken.append(pump)
            if data:
                if pump is me:
                    handed += len(data)
                await pump.hand_over(data)
    return handed


# How often a step waiting for memory looks for a kill (only while it waits).
KILL_LOOK_S = 0.05


def _take_kill(inbox: asyncio.Queue[object]) -> bool:
    """Take the first kill waiting in `inbox`, if there is one; the rest stay, in order."""
    waiting = [inbox.get_nowait() for _ in range(inbox.qsize())]
    kill = next((item for item in waiting if isinstance(item, CtrlMessage) and item.type == "kill"), None)
    for item in waiting:
        if item is not kill:
            inbox.put_nowait(item)
    return kill is not None


async def supervise(
    jail: Jail,
    cgroup: JobCgroup,
    program: Program,
    clocks: Clocks,
    pumps: list[tuple[asyncio.StreamReader | None, OnData]],
    inbox: asyncio.Queue[object],
    feed_stdin: Callable[[Activity], Awaitable[None]] | None = None,
    sink: asyncio.Task[None] | None = None,
    memory: MemoryAdmission | None = None,
    parked_until: asyncio.Event | None = None,
    uncharged: Uncharged = CHARGED_IN_FULL,
    output_spent: Callable[[], bool] | None = None,
    drain_on_stop_s: float = 0.0,
    on_go: Callable[[float], None] | None = None,
    before_go: Callable[[], Awaitable[object]] | None = None,
    extra_memory_bytes: int = 0,
) -> StepFacts:
    """Release the jail's gate with `program` and watch it to the end.

    With `memory`, the gate opens only once the jail's memory limit fits what the running
    jobs leave of the ceiling (worker/isolation/memory.py), and the limit is held until the
    step's last process is gone; the clocks start after that wait. A parked job's step (a
    compile while parked) lets every started job's steps go first until `parked_until` is
    set (its start).

    A kill already in the inbox (it came while the stage was announced or the sandbox was
    loaded), or one that comes during that wait, ends the step with the gate still shut:
    the program never runs at all.

    What the sandbox does not charge the job (its runtime's start-up: Sandbox.load) is
    left out of the clocks, the figures, and the program's CPU rlimit backstop.

    Once `output_spent()` (the step's output budget is spent), its pipes are read in few,
    big reads (_drain_dropped).

    A cancel (the worker stopping) that comes once the program has ended, while what it
    wrote is still being read and handed over (Redis slow), lets the pumps go on for up to
    `drain_on_stop_s` more, then raises StepStopped with the step's facts if they reached
    the pipes' ends: a program that ended by itself keeps its own verdict and output.

    `on_go` is told when the program is started (the loop's time of its go, its runtime's
    uncharged start-up included), and only if it is: a caller reporting a step cut short
    counts its time from there, not from a wait for memory before it.

    `before_go` runs once the step's memory is held and before its clocks start (a test
    case's copy of the compiled program), unless a kill came first; `extra_memory_bytes` is
    what the step holds of the ceiling past its jail's limit (that copy's).
    """
    if uncharged.cpu_ms and program.rlimit_cpu_s:
        room_s = cpu_backstop_room_s(uncharged.cpu_ms / 1000)
        program = dataclasses.replace(program, rlimit_cpu_s=program.rlimit_cpu_s + room_s)
    cpu_budget_ms = clocks.cpu_ms + uncharged.cpu_ms
    start_up_s = uncharged.wall_ms / 1000
    async with _memory_for(memory, cgroup, extra_memory_bytes, inbox, parked_until):
        if before_go is not None and not _has_kill(inbox):
            try:
                await before_go()
            except asyncio.CancelledError as exc:
                raise StepNotStarted(*exc.args) from None
        loop = asyncio.get_running_loop()
        cpu_base = cgroup.cpu_us()
        # Without the kernel's group OOM kill (cgroup v1), one OOM kill leaves the rest of the
        # program running, a verdict unlike v2's: the worker ends the rest itself, at a tick.
        # (Counted from here: a prestarted runtime's warm-up is not the job's.) And when the
        # program ended before a tick saw the kill: see the end of the step.
        oom_by_hand = not cgroup.oom_kills_whole_job
        oom_base = cgroup.oom_kills() if oom_by_hand else 0
        fired: str | None = "user" if _take_kill(inbox) else None
        wall_s = clocks.wall_ms / 1000 + start_up_s
        # A jail can end before its go (the ceiling's OOM killer, a kill of its cgroup), or
        # be too close to nsjail's own time limit to give the program its wall clock (it
        # waited long for memory): then nothing is started, and the platform says it failed.
        aged = fired is None and jail.backstop_left_s() < wall_s + BACKSTOP_ROOM_S
        never_ran = fired is None and (aged or not jail.go(program))
        go_at = loop.time()
        # (The idle clock too: a runtime starting up writes nothing.)
        activity = Activity(go_at + start_up_s)
        order = _Pumps(_Drops(output_spent, jail.ended, cgroup) if output_spent is not None else None)
        readers = [asyncio.create_task(_pump(reader, on_data, activity, order)) for reader, on_data in pumps]
        starts = fired is None and not never_ran
        if starts and on_go is not None:
            on_go(go_at)
        stdin_task = asyncio.create_task(feed_stdin(activity)) if feed_stdin is not None and starts else None
        inbox_task: asyncio.Future[object] = next_item(inbox)
        children = [*readers, *([stdin_task] if stdin_task else [])]
        ended_at = go_at
        idle_s = clocks.idle_ms / 1000 if clocks.idle_ms is not None else None
        cpu_due_at = cpu_clock_due_at(go_at, cpu_budget_ms / 1000, cgroup.cpu_cap_cores)
        cpu_read_at = min(cpu_due_at, go_at + CPU_CHECK_S)
        sample_memory = cgroup.samples_memory
        killed = stopped = False
        try:
            while fired is None and not never_ran:
                now = loop.time()
                if now - go_at >= wall_s:
                    fired = "wall"
                elif now >= cpu_read_at and cgroup.cpu_us() - cpu_base >= cpu_budget_ms * 1000:
                    fired = "cpu"
                elif idle_s is not None and now - activity.last >= idle_s and not activity.handing_over:
                    fired = "idle"
                if oom_by_hand and (fired or now >= cpu_read_at) and cgroup.oom_kills() > oom_base:
                    fired = "memory"  # (a clock firing after the OOM kill came too late)
                if fired:
                    ended_at = now
                    break
                if now >= cpu_read_at:
                    cpu_read_at = min(now + CPU_CHECK_S, max(cpu_due_at, now + CPU_POLL_S))
                    if sample_memory:
                        cgroup.note_memory()  # (a kernel that cannot tell the job's peak)
                timeout = min(go_at + wall_s - now, cpu_read_at - now)
                if idle_s is not None and not activity.handing_over:
                    # (While output is being handed over the idle clock waits; it is looked at
                    # again within CPU_CHECK_S of the hand-over's end.)
                    timeout = min(timeout, activity.last + idle_s - now)
                # Only what is still pending: a pump that reached EOF stays done, and watching it
                # would turn this wait into a spin until nsjail is reaped (its teardown comes after
                # the pipes close), reading cpu.stat on every turn.
                pending = [t for t in (*readers, *([sink] if sink is not None else [])) if not t.done()]
                watched = {jail.ended, inbox_task, *pending}
                done, _ = await asyncio.wait(watched, timeout=max(timeout, 0.001), return_when=asyncio.FIRST_COMPLETED)
                if jail.ended in done:
                    ended_at = loop.time()
                    break
                # `sink` is what takes the output away (the flusher): if it failed, nothing will.
                takers = [*readers, *([sink] if sink is not None else [])]
                failed = [t for t in takers if t.done() and not t.cancelled() and t.exception() is not None]
                if failed:
                    # Nothing drains that pipe any more (e.g. the job was fenced off while
                    # publishing): stop the program now rather than let it block on a full pipe.
                    ended_at = loop.time()
                    break
                if inbox_task in done:
                    item = inbox_task.result()
                    inbox_task = next_item(inbox)
                    if isinstance(item, CtrlMessage) and item.type == "kill":
                        fired = "user"
                        ended_at = loop.time()
                        break

            # Whatever ended the step, nothing of it may outlive it. A gate that reported has
            # killed and reaped the rest of its namespace first; a jail that ended by itself
            # took its pid namespace with it, and a read of its cgroup's process list usually
            # shows that here, cheaper than a trip to the isolation threads.
            if not jail.ended.done() or (not jail.reported and cgroup.may_hold_leftovers()):
                # On the thread kept for short steps: on the shared four it could wait behind
                # a teardown's retries, artifacts or big files, and the program ran on,
                # streaming and burning CPU past its clock, until a thread was free.
                await off_loop_quick(cgroup.kill)
            killed = True
            try:
                # (A gate that reported told how the program ended: no wait, and no task for one.)
                exit_info = await (jail.wait_program() if jail.reported else asyncio.wait_for(jail.wait_program(), EXIT_GRACE_S))
            except TimeoutError:
                log.error("nsjail did not exit after the kill; killing it")
                jail.terminate_supervisor()
                exit_info = await jail.wait_program()
            # The pipes hold all there is: nothing that could write to them runs any more.
            jail.end_output()
            try:
                await _read_to_the_end(readers, activity)
            except asyncio.CancelledError:
                if drain_on_stop_s > 0:
                    await asyncio.shield(asyncio.wait(readers, timeout=drain_on_stop_s))
                stopped = True
        finally:
            # Also on cancellation: no pump or feeder may outlive the step and emit afterwards.
            try:
                if not killed:
                    await off_loop_quick(cgroup.kill)
            finally:
                # (Even if cancelled again while the kill finished: the rest must still happen.)
                if inbox_task.done() and not inbox_task.cancelled():
                    # Taken from the inbox but not acted on (the step ended by itself meanwhile): a
                    # kill that came as a compile ended is for the run that follows, so it goes back.
                    inbox.put_nowait(inbox_task.result())
                else:
                    inbox_task.cancel()
                # Bounded (see worker/tasks.py): a helper that swallowed its cancellation must not
                # hold the job forever; the stdin feeder also stops on a flag of its own.
                await cancel_and_wait(children, CHILD_EXIT_S)
            outcomes = [t.exception() if t.done() and not t.cancelled() else None for t in children]
        if stopped and (any(isinstance(o, Exception) for o in outcomes) or not all(t.done() and not t.cancelled() for t in readers)):
            raise StepStopped(None)  # (some of what the program wrote was never handed over)
        for outcome in outcomes:
            # A pump that failed (e.g. the job was fenced off while publishing) ends the job.
            if isinstance(outcome, Exception):
                raise outcome
        counters = cgroup.counters(judge_ceiling=False)
        if counters.oom_kills:
            counters = await off_loop(cgroup.counters)  # (see JobCgroup.counters)
        if fired is None and oom_by_hand and counters.oom_kills > oom_base:
            # (A parent that outlived its child's OOM kill by less than a tick: v2 ends it too.)
            fired = "memory"
        if fired is None and counters.cpu_us - cpu_base >= cpu_budget_ms * 1000:
            # The program ended between two reads of the CPU clock with its budget spent: its
            # verdict says what its figure does (else a few ms past cpuMs was `completed` or
            # `timed_out` by the reads' timing).
            fired = "cpu"
        if never_ran:
            # Whatever ended it, no program of the job's did: the platform failed before it.
            if aged:
                errors = ["the sandbox neared its own time limit while the job waited for memory; nothing ran"]
            else:
                why = exit_info.errors or [f"nsjail ended with {exit_info.signal or exit_info.exit_code}"]
                errors = ["the jail ended before the program was started", *why]
            exit_info = JailExit(None, None, False, errors, program_ran=False)
            fired = None
        facts = StepFacts(
            exit=exit_info,
            fired=fired,
            duration_ms=max(0, round((ended_at - go_at) * 1000) - uncharged.wall_ms),
            cpu_ms=max(0, (counters.cpu_us - cpu_base) // 1000 - uncharged.cpu_ms),
            memory_kb=max(0, counters.memory_peak_bytes - uncharged.memory_bytes) // 1024,
            oom_kills=counters.oom_kills,
            ceiling_oom=counters.ceiling_oom,
        )
        if stopped:
            raise StepStopped(facts)
        return facts


async def _read_to_the_end(readers: list[asyncio.Task[None]], activity: Activity) -> None:
    """Wait for the pumps to read the pipes to their ends (nothing writes to them any more)."""
    handed = activity.handed_over
    await asyncio.wait(readers, timeout=EXIT_GRACE_S)
    while not all(t.done() for t in readers) and (activity.handing_over or activity.handed_over != handed):
        # What the program wrote is still being handed over, and moving (Redis slow or
        # away: the flusher gives up, and the pump with it, after REDIS_OUTAGE_S), not
        # stuck in a pipe nobody can read: wait for it rather than lose it.
        handed = activity.handed_over
        await asyncio.wait(readers, timeout=EXIT_GRACE_S)


@contextlib.asynccontextmanager
async def _memory_for(
    memory: MemoryAdmission | None,
    cgroup: JobCgroup,
    extra_bytes: int,
    inbox: asyncio.Queue[object],
    parked_until: asyncio.Event | None,
) -> AsyncIterator[None]:
    """Hold the step's memory limit, and `extra_bytes` past it, of `memory` for the step
    (nothing without `memory`, nor when a kill came first: the step then ends with the gate
    shut)."""
    if memory is None:
        yield
        return
    size = cgroup.memory_limit_bytes + extra_bytes
    if not await _admitted(memory, size, inbox, parked_until):
        yield
        return
    try:
        yield
    finally:
        memory.release(size)


async def _admitted(
    memory: MemoryAdmission, size: int, inbox: asyncio.Queue[object], parked_until: asyncio.Event | None
) -> bool:
    """Wait for the memory; False (nothing held) if a kill came first (it stays in `inbox`)."""
    speculative = parked_until is not None and not parked_until.is_set()
    if memory.try_admit(size, speculative):
        return True
    admission = asyncio.ensure_future(memory.admit(size, speculative, parked_until))
    try:
        while True:
            done, _ = await asyncio.wait({admission}, timeout=KILL_LOOK_S)
            if done:
                admission.result()
                return True
            if _has_kill(inbox):
                await _give_up(memory, size, admission)
                return False
    except asyncio.CancelledError as exc:
        await _give_up(memory, size, admission)
        raise StepNotStarted(*exc.args) from None
    except BaseException:
        await _give_up(memory, size, admission)
        raise


async def _give_up(memory: MemoryAdmission, size: int, admission: asyncio.Future[None]) -> None:
    """Stop waiting; memory already granted (the wait ended just as this step was cancelled)
    goes back, or no step after it would ever find that room again."""
    admission.cancel()
    await asyncio.gather(admission, return_exceptions=True)
    if not admission.cancelled() and admission.exception() is None:
        memory.release(size)


def _has_kill(inbox: asyncio.Queue[object]) -> bool:
    """Whether a kill waits in `inbox` (which is left as it was)."""
    waiting = [inbox.get_nowait() for _ in range(inbox.qsize())]
    for item in waiting:
        inbox.put_nowait(item)
    return any(isinstance(item, CtrlMessage) and item.type == "kill" for item in waiting)
