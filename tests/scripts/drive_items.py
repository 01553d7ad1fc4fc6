"""What the emulated Drive calls its items: ids and the Trash's index, shared by the DriveFS emulator
(`drivefs_emulator.py`, a FUSE filesystem) and the emulated Drive API (`drive_api_server.py`, plain HTTP).

Kept apart from the emulator so that what needs no FUSE (the API server, the simulator, their tests)
imports no FUSE binding: `mfusepy` raises OSError at import where libfuse is absent.
"""

from __future__ import annotations

import os


def cloud_id(cloud: str, path: str) -> str:
    """An item's id: the same in the mount's `user.drive.id` and in the emulated Drive API, which
    serves the same cloud folder. Stable across renames (the inode); a new upload of a file is a new
    inode here, a new revision on Drive (ids are only compared within one listing)."""
    if os.path.abspath(path) == os.path.abspath(cloud):
        return "cloud-root"
    return f"cloud-{os.stat(path).st_ino}"


def trash_index(trash: str) -> str:
    """Where the emulator notes each trashed item's id, parent and name (one JSON line each)."""
    return os.path.abspath(trash).rstrip("/") + ".index.jsonl"
