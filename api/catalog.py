"""Which languages exist (manifests) and which versions live workers can run.

The API reads the same `sandbox-profiles/languages/*.toml` as the workers, so it can
resolve names and aliases even while no worker is up (a job simply waits in the queue).
Versions are facts only workers know (they probe their toolchains); they advertise them
in Redis and this module reads them with a short cache.
"""

from __future__ import annotations

import time
from pathlib import Path

from api.store import JobStore
from shared.errors import FieldError, ManifestError, ValidationError
from shared.manifest import Manifest, parse_manifest
from shared.messages import LanguageInfo

__all__ = ["Catalog", "load_manifests"]

_CACHE_S = 1.0


def load_manifests(profiles_dir: Path) -> dict[str, Manifest]:
    """Every manifest in `<profiles_dir>/languages`, keyed by language name."""
    manifests: dict[str, Manifest] = {}
    for path in sorted((profiles_dir / "languages").glob("*.toml")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ManifestError(f"{path}: cannot be read as UTF-8 text ({exc})") from None
        manifest = parse_manifest(text, str(path))
        manifests[manifest.language] = manifest
    return manifests


def _version_key(version: str) -> tuple[tuple[int, int | str], ...]:
    parts: list[tuple[int, int | str]] = []
    for piece in version.replace("-", ".").split("."):
        parts.append((1, int(piece)) if piece.isdigit() else (0, piece))
    return tuple(parts)


class Catalog:
    def __init__(self, manifests: dict[str, Manifest], store: JobStore) -> None:
        self._manifests = manifests
        self._by_name = {name: m for m in manifests.values() for name in m.names}
        self._store = store
        self._cached_at = 0.0
        self._live: list[LanguageInfo] = []

    async def live(self) -> list[LanguageInfo]:
        """Runtimes that at least one live worker offers, one entry per language and version."""
        now = time.monotonic()
        if now - self._cached_at > _CACHE_S:
            seen: dict[tuple[str, str], LanguageInfo] = {}
            for worker in await self._store.live_workers():
                for info in worker.runtimes:
                    seen.setdefault((info.language, info.version), info)
            self._live = sorted(seen.values(), key=lambda i: (i.language, _version_key(i.version)))
            self._cached_at = now
        return self._live

    async def resolve(self, language: str, version: str | None) -> tuple[Manifest, str]:
        """The manifest and concrete version for a request's `language`/`version`.

        Raises:
            ValidationError: unknown language, or a version no worker offers (listing what exists).
        """
        manifest = self._by_name.get(language.strip().lower())
        if manifest is None:
            names = ", ".join(sorted(self._manifests))
            raise ValidationError([FieldError("language", f"is unknown: {language!r} (available: {names})")])
        versions = [i.version for i in await self.live() if i.language == manifest.language]
        if not versions:
            # No live worker offers it right now: fall back to what workers advertised before,
            # so a job submitted while workers restart still gets a definite version.
            versions = sorted(
                {i.version for w in await self._store.known_workers() for i in w.runtimes if i.language == manifest.language},
                key=_version_key,
            )
        if version is None or version in ("", "*", "latest"):
            return manifest, versions[-1] if versions else ""
        matches = [v for v in versions if v == version or v.startswith(version + ".")]
        if not matches:
            listed = ", ".join(versions) if versions else "none is available right now"
            raise ValidationError(
                [FieldError("version", f"{version!r} is not available for {manifest.language} (available: {listed})")]
            )
        return manifest, max(matches, key=_version_key)
