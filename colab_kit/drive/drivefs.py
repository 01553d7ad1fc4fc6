"""What Google Drive's FUSE daemon (DriveFS) says about uploads, and what kind of folder the run is in.

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
    UNCONFIRMED  a Drive mount whose attributes are missing, and any mount not known to be local
                 (rclone, sshfs, gcsfuse, nfs, ...): written is all the kit can know there, and
                 nothing is ever called "in the cloud" (Drive's API can still confirm: `driveapi.py`)
    PLAIN        a folder on this machine's own filesystem (ext4, xfs, tmpfs, overlay, ...): written,
                 fsynced and read back is as durable as it gets

Paths are resolved first (a run folder reached through a symlink into Drive is on Drive). Every read
of these attributes in the kit goes through this module.
"""

from __future__ import annotations

import errno
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from ..checkpoints.clock import clock
from .._units import format_bytes
from ..checkpoints import storage

__all__ = ["UNCOMMITTED", "ITEM_ID", "MD5", "DRIVEFS", "UNCONFIRMED", "PLAIN", "API", "HUB", "FileUpload", "cloud_id",
           "read_upload", "folder_kind", "probe_kind", "is_drive_mount", "is_local_filesystem", "LOCAL_FILESYSTEMS",
           "in_cloud", "cloud_name", "describe_kind", "check_space"]

UNCOMMITTED = "user.drive.uncommitted"
ITEM_ID = "user.drive.id"
MD5 = "user.drive.md5"
DRIVEFS, UNCONFIRMED, PLAIN = "drivefs", "unconfirmed", "plain"
API = "api"  # confirmed through Drive's API (`driveapi.py`), whatever the mount reports
HUB = "hub"  # a replica on local disk of a run folder on the Hugging Face Hub (`hub/store.py`)
COLAB_MOUNT = "/content/drive"
_MISSING = (errno.ENODATA, errno.ENOTSUP, getattr(errno, "ENOATTR", errno.ENODATA))
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


# Filesystems known to live on this machine's own disks or memory: there, written, fsynced and read
# back is as durable as it gets. Every other mount without DriveFS's attributes (fuse.rclone, sshfs,
# gcsfuse, nfs, cifs, 9p, a FUSE daemon of another name) may be a cloud behind a cache, so it is
# UNCONFIRMED: nothing there is called safe on a guess.
LOCAL_FILESYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "zfs", "f2fs", "tmpfs", "overlay"})


def is_drive_mount(path: str | os.PathLike) -> bool:
    """True when `path`, symlinks followed, lies under Colab's Drive mount point, or on a FUSE mount
    served by a daemon named "drive".

    Colab starts DriveFS as the program `drive` (colabtools `drive.py`), which libfuse reports as
    filesystem type `fuse.drive`; the emulator in the tests names itself the same way.
    """
    try:
        path = storage.resolve(path)
    except OSError:
        path = Path(path).absolute()
    if str(path) == COLAB_MOUNT or str(path).startswith(COLAB_MOUNT + "/"):
        return True
    mount = storage.mount_of(path)
    return mount is not None and (mount[1] == "fuse.drive" or (mount[1].startswith("fuse") and mount[2] == "drive"))


def is_local_filesystem(path: str | os.PathLike) -> bool:
    """True when `path`, symlinks followed, lies on a filesystem of this machine (`LOCAL_FILESYSTEMS`);
    False for any other mount, and when the mount cannot be told (unknown is not local)."""
    try:
        mount = storage.mount_of(storage.resolve(path))
    except OSError:
        return False
    return mount is not None and mount[1] in LOCAL_FILESYSTEMS and not is_drive_mount(path)


def folder_kind(folder: str | os.PathLike, on_drive: bool = False, waits=(0.5, 1.0, 2.0)) -> str:
    """DRIVEFS, UNCONFIRMED or PLAIN for the persistent folder `folder` (which must exist): `probe_kind`'s kind."""
    return probe_kind(folder, on_drive, waits)[0]


