"""Make read-only toolchain mounts reachable from inside a jail.

nsjail performs its bind mounts from inside the new user namespace, as the jail's
unprivileged identity, so a toolchain under a folder others cannot traverse (rustup's
`/root/.rustup`, `/root` being 0700) cannot be bound directly. For such a source the
worker first binds it, read-only, under its own work root (a path the jail can reach)
and hands nsjail that path instead; the jail still sees the toolchain at its original
location. No host permission is changed.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
from pathlib import Path

from worker.isolation.mounts import MS_BIND, MS_NODEV, MS_NOSUID, MS_RDONLY, MS_REC, MS_REMOUNT, MountError, mount

__all__ = ["ToolchainError", "bind_sources", "check_no_writable_submounts", "expose_mounts"]

log = logging.getLogger(__name__)

class ToolchainError(Exception):
    """A toolchain folder could not be made visible to jails."""


def _reachable_by_others(path: Path) -> bool:
    """True when every folder on the way to `path` can be traversed by any user."""
    current = Path("/")
    for part in path.parts[1:]:
        current = current / part
        try:
            mode = current.stat().st_mode
        except OSError:
            return False
        if stat.S_ISDIR(mode) and not mode & stat.S_IXOTH:
            return False
    return True


def expose_mounts(mounts: list[str], work_root: Path, mounts_text: str) -> list[str]:
    """Rewrite manifest mount entries (`path` or `src:dst`) so nsjail can bind every one."""
    mounted = {line.split()[1] for line in mounts_text.splitlines() if len(line.split()) > 1}
    out: list[str] = []
    for entry in mounts:
        source, _, target = entry.partition(":")
        target = target or source
        if _reachable_by_others(Path(source)):
            out.append(f"{source}:{target}")
            continue
        staging = work_root / ".toolchains" / hashlib.sha256(source.encode()).hexdigest()[:16]
        if str(staging) not in mounted:
            staging.mkdir(parents=True, exist_ok=True)
            os.chmod(staging.parent, 0o711)
            try:
                mount(source, str(staging), None, MS_BIND | MS_REC)
                mount("none", str(staging), None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
            except MountError as exc:
                raise ToolchainError(str(exc)) from None
            log.info("toolchain %s is bound read-only at %s for the jails", source, staging)
        out.append(f"{staging}:{target}")
    return out


_BIND = re.compile(r'mount\s*\{\s*src:\s*"([^"]+)"[^}]*\bis_bind:\s*true')


def bind_sources(profile_text: str, mounts: list[str]) -> list[str]:
    """The host folders jails bind: the profile's binds and the manifests' mounts."""
    found = [m[1] for m in _BIND.finditer(profile_text)] + [entry.partition(":")[0] for entry in mounts]
    return sorted({path for path in found if os.path.isdir(path)})


def _unescape(field: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)


def check_no_writable_submounts(sources: list[str], mountinfo_text: str) -> None:
    """Refuse a host where something is mounted read-write beneath a folder jails bind.

    nsjail binds a folder with everything mounted beneath it, and makes only the folder's
    own mount read-only: a read-write mount under /usr (or a toolchain's folder) would be
    writable from inside every jail, a channel between jobs and a way to change the host.

    Raises:
        ToolchainError: naming the mount and the folder it is under.
    """
    roots = {os.path.realpath(source): source for source in sources}
    for line in mountinfo_text.splitlines():
        fields = line.split()
        if len(fields) < 6:
            continue
        point, options = _unescape(fields[4]), fields[5].split(",")
        if "rw" not in options:
            continue
        for real, source in roots.items():
            if point != real and point.startswith(real.rstrip("/") + "/"):
                raise ToolchainError(
                    f"{point} is mounted read-write beneath {source}, which every jail binds read-only: "
                    "it would be writable from inside the jails; mount it read-only, or elsewhere"
                )
