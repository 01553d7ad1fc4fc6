"""Finding the checkpoint to resume from: the newest that verifies, on Drive or on local disk.

HF Trainer picks the highest-numbered folder with no completeness check; the kit picks the
highest-numbered one that is VALID (`validity.py`), copies it to local disk verifying every sha256,
and says which ones were skipped and why. Doubt costs time, never an older checkpoint:

- A read that fails is tried again (`RETRY_WAITS`); one still unreadable is reported as unreadable,
  never taken for "nothing there".
- Absence is not evidence (`looks.py`). The run's journal says which checkpoints should be there
  (written, not pruned) and which were confirmed in the cloud (`history.History`). A listing that lacks
  one of them is looked at again, spaced in time, and so is every checkpoint on Drive, newer than the
  one found, whose manifest or files are missing at one look (all of them together: one wait a search).
- A checkpoint the journal confirmed in the cloud is never passed over because it cannot be seen or
  read now, nor one it says was written that cannot be read: the search stops there (`Search.blocked`)
  instead of resuming from an older one. (One written, never confirmed, and missing at every look is an
  upload that died with its runtime: passed over, and said.)
"""

from __future__ import annotations

import errno
import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from .clock import clock
from . import looks, storage, validity
from .checkpoint import CHECKPOINTS, checkpoint_dir, list_checkpoints
from .history import History, read_history
from .journal import EVENTS
from .manifest import Manifest, write_manifest

__all__ = ["RETRY_WAITS", "Found", "Search", "read_told", "fetch_checkpoint", "search_checkpoints", "find_latest"]

# Seconds between the looks at checkpoints that could not be read (EIO, errno 107, a stall) or that miss a
# file: doubt costs time first (11 s in all, once for a whole search; longer than Drive hides a file for).
RETRY_WAITS = (1.0, 2.0, 4.0, 4.0)
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Found:
    """A checkpoint that verified, ready on local disk."""

    step: int
    path: Path  # local copy
    manifest: Manifest
    origin: str  # "drive" or "local"
    source: Path  # where it was found


@dataclass
class Search:
    """What a search for a checkpoint to resume from found.

    Attributes:
        found: the newest VALID checkpoint, on local disk (None: none).
        skipped: (folder, reason) of those read and found INVALID or UNFINISHED: never resumed from.
        unreadable: (folder, reason) of those that could not be read after every try: nothing is known.
        blocked: (folder, reason) of a checkpoint the journal confirmed in the cloud that cannot be seen
            or read now, or one it says was written that cannot be read: the search stopped there, and
            nothing older was taken (`found` is None).
    """

    found: Found | None = None
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)
    blocked: list[tuple[Path, str]] = field(default_factory=list)


def fetch_checkpoint(source: Path, manifest: Manifest, local_root: Path) -> Path:
    """Copy a checkpoint to `local_root/checkpoint-<step>`, hashing the bytes as they are read; what
    the hashes say of `source` is remembered (`validity.remember`).

    Raises:
        ValueError: a file does not match the manifest (nothing is left behind; `source` is INVALID).
        OSError: the copy failed: reading `source`, or writing to the local disk (nothing is known).
    """
    target = checkpoint_dir(local_root, manifest.step)
    tmp = local_root / f".fetch-{target.name}-{uuid.uuid4().hex[:8]}"
    try:
        for name, entry in manifest.files.items():
            dst = tmp / name
            storage.make_dirs(dst.parent)
            digest = storage.copy_file(source / name, dst)
            if digest != entry.sha256 and storage.sha256_file(source / name) == digest:  # the same twice
                reason = f"{name} does not match its sha256 (corrupted)"
                validity.remember(source, manifest, valid=False, reason=reason)
                raise ValueError(reason)
            if digest != entry.sha256:
                raise OSError(errno.EIO, f"{name} read differently twice (a torn read)")
            if storage.stat(dst).st_size != entry.size:
                raise ValueError(f"{name} has the wrong size (truncated?)")
        write_manifest(tmp, manifest)
        storage.remove_tree(target)
        storage.replace(tmp, target)
    finally:
        try:
            storage.remove_tree(tmp)
        except OSError as exc:
            log.debug("could not remove %s: %s", tmp, exc)
    validity.remember(source, manifest, valid=True)
    validity.remember(target, manifest, valid=True)
    return target


