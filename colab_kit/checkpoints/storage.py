"""Durable file operations, used for every write the kit makes.

Rules (DESIGN.md §4): write to a temporary name in the *same* directory, flush and fsync,
then `os.replace` (a rename across filesystems, /content -> Drive, fails with EXDEV, so we
never rename across them: copies go to a temp file beside the target). Read back and verify
what was written to the persistent folder.

All persistent I/O goes through the functions of this module, called as `storage.name(...)`: the
writes, and the reads whose failure must be told apart from an answer (`read_bytes`, `stat`,
`list_dir`, `getxattr`). That makes the module the one seam where tests inject Drive trouble (ENOSPC,
EIO, errno 107, a file missing from a listing for a moment), one named operation at a time.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import time
import uuid
from pathlib import Path

__all__ = [
    "read_bytes",
    "stat",
    "list_dir",
    "getxattr",
    "sha256_file",
    "file_digests",
    "atomic_write_bytes",
    "atomic_write_json",
    "copy_file",
    "append_line",
    "make_dirs",
    "remove_tree",
    "is_temp_name",
    "fsync_dir",
    "patiently",
    "LASTING",
]

CHUNK = 8 << 20
# Failures that another try will not mend: a full, read-only or forbidden folder.
LASTING = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT)
_TMP_MARK = ".tmp-"


def _tmp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}{_TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


def read_bytes(path: str | os.PathLike) -> bytes:
    """A whole (small) file: a manifest, the lease, a journal."""
    with open(path, "rb") as fh:
        return fh.read()


def stat(path: str | os.PathLike) -> os.stat_result:
    return os.stat(path)


def list_dir(path: str | os.PathLike) -> list[os.DirEntry]:
    """The entries of a folder (FileNotFoundError when the folder is not there)."""
    with os.scandir(path) as entries:
        return list(entries)


def getxattr(path: str | os.PathLike, name: str) -> bytes:
    """One extended attribute (DriveFS's upload state; `drive.drivefs` says what they mean)."""
    return os.getxattr(path, name)


def is_temp_name(name: str) -> bool:
    """True for the temporary files this module leaves behind when a process is killed."""
    return _TMP_MARK in name


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 8 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_digests(path: str | os.PathLike) -> tuple[str, str]:
    """(sha256, md5) of a file in one read: sha256 is the kit's check, md5 is what Drive reports."""
    sha, md5 = hashlib.sha256(), hashlib.md5()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK):
            sha.update(chunk)
            md5.update(chunk)
    return sha.hexdigest(), md5.hexdigest()


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or create in `path` durable (a no-op where directories can't be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some FUSE mounts (Drive among them) refuse fsync on directories
    finally:
        os.close(fd)


def _write_chunk(fh, data: bytes) -> None:
    # One function for every chunk written, so a benchmark can throttle it to Drive's speed.
    fh.write(data)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write `data` to `path` so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as fh:
            _write_chunk(fh, data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    """`atomic_write_bytes` of an indented JSON document."""
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def copy_file(src: str | os.PathLike, dst: str | os.PathLike) -> str:
    """Copy `src` to `dst` atomically and durably; return the sha256 of the bytes read from `src`.

    The copy is written to a temp file beside `dst`, fsynced and renamed; the caller verifies
    the result by reading it back (`sha256_file(dst)`).
    """
    dst = Path(dst)
    tmp = _tmp_name(dst)
    digest = hashlib.sha256()
    try:
        with open(src, "rb") as fin, open(tmp, "wb") as fout:
            while chunk := fin.read(CHUNK):
                digest.update(chunk)
                _write_chunk(fout, chunk)
            fout.flush()
            os.fsync(fout.fileno())
        os.replace(tmp, dst)
    except BaseException:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass  # the folder itself may be the thing that broke
        raise
    return digest.hexdigest()


def append_line(path: str | os.PathLike, line: str) -> None:
    """Append one line and fsync (a journal entry survives a kill right after this returns)."""
    with open(path, "a", encoding="utf-8") as fh:
        fh.write(line if line.endswith("\n") else line + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def make_dirs(path: str | os.PathLike) -> None:
    os.makedirs(path, exist_ok=True)


def remove_tree(path: str | os.PathLike) -> None:
    """Delete a folder; missing is fine. On Drive this fills the Trash: checkpoints are deleted
    through `drivefs.TrashFreeDeleter` instead."""
    if os.path.isdir(path):
        shutil.rmtree(path)


def patiently(action, waits=(1.0, 2.0, 4.0)):
    """`action()`, tried again after each of `waits` (seconds) when it fails in a way that may pass
    (EIO, errno 107, a stall): on Drive, doubt costs time. A `LASTING` failure is raised at once."""
    for wait in waits:
        try:
            return action()
        except OSError as exc:
            if exc.errno in LASTING:
                raise
            time.sleep(wait)
    return action()
