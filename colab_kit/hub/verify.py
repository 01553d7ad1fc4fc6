"""Is a checkpoint in the cloud on the Hub? Only what the Hub's own listing proves.

A checkpoint folder is *in the cloud* when a tree listing shows every file its manifest names, each with
the manifest's size and with the LFS object id the Hub computed, which is the sha256 of the content (the
manifest's own hash), and shows MANIFEST.json itself with the content this runtime wrote (its LFS sha256,
or, for a file kept in git, its git blob id). The run's `.gitattributes` sends every checkpoint file
through LFS (`GITATTRIBUTES`), so the proof is the content's hash, never a name or a size.

A file missing from a listing, or listed with another hash, proves nothing by itself here: it is
"not shown" (the caller looks again later; absence is not evidence, DESIGN §4).
"""

from __future__ import annotations

import hashlib

from ..checkpoints.manifest import MANIFEST, Manifest
from .repo import HubFile

__all__ = ["git_blob_id", "not_shown", "GITATTRIBUTES", "lfs_rule"]

GITATTRIBUTES = ".gitattributes"


def lfs_rule(folder: str) -> str:
    """The `.gitattributes` line that stores every file of the runs under `folder` in LFS."""
    pattern = f"{folder}/**" if folder else "**"
    return f"{pattern} filter=lfs diff=lfs merge=lfs -text"


def git_blob_id(data: bytes) -> str:
    """The id git gives a file's content (what a listing shows for a file not in LFS)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _same_content(listed: HubFile, data: bytes) -> bool:
    if listed.size != len(data):
        return False
    if listed.sha256 is not None:
        return listed.sha256 == hashlib.sha256(data).hexdigest()
    return listed.blob_id == git_blob_id(data)


def not_shown(folder: str, manifest: Manifest, manifest_bytes: bytes, listing: dict[str, HubFile]) -> list[str]:
    """The files of the checkpoint in `folder` (a path in the repo) that `listing` does not show as written:
    missing, another size, or another hash. Empty: the checkpoint is in the cloud."""
    missing = []
    for name, entry in manifest.files.items():
        listed = listing.get(f"{folder}/{name}")
        if listed is None or listed.size != entry.size or listed.sha256 != entry.sha256:
            missing.append(name)
    listed = listing.get(f"{folder}/{MANIFEST}")
    if listed is None or not _same_content(listed, manifest_bytes):
        missing.append(MANIFEST)
    return missing
