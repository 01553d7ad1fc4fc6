"""Which checkpoint a `CheckpointStore` restores: the newest that verifies, chosen by rank 0 alone.

Checkpoints on the persistent folder and on local disk are searched together (`checkpoints/search.py`):
a damaged one is skipped and named, a newer one that cannot be read now stops the restore (an older one is
never taken in its place), and "could not read" is never "nothing to restore". Nothing here deletes.
"""

from __future__ import annotations

from pathlib import Path

from .._notices import Notices
from ..checkpoints.checkpoint import CHECKPOINTS, model_signature
from ..checkpoints.journal import EVENTS, Journal
from ..checkpoints.search import Found, read_told, search_checkpoints
from ..errors import DriveError, ResumeMismatchError

__all__ = ["find_checkpoint", "check_fits"]


def find_checkpoint(folder: Path, local_dir: Path, journal: Journal, notices: Notices) -> Found | None:
    """The newest checkpoint of `folder` (the persistent folder) or `local_dir` that verifies, fetched to
    `local_dir`; None when there is none.

    Raises:
        DriveError: checkpoints exist but could not be read, or a newer one cannot be used now.
    """
    def skipped(path: Path, reason: str) -> None:
        notices.add(f"skipping checkpoint {path}: {reason}")
        journal.write("warn", what="invalid_checkpoint", path=str(path), reason=reason)

    try:
        told = read_told(folder)  # "nothing here" only when looks spaced in time agree
    except OSError as exc:
        raise DriveError(f"the journal of {folder} ({EVENTS}) could not be read ({exc}), so which checkpoints "
                         f"reached the cloud is unknown: nothing was restored or deleted. Call restore_latest() "
                         f"again once the folder answers") from exc
    search = search_checkpoints([("drive", folder / CHECKPOINTS), ("local", local_dir)],
                                local_dir, on_skip=skipped, told=told)
    if search.blocked:
        path, reason = search.blocked[0]
        raise DriveError(f"{path.name} in {folder / CHECKPOINTS} cannot be used now ({reason}), so nothing was "
                         f"restored (an older checkpoint is never taken in its place) and nothing was deleted. "
                         f"Call restore_latest() again in a minute")
    for path, reason in search.unreadable:
        journal.write("warn", what="unreadable_checkpoint", path=str(path), reason=reason)
    if search.unreadable and search.found is None:  # "could not read" is never "nothing to restore"
        raise DriveError(f"checkpoints in {folder / CHECKPOINTS} could not be read "
                         f"({'; '.join(f'{p.name}: {r}' for p, r in search.unreadable)}), so nothing was "
                         f"restored and nothing was deleted. Call restore_latest() again once the folder "
                         f"answers, or save into another folder to start fresh")
    if search.unreadable:
        notices.add(f"could not read {', '.join(p.name for p, _ in search.unreadable)}; restoring "
                    f"checkpoint-{search.found.step}, the newest that could be read")
    return search.found


def check_fits(found: Found, model) -> None:
    """Raise ResumeMismatchError when the checkpoint's tensors (names and shapes) do not fit `model`."""
    saved = found.manifest.fingerprint
    if model is not None and saved.get("model") and saved["model"] != model_signature(model)["model"]:
        raise ResumeMismatchError(
            f"checkpoint-{found.step} in {found.source.parent} holds a model of "
            f"{saved.get('parameters', '?'):,} parameters with different tensor names or shapes "
            f"than this one ({model_signature(model)['parameters']:,}). Load it into the same "
            f"architecture, or save into a new folder: ck.CheckpointStore('<another folder>')")
