"""Node-local staging of embeddings in shared memory (no torch, no engine).

One file per embedding under ``/dev/shm`` (a tmpfs: memory, never a disk), named
``<prefix><content hash>``, where the prefix names the owning process and instance
(``encsvc-ec-<pid>-<token>-``). A file holds a small header (magic, then JSON with the content
hash, shape and wire dtype), zero padding to 64 bytes, then the row-major little-endian bytes.
It is written under a temporary name and renamed, so a file that exists under its final name is
complete: an embedding is "staged" only once its bytes are all there.

The owner (the engine's scheduler process) removes its files when they are released and all of
them at ``close``; ``sweep_stale`` removes what a process that died left behind.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import secrets
import struct
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from encoder_client.protocol import BY_NAME

MAGIC = b"ECSTAGE1"
ALIGN = 64
FILE_PREFIX = "encsvc-ec-"
CONTENT_HASH_RE = re.compile(r"^[0-9a-f]{64}$")
_OWNED_RE = re.compile(rf"^{FILE_PREFIX}(\d+)-[0-9a-f]+-")


def default_directory() -> str:
    """/dev/shm where there is one (Linux), else the temporary directory."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


@dataclass(frozen=True)
class StagedItem:
    """Where one staged embedding lies and what it is: ``shape`` [rows, width], ``dtype`` a wire
    dtype name ("float32", "float16", "bfloat16"; bf16 as its 2-byte patterns)."""

    content_hash: str
    path: str
    shape: tuple[int, int]
    dtype: str

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * BY_NAME[self.dtype].numpy.itemsize


def _header(content_hash: str, shape: tuple[int, int], dtype: str) -> bytes:
    meta = json.dumps({"content_hash": content_hash, "shape": list(shape), "dtype": dtype}).encode()
    head = MAGIC + struct.pack("<I", len(meta)) + meta
    return head + bytes(-len(head) % ALIGN)


class StagingArea:
    """The staged files of one owner. Thread-safe: fetch threads stage, the owner removes."""

    def __init__(self, directory: str | None = None) -> None:
        self.directory = directory or default_directory()
        os.makedirs(self.directory, exist_ok=True)
        self.prefix = f"{FILE_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-"
        self._lock = threading.Lock()
        self._closed = False

    def path_for(self, content_hash: str) -> str:
        if not CONTENT_HASH_RE.match(content_hash):
            raise ValueError(f"not a content hash (64 lowercase hex digits): {content_hash!r}")
        return os.path.join(self.directory, self.prefix + content_hash)

    def stage(self, content_hash: str, array: np.ndarray, dtype: str) -> StagedItem:
        """Write array ([rows, width], of the numpy dtype that carries wire dtype ``dtype``) and
        return its StagedItem once complete. Raises RuntimeError once the area is closed."""
        if array.ndim != 2:
            raise ValueError(f"expected a 2-D embedding, got shape {array.shape}")
        wire = BY_NAME[dtype]  # KeyError for an unknown dtype
        if array.dtype.itemsize != wire.numpy.itemsize:
            raise ValueError(f"{dtype} needs {wire.numpy.itemsize}-byte items, got {array.dtype}")
        path = self.path_for(content_hash)
        tmp = f"{path}.{secrets.token_hex(4)}.tmp"
        data = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        shape = (int(data.shape[0]), int(data.shape[1]))
        try:
            with open(tmp, "wb") as f:
                f.write(_header(content_hash, shape, dtype))
                f.write(memoryview(data).cast("B"))
            with self._lock:  # close() sweeps under this lock: nothing is renamed in after it
                if self._closed:
                    raise RuntimeError("staging area closed")
                os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        return StagedItem(content_hash, path, shape, dtype)

    def remove(self, content_hash: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path_for(content_hash))

    def owned_files(self) -> list[str]:
        """This area's files now (complete and in progress)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        return sorted(os.path.join(self.directory, n) for n in names if n.startswith(self.prefix))

    def close(self) -> None:
        """Remove every file of this area; later stage() calls fail and leave nothing."""
        with self._lock:
            self._closed = True
            for path in self.owned_files():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)

    @property
    def closed(self) -> bool:
        return self._closed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(directory: str | None = None) -> int:
    """Remove staged files whose owning process is gone; returns how many."""
    directory = directory or default_directory()
    removed = 0
    for name in os.listdir(directory):
        m = _OWNED_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(directory, name))
                removed += 1
    return removed


@contextlib.contextmanager
def open_staged(path: str) -> Iterator[tuple[memoryview, tuple[int, int], str, dict]]:
    """Map a staged file: yields (its data bytes, shape, wire dtype, header). The memoryview is
    writable (a private copy-on-write mapping) and valid only inside the block."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    view = memoryview(mm)
    try:
        if bytes(view[:len(MAGIC)]) != MAGIC:
            raise ValueError(f"{path}: not a staged embedding")
        (size,) = struct.unpack_from("<I", view, len(MAGIC))
        start = len(MAGIC) + 4
        meta = json.loads(bytes(view[start:start + size]))
        offset = start + size + (-(start + size) % ALIGN)
        shape = (int(meta["shape"][0]), int(meta["shape"][1]))
        nbytes = shape[0] * shape[1] * BY_NAME[meta["dtype"]].numpy.itemsize
        if len(view) - offset != nbytes:
            raise ValueError(f"{path}: holds {len(view) - offset} data bytes, its header says {nbytes}")
        data = view[offset:]
        try:
            yield data, shape, meta["dtype"], meta
        finally:
            data.release()
    finally:
        view.release()
        mm.close()
