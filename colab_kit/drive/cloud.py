"""Which checkpoints are in the cloud: confirmation polling, the upload rate, what is pending.

A checkpoint goes through three states, and the kit reports each for what it is:

    saved      on the VM's local disk (the Trainer's save)
    written    copied to the persistent folder and read back (a `sync` event); on Google Drive
               this is DriveFS's cache on the same VM disk, which dies with the runtime
    in cloud   confirmed uploaded (a `cloud` event: the one durability claim)

`CloudTracker` holds the written-but-unconfirmed items (checkpoints and `final/`), polls
DriveFS's attributes with a backoff that grows with each item's age (so a 10-second upload is
timed to about a second and a 20-minute one is polled every 15 s), and measures the upload
rate from the confirmations. It never blocks training: the mirror thread polls it, and so does
`run.finish()` while it waits.

Only an item whose every byte is known to match its manifest (`verified`: published and read back,
fetched, or found VALID by `validity.check`) is ever claimed in the cloud. An item that a poll
cannot find is not forgotten: it stays pending, `missing` since then, and the mirror uploads it
again from its local copy when it stays missing (a file can vanish from Drive's listing for a
moment).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .._notices import Countdown
from .._units import format_age, format_bytes
from ..checkpoints import storage, validity
from ..checkpoints.checkpoint import list_checkpoints
from ..checkpoints.journal import Journal
from ..checkpoints.manifest import MANIFEST, Manifest
from .drivefs import PLAIN, UNCONFIRMED, in_cloud

__all__ = ["Upload", "CloudTracker", "cloud_files", "upload_for"]

log = logging.getLogger(__name__)
POLL_MIN_S, POLL_MAX_S = 0.1, 15.0
_RATE_SAMPLES = 5


@dataclass
class Upload:
    """One folder written to the persistent folder, on its way to the cloud."""

    label: str  # "checkpoint-30" or "final"
    step: int | None  # None for final/
    folder: Path
    files: dict[str, str | None]  # name -> our md5 (None: not known), MANIFEST.json included
    bytes: int
    saved: float  # time.time() when its state was saved on local disk
    started: float = field(default_factory=time.monotonic)  # writing to the folder began
    written: float = field(default_factory=time.monotonic)  # its manifest was written
    measure: bool = True  # False when `started` is not known (found at start-up)
    confirmed: float | None = None  # time.monotonic() when seen in the cloud
    confirmed_at: float | None = None  # time.time() of the same moment
    pending_bytes: int = 0
    next_poll: float = 0.0
    verified: bool = True  # every byte known to match the manifest (False: found at start, not read yet)
    written_at: float = field(default_factory=time.time)  # time.time() when its manifest was written
    missing_since: float | None = None  # time.monotonic() since when a poll cannot find it
    source: Path | None = None  # a local folder with the same files, to upload it again from
    manifest: Manifest | None = None


def cloud_files(folder: Path, manifest: Manifest) -> dict[str, str | None]:
    """What must be in the cloud for `folder` to be: name -> our md5 (None: not known), its
    MANIFEST.json included."""
    files: dict[str, str | None] = {name: entry.md5 or None for name, entry in manifest.files.items()}
    try:
        files[MANIFEST] = hashlib.md5(storage.read_bytes(folder / MANIFEST)).hexdigest()
    except OSError:
        files[MANIFEST] = None
    return files


def upload_for(folder: Path, manifest: Manifest, label: str, *, saved: float | None = None,
               started: float | None = None, measure: bool = True, source: Path | None = None,
               verified: bool = True, written_at: float | None = None) -> Upload:
    """The `Upload` of a published folder whose MANIFEST.json is `manifest`."""
    files = cloud_files(folder, manifest)
    now = time.monotonic()
    return Upload(label=label, step=manifest.step if label != "final" else None, folder=folder, files=files,
                  bytes=manifest.total_bytes, saved=manifest.created if saved is None else saved,
                  started=now if started is None else started, written=now, measure=measure,
                  pending_bytes=manifest.total_bytes, source=source, verified=verified,
                  written_at=time.time() if written_at is None else written_at, manifest=manifest)


class CloudTracker:
    """The cloud state of one run folder's uploads; thread-safe.

    Args:
        kind: `drivefs.DRIVEFS`, `UNCONFIRMED` or `PLAIN` (see `drivefs.folder_kind`).
        journal: where `cloud` events go (None: nowhere).
    """

    def __init__(self, kind: str, journal: Journal | None = None):
        self.kind = kind
        self.journal = journal
        self._items: list[Upload] = []
        self._samples: list[float] = []  # recent upload rates, bytes/s
        self._last_confirmed: float | None = None
        self.last_bytes = 0  # size of the newest checkpoint written
        self._lock = threading.RLock()

    # -- adding and forgetting ---------------------------------------------------------------------
    def add(self, upload: Upload, *, confirmed: bool | None = None) -> bool:
        """Track `upload`; True when it is in the cloud already (on a plain folder: written is enough).

        `confirmed=True` records it as confirmed without an event (found so at start-up).
        """
        with self._lock:
            self._items = [u for u in self._items if u.label != upload.label]
            self._items.append(upload)
            if upload.step is not None:
                self.last_bytes = upload.bytes
            upload.next_poll = time.monotonic() + POLL_MIN_S
            if confirmed:
                upload.confirmed, upload.confirmed_at, upload.pending_bytes = time.monotonic(), time.time(), 0
                return True
            if self.kind != PLAIN:
                return False
            self._confirm(upload)
        self._journal_confirmed([upload])
        return True

    def adopt(self, root: Path) -> None:
        """Learn the cloud state of the checkpoints already under `root` (a restart): those in the
        cloud are known (no `cloud` event: not news), the others are followed. What was verified
        (the checkpoint resumed from) is claimed at once; the others are read before they are
        counted (`Pruner.prune`). Unfinished, invalid and unreadable folders are not followed."""
        for step, path in list_checkpoints(root):
            verdict = validity.check(path, step=step, hashes=False)
            if verdict.state != validity.VALID and verdict.reason != validity.SIZES_MATCH:
                log.debug("not adopting %s: %s", path, verdict)
                continue
            try:
                written_at = storage.stat(path / MANIFEST).st_mtime
                upload = upload_for(path, verdict.manifest, f"checkpoint-{step}", measure=False,
                                    verified=verdict.valid, written_at=written_at)
                done, upload.pending_bytes = in_cloud(path, upload.files, self.kind)
            except OSError as exc:
                log.debug("not adopting %s yet: %s", path, exc)
                continue
            self.add(upload, confirmed=done)

    def mark_verified(self, step: int) -> None:
        """Every byte of checkpoint `step` matches its manifest: it may now be claimed."""
        with self._lock:
            for upload in self._items:
                if upload.step == step:
                    upload.verified = True

    def forget(self, label: str) -> None:
        with self._lock:
            self._items = [u for u in self._items if u.label != label]

    # -- polling ---------------------------------------------------------------------------------
    def poll(self, force: bool = False) -> list[Upload]:
        """Check the items whose poll is due (all with `force`); returns the newly confirmed.

        The attributes are read outside the lock: a slow or hung mount delays only the poller,
        never the training loop reading `summary()` for the gauges.
        """
        now = time.monotonic()
        with self._lock:  # on an UNCONFIRMED folder the poll only sees whether the files are there
            due = [u for u in self._items if u.confirmed is None and (force or now >= u.next_poll)]
        seen = []
        for upload in due:
            try:
                seen.append((upload, *in_cloud(upload.folder, upload.files, self.kind), False))
            except FileNotFoundError:  # missing from a listing, for a moment or for good: still pending
                seen.append((upload, False, upload.pending_bytes, True))
            except OSError as exc:  # Drive trouble: look again later
                log.debug("cannot read the upload state of %s: %s", upload.folder, exc)
                seen.append((upload, False, upload.pending_bytes, False))
        confirmed = []
        with self._lock:
            for upload, done, pending, missing in seen:
                if upload.confirmed is not None or upload not in self._items:
                    continue  # confirmed by another poller meanwhile, or forgotten
                upload.missing_since = (upload.missing_since or now) if missing else None
                if done:
                    self._confirm(upload)
                    if upload.verified:
                        confirmed.append(upload)
                else:
                    upload.pending_bytes = pending
                    age = now - upload.written
                    upload.next_poll = now + min(POLL_MAX_S, max(POLL_MIN_S, 0.1 * age))
        self._journal_confirmed(confirmed)
        return confirmed

    def missing(self, grace: float) -> list[Upload]:
        """What a poll has not found for `grace` seconds or more (the mirror uploads it again)."""
        now = time.monotonic()
        with self._lock:
            return [u for u in self._items if u.missing_since is not None and now - u.missing_since >= grace]

    def _confirm(self, upload: Upload) -> None:
        """Mark `upload` in the cloud and take a rate sample (with the lock held)."""
        now = time.monotonic()
        upload.confirmed, upload.confirmed_at, upload.pending_bytes = now, time.time(), 0
        # Uploads go one after another: this one had the line to itself from the moment it was
        # written or the previous one landed, whichever came later.
        began = max(upload.started, self._last_confirmed or upload.started)
        if upload.measure and now - began > 0.05 and upload.bytes > 0:
            self._samples = (self._samples + [upload.bytes / (now - began)])[-_RATE_SAMPLES:]
        self._last_confirmed = now

    def _journal_confirmed(self, uploads: list[Upload]) -> None:
        for upload in uploads:
            if self.journal is not None:
                fields = {"step": upload.step} if upload.step is not None else {"what": "final"}
                rate = self.rate_bps
                self.journal.write("cloud", **fields, seconds=round(upload.confirmed_at - upload.saved, 2),
                                   bytes=upload.bytes, rate_bps=round(rate) if rate else None)
            log.info("%s is in the cloud (%s)", upload.label, format_bytes(upload.bytes))

    def next_poll_in(self) -> float | None:
        """Seconds until an item is due for polling; None when nothing waits."""
        with self._lock:
            due = [u.next_poll for u in self._items if u.confirmed is None]
        return max(0.0, min(due) - time.monotonic()) if due else None

    # -- what is known -------------------------------------------------------------------------------
    @property
    def rate_bps(self) -> float | None:
        """The measured upload rate (median of the recent confirmations), bytes per second."""
        with self._lock:
            if not self._samples:
                return None
            ordered = sorted(self._samples)
            return ordered[len(ordered) // 2]

    def expected_upload_s(self, nbytes: int) -> float | None:
        """Seconds to upload `nbytes` at the measured rate (None: no rate yet, or nothing to upload)."""
        rate = self.rate_bps
        return nbytes / rate if rate and nbytes else None

    def get(self, label: str) -> Upload | None:
        with self._lock:
            return next((u for u in self._items if u.label == label), None)

    def confirmed_steps(self, *, verified_only: bool = True) -> set[int]:
        """Checkpoints in the cloud (`verified_only=False`: also those not yet read since a restart)."""
        with self._lock:
            return {u.step for u in self._items if u.confirmed is not None and u.step is not None
                    and (u.verified or not verified_only)}

    def checkpoint_steps(self) -> set[int]:
        """Every checkpoint followed (written to the folder, confirmed or not)."""
        with self._lock:
            return {u.step for u in self._items if u.step is not None}

    def settled_steps(self, age: Callable[[int], float]) -> set[int]:
        """Checkpoints written at least `age(bytes)` seconds ago (a Drive mount without attributes)."""
        now = time.time()
        with self._lock:
            return {u.step for u in self._items if u.step is not None and now - u.written_at >= age(u.bytes)}

    def newest_in_cloud(self) -> Upload | None:
        with self._lock:
            done = [u for u in self._items if u.confirmed is not None and u.step is not None and u.verified]
            return max(done, key=lambda u: u.step) if done else None

    def pending(self) -> list[Upload]:
        """Written, not yet confirmed (on an UNCONFIRMED folder: everything written)."""
        with self._lock:
            return [u for u in self._items if u.confirmed is None]

    @property
    def pending_bytes(self) -> int:
        return sum(u.pending_bytes for u in self.pending())

    def eta_s(self) -> float | None:
        """Seconds until the pending bytes are up, at the measured rate (None: not known)."""
        pending = self.pending_bytes
        if self.kind == UNCONFIRMED:
            return None
        return 0.0 if not pending else self.expected_upload_s(pending)

    def all_in_cloud(self) -> bool:
        return self.kind != UNCONFIRMED and not self.pending()

    def wait(self, deadline: float | None) -> bool:
        """Poll until everything written is in the cloud or `deadline` (monotonic) passes, showing
        a countdown (main thread only); False at once on a folder that cannot confirm uploads."""
        countdown = None
        while True:
            self.poll()
            if self.all_in_cloud() or self.kind == UNCONFIRMED:
                return self.all_in_cloud()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            countdown = countdown or Countdown()
            eta, rate = self.eta_s(), self.rate_bps
            countdown.show(f"colab_kit: waiting for Drive to upload {format_bytes(self.pending_bytes)} "
                           f"({self.pending_labels()})"
                           + (f": ~{format_age(eta)} left at {format_bytes(rate)}/s" if eta and rate else "")
                           + (f"; giving up in {format_age(left)}" if left is not None else ""))
            time.sleep(min(1.0, left) if left is not None else 1.0)

    def pending_labels(self) -> str:
        """"checkpoint-60, final/": what is written and not yet in the cloud."""
        return ", ".join(u.label + ("/" if u.step is None else "") for u in self.pending())

    def summary(self) -> dict:
        """The facts `run.status()`, finish and the gauges report."""
        newest = self.newest_in_cloud()
        rate, eta = self.rate_bps, self.eta_s()
        return {
            "durability": self.kind,
            "cloud_step": newest.step if newest else None,
            "cloud_age_s": round(time.time() - newest.saved, 1) if newest else None,
            "pending": [u.label for u in self.pending()],
            "pending_bytes": self.pending_bytes,
            "pending_eta_s": round(eta, 1) if eta is not None else None,
            "upload_rate_bps": round(rate) if rate else None,
        }

    def describe(self) -> str:
        """One short line: the newest checkpoint in the cloud, its age, and what is pending."""
        facts = self.summary()
        pending = self.pending()
        if self.kind == UNCONFIRMED:
            written = [u.label for u in pending]
            return ("written to Drive, upload not confirmed: " + ", ".join(written)) if written else \
                "nothing written to Drive yet"
        if facts["cloud_step"] is not None:
            text = f"in the cloud: {facts['cloud_step']} ({format_age(facts['cloud_age_s'])} old)"
        else:
            text = "nothing in the cloud yet"
        if pending:
            eta = facts["pending_eta_s"]
            text += (f"; uploading {format_bytes(facts['pending_bytes'])}"
                     + (f", ~{format_age(eta)} left" if eta is not None else ""))
        return text
