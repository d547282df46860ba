"""`coderunner up | api | worker`.

`up` runs the whole stack on this machine: a private redis-server and soketi on free
ports, the API, and one worker (`--workers N`: N of them); Ctrl-C, SIGTERM or a hangup
(the terminal closing) stops every child (whole process groups), so nothing is left behind. A worker that dies is restarted
with backoff and said so (launcher/supervisor.py), and so are soketi and the API, on
their ports; Redis dying stops the stack (it keeps no data across a restart here). Its logs go to `.coderunner/logs/<UTC time>/` of this
checkout (or `CODERUNNER_LOG_ROOT`), and outlive the stack: the last `KEEP_LOG_RUNS` runs
are kept.

`node` runs the Node.js (>= 20) this checkout uses (see launcher/node.py) with the
arguments, e.g. `coderunner node clients/js/run-job.mjs ...`.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from shared.paths import REPO_ROOT

if TYPE_CHECKING:
    from launcher.stack import Stack

__all__ = ["KEEP_LOG_RUNS", "main", "new_log_dir", "port_in_use"]

KEEP_LOG_RUNS = 10
_RUN_NAME = re.compile(r"^\d{8}T\d{6}Z(-\d+)?$")


def port_in_use(host: str, port: int) -> str | None:
    """Why `host:port` cannot be bound for listening (None: it can).

    Binds the way uvicorn does (SO_REUSEADDR, so a closed socket in TIME_WAIT does not
    count) and closes again at once.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host}: {exc}"
    for family, kind, proto, _name, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return "in use"
                return exc.strerror or str(exc)
    return None


def new_log_dir(root: Path, keep: int = KEEP_LOG_RUNS) -> Path:
    """A fresh `<root>/<UTC time>/` for one run's logs; only the newest `keep` runs stay.

    `<root>/latest` points at the new one.
    """
    root.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")

    def order(name: str) -> tuple[str, int]:
        return name[:16], int(name[17:] or 1)

    def runs() -> list[Path]:
        found = (p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and _RUN_NAME.match(p.name))
        return sorted(found, key=lambda p: order(p.name))

    # Runs in the same second get -2, -3 ... after the newest of that second, so a new run
    # never takes the name of one that was pruned and never sorts before an older one.
    n = max([order(p.name)[1] for p in runs() if p.name[:16] == stamp], default=0) + 1
    while True:
        run = root / (stamp if n == 1 else f"{stamp}-{n}")
        try:
            run.mkdir()
            break
        except FileExistsError:
            n += 1
    all_runs = runs()
    for old in all_runs[: max(0, len(all_runs) - keep)]:
        if old != run:
            shutil.rmtree(old, ignore_errors=True)
    latest = root / "latest"
    try:
        if latest.is_symlink() or not latest.exists():
            tmp = root / f".latest-{os.getpid()}"
            tmp.unlink(missing_ok=True)
            tmp.symlink_to(run.name)
            tmp.replace(latest)
    except OSError:
        pass
    return run


def banner(stack: Stack, env: Mapping[str, str]) -> str:
    """What `up` prints once the stack serves. The secrets it made up are shown (they are
    how to reach it); those the operator gave it in the environment are not: they may be
    real ones, and this lands in terminal scrollback, journald and CI logs."""
    if env.get("EXECUTOR_API_TOKEN"):
        playground = f"{stack.api_url}/#token=<your EXECUTOR_API_TOKEN>"
        token = "yours, from EXECUTOR_API_TOKEN"
    else:
        playground, token = f"{stack.api_url}/#token={stack.api_token}", stack.api_token
    secret = "your CALLBACK_SECRET" if env.get("CALLBACK_SECRET") else f"CALLBACK_SECRET={stack.callback_secret}"
    return (
        f"\n  API         {stack.api_url}\n"
        f"  Playground  {playground}\n"
        f"  API token   {token}\n"
        f"  Callbacks   signed with {secret}\n"
        f"  soketi      ws://127.0.0.1:{stack.soketi_port} (key {stack.pusher_key})\n"
        f"  Workers     {_workers_line(stack)}\n"
        f"  Logs        {stack.log_dir}\n\n"
        "  Ctrl-C stops everything (running jobs get the worker's grace; Ctrl-C again ends them at once).\n"
    )


