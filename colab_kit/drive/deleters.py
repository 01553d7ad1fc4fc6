"""How a checkpoint folder is deleted on each kind of folder, once `gate.py` has allowed it.

Nothing here decides anything: the gate takes the proof, then hands the folder to one of these.

    TrashFreeDeleter  Drive through the mount: each file is emptied first, so that Drive's Trash keeps
                      only 0-byte stubs; unlinked once the truncation is in the cloud. Plain folders:
                      a delete is a delete.
    ApiDeleter        Drive's API (`files.delete` by id: nothing goes to the Trash), then the mount's
                      local copy, which DriveFS no longer has anything to upload or trash for.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..checkpoints.clock import clock
from ..checkpoints import storage
from ..errors import DriveError
from .drivefs import API, HUB, PLAIN, UNCONFIRMED, read_upload

__all__ = ["TrashFreeDeleter", "ApiDeleter", "UNCONFIRMED_GRACE_S"]

log = logging.getLogger(__name__)
# Without attributes, a truncation is given this long to reach the cloud before the unlink (only the
# size of the stub left in Drive's Trash depends on it, never what is kept).
UNCONFIRMED_GRACE_S = 120.0


class TrashFreeDeleter:
    """Deletes folders so that Drive's Trash keeps only empty stubs.

    Drive moves every deleted file to its Trash, which counts against the quota for 30 days
    (Drive Help 2375194): a 1.3 GB checkpoint every 10 minutes fills a free Drive in hours. So on
    a Drive mount each file is first truncated to 0 bytes; only once that truncation is in the
    cloud (or, without attributes, after a grace period) are the files unlinked. On a plain
    folder a delete is a delete. `start` never blocks; `poll` finishes what is ready.
    """

    def __init__(self, kind: str, grace_s: float = UNCONFIRMED_GRACE_S):
        self.kind = kind
        self.grace_s = grace_s
        self._waiting: dict[Path, float] = {}  # folder -> when its files were truncated

    @property
    def pending(self) -> list[Path]:
        return list(self._waiting)

    def start(self, folder: Path, first: str | None = None, manifest_md5: str | None = None) -> None:
        """Begin deleting `folder`; the file named `first` (its manifest) is emptied first, so a
        kill half-way leaves a folder that no longer passes for a checkpoint. (`manifest_md5` is for the
        API's deleter; through the mount the gate compared the manifest's bytes already.)"""
        if self.kind == PLAIN:
            _remove_tree(folder, first)
            return
        files = storage.files_under(folder)
        files.sort(key=lambda p: p.name != first)
        for path in files:
            if storage.stat(path).st_size:
                storage.truncate(path, 0)
        self._waiting[folder] = clock.monotonic()

    def poll(self) -> list[Path]:
        """Unlink the folders whose truncations are in the cloud; returns them."""
        done = []
        for folder, since in list(self._waiting.items()):
            try:
                ready = self._truncation_in_cloud(folder, since)
                if ready:
                    _remove_tree(folder, None)
            except FileNotFoundError:
                ready = True
            except OSError as exc:  # Drive trouble: try again at the next poll
                log.debug("deleting %s: %s", folder, exc)
                continue
            if ready:
                del self._waiting[folder]
                done.append(folder)
        return done

    def _truncation_in_cloud(self, folder: Path, since: float) -> bool:
        if self.kind == UNCONFIRMED:
            return clock.monotonic() - since >= self.grace_s
        return all(read_upload(path).uncommitted == b"0" for path in storage.files_under(folder))


class ApiDeleter:
    """Deletes for good through Drive's API (`files.delete` by id), then the mount's local copy. The
    interface of `TrashFreeDeleter`; the gate has checked the id afresh before `start`."""

    kind = API

    def __init__(self, api):
        self.api = api
        self.pending: list[Path] = []  # nothing waits: a delete is done when `start` returns

    def start(self, folder: Path, first: str | None = None, manifest_md5: str | None = None) -> None:
        """Delete `folder` in Drive (only when its `first` file there has `manifest_md5`), then locally.

        Raises:
            OSError: the API did not answer (ApiUnavailable), or the folder in Drive is not the one chosen:
                nothing was deleted; chosen again later.
        """
        try:
            self.api.delete(folder, manifest_md5=manifest_md5, manifest=first or "")
        except FileNotFoundError:  # already gone from Drive: only the local copy is left
            pass
        except DriveError as exc:  # e.g. a folder of the same name appeared: nothing deleted, try later
            raise OSError(str(exc)) from exc
        try:
            _remove_tree(folder, first)
        except OSError as exc:  # the local copy goes at the next start (nothing in Drive is left of it)
            log.debug("removing the mount's copy of %s: %s", folder, exc)

    def poll(self) -> list[Path]:
        return []


class HubDeleter:
    """Deletes a checkpoint from the Hub repo in one commit through the run's lease, then from the replica
    (`hub/store.py`). The interface of `TrashFreeDeleter`. A deletion frees no storage quota while the repo's
    history holds the files (the Hub keeps every commit)."""

    kind = HUB

    def __init__(self, store):
        self.store = store
        self.pending: list[Path] = []  # nothing waits: a delete is done when `start` returns

    def start(self, folder: Path, first: str | None = None, manifest_md5: str | None = None) -> None:
        """Raises OSError (the Hub did not answer, or the lease is lost): nothing was deleted; chosen again later."""
        self.store.delete(folder)

    def poll(self) -> list[Path]:
        return []


def _remove_tree(folder: Path, first: str | None) -> None:
    """Unlink `first`, then every file, then the folders, deepest first."""
    if first is not None:
        try:
            storage.unlink(folder / first)
        except FileNotFoundError:
            pass
    for path in storage.files_under(folder):
        storage.unlink(path)
    _remove_folders(folder)


def _remove_folders(folder: Path) -> None:
    for entry in storage.list_dir(folder):
        if entry.is_dir():
            _remove_folders(Path(entry.path))
    storage.rmdir(folder)
