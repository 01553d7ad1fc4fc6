"""The simulator's filesystem behind `colab_kit.checkpoints.storage`: every VM's local disk, and the Drive
mount as that VM sees it (`model.DriveModel`), with the faults of `faults.py` on the mount.

The kit runs unchanged on it (`storage.use_filesystem`): the same calls as `osfs.OsFilesystem`, answered
from memory. The world says which VM and which runtime act (`vm`, `actor`) before each event; every
change to the mount is shown to `on_change(op, path, data)` first, so that the invariants can judge it
against the cloud as it is at that moment.
"""

from __future__ import annotations

import errno
import io
import hashlib
import os
import stat as _stat
from pathlib import Path

from model import Blob, DriveModel

__all__ = ["MemFs", "LocalDisk", "DRIVE", "LOCAL"]

DRIVE, LOCAL = "/sim/drive", "/sim/local"
_DIR = _stat.S_IFDIR | 0o755
_FILE = _stat.S_IFREG | 0o644


class Stat:
    __slots__ = ("st_size", "st_mtime", "st_mtime_ns", "st_mode")

    def __init__(self, size: int, mtime_ns: int, mode: int):
        self.st_size, self.st_mtime_ns, self.st_mode = size, mtime_ns, mode
        self.st_mtime = mtime_ns / 1e9


class Entry:
    __slots__ = ("name", "path", "_dir")

    def __init__(self, folder: str, name: str, is_dir: bool):
        self.name, self.path, self._dir = name, f"{folder}/{name}", is_dir

    def is_dir(self) -> bool:
        return self._dir


class LocalDisk:
    """One VM's own disk: files (hard links share a `Blob`) and folders."""

    def __init__(self):
        self.files: dict[str, Blob] = {}
        self.dirs: set[str] = {LOCAL}


def _err(code: int, path: str) -> OSError:
    cls = FileNotFoundError if code == errno.ENOENT else OSError
    return cls(code, os.strerror(code), path)


