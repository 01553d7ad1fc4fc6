"""Writing one checkpoint's snapshot to the persistent folder, for the mirror's worker: the files
first, each read back, MANIFEST.json last (`checkpoints.checkpoint.publish_folder`), after checking
that the lease is still this runtime's and that the folder has room; and saying how it went.

A checkpoint folder that holds a manifest is never written over here: the same checkpoint is left as
it is (or repaired, file by file, its manifest untouched); another checkpoint of the same step is
replaced only through the gate (`gate.py`), on the proof that a newer one is in the cloud. A folder
without a manifest is written into when this writer made it, or when looks spaced in time agree that
it has none (a manifest Drive hides for a moment is still a checkpoint).
"""

from __future__ import annotations

import errno
import logging
from pathlib import Path
from typing import Callable

from ..checkpoints.clock import clock
from .._notices import Notices
from .._units import format_age, format_bytes
from ..checkpoints import looks, storage, validity
from ..checkpoints.checkpoint import CHECKPOINTS, checkpoint_dir, publish_folder, repair_folder
from ..checkpoints.journal import Journal
from ..checkpoints.manifest import MANIFEST, Manifest, parse_manifest
from ..checkpoints.snapshot import Snapshot, snapshot_manifest
from .cloud import CloudTracker, Upload, upload_for
from .drivefs import API, DRIVEFS, PLAIN, UNCONFIRMED, check_space
from .gate import CheckpointGate, choose

__all__ = ["Publisher"]

log = logging.getLogger(__name__)
# How long the next checkpoint waits for the previous one to reach the cloud before it goes anyway.
GATE_MIN_S = 600.0


