"""What the mirror's worker does besides uploading checkpoints, so that the training thread never
touches Drive: small files the training loop hands over (`micro_batch.json`), the local copies kept
until their checkpoint is safe, and uploading again what Drive lost.

Each piece is tried when due and, on Drive trouble, again later; none of them raises.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Callable

from ..checkpoints.clock import clock
from .._units import format_age
from ..checkpoints import storage
from ..checkpoints.snapshot import Snapshot, discard
from .cloud import CloudTracker, Upload, upload_for

__all__ = ["DeferredWrites", "KeptCopies", "MISSING_GRACE_S", "MAX_KEPT"]

log = logging.getLogger(__name__)
# A followed upload that a poll cannot find for this long is uploaded again from its local copy
# (a file can vanish from Drive's listing for a moment; one that stays away is lost).
MISSING_GRACE_S = 30.0
# Local copies kept for uploading again, at most (hard links: they cost disk once the Trainer deleted
# its own copy). Confirmations that stall must not fill the VM's disk until a save fails.
MAX_KEPT = 2


class DeferredWrites:
    """Small files to write to the persistent folder from the mirror's worker: bytes, a JSON document,
    or a function of the bytes there now (None: none) that returns the bytes to write (a merge). The
    newest content of each path wins; a write that fails waits for the next flush."""

    def __init__(self):
        self._lock = threading.Lock()
        self._waiting: dict[Path, object] = {}

    def write_later(self, path: str | Path, data) -> None:
        if not isinstance(data, bytes) and not callable(data):
            data = (json.dumps(data, indent=1, sort_keys=True) + "\n").encode()
        with self._lock:
            self._waiting[Path(path)] = data

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._waiting)

    def drop(self) -> None:
        """Forget what waits (the run folder is another runtime's now)."""
        with self._lock:
            self._waiting.clear()

    def flush(self, lease_ok: Callable[[], bool | None] = lambda: True) -> bool:
        """Write what waits, while the lease is this runtime's; True when nothing is left."""
        with self._lock:
            waiting = dict(self._waiting)
        if waiting and lease_ok() is not True:
            return False
        for path, data in waiting.items():
            try:
                storage.atomic_write_bytes(path, data(_current(path)) if callable(data) else data)
            except OSError as exc:
                log.debug("writing %s failed (%s); it waits", path, exc)
                continue
            with self._lock:
                if self._waiting.get(path) is data:
                    del self._waiting[path]
        return not self.pending


def _current(path: Path) -> bytes | None:
    """What a merge starts from: the file's bytes, None when it is not there (OSError: unknown, try later)."""
    try:
        return storage.read_bytes(path)
    except FileNotFoundError:
        return None


class KeptCopies:
    """The local snapshots of checkpoints already written to the persistent folder, kept until their
    checkpoint is in the cloud, so that one Drive lost can be uploaded again. At most `MAX_KEPT`: while
    confirmations do not come, the oldest copy goes (said once), and training goes on."""

    def __init__(self, tracker: CloudTracker, notices, journal, most: int | None = None):
        self.tracker, self.notices, self.journal = tracker, notices, journal
        self.most = MAX_KEPT if most is None else most
        self._kept: dict[int, Snapshot] = {}
        self.reuploads = 0
        self._told = False

    def keep(self, snap: Snapshot) -> None:
        old = self._kept.pop(snap.step, None)
        if old is not None and old.path != snap.path:
            discard(old)
        self._kept[snap.step] = snap
        while len(self._kept) > self.most:
            oldest = min(self._kept)
            discard(self._kept.pop(oldest))
            if not self._told:
                self._told = True
                upload = self.tracker.get(f"checkpoint-{oldest}")
                waited = format_age(clock.monotonic() - upload.written) if upload is not None else "a while"
                self.notices.add(f"Drive has not confirmed checkpoint-{oldest} after {waited}; this VM keeps local "
                                 f"copies of only the {self.most} newest checkpoints waiting for Drive, so that its "
                                 f"disk does not fill. Training goes on; Drive keeps every checkpoint it was given")
                self.journal.write("warn", what="kept_copies_bounded", dropped=oldest, most=self.most)

    def release_safe(self) -> None:
        """Let go of the copies whose checkpoint is in the cloud, pruned or forgotten."""
        for step, snap in list(self._kept.items()):
            upload = self.tracker.get(f"checkpoint-{step}")
            if upload is None or upload.confirmed is not None:
                discard(self._kept.pop(step))

    def discard_all(self) -> None:
        for snap in self._kept.values():
            discard(snap)
        self._kept.clear()

    def upload_missing(self, publisher, lease_ok) -> None:
        """Upload again, from its local copy, what a poll has not found for MISSING_GRACE_S: through the
        `publisher`'s rules of a first write (`Publisher.write_again`: the folder read now, another checkpoint
        there left alone), the missing files only where it holds this one (a checkpoint whole in the cloud stays
        whole meanwhile)."""
        for upload in self.tracker.missing(MISSING_GRACE_S):
            try:
                source = upload.source if upload.source is not None and storage.is_dir(upload.source) else None
            except OSError:
                source = None
            if source is None or upload.manifest is None:  # lost for good: said, and no longer followed
                self.journal.write("warn", what="missing_in_cloud", label=upload.label)
                self.notices.add(f"{upload.label} is missing from {upload.folder.parent} and no local copy is left "
                                 f"to upload it again; it was never counted as in the cloud, and is not followed "
                                 f"any more")
                self.tracker.forget(upload.label)
                continue
            try:
                ours = publisher.write_again(source, upload.folder, upload.manifest, lease_ok)
            except OSError as exc:
                log.info("uploading %s again failed: %s", upload.label, exc)
                continue
            if not ours:
                self._not_ours(upload)
                continue
            self.reuploads += 1
            self.journal.write("warn", what="reuploaded", label=upload.label, missing_s=round(
                clock.monotonic() - upload.missing_since, 1))
            self.tracker.add(_again(upload))

    def _not_ours(self, upload: Upload) -> None:
        """`upload`'s folder holds another checkpoint of its step now: left as it is, and no longer followed."""
        self.journal.write("warn", what="not_ours_now", label=upload.label)
        self.notices.add(f"{upload.folder} holds another checkpoint of step {upload.step} now (another runtime's, or "
                         f"one published again): it was left as it is, and this runtime's {upload.label}, never "
                         f"counted as in the cloud, was not uploaded again")
        self.tracker.forget(upload.label)


def _again(upload: Upload) -> Upload:
    """A fresh `Upload` for a folder published again (the old one's timing no longer applies)."""
    return upload_for(upload.folder, upload.manifest, upload.label, saved=upload.saved, measure=False,
                      source=upload.source)
