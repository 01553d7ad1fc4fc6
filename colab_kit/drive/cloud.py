"""Which checkpoints are in the cloud: confirmation polling, the upload rate, what is pending.

A checkpoint goes through three states, and the kit reports each for what it is:

    saved      on the VM's local disk (the Trainer's save)
    written    copied to the persistent folder and read back (a `sync` event); on Google Drive
               this is DriveFS's cache on the same VM disk, which dies with the runtime
    in cloud   confirmed uploaded (a `cloud` event: the one durability claim)

`CloudTracker` holds the written-but-unconfirmed items (checkpoints and `final/`), polls
DriveFS's attributes with a backoff that grows with each item's age (so a 10-second upload is
timed to about a second and a 20-minute one is polled every 15 s), and measures the upload
rate from the confirmations. It never blocks training: the mirror's worker polls it, and so does
`run.finish()` while it waits (`lifecycle/finish.wait_for_cloud`).

Only an item whose every byte is known to match its manifest (`verified`: published and read back,
fetched, or found VALID by `validity.check`) is ever claimed in the cloud. An item that a poll
cannot find is not forgotten: it stays pending, `missing` since then, and the mirror uploads it
again from its local copy when it stays missing (a file can vanish from Drive's listing for a
moment).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from ..checkpoints.clock import clock
from .._units import format_age, format_bytes
from ..checkpoints import storage, validity
from ..checkpoints.checkpoint import list_checkpoints
from ..checkpoints.journal import Journal
from ..checkpoints.manifest import MANIFEST
from ..errors import DriveError
from .drivefs import HUB, PLAIN, UNCONFIRMED, in_cloud
from .uploads import Upload, cloud_files, learn_manifest, upload_for

__all__ = ["Upload", "CloudTracker", "cloud_files", "upload_for"]

log = logging.getLogger(__name__)
POLL_MIN_S, POLL_MAX_S = 0.1, 15.0
# Drive's API has per-user query limits: a pending item is listed first when it should be up at the
# measured rate (2 s after it was written at the earliest), then 2 s, 4 s, 8 s, ... later, at most
# every 2 minutes (one `files.list` each).
API_POLL_FIRST_S, API_POLL_MAX_S = 2.0, 120.0
_RATE_SAMPLES = 5


class CloudTracker:
    """The cloud state of one run folder's uploads; thread-safe.

    Args:
        kind: `drivefs.DRIVEFS`, `UNCONFIRMED`, `PLAIN` (see `drivefs.folder_kind`) or `API`.
        journal: where `cloud` events go (None: nowhere).
        api: the `driveapi.DriveApi` that confirms uploads (kind `API`): each file's size and md5
            as Drive's servers report them, instead of DriveFS's attributes.
    """

    def __init__(self, kind: str, journal: Journal | None = None, api=None):
        self.kind = kind
        self.journal = journal
        self.api = api
        self._items: list[Upload] = []
        self._samples: list[float] = []  # recent upload rates, bytes/s
        self._last_confirmed: float | None = None
        self.last_bytes = 0  # size of the newest checkpoint written
        self._lock = threading.RLock()
        self._polling = threading.Lock()  # one poll at a time (one may hang on a stalled mount)
        self.on_confirmed = None  # called with each checkpoint confirmed in the cloud (the status page: `report/`)

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
            first = self._first_api_poll(upload) if self.api is not None and self.kind != HUB else POLL_MIN_S
            upload.next_poll = clock.monotonic() + first
            if confirmed:
                upload.confirmed, upload.confirmed_at, upload.pending_bytes = clock.monotonic(), clock.time(), 0
                return True
            if self.kind != PLAIN:
                return False
            self._confirm(upload)
        self._journal_confirmed([upload])
        return True

    def adopt(self, root: Path) -> bool:
        """Learn the cloud state of the checkpoints already under `root` (a restart): those in the
        cloud are known, the others are followed. What was verified (the checkpoint resumed from) is
        claimed at once, the others once they are read (`mark_verified`, from `Pruner.prune`): a `cloud`
        event with `adopted`, so that the journal knows what this runtime found in the cloud even when the
        runtime that uploaded it died before it could say so. Unfinished and invalid folders are not
        followed; those already followed are left as they are. Returns False when a read failed (the
        listing, or a folder's upload state): the caller adopts again later, for what was not read."""
        try:
            listed = list_checkpoints(root)
        except OSError as exc:
            log.debug("cannot list %s yet: %s", root, exc)
            return False
        complete = True
        for step, path in listed:
            if self.get(f"checkpoint-{step}") is not None:
                continue
            verdict = validity.check(path, step=step, hashes=False)
            if verdict.state != validity.VALID and verdict.reason != validity.SIZES_MATCH:
                log.debug("not adopting %s: %s", path, verdict)
                complete = complete and not verdict.unknown  # unknown now (a read failed, a file hidden): again later
                continue
            try:
                written_at = storage.stat(path / MANIFEST).st_mtime
                upload = upload_for(path, verdict.manifest, f"checkpoint-{step}", measure=False,
                                    verified=verdict.valid, written_at=written_at)
                done, upload.pending_bytes = self._check(upload)
            except OSError as exc:
                log.debug("not adopting %s yet: %s", path, exc)
                complete = False
                continue
            self.add(upload, confirmed=done)
            if done and upload.verified:
                self._journal_confirmed([upload], adopted=True)
        return complete

    def mark_verified(self, step: int) -> None:
        """Every byte of checkpoint `step` matches its manifest: it may now be claimed."""
        claimed = []
        with self._lock:
            for upload in self._items:
                if upload.step == step and not upload.verified:
                    upload.verified = True
                    if upload.confirmed is not None:
                        claimed.append(upload)
        self._journal_confirmed(claimed, adopted=True)

    def forget(self, label: str) -> None:
        with self._lock:
            self._items = [u for u in self._items if u.label != label]

    # -- polling ---------------------------------------------------------------------------------
    def poll(self, force: bool = False) -> list[Upload]:
        """Check the items whose poll is due (all with `force`); returns the newly confirmed.

        The attributes are read outside the lock: a slow or hung mount delays only the poller,
        never the training loop reading `summary()` for the gauges.
        """
        if not self._polling.acquire(blocking=False):
            return []  # another poll is under way (perhaps stuck on Drive): it says what it finds
        try:
            return self._poll(force)
        finally:
            self._polling.release()

    def _poll(self, force: bool) -> list[Upload]:
        now = clock.monotonic()
        with self._lock:  # on an UNCONFIRMED folder the poll only sees whether the files are there
            due = [u for u in self._items if u.confirmed is None and (force or now >= u.next_poll)]
        seen = []
        for upload in due:
            try:
                seen.append((upload, *self._check(upload), False))
            except FileNotFoundError:  # missing from a listing, for a moment or for good: still pending
                seen.append((upload, False, upload.pending_bytes, self.api is None))  # the API: not there yet
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
                    upload.next_poll = now + (min(API_POLL_MAX_S, API_POLL_FIRST_S * 2 ** (upload.polls - 1))
                                              if self.api is not None else min(POLL_MAX_S, max(POLL_MIN_S, 0.1 * age)))
        self._journal_confirmed(confirmed)
        return confirmed

    def _first_api_poll(self, upload: Upload) -> float:
        """Seconds until the API is first asked about `upload`: when it should be up at the measured
        rate (with a margin), at least API_POLL_FIRST_S; one listing then usually confirms it."""
        expected = self.expected_upload_s(upload.bytes)
        return min(API_POLL_MAX_S, max(API_POLL_FIRST_S, 1.2 * expected + 1.0 if expected else 0.0))

    def _check(self, upload: Upload) -> tuple[bool, int]:
        """(in the cloud, bytes not yet there) from DriveFS's attributes, Drive's API, or the Hub (which commits
        the folder first where its head lacks it: `hub/store.py`)."""
        upload.polls += 1
        if self.api is None:
            return in_cloud(upload.folder, upload.files, self.kind)
        if self.kind == HUB:
            before = self.api.calls
            try:
                return self.api.confirm(upload.folder, upload.manifest)
            finally:
                upload.api_calls += self.api.calls - before
        learn_manifest(upload)  # its size or md5, where a read failed as it was written (else nothing is read)
        expected = {name: (upload.sizes[name], md5) for name, md5 in upload.files.items() if name in upload.sizes}
        if len(expected) < len(upload.files):  # a size not known: nothing can be confirmed yet
            return False, upload.pending_bytes
        before = self.api.calls
        try:
            return self.api.confirm(upload.folder, expected)
        except DriveError as exc:  # a second folder of the run's name, say: unknown, never a confirmation
            raise OSError(str(exc)) from exc
        finally:
            upload.api_calls += self.api.calls - before

    def missing(self, grace: float) -> list[Upload]:
        """What a poll has not found for `grace` seconds or more (the mirror uploads it again)."""
        now = clock.monotonic()
        with self._lock:
            return [u for u in self._items if u.missing_since is not None and now - u.missing_since >= grace]

    def _confirm(self, upload: Upload) -> None:
        """Mark `upload` in the cloud and take a rate sample (with the lock held)."""
        now = clock.monotonic()
        upload.confirmed, upload.confirmed_at, upload.pending_bytes = now, clock.time(), 0
        # Uploads go one after another: this one had the line to itself from the moment it was
        # written or the previous one landed, whichever came later.
        began = max(upload.started, self._last_confirmed or upload.started)
        if upload.measure and now - began > 0.05 and upload.bytes > 0:
            self._samples = (self._samples + [upload.bytes / (now - began)])[-_RATE_SAMPLES:]
        self._last_confirmed = now

    def _journal_confirmed(self, uploads: list[Upload], adopted: bool = False) -> None:
        for upload in uploads:
            if self.journal is not None:
                fields = {"step": upload.step} if upload.step is not None else {"what": "final"}
                if adopted:  # found in the cloud at a start, uploaded by an earlier runtime
                    fields["adopted"] = True
                rate = self.rate_bps
                if self.api is not None:  # proof from Drive's servers or the Hub's, and what it cost
                    fields.update(via="hub" if self.kind == HUB else "api", api_calls=upload.api_calls)
                self.journal.write("cloud", **fields, seconds=round(upload.confirmed_at - upload.saved, 2),
                                   bytes=upload.bytes, rate_bps=round(rate) if rate else None)
            log.info("%s is in the cloud (%s)", upload.label, format_bytes(upload.bytes))
            if self.on_confirmed is not None:
                self.on_confirmed(upload)

    def next_poll_in(self) -> float | None:
        """Seconds until an item is due for polling; None when nothing waits."""
        with self._lock:
            due = [u.next_poll for u in self._items if u.confirmed is None]
        return max(0.0, min(due) - clock.monotonic()) if due else None

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
            "cloud_age_s": round(clock.time() - newest.saved, 1) if newest else None,
            "pending": [u.label for u in self.pending()],
            "pending_bytes": self.pending_bytes,
            "pending_eta_s": round(eta, 1) if eta is not None else None,
            "upload_rate_bps": round(rate) if rate else None,
            "api_calls": self.api.calls if self.api is not None else None,
        }

    def describe(self) -> str:
        """One short line: the newest checkpoint in the cloud, its age, and what is pending."""
        facts = self.summary()
        pending = self.pending()
        if self.kind == UNCONFIRMED:
            written = [u.label for u in pending]
            return ("written to Drive, upload not confirmed: " + ", ".join(written)) if written else \
                "nothing written to Drive yet"
        if self.kind == PLAIN:  # a plain folder has no cloud: saved is what there is to say
            return (f"saved: {facts['cloud_step']} ({format_age(facts['cloud_age_s'])} old)"
                    if facts["cloud_step"] is not None else "nothing saved yet")
        if facts["cloud_step"] is not None:
            text = f"in the cloud: {facts['cloud_step']} ({format_age(facts['cloud_age_s'])} old)"
        else:
            text = "nothing in the cloud yet"
        if pending:
            eta = facts["pending_eta_s"]
            text += (f"; uploading {format_bytes(facts['pending_bytes'])}"
                     + (f", ~{format_age(eta)} left" if eta is not None else ""))
        return text
