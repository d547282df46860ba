"""Where the repository's data folders are when settings do not say otherwise."""

from __future__ import annotations

from pathlib import Path

from shared.settings import Settings

__all__ = ["LOCAL_NSJAIL", "REPO_ROOT", "profiles_dir"]

REPO_ROOT = Path(__file__).resolve().parent.parent
# Where scripts/build-nsjail.sh (run by `make`) puts the nsjail it builds.
LOCAL_NSJAIL = REPO_ROOT / ".tools" / "nsjail" / "bin" / "nsjail"


def profiles_dir(settings: Settings) -> Path:
    return Path(settings.sandbox_profiles_dir) if settings.sandbox_profiles_dir else REPO_ROOT / "sandbox-profiles"
