"""The two mount(2) calls the worker makes on the host, via libc (no `mount` binary, no shell)."""

from __future__ import annotations

import ctypes
import errno
import os

__all__ = ["MS_BIND", "MS_NODEV", "MS_NOSUID", "MS_RDONLY", "MS_REC", "MS_REMOUNT", "MountError", "detach", "mount"]

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MNT_DETACH = 0x2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


class MountError(OSError):
    """A mount or unmount failed; the message names both paths and the reason."""


def mount(source: str, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    ok = _libc.mount(
        source.encode(), target.encode(), fstype.encode() if fstype else None, flags, data.encode() if data else None
    )
    if ok != 0:
        raise MountError(f"mount {source} on {target}: {os.strerror(ctypes.get_errno())}")


def detach(target: str) -> bool:
    """Lazily unmount `target`; False if there was nothing to unmount (already gone, or not
    a mount point)."""
    if _libc.umount2(target.encode(), MNT_DETACH) != 0:
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOENT):
            raise MountError(f"umount {target}: {os.strerror(err)}")
        return False
    return True
