"""Writing one checkpoint's snapshot to the persistent folder, for the mirror's thread: the files
first, each read back, MANIFEST.json last (`checkpoints.checkpoint.publish_folder`), after checking
that the lease is still this runtime's and that the folder has room; and saying how it went.
"""

from __future__ import annotations

import errno
import logging
import time
from pathlib import Path
from typing import Callable

from .._notices import Notices
from .._units import format_age, format_bytes
from ..checkpoints import validity
from ..checkpoints.checkpoint import CHECKPOINTS, checkpoint_dir, publish_folder
from ..checkpoints.journal import Journal
from ..checkpoints.manifest import Manifest, read_manifest
from ..checkpoints.snapshot import Snapshot, snapshot_manifest
from .cloud import CloudTracker, Upload, upload_for
from .drivefs import API, DRIVEFS, PLAIN, UNCONFIRMED, check_space

__all__ = ["Publisher"]

log = logging.getLogger(__name__)
# How long the next checkpoint waits for the previous one to reach the cloud before it goes anyway.
GATE_MIN_S = 600.0


class Publisher:
    """Writes snapshots to `run_dir/checkpoints/` and keeps the count of failures.

    Args:
        ours: the set of folders this writer created (the pruner may delete them unfinished).
        backoff: (first, longest) seconds between retries of a failed write.
        on_disconnected: called (from the mirror's thread) on errno 107, to remount Drive.
    """

    def __init__(self, run_dir: Path, *, tracker: CloudTracker, journal: Journal, notices: Notices,
                 ours: set[Path], backoff: tuple[float, float], on_disconnected: Callable[[], None] | None):
        self.run_dir, self.tracker, self.journal, self.notices = Path(run_dir), tracker, journal, notices
        self.ours, self.backoff, self.on_disconnected = ours, backoff, on_disconnected
        self.written_step: int | None = None
        self.failures = 0  # consecutive failed attempts
        self.total_failures = 0
        self.unsynced_reason: str | None = None
        self.in_flight: Upload | None = None  # the upload written last, on its way to the cloud
        self._gate_warned = False

    def gate_open(self, now: float, settle) -> bool:
        """May the next snapshot be written now? On Drive one checkpoint at a time is in DriveFS's
        upload queue: the next waits until the one in flight is in the cloud (or, where nothing
        reports uploads, for its upload time at the assumed rate), or until it has waited too long."""
        upload, tracker = self.in_flight, self.tracker
        if (upload is None or upload.confirmed is not None or tracker.kind == PLAIN
                or tracker.get(upload.label) is not upload):
            return True
        if tracker.kind == UNCONFIRMED:  # nothing reports the upload: give it its assumed upload time
            return now - upload.written >= upload.bytes / settle.rate_bps
        expected = tracker.expected_upload_s(upload.bytes) or 0.0
        if now - upload.written < max(GATE_MIN_S, 3 * expected):
            return False
        if not self._gate_warned:
            self._gate_warned = True
            waited = format_age(now - upload.written)
            self.notices.add(f"Drive has not confirmed {upload.label} ({format_bytes(upload.bytes)}) after "
                             f"{waited}; uploading the next checkpoint anyway (python -m colab_kit drive-check "
                             f"shows what Drive reports)")
            self.journal.write("warn", what="upload_slow", step=upload.step, waited_s=round(now - upload.written))
        return True

    def write(self, snap: Snapshot, lease_ok: Callable[[], bool | None]) -> Upload:
        """Write `snap` (unless the folder holds it already) and return its `Upload`.

        Raises:
            OSError: Drive trouble, or the lease not confirmed now (EAGAIN). SnapshotChanged.
        """
        started = time.monotonic()
        manifest = snapshot_manifest(snap)
        held = lease_ok()
        if held is not True:
            raise OSError(errno.EAGAIN, "the run's lease could not be confirmed, so nothing is written now"
                          if held is None else "another runtime holds the run folder now")
        target = checkpoint_dir(self.run_dir / CHECKPOINTS, snap.step)
        self.ours.add(target)
        if target.is_dir() and _same_manifest(target, manifest) and validity.check(target, step=snap.step).valid:
            log.info("checkpoint-%d is already on %s", snap.step, self.run_dir)
        else:
            # Bytes written but not yet uploaded: known only where DriveFS reports them.
            pending = self.tracker.pending_bytes if self.tracker.kind in (DRIVEFS, API) else 0
            check_space(self.run_dir, snap.bytes, pending, f"checkpoint-{snap.step}")
            publish_folder(snap.path, target, manifest)
        seconds = time.monotonic() - started
        self.written_step = snap.step
        if self.failures:
            self.notices.add(f"sync to {self.run_dir} works again; checkpoint-{snap.step} is written")
        self.failures, self.unsynced_reason = 0, None
        self.journal.write("sync", step=snap.step, seconds=round(seconds, 3), bytes=manifest.total_bytes)
        log.info("checkpoint-%d written to %s (%s in %.1f s)", snap.step, self.run_dir,
                 format_bytes(manifest.total_bytes), seconds)
        self.journal.flush(timeout=0)
        self.in_flight = upload_for(target, manifest, f"checkpoint-{snap.step}", saved=snap.taken, started=started,
                                    source=snap.path)
        return self.in_flight

    def failed(self, snap: Snapshot, exc: BaseException) -> float:
        """Count and report a failed write; returns the seconds to wait before the next try."""
        self.failures += 1
        self.total_failures += 1
        self.unsynced_reason = f"{type(exc).__name__}: {exc}"
        delay = min(self.backoff[1], self.backoff[0] * 2 ** (self.failures - 1))
        disconnected = isinstance(exc, OSError) and exc.errno == errno.ENOTCONN
        message = (f"could not sync checkpoint-{snap.step} to {self.run_dir} ({exc}); training "
                   f"continues, retrying in {delay:.0f} s")
        if disconnected:
            message += " (Drive disconnected: remounting)"
        if self.failures in (1, 2, 4) or self.failures % 10 == 0:  # loud, but not every retry
            self.notices.add(message)
        self.journal.write("warn", what="sync_failed", step=snap.step, error=str(exc),
                           errno=getattr(exc, "errno", None), attempt=self.failures, retry_in=delay)
        if disconnected and self.on_disconnected is not None:
            self.on_disconnected()  # a remount, here in the mirror's thread: training never waits for it
        return delay


def _same_manifest(folder: Path, manifest: Manifest) -> bool:
    try:
        return read_manifest(folder).files == manifest.files
    except (ValueError, OSError):
        return False
