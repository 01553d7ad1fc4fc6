"""Mirror checkpoints from local disk to the persistent folder in a background thread.

The training loop only pays for a snapshot (hard links, or a local copy where links are not
possible) so that the Trainer's own pruning cannot delete files under the upload. A single
worker then, for the newest snapshot only:

1. hashes the snapshot (and leaves a MANIFEST.json beside the local checkpoint too),
2. copies every data file to `<drive_dir>/checkpoints/checkpoint-<step>/`, reading each back
   to verify size and sha256, and writes MANIFEST.json last, atomically (a `sync` event:
   *written* to the persistent folder),
3. follows the upload until the checkpoint is *in the cloud* (`cloud.CloudTracker`; a `cloud`
   event), and only then starts the next snapshot: on Drive one checkpoint at a time is in
   DriveFS's upload queue, and a newer snapshot replaces a queued older one instead of waiting
   behind it,
4. prunes older checkpoints only once a newer one is in the cloud (`retention.py`),
   deleting them the Trash-free way on Drive (`drivefs.TrashFreeDeleter`).

Drive errors (ENOSPC, EIO, permissions, errno 107 "Transport endpoint is not connected") are
retried with exponential backoff; they are reported, never raised into training.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from pathlib import Path
from typing import Callable

from .._notices import Notices
from .._units import format_age, format_bytes
from ..checkpoints.checkpoint import CHECKPOINTS, checkpoint_dir, publish_folder
from ..checkpoints.journal import Journal
from ..checkpoints.manifest import Manifest, read_manifest, verify_folder
from ..checkpoints.snapshot import Snapshot, SnapshotChanged, discard, snapshot_manifest
from .cloud import CloudTracker, upload_for
from .drivefs import DRIVEFS, PLAIN, UNCONFIRMED, check_space
from .retention import Pruner

__all__ = ["Mirror"]

log = logging.getLogger(__name__)
# How long the next checkpoint waits for the previous one to reach the cloud before it goes anyway.
GATE_MIN_S = 600.0
_DELETE_POLL_S = 1.0


class Mirror:
    """The background uploader of one run folder.

    Args:
        run_dir: the persistent run folder; checkpoints go to `run_dir/checkpoints/`.
        keep: checkpoints in the cloud to keep (at least 1).
        journal: where `sync`, `cloud`, `prune` and `warn` events go.
        notices: where messages for the user go.
        on_disconnected: called (from the worker) on errno 107, to ask for a Drive remount.
        kind: what "in the cloud" means for `run_dir` (`drivefs.folder_kind`).
        prune_after: "cloud" (the rule). "written" is the behaviour before 0.2, kept so that the
            tests and `bench/work_at_risk.py` can show what it loses: prune once a newer manifest
            is written, delete at once, upload without waiting for the cloud, never stretch
            `save_every`.
        writer: False for a follower rank (`ranks.py`): no worker thread, nothing is uploaded,
            read or pruned; every snapshot is discarded.
    """

    def __init__(self, run_dir: str | Path, *, keep: int, journal: Journal, notices: Notices,
                 on_disconnected: Callable[[], None] | None = None,
                 backoff: tuple[float, float] = (2.0, 120.0), kind: str = PLAIN, prune_after: str = "cloud",
                 writer: bool = True):
        if prune_after not in ("cloud", "written"):
            raise ValueError(f"prune_after={prune_after!r}: use 'cloud' or 'written'")
        self.run_dir = Path(run_dir)
        self.keep = max(1, int(keep))
        self.journal = journal
        self.notices = notices
        self.on_disconnected = on_disconnected
        self.backoff = backoff
        self.kind = kind
        self.prune_after = prune_after
        self.tracker = CloudTracker(kind, journal)
        self.pruner = Pruner(self.run_dir / CHECKPOINTS, kind=kind, prune_after=prune_after, keep=self.keep,
                             journal=journal, notices=notices)
        self.deleter = self.pruner.deleter
        # The Trainer's best checkpoint (state.best_model_checkpoint): never superseded in the
        # queue nor pruned while it is best. Set from the training loop.
        self.best_step: int | None = None
        self.written_step: int | None = None
        self.failures = 0  # consecutive failed attempts
        self.total_failures = 0
        self.unsynced_reason: str | None = None
        self._queued: list[Snapshot] = []  # oldest first: at most the best one and the newest
        self._current: Snapshot | None = None
        self._retry_at = 0.0
        self._in_flight = None  # the Upload written last, on its way to the cloud
        self._gate_warned = False
        self._prune_wanted = False
        self._delete_poll_at = 0.0
        self._paused = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="colab_kit-mirror", daemon=True)
        self.writer = writer
        if writer:
            self._thread.start()
        else:
            self._closed = True

    # -- main-thread API -------------------------------------------------------------------
    def adopt_existing(self) -> None:
        """Learn the cloud state of the checkpoints already in the folder (a restart), and let the
        worker prune what the rules allow (leftovers of a killed run among them)."""
        if not self.writer:
            return
        self.tracker.adopt(self.run_dir / CHECKPOINTS)
        with self._cond:
            self._prune_wanted = True
            self._cond.notify_all()

    def submit(self, snapshot: Snapshot) -> None:
        """Queue `snapshot`; it replaces the queued, older ones (never the one being uploaded, nor
        the best one: that one is uploaded first)."""
        with self._cond:
            if self._closed or self._paused:
                discard(snapshot)
                return
            kept = []
            for old in self._queued:
                if old.path == snapshot.path:  # the same step again: take_snapshot replaced its files
                    continue
                if old.step == self.best_step:
                    kept.append(old)
                    continue
                log.info("checkpoint-%d superseded by checkpoint-%d before upload", old.step, snapshot.step)
                discard(old)
            self._queued = kept + [snapshot]
            self._cond.notify_all()

    @property
    def pending_steps(self) -> list[int]:
        """Steps saved locally but not yet written to the persistent folder."""
        with self._cond:
            return [s.step for s in (self._current, *self._queued) if s is not None]

    @property
    def paused(self) -> bool:
        return self._paused

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted checkpoint is written; False on timeout, when paused, or when
        the worker thread is not alive (a process forked from the one that started it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._paused:
                return False
            while self._current is not None or self._queued:
                if self._paused or not self._thread.is_alive():
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(timeout=min(left, 1.0) if left is not None else 1.0)
        return True

    def pause(self, reason: str) -> None:
        """Stop uploading and pruning for good (the lease was lost to another runtime)."""
        with self._cond:
            self._paused = True
            self.unsynced_reason = reason
            for old in self._queued:
                discard(old)
            self._queued = []
            self._cond.notify_all()

    def finish_deletions(self, timeout: float) -> bool:
        """Wait (up to `timeout` s) for the Trash-free deletions under way; False if some remain
        (they stay as empty files in a folder without a manifest, cleaned up at the next start)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.deleter.pending and not self._paused and self.kind == DRIVEFS:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(timeout=min(left, 0.5))
        return not self.deleter.pending

    def prune_now(self, deadline: float) -> None:
        """After `close()`: one pruning pass in the calling thread (the checkpoints that reached the
        cloud after the run finished allow it), waiting for its deletions until `deadline`."""
        if self._thread.is_alive() or self._paused or not self.writer:
            return
        try:
            self._prune()
            while self.deleter.pending and time.monotonic() < deadline:
                self.deleter.poll()
                time.sleep(0.2)
        except OSError as exc:  # Drive trouble: the next start prunes instead
            log.info("pruning after the finish failed: %s", exc)

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)

    # -- worker ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while (snap := self._next()) is not False:
            try:
                self._housekeeping()
            except Exception:  # a bug or Drive trouble must not kill the thread silently
                log.exception("colab_kit: checkpoint housekeeping failed; trying again later")
            if snap is not None:
                self._attempt(snap)

    def _next(self):
        """Wait for work: a snapshot to upload now, or housekeeping that is due (None); False: stop."""
        with self._cond:
            while True:
                if self._closed or self._paused:
                    return False
                now = time.monotonic()
                if self._current is None and self._queued and self._gate_open(now):
                    self._current = self._queued.pop(0)
                if self._current is not None and now >= self._retry_at:
                    return self._current
                waits = [w for w in (self.tracker.next_poll_in(), self._gate_wait(now),
                                     self._retry_at - now if self._current is not None else None,
                                     self._delete_poll_at - now if self.deleter.pending else None,
                                     0.0 if self._prune_wanted else None) if w is not None]
                if waits and min(waits) <= 0:
                    return None
                self._cond.wait(timeout=min(waits) if waits else None)

    def _gate_open(self, now: float) -> bool:
        upload = self._in_flight
        if (upload is None or upload.confirmed is not None or self.kind != DRIVEFS
                or self.prune_after == "written" or self.tracker.get(upload.label) is not upload):
            return True
        expected = self.tracker.expected_upload_s(upload.bytes) or 0.0
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

    def _gate_wait(self, now: float) -> float | None:
        if not self._queued or self._current is not None or self._gate_open(now):
            return None
        return 1.0  # re-check as confirmations arrive (the poller wakes us sooner)

    def _housekeeping(self) -> None:
        confirmed = self.tracker.poll()
        with self._cond:
            wanted, self._prune_wanted = self._prune_wanted, False
            if confirmed:
                self._cond.notify_all()  # the gate may be open now
        if wanted or any(u.step is not None for u in confirmed):
            self._prune()
        if self.deleter.pending and time.monotonic() >= self._delete_poll_at:
            self.deleter.poll()
            self._delete_poll_at = time.monotonic() + _DELETE_POLL_S

    def _attempt(self, snap: Snapshot) -> None:
        try:
            self._upload(snap)
        except SnapshotChanged as exc:  # overwritten in place: a newer save will follow
            self.notices.add(f"{exc}; skipped it")
            self.journal.write("warn", what="snapshot_changed", step=snap.step, error=str(exc))
        except Exception as exc:  # OSError is Drive trouble; anything else a bug: retry, report
            if not isinstance(exc, OSError):
                log.exception("unexpected error mirroring checkpoint-%d", snap.step)
            self._failed(snap, exc)
            return
        discard(snap)  # before the worker says it is done: drain() returning means nothing is left behind
        with self._cond:
            self._current = None
            self._cond.notify_all()

    def _failed(self, snap: Snapshot, exc: BaseException) -> None:
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
            self.on_disconnected()
        with self._cond:
            newer = any(q.step > snap.step for q in self._queued)
            if newer and snap.step != self.best_step:  # superseded: stop retrying this one
                discard(snap)
                self._current = None
            elif newer:  # the best one is retried after the newer one, which is not held up by it
                self._queued.append(snap)
                self._current = None
            else:
                self._retry_at = time.monotonic() + delay
            self._cond.notify_all()

    def _upload(self, snap: Snapshot) -> None:
        started = time.monotonic()
        manifest = snapshot_manifest(snap)
        target = checkpoint_dir(self.run_dir / CHECKPOINTS, snap.step)
        if target.is_dir() and _same_manifest(target, manifest) and verify_folder(target, hashes=False) is None:
            log.info("checkpoint-%d is already on %s", snap.step, self.run_dir)
        else:
            # Bytes written but not yet uploaded: known only where DriveFS reports them.
            pending = self.tracker.pending_bytes if self.kind == DRIVEFS else 0
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
        self.journal.flush()
        upload = upload_for(target, manifest, f"checkpoint-{snap.step}", saved=snap.taken, started=started)
        in_cloud = self.tracker.add(upload)
        self._in_flight = upload
        if in_cloud or self.prune_after == "written" or self.kind == UNCONFIRMED:
            self._prune()

    def _prune(self) -> None:
        protect = {s.step for s in (self._current,) if s is not None}
        self.pruner.prune(self.tracker, protect=protect, best=self.best_step)


def _same_manifest(folder: Path, manifest: Manifest) -> bool:
    try:
        return read_manifest(folder).files == manifest.files
    except ValueError:
        return False