class MemFs:
    """Args: drive: the `DriveModel`; clock: the world's virtual clock; faults: the mount's `Faults`;
    attrs: whether the mount answers DriveFS's attributes; fstype: its filesystem type."""

    def __init__(self, drive: DriveModel, clock, faults, *, attrs: bool, fstype: str = "fuse.drive"):
        self.drive, self.clock, self.faults, self.attrs, self.fstype = drive, clock, faults, attrs, fstype
        self.vm = None
        self.disk: LocalDisk | None = None
        self.actor = None
        self.on_change = lambda op, path, data=None: None
        self._ns = 0
        self._synced = -1.0

    # -- helpers ----------------------------------------------------------------------------------
    def _now_ns(self) -> int:
        self._ns += 1
        return int(self.clock.time() * 1e9) + self._ns  # never two writes with one mtime

    @staticmethod
    def _where(path) -> tuple[bool, str]:
        text = str(path)
        return text == DRIVE or text.startswith(DRIVE + "/"), text

    def _sync(self) -> None:
        now = self.clock.monotonic()
        if now != self._synced:
            self._synced = now
            self.drive.advance(now)

    def _dfile(self, path: str):
        blob = self.vm.dirty.get(path)
        if blob is not None:
            return blob.data, blob.mtime_ns
        cloud = self.drive.files.get(path)
        return (cloud.data, cloud.mtime_ns) if cloud is not None else None

    def _dread(self, op: str, path: str) -> bytes:
        self._sync()
        self.faults.before(op, path, self)
        found = self._dfile(path)
        if found is None:
            if path in self.drive.dirs:
                raise _err(errno.EISDIR, path)
            raise _err(errno.ENOENT, path)
        return self.faults.torn(op, found[0])

    def _lread(self, path: str) -> bytes:
        blob = self.disk.files.get(path)
        if blob is None:
            raise _err(errno.EISDIR if path in self.disk.dirs else errno.ENOENT, path)
        return blob.data

    def _dwrite(self, op: str, path: str, data: bytes) -> None:
        self._sync()
        self.faults.before(op, path, self, write=True)
        parent = path.rsplit("/", 1)[0]
        if parent not in self.drive.dirs:
            raise _err(errno.ENOENT, path)
        quota = self.drive.quota
        if quota is not None and self.drive.used_bytes(self.vm) + len(data) > quota:
            raise _err(errno.ENOSPC, path)
        self.on_change(op, path, data)
        self.drive.write(self.vm, path, data, self._now_ns(), self.clock.monotonic())

    def _lwrite(self, path: str, data: bytes, mtime_ns: int | None = None) -> None:
        if path.rsplit("/", 1)[0] not in self.disk.dirs:
            raise _err(errno.ENOENT, path)
        self.disk.files[path] = Blob(data, mtime_ns if mtime_ns is not None else self._now_ns())

    # -- reads ------------------------------------------------------------------------------------
    def read_bytes(self, path) -> bytes:
        drive, path = self._where(path)
        return self._dread("read", path) if drive else self._lread(path)

    def read_tail(self, path, size: int) -> bytes:
        return self.read_bytes(path)[-size:]

    def open_read(self, path):
        return io.BytesIO(self.read_bytes(path))

    def stat(self, path):
        drive, path = self._where(path)
        if not drive:
            blob = self.disk.files.get(path)
            if blob is not None:
                return Stat(len(blob.data), blob.mtime_ns, _FILE)
            if path in self.disk.dirs:
                return Stat(0, 0, _DIR)
            raise _err(errno.ENOENT, path)
        self._sync()
        self.faults.before("stat", path, self)
        found = self._dfile(path)
        if found is not None:
            return Stat(len(found[0]), found[1], _FILE)
        if path in self.drive.dirs:
            return Stat(0, 0, _DIR)
        raise _err(errno.ENOENT, path)

    def list_dir(self, path) -> list:
        drive, path = self._where(path)
        prefix = path + "/"
        if not drive:
            if path not in self.disk.dirs:
                raise _err(errno.ENOENT if path not in self.disk.files else errno.ENOTDIR, path)
            names = {p[len(prefix):]: False for p in self.disk.files if p.startswith(prefix) and "/" not in p[len(prefix):]}
            names.update({p[len(prefix):]: True for p in self.disk.dirs if p.startswith(prefix) and "/" not in p[len(prefix):]})
            return [Entry(path, n, d) for n, d in sorted(names.items())]
        self._sync()
        self.faults.before("list", path, self)
        if path not in self.drive.dirs:
            raise _err(errno.ENOENT, path)
        names = {}
        for table in (self.drive.files, self.vm.dirty):
            for p in table:
                if p.startswith(prefix) and "/" not in p[len(prefix):]:
                    names[p[len(prefix):]] = False
        for p in self.drive.dirs:
            if p.startswith(prefix) and "/" not in p[len(prefix):]:
                names[p[len(prefix):]] = True
        shown = self.faults.listing(path, sorted(names), self)
        return [Entry(path, n, names[n]) for n in shown]

    def getxattr(self, path, name: str) -> bytes:
        drive, path = self._where(path)
        if not drive or not self.attrs:
            raise _err(errno.ENODATA, path)
        self._sync()
        self.faults.before("xattr", path, self)
        blob, cloud = self.vm.dirty.get(path), self.drive.files.get(path)
        if blob is None and cloud is None:
            if path in self.drive.dirs:
                return {"user.drive.uncommitted": b"0", "user.drive.id": self.drive.dirs[path].encode()}.get(
                    name) or _raise(_err(errno.ENODATA, path))
            raise _err(errno.ENOENT, path)
        if name == "user.drive.uncommitted":
            return b"1" if blob is not None else b"0"
        if name == "user.drive.id":
            return (cloud.id if cloud is not None else self.vm.local_ids.get(path, "local-0")).encode()
        if name == "user.drive.md5" and cloud is not None:
            return cloud.md5.encode()
        raise _err(errno.ENODATA, path)

    def files_under(self, folder) -> list[Path]:
        drive, folder = self._where(folder)
        prefix = folder + "/"
        if not drive:
            return [Path(p) for p in sorted(p for p in self.disk.files if p.startswith(prefix))]
        self._sync()
        self.faults.before("list", folder, self)
        found = {p for table in (self.drive.files, self.vm.dirty) for p in table if p.startswith(prefix)}
        return [Path(p) for p in sorted(found) if not self.faults.hidden(p, self)]

    def digests(self, path, *names: str) -> tuple[str, ...]:
        data = self.read_bytes(path)
        return tuple(hashlib.new(name, data).hexdigest() for name in names)

    def free_bytes(self, path):
        drive, _ = self._where(path)
        if not drive or self.drive.quota is None:
            return None
        return max(0, self.drive.quota - self.drive.used_bytes(self.vm))

    def resolve(self, path) -> Path:
        return Path(path)

    def mount_of(self, path):
        drive, _ = self._where(path)
        return (DRIVE, self.fstype, "drive" if self.fstype == "fuse.drive" else "remote") if drive else \
            (LOCAL, "ext4", "/dev/vda")

    # -- writes -----------------------------------------------------------------------------------
    def atomic_write_bytes(self, path, data: bytes, durable: bool = True) -> None:
        drive, path = self._where(path)
        self._dwrite("write", path, bytes(data)) if drive else self._lwrite(path, bytes(data))

    def overwrite_bytes(self, path, data: bytes) -> None:
        self.atomic_write_bytes(path, data)  # a whole write either way here: the in-memory Drive has no Trash

    def copy_file(self, src, dst, durable: bool = True) -> str:
        data = self.read_bytes(src)
        drive, dst = self._where(dst)
        if drive:
            self._dwrite("write", dst, data)
        else:
            keep = self.disk.files.get(str(src)).mtime_ns if not durable and str(src) in self.disk.files else None
            self._lwrite(dst, data, keep)
        return hashlib.sha256(data).hexdigest()

    def append_line(self, path, line: str) -> None:
        drive, path = self._where(path)
        try:
            old = self.read_bytes(path)
        except FileNotFoundError:
            old = b""
        data = old + line.encode()
        self._dwrite("append", path, data) if drive else self._lwrite(path, data)

    def make_dirs(self, path) -> None:
        drive, path = self._where(path)
        parts = path.split("/")
        for i in range(3, len(parts) + 1):
            sub = "/".join(parts[:i])
            if drive:
                if sub not in self.drive.dirs:
                    self._sync()
                    self.faults.before("mkdir", sub, self, write=True)
                    self.drive.mkdir(sub)
            else:
                self.disk.dirs.add(sub)

    def remove_tree(self, path) -> None:
        drive, path = self._where(path)
        prefix = path + "/"
        if not drive:
            for p in [p for p in self.disk.files if p.startswith(prefix)]:
                del self.disk.files[p]
            self.disk.dirs -= {d for d in self.disk.dirs if d == path or d.startswith(prefix)}
            return
        self._sync()
        self.faults.before("rmtree", path, self, write=True)
        self.on_change("rmtree", path)
        for p in [p for table in (self.drive.files, self.vm.dirty) for p in table if p.startswith(prefix)]:
            self.drive.unlink(self.vm, p)
        for d in sorted((d for d in self.drive.dirs if d == path or d.startswith(prefix)), reverse=True):
            self.drive.rmdir(d)

    def unlink(self, path) -> None:
        drive, path = self._where(path)
        if not drive:
            if self.disk.files.pop(path, None) is None:
                raise _err(errno.ENOENT, path)
            return
        self._sync()
        self.faults.before("unlink", path, self, write=True)
        if self._dfile(path) is None:
            raise _err(errno.ENOENT, path)
        self.on_change("unlink", path)
        self.drive.unlink(self.vm, path)

    def truncate(self, path, size: int = 0) -> None:
        drive, path = self._where(path)
        data = self.read_bytes(path)[:size]
        if drive:
            self.on_change("truncate", path)
            self._dwrite("truncate", path, data)
        else:
            self._lwrite(path, data)

    def replace(self, src, dst) -> None:
        drive, src = self._where(src)
        _, dst = self._where(dst)
        if not drive:
            if src in self.disk.files:
                self.disk.files[dst] = self.disk.files.pop(src)
                return
            for p in [p for p in self.disk.files if p.startswith(src + "/")]:
                self.disk.files[dst + p[len(src):]] = self.disk.files.pop(p)
            for d in [d for d in self.disk.dirs if d == src or d.startswith(src + "/")]:
                self.disk.dirs.discard(d)
                self.disk.dirs.add(dst + d[len(src):])
            return
        self._sync()
        self.faults.before("rename", src, self, write=True)
        if self._dfile(src) is None and src not in self.drive.dirs:
            raise _err(errno.ENOENT, src)
        self.on_change("rename", src)
        self.drive.rename(src, dst)

    def rmdir(self, path) -> None:
        drive, path = self._where(path)
        if not drive:
            if any(p.startswith(path + "/") for p in self.disk.files):
                raise _err(errno.ENOTEMPTY, path)
            self.disk.dirs.discard(path)
            return
        self._sync()
        self.faults.before("rmdir", path, self, write=True)
        prefix = path + "/"
        if any(p.startswith(prefix) for table in (self.drive.files, self.vm.dirty) for p in table):
            raise _err(errno.ENOTEMPTY, path)
        self.on_change("rmdir", path)
        self.drive.rmdir(path)

    def link(self, src, dst) -> None:
        drive, src = self._where(src)
        if drive or self._where(dst)[0]:
            raise _err(errno.EXDEV, str(dst))
        blob = self.disk.files.get(src)
        if blob is None:
            raise _err(errno.ENOENT, src)
        if str(dst).rsplit("/", 1)[0] not in self.disk.dirs:
            raise _err(errno.ENOENT, str(dst))
        self.disk.files[str(dst)] = blob

    def fsync_dir(self, path) -> None:
        return None

    def rewrite_in_place(self, path, data: bytes) -> None:
        """What `open(path, "wb")` does on the VM's disk (the Trainer saving over an existing checkpoint): the
        same file gets new bytes, and so does every hard link to it (a snapshot's)."""
        _, path = self._where(path)
        blob = self.disk.files.get(path)
        if blob is None:
            self._lwrite(path, bytes(data))
            return
        blob.data, blob.mtime_ns = bytes(data), self._now_ns()


def _raise(exc: Exception):
    raise exc
