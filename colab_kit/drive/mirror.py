"""Mirror checkpoints from local disk to the persistent folder in a background worker.

The training loop only pays for a snapshot (hard links, or a local copy where links are not
possible) so that the Trainer's own pruning cannot delete files under the upload. A single
worker then, for the newest snapshot only: hashes it and writes it to
`<drive_dir>/checkpoints/checkpoint-<step>/`, read back, MANIFEST.json last (a `sync` event:
*written*; `publish.py`); follows the upload until it is *in the cloud* (`cloud.py`; a `cloud`
event) before the next one goes, so that on Drive one checkpoint at a time is in DriveFS's
upload queue and a newer snapshot replaces a queued older one; and lets older checkpoints go by the
rules (`retention.py`), each deletion on a fresh proof (`gate.py`).

The same worker does everything else that touches the persistent folder (`upkeep.py`): the
journal's lines, small files such as `micro_batch.json`, learning what the folder held at start, a
remount after errno 107, uploading again what Drive lost. The training thread only queues: a stalled
mount stalls this worker.

The worker is a step function (`step`): its thread calls it, and so does the deterministic simulator
(`tests/sim/`), which runs the kit's own workers over thousands of faulty Drives on a virtual clock.
Drive errors are retried with exponential backoff and reported, never raised into training. Before
every upload, publish and delete the worker checks that the run's lease is still this runtime's; once
it is another's, this runtime writes nothing more to the run folder.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from .._clock import clock
from .._notices import Notices
from ..checkpoints.checkpoint import CHECKPOINTS
from ..checkpoints.journal import Journal
from ..checkpoints.snapshot import Snapshot, SnapshotChanged, discard
from .cloud import CloudTracker
from .deleters import TrashFreeDeleter
from .drivefs import DRIVEFS, PLAIN, UNCONFIRMED, probe_kind
from .gate import CheckpointGate
from .publish import Publisher
from .retention import Ladder, Pruner
from .upkeep import DeferredWrites, KeptCopies

__all__ = ["Mirror"]

log = logging.getLogger(__name__)
_DELETE_POLL_S = 1.0
_CHORES_RETRY_S = 2.0  # journal lines or small files that failed to go: the next try
_PRUNE_AGAIN_S = 5.0  # after a pass that a doubt stopped
_LADDER_AGAIN_S = 60.0  # no attributes: checkpoints move up the ladder as they age
_IDLE_S = 30.0
_REPROBE_S = 60.0  # attributes that could not be read at the start are asked again this often


class Mirror:
    """The background uploader of one run folder.

    Args:
        run_dir: the persistent run folder; checkpoints go to `run_dir/checkpoints/`.
        keep: checkpoints in the cloud to keep (at least 1).
        journal: where `sync`, `cloud`, `prune`, `kept` and `warn` events go.
        notices: where messages for the user go.
        on_disconnected: called (from the worker) on errno 107, to ask for a Drive remount.
        kind: what "in the cloud" means for `run_dir` (`drivefs.folder_kind`, or API).
        prune_after: "cloud" (the rule), or "written", the rule before 0.2, kept to show what it
            loses (tests, bench/work_at_risk.py): prune once a newer manifest is written.
        writer: False for a follower rank (`ranks.py`): no worker, nothing is uploaded, read or
            pruned; every snapshot is discarded.
        ladder: what is kept where nothing confirms uploads (`retention.Ladder`).
        pace_bps: where nothing confirms uploads, the next checkpoint is written only after the previous
            one's size at this rate (it spares Drive's upload queue; it never decides a deletion).
        lease: the run's `Lease`, checked before every upload, publish and delete (None: a folder
            without a lease, a CheckpointStore of its own).
        on_lease_lost: called (from the worker) when a check finds the lease another runtime's.
        api: with kind API, the `driveapi.DriveApi` that confirms uploads and deletes for good.
        threaded: False runs no thread: the caller calls `step()` (the simulator).
        known_steps: the checkpoints the run's journal says the folder holds (a missing one is looked
            for again before a publish writes into its folder).
    """

    def __init__(self, run_dir: str | Path, *, keep: int, journal: Journal, notices: Notices,
                 on_disconnected: Callable[[], None] | None = None,
                 backoff: tuple[float, float] = (2.0, 120.0), kind: str = PLAIN, prune_after: str = "cloud",
                 writer: bool = True, ladder: Ladder = Ladder(), pace_bps: float = 1e6, lease=None,
                 on_lease_lost: Callable[[], None] | None = None, api=None, threaded: bool = True,
                 known_steps=(), kind_settled: bool = True):
        if prune_after not in ("cloud", "written"):
            raise ValueError(f"prune_after={prune_after!r}: use 'cloud' or 'written'")
        self.run_dir = Path(run_dir)
        self.keep = max(1, int(keep))
        self.journal, self.notices, self.kind, self.prune_after = journal, notices, kind, prune_after
        self.ladder, self.pace_bps = ladder, pace_bps
        self.tracker = CloudTracker(kind, journal, api=api)
        rule_kind = PLAIN if prune_after == "written" else kind  # the old rule: written is safe everywhere
        self.gate = CheckpointGate(self.run_dir / CHECKPOINTS, kind=rule_kind, journal=journal,
                                   lease_check=self._lease_ok if lease is not None else None, api=api, lease=lease)
        self.pruner = Pruner(self.run_dir / CHECKPOINTS, kind=rule_kind, keep=self.keep, gate=self.gate, ladder=ladder)
        self.deferred = DeferredWrites()
        self.kept = KeptCopies(self.tracker, notices, journal)
        self.lease, self.on_lease_lost = lease, on_lease_lost
        self.publisher = Publisher(self.run_dir, tracker=self.tracker, journal=journal, notices=notices,
                                   backoff=backoff, on_disconnected=on_disconnected, gate=self.gate,
                                   known_steps=known_steps)
        # The Trainer's best checkpoint (state.best_model_checkpoint): never superseded in the
        # queue nor pruned while it is best. Set from the training loop.
        self.best_step: int | None = None
        self.protected: set[int] = set()  # kept whatever the rules say (a best checkpoint not readable at resume)
        self._queued: list[Snapshot] = []  # oldest first: at most the best one and the newest
        self._current: Snapshot | None = None
        self._dropped: list[int] = []
        self._retry_at = self._delete_poll_at = self._chores_at = 0.0
        self._prune_wanted = self._adopt_wanted = self._paused = self._closed = self._woken = self._pruning = False
        self._prune_at = float("inf")  # a pass is due then (a doubt to look at again, the ladder)
        self._reprobe_at = float("inf") if kind_settled or kind != UNCONFIRMED else clock.monotonic() + _REPROBE_S
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="colab_kit-mirror", daemon=True)
        self.writer = writer
        self.threaded = threaded and writer
        if writer:
            journal.on_pending = self.wake
            if self.threaded:
                self._thread.start()
        else:
            self._closed = True

    # -- main-thread API -------------------------------------------------------------------
    def adopt_existing(self) -> None:
        """Have the worker learn the cloud state of the checkpoints already in the folder (a restart) and
        let go of what the rules allow. Returns at once: the folder is read in the worker."""
        if not self.writer:
            return
        with self._cond:
            self._adopt_wanted = True
            self._woken = True
            self._cond.notify_all()

    def wake(self) -> None:
        """Something was queued (a journal line, a small file): the worker looks at once. Cheap, and
        safe to call from the training thread."""
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def write_later(self, path: str | Path, data) -> None:
        """Write `data` (bytes, a JSON document, or a function of the bytes there now) to `path` in the
        persistent folder, from the worker; never on the caller's thread beyond a few seconds, and never
        once the lease is another runtime's."""
        if not self.writer or self._paused:
            return
        self.deferred.write_later(path, data)
        if self._thread.is_alive() or not self.threaded:
            self.wake()
        else:  # no worker any more (after finish): written now, waited for a few seconds at most
            try:
                clock.within(5.0, self.deferred.flush)
            except Exception as exc:  # noqa: BLE001 - Late, or Drive trouble: it waits for the next flush
                log.info("writing %s waits: %s", path, exc)

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
            self._woken = True
            self._cond.notify_all()

    @property
    def pending_steps(self) -> list[int]:
        """Steps saved locally but not yet written to the persistent folder."""
        with self._cond:
            return [s.step for s in (self._current, *self._queued) if s is not None]

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def dropped_steps(self) -> list[int]:
        """Steps that will never be written: queued when the lease was lost."""
        return list(self._dropped)

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
        deadline = None if timeout is None else clock.monotonic() + timeout
        with self._cond:
            if self._paused:
                return False
            while self._busy():
                if self._paused or not self._thread.is_alive():
                    return False
                left = None if deadline is None else deadline - clock.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(timeout=min(left, 1.0) if left is not None else 1.0)
        return True

    def _busy(self) -> bool:
        return bool(self._current is not None or self._queued or self.journal.pending or self.deferred.pending
                    or self._adopt_wanted or self._prune_wanted or self._pruning)

    def pause(self, reason: str) -> None:
        """Stop for good (the lease was lost to another runtime): nothing more is uploaded, pruned,
        journaled or written to the run folder by this runtime; what was queued is dropped and said."""
        with self._cond:
            if self._paused:
                return
            self._paused = True
            self.publisher.unsynced_reason = reason
            self._dropped = [s.step for s in self._queued] + ([self._current.step] if self._current else [])
            for old in self._queued:
                discard(old)
            self._queued = []
            self._cond.notify_all()
        self.journal.stop_persistent(reason)
        self.deferred.drop()

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
        (they stay as empty files in a folder without a manifest, deleted at a later pass)."""
        deadline = clock.monotonic() + timeout
        with self._cond:
            while self.gate.pending and not self._paused and self.kind == DRIVEFS and clock.monotonic() < deadline:
                self._cond.wait(timeout=min(deadline - clock.monotonic(), 0.5))
        return not self.gate.pending

    def prune_now(self, deadline: float) -> None:
        """After `close()`: one pruning pass in the calling thread (the checkpoints that reached the
        cloud after the run finished allow it), waiting for its deletions until `deadline`."""
        if self._thread.is_alive() or self._paused or not self.writer:
            return
        self._prune()
        while self.gate.pending and clock.monotonic() < deadline:
            self.gate.poll()
            clock.sleep(0.2)

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
        while True:
            with self._cond:
                if self._closed or self._paused:
                    return
                self._woken = False
            wait = self.step()
            with self._cond:
                if self._closed or self._paused:
                    return
                if not self._woken and wait > 0:
                    self._cond.wait(timeout=min(wait, _IDLE_S))

    def step(self) -> float:
        """One round of the worker: what is due of the chores (journal lines, small files, learning the
        folder, confirmations, pruning, deletions under way), then one try at the snapshot whose turn it
        is. Returns the seconds until it wants to run again. Never raises."""
        if self._paused or not self.writer:
            return _IDLE_S
        try:
            self._housekeeping()
        except Exception:  # a bug or Drive trouble must not kill the worker silently
            log.exception("colab_kit: checkpoint housekeeping failed; trying again later")
        now = clock.monotonic()
        with self._cond:
            if self._current is None and self._queued and self._turn_came(now):
                self._current = self._queued.pop(0)
            snap = self._current if self._current is not None and now >= self._retry_at and not self._paused else None
        if snap is not None:
            self._attempt(snap)
        return self._next_wait()

    def _next_wait(self) -> float:
        now = clock.monotonic()
        with self._cond:
            chores = self.journal.pending or self.deferred.pending or self.tracker.missing(0.0)
            waits = [w for w in (self.tracker.next_poll_in(),
                                 1.0 if self._queued and self._current is None else None,  # its turn comes
                                 self._retry_at - now if self._current is not None else None,
                                 self._delete_poll_at - now if self.gate.pending else None,
                                 self._chores_at - now if chores else None,
                                 self._prune_at - now if self._prune_at != float("inf") else None,
                                 0.0 if self._prune_wanted or self._adopt_wanted else None) if w is not None]
        return max(0.0, min(waits + [_IDLE_S]))

    def _turn_came(self, now: float) -> bool:
        return self.prune_after == "written" or self.publisher.may_write_next(now, self.pace_bps)

    def _housekeeping(self) -> None:
        if clock.monotonic() >= self._reprobe_at:
            self._reprobe()
        if self._adopt_wanted:
            self.tracker.adopt(self.run_dir / CHECKPOINTS)
            with self._cond:
                self._adopt_wanted, self._prune_wanted = False, True
                self._cond.notify_all()
        now = clock.monotonic()
        if now >= self._chores_at and (self.journal.pending or self.deferred.pending):
            held = self._lease_ok()  # once the folder is another runtime's, not one line more goes there
            done = held is True and self.journal.flush(timeout=0, held=True) & self.deferred.flush(lambda: held)
            self._chores_at = now if done else now + _CHORES_RETRY_S
            with self._cond:
                self._cond.notify_all()  # drain() may be waiting for them
        confirmed = self.tracker.poll()
        self.kept.release_safe()
        if self.tracker.missing(0.0) and now >= self._chores_at:
            self.kept.upload_missing(self._lease_ok)
            self._chores_at = max(self._chores_at, now + _CHORES_RETRY_S)
        with self._cond:
            wanted, self._prune_wanted = self._prune_wanted, False
            self._pruning = wanted  # drain() waits for a pass that was asked for
            if confirmed:
                self._cond.notify_all()  # the next snapshot's turn may have come
        try:
            if wanted or now >= self._prune_at or any(u.step is not None for u in confirmed):
                self._prune()
        finally:
            with self._cond:
                self._pruning = False
                self._cond.notify_all()
        if self.gate.pending and clock.monotonic() >= self._delete_poll_at:
            self.gate.poll()
            self._delete_poll_at = clock.monotonic() + _DELETE_POLL_S

    def _reprobe(self) -> None:
        """DriveFS's attributes could not be read at the start: ask again; once they answer, the folder's uploads
        are confirmed by them from now on (a read failure at the start no longer decides the whole run)."""
        kind, settled = probe_kind(self.run_dir, waits=())
        self._reprobe_at = float("inf") if settled else clock.monotonic() + _REPROBE_S
        if kind != DRIVEFS:
            return
        self.kind = self.tracker.kind = kind
        if self.prune_after == "cloud":
            self.pruner.kind = self.gate.kind = kind
            if not self.gate.pending:
                self.gate.deleter = TrashFreeDeleter(kind)
        self.journal.write("warn", what="kind", durability=kind, because="DriveFS's attributes answer now")
        self.notices.add("DriveFS's upload attributes answer now: checkpoints are confirmed in the cloud from now on")

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
                self._retry_at = clock.monotonic() + delay
            self._cond.notify_all()

    def _upload(self, snap: Snapshot) -> None:
        upload = self.publisher.write(snap, self._lease_ok)
        if upload is None:  # kept what the folder holds at this step (the gate said why): nothing to follow
            discard(snap)
            return
        self.kept.keep(snap)
        in_cloud = self.tracker.add(upload)
        if in_cloud or self.prune_after == "written" or self.kind == UNCONFIRMED:
            self._prune()

    def _prune(self) -> None:
        protect = {s.step for s in (self._current,) if s is not None} | self.protected
        done = self.pruner.prune(self.tracker, protect=protect, best=self.best_step)
        if done is None:
            self._prune_at = clock.monotonic() + _PRUNE_AGAIN_S
        elif self.pruner.kind == UNCONFIRMED and len(self.tracker.checkpoint_steps()) > 1:
            self._prune_at = clock.monotonic() + _LADDER_AGAIN_S
        else:
            self._prune_at = float("inf")
