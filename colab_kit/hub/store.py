"""A run folder kept on the Hugging Face Hub, through a replica on this machine's disk.

The kit's durability core works on a folder: it writes a checkpoint there (data first, MANIFEST.json
last, read back), follows it until it is in the cloud, and lets older ones go through its one gate. On
the Hub the folder is a *replica* on local disk (`<scratch>/hub/<repo>/<name>/`), and this class is what
stands between it and the repo, in the role DriveFS plays for a Drive mount:

- `pull` (at the start, the lease held): the files of the run's folder at the head that a resume needs are made
  present in the replica, the rest behind it (`fill.py`), downloaded where the replica lacks them or holds
  other bytes (a fresh VM starts from the Hub, the same VM after a kernel restart keeps what it has); files
  only in the replica (written, not yet committed) stay, for the uploader to commit; the journal is merged,
  never replaced (the replica's may be newer);
- `confirm` (the tracker, for each written checkpoint and `final/`): the folder is committed in ONE commit,
  manifest included, if the head does not hold it yet, then it is in the cloud when the listing shows every
  file with the manifest's sha256 as its LFS id (`verify.py`);
- `delete` (the gate's deleter): one commit removing the folder, then the replica's copy;
- `sync_small` (the uploader's chores, throttled): the journal and the small files of the run folder
  committed together when they changed, at most once a minute (a repo takes about 128 commits an hour).

Every commit goes through the run's `HubLease`, so none lands once another runtime took the run over.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Callable

from ..checkpoints import storage
from ..checkpoints.checkpoint import ARCHIVE
from ..checkpoints.clock import clock
from ..checkpoints.journal import EVENTS, merge_journals
from ..checkpoints.manifest import MANIFEST, Manifest, parse_manifest
from .fill import Fill
from .lease import HubLease
from .repo import HubFile, HubRepo
from .verify import GITATTRIBUTES, git_blob_id, lfs_rule, not_shown

__all__ = ["HubStore", "SMALL_EVERY_S"]

log = logging.getLogger(__name__)
SMALL_EVERY_S = 60.0


class HubStore:
    """The Hub side of one run folder's replica.

    Args:
        repo: the `HubRepo`.
        lease: the run's `HubLease` (held: every commit goes through it).
        replica: the run folder on local disk; its path in the repo is `lease.folder`.
    """

    def __init__(self, repo: HubRepo, lease: HubLease, replica: Path):
        self.repo, self.lease, self.replica = repo, lease, Path(replica)
        self.folder = lease.folder
        self.calls = 0  # Hub requests made for confirmations (said in status, as the Drive API's)
        self.say = None  # the run's notices (shown on the main thread): the quota truth, said once
        self._quota_said = False
        self._small_at = -float("inf")
        self.fill = Fill(self)

    def describe(self) -> str:
        return f"the Hugging Face Hub ({self.repo.address}, folder {self.folder})"

    def repo_path(self, local: Path) -> str:
        """The path in the repo of a file or folder of the replica."""
        relative = Path(local).relative_to(self.replica).as_posix()
        return self.folder if relative == "." else f"{self.folder}/{relative}"

    # -- the start ---------------------------------------------------------------------------------------
    def ensure_lfs_rule(self) -> None:
        """Every file of the runs under the address's folder goes to LFS, so that a listing shows each one's
        sha256 (`verify.py`): the rule is added to the repo's .gitattributes once, by the lease's commit."""
        rule = lfs_rule(self.repo.address.prefix)
        current = self.repo.read(GITATTRIBUTES, revision=self.lease.head) or b""
        if rule.encode() in current.splitlines():
            return
        self.lease.commit("colab_kit: LFS for the runs' files",
                          add={GITATTRIBUTES: current.rstrip(b"\n") + (b"\n" if current else b"") + rule.encode() + b"\n"})

    def pull(self, progress: Callable[[int, int, int, int], None] | None = None) -> int:
        """Fill the replica with what a resume needs from the run's folder at the lease's head (`fill.py`: the
        small files, the checkpoint a resume chooses, newer folders, the Trainer's best); returns the files
        downloaded. The rest comes with `fill.start()` (or `fill.fill()`). Raises HubUnavailable when the Hub
        cannot be read (nothing is decided from a failed read)."""
        return self.fill.now(progress)

    @property
    def _journal_path(self) -> str:
        return f"{self.folder}/{EVENTS}" if self.folder else EVENTS

    def _relative(self, path: str) -> str:
        return path[len(self.folder) + 1:] if self.folder else path

    @staticmethod
    def _merge_journal(hubs: Path, replicas: Path) -> None:
        """The replica's journal may hold lines the Hub has not got (a kernel restart before they were
        committed) and the Hub's lines the replica lacks (another runtime's): the replica gets both, and the
        uploader commits the merge. Replacing it with the Hub's copy lost those lines for good."""
        merged = merge_journals(storage.read_bytes(hubs), storage.read_bytes(replicas))
        storage.atomic_write_bytes(replicas, merged)

    def _same_locally(self, path: str, listed: HubFile) -> bool:
        """Does the replica hold the listed bytes? An LFS file (a checkpoint's, GBs) is hashed in chunks,
        never read whole into memory; a small one is compared by its git blob id."""
        local = self.replica / self._relative(path)
        try:
            if listed.sha256 is not None:
                return storage.stat(local).st_size == listed.size and storage.sha256_file(local) == listed.sha256
            return git_blob_id(storage.read_bytes(local)) == listed.blob_id
        except FileNotFoundError:
            return False

    # -- the tracker and the gate ------------------------------------------------------------------------
    def confirm(self, folder: Path, manifest: Manifest, *, push: bool = True) -> tuple[bool, int]:
        """(in the cloud, bytes not shown yet) for the published folder `folder` of the replica whose manifest is
        `manifest`: committed first (one commit, manifest included) when `push` and the head does not show it.

        Raises:
            OSError: HubUnavailable (unknown), the replica's copy unreadable, or the lease lost (nothing is
                committed then: the mirror pauses at its next lease check).
        """
        raw = storage.read_bytes(folder / MANIFEST)
        there = parse_manifest(raw)
        if there is None or there.files != manifest.files or there.step != manifest.step:
            raise OSError(f"{folder / MANIFEST} is not the manifest written")
        where = self.repo_path(folder)
        self.calls += 1
        listed = self.repo.listing(where)
        missing = not_shown(where, manifest, raw, listed)
        if missing and push:
            files = self._changed_small()  # the journal rides along: on the Hub it is as new as the checkpoint
            files.update({f"{where}/{name}": folder / name for name in manifest.files})
            files[f"{where}/{MANIFEST}"] = raw  # the bytes checked above: never a manifest written since
            files.update(self._archive_unsent())  # what this folder replaced (final/'s last export), kept there too
            # Published whole, never a union: a file of an earlier export the manifest does not name goes, in the
            # same commit (the replica's swap, through the gate, already moved that export to archive/).
            stale = [path for path in listed if path != f"{where}/{MANIFEST}" and path[len(where) + 1:]
                     not in manifest.files]
            self.lease.commit(f"colab_kit: {folder.name} of {self.replica.name}", add=files, delete=stale)
            self._small_at = clock.monotonic()
            self.calls += 1
            missing = not_shown(where, manifest, raw, self.repo.listing(where))
        pending = sum(manifest.files[name].size for name in missing if name in manifest.files)
        return not missing, pending

    def _archive_unsent(self) -> dict[str, Path]:
        """The replica's archive/ files the Hub does not hold: what a fresh start or a new export of final/ moved
        aside on the replica, committed where the store keeps things (their blobs are mostly on the Hub
        already, under their old paths: the client sends none twice)."""
        archive = self.replica / ARCHIVE
        if not storage.is_dir(archive):
            return {}
        there = self.repo.listing(self.repo_path(archive))
        files = (Path(f) for f in storage.files_under(archive))
        return {self.repo_path(f): f for f in files if self.repo_path(f) not in there and not storage.is_temp_name(f.name)}

    def delete(self, folder: Path) -> None:
        """Remove `folder` (a checkpoint of the replica, or one still on its way to it) from the repo in one
        commit, then from the replica."""
        where = self.repo_path(folder)
        with self.fill.leaving(self._relative(where)):  # one on its way is never fetched after this
            if self.repo.listing(where):
                self.lease.commit(f"colab_kit: prune {folder.name} of {self.replica.name}", delete=[where + "/"])
                if self.say is not None and not self._quota_said:
                    self._quota_said = True
                    self.say(f"{folder.name} was deleted from {self.repo.address}'s main branch, as keep asks; its "
                             f"files stay in the repo's history and count against your Hub storage quota until the "
                             f"history is squashed (the kit never does that by itself): HfApi().super_squash_history("
                             f"{self.repo.address.repo_id!r}, repo_type={self.repo.address.repo_type!r})")
        storage.remove_tree(folder)

    # -- the journal and the small files -----------------------------------------------------------------
    def sync_small(self, force: bool = False) -> bool:
        """Commit the run folder's small files (journal, settings, metrics, gauges) that changed; at most once a
        minute unless `force`. Returns True when the Hub holds them as the replica does now."""
        if not force and clock.monotonic() - self._small_at < SMALL_EVERY_S:
            return False
        changed = self._changed_small()
        if changed:
            self.lease.commit(f"colab_kit: journal of {self.replica.name}", add=changed)
        self._small_at = clock.monotonic()
        return True

    def _changed_small(self) -> dict[str, bytes]:
        listing = self.repo.listing(self.folder)
        changed = {}
        for entry in storage.list_dir(self.replica):
            if entry.is_dir() or storage.is_temp_name(entry.name) or entry.name == Path(self.lease.path).name:
                continue
            data = storage.read_bytes(Path(entry.path))
            where = f"{self.folder}/{entry.name}" if self.folder else entry.name
            listed = listing.get(where)
            if listed is None or not (hashlib.sha256(data).hexdigest() == listed.sha256 if listed.sha256
                                      else git_blob_id(data) == listed.blob_id):
                changed[where] = data
        return changed

