"""Mirror checkpoints from local disk to the persistent folder in a background thread.

The training loop only pays for a snapshot (hard links, or a local copy where links are not
possible) so that the Trainer's own pruning cannot delete files under the upload. A single
worker then, for the newest snapshot only: hashes it and writes it to
`<drive_dir>/checkpoints/checkpoint-<step>/`, read back, MANIFEST.json last (a `sync` event:
*written*; `publish.py`); follows the upload until it is *in the cloud* (`cloud.py`; a `cloud`
event) before the next one goes, so that on Drive one checkpoint at a time is in DriveFS's
upload queue and a newer snapshot replaces a queued older one; and prunes older checkpoints only
once a newer one is in the cloud, Trash-free, and nothing on doubt (`retention.py`).

The same thread does everything else that touches the persistent folder (`upkeep.py`): the
journal's lines, small files such as `micro_batch.json`, a remount after errno 107, uploading
again what Drive lost. The training thread only queues: a stalled mount stalls this thread.

Drive errors (ENOSPC, EIO, permissions, errno 107 "Transport endpoint is not connected") are
retried with exponential backoff; they are reported, never raised into training. Before every
upload, publish and delete the thread checks that the run's lease is still this runtime's.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Callable

from .._notices import Notices
from ..checkpoints.checkpoint import CHECKPOINTS
from ..checkpoints.journal import Journal
from ..checkpoints.snapshot import Snapshot, SnapshotChanged, discard
from .cloud import CloudTracker
from .drivefs import DRIVEFS, PLAIN, UNCONFIRMED
from .publish import Publisher
from .retention import Pruner, Settle, unfinished_folders
from .upkeep import DeferredWrites, KeptCopies

__all__ = ["Mirror"]

log = logging.getLogger(__name__)
_DELETE_POLL_S = 1.0
_CHORES_RETRY_S = 2.0  # journal lines or small files that failed to go: the next try
_PRUNE_AGAIN_S = 5.0  # after a pass that a doubt stopped, or while checkpoints settle (no attributes)


class Mirror:
    """The background uploader of one run folder.

    Args:
        run_dir: the persistent run folder; checkpoints go to `run_dir/checkpoints/`.
        keep: checkpoints in the cloud to keep (at least 1).
        journal: where `sync`, `cloud`, `prune` and `warn` events go.
        notices: where messages for the user go.
        on_disconnected: called (from the worker) on errno 107, to ask for a Drive remount.
        kind: what "in the cloud" means for `run_dir` (`drivefs.folder_kind`).
        prune_after: "cloud" (the rule), or "written", the rule before 0.2, kept to show what it
            loses (tests, bench/work_at_risk.py): prune once a newer manifest is written, at once.
        writer: False for a follower rank (`ranks.py`): no worker thread, nothing is uploaded,
            read or pruned; every snapshot is discarded.
        settle: on a Drive mount without attributes, when a checkpoint counts as settled.
        lease: the run's `Lease`, checked before every upload, publish and delete (None: a folder
            without a lease, a CheckpointStore of its own).
        on_lease_lost: called (from the worker) when a check finds the lease another runtime's.
        api: with kind `API`, the `driveapi.DriveApi` that confirms uploads and deletes for good.
    """

    def __init__(self, run_dir: str | Path, *, keep: int, journal: Journal, notices: Notices,
                 on_disconnected: Callable[[], None] | None = None,
                 backoff: tuple[float, float] = (2.0, 120.0), kind: str = PLAIN, prune_after: str = "cloud",
                 writer: bool = True, settle: Settle = Settle(), lease=None,
                 on_lease_lost: Callable[[], None] | None = None, api=None):
        if prune_after not in ("cloud", "written"):
            raise ValueError(f"prune_after={prune_after!r}: use 'cloud' or 'written'")
        self.run_dir = Path(run_dir)
        self.keep = max(1, int(keep))
        self.journal, self.notices, self.kind, self.prune_after = journal, notices, kind, prune_after
        self.tracker = CloudTracker(kind, journal, api=api)
        self.settle = settle
        self.pruner = Pruner(self.run_dir / CHECKPOINTS, kind=kind, prune_after=prune_after, keep=self.keep,
                             journal=journal, notices=notices, settle=settle, api=api)
        self.deleter = self.pruner.deleter
        self.deferred = DeferredWrites()
        self.kept = KeptCopies(self.tracker, settle.age)
        self.lease, self.on_lease_lost = lease, on_lease_lost
        self.ours: set[Path] = set()  # unfinished folders this writer may delete (created, or found at start)
        self.publisher = Publisher(self.run_dir, tracker=self.tracker, journal=journal, notices=notices,
                                   ours=self.ours, backoff=backoff, on_disconnected=on_disconnected)
        # The Trainer's best checkpoint (state.best_model_checkpoint): never superseded in the
        # queue nor pruned while it is best. Set from the training loop.
        self.best_step: int | None = None
        self._queued: list[Snapshot] = []  # oldest first: at most the best one and the newest
        self._current: Snapshot | None = None
        self._retry_at = self._delete_poll_at = self._chores_at = 0.0
        self._prune_wanted = self._paused = self._closed = False
        self._prune_at = float("inf")  # a pass is due then (a doubt to look at again, checkpoints settling)
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="colab_kit-mirror", daemon=True)
        self.writer = writer
        if writer:
            journal.on_pending = self.wake
            self._thread.start()
        else:
            self._closed = True

    # -- main-thread API -------------------------------------------------------------------
    def adopt_existing(self) -> None:
        """Learn the cloud state of the checkpoints already in the folder (a restart), and let the
        worker prune what the rules allow (leftovers of a killed run among them: the folders found
        unfinished now are this writer's to delete, since it holds the lease)."""
        if not self.writer:
            return
        self.ours.update(unfinished_folders(self.run_dir / CHECKPOINTS))
        self.tracker.adopt(self.run_dir / CHECKPOINTS)
        with self._cond:
            self._prune_wanted = True
            self._cond.notify_all()

    def wake(self) -> None:
        """Something was queued (a journal line, a small file): the worker looks at once. Cheap, and
        safe to call from the training thread."""
        with self._cond:
            self._cond.notify_all()

    def write_later(self, path: str | Path, data) -> None:
        """Write `data` (bytes, or a JSON document) to `path` in the persistent folder, from the worker."""
        if not self.writer:
            return
        self.deferred.write_later(path, data)
        if self._thread.is_alive():
            self.wake()
        else:  # no worker any more (after finish): the caller writes, as it would without the kit
            self.deferred.flush()

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

    # What the publisher knows, said by the mirror (run.status() reads them).
    written_step = property(lambda self: self.publisher.written_step,
                            lambda self, step: setattr(self.publisher, "written_step", step))
    failures = property(lambda self: self.publisher.failures)
    total_failures = property(lambda self: self.publisher.total_failures)
    unsynced_reason = property(lambda self: self.publisher.unsynced_reason)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted checkpoint, journal line and small file is written; False on
        timeout, when paused, or when the worker thread is not alive (a process forked from the one
        that started it)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._paused:
                return False
            while self._current is not None or self._queued or self.journal.pending or self.deferred.pending:
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
            self.publisher.unsynced_reason = reason
            for old in self._queued:
                discard(old)
            self._queued = []
            self._cond.notify_all()

    def _lease_ok(self) -> bool | None:
        """Is the lease still ours? True, False (lost: pauses, for good) or None (unknown: not now)."""
        if self.lease is None:
            return True
        held = self.lease.check()
        if held is False and not self._paused:
            self.pause("another runtime took over the run folder")
            if self.on_lease_lost is not None:
                self.on_lease_lost()
        return held

    def finish_deletions(self, timeout: float) -> bool:
        """Wait (up to `timeout` s) for the Trash-free deletions under way; False if some remain
        (they stay as empty files in a folder without a manifest, cleaned up at the next start)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self.deleter.pending and not self._paused and self.kind == DRIVEFS and time.monotonic() < deadline:
                self._cond.wait(timeout=min(deadline - time.monotonic(), 0.5))
        return not self.deleter.pending

    def prune_now(self, deadline: float) -> None:
        """After `close()`: one pruning pass in the calling thread (the checkpoints that reached the
        cloud after the run finished allow it), waiting for its deletions until `deadline`."""
        if self._thread.is_alive() or self._paused or not self.writer:
            return
        self._prune()
        while self.deleter.pending and time.monotonic() < deadline:
            self.deleter.poll()
            time.sleep(0.2)

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        if not self._thread.is_alive():
            self.kept.discard_all()
            if self.journal.on_pending == self.wake:  # no flusher any more: the journal's writers flush
                self.journal.on_pending = None

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
                chores = self.journal.pending or self.deferred.pending or self.tracker.missing(0.0)
                waits = [w for w in (self.tracker.next_poll_in(), self._gate_wait(now),
                                     self._retry_at - now if self._current is not None else None,
                                     self._delete_poll_at - now if self.deleter.pending else None,
                                     self._chores_at - now if chores else None,
                                     self._prune_at - now if self._prune_at != float("inf") else None,
                                     0.0 if self._prune_wanted else None) if w is not None]
                if waits and min(waits) <= 0:
                    return None
                self._cond.wait(timeout=min(waits + [30.0]))  # idle: look again now and then anyway

    def _gate_open(self, now: float) -> bool:
        return self.prune_after == "written" or self.publisher.gate_open(now, self.settle)

    def _gate_wait(self, now: float) -> float | None:
        if not self._queued or self._current is not None or self._gate_open(now):
            return None
        return 1.0  # re-check as confirmations arrive (the poller wakes us sooner)

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now >= self._chores_at and (self.journal.pending or self.deferred.pending):
            done = self.journal.flush(timeout=0) & self.deferred.flush()
            self._chores_at = now if done else now + _CHORES_RETRY_S
            with self._cond:
                self._cond.notify_all()  # drain() may be waiting for them
        confirmed = self.tracker.poll()
        self.kept.release_safe()
        if self.tracker.missing(0.0) and now >= self._chores_at:
            self.kept.upload_missing(self.journal, self.notices, self._lease_ok)
            self._chores_at = max(self._chores_at, now + _CHORES_RETRY_S)
        with self._cond:
            wanted, self._prune_wanted = self._prune_wanted, False
            if confirmed:
                self._cond.notify_all()  # the gate may be open now
        if wanted or now >= self._prune_at or any(u.step is not None for u in confirmed):
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
            discard(snap)
        except Exception as exc:  # OSError is Drive trouble; anything else a bug: retry, report
            if not isinstance(exc, OSError):
                log.exception("unexpected error mirroring checkpoint-%d", snap.step)
            self._failed(snap, exc)
            return
        self.kept.release_safe()  # before the worker says it is done: what is safe leaves nothing behind
        with self._cond:
            self._current = None
            self._cond.notify_all()

    def _failed(self, snap: Snapshot, exc: BaseException) -> None:
        delay = self.publisher.failed(snap, exc)
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
        upload = self.publisher.write(snap, self._lease_ok)
        self.kept.keep(snap)
        in_cloud = self.tracker.add(upload)
        if in_cloud or self.prune_after == "written" or self.kind == UNCONFIRMED:
            self._prune()

    def _prune(self) -> None:
        protect = {s.step for s in (self._current,) if s is not None}
        done = self.pruner.prune(self.tracker, protect=protect, best=self.best_step, ours=self.ours,
                                 lease_ok=self._lease_ok)
        # Look again soon after a doubt; while checkpoints settle (no attributes), as they settle.
        waiting = done is None or (self.kind == UNCONFIRMED and self.prune_after == "cloud"
                                   and len(self.tracker.checkpoint_steps()) > 1)
        self._prune_at = time.monotonic() + _PRUNE_AGAIN_S if waiting else float("inf")
