"""Which languages this worker can run: manifests from sandbox-profiles/, versions probed.

A language whose toolchain is missing (probe not found, fails, or prints no version) is
simply not offered by this worker.
"""

from __future__ import annotations

import asyncio
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from shared.manifest import Manifest, parse_manifest
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


async def _probe(manifest: Manifest, timeout_s: float) -> str | None:
    try:
        proc = await asyncio.create_subprocess_exec(
            *manifest.version_probe,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env={"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
        )
    except OSError as exc:
        log.info("language %s not offered: %s", manifest.language, exc)
        return None
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        log.warning("language %s not offered: version probe timed out", manifest.language)
        return None
    match = re.search(manifest.version_pattern, out.decode(errors="replace"))
    if proc.returncode != 0 or not match:
        log.warning("language %s not offered: probe exited %s: %r", manifest.language, proc.returncode, out[:200])
        return None
    return match.group(1)


async def discover_runtimes(manifests: list[Manifest], timeout_s: float = 20.0) -> dict[str, Runtime]:
    """Probe every manifest's toolchain concurrently; returns language -> Runtime."""
    versions = await asyncio.gather(*(_probe(m, timeout_s) for m in manifests))
    return {m.language: Runtime(m, v) for m, v in zip(manifests, versions, strict=False) if v is not None}
