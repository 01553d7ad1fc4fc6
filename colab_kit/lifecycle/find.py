"""`start_run`'s search for the checkpoint to resume from, and what it says about what it found.

The journal (`events.jsonl`) says which checkpoints the run folder should hold and which reached the
cloud; the search (`checkpoints/search.py`) looks again at what is missing, and never passes over a
checkpoint the journal confirmed in the cloud: it stops and says so instead of resuming from an older
one (`resume="readable"` is the user's way past that, when such a checkpoint is gone for good).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from .._notices import Notices
from ..checkpoints import storage
from ..checkpoints.checkpoint import CHECKPOINTS, KIT_STATE, aside_path, list_checkpoints
from ..checkpoints.history import History
from ..checkpoints.journal import EVENTS, Journal
from ..checkpoints.search import RETRY_WAITS, Found, Search, read_told, search_checkpoints
from ..errors import DriveError
from .best import fetch_best, recorded_best
from .fresh import fresh_start_advice

__all__ = ["RESUME_MODES", "Finding", "find_resume", "set_aside_newer", "kit_state", "fetch_best_of"]

log = logging.getLogger(__name__)
RESUME_MODES = (True, False, "readable")


@dataclass
class Finding:
    """What `find_resume` found: the checkpoint (None: start fresh), what the journal says, where it looked."""

    found: Found | None
    told: History
    places: list[tuple[str, Path]]
    search: Search | None


def find_resume(name: str, drive_dir: Path, local: Path, *, resume, notices: Notices, journal: Journal,
                on_hub: bool = False) -> Finding:
    """Read what the journal says, search Drive and the local disk, and report what was passed over.

    Raises:
        DriveError: the journal or the checkpoints could not be read (nothing was started), or a
            checkpoint the journal confirmed in the cloud cannot be seen or read now.
    """
    places = [("drive", drive_dir / CHECKPOINTS), ("local", local)]
    try:
        told = read_told(drive_dir, local / EVENTS)  # "nothing here" only when looks spaced in time agree
    except OSError as exc:
        raise DriveError(f"the journal of {drive_dir} ({EVENTS}) could not be read ({exc.strerror or exc}), so "
                         f"which checkpoints reached the cloud is unknown; nothing was started, moved or deleted. "
                         f"Run this cell again once Drive answers (if the mount itself is stuck: Runtime -> "
                         f"Restart session)") from exc
    journal.known_to_exist = told.found  # from now on, a journal missing at one look is doubt
    if resume is False:
        return Finding(None, told, places, None)

    def skipped(path: Path, reason: str) -> None:
        notices.add(f"skipping checkpoint {path}: {reason}")
        journal.write("warn", what="invalid_checkpoint", path=str(path), reason=reason)

    search = search_checkpoints(places, local, on_skip=skipped,
                                told=told if resume is True else History(started=told.started, occupied=told.occupied))
    if search.blocked:
        raise _blocked_error(name, drive_dir, search.blocked, on_hub)
    if search.unreadable:
        if search.found is None:  # never a fresh start on top of checkpoints that could not be read
            raise _unreadable_error(name, drive_dir, search.unreadable, on_hub)
        _say_unreadable(notices, journal, search)
    return Finding(search.found, told, places, search)


def _blocked_error(name: str, drive_dir: Path, blocked: list[tuple[Path, str]], on_hub: bool) -> DriveError:
    path, reason = blocked[0]
    disk = " Free space on this VM's disk first (the copy back needs it)." if "disk is full" in reason else ""
    return DriveError(
        f"{path.name} of {drive_dir} was written there (events.jsonl says so) but cannot be used now: {reason}; "
        f"looked at {1 + len(RETRY_WAITS)} times over {sum(RETRY_WAITS):.0f} s. Drive hides files for a while "
        f"sometimes, so nothing was started, moved or deleted, and no older checkpoint was taken instead.{disk} "
        f"Run this cell again in a minute. If {path.name} is gone for good (deleted at drive.google.com), resume "
        f"from the newest one that can be read: ck.start_run({name!r}, resume='readable'); or "
        + fresh_start_advice(name, drive_dir, on_hub=on_hub))


def _unreadable_error(name: str, drive_dir: Path, unreadable: list[tuple[Path, str]], on_hub: bool) -> DriveError:
    names = "; ".join(f"{path.name}: {reason}" for path, reason in unreadable)
    disk = " Free space on this VM's disk first (the copy back needs it)." if "disk is full" in names else ""
    return DriveError(
        f"checkpoints of {drive_dir} could not be read ({names}), tried {1 + len(RETRY_WAITS)} times each; "
        f"nothing was started, moved or deleted.{disk} Run this cell again once Drive answers (if the mount "
        f"itself is stuck: Runtime -> Restart session). Or, anyway, " + fresh_start_advice(name, drive_dir, on_hub=on_hub))


def _say_unreadable(notices: Notices, journal: Journal, search: Search) -> None:
    names = ", ".join(path.name for path, _ in search.unreadable)
    notices.add(f"could not read {names} after {1 + len(RETRY_WAITS)} tries ({search.unreadable[0][1]}); resuming "
                f"from checkpoint-{search.found.step}, the newest that could be read (none of them had reached the "
                f"cloud, as the journal says). Nothing was deleted: {names} stay where they are")
    for path, reason in search.unreadable:
        journal.write("warn", what="unreadable_checkpoint", path=str(path), reason=reason)


def set_aside_newer(local: Path, step: int, journal: Journal) -> None:
    """Local checkpoints newer than the one resumed from could not be verified (a save killed half-way):
    moved aside on the local disk, never deleted, so that the Trainer does not mistake them for its own."""
    aside = local / ".set-aside"
    for newer, path in list_checkpoints(local):
        if newer > step:
            storage.make_dirs(aside)
            moved = aside_path(aside, path.name)
            storage.replace(path, moved)
            journal.write("warn", what="set_aside", path=str(moved), reason="newer than the checkpoint resumed "
                          "from, and not verifiable")


def kit_state(found: Found) -> dict:
    """The training clock saved with `found`."""
    if found.manifest.kit_state:
        return dict(found.manifest.kit_state)
    try:  # a checkpoint saved before the clock moved into the manifest
        return json.loads(storage.read_bytes(found.path / KIT_STATE))
    except (OSError, ValueError):
        return {}


def fetch_best_of(run, finding: Finding) -> None:
    """Fetch the Trainer's best checkpoint named in the resumed one, and protect it on Drive (also when it
    cannot be read now: a checkpoint that cannot be read is never let go)."""
    found = finding.found
    best = recorded_best(found.path)
    run.mirror.best_step = best
    if best is None:
        return
    unreadable: list[str] = []

    def skipped(path: Path, reason: str) -> None:
        if reason.startswith("unreadable"):
            unreadable.append(reason)
        run.notices.add(f"skipping checkpoint {path}: {reason}")

    run.resume_best = fetch_best(best, found.path, found.step, finding.places, run.local_dir, skipped)
    if run.resume_best is not None:
        return
    if unreadable:
        run.mirror.protected.add(best)
        run.notices.add(f"the Trainer's best checkpoint so far, checkpoint-{best}, could not be read now "
                        f"({unreadable[0]}); it stays in {run.drive_dir} and is never pruned, but "
                        f"load_best_model_at_end cannot return to it in this session")
        run.journal.write("warn", what="best_unreadable", step=best)
    else:
        run.notices.add(f"the Trainer's best checkpoint so far, checkpoint-{best}, is not in {run.drive_dir} any "
                        f"more, so load_best_model_at_end cannot return to it: the best is tracked again "
                        f"from the checkpoints of this session")
        run.journal.write("warn", what="best_missing", step=best)
