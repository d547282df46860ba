"""Jobs' memory limits are admitted against the ceiling all jails share, so no job can have
the kernel's OOM killer pick another job under that ceiling."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from shared.messages import CtrlMessage
from tests.conftest import StackFactory
from tests.helpers import Api, py_job
from worker.isolation.memory import SLOT_RESERVE_BYTES, MemoryAdmission
from worker.job.supervise import _admitted

MIB = 1 << 20


async def test_steps_are_admitted_in_order_while_their_limits_fit() -> None:
    memory = MemoryAdmission(100 * MIB)
    assert memory.try_admit(60 * MIB)
    order: list[str] = []

    async def step(name: str, size: int) -> None:
        await memory.admit(size)
        order.append(name)
        await asyncio.sleep(0.01)
        memory.release(size)

    # 50 does not fit beside 60; 10 would, but comes after it and waits its turn.
    waiting = [asyncio.create_task(step("fifty", 50 * MIB)), asyncio.create_task(step("ten", 10 * MIB))]
    await asyncio.sleep(0.02)
    assert order == [] and memory.waiting == 2
    memory.release(60 * MIB)
    await asyncio.gather(*waiting)
    assert order == ["fifty", "ten"] and memory.held_bytes == 0


async def test_a_step_bigger_than_the_room_runs_alone() -> None:
    memory = MemoryAdmission(100 * MIB)
    assert memory.try_admit(10 * MIB)
    big = asyncio.create_task(memory.admit(300 * MIB))
    await asyncio.sleep(0.01)
    assert not big.done()
    memory.release(10 * MIB)
    await asyncio.wait_for(big, 1)
    assert not memory.try_admit(1)  # nothing beside it
    memory.release(300 * MIB)
    assert memory.try_admit(100 * MIB)


async def test_a_waiter_that_gives_up_holds_nothing_and_blocks_nobody() -> None:
    memory = MemoryAdmission(100 * MIB)
    assert memory.try_admit(90 * MIB)
    first = asyncio.create_task(memory.admit(50 * MIB))
    second = asyncio.create_task(memory.admit(5 * MIB))
    await asyncio.sleep(0.01)
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await asyncio.wait_for(second, 1)  # first in line now, and it fits
    assert memory.held_bytes == 95 * MIB


async def test_sharing_the_room_with_another_worker_halves_it() -> None:
    # Each worker keeps its own slots' reserve out of its part.
    assert MemoryAdmission(1024 * MIB, slots=2).capacity_bytes == 1024 * MIB - 2 * SLOT_RESERVE_BYTES
    shared = MemoryAdmission(1024 * MIB, slots=2)
    shared.share_with(2)
    assert shared.capacity_bytes == 512 * MIB - 2 * SLOT_RESERVE_BYTES
    memory = MemoryAdmission(100 * MIB)
    memory.share_with(2)
    assert memory.capacity_bytes == 50 * MIB and memory.try_admit(50 * MIB) and not memory.try_admit(1)
    waiting = asyncio.create_task(memory.admit(40 * MIB))
    await asyncio.sleep(0.01)
    memory.share_with(1)  # the other worker left: room at once
    await asyncio.wait_for(waiting, 1)


async def test_started_jobs_steps_go_before_parked_jobs_compiles() -> None:
    memory = MemoryAdmission(100 * MIB)
    assert memory.try_admit(100 * MIB)
    order: list[str] = []

    async def step(name: str, speculative: bool) -> None:
        await memory.admit(60 * MIB, speculative)
        order.append(name)

    waiting = [asyncio.create_task(step("parked compile", True))]
    await asyncio.sleep(0.01)
    waiting.append(asyncio.create_task(step("started run", False)))
    await asyncio.sleep(0.01)
    assert not memory.try_admit(1, speculative=True)  # nor does a new compile overtake
    memory.release(100 * MIB)
    await asyncio.sleep(0.01)
    assert order == ["started run"]
    memory.release(60 * MIB)
    await asyncio.gather(*waiting)
    assert order == ["started run", "parked compile"]


async def test_a_parked_compile_whose_job_starts_queues_with_the_started_jobs() -> None:
    # Its job started while its compile waited for memory (or the start was there at claim):
    # from then on it waits in the started jobs' line, behind those already in it, ahead of
    # those after it, rather than behind every started job that ever comes.
    memory = MemoryAdmission(100 * MIB)
    assert memory.try_admit(100 * MIB)
    order: list[str] = []
    started = asyncio.Event()

    async def step(name: str, speculative: bool) -> None:
        await memory.admit(60 * MIB, speculative, started if speculative else None)
        order.append(name)
        await asyncio.sleep(0.02)
        memory.release(60 * MIB)

    waiting = [asyncio.create_task(step("compile", True))]
    await asyncio.sleep(0.01)
    waiting.append(asyncio.create_task(step("before its start", False)))
    await asyncio.sleep(0.01)
    started.set()
    await asyncio.sleep(0.01)
    waiting.append(asyncio.create_task(step("after its start", False)))
    await asyncio.sleep(0.01)
    memory.release(100 * MIB)
    await asyncio.wait_for(asyncio.gather(*waiting), 2)
    assert order == ["before its start", "compile", "after its start"]


@pytest.mark.parametrize("turns", [0, 1, 2])
async def test_a_step_cancelled_as_its_memory_is_granted_gives_it_back(turns: int) -> None:
    memory = MemoryAdmission(100 * MIB)
    assert memory.try_admit(90 * MIB)
    step = asyncio.create_task(_admitted(memory, 60 * MIB, asyncio.Queue(), None))
    await asyncio.sleep(0.01)
    memory.release(90 * MIB)  # granted now...
    for _ in range(turns):
        await asyncio.sleep(0)
    step.cancel()  # ...as the step is cancelled
    await asyncio.gather(step, return_exceptions=True)
    if step.cancelled():
        assert memory.held_bytes == 0 and memory.try_admit(100 * MIB)
    else:
        assert step.result() is True and memory.held_bytes == 60 * MIB


async def test_a_kill_while_waiting_for_memory_takes_nothing_and_stays_for_the_step() -> None:
    memory = MemoryAdmission(100 * MIB)
    assert memory.try_admit(100 * MIB)
    inbox: asyncio.Queue[object] = asyncio.Queue()
    waiting = asyncio.create_task(_admitted(memory, 10 * MIB, inbox, None))
    await asyncio.sleep(0.1)
    kill = CtrlMessage(type="kill")
    inbox.put_nowait(kill)
    assert await asyncio.wait_for(waiting, 1) is False
    assert inbox.get_nowait() is kill and memory.held_bytes == 100 * MIB and memory.waiting == 0


@pytest.mark.stack
@pytest.mark.sandbox
def test_two_jobs_whose_limits_pass_the_ceiling_run_one_after_the_other(make_stack: StackFactory) -> None:
    # 700 MiB for all jobs: two of 400 MiB that each fill 360 MiB cannot both run. Together
    # they would pass the ceiling, and its OOM killer would end one as if it had passed its
    # own limit; one at a time, both complete.
    stack = make_stack(SANDBOX_MEMORY_TOTAL_MB="700", WORKER_MAX_SANDBOXES="2")
    code = "import time\nheld = b'x' * (360 << 20)\ntime.sleep(1.5)\nprint('kept', len(held) >> 20)"
    with Api(stack) as api:
        jobs = [api.execute(py_job(code, collectOutput=True, limits={"memoryMb": 400})) for _ in range(2)]
        began = time.monotonic()
        for job in jobs:
            assert api.start(job).status_code == 202
        results = [api.wait_state(job, {"done"}, timeout_s=30)["result"] for job in jobs]
        took = time.monotonic() - began
        assert [r["outcome"] for r in results] == ["completed", "completed"], results
        for job in jobs:
            assert api.get(f"/v1/jobs/{job['jobId']}/output").json()["stdout"] == "kept 360\n"
        # One waited for the other; neither's clocks counted the wait.
        assert took >= 3.0 and all(r["durationMs"] < 2900 for r in results), (took, results)


def test_a_job_the_workers_stop_caught_waiting_for_memory_never_ran(make_stack: StackFactory) -> None:
    # Its program was still behind the gate, waiting for the other job's memory, when the
    # grace ended: it was reported `killed` as though it had run, with its wait as its
    # durationMs. Nothing of it ran: internal_error (safe to submit again), 0 ms.
    stack = make_stack(SANDBOX_MEMORY_TOTAL_MB="700", WORKER_MAX_SANDBOXES="2", WORKER_SHUTDOWN_GRACE_MS="300")
    code = "import sys, time\nheld = b'x' * (300 << 20)\nprint('holding', flush=True)\ntime.sleep(20)"
    with Api(stack) as api:
        holder, waiter = (api.execute(py_job(code, collectOutput=True, limits={"memoryMb": 400, "idleMs": 30000})) for _ in range(2))
        assert api.start(holder).status_code == 202
        deadline = time.monotonic() + 20
        with stack.redis() as redis:
            while not any(f[b"name"] == b"stdout" for _, f in redis.xrange(f"job:{holder['jobId']}:events")):
                assert time.monotonic() < deadline, "the first job never held its memory"
                time.sleep(0.05)
        assert api.start(waiter).status_code == 202
        api.wait_state(waiter, {"running"}, timeout_s=10)
        time.sleep(1.0)  # (its step waits at the gate: nothing of it may run before the holder ends)
        stack.stop_process("worker", signal.SIGTERM)
        held, waited = (api.wait_state(job, {"done", "killed", "error"}, timeout_s=20)["result"] for job in (holder, waiter))
        assert (held["outcome"], held["killedBy"]) == ("killed", "user"), held
        assert (waited["outcome"], waited["durationMs"], waited["signal"]) == ("internal_error", 0, None), waited
        assert "nothing of it ran" in waited["message"], waited
        assert api.get(f"/v1/jobs/{waiter['jobId']}/output").json()["stdout"] == ""
