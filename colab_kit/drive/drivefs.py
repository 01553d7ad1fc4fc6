"""What Google Drive's FUSE daemon (DriveFS) says about uploads, and deleting without Trash.

In Colab, a write to /content/drive returns once the bytes are in DriveFS's cache on the VM
disk; the upload to the cloud comes later, and the VM disk dies with the runtime. DriveFS shows
each file's upload state as extended attributes (names from DriveFS's own tests; see
`shared/research/drive-reality.md`):

    user.drive.uncommitted   b"1" while the file has bytes the cloud lacks, b"0" once committed
    user.drive.id            b"local-<n>" until the item exists in the cloud, then its cloud id
    user.drive.md5           the md5 of the cloud copy (where DriveFS provides it)

A folder is one of three kinds (`folder_kind`):

    DRIVEFS      the attributes answer: a file is in the cloud when it is committed, has a cloud
                 id and (where the md5 is given) the cloud copy's md5 is ours
    UNCONFIRMED  a Drive mount whose attributes are missing: written is all we can know, and
                 nothing is ever called "in the cloud"
    PLAIN        a local or network folder: written, fsynced and read back is as durable as it gets

Every read of these attributes in the kit goes through this module.
"""

from __future__ import annotations

import errno
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .._units import format_bytes
from ..checkpoints import storage

__all__ = ["UNCOMMITTED", "ITEM_ID", "MD5", "DRIVEFS", "UNCONFIRMED", "PLAIN", "API", "FileUpload", "cloud_id",
           "read_upload", "folder_kind", "is_drive_mount", "in_cloud", "describe_kind", "check_space",
           "TrashFreeDeleter"]

UNCOMMITTED = "user.drive.uncommitted"
ITEM_ID = "user.drive.id"
MD5 = "user.drive.md5"
DRIVEFS, UNCONFIRMED, PLAIN = "drivefs", "unconfirmed", "plain"
API = "api"  # confirmed through Drive's API (`driveapi.py`), whatever the mount reports
COLAB_MOUNT = "/content/drive"
_MISSING = (errno.ENODATA, errno.ENOTSUP, getattr(errno, "ENOATTR", errno.ENODATA))
# Without attributes, a truncation is given this long to reach the cloud before the unlink.
UNCONFIRMED_GRACE_S = 120.0
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FileUpload:
    """DriveFS's attributes of one file; None where an attribute is missing."""

    uncommitted: bytes | None
    item_id: bytes | None
    md5: bytes | None

    @property
    def has_attributes(self) -> bool:
        return self.uncommitted is not None

    def in_cloud(self, md5: str | None = None) -> bool:
        """Committed, with a cloud id, and (where both are known) the cloud md5 is `md5`."""
        if self.uncommitted != b"0" or not self.item_id or self.item_id.startswith(b"local-"):
            return False
        return self.md5 is None or md5 is None or self.md5.decode(errors="replace") == md5


def _attr(path: str | os.PathLike, name: str) -> bytes | None:
    try:
        return storage.getxattr(path, name)
    except OSError as exc:
        if exc.errno in _MISSING:
            return None
        raise


def read_upload(path: str | os.PathLike) -> FileUpload:
    """The three attributes of `path` (None where missing; other OSErrors are raised)."""
    uncommitted = _attr(path, UNCOMMITTED)
    if uncommitted is None:  # no DriveFS attributes here: skip the other two reads
        return FileUpload(None, None, None)
    return FileUpload(uncommitted, _attr(path, ITEM_ID), _attr(path, MD5))


def cloud_id(path: str | os.PathLike) -> str | None:
    """The Drive item id DriveFS reports for `path`; None where it reports none, or only a local
    placeholder (not in the cloud yet), or the read fails (unknown: the caller finds it another way)."""
    try:
        value = _attr(path, ITEM_ID)
    except OSError:
        return None
    text = value.decode(errors="replace").strip() if value else ""
    return text if text and not text.startswith("local") else None


