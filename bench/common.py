"""Shared bits of the benchmarks: percentiles and a stack-driven job timer."""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.keepalive import KeepAliveHttp
from launcher.stack import Stack
from tests.helpers import Api, Realtime

__all__ = ["KeepAliveRealtime", "api_client", "first_arrival", "pct", "summary", "time_job"]


def api_client(stack: Stack, timeout_s: float = 60) -> KeepAliveHttp:
    """A kept-open connection to the stack's API holding its API token (one per thread,
    never one per request)."""
    return KeepAliveHttp(stack.api_url, {"Authorization": f"Bearer {stack.api_token}"}, timeout_s)


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(p / 100 * (len(ordered) - 1))))
    return ordered[index]


def first_arrival(rt: Realtime, channel: str, event: str) -> list[float]:
    """A list that gets the perf_counter() instant of `event`'s first arrival on `channel`
    (stamped in the Pusher client's thread, before anything else handles it)."""
    first: list[float] = []

    def stamp(_data: str) -> None:
        if not first:
            first.append(time.perf_counter())

    rt.pusher.channels[channel].bind(event, stamp)
    return first


def summary(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(pct(values, 50), 2),
        "p90_ms": round(pct(values, 90), 2),
        "mean_ms": round(statistics.fmean(values), 2),
        "min_ms": round(min(values), 2),
    }


class KeepAliveRealtime(Realtime):
    """A Realtime whose channel auth goes through a kept-open client of the API's.

    pysher signs each subscription with a fresh `requests.post` (a new connection per job);
    pusher-js in a browser reuses its connection, and so do these benchmarks. `api` is the
    tests' Api or a bench.keepalive.KeepAliveHttp holding the API token.
    """

    def __init__(self, stack: Stack, api: Api | KeepAliveHttp) -> None:
        super().__init__(stack)
        self.pusher._generate_auth_token = lambda channel: self._auth(api, channel)

    def _auth(self, api: Api | KeepAliveHttp, channel: str) -> str:
        form = {"channel_name": channel, "socket_id": self.pusher.connection.socket_id}
        response = api.post("/v1/channel-auth", data=form)
        if response.status_code != 200:
            raise SystemExit(f"channel auth failed: {response.status_code} {response.text}")
        return str(response.json()["auth"])


def time_job(api: Api, rt: Realtime, body: dict[str, Any], expect_stdout: str) -> tuple[float, float]:
    """(execute→result, start→result) in ms for one job driven like an IDE would."""
    t0 = time.perf_counter()
    job = api.execute(body)
    followed = rt.follow(job)
    t1 = time.perf_counter()
    api.start(job)
    result = followed.wait_result(timeout_s=60)
    t2 = time.perf_counter()
    if result["outcome"] != "completed" or followed.text("stdout") != expect_stdout:
        raise SystemExit(f"job misbehaved: {result} {followed.events}")
    rt.pusher.unsubscribe(job["channel"])
    return (t2 - t0) * 1000, (t2 - t1) * 1000