class Publisher:
    """Writes snapshots to `run_dir/checkpoints/` and keeps the count of failures.

    Args:
        backoff: (first, longest) seconds between retries of a failed write.
        on_disconnected: called (from the mirror's worker) on errno 107, to remount Drive.
        gate: the run folder's `CheckpointGate` (another checkpoint of the same step is replaced there).
        known_steps: the checkpoints the journal says the folder holds.
    """

    def __init__(self, run_dir: Path, *, tracker: CloudTracker, journal: Journal, notices: Notices,
                 backoff: tuple[float, float], on_disconnected: Callable[[], None] | None,
                 gate: CheckpointGate, known_steps=()):
        self.run_dir, self.tracker, self.journal, self.notices = Path(run_dir), tracker, journal, notices
        self.backoff, self.on_disconnected, self.gate = backoff, on_disconnected, gate
        self.known_steps = set(known_steps)
        self.on_full: Callable[[], None] | None = None  # makes room on a full Drive (by the deletion rules)
        self.made: set[Path] = set()  # the folders this writer created
        self.written_step: int | None = None
        self.failures = 0  # consecutive failed attempts
        self.total_failures = 0
        self.unsynced_reason: str | None = None
        self._blocking: Path | None = None  # what the try under way found (`write`)
        self.blocked_by: Path | None = None  # a folder of the same step that can be neither read whole nor replaced now
        self.folder_gone = False  # the run folder was missing at every look: training stops (`Run.stop_if_lease_lost`)
        self.in_flight: Upload | None = None  # the upload written last, on its way to the cloud
        self._gate_warned = False

    def may_write_next(self, now: float, pace_bps: float) -> bool:
        """May the next snapshot be written now? On Drive one checkpoint at a time is in DriveFS's
        upload queue: the next waits until the one in flight is in the cloud (or, where nothing
        reports uploads, for its size at `pace_bps`), or until it has waited too long. Pacing only:
        nothing is ever deleted on a rate."""
        upload, tracker = self.in_flight, self.tracker
        if (upload is None or upload.confirmed is not None or tracker.kind == PLAIN
                or tracker.get(upload.label) is not upload):
            return True
        if tracker.kind == UNCONFIRMED:  # nothing reports the upload: give it time, at an assumed rate
            return now - upload.written >= upload.bytes / pace_bps
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

    def write(self, snap: Snapshot, lease_ok: Callable[[], bool | None]) -> Upload | None:
        """Write `snap` (unless the folder holds it already) and return its `Upload`; None when the folder
        holds another checkpoint of this step that the gate kept (said in the journal).

        Raises:
            OSError: Drive trouble, or the lease not confirmed now (EAGAIN). SnapshotChanged.
        """
        # Decided again at every try, and said only when the try ends: `finish` reads it from another thread, and a
        # try that has begun to look has not yet decided (reset as it began, finish saw None and gave the wrong
        # advice under load).
        self._blocking = None
        try:
            return self._write(snap, lease_ok)
        finally:
            self.blocked_by = self._blocking

    def _write(self, snap: Snapshot, lease_ok: Callable[[], bool | None]) -> Upload | None:
        started = clock.monotonic()
        manifest = snapshot_manifest(snap)
        target = checkpoint_dir(self.run_dir / CHECKPOINTS, snap.step)
        state = self._state(target, manifest)  # reads only (and may wait: looks spaced in time)
        held = lease_ok()  # after any wait, right before the first write
        if held is not True:
            raise OSError(errno.EAGAIN, self._why_unconfirmed() if held is None
                          else "another runtime holds the run folder now")
        if state == "same":
            log.info("checkpoint-%d is already on %s", snap.step, self.run_dir)
        elif state == "repair":
            self.gate.evidence.wrote(target)  # counted as the writing begins: what it writes queues behind what came before
            written = repair_folder(snap.path, target, manifest)
            log.info("checkpoint-%d on %s repaired (%s)", snap.step, self.run_dir, ", ".join(written) or "nothing")
        elif state == "other":
            why = self._replace(target, snap, manifest)
            if why is not None:
                if not validity.check(target, step=snap.step).valid:  # a doubt, or a proof still to come: retried
                    self._blocking = target
                    raise OSError(errno.EAGAIN, f"{target.name} holds files of another save that could not be "
                                                f"replaced now ({why})")
                self._kept_other(target, snap)  # a whole checkpoint of this step stays: this one is not uploaded
                return None
        else:  # "new": nothing there, or leftovers without a manifest
            self._check_space(snap)
            self.made.add(target)
            self.gate.evidence.wrote(target)
            publish_folder(snap.path, target, manifest)
        return self._written(snap, target, manifest, started)

    def write_again(self, source: Path, target: Path, manifest: Manifest, lease_ok: Callable[[], bool | None]) -> bool:
        """Upload again, from `source` (a kept local copy), the checkpoint this runtime wrote to `target` and Drive
        lost part or all of, on the rules of a first write: the folder is read now; it is repaired (its manifest
        untouched) where it holds this same checkpoint, written anew (manifest last) where every look finds none;
        False, nothing written, where it holds another checkpoint now: the run was taken over and this VM's view of
        the lease is late, or it was published again (path 9 of issue 46). The checkpoint keeps its place in the
        write order (`evidence.py`) from its first write: counted again here, the simulator found the deletion
        rules broken (Drive world, mode none, seeds 1283 and 7441: the newest checkpoint not whole at the end).

        Raises:
            OSError: Drive trouble, or the lease not confirmed now (EAGAIN).
        """
        state = self._state(target, manifest, look_again=True)  # a manifest Drive hides is still a checkpoint
        if lease_ok() is not True:  # after the looks, right before the first write
            raise OSError(errno.EAGAIN, "the run's lease is not confirmed as this runtime's now")
        if state == "other":  # another checkpoint only on a manifest read whole now; a torn read is unknown
            try:
                there = parse_manifest(storage.read_bytes(target / MANIFEST))
            except FileNotFoundError:
                there = None
            if there is None or there.files == manifest.files and there.step == manifest.step:
                raise OSError(errno.EIO, f"{target.name}: its manifest could not be read whole now")
            return False
        if state != "same":
            if state == "repair":
                repair_folder(source, target, manifest)
            else:
                publish_folder(source, target, manifest)
        return True

    def _state(self, target: Path, manifest: Manifest, look_again: bool = False) -> str:
        """"same", "repair" (the same manifest, a file missing or damaged), "other" (another manifest) or
        "new" (no manifest: every look agrees where one may be, or this writer made the folder and
        `look_again` is False)."""
        def look():
            try:
                return storage.read_bytes(target / MANIFEST)
            except FileNotFoundError:
                return None

        raw = look()
        if raw is None and (look_again or target not in self.made and self._known(target)):
            raw = looks.again(look, lambda answer: answer is None)
        if raw is None:
            return "new"
        there = parse_manifest(raw)
        ours = there is not None and there.files == manifest.files and there.step == manifest.step
        verdict = validity.check(target, step=manifest.step)
        if verdict.unknown and not verdict.absent:  # a torn read among them: look again later
            if not ours:
                self._blocking = target  # another save's, unreadable: finish says what helps (`lifecycle/finish.py`)
            raise OSError(errno.EIO, f"{target.name}: {verdict.reason}")
        if not ours:
            return "other"
        return "same" if verdict.valid else "repair"

    def _known(self, target: Path) -> bool:
        """May `target` hold a checkpoint? (The journal says one was written, or the folder was followed.) A
        step the journal never saw written needs one look only: this runtime holds the lease, and a folder
        left without a manifest by a killed upload is just that."""
        step = int(target.name.split("-")[-1])
        return step in self.known_steps or step in self.tracker.checkpoint_steps()

    def _replace(self, target: Path, snap: Snapshot, manifest: Manifest) -> str | None:
        newest = self.tracker.newest_in_cloud()
        try:
            there = choose(target, snap.step)
            witness = choose(newest.folder, newest.step) if newest is not None else None
        except OSError as exc:
            raise OSError(errno.EIO, f"{target.name} could not be read ({exc})") from exc
        return self.gate.replace(there, witness,
                                 lambda: publish_folder(snap.path, target, manifest, replace=True))

    def _kept_other(self, target: Path, snap: Snapshot) -> None:
        """Say why `snap` was not uploaded: its folder holds another checkpoint of the same step, kept."""
        if target in self.made:  # this runtime wrote it: the same step saved twice, the first save already there
            self.notices.add(f"checkpoint-{snap.step} was saved a second time at the same step after its first save "
                             f"had reached {self.run_dir}: the first save stays there (replacing it could leave no "
                             f"copy in the cloud) and the second was not uploaded; later checkpoints are, as usual")
            self.journal.write("warn", what="saved_twice", step=snap.step)
            return
        self.notices.add(f"{target} holds another checkpoint of step {snap.step} (from an earlier timeline) that may "
                         f"be the only copy in the cloud, so it was kept and this one was not uploaded; the next "
                         f"checkpoint will be")

    def _why_unconfirmed(self) -> str:
        """Why nothing is written: said with what can be seen now. A run folder missing at every look (spaced
        in time: Drive hides things for a moment) stops training at the next step (`folder_gone`); nothing is
        deleted or claimed on it: the checkpoints stay on this VM, and a re-run start_run cell makes the folder
        anew and uploads the newest."""
        def there() -> bool:
            try:
                return storage.exists(self.run_dir)
            except OSError:
                return True  # unknown is not gone
        if there() or looks.again(there, lambda answer: not answer):
            return "the run's lease could not be confirmed, so nothing is written now"
        self.folder_gone = True
        return (f"the run folder {self.run_dir} is not there (deleted or moved?) at {1 + len(looks.WAITS)} looks over "
                f"{looks.span():.0f} s, so this runtime's lease cannot be confirmed and nothing is written: the "
                f"checkpoints stay on this VM. Run the start_run cell again: it makes the folder anew and uploads the "
                f"newest checkpoint")

    def _check_space(self, snap: Snapshot) -> None:
        # Bytes written but not yet uploaded: known only where DriveFS reports them.
        pending = self.tracker.pending_bytes if self.tracker.kind in (DRIVEFS, API) else 0
        try:
            check_space(self.run_dir, snap.bytes, pending, f"checkpoint-{snap.step}")
        except OSError:
            if self.on_full is None:
                raise
            self.on_full()  # make room by the deletion rules, then ask again
            check_space(self.run_dir, snap.bytes, pending, f"checkpoint-{snap.step}")

    def _written(self, snap: Snapshot, target: Path, manifest: Manifest, started: float) -> Upload:
        seconds = clock.monotonic() - started
        self.written_step = snap.step
        if self.failures:
            self.notices.add(f"sync to {self.run_dir} works again; checkpoint-{snap.step} is written")
        self.failures, self.unsynced_reason = 0, None
        self.journal.write("sync", step=snap.step, seconds=round(seconds, 3), bytes=manifest.total_bytes)
        log.info("checkpoint-%d written to %s (%s in %.1f s)", snap.step, self.run_dir,
                 format_bytes(manifest.total_bytes), seconds)
        self.journal.flush(timeout=0)  # asks the lease again: the write may have taken long, and it may be lost now
        self.in_flight = upload_for(target, manifest, f"checkpoint-{snap.step}", saved=snap.taken, started=started,
                                    source=snap.path)
        return self.in_flight

    def failed(self, snap: Snapshot, exc: BaseException) -> float:
        """Count and report a failed write; returns the seconds to wait before the next try."""
        self.failures += 1
        self.total_failures += 1
        self.unsynced_reason = f"{type(exc).__name__}: {exc}"
        delay = min(self.backoff[1], self.backoff[0] * 2 ** (self.failures - 1))
        if self.blocked_by is not None:  # a doubt about the target: its next spaced look may be due sooner
            delay = max(0.0, min(delay, self.gate.evidence.next_look_at([self.blocked_by]) - clock.monotonic()))
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
            self.on_disconnected()  # a remount, here in the mirror's worker: training never waits for it
        return delay
