"""CPU per Redis command in the caller's process: redis-py's asyncio client against LeanRedis.

What the API and the worker pay for each command they send (leanredis/ says why it
exists). A private redis-server on a free loopback port; one client of each kind, on
uvloop as the services run; for each command shape, `--calls` sequential awaits timed
with process_time (this process's CPU only, not Redis's). The two clients alternate within
every repetition, the first of them flipped each time; the table gives min / median / max
of the per-repetition figures in microseconds of CPU per call and the ratio of the medians.

    .venv/bin/python bench/redis_client.py [--reps 3] [--calls 5000]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import uvloop
from redis.asyncio import Redis

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from launcher.stack import free_port
from leanredis import LeanRedis

SCRIPT = "redis.call('HSET', KEYS[1], 'f', ARGV[1]); return redis.call('HGET', KEYS[1], 'f')"


def shapes(client: Redis) -> dict[str, Callable[[], Awaitable[object]]]:
    script = client.register_script(SCRIPT)

    async def pipeline() -> object:
        async with client.pipeline(transaction=True) as pipe:
            pipe.get("k")
            pipe.exists("k")
            pipe.hget("h", "f")
            return await pipe.execute()

    return {
        "GET": lambda: client.get("k"),
        "HMGET 3 fields": lambda: client.hmget("h", ["f", "g", "x"]),
        "script (EVALSHA)": lambda: script(keys=["h"], args=["v"]),
        "MULTI/EXEC of 3": pipeline,
    }


async def cpu_us_per_call(call: Callable[[], Awaitable[object]], calls: int) -> float:
    for _ in range(200):  # warm: connection, script cache
        await call()
    started = time.process_time()
    for _ in range(calls):
        await call()
    return (time.process_time() - started) / calls * 1e6


async def run(port: int, reps: int, calls: int) -> dict[str, dict[str, list[float]]]:
    url = f"redis://127.0.0.1:{port}/0"
    clients = {"redis-py": Redis.from_url(url, socket_timeout=5), "LeanRedis": LeanRedis.from_url(url, socket_timeout=5)}
    await clients["redis-py"].set("k", "v")
    figures: dict[str, dict[str, list[float]]] = {}
    try:
        calls_by_client = {name: shapes(client) for name, client in clients.items()}
        for rep in range(reps):
            order = list(clients) if rep % 2 == 0 else list(reversed(clients))
            for shape in calls_by_client["redis-py"]:
                for name in order:
                    us = await cpu_us_per_call(calls_by_client[name][shape], calls)
                    figures.setdefault(shape, {}).setdefault(name, []).append(us)
    finally:
        for client in clients.values():
            await client.aclose()
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True).stdout != b"PONG\n":
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)
        figures = uvloop.run(run(port, args.reps, args.calls))
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()
    print(f"CPU per call in the caller, µs, {args.reps} repetitions of {args.calls} calls (min / median / max)")
    print(f"{'command':20s} {'redis-py':>22s} {'LeanRedis':>22s}  ratio")
    for shape, by_client in figures.items():
        cells = [by_client[name] for name in ("redis-py", "LeanRedis")]
        text = [f"{min(c):6.1f} / {statistics.median(c):6.1f} / {max(c):6.1f}" for c in cells]
        ratio = statistics.median(cells[1]) / statistics.median(cells[0])
        print(f"{shape:20s} {text[0]:>22s} {text[1]:>22s}  {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
