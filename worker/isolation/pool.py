"""The warm pool: one ready sandbox per slot, handed to whichever job starts first.

Parked jobs hold no sandbox (a record and a subscription each), so a worker can keep many
of them while its few jails go to jobs that actually run. A job takes a sandbox when its
start arrives, in the order starts arrived; when the job is over the sandbox is destroyed
and its slot builds the next one in the background.

A slot's next sandbox is primed with the runtime of the language its last job used (if
that language has a prestart shim; the worker's WORKER_PRESTART language before any
job), so a run of jobs in one language finds its interpreter already started; a
saturated worker builds plain instead, and primes its plain spares again once idle (see
`_prime_now` and `_reprime_one`). A job
takes a sandbox whose runtime it can adopt, else a plain one; a primed sandbox it cannot
use is rebuilt plain for it (a plain sandbox runs anything).
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Callable
from dataclasses import dataclass

from worker.isolation.jail import Program
from worker.isolation.sandbox import MAX_IDLE_S, Prime, RuntimeFailed, Sandbox, SandboxFactory

__all__ = ["BUILD_CHECK_S", "SandboxPool", "SandboxesFailing"]

log = logging.getLogger(__name__)

ARM_RETRY_S = 2.0
# A started job (or a test case) waiting for a sandbox gives up on this worker once this many
# builds failed, and none succeeded, since it began waiting (see failing); the builds are
# looked at this often while it waits.
BUILD_FAILURES_TO_GIVE_UP = 3
BUILD_CHECK_S = 0.5
# How long no job may have asked for a sandbox before plain spares are primed again.
REPRIME_IDLE_S = 1.0
# Started jobs that waited side by side for sandboxes this recently: the worker is saturated.
SATURATED_FOR_S = 1.0
# A language whose prestarted runtime failed to come up this many times in a row is not
# prestarted again by this worker. One failure (a runtime slow to start beside busy jobs)
# only makes that slot build its next sandbox plain.
PRIME_FAILURES_TO_STOP = 3


class SandboxesFailing(Exception):
    """Every sandbox this worker built while a job waited failed (the last build's error)."""


@dataclass(frozen=True)
class _Borrower:
    """A parked job waiting to borrow a sandbox (see `SandboxPool.borrow`)."""

    waiter: asyncio.Future[Sandbox]
    program: Program | None
    recall: Callable[[], None]
    language: str


class SandboxPool:
    def __init__(
        self,
        factory: SandboxFactory,
        owner: str,
        slots: int,
        primes: dict[str, Prime] | None = None,
        first_prime: str = "",
    ) -> None:
        self._factory = factory
        self._owner = owner
        self.slots = slots
        # Every language's prime, kept for prime_for even once it is no longer prestarted.
        self._primes = primes or {}
        # Languages no longer prestarted (PRIME_FAILURES_TO_STOP), and each language's
        # runtime failures since its last warm-up that came up.
        self._unprimed: set[str] = set()
        self._prime_failures: dict[str, int] = {}
        # What each slot primes its next sandbox with (None: a plain one).
        self._slot_prime: dict[int, Prime | None] = {slot: self._primes.get(first_prime) for slot in range(slots)}
        self._ready: collections.deque[Sandbox] = collections.deque()
        self._waiters: collections.deque[asyncio.Future[Sandbox]] = collections.deque()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        # Sandboxes being built right now (each will go to whoever waits first).
        self._building = 0
        # Slots in none of a job's hands (see in_use): about to build (a retry's pause after
        # a failed build, or the turn before the build's task runs), tearing their last
        # sandbox down, or torn down by the job that had it (`retiring`, then `rearm`); and
        # whether the slots were armed.
        self._to_build = 0
        self._retiring = 0
        self._job_retiring: set[int] = set()
        self._started = False
        # loop.time() of the last take() or borrow(), and the pending re-priming check.
        self._last_demand = 0.0
        # loop.time() of the last take() that found no sandbox ready.
        self._last_wait = float("-inf")
        self._reprime_timer: asyncio.TimerHandle | None = None
        # Parked jobs waiting to borrow a spare sandbox, and the borrowers (oldest first) with
        # the callback that makes one give its sandbox up for a started job.
        self._borrow_waiters: collections.deque[_Borrower] = collections.deque()
        self._lent: dict[int, Callable[[], None]] = {}
        # Set whenever a sandbox becomes ready or a waiter is served (the claimer watches it).
        self.changed = asyncio.Event()
        # Builds that succeeded and that failed so far, and how the last failure failed: a
        # job that sees only failures while it waits gives up on this worker (see failing).
        self.builds_made = 0
        self.builds_failed = 0
        self.last_build_error = ""

    def prime_for(self, language: str) -> Prime | None:
        """The language's prime here, if it has one: a plain sandbox running what it would
        have adopted leaves the runtime's start-up out of the job's charges too (Sandbox.load),
        also once the language is no longer prestarted here."""
        return self._primes.get(language)

    def _prime_to_build(self, language: str) -> Prime | None:
        """What a slot serving `language` primes its next sandbox with."""
        return None if language in self._unprimed else self._primes.get(language)

    @property
    def waiting(self) -> int:
        """Started jobs waiting for a sandbox."""
        return sum(1 for w in self._waiters if not w.done())

    @property
    def ready(self) -> int:
        return len(self._ready)

    @property
    def building(self) -> int:
        return self._building

    @property
    def in_use(self) -> int:
        """Slots whose sandbox a job holds (a claimed job's run, compile or load): not the
        ones ready, building, waiting to build again after a failure, or tearing down."""
        if not self._started or self._closed:
            return 0
        idle = len(self._ready) + self._building + self._to_build + self._retiring + len(self._job_retiring)
        return max(0, self.slots - idle)

    def start(self) -> None:
        self._started = True
        for slot in range(self.slots):
            self._arm(slot)

    def _spawn(self, coro, name: str) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _arm(self, slot: int, delay_s: float = 0.0) -> None:
        """Build a fresh sandbox for `slot` in the background (never once the pool is closed)."""
        if self._closed:
            return
        self._to_build += 1

        async def arm() -> None:
            try:
                if delay_s:
                    await asyncio.sleep(delay_s)
            finally:
                self._to_build -= 1
            prime = self._prime_now(slot)
            self._building += 1
            try:
                sandbox = await self._factory.prepare(self._owner, slot, prime)
            except Exception as exc:
                if prime is not None and isinstance(exc, RuntimeFailed):
                    # A runtime that will not start must not keep the slot from serving.
                    self._runtime_failed(slot, prime, exc)
                    self._arm(slot)
                    return
                self.builds_failed += 1
                self.last_build_error = str(exc) or type(exc).__name__
                log.error("slot %d: cannot build a sandbox (%s); retrying in %.0fs", slot, exc, ARM_RETRY_S)
                self._arm(slot, delay_s=ARM_RETRY_S)
                return
            finally:
                self._building -= 1
            self.builds_made += 1
            if prime is not None:
                self._prime_failures.pop(prime.language, None)
            if self._closed:
                await sandbox.destroy()
                return
            self._offer(sandbox)

        self._spawn(arm(), f"arm-slot-{slot}")

    def _runtime_failed(self, slot: int, prime: Prime, exc: Exception) -> None:
        """The slot builds plain next; after PRIME_FAILURES_TO_STOP in a row, every slot does
        for that language (a job of it still marks its slot for it: see _prime_to_build)."""
        self._slot_prime[slot] = None
        failures = self._prime_failures[prime.language] = self._prime_failures.get(prime.language, 0) + 1
        if failures < PRIME_FAILURES_TO_STOP:
            log.warning("slot %d: %s; building it plain this time", slot, exc)
            return
        self._unprimed.add(prime.language)
        for other, its_prime in self._slot_prime.items():
            if its_prime is not None and its_prime.language == prime.language:
                self._slot_prime[other] = None
        log.error("slot %d: %s (%d times in a row); not prestarting %s again", slot, exc, failures, prime.language)

    def _prime_now(self, slot: int) -> Prime | None:
        """What `slot` builds now: its prime, unless the worker is saturated: jobs wait for
        a sandbox (started jobs, or parked borrowers that may be lent one), or started jobs
        waited side by side within the last SATURATED_FOR_S.

        A waiting job gets whichever sandbox is ready first, and a plain one is ready
        sooner and costs less in all (nsjail alone; the job's own interpreter start-up is
        the same work the prestarted one would have done before it, plus the shim's). So
        a saturated worker builds plain and spends its CPU on jobs. The recent wait counts
        as well as a present one: under a steady load jobs and builds come in waves, and a
        build started between two waves is taken by the next one. Plain sandboxes left
        ready afterwards are primed again once the worker is idle (`_reprime_one`).
        """
        if self._jobs_wait() or asyncio.get_running_loop().time() - self._last_wait < SATURATED_FOR_S:
            return None
        return self._slot_prime.get(slot)

    def _jobs_wait(self) -> bool:
        return bool(self.waiting) or (self._can_lend() and any(not b.waiter.done() for b in self._borrow_waiters))

    def _reprime_one(self) -> None:
        """Idle (no job asked for a sandbox for REPRIME_IDLE_S, nobody waits, nothing
        builds): rebuild one ready plain sandbox whose slot has a prime, primed. Each
        rebuild that becomes ready calls this again, so the spares a burst left plain are
        primed one at a time. A worker under load never gets here: its plain spares are
        used as they are, never thrown away for primed ones."""
        if self._reprime_timer is not None:
            self._reprime_timer.cancel()
            self._reprime_timer = None
        if self._closed or self._building or self._jobs_wait():
            return
        stale = next((s for s in self._ready if s.prime is None and self._slot_prime.get(s.slot) is not None), None)
        if stale is None:
            return
        loop = asyncio.get_running_loop()
        # Past both: idle long enough, and no longer saturated (the rebuild must be primed).
        wait_s = max(self._last_demand + REPRIME_IDLE_S, self._last_wait + SATURATED_FOR_S) - loop.time()
        if wait_s > 0:
            self._reprime_timer = loop.call_later(wait_s, self._reprime_one)
            return
        self._ready.remove(stale)
        self._retire(stale, name=f"reprime-{stale.name}")

    def _offer(self, sandbox: Sandbox) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(sandbox)
                self.changed.set()
                return
        for borrower in list(self._borrow_waiters):
            if borrower.waiter.done():
                self._borrow_waiters.remove(borrower)
            elif self._may_lend(sandbox, borrower.program):
                self._borrow_waiters.remove(borrower)
                # Lent here, not when the borrower resumes: a second offer in the same turn
                # of the loop must already see this loan against the cap.
                self._lend(sandbox, borrower.recall, borrower.program, borrower.language)
                borrower.waiter.set_result(sandbox)
                return
        self._ready.append(sandbox)
        self.changed.set()
        self._reprime_one()

    # ------------------------------------------------------------------ lending

    def _may_lend(self, sandbox: Sandbox, program: Program | None) -> bool:
        """A parked job may borrow `sandbox` for `program`: it is plain or its runtime adopts
        the program, no started job waits, and at least one slot stays for started jobs."""
        fits = sandbox.prime is None or (program is not None and sandbox.adopts(program))
        return fits and not self.waiting and self._can_lend()

    def _can_lend(self) -> bool:
        """At least one slot always stays for started jobs."""
        return len(self._lent) < self.slots - 1

    def _lendable(self, program: Program | None) -> Sandbox | None:
        """The ready sandbox a parked job would borrow: one whose runtime adopts `program`,
        else a plain one."""
        adopting = (s for s in self._ready if program is not None and s.adopts(program) and self._may_lend(s, program))
        return next(adopting, None) or next((s for s in self._ready if self._may_lend(s, program)), None)

    def _replace_stale(self) -> None:
        """Ready sandboxes that sat idle too long (nsjail's own time limit nears) or whose
        jail died are rebuilt, never lent (take() checks the one it picks the same way)."""
        for sandbox in [s for s in self._ready if not _fresh(s)]:
            self._ready.remove(sandbox)
            self._retire(sandbox)

    def lend_ready(self, recall: Callable[[], None], program: Program, language: str = "") -> Sandbox | None:
        """A sandbox ready now that a parked job may borrow for `program` (see `borrow`), or
        None: nothing is waited for and nothing is rebuilt for it."""
        self._last_demand = asyncio.get_running_loop().time()
        self._replace_stale()
        sandbox = self._lendable(program)
        if sandbox is None:
            return None
        self._ready.remove(sandbox)
        self._lend(sandbox, recall, program, language)
        return sandbox

    def _lend(self, sandbox: Sandbox, recall: Callable[[], None], program: Program | None, language: str) -> None:
        self._lent[sandbox.slot] = recall
        if language:
            prime = self._prime_to_build(language)
            self._slot_prime[sandbox.slot] = (
                prime if prime is not None and program is not None and prime.adopts(program) else None
            )

    async def borrow(self, recall: Callable[[], None], program: Program | None = None, language: str = "") -> Sandbox:
        """A spare plain sandbox for a parked job (compiling before its start); waits for one.

        Started jobs always come first: `recall` is called when a started job finds no
        sandbox ready, and the borrower must then give its sandbox up (destroy it; the slot
        rebuilds) and do its work after start instead.
        """
        self._last_demand = asyncio.get_running_loop().time()
        self._replace_stale()
        sandbox = self._lendable(program)
        if sandbox is not None:
            self._ready.remove(sandbox)
            self._lend(sandbox, recall, program, language)
            return sandbox
        spare = self._ready[0] if self._ready and not self.waiting and self._can_lend() else None
        if spare is not None:
            # Only primed sandboxes are spare: one is rebuilt plain for this borrower
            # (a started job still comes first when it is ready).
            self._ready.remove(spare)
            self._retire(spare, plain=True)
        waiter: asyncio.Future[Sandbox] = asyncio.get_running_loop().create_future()
        self._borrow_waiters.append(_Borrower(waiter, program, recall, language))
        try:
            return await waiter  # `_offer` lent it
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                sandbox = waiter.result()
                self._lent.pop(sandbox.slot, None)
                self._offer(sandbox)
            raise

    def build_mark(self) -> list[int]:
        """Where the builds stand as a wait begins, for `failing`."""
        return [self.builds_made, self.builds_failed]

    def failing(self, mark: list[int]) -> bool:
        """Whether BUILD_FAILURES_TO_GIVE_UP builds failed, and none succeeded, since `mark`.
        A success moves the mark on: it went to some waiting job, and the count starts again
        for those still waiting."""
        if self.builds_made != mark[0]:
            mark[:] = self.build_mark()
            return False
        return self.builds_failed - mark[1] >= BUILD_FAILURES_TO_GIVE_UP

    async def take_unless_failing(self, program: Program | None = None, language: str = "") -> Sandbox:
        """`take`, giving up with SandboxesFailing once builds only fail while it waits."""
        mark = self.build_mark()
        take = asyncio.ensure_future(self.take(program, language))
        try:
            while True:
                done, _ = await asyncio.wait({take}, timeout=BUILD_CHECK_S)
                if done:
                    return take.result()
                if self.failing(mark):
                    raise SandboxesFailing(self.last_build_error)
        except BaseException:
            await call_off(take, self.put_back)
            raise

    def put_back(self, sandbox: Sandbox) -> None:
        """A sandbox taken and left unused (its taker gave up): the next job's, as it is."""
        self._offer(sandbox)

    def keep(self, sandbox: Sandbox) -> None:
        """The borrower started: the sandbox is its job's now, no longer recallable."""
        self._lent.pop(sandbox.slot, None)

    def _recall_one(self) -> None:
        """A started job must wait: the oldest borrower gives its sandbox back."""
        if self._lent:
            slot = next(iter(self._lent))
            self._lent.pop(slot)()

    async def take(self, program: Program | None = None, language: str = "") -> Sandbox:
        """The next ready sandbox for `program` (first come, first served); waits while none is.

        A ready sandbox whose runtime adopts `program` is preferred, then a plain one. A
        sandbox that sat idle too long, whose jail died, or whose prestarted runtime cannot
        run `program`, is replaced first (plain, for a runtime mismatch).
        """
        demand = self._demand(program, language)
        first_pass = True
        while True:
            sandbox = self._pick(program) if not self._waiters else None
            if sandbox is None:
                if first_pass and self.waiting:
                    # Nothing was ready for it and other started jobs wait too: the worker
                    # is saturated. (One job at a time waiting for its slot's rebuild is a
                    # single client going fast, and a wait after giving up a sandbox primed
                    # for another language is a change of language; neither is load.)
                    self._last_wait = asyncio.get_running_loop().time()
                waiter: asyncio.Future[Sandbox] = asyncio.get_running_loop().create_future()
                self._waiters.append(waiter)
                self._recall_one()
                try:
                    sandbox = await waiter
                except asyncio.CancelledError:
                    if waiter.done() and not waiter.cancelled():
                        self._offer(waiter.result())  # served as we were cancelled: pass it on
                    raise
            if self._serves(sandbox, program, language, demand):
                return sandbox
            first_pass = False

    def take_ready(self, program: Program | None = None, language: str = "") -> Sandbox | None:
        """`take` without the wait: the sandbox `take` would return now, or None when it would
        wait (nothing fit to run `program` is ready, or other started jobs wait first)."""
        demand = self._demand(program, language)
        while not self._waiters and (sandbox := self._pick(program)) is not None:
            if self._serves(sandbox, program, language, demand):
                return sandbox
        return None

    def _demand(self, program: Program | None, language: str) -> Prime | None:
        """A job for `program` asks for a sandbox: the runtime its slot should prime next."""
        self._last_demand = asyncio.get_running_loop().time()
        if not language:
            return None
        # The slot that serves this job primes its next sandbox for this language (if jobs
        # like this one could adopt that runtime).
        prime = self._prime_to_build(language)
        return prime if prime is not None and program is not None and prime.adopts(program) else None

    def _serves(self, sandbox: Sandbox, program: Program | None, language: str, demand: Prime | None) -> bool:
        """Whether the picked `sandbox` can run `program`; one that cannot (stale, its jail
        dead, or a runtime that does not adopt it) is retired and its slot rebuilt."""
        if language:
            self._slot_prime[sandbox.slot] = demand
        usable = sandbox.prime is None or program is None or sandbox.adopts(program)
        if usable and _fresh(sandbox):
            return True
        self._retire(sandbox, plain=not usable)
        return False

    def _pick(self, program: Program | None) -> Sandbox | None:
        """The best ready sandbox for `program`: one that adopts it, else a plain one, else any."""
        if not self._ready:
            return None
        choice = next((s for s in self._ready if program is not None and s.adopts(program)), None)
        if choice is None:
            choice = next((s for s in self._ready if s.prime is None), self._ready[0])
        self._ready.remove(choice)
        return choice

    def _retire(self, sandbox: Sandbox, plain: bool = False, name: str = "") -> None:
        """Tear `sandbox` down in the background, then build its slot's next one (plain,
        or as the slot primes). The slot counts as retiring from now on, not in use."""
        self._retiring += 1
        self._spawn(self._replace(sandbox, plain), name or f"replace-{sandbox.name}")

    async def _replace(self, sandbox: Sandbox, plain: bool = False) -> None:
        if plain:
            self._slot_prime[sandbox.slot] = None
        try:
            await sandbox.destroy()
        except Exception:
            # The slot builds its next sandbox all the same (as after a job's own teardown):
            # a failed teardown must not take a slot out of service for the worker's life.
            log.exception("sandbox %s: teardown failed", sandbox.name)
        finally:
            self._retiring -= 1
            self._arm(sandbox.slot)

    def give_back(self, sandbox: Sandbox) -> None:
        """A job is done with `sandbox`: destroy it and build its slot's next one."""
        self._lent.pop(sandbox.slot, None)
        self._retire(sandbox, name=f"retire-{sandbox.name}")

    def retiring(self, slot: int) -> None:
        """The job that had `slot`'s sandbox is tearing it down itself (then `rearm`)."""
        self._job_retiring.add(slot)

    def rearm(self, slot: int) -> None:
        """A job destroyed its sandbox itself: build the slot's next one."""
        self._lent.pop(slot, None)
        self._job_retiring.discard(slot)
        self._arm(slot)

    async def close(self) -> None:
        """Stop building; destroy every ready sandbox."""
        self._closed = True
        if self._reprime_timer is not None:
            self._reprime_timer.cancel()
        for task in list(self._tasks):
            if task.get_name().startswith("arm-slot-"):
                task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        ready = list(self._ready)
        self._ready.clear()
        await asyncio.gather(*(sandbox.destroy() for sandbox in ready), return_exceptions=True)


async def call_off(take: asyncio.Future[Sandbox], keep: Callable[[Sandbox], None]) -> None:
    """Stop waiting for `take` (a task taking a sandbox): cancel it, and hand a sandbox it
    got all the same to `keep`. A take can end with its sandbox a turn of the loop before
    its waiter hears of it; a waiter that gives up then must not drop the sandbox, whose
    slot would be lost for the worker's life."""
    if not take.done():
        take.cancel()
        await asyncio.gather(take, return_exceptions=True)
    if not take.cancelled() and take.exception() is None:
        keep(take.result())


def _fresh(sandbox: Sandbox) -> bool:
    """Its jail is alive and has time left before nsjail's own limit. (A prestarted runtime
    that died there is seen at its gate's report: the gate then waits to be let go.)"""
    return sandbox.idle_s < MAX_IDLE_S and not sandbox.jail.ended.done()
