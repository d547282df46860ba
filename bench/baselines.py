"""What our figures are put next to: a Piston at PISTON_URL, or bare nsjail with our profile.

Piston is driven through its public API only (`POST /api/v2/execute`, `GET
/api/v2/runtimes`); nothing of Piston lives in this repository. Bare nsjail runs the same
program with the jobs' sandbox profile (sandbox-profiles/base.cfg) and the same nsjail binary
as our workers, a fresh jail per run with its output piped: the floor a fully isolated
process has here.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.keepalive import HttpError, KeepAliveHttp
from bench.latency import bare_argv, bare_workspace

__all__ = ["Bare", "Piston", "piston_from_env"]


@dataclass(frozen=True)
class Piston:
    url: str
    version: str = "*"
    language: str = "python"

    def client(self) -> KeepAliveHttp:
        """One kept-open connection per caller thread (never one per request): the same lean
        client our side's load generators use."""
        return KeepAliveHttp(self.url, timeout_s=60)

    def describe(self) -> str:
        """The runtime Piston offers for `language`, or SystemExit when nothing answers at
        url or it has none."""
        try:
            with self.client() as client:
                runtimes = client.get("/api/v2/runtimes").raise_for_status().json()
        except (HttpError, ValueError) as exc:
            raise SystemExit(f"PISTON_URL={self.url}: no Piston answers there ({exc})") from None
        versions = [
            r.get("version", "?")
            for r in runtimes
            if r.get("language") == self.language or self.language in r.get("aliases", [])
        ]
        if not versions:
            raise SystemExit(f"PISTON_URL={self.url}: Piston has no {self.language} runtime installed")
        return f"Piston at {self.url} ({self.language} {', '.join(versions)}; asking for {self.version!r})"

    def execute(self, client: KeepAliveHttp, name: str, source: str, stdin: str = "") -> dict[str, Any]:
        """POST /api/v2/execute; the answer (its `compile` and `run` parts) is the result."""
        body: dict[str, Any] = {
            "language": self.language,
            "version": self.version,
            "files": [{"name": name, "content": source}],
            "stdin": stdin,
        }
        response = client.post("/api/v2/execute", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"Piston answered {response.status_code}: {response.text[:300]}")
        return response.json()  # type: ignore[no-any-return]

    def run(self, client: KeepAliveHttp, program: str, expect: str) -> None:
        """A Python program, its stdout checked."""
        run = self.execute(client, "main.py", program).get("run") or {}
        if run.get("stdout") != expect or run.get("code") != 0:
            raise RuntimeError(f"Piston run misbehaved: {str(run)[:300]}")


def piston_from_env(language: str = "python", version_env: str = "PISTON_PYTHON_VERSION") -> Piston | None:
    url = os.environ.get("PISTON_URL", "").strip().rstrip("/")
    if url and not url.startswith("http://"):
        raise SystemExit(f"PISTON_URL={url}: give an http:// URL (the benchmarks' client speaks plain HTTP)")
    return Piston(url, os.environ.get(version_env, "*"), language) if url else None


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
