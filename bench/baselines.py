"""What our figures are put next to: a Piston at PISTON_URL, or bare nsjail with our profile.

Piston is driven through its public API only (`POST /api/v2/execute`, `GET
/api/v2/runtimes`); nothing of Piston lives in this repository. Bare nsjail runs the same
program with the jobs' sandbox profile (sandbox-profiles/base.cfg) and the bundled nsjail,
a fresh jail per run with its output piped: the floor a fully isolated process has here.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.latency import bare_argv, bare_workspace

__all__ = ["Bare", "Piston", "piston_from_env"]


@dataclass(frozen=True)
class Piston:
    url: str
    version: str = "*"

    def client(self) -> httpx.Client:
        """One keep-alive client per caller thread (never one per request)."""
        return httpx.Client(base_url=self.url, timeout=60)

    def describe(self) -> str:
        """The Python runtime Piston offers, or SystemExit when nothing answers at url."""
        try:
            with self.client() as client:
                runtimes = client.get("/api/v2/runtimes").raise_for_status().json()
        except (httpx.HTTPError, ValueError) as exc:
            raise SystemExit(f"PISTON_URL={self.url}: no Piston answers there ({exc})") from None
        versions = [r.get("version", "?") for r in runtimes if r.get("language") == "python"]
        if not versions:
            raise SystemExit(f"PISTON_URL={self.url}: Piston has no python runtime installed")
        return f"Piston at {self.url} (python {', '.join(versions)})"

    def run(self, client: httpx.Client, program: str, expect: str) -> None:
        """POST /api/v2/execute and check the answer; the response is the result."""
        body: dict[str, Any] = {
            "language": "python",
            "version": self.version,
            "files": [{"name": "main.py", "content": program}],
        }
        response = client.post("/api/v2/execute", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"Piston answered {response.status_code}: {response.text[:200]}")
        run = response.json().get("run") or {}
        if run.get("stdout") != expect or run.get("code") != 0:
            raise RuntimeError(f"Piston run misbehaved: {str(run)[:300]}")


def piston_from_env() -> Piston | None:
    url = os.environ.get("PISTON_URL", "").strip().rstrip("/")
    return Piston(url, os.environ.get("PISTON_PYTHON_VERSION", "*")) if url else None


class Bare:
    """One program under bare nsjail, run as often as asked, from any number of threads."""

    def __init__(self, program: str, expect: str) -> None:
        self.workspace = bare_workspace(program)
        self.argv = bare_argv(self.workspace, sandboxed=True)
        self.expect = expect.encode()

    def run(self, _client: object = None) -> tuple[float, float]:
        """(spawn → first stdout byte, spawn → exit with all output read), in ms."""
        t0 = time.perf_counter()
        proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None
        head = os.read(proc.stdout.fileno(), 65536)
        t1 = time.perf_counter()
        rest, err = proc.communicate()
        t2 = time.perf_counter()
        if head + rest != self.expect:
            raise RuntimeError(f"bare nsjail run misbehaved: exit {proc.returncode}, stdout {(head + rest)[:200]!r}, stderr {err[:300]!r}")
        return (t1 - t0) * 1000, (t2 - t0) * 1000

    def cleanup(self) -> None:
        for child in self.workspace.iterdir():
            child.unlink()
        Path(self.workspace).rmdir()
