"""The API's sweep (api/sweeper.py) against stand-ins for soketi and the store: what it asks
and what it sends. The real thing runs in tests/test_audience.py (a lost webhook, a kill an
API could not publish) and tests/test_api_scripts.py (the debts in Redis)."""

from __future__ import annotations

from typing import Any

from api.sweeper import RealtimeSweeper


class _Owed:
    def __init__(self, events: list[tuple[str, bytes]]) -> None:
        self.events = events


class _Store:
    def __init__(self, marked: set[str]) -> None:
        self.marked = marked
        self.asked: list[list[str]] = []
        self.subscribed: list[str] = []
        self.owed: list[tuple[str, tuple[str, bytes] | None]] = []
        self.settled: list[tuple[str, bool]] = []

    async def unmarked(self, job_ids: list[str]) -> list[str]:
        self.asked.append(list(job_ids))
        return [job_id for job_id in job_ids if job_id not in self.marked]

    async def mark_subscribed(self, job_id: str, unmarked_only: bool = False) -> _Owed:
        assert unmarked_only
        self.subscribed.append(job_id)
        self.marked.add(job_id)
        return _Owed([("result", b'{"seq":3}')])

    async def take_owed_publishes(self) -> list[tuple[str, tuple[str, bytes] | None]]:
        owed, self.owed = self.owed, []
        return owed

    async def settle_owed(self, debt: str, taken: bool = False) -> None:
        self.settled.append((debt, taken))


class _Realtime:
    def __init__(self) -> None:
        self.occupied: list[str] | None = []
        self.soon: list[tuple[str, Any]] = []
        self.published: list[tuple[str, list[tuple[str, bytes]]]] = []
        self.takes = True

    async def occupied_jobs(self) -> list[str] | None:
        return self.occupied

    def publish_soon(self, channel: str, owed: Any) -> None:
        self.soon.append((channel, owed))

    async def publish(self, channel: str, events: list[tuple[str, bytes]]) -> bool:
        self.published.append((channel, events))
        return self.takes


async def test_the_sweep_marks_a_channel_unmarked_two_sweeps_running_and_looks_up_each_once() -> None:
    store, realtime = _Store(marked={"a"}), _Realtime()
    sweeper = RealtimeSweeper(store, realtime, 1000)  # type: ignore[arg-type]
    realtime.occupied = ["a", "b"]
    await sweeper.sweep()
    assert store.asked == [["a", "b"]] and store.subscribed == []  # (b: maybe a webhook on its way)
    realtime.occupied = ["a", "b", "c"]
    await sweeper.sweep()
    # a is known marked: not looked up again. b stayed unmarked: marked now, its replay sent.
    assert store.asked[1] == ["b", "c"] and store.subscribed == ["b"]
    assert [channel for channel, _ in realtime.soon] == ["private-run-b"]
    realtime.occupied = ["b", "c"]
    await sweeper.sweep()
    assert store.asked[2] == ["c"] and store.subscribed == ["b", "c"]
    realtime.occupied = ["a", "b", "c"]  # (a came back: forgotten while gone, looked up again)
    await sweeper.sweep()
    assert store.asked[3] == ["a"]
    realtime.occupied = None  # (soketi did not say: nothing changes)
    await sweeper.sweep()
    assert len(store.asked) == 4


async def test_the_sweep_settles_an_owed_result_only_once_soketi_took_it() -> None:
    store, realtime = _Store(marked=set()), _Realtime()
    sweeper = RealtimeSweeper(store, realtime, 1000)  # type: ignore[arg-type]
    store.owed = [("j1:kill", ("result", b'{"seq":1}')), ("j2:api:x", None), ("j3:gap", ("stdout", b"{}"))]
    realtime.takes = False
    await sweeper.sweep()
    # j1's result did not go: left taken, for a sweep after its lease. j2's log is gone and j3's
    # last entry is no result: nothing to send, settled.
    assert realtime.published == [("private-run-j1", [("result", b'{"seq":1}')])]
    assert store.settled == [("j2:api:x", True), ("j3:gap", True)]
    store.owed = [("j1:kill", ("result", b'{"seq":1}'))]
    realtime.takes = True
    await sweeper.sweep()
    assert store.settled[-1] == ("j1:kill", True)