def probe_kind(folder: str | os.PathLike, on_drive: bool = False, waits=(0.5, 1.0, 2.0)) -> tuple[str, bool]:
    """(kind, settled) of the persistent folder `folder`: `settled` is False when the attributes could not be
    read at all, so that UNCONFIRMED stands only until a later read answers (the mirror asks again).

    DRIVEFS where the attributes answer (the folder and a few files in it are asked: whether DriveFS
    gives folders the attributes is not known; `start_run` has written the lease file there by then).
    PLAIN only on a filesystem known to be local (`is_local_filesystem`); any other folder, and one whose
    attributes could not be read at all, is UNCONFIRMED: what is not known is never taken as safe.
    """
    folder = storage.resolve(folder)
    failed = None
    for wait in (0.0, *waits):  # a failed read is asked again: it says nothing about the attributes
        clock.sleep(wait)
        try:
            probes = [folder, *sorted(Path(e.path) for e in storage.list_dir(folder) if not e.is_dir())[:3]]
            if any(read_upload(path).has_attributes for path in probes):
                return DRIVEFS, True
            failed = None
            break
        except OSError as exc:  # e.g. errno 107 for good
            log.debug("cannot read DriveFS attributes of %s: %s", folder, exc)
            failed = exc
    if failed is not None:
        return UNCONFIRMED, False
    if on_drive or not is_local_filesystem(folder):
        return UNCONFIRMED, True
    return PLAIN, True


def describe_kind(kind: str) -> str:
    """One line for the user: what "in the cloud" means on this kind of folder."""
    return {
        DRIVEFS: "Google Drive; a checkpoint counts as in the cloud once DriveFS reports every file uploaded",
        UNCONFIRMED: ("Google Drive, but DriveFS's upload attributes are missing here: checkpoints are "
                      "shown as written, upload not confirmed (run ck.drive_check() to see what Drive reports)"),
        PLAIN: "a plain folder; a checkpoint counts as safe once written, fsynced and read back",
        API: ("Google Drive, confirmed through Drive's API: a checkpoint counts as in the cloud once Drive's "
              "servers hold every file with the manifest's size and md5"),
        HUB: ("the Hugging Face Hub: each checkpoint is one commit, in the cloud once the repo lists every file "
              "with the manifest's sha256"),
    }[kind]


def cloud_name(kind: str) -> str:
    """What uploads the run's checkpoints, in a message: "the Hub" or "Drive"."""
    return "the Hub" if kind == HUB else "Drive"


def in_cloud(folder: Path, files: dict[str, str | None], kind: str) -> tuple[bool, int]:
    """Whether every file of `files` (name -> our md5 or None) under `folder` is in the cloud.

    Returns:
        (all in the cloud, bytes of the files not yet in the cloud). On a PLAIN folder written
        files count as in the cloud; on an UNCONFIRMED one nothing ever does.

    Raises:
        OSError: a file is missing or unreadable (the caller decides what that means).
    """
    pending, every = 0, kind != UNCONFIRMED
    for name, md5 in files.items():
        path = folder / name
        if kind == PLAIN:
            storage.stat(path)
            continue
        if kind == UNCONFIRMED or not _committed(path, md5):
            every = False  # counted apart from the bytes: an emptied file has none to count
            pending += storage.stat(path).st_size
    return every, pending


def _committed(path: Path, md5: str | None) -> bool:
    """`read_upload(path).in_cloud(md5)`, sparing the id and md5 reads of a file not committed yet (a poll
    asks every pending file each time)."""
    uncommitted = _attr(path, UNCOMMITTED)
    if uncommitted != b"0":
        return False
    return FileUpload(uncommitted, _attr(path, ITEM_ID), _attr(path, MD5)).in_cloud(md5)


def check_space(folder: Path, needed: int, pending: int, what: str) -> None:
    """Refuse to start an upload that cannot fit: a full Drive fails it half-way, and cleaning up
    the half-copy fills the Trash.

    Raises:
        OSError(ENOSPC): less free space than `needed` plus `pending` (written, not yet uploaded).
    """
    try:
        free = storage.free_bytes(folder)
    except OSError:
        return
    if free is None:  # the filesystem reports no size
        return
    if free < needed + pending:
        raise OSError(errno.ENOSPC, f"{folder} has {format_bytes(free)} free, but {what} needs "
                      f"{format_bytes(needed)} plus {format_bytes(pending)} still uploading, so its upload "
                      f"was not started. Free space on Drive (its Trash counts too) or lower keep")
