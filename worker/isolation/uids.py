"""Job uids are the host's: no two workers on one host may run jobs as the same uid.

A job runs as `SANDBOX_UID_BASE + slot` outside its jail. The kernel keeps some quotas per
uid across namespaces (pending signals, POSIX message queue bytes, inotify instances), and
a uid is what host-side tools see. Two workers started with overlapping ranges would have
their jobs share those silently, so each worker holds a lock per uid of its range for its
whole life (an flock on `/run/coderunner-uids/<uid>`, released by the kernel when the
worker exits however it dies) and refuses to start while another process holds one.

Nor may a job uid be a real account's: the job would own that account's files wherever a
jail can reach them, and share its per-uid quotas. A range that names an account or a
group is refused at start.
"""

from __future__ import annotations

import errno
import fcntl
import grp
import os
import pwd
from pathlib import Path

__all__ = ["LOCK_DIR", "UidLease", "UidsInUse", "accounts_in", "try_lock", "uids_held"]

# Host-wide, not under a work root: two workers with different work roots and the same
# uids must still see each other.
LOCK_DIR = Path("/run/coderunner-uids")


class UidsInUse(Exception):
    """Another worker on this host holds some of these uids."""


def try_lock(path: Path) -> int | None:
    """An open descriptor of `path` holding its exclusive flock, or None while another
    process holds it. Close-on-exec: a child (nsjail) must not inherit the lock."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return None
        raise
    return fd


def accounts_in(first: int, count: int) -> list[str]:
    """The host's users and groups whose id falls in `first` .. `first + count - 1`
    (`user NAME (UID)`, `group NAME (GID)`). Looked up one id at a time, through NSS like
    any lookup, so a directory service is asked only about these ids (may block: a thread)."""
    found = []
    for uid in range(first, first + count):
        try:
            found.append(f"user {pwd.getpwuid(uid).pw_name} ({uid})")
        except (KeyError, OverflowError):  # (none, or past what an id can be)
            pass
        try:
            found.append(f"group {grp.getgrgid(uid).gr_name} ({uid})")
        except (KeyError, OverflowError):
            pass
    return found


def uids_held(first: int, count: int, lock_dir: Path = LOCK_DIR) -> dict[int, str]:
    """Which of these uids a running worker holds, and its pid (a look: nothing is taken)."""
    held = {}
    for uid in range(first, first + count):
        try:
            fd = os.open(lock_dir / str(uid), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                held[uid] = _holder(lock_dir / str(uid))
        finally:
            os.close(fd)  # a shared lock taken just now goes with it
    return held


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
            fd = try_lock(path)
            if fd is None:
                holder = _holder(path)
                last = self.first + self.count - 1
                raise UidsInUse(
                    f"job uid {uid} is in use by another worker on this host (pid {holder}); this worker's "
                    f"range is {self.first}-{last} (SANDBOX_UID_BASE {self.first} plus one per slot and one "
                    f"for the self-test): give each worker on a host a SANDBOX_UID_BASE at least {self.count} apart"
                )
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


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"
