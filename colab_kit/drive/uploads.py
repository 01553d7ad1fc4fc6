"""One folder on its way to the cloud (`Upload`): what must be there, its sizes and md5s, and its timings.

`CloudTracker` (`cloud.py`) follows these until they are confirmed; `publish.py`, `final.py` and
`upkeep.py` make them from a published folder's manifest.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoints.clock import clock
from ..checkpoints import storage
from ..checkpoints.manifest import MANIFEST, Manifest, parse_manifest

__all__ = ["Upload", "cloud_files", "learn_manifest", "upload_for"]


@dataclass
class Upload:
    """One folder written to the persistent folder, on its way to the cloud."""

    label: str  # "checkpoint-30" or "final"
    step: int | None  # None for final/
    folder: Path
    files: dict[str, str | None]  # name -> our md5 (None: not known), MANIFEST.json included
    bytes: int
    saved: float  # clock.time() when its state was saved on local disk
    started: float = field(default_factory=clock.monotonic)  # writing to the folder began
    written: float = field(default_factory=clock.monotonic)  # its manifest was written
    measure: bool = True  # False when `started` is not known (found at start-up)
    confirmed: float | None = None  # clock.monotonic() when seen in the cloud
    confirmed_at: float | None = None  # clock.time() of the same moment
    pending_bytes: int = 0
    next_poll: float = 0.0
    verified: bool = True  # every byte known to match the manifest (False: found at start, not read yet)
    written_at: float = field(default_factory=clock.time)  # clock.time() when its manifest was written
    missing_since: float | None = None  # clock.monotonic() since when a poll cannot find it
    source: Path | None = None  # a local folder with the same files, to upload it again from
    manifest: Manifest | None = None
    sizes: dict[str, int] = field(default_factory=dict)  # name -> bytes, MANIFEST.json included
    polls: int = 0  # times its cloud state was asked
    api_calls: int = 0  # Drive API requests spent on it (confirm="api")


def cloud_files(folder: Path, manifest: Manifest) -> dict[str, str | None]:
    """What must be in the cloud for `folder` to be: name -> our md5 (None: not known), its
    MANIFEST.json included."""
    files: dict[str, str | None] = {name: entry.md5 or None for name, entry in manifest.files.items()}
    try:
        files[MANIFEST] = hashlib.md5(storage.read_bytes(folder / MANIFEST)).hexdigest()
    except OSError:
        files[MANIFEST] = None
    return files


def learn_manifest(upload: Upload) -> None:
    """The size and md5 of `upload`'s MANIFEST.json, where a read failed when it was written (without them Drive's
    API can never confirm the folder): read now, and kept only when the bytes hold the same manifest.

    Raises:
        OSError: it could not be read now (the next poll tries again)."""
    if upload.manifest is None or (MANIFEST in upload.sizes and upload.files.get(MANIFEST) is not None):
        return
    raw = storage.read_bytes(upload.folder / MANIFEST)
    there = parse_manifest(raw)
    if there is None or there.files != upload.manifest.files or there.step != upload.manifest.step:
        return  # another manifest now: what was written is not there to confirm
    upload.sizes[MANIFEST], upload.files[MANIFEST] = len(raw), hashlib.md5(raw).hexdigest()


def upload_for(folder: Path, manifest: Manifest, label: str, *, saved: float | None = None,
               started: float | None = None, measure: bool = True, source: Path | None = None,
               verified: bool = True, written_at: float | None = None) -> Upload:
    """The `Upload` of a published folder whose MANIFEST.json is `manifest`."""
    files = cloud_files(folder, manifest)
    sizes = {name: entry.size for name, entry in manifest.files.items()}
    try:
        sizes[MANIFEST] = storage.stat(folder / MANIFEST).st_size
    except OSError:
        pass  # not known: the API cannot confirm it until it is
    now = clock.monotonic()
    return Upload(label=label, step=manifest.step if label != "final" else None, folder=folder, files=files,
                  bytes=manifest.total_bytes, saved=manifest.created if saved is None else saved,
                  started=now if started is None else started, written=now, measure=measure,
                  pending_bytes=manifest.total_bytes, source=source, verified=verified,
                  written_at=clock.time() if written_at is None else written_at, manifest=manifest, sizes=sizes)
