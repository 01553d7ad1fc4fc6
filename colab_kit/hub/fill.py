"""The replica filled from the Hub: what a resume needs at once, the rest behind it, each folder whole.

A new VM's replica starts empty, and a run on the Hub holds `keep` checkpoints, `final/` and the journal: GBs
in a real run, of which a resume needs one checkpoint. `Fill.now` (start_run waits for it) fetches the small
files of the run folder, the checkpoint a resume will choose (the newest whose manifest's files the Hub
holds), every folder of a newer step (a save cut short: the resume judges it) and the Trainer's best, which
that checkpoint names. The older checkpoints and `final/` come after (`Fill.later`: a thread in a real run,
an event in the simulator, or on demand: `save_final` asks for `final/` before it replaces it).

Each folder is downloaded into a staging folder beside the replica, every file checked against the sha256
the Hub's listing shows (the client checks sizes only), and moved into the replica whole: a folder that
showed up half-filled would look like a checkpoint whose upload never ended, which the gate may delete
(issue 38).

The retention rules judge the whole run, never the part that has arrived: the checkpoints still on their way
are shown to them (`elsewhere`, `whole_steps`) as the Hub holds them at the head, and one the rules let go is
deleted by a commit without being fetched (`leaving`). A Hub that refuses downloads for the rest of the run
then costs the replica its older checkpoints, never the repo its retention.

`archive/` is never fetched: nothing on the VM reads the Hub's archive (the store only sends the replica's
own archive/ to it).
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from ..checkpoints import storage
from ..checkpoints.checkpoint import ARCHIVE, CHECKPOINTS, FINAL, recorded_best, step_of
from ..checkpoints.journal import EVENTS
from ..checkpoints.manifest import MANIFEST, Manifest, parse_manifest
from . import staging
from .repo import HubFile, HubUnavailable

__all__ = ["Fill", "RETRY_S"]

log = logging.getLogger(__name__)
RETRY_S = (30.0, 60.0, 120.0, 300.0)  # the background's pauses after the Hub did not answer (the last repeats)
TOP = ""  # the folder key of the run folder's own files (the journal, settings, metrics)

Progress = Callable[[int, int, int, int], None]


class Fill:
    """The filling of one `HubStore`'s replica, for one start.

    Args:
        store: the `HubStore` (its repo, lease, replica and the rules for the journal and for local copies).
    """

    def __init__(self, store):
        self.store = store
        self.head: str | None = None
        self.listing: dict[str, HubFile] = {}
        self.manifests: dict[str, Manifest] = {}  # folder key -> its manifest as the Hub holds it at `head`
        self.raw: dict[str, bytes] = {}  # folder key -> that manifest's bytes (what the gate compares)
        self.whole: set[str] = set()  # the checkpoints whole on the Hub at `head` that the run has not deleted
        self.later: dict[str, list[str]] = {}  # folder key -> its paths in the repo, still to fetch
        self.failed: str | None = None  # why the last try of `later` failed (None: it did not)
        self._lock = threading.Lock()  # one filling at a time: the thread's, or one asked for on demand
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.staging = staging.staging_folder(store.replica, os.getpid())

    # -- at the start ------------------------------------------------------------------------------------
    def now(self, progress: Progress | None = None) -> int:
        """Fetch what a resume needs; returns the files downloaded. `progress(bytes_done, bytes_all, files_done,
        files_all)` is told after each file. Raises HubUnavailable when the Hub cannot be read (nothing is decided
        from a failed read)."""
        store = self.store
        staging.sweep(store.replica)
        self.head = store.lease.head
        listing = store.repo.listing(store.folder, revision=self.head)
        listing.update(store.repo.listing(store.folder, revision=self.head))  # absence is not evidence: look twice
        self.listing = listing
        groups = self._groups(listing)
        chosen = self._chosen(groups)
        first = [key for key in groups if _needed_first(key, chosen)]
        self.later = {key: paths for key, paths in groups.items() if key not in first}
        fetched = self._fetch({key: groups[key] for key in first}, progress)
        best = self._best(chosen)
        if best in self.later:  # the Trainer's best: resume restores load_best_model_at_end's choice from it
            fetched += self._fetch({best: self.later.pop(best)}, progress)
        if chosen is not None and not self._holds(chosen):  # it did not verify here: the older ones, now
            fetched += self._fetch(self.later, progress)
            self.later = {}
        return fetched

    def _groups(self, listing: dict[str, HubFile]) -> dict[str, list[str]]:
        """The run's files at the head by folder key (TOP, `final`, `checkpoints/checkpoint-<n>`), the files a
        manifest names that the listing missed included (asked for by name: a listing that misses a file proves
        nothing); the lease and archive/ left out."""
        store = self.store
        groups: dict[str, list[str]] = {}
        for path in listing:
            if path != store.lease.path:
                groups.setdefault(self._key(path), []).append(path)
        groups.pop(ARCHIVE, None)
        for key in list(groups):
            if key != FINAL and not key.startswith(f"{CHECKPOINTS}/"):
                continue
            raw = store.repo.read(f"{self._where(key)}/{MANIFEST}", revision=self.head)  # by name, listed or not
            manifest = parse_manifest(raw) if raw is not None else None
            if manifest is None:
                continue
            self.manifests[key], self.raw[key] = manifest, raw
            for name in (*manifest.files, MANIFEST):
                path = f"{self._where(key)}/{name}"
                if path not in listing and store.repo.read(path, revision=self.head) is not None:
                    groups[key].append(path)
        journal = store._journal_path
        if journal not in listing and store.repo.read(journal, revision=self.head) is not None:
            groups.setdefault(TOP, []).append(journal)
        return groups

    def _chosen(self, groups: dict[str, list[str]]) -> str | None:
        """The checkpoint a resume will choose: the newest whose manifest's files the Hub holds at the head,
        each with the manifest's size and sha256 where the listing shows it (None: no checkpoint is whole)."""
        whole = []
        for key, manifest in self.manifests.items():
            if not key.startswith(f"{CHECKPOINTS}/"):
                continue
            there = set(groups[key])
            if all(self._matches(f"{self._where(key)}/{name}", entry, there) for name, entry in manifest.files.items()):
                whole.append(key)
        self.whole = {key for key in whole if _step(key) is not None}
        return max(whole, key=_step, default=None)

    def _matches(self, path: str, entry, there: set[str]) -> bool:
        listed = self.listing.get(path)
        if listed is None:
            return path in there  # named by the manifest, missed by the listing, there when asked for by name
        return listed.size == entry.size and listed.sha256 == entry.sha256

    def _best(self, chosen: str | None) -> str | None:
        """The folder key of the checkpoint that the chosen one's trainer_state.json names as best."""
        if chosen is None:
            return None
        best = recorded_best(self.store.replica / chosen)
        return f"{CHECKPOINTS}/checkpoint-{best}" if best is not None else None

    def _holds(self, key: str) -> bool:
        from ..checkpoints import validity

        try:
            return validity.check(self.store.replica / key).valid
        except OSError:
            return False

    # -- behind the start ----------------------------------------------------------------------------------
    def elsewhere(self) -> dict[int, tuple[bytes | None, bool]]:
        """The checkpoints still on their way from the Hub: step -> (their manifest's bytes at the head, None
        without one; whole there: every file the manifest names listed with its sha256)."""
        keys = [key for key in list(self.later) if key.startswith(f"{CHECKPOINTS}/") and _step(key) is not None]
        return {_step(key): (self.raw.get(key), key in self.whole) for key in keys}

    def whole_steps(self) -> set[int]:
        """The steps of the checkpoints whole on the Hub at the head (arrived or not) that the run has not
        deleted: in the cloud by the store's own proof, before the tracker has adopted those that arrived."""
        return {_step(key) for key in list(self.whole)}

    def same_there(self, step: int, raw: bytes | None) -> str | None:
        """For the gate: checkpoint `step`, chosen while still on its way, is what it was chosen as (its manifest's
        bytes `raw`), read afresh (in the replica once it arrived, else on the Hub at the lease's head); None when
        it is, else why not."""
        key = f"{CHECKPOINTS}/checkpoint-{step}"
        if key not in self.later:
            local = self.store.replica / key / MANIFEST
            try:
                now = storage.read_bytes(local) if storage.exists(local) else None
            except OSError as exc:
                return f"checkpoint-{step} could not be read again ({exc})"
        else:
            try:
                now = self.store.repo.read(f"{self._where(key)}/{MANIFEST}", revision=self.store.lease.head)
            except OSError as exc:  # HubUnavailable: unknown
                return f"checkpoint-{step} could not be read again on the Hub ({exc})"
        return None if now == raw else f"checkpoint-{step}'s manifest changed since it was chosen"

    @contextmanager
    def leaving(self, key: str):
        """Around the commit that deletes folder `key` from the Hub: one still on its way leaves the filling first
        (never fetched, never placed after its deletion) and comes back to it when the commit failed. Raises
        HubUnavailable while the filling works on a folder (the next pass of the rules tries again)."""
        if key not in self.later:
            yield
            self.whole.discard(key)
            return
        if not self._lock.acquire(blocking=False):
            raise HubUnavailable(f"{key} is not deleted while the replica's filling downloads a folder: the next "
                                 f"pass tries again")
        try:
            paths = self.later.pop(key, None)
            try:
                yield
            except BaseException:
                if paths is not None:
                    self.later[key] = paths
                raise
            self.whole.discard(key)
        finally:
            self._lock.release()

    def fill(self, key: str | None = None, *, stoppable: bool = False, progress: Progress | None = None) -> bool:
        """Fetch the folder `key` (default: every one still to come, newest first) now, if it is still to come;
        True when nothing of it is left to fetch. A Hub that does not answer is said in `failed` (and False).
        One folder at a time holds the lock: `save_final`'s wait for final/ is one folder long."""
        keys = sorted(self.later, key=lambda k: (k == FINAL, -(_step(k) or 0))) if key is None else [key]
        for k in keys:
            with self._lock:
                if k not in self.later:
                    continue  # fetched meanwhile (on demand, or by the thread)
                try:
                    self._fetch({k: self.later[k]}, progress, stoppable=stoppable)
                except OSError as exc:  # HubUnavailable, a hash that does not match, a local disk that refused
                    self.failed = str(exc)
                    log.info("the replica's filling waits: %s", exc)
                    return False
                self.later.pop(k)
        self.failed = None
        return True

    def start(self, on_filled: Callable[[], None] | None = None) -> None:
        """Fill the rest in a daemon thread, trying again after `RETRY_S` while the Hub does not answer;
        `on_filled()` once everything is there (the mirror learns the folders that arrived)."""
        if not self.later or self._thread is not None:
            return

        def work():
            tries = 0
            while not self._stop.is_set():
                if self.fill(stoppable=True):
                    if on_filled is not None:
                        on_filled()
                    return
                pause = RETRY_S[min(tries, len(RETRY_S) - 1)]
                tries += 1
                if self._stop.wait(pause):
                    return

        self._thread = threading.Thread(target=work, name="colab_kit-hub-fill", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 1.0) -> None:
        """The run ends (its training did): the thread fetches no more (a folder under way is never placed);
        what is asked for on demand (`save_final`'s final/) is still fetched."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- fetching ------------------------------------------------------------------------------------------
    def _fetch(self, groups: dict[str, list[str]], progress: Progress | None, stoppable: bool = False) -> int:
        """Download what the replica lacks of `groups`, each folder through the staging folder; returns the
        files downloaded. The run folder's own files first, then the checkpoints, newest first (each folder's
        manifest before its data), then final/."""
        store = self.store
        wanted = {key: sorted((p for p in paths if not self._same_locally(p)), key=self._order)
                  for key, paths in groups.items()}
        order = sorted(wanted, key=lambda key: (key != TOP, self._order(wanted[key][-1]) if wanted[key] else ()))
        sizes = {path: self.listing[path].size if path in self.listing else 0 for paths in wanted.values()
                 for path in paths}
        total, count, got = sum(sizes.values()), len(sizes), [0, 0]
        for key in order:
            for path in wanted[key]:
                if stoppable and self._stop.is_set():
                    raise HubUnavailable("the run ended before its replica was filled")
                store.repo.download([path], self.staging, revision=self.head)
                self._check(self.staging / path, path)
                got[0], got[1] = got[0] + sizes[path], got[1] + 1
                if progress is not None:
                    progress(got[0], total, got[1], count)
            if wanted[key]:
                if stoppable and self._stop.is_set():  # the run ended while it downloaded: nothing is placed
                    raise HubUnavailable("the run ended before its replica was filled")
                staging.place(store, key, self.staging, wanted[key], folder=self._where(key) if key != TOP else None)
        if storage.exists(self.staging):
            storage.remove_tree(self.staging)
        return count

    def _check(self, local: Path, path: str) -> None:
        """The downloaded file holds what the Hub's listing (or, for a file it missed, the manifest) says."""
        listed = self.listing.get(path)
        key = self._key(path)
        entry = self.manifests[key].files.get(path.rsplit("/", 1)[1]) if key in self.manifests else None
        sha256 = listed.sha256 if listed is not None else entry.sha256 if entry is not None else None
        staging.verify(local, path, sha256=sha256, blob_id=listed.blob_id if listed is not None else None)

    # -- names ---------------------------------------------------------------------------------------------
    def _key(self, path: str) -> str:
        parts = self.store._relative(path).split("/")
        if len(parts) == 1:
            return TOP
        if parts[0] == CHECKPOINTS and len(parts) > 2:
            return f"{CHECKPOINTS}/{parts[1]}"
        return parts[0]

    def _where(self, key: str) -> str:
        folder = self.store.folder
        return f"{folder}/{key}" if folder else key

    def _order(self, path: str) -> tuple:
        """Small files first (the journal, the manifests), then each checkpoint's files, newest first, then
        everything else (`final/`)."""
        parts = self.store._relative(path).split("/")
        if parts[-1] in (EVENTS, MANIFEST) or len(parts) == 1:
            return (0, 0, path)
        key = self._key(path)
        if key.startswith(f"{CHECKPOINTS}/") and _step(key) is not None:
            return (1, -_step(key), path)
        return (2, 0, path)

    def _same_locally(self, path: str) -> bool:
        listed = self.listing.get(path)
        return listed is not None and self.store._same_locally(path, listed)


def _step(key: str) -> int | None:
    return step_of(key.rsplit("/", 1)[-1])


def _needed_first(key: str, chosen: str | None) -> bool:
    """Whether start_run waits for folder `key`: the run folder's own files, any folder but the checkpoints and
    final/, and the checkpoints from the chosen one on (all of them when none is whole)."""
    if key == FINAL:
        return False
    if not key.startswith(f"{CHECKPOINTS}/"):
        return True
    step = _step(key)
    return chosen is None or step is None or step >= _step(chosen)