def read_told(run_dir: Path, local_copy: Path | None = None) -> History:
    """What the journal of the run folder `run_dir` (and its `local_copy`) says, with whether the folder holds
    anything at all (`History.occupied`).

    "Nothing here" is decided only by looks spaced in time (`looks.again`) that agree across the checkpoints'
    listing and the journal together: a busy mount can show an empty `checkpoints/` and no journal for a few
    seconds, and a fresh start over whole checkpoints would then write over them. Neither piece alone, nor two
    listings a moment apart, settles it. A look that cannot read a piece counts as something there.

    Raises:
        OSError: the journal could not be read (what it says is unknown).
    """
    def look() -> tuple[bool, bool]:
        try:
            listed = bool(list_checkpoints(run_dir / CHECKPOINTS))
        except OSError:
            listed = True
        try:
            journal = storage.exists(run_dir / EVENTS)
        except OSError:
            journal = True
        return listed, journal

    occupied = any(looks.again(look, lambda seen: not any(seen)))
    told = read_history(run_dir / EVENTS, local_copy, expected=occupied)
    told.occupied = occupied or told.found
    return told


def _listing(origin: str, root: Path, told: History, waits) -> tuple[dict[int, Path] | None, str]:
    """The checkpoints under `root` ({step: folder}, or None and why when it cannot be listed). On Drive,
    a listing that lacks a checkpoint the journal expects is taken again after each of `waits`, and
    every folder seen in any of them counts; one the journal says is there that no listing shows is a
    candidate all the same (looked at directly: a listing can miss what a read finds)."""
    found: dict[int, Path] = {}
    problem, listings = "", 0
    needed = 2 if origin == "drive" else 1  # on Drive two at once: a listing short an entry is caught by the next
    for wait in (0.0,) * needed + (tuple(waits) if origin == "drive" else ()):
        clock.sleep(wait)
        try:
            found.update(list_checkpoints(root, missing_ok=origin != "drive" or not told.expected))
            listings += 1
        except FileNotFoundError:
            problem = "the folder is missing"
        except OSError as exc:
            problem = f"the folder could not be listed ({exc.strerror or exc})"
        if listings >= needed and not (told.expected - set(found)) and (found or not (told.started or told.occupied)):
            break
    if origin == "drive":  # what the journal says is there, in no listing: looked at directly all the same
        for unseen in told.expected - set(found):
            found[unseen] = checkpoint_dir(root, unseen)
    if not listings and not (problem == "the folder is missing" and not told.expected):
        return None, problem
    return found, ""


def search_checkpoints(places: Iterable[tuple[str, Path]], local_root: Path, *, step: int | None = None,
                       on_skip: Callable[[Path, str], None] | None = None, waits: Iterable[float] | None = None,
                       told: History | None = None) -> Search:
    """The newest VALID checkpoint across several places, copied to `local_root`.

    Args:
        places: ("drive" | "local", folder holding checkpoint-<step> folders). On a tie of steps the
            local one wins (no copy needed).
        local_root: where a checkpoint from Drive is copied to (verifying every sha256 on the way).
        step: only this step (the Trainer's best checkpoint), instead of the newest.
        on_skip: called with (folder, reason) for every checkpoint found INVALID or UNFINISHED.
        waits: seconds between the looks at a checkpoint that cannot be read or misses something
            (default `RETRY_WAITS`). One still unreadable after them is reported in `unreadable`, and the
            search goes on to older ones: the caller decides (start_run never starts fresh over one).
        told: what the run's journal says (`history.read_history`): the checkpoints that should be on
            Drive, and those confirmed in the cloud, which are never passed over (`Search.blocked`).
    """
    waits = RETRY_WAITS if waits is None else tuple(waits)
    told = told or History()
    candidates = []
    result = Search()
    for origin, root in places:
        listed, problem = _listing(origin, Path(root), told, waits)
        if listed is None:
            result.unreadable.append((Path(root), problem))
            listed = {s: checkpoint_dir(root, s) for s in told.expected} if origin == "drive" else {}
        for found_step, path in listed.items():
            if step is None or found_step == step:
                candidates.append((found_step, origin == "local", origin, path))
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
    doubtful: list[_Doubt] = []  # newer than anything found so far, and not settled by one look
    for found_step, _, origin, path in candidates:  # one look at each, newest first, to the first valid one
        doubt = _Doubt(found_step, origin, path, origin == "drive" and found_step in told.expected,
                       origin == "drive" and found_step in told.confirmed)
        found, doubt.verdict = _try_one(found_step, origin, path, local_root)
        if found is not None:
            result.found = found
            break
        if doubt.settled():
            _skip(result, doubt, on_skip, waits)
        else:
            doubtful.append(doubt)
    # What is newer than the one found, and unknown or missing, is looked at again together, spaced in
    # time: one wait for all of them (a second look each after each wait), the newest valid one wins.
    for wait in waits:
        if not doubtful:
            break
        clock.sleep(wait)
        for doubt in list(doubtful):
            found, doubt.verdict = _try_one(doubt.step, doubt.origin, doubt.path, local_root)
            if found is not None:  # newer than what was found: it wins, and what is older is moot
                result.found = found
                doubtful = [d for d in doubtful if d.step > found.step]
                break
            if doubt.settled():
                doubtful.remove(doubt)
                _skip(result, doubt, on_skip, waits)
    for doubt in doubtful:  # newer than what was found, still unknown or missing after every look
        verdict = doubt.verdict
        if doubt.confirmed and (verdict.absent or verdict.state == validity.UNFINISHED) or \
                doubt.expected and verdict.unknown and not verdict.absent:
            # In the cloud (or written there) as the journal says, and not seen or not read now: never passed
            # over for an older one, nor for a fresh start
            why = "it is not there at any look" if verdict.absent or verdict.state == validity.UNFINISHED \
                else verdict.reason
            result.found = None
            result.blocked.append((doubt.path, why))
            return result
        if verdict.unknown and not verdict.absent:
            result.unreadable.append((doubt.path, verdict.reason))
        else:
            _skip(result, doubt, on_skip, waits)
    return result


