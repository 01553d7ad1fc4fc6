"""The one seam for every file operation of the kit's durability core, on Drive and on local disk.

All I/O of checkpoints, the journal, the lease and Drive's upload state goes through the functions of
this module, called as `storage.name(...)`. That makes it the one place where tests inject Drive
trouble (ENOSPC, EIO, errno 107, a file missing from a listing for a moment), one named operation at a
time, and where the deterministic simulator (`tests/sim/`) puts an in-memory Drive and VM disk in
place of the operating system's (`use_filesystem`). The real calls, written durably (temp file in
the same folder, fsync, `os.replace`), are in `osfs.py`.

A read that fails is not an answer: `exists` and `is_dir` say False only when the path is not there,
and raise every other OSError, so that no caller takes "could not read" for "absent".
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat as _stat
from pathlib import Path

from .clock import clock
from .osfs import CHUNK, TMP_MARK, OsFilesystem, write_chunk

__all__ = [
    "read_bytes",
    "open_read",
    "stat",
    "list_dir",
    "getxattr",
    "read_tail",
    "exists",
    "is_dir",
    "files_under",
    "sha256_file",
    "file_digests",
    "free_bytes",
    "resolve",
    "mount_of",
    "atomic_write_bytes",
    "atomic_write_json",
    "overwrite_bytes",
    "copy_file",
    "append_line",
    "make_dirs",
    "remove_tree",
    "unlink",
    "truncate",
    "replace",
    "rmdir",
    "link",
    "is_temp_name",
    "fsync_dir",
    "patiently",
    "use_filesystem",
    "LASTING",
    "CHUNK",
]

# Failures that another try will not mend: a full, read-only or forbidden folder.
LASTING = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT)
_ABSENT = (errno.ENOENT, errno.ENOTDIR)


def _write_chunk(fh, data: bytes) -> None:
    # Module-level, so that a benchmark can throttle every chunk written to Drive's speed.
    write_chunk(fh, data)


_fs = OsFilesystem(chunk=lambda fh, data: _write_chunk(fh, data))


@contextlib.contextmanager
def use_filesystem(fs):
    """Run the block with `fs` (the simulator's in-memory filesystem) behind every function here."""
    global _fs
    previous, _fs = _fs, fs
    try:
        yield fs
    finally:
        _fs = previous


# -- reads -----------------------------------------------------------------------------------------
def read_bytes(path: str | os.PathLike) -> bytes:
    """A whole (small) file: a manifest, the lease, a journal."""
    return _fs.read_bytes(path)


def open_read(path: str | os.PathLike):
    """A file opened for reading in binary (a large file streamed to the Hub); the caller closes it."""
    return _fs.open_read(path)


def stat(path: str | os.PathLike) -> os.stat_result:
    return _fs.stat(path)


def list_dir(path: str | os.PathLike) -> list:
    """The entries of a folder (`.name`, `.path`, `.is_dir()`); FileNotFoundError when it is not there."""
    return _fs.list_dir(path)


def getxattr(path: str | os.PathLike, name: str) -> bytes:
    """One extended attribute (DriveFS's upload state; `drive.drivefs` says what they mean)."""
    return _fs.getxattr(path, name)


def read_tail(path: str | os.PathLike, size: int) -> bytes:
    """The last `size` bytes of a file (a journal's torn last line)."""
    return _fs.read_tail(path, size)


def exists(path: str | os.PathLike) -> bool:
    """False only when `path` is not there; any other failed read is raised (it is not an answer)."""
    try:
        stat(path)
    except OSError as exc:
        if exc.errno in _ABSENT:
            return False
        raise
    return True


def is_dir(path: str | os.PathLike) -> bool:
    """True for a folder, False for a file or nothing; any other failed read is raised."""
    try:
        return _stat.S_ISDIR(stat(path).st_mode)
    except OSError as exc:
        if exc.errno in _ABSENT:
            return False
        raise


def files_under(folder: str | os.PathLike) -> list[Path]:
    """Every file below `folder` (recursively, folders left out), sorted."""
    return _fs.files_under(folder)


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 8 MiB chunks."""
    return _fs.digests(path, "sha256")[0]


def file_digests(path: str | os.PathLike) -> tuple[str, str]:
    """(sha256, md5) of a file in one read: sha256 is the kit's check, md5 is what Drive reports."""
    return _fs.digests(path, "sha256", "md5")


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free space where `path` lives; None when the filesystem reports no size."""
    return _fs.free_bytes(path)


def resolve(path: str | os.PathLike) -> Path:
    """`path` with every symlink followed: where it really lives."""
    return _fs.resolve(path)


def mount_of(path: str | os.PathLike) -> tuple[str, str, str] | None:
    """(mount point, filesystem type, source) of the mount holding the resolved `path`; None: unknown."""
    return _fs.mount_of(path)


def is_temp_name(name: str) -> bool:
    """True for the temporary files this module leaves behind when a process is killed."""
    return TMP_MARK in name


# -- writes ----------------------------------------------------------------------------------------
def atomic_write_bytes(path: str | os.PathLike, data: bytes, durable: bool = True) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part.
    `durable=False` skips the fsyncs (a local record that guards against a dead process only)."""
    _fs.atomic_write_bytes(path, data, durable)


def atomic_write_json(path: str | os.PathLike, obj, *, indent: int | None = 1) -> None:
    """`atomic_write_bytes` of a JSON document (indented: people read these; `indent=None` for one that is
    rewritten every few seconds, which json encodes faster on one line)."""
    atomic_write_bytes(path, (json.dumps(obj, indent=indent, sort_keys=True) + "\n").encode())


def overwrite_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` into `path` in place (truncated first; made when missing), not through a renamed copy.

    For a file that people read and that is rewritten every few minutes (the status page): on Drive a file
    renamed over another sends the one it replaces to the Trash, which counts against the quota until it is
    emptied, where a file written in place becomes a new revision of the same item. A reader may see it half
    written; nothing the kit decides reads such a file."""
    _fs.overwrite_bytes(path, data)


def copy_file(src: str | os.PathLike, dst: str | os.PathLike, durable: bool = True) -> str:
    """Copy `src` to `dst` atomically (and durably); return the sha256 of the bytes read from `src`.

    The copy is written to a temp file beside `dst`, fsynced and renamed; the caller verifies the
    result by reading it back (`sha256_file(dst)`). `durable=False`: a local stand-in for a hard
    link, which keeps the source's times and is not fsynced.
    """
    return _fs.copy_file(src, dst, durable)


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line and fsync (a journal entry survives a kill right after this returns)."""
    _fs.append_line(path, line if line.endswith("\n") else line + "\n")


def make_dirs(path: str | os.PathLike) -> None:
    _fs.make_dirs(path)


def remove_tree(path: str | os.PathLike) -> None:
    """Delete a folder and what it holds; missing is fine. For the VM's disk only: what may be the only
    copy of a checkpoint on Drive is deleted through `drive.gate`, and nowhere else."""
    _fs.remove_tree(path)


def unlink(path: str | os.PathLike) -> None:
    _fs.unlink(path)


def truncate(path: str | os.PathLike, size: int = 0) -> None:
    _fs.truncate(path, size)


def replace(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename `src` to `dst` (over it, atomically), on one filesystem."""
    _fs.replace(src, dst)


def rmdir(path: str | os.PathLike) -> None:
    _fs.rmdir(path)


def link(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """A hard link (OSError where the filesystem has none, or across filesystems)."""
    _fs.link(src, dst)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or create in `path` durable (a no-op where directories can't be opened)."""
    _fs.fsync_dir(path)


def patiently(action, waits=(1.0, 2.0, 4.0)):
    """`action()`, tried again after each of `waits` (seconds) when it fails in a way that may pass
    (EIO, errno 107, a stall): on Drive, doubt costs time. A `LASTING` failure is raised at once."""
    for wait in waits:
        try:
            return action()
        except OSError as exc:
            if exc.errno in LASTING:
                raise
            clock.sleep(wait)
    return action()