def _up(argv: list[str]) -> int:
    from launcher.stack import MAX_WORKERS, Stack, StackError
    from shared.settings import parse_port

    parser = argparse.ArgumentParser(prog="coderunner up", description="Run Redis, soketi, the API and workers.")
    try:
        default_port = parse_port(os.environ.get("API_PORT") or "8000")
    except ValueError as exc:
        print(f"coderunner up: API_PORT={os.environ['API_PORT']!r} is invalid: {exc}", file=sys.stderr)
        return 2
    parser.add_argument("--port", type=parse_port, default=default_port, help="API port (default API_PORT or 8000)")
    parser.add_argument("--host", default=os.environ.get("API_HOST", "127.0.0.1"), help="API bind address")
    parser.add_argument(
        "--workers", type=int, default=1, metavar="N",
        help=f"how many workers (1 to {MAX_WORKERS}; default 1); one that dies is restarted",
    )  # fmt: skip
    parser.add_argument("--no-worker", action="store_true", help="start everything but the workers")
    args = parser.parse_args(argv)
    if not 1 <= args.workers <= MAX_WORKERS:
        parser.error(f"--workers must be between 1 and {MAX_WORKERS}")

    # Before anything starts or is printed: a second `make up` must not get as far as a
    # banner and a token for a stack that cannot serve.
    busy = port_in_use(args.host, args.port)
    if busy is not None:
        where = f"{args.host}:{args.port}"
        why = f"{where} is already in use (another `make up`?)" if busy == "in use" else f"cannot listen on {where}: {busy}"
        print(
            f"coderunner up: {why}; nothing was started.\n"
            f"  Pick another port: make up PORT=9000   (or: coderunner up --port 9000)",
            file=sys.stderr,
        )
        return 1

    log_root = Path(os.environ.get("CODERUNNER_LOG_ROOT") or REPO_ROOT / ".coderunner" / "logs")
    log_dir = new_log_dir(log_root)
    workers = 0 if args.no_worker else args.workers

    def on_event(message: str) -> None:
        _say(f"coderunner up: {message}")

    stack = Stack(
        api_port=args.port,
        api_host=args.host,
        with_worker=workers > 0,
        workers=workers,
        supervise=True,
        supervise_services=True,
        on_event=on_event,
        log_dir=log_dir,
    )
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        if stopping and signum == signal.SIGINT:
            # Ctrl-C again while stopping: the workers end their running jobs now.
            stack.hurry_workers()
        stopping = True

    # SIGHUP is the terminal closing: the children sit in sessions of their own, so only
    # `up` hears it, and dying of it would leave the whole stack running.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    what = {0: "and the API", 1: "API and worker"}.get(workers, f"API and {workers} workers")
    _say(f"coderunner: starting redis-server, soketi, {what}...")
    try:
        stack.start()
    except StackError as exc:
        _say(f"coderunner up: {exc}", sys.stderr)
        for name in ("redis", "soketi", "api", *stack.worker_names()):
            tail = stack.log(name).strip().splitlines()[-15:]
            if tail:
                _say(f"--- {name} log ---\n" + "\n".join(tail), sys.stderr)
        stack.cleanup()
        _say(f"coderunner up: logs kept in {log_dir}", sys.stderr)
        return 1
    status = 0
    if stopping:
        # Ctrl-C (or a hangup) came while the stack started: stop it, and print no banner
        # (nor the token) for a stack that is going away.
        _say("coderunner: interrupted during start-up; stopping...")
        stack.cleanup()
        _say(f"coderunner: stopped; logs kept in {log_dir}")
        return 130
    try:
        _say(banner(stack, os.environ))
        while not stopping:
            dead = stack.dead_children()
            if dead:
                _say(f"coderunner up: {', '.join(dead)} exited unexpectedly; stopping", sys.stderr)
                for name in dead:
                    _say(f"--- {name} log ---\n" + "\n".join(stack.log(name).splitlines()[-20:]), sys.stderr)
                status = 1
                break
            time.sleep(0.2)
        _say("coderunner: stopping...")
    finally:
        stack.cleanup()
    _say(f"coderunner: stopped; logs kept in {log_dir}")
    return status


def _say(line: str, stream: TextIO | None = None) -> None:
    """Print a line; once the terminal is gone (a hangup), the stack goes on (or stops)
    silently rather than dying of a failed write with its children still running."""
    try:
        print(line, file=stream or sys.stdout, flush=True)
    except OSError:
        pass


def _workers_line(stack: Stack) -> str:
    names = stack.worker_names()
    if not names:
        return "none (--no-worker)"
    ids = ", ".join(stack.worker_ids[name] for name in names)
    return f"{len(names)} ({ids}); one that dies is restarted"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("up", "api", "worker", "node")
    if not argv or argv[0] not in commands:
        print("usage: coderunner {up,api,worker,node} [options]\n"
              "  up      run the whole stack (redis-server, soketi, API, workers) on this machine\n"
              "  api     serve the HTTP API (production: behind a load balancer)\n"
              "  worker  claim and run jobs under nsjail (production: on every execution host)\n"
              "  node    run the Node.js 20 this checkout uses, e.g. node clients/js/run-job.mjs ...",
              file=sys.stderr)  # fmt: skip
        return 2
    command, rest = argv[0], argv[1:]
    if command == "up":
        return _up(rest)
    if command == "node":
        from launcher.node import main as node_main

        return node_main(rest)
    if command == "api":
        from api.__main__ import main as api_main

        return api_main(rest)
    from worker.__main__ import main as worker_main

    return worker_main(rest)


if __name__ == "__main__":
    sys.exit(main())
