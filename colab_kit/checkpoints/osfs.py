"""The real filesystem behind `storage`: the operating system's calls, written durably.

Rules (DESIGN.md §4): write to a temporary name in the *same* directory, flush and fsync, then
`os.replace` (a rename across filesystems, /content -> Drive, fails with EXDEV, so the kit never
renames across them: copies go to a temp file beside the target).

The deterministic simulator (`tests/sim/`) puts an in-memory Drive and VM disk in its place; every
method here has its twin there, so that the kit's own code runs unchanged over both.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from pathlib import Path

__all__ = ["OsFilesystem", "TMP_MARK", "CHUNK", "write_chunk"]

CHUNK = 8 << 20
TMP_MARK = ".tmp-"


def write_chunk(fh, data: bytes) -> None:
    """Every chunk the kit writes goes through here (`storage._write_chunk`, which a benchmark throttles)."""
    fh.write(data)


def _tmp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}")


class OsFilesystem:
    """The operating system's files. `chunk` writes every chunk (the throttling seam)."""

    def __init__(self, chunk=None):
        self.chunk = chunk or write_chunk

    # -- reads -----------------------------------------------------------------------------------
    def read_bytes(self, path) -> bytes:
        with open(path, "rb") as fh:
            return fh.read()

    def open_read(self, path):
        return open(path, "rb")

    def stat(self, path) -> os.stat_result:
        return os.stat(path)

    def list_dir(self, path) -> list:
        with os.scandir(path) as entries:
            return list(entries)

    def getxattr(self, path, name: str) -> bytes:
        return os.getxattr(path, name)

    def read_tail(self, path, size: int) -> bytes:
        """The last `size` bytes of a file (fewer when it is shorter)."""
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - size))
            return fh.read()

    def files_under(self, folder) -> list[Path]:
        """Every file below `folder` (not folders), sorted."""
        return sorted(p for p in Path(folder).rglob("*") if p.is_file())

    def digests(self, path, *names: str) -> tuple[str, ...]:
        """The hex digests `names` ("sha256", "md5") of a file, in one read."""
        hashers = [hashlib.new(name) for name in names]
        with open(path, "rb") as fh:
            while chunk := fh.read(CHUNK):
                for hasher in hashers:
                    hasher.update(chunk)
        return tuple(h.hexdigest() for h in hashers)

    def free_bytes(self, path) -> int | None:
        """Free space where `path` lives (None: the filesystem reports no size)."""
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize if st.f_blocks else None

    def resolve(self, path) -> Path:
        return Path(path).resolve()

    def mount_of(self, path) -> tuple[str, str, str] | None:
        """(mount point, filesystem type, source) of the mount holding `path`, from mountinfo."""
        try:
            with open("/proc/self/mountinfo", encoding="utf-8") as fh:
                lines = fh.read().splitlines()
        except OSError:
            return None
        best, target = None, str(path)
        for line in lines:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) < 5 or len(tail) < 2:
                continue
            point = fields[4].replace("\\040", " ")
            inside = target == point or target.startswith(point.rstrip("/") + "/")
            if inside and (best is None or len(point) >= len(best[0])):  # the last of equal ones is on top
                best = (point, tail[0], tail[1])
        return best

    # -- writes ----------------------------------------------------------------------------------
    def atomic_write_bytes(self, path, data: bytes, durable: bool = True) -> None:
        path = Path(path)
        tmp = _tmp_name(path)
        try:
            with open(tmp, "wb") as fh:
                self.chunk(fh, data)
                fh.flush()
                if durable:
                    os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        if durable:
            self.fsync_dir(path.parent)

    def overwrite_bytes(self, path, data: bytes) -> None:
        with open(path, "wb") as fh:
            self.chunk(fh, data)

    def copy_file(self, src, dst, durable: bool = True) -> str:
        dst = Path(dst)
        tmp = _tmp_name(dst)
        digest = hashlib.sha256()
        try:
            with open(src, "rb") as fin, open(tmp, "wb") as fout:
                while chunk := fin.read(CHUNK):
                    digest.update(chunk)
                    self.chunk(fout, chunk)
                fout.flush()
                if durable:
                    os.fsync(fout.fileno())
            if not durable:  # a local copy standing in for a hard link keeps the source's times
                shutil.copystat(src, tmp)
            os.replace(tmp, dst)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return digest.hexdigest()

    def append_line(self, path, line: str) -> None:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())

    def make_dirs(self, path) -> None:
        os.makedirs(path, exist_ok=True)

    def remove_tree(self, path) -> None:
        if os.path.isdir(path):
            shutil.rmtree(path)

    def unlink(self, path) -> None:
        os.unlink(path)

    def truncate(self, path, size: int = 0) -> None:
        os.truncate(path, size)

    def replace(self, src, dst) -> None:
        os.replace(src, dst)

    def rmdir(self, path) -> None:
        os.rmdir(path)

    def link(self, src, dst) -> None:
        os.link(src, dst)

    def fsync_dir(self, path) -> None:
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


def _unlink_quietly(path: Path) -> None:
    try:
        path.unlink(missing_ok=True)
    except OSError:
        pass  # the folder itself may be the thing that broke
