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

from ..checkpoints.clock import clock
from .._notices import Notices
from ..checkpoints.checkpoint import CHECKPOINTS
from ..checkpoints.journal import Journal
from ..checkpoints.snapshot import Snapshot, discard, keep_on_disk
from .cloud import CloudTracker
from .drivefs import DRIVEFS, PLAIN, UNCONFIRMED
from .gate import CheckpointGate
from .publish import Publisher
from .retention import Ladder, Pruner
from .upkeep import DeferredWrites, KeptCopies
from . import worker
from .worker import MirrorWorker

__all__ = ["Mirror"]

log = logging.getLogger(__name__)


class Mirror(MirrorWorker):
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
        confirmed_steps: those the journal says reached the cloud (never taken as holding no checkpoint).
    """

    def __init__(self, run_dir: str | Path, *, keep: int, journal: Journal, notices: Notices,
                 on_disconnected: Callable[[], None] | None = None,
                 backoff: tuple[float, float] = (2.0, 120.0), kind: str = PLAIN, prune_after: str = "cloud",
                 writer: bool = True, ladder: Ladder = Ladder(), pace_bps: float = 1e6, lease=None,
                 on_lease_lost: Callable[[], None] | None = None, api=None, threaded: bool = True,
                 known_steps=(), confirmed_steps=(), kind_settled: bool = True):
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
        told = set(confirmed_steps)  # what the journal says reached the cloud, followed or not
        self.gate.evidence.confirmed = lambda: self.tracker.confirmed_steps(verified_only=False) | told
        self.pruner = Pruner(self.run_dir / CHECKPOINTS, kind=rule_kind, keep=self.keep, gate=self.gate, ladder=ladder)
        self.deferred = DeferredWrites()
        self.kept = KeptCopies(self.tracker, notices, journal)
        self.lease, self.on_lease_lost = lease, on_lease_lost
        self.publisher = Publisher(self.run_dir, tracker=self.tracker, journal=journal, notices=notices,
                                   backoff=backoff, on_disconnected=on_disconnected, gate=self.gate,
                                   known_steps=known_steps)
        self.publisher.on_full = self._make_room
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
        self._adopt_at = float("inf")  # what the folder held at the start is read again then (a read failed)
        self._prune_backoff = 0.0  # seconds until the next pass after a doubt or a kept deletion (doubling)
        self._reprobe_at = (float("inf") if kind_settled or kind != UNCONFIRMED
                            else clock.monotonic() + worker.REPROBE_S)
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
        the best one: that one is uploaded first). A later save of the same step replaces an earlier one
        wherever it waits, and the earlier one, if it is being uploaded, is not tried again (`_failed`)."""
        with self._cond:
            if self._closed or self._paused:
                (keep_on_disk if self.folder_gone else discard)(snapshot)
                return
            kept = []
            for old in self._queued:
                if old.step == snapshot.step:  # saved again at the same step: the later save is the one
                    log.info("checkpoint-%d saved again before its upload: the later save replaces it", old.step)
                    discard(old)
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
    def alive(self) -> bool:
        """Its worker thread runs (not in a forked copy, nor where the caller steps it)."""
        return self._thread.is_alive()

    @property
    def closed(self) -> bool:
        """Closed by `finish()`: it takes no more checkpoints."""
        return self._closed

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
    folder_gone = property(lambda self: self.publisher.folder_gone)

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
        """Stop for good (the lease was lost to another runtime, or the run folder is gone): nothing more is
        uploaded, pruned, journaled or written to the run folder by this runtime; what was queued is dropped and
        said."""
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
        if self._closed and threading.current_thread() is self._thread:
            return False  # a worker told to stop (one that outlived close's wait) acts on nothing more
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
