"""The mirror's worker: one round at a time (`step`), called by the mirror's thread, or by the deterministic
simulator (`tests/sim/`), which runs the kit's own workers over thousands of faulty Drives on a virtual
clock. Each round does what is due of the chores (journal lines, small files, learning what the folder
held at the start, confirmations, pruning, deletions under way), then tries the snapshot whose turn it is.

`MirrorWorker` is the worker half of `mirror.Mirror`, which holds the queue, the state and the API that
the training thread calls; it is not used on its own.
"""

from __future__ import annotations

import logging

from ..checkpoints.checkpoint import CHECKPOINTS
from ..checkpoints.clock import clock
from ..checkpoints.snapshot import Snapshot, SnapshotChanged, discard, keep_on_disk
from .deleters import TrashFreeDeleter
from .drivefs import DRIVEFS, HUB, UNCONFIRMED, probe_kind

__all__ = ["MirrorWorker", "IDLE_S", "REPROBE_S"]

log = logging.getLogger(__name__)
_DELETE_POLL_S = 1.0
_CHORES_RETRY_S = 2.0  # journal lines or small files that failed to go: the next try
_PRUNE_AGAIN_S = 5.0  # after a pass that a doubt stopped
_LADDER_AGAIN_S = 60.0  # no attributes: checkpoints move up the ladder as they age
IDLE_S = 30.0
REPROBE_S = 60.0  # attributes that could not be read at the start are asked again this often


class MirrorWorker:
    """The rounds of `Mirror`'s worker (see the module docstring)."""

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
                    self._cond.wait(timeout=min(wait, IDLE_S))

    def step(self) -> float:
        """One round of the worker: what is due of the chores (journal lines, small files, learning the
        folder, confirmations, pruning, deletions under way), then one try at the snapshot whose turn it
        is. Returns the seconds until it wants to run again. Never raises."""
        if self._paused or not self.writer:
            return IDLE_S
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
                                 self._adopt_at - now if self._adopt_at != float("inf") else None,
                                 0.0 if self._prune_wanted or self._adopt_wanted else None) if w is not None]
        return max(0.0, min(waits + [IDLE_S]))

    def _turn_came(self, now: float) -> bool:
        return self.prune_after == "written" or self.publisher.may_write_next(now, self.pace_bps)

    def _housekeeping(self) -> None:
        if clock.monotonic() >= self._reprobe_at:
            self._reprobe()
        if self._adopt_wanted or clock.monotonic() >= self._adopt_at:
            read = self.tracker.adopt(self.run_dir / CHECKPOINTS)
            self._adopt_at = float("inf") if read else clock.monotonic() + _PRUNE_AGAIN_S  # what failed: again
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
        if self.kind == HUB:
            self.sync_store()
        confirmed = self.tracker.poll()
        self.kept.release_safe()
        if self.tracker.missing(0.0) and now >= self._chores_at:
            self.kept.upload_missing(self.publisher, self._lease_ok)
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

    def sync_store(self, force: bool = False) -> bool:
        """On the Hub: commit the journal and the small files that changed (at most once a minute unless
        `force`). True when the Hub holds them as the replica does; False when not now (said in the log)."""
        try:
            return self.tracker.api.sync_small(force)
        except OSError as exc:  # the Hub's trouble, or the lease lost (the next lease check pauses the mirror)
            log.info("the journal waits for the Hub: %s", exc)
            return False

    def _reprobe(self) -> None:
        """DriveFS's attributes could not be read at the start: ask again; once they answer, the folder's uploads
        are confirmed by them from now on (a read failure at the start no longer decides the whole run)."""
        kind, settled = probe_kind(self.run_dir, waits=())
        self._reprobe_at = float("inf") if settled else clock.monotonic() + REPROBE_S
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
        if self.publisher.folder_gone:  # missing at every look: nothing more goes there, nothing is retried
            self._folder_gone(snap)
            return
        delay = self.publisher.failed(snap, exc)
        with self._cond:
            newer = any(q.step > snap.step for q in self._queued)
            again = any(q.step == snap.step for q in self._queued)  # a later save of this step: it is the one
            if again or newer and snap.step != self.best_step:  # superseded: stop retrying this one
                discard(snap)
                self._current = None
            elif newer:  # the best one is retried after the newer one, which is not held up by it
                self._queued.append(snap)
                self._current = None
            else:
                self._retry_at = clock.monotonic() + delay
            self._cond.notify_all()

    def _folder_gone(self, snap: Snapshot) -> None:
        """The run folder is gone (deleted or moved?): this runtime stops writing there, training stops at its
        next step (`Run.stop_if_lease_lost`), and the start_run cell run again makes the folder anew. Nothing
        is deleted: the Trainer's checkpoints stay on this VM's disk."""
        reason = f"the run folder {self.run_dir} is gone (deleted or moved?)"
        self.notices.add(f"{reason}: checkpoint-{snap.step} and what follows stay on this VM's disk, and training "
                         f"stops at its next step. Run the start_run cell again: it makes the folder anew and uploads "
                         f"the newest checkpoint")
        self.journal.write("warn", what="run_folder_gone", step=snap.step)
        with self._cond:
            waiting = [snap, *self._queued]
        for kept in waiting:  # resumable from this disk: the start_run cell run again finds them
            keep_on_disk(kept)
        self.pause(reason)
        with self._cond:
            self._current = None
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

    def _make_room(self) -> None:
        """Drive has no room for the next checkpoint: keep as little as the rules allow (`Pruner.prune`'s
        `tight`), each deletion on its proof, and say what went."""
        protect = {s.step for s in (self._current,) if s is not None} | self.protected
        gone = self.pruner.prune(self.tracker, protect=protect, best=self.best_step, tight=True)
        if gone:
            self.notices.add(f"Drive is full: deleted {', '.join(f'checkpoint-{s}' for s in gone)} to make room "
                             f"(each once a newer one was safe, as always); fewer checkpoints are kept until there "
                             f"is room again. Free space at drive.google.com (the Trash counts too)")
            self.journal.write("warn", what="drive_full", deleted=gone)

    def _prune(self) -> None:
        protect = {s.step for s in (self._current,) if s is not None} | self.protected
        done = self.pruner.prune(self.tracker, protect=protect, best=self.best_step)
        if done is None or self.pruner.again:  # a doubt, or a deletion the gate kept: looked at again, backing off
            self._prune_backoff = min(_LADDER_AGAIN_S, 2 * self._prune_backoff or _PRUNE_AGAIN_S)
            self._prune_at = clock.monotonic() + self._prune_backoff
        else:
            self._prune_backoff = 0.0
            if self.pruner.kind == UNCONFIRMED and len(self.tracker.checkpoint_steps()) > 1:
                self._prune_at = clock.monotonic() + _LADDER_AGAIN_S
            else:
                self._prune_at = float("inf")
        # The spaced looks at a folder that may hold no checkpoint, one a pass: the next one is due then.
        self._prune_at = min(self._prune_at, self.gate.evidence.next_look_at())
