"""Per-job workspace: a size- and inode-capped tmpfs the worker mounts, fills, then discards.

Every file is written before any untrusted step runs (compilers included), through
descriptors opened with O_NOFOLLOW relative to the workspace's own descriptor, and owned
by the job's uid from the moment it exists. (A test case's copy of a big compiled program
is written by a copier, as the job's uid, in a cgroup of its own: `Workspace.unpack`.)
After launch the worker only unmounts the tmpfs (a detach needs no walk of a tree the job
could have booby-trapped) and reads files through no-follow descriptors (defence R1).
Mounting, staging and unmounting take kernel locks, so the sandbox calls these methods on
the isolation threads (offload.py).
"""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import shutil
import stat
import subprocess
import tarfile
import threading
from pathlib import Path

from worker.isolation.mounts import MS_NODEV, MS_NOSUID, MountError, detach, mount

__all__ = [
    "PACKED_FROM_BYTES", "Packed", "SnapshotTooBig", "Unpacking", "Workspace", "WorkspaceError", "detach_workspace",
    "missing_copier_tools", "pack", "pack_if_big", "tmpfs_charge",
]  # fmt: skip

log = logging.getLogger(__name__)

# How deep the folders a compile left may nest for a test batch to copy them (a Java
# package of 1,500 components fits the workspace's inodes; 64 is far past any real one).
MAX_SNAPSHOT_DEPTH = 64


# From this much (tmpfs_charge) on, what a compile left is copied into each test case by a
# copier in a memory cgroup of its own under the ceiling all jobs share (Workspace.unpack),
# and the case's memory admission holds it. Below it the worker writes the files itself:
# their pages are charged to the worker, at most this much for each case running. The
# copier's three execs cost about 5 ms a case more than the worker's own write (2 MiB: 5.9
# against 0.9 ms; 8 MiB: 10.3 against 3.4), so everyday programs (Go's 2 MB, Rust's 4 MB)
# stay below it, and the copier is for the big ones, up to the workspace's 64 MiB.
PACKED_FROM_BYTES = 8 << 20
# What a tmpfs file or folder costs in memory past its pages (its inode and dentry).
_INODE_BYTES = 1024
_PAGE_BYTES = 4096
# Longer paths cannot be opened whole (PATH_MAX), as the copier opens them.
MAX_SNAPSHOT_PATH_BYTES = 4095
# How long a copier may take (64 MiB copies in well under a second).
UNPACK_TIMEOUT_S = 20.0
# The copier joins its cgroups as root, then becomes the job's uid and gid (no other group)
# and extracts: a process that is the job's uid is never moved into a cgroup from outside.
_COPIER = (
    'uid=$1 gid=$2 into=$3; shift 3; for procs; do echo $$ > "$procs" || exit 125; done; '
    'exec setpriv --reuid="$uid" --regid="$gid" --clear-groups -- '
    # -p: the archive's modes as they are; -m: modified now, as a staged file is; -k: a
    # file already there is an error, as staging's O_EXCL makes it.
    'tar -x -p -m -k --no-same-owner -f - -C "$into"'
)
_COPIER_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"
# The host tools the copier needs, and the Debian package of each.
COPIER_TOOLS = {"tar": "tar", "setpriv": "util-linux (or setpriv)"}


def missing_copier_tools() -> list[str]:
    """The copier's tools this host lacks, each with its package."""
    return [f"{tool} ({package})" for tool, package in COPIER_TOOLS.items() if shutil.which(tool, path=_COPIER_PATH) is None]


