"""Which languages this worker can run: manifests from sandbox-profiles/, versions probed.

A language whose toolchain is missing (probe not found, fails, or prints no version) is
simply not offered by this worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from shared.manifest import Manifest, parse_manifest, with_home
from shared.messages import LanguageInfo

__all__ = ["Runtime", "discover_runtimes", "load_manifests"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    manifest: Manifest
    version: str

    def info(self) -> LanguageInfo:
        m = self.manifest
        return LanguageInfo(
            language=m.language, version=self.version, aliases=list(m.aliases), interactive=m.interactive, compiled=m.compiled
        )


def load_manifests(profiles_dir: Path) -> list[Manifest]:
    return [
        parse_manifest(path.read_text(encoding="utf-8"), str(path))
        for path in sorted((profiles_dir / "languages").glob("*.toml"))
    ]


async def _run_probe(argv: list[str], path: list[str], timeout_s: float) -> tuple[int | None, str]:
    env = {"PATH": ":".join([*path, "/usr/local/bin", "/usr/bin", "/bin"]), "LANG": "C.UTF-8", "HOME": os.environ.get("HOME", "/root")}
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
        )
    except OSError as exc:
        return None, str(exc)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None, "timed out"
    return proc.returncode, out.decode(errors="replace")


async def _probe(manifest: Manifest, timeout_s: float) -> Runtime | None:
    """The runtime a manifest describes on this host, or None (with a log line saying why)."""
    if manifest.home_probe:
        code, out = await _run_probe(manifest.home_probe, manifest.probe_path, timeout_s)
        home = out.strip().splitlines()[-1] if code == 0 and out.strip() else ""
        if not home.startswith("/"):
            log.info("language %s not offered: home probe failed: %s", manifest.language, out.strip()[:200])
            return None
        manifest = with_home(manifest, home)
    code, out = await _run_probe(manifest.version_probe, manifest.probe_path, timeout_s)
    match = re.search(manifest.version_pattern, out) if code == 0 else None
    if match is None:
        log.info("language %s not offered: version probe %s gave %s: %r", manifest.language, manifest.version_probe[0], code, out[:200])
        return None
    # A folder its manifest binds into every jail must be there (Java's /etc/java-17-openjdk
    # on a host whose JDK is another): binding it would fail the worker's start for every
    # language, where a missing toolchain only means this one is not offered.
    for entry in manifest.mounts:
        source = entry.partition(":")[0]
        if not await asyncio.to_thread(os.path.isdir, source):
            log.info("language %s not offered: %s, which its manifest mounts, is not a folder here", manifest.language, source)
            return None
    return Runtime(manifest, match.group(1))


async def discover_runtimes(manifests: list[Manifest], timeout_s: float = 20.0) -> dict[str, Runtime]:
    """Probe every manifest's toolchain concurrently; returns language -> Runtime."""
    runtimes = await asyncio.gather(*(_probe(m, timeout_s) for m in manifests))
    return {r.manifest.language: r for r in runtimes if r is not None}
