"""Which checkpoints to delete: only what a newer checkpoint *in the cloud* makes unnecessary.

A delete is a small metadata operation and reaches Drive's cloud before a large pending upload
does, so pruning on anything less than "a newer checkpoint is in the cloud" can leave no
checkpoint in the cloud at all (shown on the DriveFS emulator in tests/test_cloud_e2e.py).
`keep` counts checkpoints in the cloud; what is newer and still on its way is kept too.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Iterable

from ..checkpoints.checkpoint import list_checkpoints
from ..checkpoints.manifest import MANIFEST, read_manifest, verify_folder
from .drivefs import DRIVEFS, PLAIN, UNCONFIRMED, TrashFreeDeleter

__all__ = ["prunable", "choose_doomed", "Pruner", "UNCONFIRMED_SETTLE_S"]

# Without DriveFS's attributes, the newest checkpoint written this long ago (plus 1 s per MB) is
# kept back from pruning: an assumption that it has probably reached the cloud, never reported
# as "in the cloud".
UNCONFIRMED_SETTLE_S = 600.0
log = logging.getLogger(__name__)


def prunable(steps: Iterable[int], valid: set[int], safe: set[int], keep: int,
             protect: set[int] = frozenset(), best: int | None = None) -> list[int]:
    """The checkpoints to delete, given which are valid and which are safe (in the cloud).

    Keeps the `keep` newest safe checkpoints (so at least one always remains), anything newer than
    the newest safe one that is still valid (it may be on its way to the cloud) and `protect`;
    deletes everything else. With no safe checkpoint nothing is deleted: a deletion reaches the
    cloud before a large pending upload does, so pruning on anything less can leave no checkpoint
    in the cloud at all.

    `best`, the Trainer's best checkpoint, is never deleted while it is valid, and once safe it
    takes one of the `keep` places, as in the Trainer's own rotation: with keep=1 the newest and
    the best both stay.
    """
    ranked = sorted(safe & valid, reverse=True)
    if not ranked:
        return []
    newest = ranked[0]
    counted = {newest} | ({best} if best in ranked else set())  # the places of `keep` they take
    for step in ranked:
        if len(counted) >= keep:
            break
        counted.add(step)
    kept = counted | set(protect) | ({best} if best in valid else set())
    return sorted(s for s in steps if s not in kept and (s < newest or s not in valid))


def choose_doomed(root: Path, *, kind: str, prune_after: str, confirmed: set[int], keep: int,
                  protect: set[int], best: int | None = None,
                  deleting: Iterable[Path] = ()) -> list[tuple[int, Path]]:
    """The (step, folder) pairs under `root` to delete now.

    Args:
        kind: the folder's `drivefs` kind. On a DRIVEFS folder the safe checkpoints are those
            `confirmed` in the cloud; on a plain folder written (and verified) is safe; on an
            UNCONFIRMED Drive mount written counts too, but the newest checkpoint written long
            enough ago is kept back as well.
        prune_after: "cloud", or "written" for the rule before 0.2 (every valid one is safe).
        protect: steps never deleted (the one being uploaded).
        best: the Trainer's best checkpoint (see `prunable`).
        deleting: folders already being deleted.
    """
    deleting = set(deleting)
    existing = [(s, p) for s, p in list_checkpoints(root) if p not in deleting]
    manifests = {}
    for step, path in existing:
        try:
            manifest = read_manifest(path)
        except ValueError:
            continue
        if manifest.step == step and verify_folder(path, manifest, hashes=False) is None:
            manifests[step] = (path, manifest)
    valid = set(manifests)
    protect = set(protect)
    safe = confirmed if kind == DRIVEFS and prune_after == "cloud" else valid
    if kind == UNCONFIRMED and prune_after == "cloud":
        settled = [s for s, (p, m) in manifests.items()
                   if _written_age(p) >= UNCONFIRMED_SETTLE_S + m.total_bytes / 1e6]
        if settled:
            protect.add(max(settled))
    paths = dict(existing)
    return [(step, paths[step]) for step in prunable(paths, valid, safe, keep, protect, best)]


def _written_age(folder: Path) -> float:
    try:
        return time.time() - (folder / MANIFEST).stat().st_mtime
    except OSError:
        return 0.0


class Pruner:
    """Deletes the checkpoints of one folder that `choose_doomed` allows: the Trash-free way on Drive
    (`drivefs.TrashFreeDeleter`), journaled before the first file goes, and says so once.

    Args:
        root: the folder of `checkpoint-<step>` folders.
        kind, prune_after, keep: as for `choose_doomed`. The rule before 0.2 ("written") also deleted
            at once, to Drive's Trash, which is what made it lose data.
        journal, notices: where `prune` events and the message for the user go.
    """

    def __init__(self, root: Path, *, kind: str, prune_after: str, keep: int, journal, notices):
        self.root, self.kind, self.prune_after, self.keep = Path(root), kind, prune_after, keep
        self.journal, self.notices = journal, notices
        self.deleter = TrashFreeDeleter(kind if prune_after == "cloud" else PLAIN)
        self._told = False

    def prune(self, tracker, *, protect: set[int], best: int | None) -> list[int]:
        """Start deleting what the rules allow now; returns the steps."""
        doomed = choose_doomed(self.root, kind=self.kind, prune_after=self.prune_after,
                               confirmed=tracker.confirmed_steps(), keep=self.keep, protect=protect,
                               best=best, deleting=self.deleter.pending)
        if doomed:  # journaled first: a checkpoint reported in the cloud stays there until this line
            self.journal.write("prune", steps=[step for step, _ in doomed], trash_free=self.deleter.kind != PLAIN)
        for step, path in doomed:
            tracker.forget(f"checkpoint-{step}")
            try:
                self.deleter.start(path, first=MANIFEST)
            except OSError as exc:  # Drive trouble: the folder is doomed again at the next pruning
                log.info("could not delete %s yet: %s", path, exc)
        if doomed and self.deleter.kind != PLAIN and not self._told:
            self._told = True
            self.notices.add(f"deleted checkpoint-{doomed[0][0]} from Drive the Trash-free way: each file is emptied "
                             f"before it is deleted, so Drive's Trash keeps only 0-byte stubs (for 30 days, or "
                             f"until you empty the Trash at drive.google.com); they take no quota")
        return [step for step, _ in doomed]
