"""What a worker builds at start-up, kept for the next deployment on the same host.

A worker compiles its C helpers (the jail gate, the cgroup entry helper) and the shims of
the languages it prestarts (Java's with javac) once per work root: about a second of CPU,
most of a worker's start. Each deployment has a work root of its own under /run, so every
new deployment on a host, and every deployment after a reboot, paid it again. The outputs
are named by a digest of everything that went into them (source, flags, command, the
compiler or toolchain and its version), so one made for another deployment is the same file: the cache
(SANDBOX_BUILD_CACHE) keeps a copy of each under that name, and a worker copies it into
its work root instead of building it again.

The gate runs inside every jail and the entry helper as root on the host, so a cached file
is used only if this process could have written it itself and nobody else could have: the
cache folder and the file must be owned by this process's user and writable by nobody
else, and the file must be a plain file (not a link). Anything else is not used (and said
once in the log); the worker then builds as before.

Each use renews a file's time; a worker's start removes what no worker has used for
UNUSED_FOR_S (builds of sources, compilers and toolchains long replaced) and temporary
files a crash left.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

__all__ = ["NO_CACHE", "BuildCache"]

log = logging.getLogger(__name__)

# A cached build nobody has fetched or kept for this long is removed at a worker's start.
UNUSED_FOR_S = 30 * 86400
# A temporary file this old is a crash's leftover (a keep takes well under a second).
LEFTOVER_AFTER_S = 3600


class BuildCache:
    """A folder of built files, each under a name that says what it was built from."""

    def __init__(self, folder: Path | None) -> None:
        self.folder = folder
        self._usable: bool | None = None

    def fetch(self, name: str, dest: Path, mode: int) -> bool:
        """Copy the cached `name` to `dest` (whole or not at all) with `mode`; False if the
        cache has no usable copy of it."""
        fd = self._open_trusted(name)
        if fd is None:
            return False
        tmp: str | None = None
        try:
            out_fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
            with open(fd, "rb", closefd=False) as src, open(out_fd, "wb") as out:
                shutil.copyfileobj(src, out)
            os.chmod(tmp, mode)
            os.replace(tmp, dest)
            tmp = None
            return True
        except OSError as exc:  # (a full or failing disk: built instead)
            log.warning("build cache: %s could not be copied out (%s)", name, exc)
            return False
        finally:
            os.close(fd)
            _discard(tmp)

    def read(self, name: str) -> bytes | None:
        """The cached `name`'s bytes (a small file), or None if the cache has no usable copy."""
        fd = self._open_trusted(name)
        if fd is None:
            return None
        try:
            with open(fd, "rb", closefd=False) as src:
                return src.read()
        except OSError as exc:
            log.warning("build cache: %s could not be read (%s)", name, exc)
            return None
        finally:
            os.close(fd)

    def _open_trusted(self, name: str) -> int | None:
        """A descriptor of the cached `name` if it is a plain file only this user could
        have written (see the module docstring), else None."""
        if not self._ready():
            return None
        assert self.folder is not None
        source = self.folder / name
        try:
            fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:  # a link (ELOOP), or unreadable
            log.warning("build cache: %s is not used (%s)", source, exc)
            return None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or not _owned_by_me_alone(info):
            os.close(fd)
            log.warning("build cache: %s is not used (not a plain file that only this user could have written)", source)
            return None
        try:
            os.utime(fd)  # (in use: kept by prune)
        except OSError:
            pass  # a read-only cache: nothing is pruned there either
        return fd

    def keep(self, name: str, built: Path | bytes) -> None:
        """Keep a copy of `built` (a file, or its bytes) as `name` (best effort: a cache
        that cannot take it costs the next deployment a build, nothing more)."""
        if not self._ready():
            return
        assert self.folder is not None
        tmp: str | None = None
        try:
            # A name of its own (workers of other pid namespaces may keep the same file at
            # once), synced before the rename: a crash never leaves a cut-off file under
            # the final name, which nothing would ever build again.
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=f".{name}.")
            with open(fd, "wb") as out:
                if isinstance(built, bytes):
                    out.write(built)
                else:
                    with open(built, "rb") as src:
                        shutil.copyfileobj(src, out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, self.folder / name)
            tmp = None
            _sync_folder(self.folder)
        except OSError as exc:  # (read-only, full: the next deployment builds it again)
            log.warning("build cache: could not keep %s (%s)", name, exc)
        finally:
            _discard(tmp)

    def prune(self, unused_for_s: float = UNUSED_FOR_S, leftover_after_s: float = LEFTOVER_AFTER_S) -> list[str]:
        """Remove the builds nobody used for `unused_for_s` and temporary files older than
        `leftover_after_s`; returns their names."""
        if not self._ready():
            return []
        assert self.folder is not None
        now = time.time()
        removed: list[str] = []
        try:
            entries = list(os.scandir(self.folder))
        except OSError:
            return []
        for entry in entries:
            try:
                info = entry.stat(follow_symlinks=False)
                age = now - info.st_mtime
                if age > (leftover_after_s if entry.name.startswith(".") else unused_for_s):
                    os.unlink(entry.path)
                    removed.append(entry.name)
            except OSError:
                continue  # (gone meanwhile, or a read-only cache)
        return removed

    def _ready(self) -> bool:
        """Whether the folder exists (made if need be) and only this user can write to it."""
        if self._usable is None:
            self._usable = self._check()
        return self._usable

    def _check(self) -> bool:
        if self.folder is None:
            return False
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = os.lstat(self.folder)
        except OSError as exc:
            log.warning("build cache %s is not used: %s", self.folder, exc)
            return False
        if not stat.S_ISDIR(info.st_mode) or not _owned_by_me_alone(info):
            log.warning(
                "build cache %s is not used: it must be a folder owned by this user and writable by nobody else",
                self.folder,
            )
            return False
        return True


def _owned_by_me_alone(info: os.stat_result) -> bool:
    return info.st_uid == os.geteuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _discard(tmp: str | None) -> None:
    if tmp is not None:
        try:
            os.unlink(tmp)
        except OSError:
            pass  # (read-only: nothing was made there either)


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# No cache: every build is made (the helpers' own tests, SANDBOX_BUILD_CACHE empty).
NO_CACHE = BuildCache(None)