def tmpfs_charge(files: list[tuple[str, bytes]]) -> int:
    """What `files` take of a tmpfs's memory: whole pages, and an inode for each file and
    folder."""
    folders = {"/".join(parts[:depth]) for name, _ in files for parts in [name.split("/")] for depth in range(1, len(parts))}
    pages = sum(-(-len(data) // _PAGE_BYTES) * _PAGE_BYTES for _, data in files)
    return pages + (len(files) + len(folders)) * _INODE_BYTES


@dataclasses.dataclass(frozen=True, slots=True)
class Packed:
    """What a compile left, packed once for every test case's copy (a tar archive)."""

    archive: bytes
    # What the unpacked files take of a tmpfs (tmpfs_charge): the copy's cgroup holds it.
    charge_bytes: int


def pack_if_big(files: list[tuple[str, bytes]], executable: frozenset[str]) -> Packed | None:
    """`files` packed when they take PACKED_FROM_BYTES or more of a tmpfs; else None (the
    worker writes them into each case itself)."""
    charge = tmpfs_charge(files)
    return _pack(files, executable, charge) if charge >= PACKED_FROM_BYTES else None


def pack(files: list[tuple[str, bytes]], executable: frozenset[str]) -> Packed:
    """`files` (as `Workspace.snapshot` read them) as a tar of regular files only."""
    return _pack(files, executable, tmpfs_charge(files))


def _pack(files: list[tuple[str, bytes]], executable: frozenset[str], charge_bytes: int) -> Packed:
    buffer = io.BytesIO()
    # (Names as the listing gave them, undecodable bytes included: GNU tar keeps them.)
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT, encoding="utf-8", errors="surrogateescape") as tar:
        for name, data in files:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mode = 0o755 if name in executable else 0o644
            tar.addfile(info, io.BytesIO(data))
    return Packed(archive=buffer.getvalue(), charge_bytes=charge_bytes)


class Unpacking:
    """A copy under way, which another thread may stop (the worker stopping): its copier
    is killed, and one not started yet is never started."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._copier: subprocess.Popen[bytes] | None = None
        self.stopped = False

    def began(self, copier: subprocess.Popen[bytes]) -> bool:
        """Note the copier; False (and it is killed) if the copy was stopped already."""
        with self._lock:
            self._copier = copier
            if self.stopped:
                copier.kill()
            return not self.stopped

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
            if self._copier is not None and self._copier.returncode is None:
                self._copier.kill()


class WorkspaceError(Exception):
    """The workspace could not be created or staged (a platform failure, not the program's)."""


class SnapshotTooBig(WorkspaceError):
    """What a compile left is past what a test batch copies into its cases (too many bytes,
    files, or levels of folders): the submission's doing, not the platform's."""


# How many mounts a kept mount point may have stacked on it before a fresh tmpfs goes on
# top (each a teardown whose detach failed): the next mount detaches them all first.
MAX_STACKED_MOUNTS = 8


class Workspace:
    """A job's tmpfs, mounted on `<root>/<name>`.

    With `keep_mount_point`, the folder is a slot's, made once and used by every sandbox the
    slot builds (as the slot's uid is): each gets a fresh tmpfs on it, and `destroy` only
    detaches that. Removing a folder a mount was just detached from waits on the host's
    mount locks, which every jail's new mount namespace takes too: it cost more than the
    mount and the detach together, on every job.
    """

    def __init__(self, root: Path, job_id: str, uid: int, gid: int, keep_mount_point: bool = False) -> None:
        self.path = root / job_id
        self._where = f"{root}/{job_id}"  # for os calls: pathlib's conversions cost more than some of them
        self.uid = uid
        self.gid = gid
        self.keep_mount_point = keep_mount_point
        self._mounted = False

    def create(self, size_bytes: int, inodes: int) -> None:
        try:
            os.mkdir(self._where, 0o700)
        except FileExistsError:
            if not self.keep_mount_point:
                raise WorkspaceError(f"workspace {self.path} already exists") from None
            # The slot's folder: nothing should be mounted on it, but a teardown whose detach
            # failed would have left its tmpfs, and a new one must not go on top of it.
            try:
                _detach_every_layer(self._where)
            except MountError as exc:
                raise WorkspaceError(str(exc)) from None
        try:
            mount("coderunner-ws", self._where, "tmpfs", MS_NOSUID | MS_NODEV,
                  f"size={size_bytes},nr_inodes={inodes},mode=0700,uid={self.uid},gid={self.gid}")  # fmt: skip
        except MountError as exc:
            raise WorkspaceError(str(exc)) from None
        self._mounted = True

    def stage(self, files: list[tuple[str, bytes]], executable: frozenset[str] = frozenset()) -> None:
        """Write the submitted files (already validated names) into the fresh workspace;
        those named in `executable` get mode 0755 (a compiled program copied from another)."""
        root_fd = os.open(self._where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for name, data in files:
                self._write_file(root_fd, name, data, 0o755 if name in executable else 0o644)
        except OSError as exc:
            raise WorkspaceError(f"cannot stage {len(files)} files: {exc}") from None
        finally:
            os.close(root_fd)

    def unpack(
        self, packed: Packed, procs_files: list[str], unpacking: Unpacking | None = None, timeout_s: float = UNPACK_TIMEOUT_S
    ) -> None:
        """Write `packed` into the fresh workspace by a copier (tar) that joins `procs_files`
        before it reads a byte, so every page it writes is charged there, and runs as the
        job's uid and gid. Blocking: for the isolation threads.

        Raises:
            WorkspaceError: the copier could not start or join its cgroups, it failed, or
                it was stopped (`unpacking`).
        """
        unpacking = unpacking or Unpacking()
        try:
            # (No uid change in Popen itself: that would fork the whole worker; this can vfork.)
            copier = subprocess.Popen(
                ["/bin/sh", "-c", _COPIER, "copier", str(self.uid), str(self.gid), self._where, *procs_files],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                cwd="/", env={"PATH": _COPIER_PATH, "LC_ALL": "C"}, close_fds=True,
            )  # fmt: skip
        except OSError as exc:
            raise WorkspaceError(f"the copier for the compiled program could not start: {exc}") from None
        try:
            if not unpacking.began(copier):
                raise WorkspaceError("the copy of the compiled program was stopped")
            try:
                _, errors = copier.communicate(packed.archive, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise WorkspaceError(f"copying the compiled program took over {timeout_s:g} s") from None
        finally:
            if copier.returncode is None:
                copier.kill()
                copier.wait()
        if unpacking.stopped:
            raise WorkspaceError("the copy of the compiled program was stopped")
        if copier.returncode != 0:
            why = "could not join its cgroup" if copier.returncode == 125 else f"exit {copier.returncode}"
            detail = errors.decode(errors="replace").strip().splitlines()[-1:] or [why]
            raise WorkspaceError(f"copying the compiled program failed: {detail[0]}")

    def remove(self, names: list[str]) -> None:
        """Remove top-level files (not folders) by name; a missing one is fine."""
        if not names:
            return
        root_fd = os.open(self._where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for name in names:
                try:
                    os.unlink(name, dir_fd=root_fd)
                except FileNotFoundError:
                    pass
        finally:
            os.close(root_fd)

    def snapshot(self, max_bytes: int, max_files: int = 4096) -> tuple[list[tuple[str, bytes]], frozenset[str]]:
        """Every regular file in the workspace (relative path, bytes) and which are executable.

        What a compile step left, to be copied into each test case's fresh workspace. The
        tree was written by untrusted code: every component is opened without following
        links, only directories and regular files are looked at (a FIFO is never opened
        for reading: O_NONBLOCK, then fstat), and the total is capped.

        Raises:
            SnapshotTooBig: over `max_bytes` or `max_files`, or folders nested deeper than
                MAX_SNAPSHOT_DEPTH (each level holds a descriptor while its folders are
                read, and the walk recurses).
        """
        files: list[tuple[str, bytes]] = []
        executable: set[str] = set()
        total = 0
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK

        def walk(dir_fd: int, prefix: str, depth: int = 0) -> None:
            nonlocal total
            if depth > MAX_SNAPSHOT_DEPTH:
                raise SnapshotTooBig(f"it nests folders deeper than {MAX_SNAPSHOT_DEPTH}")
            for entry in sorted(os.listdir(dir_fd)):
                try:
                    fd = os.open(entry, flags, dir_fd=dir_fd)
                except OSError:
                    continue  # a link, or gone
                try:
                    info = os.fstat(fd)
                    if stat.S_ISDIR(info.st_mode):
                        walk(fd, f"{prefix}{entry}/", depth + 1)
                    elif stat.S_ISREG(info.st_mode):
                        if len(os.fsencode(prefix + entry)) > MAX_SNAPSHOT_PATH_BYTES:
                            raise SnapshotTooBig(f"a path in it is longer than {MAX_SNAPSHOT_PATH_BYTES} bytes")
                        total += info.st_size
                        if total > max_bytes or len(files) >= max_files:
                            raise SnapshotTooBig(f"it is over {max_bytes} bytes or {max_files} files (each hard link in full)")
                        chunks = []
                        while chunk := os.read(fd, 1 << 20):
                            chunks.append(chunk)
                        files.append((prefix + entry, b"".join(chunks)))
                        if info.st_mode & 0o111:
                            executable.add(prefix + entry)
                finally:
                    os.close(fd)

        root_fd = os.open(self._where, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            walk(root_fd, "")
        finally:
            os.close(root_fd)
        return files, frozenset(executable)

    def _write_file(self, root_fd: int, name: str, data: bytes, mode: int = 0o644) -> None:
        *parents, leaf = name.split("/")
        dir_fd = os.dup(root_fd)
        try:
            for part in parents:
                try:
                    os.mkdir(part, 0o755, dir_fd=dir_fd)
                    created = True
                except FileExistsError:
                    created = False
                next_fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
                os.close(dir_fd)
                dir_fd = next_fd
                if created:
                    os.fchown(dir_fd, self.uid, self.gid)
            fd = os.open(leaf, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
            try:
                os.fchown(fd, self.uid, self.gid)
                view = memoryview(data)
                while view:
                    written = os.write(fd, view)
                    view = view[written:]
            finally:
                os.close(fd)
        finally:
            os.close(dir_fd)

    def destroy(self) -> None:
        """Detach the tmpfs (its pages are freed once no jail holds it) and remove the mount
        point, unless it is kept."""
        if self._mounted:
            detach(self._where)
            self._mounted = False
        if self.keep_mount_point:
            return
        try:
            os.rmdir(self._where)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.error("workspace %s could not be removed: %s", self.path, exc)


def _detach_every_layer(where: str) -> None:
    """Detach what is mounted on `where`, layer by layer (up to MAX_STACKED_MOUNTS)."""
    for _ in range(MAX_STACKED_MOUNTS):
        if not detach(where):
            return


def detach_workspace(path: Path, mounts_text: str) -> None:
    """Detach a workspace tmpfs left behind by a dead worker and remove its mount point."""
    if any(line.split()[1:2] == [str(path)] for line in mounts_text.splitlines()):
        _detach_every_layer(str(path))
    try:
        path.rmdir()
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("stale workspace %s: %s", path, exc)
