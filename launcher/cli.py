"""`coderunner up | api | worker`.

`up` runs the whole stack on this machine: a private redis-server and soketi on free
ports, the API, and one worker; Ctrl-C or SIGTERM stops every child (whole process
groups), so nothing is left behind.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

__all__ = ["main"]


def _up(argv: list[str]) -> int:
    from launcher.stack import Stack, StackError

    parser = argparse.ArgumentParser(prog="coderunner up", description="Run Redis, soketi, the API and a worker.")
    parser.add_argument("--port", type=int, default=int(os.environ.get("API_PORT", "8000")), help="API port (default 8000)")
    parser.add_argument("--host", default=os.environ.get("API_HOST", "127.0.0.1"), help="API bind address")
    parser.add_argument("--no-worker", action="store_true", help="start everything but the worker")
    args = parser.parse_args(argv)

    stack = Stack(api_port=args.port, api_host=args.host, with_worker=not args.no_worker)
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print("coderunner: starting redis-server, soketi, API and worker...", flush=True)
    try:
        stack.start()
    except StackError as exc:
        print(f"coderunner up: {exc}", file=sys.stderr)
        for name in ("redis", "soketi", "api", "worker"):
            tail = stack.log(name).strip().splitlines()[-15:]
            if tail:
                print(f"--- {name} log ---\n" + "\n".join(tail), file=sys.stderr)
        stack.cleanup()
        return 1
    print(
        f"\n  API         {stack.api_url}\n"
        f"  Playground  {stack.api_url}/#token={stack.api_token}\n"
        f"  API token   {stack.api_token}\n"
        f"  soketi      ws://127.0.0.1:{stack.soketi_port} (key {stack.pusher_key})\n"
        f"  Logs        {stack.log_dir}\n\n"
        "  Ctrl-C stops everything.\n",
        flush=True,
    )
    status = 0
    while not stopping:
        dead = stack.dead_children()
        if dead:
            print(f"coderunner up: {', '.join(dead)} exited unexpectedly; stopping", file=sys.stderr)
            for name in dead:
                print(f"--- {name} log ---\n" + "\n".join(stack.log(name).splitlines()[-20:]), file=sys.stderr)
            status = 1
            break
        time.sleep(0.2)
    print("coderunner: stopping...", flush=True)
    stack.cleanup()
    return status


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("up", "api", "worker")
    if not argv or argv[0] not in commands:
        print("usage: coderunner {up,api,worker} [options]\n"
              "  up      run the whole stack (redis-server, soketi, API, worker) on this machine\n"
              "  api     serve the HTTP API (production: behind a load balancer)\n"
              "  worker  claim and run jobs under nsjail (production: on every execution host)",
              file=sys.stderr)  # fmt: skip
        return 2
    command, rest = argv[0], argv[1:]
    if command == "up":
        return _up(rest)
    if command == "api":
        from api.__main__ import main as api_main

        return api_main(rest)
    from worker.__main__ import main as worker_main

    return worker_main(rest)


if __name__ == "__main__":
    sys.exit(main())
