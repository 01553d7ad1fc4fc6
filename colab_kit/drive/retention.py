"""Which checkpoints to delete: only what a newer checkpoint *in the cloud* makes unnecessary, and
nothing at all on doubt.

A delete is a small metadata operation and reaches Drive's cloud before a large pending upload
does, so pruning on anything less than "a newer checkpoint is in the cloud" can leave no
checkpoint in the cloud at all (shown on the DriveFS emulator in tests/drive/test_cloud_e2e.py).
`keep` counts checkpoints in the cloud; what is newer and still on its way is kept too.

"In the cloud" depends on the folder (`drivefs.folder_kind`): confirmed by DriveFS's attributes;
on a Drive mount without them, *settled*: written longer ago than `Settle.age`, an assumption
stated to the user, never a claim; on a plain folder, written and read back.

A pruning pass decides from reads, and a read that fails is unknown, not "invalid" or "gone": the
pass then stops and deletes nothing (`Pruner.prune` returns None), and the next pass looks again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from .._units import format_age, format_bytes
from ..checkpoints import storage, validity
from ..checkpoints.checkpoint import list_checkpoints
from ..checkpoints.manifest import MANIFEST
from .driveapi import ApiDeleter
from .drivefs import API, DRIVEFS, PLAIN, TrashFreeDeleter

__all__ = ["Settle", "prunable", "Pruner", "unfinished_folders"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Settle:
    """On a Drive mount that does not report uploads: how long after it was written a checkpoint is
    taken to have reached the cloud, `base_s` plus its upload time at an assumed `rate_bps`.

    Nothing is ever *called* in the cloud on such a mount. The age only decides pruning: no checkpoint
    is deleted until a newer one is settled, so one old enough to have uploaded always stays. Users
    report Drive uploading at tens of KB/s to a few MB/s (shared/research/drive-reality.md); at the
    defaults a 1.3 GB checkpoint settles after 10 min + 1,300 s = 31.7 min.
    """

    base_s: float = 600.0
    rate_bps: float = 1e6

    def age(self, nbytes: int) -> float:
        return self.base_s + nbytes / self.rate_bps

    def describe(self, nbytes: int | None = None) -> str:
        rule = f"{format_age(self.base_s)} plus its upload time at an assumed {format_bytes(self.rate_bps)}/s"
        return rule + (f" ({format_age(self.age(nbytes))} for {format_bytes(nbytes)})" if nbytes else "")


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


class Pruner:
    """Deletes the checkpoints of one folder that the rules allow, and nothing on doubt: the Trash-free
    way on Drive (`drivefs.TrashFreeDeleter`), journaled before the first file goes.

    Args:
        root: the folder of `checkpoint-<step>` folders.
        kind: the folder's `drivefs` kind.
        api: the `driveapi.DriveApi` of kind `API`, which deletes for good.
        prune_after: "cloud", or "written" (the rule before 0.2, which also deleted at once, to
            Drive's Trash: kept for the tests and bench/work_at_risk.py to show what it loses).
        keep: checkpoints in the cloud to keep.
        settle: the settle age on an UNCONFIRMED folder.
        journal, notices: where `prune` events and the message for the user go.
    """

    def __init__(self, root: Path, *, kind: str, prune_after: str, keep: int, journal, notices,
                 settle: Settle = Settle(), api=None):
        self.root, self.kind, self.prune_after, self.keep = Path(root), kind, prune_after, keep
        self.settle, self.journal, self.notices = settle, journal, notices
        if kind == API and prune_after == "cloud":  # deleted for good by id: no Trash at all
            self.deleter = ApiDeleter(api)
        else:
            self.deleter = TrashFreeDeleter(kind if prune_after == "cloud" else PLAIN)
        self.last_doubt: str | None = None  # why the last pass deleted nothing, when it was a doubt
        self._told = False

    def _safe(self, tracker, listed: set[int]) -> set[int]:
        if self.prune_after == "written" or self.kind == PLAIN:
            return set(listed)
        if self.kind in (DRIVEFS, API):
            return tracker.confirmed_steps(verified_only=False)
        return tracker.settled_steps(self.settle.age)  # UNCONFIRMED

    def prune(self, tracker, *, protect: set[int], best: int | None, ours: set[Path],
              lease_ok: Callable[[], bool | None]) -> list[int] | None:
        """One pass: start deleting what the rules allow; returns the steps, or None when a doubt (a
        failed read, a listing without a checkpoint being followed, a lease that cannot be confirmed)
        stopped the pass before anything was deleted. `ours`: the unfinished folders (no manifest) this
        writer may delete, those it created or found at its start; any other one is left alone."""
        try:
            listed = dict((s, p) for s, p in list_checkpoints(self.root) if p not in set(self.deleter.pending))
        except OSError as exc:
            return self._doubt(f"the checkpoints could not be listed ({exc.strerror or exc})")
        followed = tracker.checkpoint_steps()
        if followed - set(listed):  # a listing that hides a checkpoint: look again later
            return self._doubt(f"checkpoint-{min(followed - set(listed))} is missing from the listing")
        safe_raw = self._safe(tracker, set(listed))
        verdicts: dict[int, validity.Verdict] = {}
        counted: list[int] = []
        for step in sorted(safe_raw & set(listed), reverse=True):
            if len(counted) >= self.keep and step != best:
                continue  # enough counted: only the best still needs a look
            verdict = verdicts[step] = validity.check(listed[step], step=step)
            if verdict.unknown:
                return self._doubt(f"checkpoint-{step}: {verdict.reason}")
            if verdict.valid:
                tracker.mark_verified(step)
                counted.append(step)
            else:
                tracker.forget(f"checkpoint-{step}")  # never claimed in the cloud
        known_bad = {s for s, v in verdicts.items() if not v.valid}
        doomed = prunable(listed, set(listed) - known_bad, set(counted), self.keep, set(protect), best)
        chosen = []
        for step in doomed:
            try:
                storage.stat(listed[step] / MANIFEST)
            except FileNotFoundError:  # unfinished: only its own writer's leftovers may go
                if listed[step] not in ours:
                    log.info("leaving %s alone: unfinished, and not this writer's", listed[step])
                    continue
            except OSError as exc:
                return self._doubt(f"checkpoint-{step}'s manifest could not be read ({exc.strerror or exc})")
            chosen.append(step)
        self.last_doubt = None
        if not chosen:
            return []
        held = lease_ok()
        if held is not True:  # lost (the mirror pauses) or not confirmed now: delete nothing
            return self._doubt("the lease could not be confirmed" if held is None else "the lease was lost")
        # Journaled first: a checkpoint reported in the cloud stays there until this line.
        self.journal.write("prune", steps=chosen, trash_free=self.deleter.kind != PLAIN)
        for step in chosen:
            tracker.forget(f"checkpoint-{step}")
            validity.forget(listed[step])
            try:
                self.deleter.start(listed[step], first=MANIFEST)
            except OSError as exc:  # Drive trouble: the folder is chosen again at a later pass
                log.info("could not delete %s yet: %s", listed[step], exc)
                break
        if self.deleter.kind == API and not self._told:
            self._told = True
            self.notices.add(f"deleted checkpoint-{chosen[0]} from Drive for good through its API (files.delete by "
                             f"id): nothing goes to Drive's Trash, and the rest of your Trash is left alone")
        elif self.deleter.kind != PLAIN and not self._told:
            self._told = True
            self.notices.add(f"deleted checkpoint-{chosen[0]} from Drive the Trash-free way: each file is emptied "
                             f"before it is deleted, so Drive's Trash keeps only 0-byte stubs (for 30 days, or "
                             f"until you empty the Trash at drive.google.com); they take no quota")
        return chosen

    def _doubt(self, why: str) -> None:
        if why != self.last_doubt:
            log.info("pruning deleted nothing this time: %s", why)
        self.last_doubt = why
        return None


def unfinished_folders(root: Path) -> list[Path]:
    """The checkpoint folders under `root` without a manifest now (an empty list when it cannot be read)."""
    try:
        listed = list_checkpoints(root)
    except OSError as exc:
        log.debug("listing %s: %s", root, exc)
        return []
    return [path for step, path in listed
            if validity.check(path, step=step, hashes=False).state == validity.UNFINISHED]
