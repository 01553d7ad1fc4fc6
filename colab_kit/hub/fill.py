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
(issue 38). Until the older checkpoints are all there the replica is not the whole run, so the gate deletes
nothing (`still_arriving`): the retention rules judge the run, never a part of it.

`archive/` is never fetched: nothing on the VM reads the Hub's archive (the store only sends the replica's
own archive/ to it).
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Callable

from ..checkpoints import storage
from ..checkpoints.checkpoint import ARCHIVE, CHECKPOINTS, FINAL, recorded_best, step_of
from ..checkpoints.clock import clock
from ..checkpoints.journal import EVENTS
from ..checkpoints.manifest import MANIFEST, Manifest, parse_manifest
from .repo import HubFile, HubUnavailable
from .verify import git_blob_id

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
        self.later: dict[str, list[str]] = {}  # folder key -> its paths in the repo, still to fetch
        self.failed: str | None = None  # why the last try of `later` failed (None: it did not)
        self._lock = threading.Lock()  # one filling at a time: the thread's, or one asked for on demand
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- at the start ------------------------------------------------------------------------------------
    def now(self, progress: Progress | None = None) -> int:
        """Fetch what a resume needs; returns the files downloaded. `progress(bytes_done, bytes_all, files_done,
        files_all)` is told after each file. Raises HubUnavailable when the Hub cannot be read (nothing is decided
        from a failed read)."""
        store = self.store
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
            self.manifests[key] = manifest
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
    def still_arriving(self) -> str | None:
        """Why the replica is not the whole run yet (older checkpoints still to come from the Hub), or None."""
        waiting = [key for key in self.later if key.startswith(f"{CHECKPOINTS}/")]
        if not waiting:
            return None
        failed = f"; the last try failed: {self.failed}" if self.failed else ""
        return (f"{len(waiting)} older checkpoint(s) are still arriving from the Hub, and nothing is deleted until "
                f"the replica holds the whole run{failed}")

    def fill(self, key: str | None = None, *, stoppable: bool = False) -> bool:
        """Fetch the folder `key` (default: every one still to come, newest first) now, if it is still to come;
        True when nothing of it is left to fetch. A Hub that does not answer is said in `failed` (and False).
        One folder at a time holds the lock: `save_final`'s wait for final/ is one folder long."""
        keys = sorted(self.later, key=lambda k: (k == FINAL, -(_step(k) or 0))) if key is None else [key]
        for k in keys:
            with self._lock:
                if k not in self.later:
                    continue  # fetched meanwhile (on demand, or by the thread)
                try:
                    self._fetch({k: self.later[k]}, None, stoppable=stoppable)
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
        staging = store.replica.parent / f".fill-{store.replica.name}"
        for key in order:
            for path in wanted[key]:
                if stoppable and self._stop.is_set():
                    raise HubUnavailable("the run ended before its replica was filled")
                store.repo.download([path], staging, revision=self.head)
                self._check(staging / path, path)
                got[0], got[1] = got[0] + sizes[path], got[1] + 1
                if progress is not None:
                    progress(got[0], total, got[1], count)
            if wanted[key]:
                self._place(key, staging, wanted[key])
        if storage.exists(staging):
            storage.remove_tree(staging)
        return count

    def _check(self, local: Path, path: str) -> None:
        """The downloaded file holds what the Hub's listing (or, for a file it missed, the manifest) says: the
        client checks a download's size only. Hashed in chunks right after it landed (the page cache holds it)."""
        listed = self.listing.get(path)
        key = self._key(path)
        entry = self.manifests[key].files.get(path.rsplit("/", 1)[1]) if key in self.manifests else None
        expected = listed.sha256 if listed is not None else entry.sha256 if entry is not None else None
        if expected is not None:
            if storage.sha256_file(local) != expected:
                storage.unlink(local)
                raise OSError(f"{path} as downloaded does not hold the bytes the Hub lists (sha256): fetched again later")
        elif listed is not None and git_blob_id(storage.read_bytes(local)) != listed.blob_id:  # a small git file
            storage.unlink(local)
            raise OSError(f"{path} as downloaded is not the file the Hub lists: fetched again later")

    def _place(self, key: str, staging: Path, paths: list[str]) -> None:
        """Move what was downloaded for `key` into the replica: a folder the replica lacks moves in whole (one
        rename), else file by file; the journal is merged, never replaced (the replica's may be newer)."""
        store = self.store
        target = store.replica / key
        if key != TOP and not storage.exists(target):
            storage.make_dirs(target.parent)
            storage.replace(staging / self._where(key), target)
            return
        for path in paths:
            local = store.replica / store._relative(path)
            storage.make_dirs(local.parent)
            if path == store._journal_path and storage.exists(local):
                store._merge_journal(staging / path, local)
            else:
                storage.replace(staging / path, local)

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
