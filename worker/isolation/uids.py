"""Job uids are the host's: no two workers on one host may run jobs as the same uid.

A job runs as `SANDBOX_UID_BASE + slot` outside its jail. The kernel keeps some quotas per
uid across namespaces (pending signals, POSIX message queue bytes, inotify instances), and
a uid is what host-side tools see. Two workers started with overlapping ranges would have
their jobs share those silently, so each worker holds a lock per uid of its range for its
whole life (an flock on `/run/coderunner-uids/<uid>`, released by the kernel when the
worker exits however it dies) and refuses to start while another process holds one.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

__all__ = ["LOCK_DIR", "UidLease", "UidsInUse"]

# Host-wide, not under a work root: two workers with different work roots and the same
# uids must still see each other.
LOCK_DIR = Path("/run/coderunner-uids")


class UidsInUse(Exception):
    """Another worker on this host holds some of these uids."""


class UidLease:
    """The uids `first` .. `first + count - 1`, held until `close()` or the process ends."""

    def __init__(self, first: int, count: int, lock_dir: Path = LOCK_DIR) -> None:
        self.first = first
        self.count = count
        self._held: list[tuple[Path, int]] = []
        lock_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        try:
            for uid in range(first, first + count):
                self._take(lock_dir / str(uid), uid)
        except BaseException:
            self.close()
            raise

    def _take(self, path: Path, uid: int) -> None:
        while True:
            # Close-on-exec: a jail's nsjail must not inherit the lock, or outlive the worker with it.
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                    os.close(fd)
                    raise
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                last = self.first + self.count - 1
                raise UidsInUse(
                    f"job uid {uid} is in use by another worker on this host (pid {holder}); this worker's "
                    f"range is {self.first}-{last} (SANDBOX_UID_BASE {self.first} plus one per slot and one "
                    f"for the self-test): give each worker on a host a SANDBOX_UID_BASE at least {self.count} apart"
                ) from None
            # A holder removes its file on close (under the lock); a lock taken on a file
            # already removed holds nothing, so take the one now at that path instead.
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        self._held.append((path, fd))
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)

    def close(self) -> None:
        """Release the uids, removing their files (a worker that dies leaves them: the next
        worker on those uids takes them over)."""
        for path, fd in self._held:
            try:
                path.unlink()  # still locked: nobody can hold this file now
            except OSError:
                pass
            os.close(fd)  # releases its lock
        self._held.clear()