@dataclass
class _Doubt:
    """A candidate that one look could not settle."""

    step: int
    origin: str
    path: Path
    expected: bool  # the journal says it was written
    confirmed: bool  # the journal says it reached the cloud
    verdict: validity.Verdict | None = None

    def settled(self) -> bool:
        """Is its last verdict an answer? Invalid is; a manifest missing on local disk is (a save the process
        never finished); on Drive a missing manifest is one look's answer, whatever the journal says (its
        line may have died with the runtime that wrote the checkpoint)."""
        verdict = self.verdict
        if verdict.unknown or verdict.absent:
            return verdict.state == validity.UNFINISHED and self.origin == "local"
        return True


def _skip(result: Search, doubt: _Doubt, on_skip, waits) -> None:
    reason = doubt.verdict.reason
    if doubt.verdict.absent:  # missing at every look, and never confirmed: an upload that did not finish
        reason = reason.replace("at this look", f"at every look over {sum(waits):.0f} s") + \
            " (its upload never finished)"
    result.skipped.append((doubt.path, reason))
    if on_skip is not None:
        on_skip(doubt.path, reason)


def _try_one(step: int, origin: str, path: Path, local_root: Path) -> tuple[Found | None, validity.Verdict]:
    """One look at one candidate: (Found, VALID), or (None, the verdict)."""
    if origin == "local":  # hashed in place
        verdict = validity.check(path, step=step)
        return (Found(step, path, verdict.manifest, origin, path) if verdict.valid else None), verdict
    verdict = validity.check(path, step=step, hashes=False)  # Drive: sizes now, hashes while the bytes are copied
    if not verdict.valid and verdict.reason != validity.SIZES_MATCH:
        return None, verdict
    manifest = verdict.manifest
    try:
        local = fetch_checkpoint(path, manifest, local_root)
    except ValueError as exc:
        return None, validity.Verdict(validity.INVALID, str(exc), manifest)
    except FileNotFoundError as exc:  # gone between the look and the copy: absent at this look
        validity.forget(path)
        return None, validity.Verdict(validity.UNKNOWN, f"{Path(exc.filename or '').name or 'a file'} is missing "
                                      f"at this look", manifest, absent=True)
    except OSError as exc:
        validity.forget(path)  # what was known of it no longer holds now: the next look reads it again
        where = "the local disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else (exc.strerror or str(exc))
        return None, validity.Verdict(validity.UNKNOWN, f"could not be copied to local disk ({where})")
    return Found(step, local, manifest, origin, path), validity.Verdict(validity.VALID, "", manifest)


def find_latest(places: Iterable[tuple[str, Path]], local_root: Path,
                on_skip: Callable[[Path, str], None], *, step: int | None = None,
                told: History | None = None) -> Found | None:
    """`search_checkpoints(...).found`, with every unreadable (or blocked) checkpoint reported to `on_skip`
    too (for callers that resume from what they find and start nothing fresh over the others)."""
    result = search_checkpoints(places, local_root, step=step, on_skip=on_skip, told=told)
    for path, reason in result.unreadable + result.blocked:
        on_skip(path, f"unreadable ({reason})")
    return result.found
