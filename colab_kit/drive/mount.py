"""Where a run's persistent folder lives, and mounting Google Drive in Colab.

    drive=ROOT or $COLAB_KIT_DRIVE   ->  ROOT/<name>/                      (anywhere)
    in Colab                         ->  /content/drive/MyDrive/colab_kit/<name>/
    elsewhere                        ->  ./drive/<name>/   (a local folder stands in for Drive)
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

from ..errors import DriveError
from ..runtime import in_colab

__all__ = ["ENV_DRIVE", "COLAB_MOUNT", "resolve_root", "mount_drive", "remount_drive", "flush_and_unmount",
           "flush_hint"]

ENV_DRIVE = "COLAB_KIT_DRIVE"
COLAB_MOUNT = "/content/drive"
COLAB_SUBDIR = "colab_kit"  # under MyDrive
LOCAL_DEFAULT = "drive"
log = logging.getLogger(__name__)


def _is_mounted(mountpoint: Path) -> bool:
    try:
        return (mountpoint / "MyDrive").is_dir()
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            return False
        raise


def _drive_module():
    from google.colab import drive  # only reached in Colab (or with a stand-in in tests)

    return drive


def mount_drive(mountpoint: str | None = None) -> Path:
    """Mount Google Drive (a no-op when it is mounted); returns the MyDrive folder.

    Never writes under the mount point before mounting (mounting fails on a non-empty folder),
    and remounts with `force_remount=True` when the mount answers errno 107 ("Transport
    endpoint is not connected"), which happens hours into long runs.
    """
    mp = Path(mountpoint or COLAB_MOUNT)
    try:
        if _is_mounted(mp):
            return mp / "MyDrive"
    except OSError as exc:
        raise DriveError(f"cannot look at {mp}: {exc}") from exc
    stale = False
    try:
        os.listdir(mp)
    except FileNotFoundError:
        pass
    except OSError as exc:
        stale = exc.errno == errno.ENOTCONN
    if not stale and mp.is_dir() and any(mp.iterdir()):
        raise DriveError(
            f"{mp} already holds files but Drive is not mounted there, so mounting would fail. "
            f"Something wrote there before mounting; move those files away (for example "
            f"`!mv {mp} /content/drive_old`) and run this cell again.")
    drive = _drive_module()
    try:
        drive.mount(str(mp), force_remount=stale)
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ENOTCONN and not stale:
            drive.mount(str(mp), force_remount=True)
        else:
            raise DriveError(f"mounting Google Drive at {mp} failed: {exc}. Run the cell again; "
                             f"if it keeps failing use Runtime -> Disconnect and delete runtime, "
                             f"or pass drive='/content/some_local_folder' to keep the run local.") from exc
    if not _is_mounted(mp):
        raise DriveError(f"Google Drive did not appear at {mp}/MyDrive after mounting")
    return mp / "MyDrive"


def remount_drive(mountpoint: str | None = None) -> None:
    """Force a remount after errno 107 (main thread only: it may ask for authorisation)."""
    _drive_module().mount(mountpoint or COLAB_MOUNT, force_remount=True)


def flush_and_unmount() -> None:
    """Colab's only flush: push Drive's cache to the cloud, then unmount (main thread only).

    Raises:
        DriveError: Colab reported a failure (colabtools raises ValueError('flush_and_unmount failed')).
    """
    try:
        _drive_module().flush_and_unmount()
    except Exception as exc:
        raise DriveError(f"drive.flush_and_unmount() failed: {exc}. Files may still be in Drive's cache on "
                         f"this VM; keep the runtime connected, mount Drive again and check with "
                         f"`python -m colab_kit status <run folder>`") from exc


def resolve_root(drive: str | os.PathLike | None = None) -> tuple[Path, bool]:
    """The root folder that holds run folders, and whether it is on Colab's Google Drive mount.

    Raises:
        DriveError: a folder under /content/drive while Drive is not mounted there: it would be created
            on the VM's disk, called Google Drive, lost with the runtime, and make mounting fail later.
    """
    if drive is not None or os.environ.get(ENV_DRIVE):
        root = Path(drive if drive is not None else os.environ[ENV_DRIVE]).expanduser().absolute()
        real = root.resolve()  # a folder reached through a symlink into Drive is on Drive
        under_mount = any(Path(COLAB_MOUNT) == p or Path(COLAB_MOUNT) in p.parents for p in (root, real))
        if under_mount and not _is_mounted(Path(COLAB_MOUNT)):
            raise DriveError(
                f"{root} is under {COLAB_MOUNT}, but Google Drive is not mounted there, so it would be a folder "
                f"on this VM's disk (lost with the runtime) and Drive could not be mounted over it later. Mount "
                f"Drive first: from google.colab import drive; drive.mount({COLAB_MOUNT!r}). Or give a folder "
                f"outside {COLAB_MOUNT} to keep the run on this VM, for example drive='/content/runs'")
        return root, under_mount
    if in_colab():
        return mount_drive() / COLAB_SUBDIR, True
    return Path(LOCAL_DEFAULT).absolute(), False


def flush_hint() -> str:
    """What to tell a Colab user about Drive's own upload cache."""
    return ("files written to /content/drive reach the cloud when Drive uploads them in the background; "
            "before you close this runtime on purpose, run run.finish(flush=True) (or `from google.colab "
            "import drive; drive.flush_and_unmount()`) to push them; it also unmounts Drive.")
