"""Holding a tmpfs file's inode lock for as long as a test likes, as a hostile local user can: a
``write()`` into the file from a buffer whose page is registered with userfaultfd and never filled.
The kernel takes the inode lock, then faults on the buffer and sleeps until ``release()`` closes the
userfaultfd (the fault is then retried and completes). Without root, an unprivileged user does the same
with a FUSE-backed buffer, or with userfaultfd where ``vm.unprivileged_userfaultfd`` is 1."""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import platform
import struct
import threading

_SYS_USERFAULTFD = {"x86_64": 323, "aarch64": 282}
_UFFDIO_API, _UFFDIO_REGISTER, _UFFD_API = 0xC018AA3F, 0xC020AA00, 0xAA
_UFFDIO_REGISTER_MODE_MISSING = 1

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.syscall.restype = ctypes.c_long
_libc.write.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
_libc.write.restype = ctypes.c_ssize_t
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mmap.restype = ctypes.c_void_p


def why_unavailable() -> str | None:
    """None where this process can hold a lock so; else why not."""
    if platform.machine() not in _SYS_USERFAULTFD:
        return f"userfaultfd's syscall number is not known here ({platform.machine()})"
    fd = _libc.syscall(_SYS_USERFAULTFD[platform.machine()], os.O_CLOEXEC | os.O_NONBLOCK)
    if fd < 0:
        return f"userfaultfd: {os.strerror(ctypes.get_errno())} (root, or vm.unprivileged_userfaultfd=1)"
    os.close(fd)
    return None


class InodeLockHolder:
    """Holds ``fd``'s inode lock from construction until ``release()`` (a write of one page at ``offset``)."""

    def __init__(self, fd: int, offset: int = 0) -> None:
        self._uffd = _libc.syscall(_SYS_USERFAULTFD[platform.machine()], os.O_CLOEXEC | os.O_NONBLOCK)
        if self._uffd < 0:
            raise OSError(ctypes.get_errno(), "userfaultfd")
        fcntl.ioctl(self._uffd, _UFFDIO_API, bytearray(struct.pack("QQQ", _UFFD_API, 0, 0)))
        self._page = _libc.mmap(None, 4096, 0x3, 0x22, -1, 0)  # read/write, private anonymous
        fcntl.ioctl(self._uffd, _UFFDIO_REGISTER,
                    bytearray(struct.pack("QQQQ", self._page, 4096, _UFFDIO_REGISTER_MODE_MISSING, 0)))
        self._thread = threading.Thread(target=lambda: os.lseek(fd, offset, 0) == offset and
                                        _libc.write(fd, self._page, 4096), daemon=True)
        self._thread.start()

    def release(self) -> None:
        if self._uffd >= 0:
            os.close(self._uffd)  # the fault is retried without userfaultfd and the write completes
            self._uffd = -1
        self._thread.join(10)