def _mount_of(path: Path) -> tuple[str, str, str] | None:
    """(mount point, filesystem type, source) of the mount holding `path`, from mountinfo."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    best = None
    target = str(path)
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 2:
            continue
        point = fields[4].replace("\\040", " ")
        if (target == point or target.startswith(point.rstrip("/") + "/")) and (best is None or len(point) > len(best[0])):
            best = (point, tail[0], tail[1])
    return best


def is_drive_mount(path: str | os.PathLike) -> bool:
    """True under Colab's Drive mount point, or on a FUSE mount served by a daemon named "drive".

    Colab starts DriveFS as the program `drive` (colabtools `drive.py`), which libfuse reports as
    filesystem type `fuse.drive`; the emulator in the tests names itself the same way.
    """
    path = Path(path).absolute()
    if str(path) == COLAB_MOUNT or str(path).startswith(COLAB_MOUNT + "/"):
        return True
    mount = _mount_of(path)
    return mount is not None and (mount[1] == "fuse.drive" or (mount[1].startswith("fuse") and mount[2] == "drive"))


def folder_kind(folder: str | os.PathLike, on_drive: bool = False) -> str:
    """DRIVEFS, UNCONFIRMED or PLAIN for the persistent folder `folder` (which must exist).

    The folder and a few files in it are asked (whether DriveFS gives folders the attributes
    is not known; `start_run` has written the lease file there by then).
    """
    folder = Path(folder)
    for attempt in range(3):  # a failed read is asked again: it says nothing about the attributes
        try:
            probes = [folder, *sorted(p for p in folder.iterdir() if p.is_file())[:3]]
            if any(read_upload(path).has_attributes for path in probes):
                return DRIVEFS
            break
        except OSError as exc:  # e.g. errno 107 for good: decide from the mount itself
            log.debug("cannot read DriveFS attributes of %s: %s", folder, exc)
            time.sleep(0.5 * (attempt + 1))
    return UNCONFIRMED if on_drive or is_drive_mount(folder) else PLAIN


def describe_kind(kind: str) -> str:
    """One line for the user: what "in the cloud" means on this kind of folder."""
    return {
        DRIVEFS: "Google Drive; a checkpoint counts as in the cloud once DriveFS reports every file uploaded",
        UNCONFIRMED: ("Google Drive, but DriveFS's upload attributes are missing here: checkpoints are "
                      "shown as written, upload not confirmed (run ck.drive_check() to see what Drive reports)"),
        PLAIN: "a plain folder; a checkpoint counts as safe once written, fsynced and read back",
        API: ("Google Drive, confirmed through Drive's API: a checkpoint counts as in the cloud once Drive's "
              "servers hold every file with the manifest's size and md5"),
    }[kind]


def in_cloud(folder: Path, files: dict[str, str | None], kind: str) -> tuple[bool, int]:
    """Whether every file of `files` (name -> our md5 or None) under `folder` is in the cloud.

    Returns:
        (all in the cloud, bytes of the files not yet in the cloud). On a PLAIN folder written
        files count as in the cloud; on an UNCONFIRMED one nothing ever does.

    Raises:
        OSError: a file is missing or unreadable (the caller decides what that means).
    """
    pending = 0
    for name, md5 in files.items():
        path = folder / name
        if kind == PLAIN:
            storage.stat(path)
            continue
        if kind == UNCONFIRMED or not read_upload(path).in_cloud(md5):
            pending += storage.stat(path).st_size
    return pending == 0 and kind != UNCONFIRMED, pending


def check_space(folder: Path, needed: int, pending: int, what: str) -> None:
    """Refuse to start an upload that cannot fit: a full Drive fails it half-way, and cleaning up
    the half-copy fills the Trash.

    Raises:
        OSError(ENOSPC): less free space than `needed` plus `pending` (written, not yet uploaded).
    """
    try:
        st = os.statvfs(folder)
    except OSError:
        return
    if not st.f_blocks:  # the filesystem reports no size
        return
    free = st.f_bavail * st.f_frsize
    if free < needed + pending:
        raise OSError(errno.ENOSPC, f"{folder} has {format_bytes(free)} free, but {what} needs "
                      f"{format_bytes(needed)} plus {format_bytes(pending)} still uploading, so its upload "
                      f"was not started. Free space on Drive (its Trash counts too) or lower keep")


class TrashFreeDeleter:
    """Deletes folders so that Drive's Trash keeps only empty stubs.

    Drive moves every deleted file to its Trash, which counts against the quota for 30 days
    (Drive Help 2375194): a 1.3 GB checkpoint every 10 minutes fills a free Drive in hours. So on
    a Drive mount each file is first truncated to 0 bytes; only once that truncation is in the
    cloud (or, without attributes, after a grace period) are the files unlinked. On a plain
    folder a delete is a delete. `start` never blocks; `poll` finishes what is ready.
    """

    def __init__(self, kind: str, grace_s: float = UNCONFIRMED_GRACE_S):
        self.kind = kind
        self.grace_s = grace_s
        self._waiting: dict[Path, float] = {}  # folder -> when its files were truncated

    @property
    def pending(self) -> list[Path]:
        return list(self._waiting)

    def start(self, folder: Path, first: str | None = None) -> None:
        """Begin deleting `folder`; the file named `first` (its manifest) is emptied first, so a
        kill half-way leaves a folder that no longer passes for a checkpoint."""
        if self.kind == PLAIN:
            _remove_tree(folder, first)
            return
        files = _files(folder)
        files.sort(key=lambda p: p.name != first)
        for path in files:
            if path.stat().st_size:
                os.truncate(path, 0)
        self._waiting[folder] = time.monotonic()

    def poll(self) -> list[Path]:
        """Unlink the folders whose truncations are in the cloud; returns them."""
        done = []
        for folder, since in list(self._waiting.items()):
            try:
                ready = self._truncation_in_cloud(folder, since)
                if ready:
                    _remove_tree(folder, None)
            except FileNotFoundError:
                ready = True
            except OSError as exc:  # Drive trouble: try again at the next poll
                log.debug("deleting %s: %s", folder, exc)
                continue
            if ready:
                del self._waiting[folder]
                done.append(folder)
        return done

    def _truncation_in_cloud(self, folder: Path, since: float) -> bool:
        if self.kind == UNCONFIRMED:
            return time.monotonic() - since >= self.grace_s
        return all(read_upload(path).uncommitted == b"0" for path in _files(folder))


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def _remove_tree(folder: Path, first: str | None) -> None:
    if first is not None:
        (folder / first).unlink(missing_ok=True)
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        if path.is_dir():
            path.rmdir()
        else:
            path.unlink()
    folder.rmdir()
