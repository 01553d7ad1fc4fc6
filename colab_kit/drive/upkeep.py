"""What the mirror's thread does besides uploading checkpoints, so that the training thread never
touches Drive: small files the training loop hands over (`micro_batch.json`), the journal's queued
lines, the local copies kept until their checkpoint is safe, and uploading again what Drive lost.

Each piece is tried when due and, on Drive trouble, again later; none of them raises.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from ..checkpoints import storage
from ..checkpoints.checkpoint import publish_folder
from ..checkpoints.snapshot import Snapshot, discard
from .cloud import CloudTracker, Upload, upload_for
from .drivefs import UNCONFIRMED

__all__ = ["DeferredWrites", "KeptCopies", "MISSING_GRACE_S"]

log = logging.getLogger(__name__)
# A followed upload that a poll cannot find for this long is uploaded again from its local copy
# (a file can vanish from Drive's listing for a moment; one that stays away is lost).
MISSING_GRACE_S = 30.0


class DeferredWrites:
    """Small files to write to the persistent folder from the mirror's thread (bytes, or a JSON
    document); the newest content of each path wins, and a write that fails waits for the next flush."""

    def __init__(self):
        self._lock = threading.Lock()
        self._waiting: dict[Path, bytes] = {}

    def write_later(self, path: str | Path, data) -> None:
        if not isinstance(data, bytes):
            data = (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()
        with self._lock:
            self._waiting[Path(path)] = data

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._waiting)

    def flush(self) -> bool:
        """Write what waits; True when nothing is left."""
        with self._lock:
            waiting = dict(self._waiting)
        for path, data in waiting.items():
            try:
                storage.atomic_write_bytes(path, data)
            except OSError as exc:
                log.debug("writing %s failed (%s); it waits", path, exc)
                continue
            with self._lock:
                if self._waiting.get(path) is data:
                    del self._waiting[path]
        return not self.pending


class KeptCopies:
    """The local snapshots of checkpoints already written to the persistent folder, kept until their
    checkpoint is safe (in the cloud; settled on a Drive mount without attributes), so that one Drive
    lost can be uploaded again. Hard links: they cost local disk only once the Trainer has deleted its
    own copy."""

    def __init__(self, tracker: CloudTracker, settle_age):
        self.tracker = tracker
        self.settle_age = settle_age  # bytes -> seconds (the Pruner's Settle.age)
        self._kept: dict[int, Snapshot] = {}
        self.reuploads = 0

    def keep(self, snap: Snapshot) -> None:
        old = self._kept.pop(snap.step, None)
        if old is not None and old.path != snap.path:
            discard(old)
        self._kept[snap.step] = snap

    def release_safe(self) -> None:
        """Let go of the copies whose checkpoint is safe, pruned or forgotten."""
        settled = self.tracker.settled_steps(self.settle_age) if self.tracker.kind == UNCONFIRMED else set()
        for step, snap in list(self._kept.items()):
            upload = self.tracker.get(f"checkpoint-{step}")
            if upload is None or upload.confirmed is not None or step in settled:
                discard(self._kept.pop(step))

    def discard_all(self) -> None:
        for snap in self._kept.values():
            discard(snap)
        self._kept.clear()

    def upload_missing(self, journal, notices, lease_ok) -> None:
        """Upload again, from its local copy, what a poll has not found for MISSING_GRACE_S."""
        for upload in self.tracker.missing(MISSING_GRACE_S):
            source = upload.source if upload.source is not None and upload.source.is_dir() else None
            if source is None or upload.manifest is None:  # lost for good: said, and no longer followed
                journal.write("warn", what="missing_in_cloud", label=upload.label)
                notices.add(f"{upload.label} is missing from {upload.folder.parent} and no local copy is left "
                            f"to upload it again; it was never counted as in the cloud, and is not followed any more")
                self.tracker.forget(upload.label)
                continue
            if lease_ok() is not True:
                return
            try:
                publish_folder(source, upload.folder, upload.manifest)
            except OSError as exc:
                log.info("uploading %s again failed: %s", upload.label, exc)
                continue
            self.reuploads += 1
            journal.write("warn", what="reuploaded", label=upload.label, missing_s=round(
                time.monotonic() - upload.missing_since, 1))
            self.tracker.add(_again(upload))


def _again(upload: Upload) -> Upload:
    """A fresh `Upload` for a folder published again (the old one's timing no longer applies)."""
    return upload_for(upload.folder, upload.manifest, upload.label, saved=upload.saved, measure=False,
                      source=upload.source)
