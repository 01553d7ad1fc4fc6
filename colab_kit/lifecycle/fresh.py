"""Where `run.train` resumes from: `resume_from_checkpoint` as the Trainer takes it, checked by the kit.

    run.train(trainer)                                  # the newest valid checkpoint, if any (start_run chose it)
    run.train(trainer, resume_from_checkpoint=True)     # the same, and an error when there is none
    run.train(trainer, resume_from_checkpoint=path)     # that checkpoint, verified against its manifest
    run.train(trainer, resume_from_checkpoint=False)    # from step 0: earlier checkpoints are archived

A fresh start never deletes: the run's checkpoints on Drive are moved to `<drive_dir>/archive/`
(as `start_run(resume=False)` does), since new checkpoints with the same step numbers next to them
would mix two runs, and a resume after a disconnect would pick the wrong one.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from ..checkpoints import looks, storage, validity
from ..checkpoints.checkpoint import ARCHIVE, CHECKPOINTS, aside_path, list_checkpoints, step_of
from ..drive.drivefs import HUB
from ..errors import CheckpointError, ColabKitError, DriveError
from .registry import TrainClock

__all__ = ["archive_checkpoints", "archive_path", "resume_argument", "start_over", "fresh_start_advice"]

_DRAIN_S = 120.0  # a fresh start waits this long for uploads under way before it moves anything


def fresh_start_advice(name: str, drive_dir: Path, *, on_hub: bool) -> str:
    """How to start this run fresh, as the advice of an error ends: `resume=False` archives a folder's
    checkpoints; on the Hub, where `start_run` refuses it, the run starts over under a new name."""
    if on_hub:
        return (f"start fresh under a new name (a fresh start over a run kept on the Hub is not supported: "
                f"resume=False is refused there): ck.start_run({name + '-2'!r}, store=...), the same store")
    return f"start fresh, which moves every checkpoint to {drive_dir / ARCHIVE}: ck.start_run({name!r}, resume=False)"


def archive_checkpoints(run, *, expected: bool = True) -> Path | None:
    """Move the run's checkpoints aside for a fresh start (through the gate: with the lease held; nothing is
    deleted from Drive; the local copies go); the folder they went to, or None when there were none.

    A listing that shows no checkpoint where the journal says there are some (`expected`) is looked at
    again, spaced in time, before "nothing to archive" is believed: a new run mixed into the old run's
    folder would make a later resume pick the old run's newest checkpoint.

    Raises:
        DriveError: the lease could not be confirmed, so nothing was moved.
    """
    checkpoints = run.drive_dir / CHECKPOINTS
    listed = looks.again(lambda: list_checkpoints(checkpoints), lambda found: not found,
                         None if expected else ())
    moved = None
    if listed:
        moved = archive_path(run, CHECKPOINTS)
        if not run.mirror.gate.archive(checkpoints, moved):
            raise DriveError(f"the checkpoints of {run.drive_dir} were not moved to {moved.parent}: the run's lease "
                             f"could not be confirmed now; nothing was moved or deleted. Run the cell again")
    for _, path in list_checkpoints(run.local_dir):
        storage.remove_tree(path)
    return moved


def archive_path(run, name: str) -> Path:
    """Where `name` (checkpoints/, final/) of `run` is moved aside: a name in `archive/` that no other folder moved
    there ever had, this runtime's or another's (`aside_path`; the lease's session tells runtimes apart)."""
    runtime = run.lease.info.session[:12] if run.lease is not None else uuid.uuid4().hex[:12]
    return aside_path(run.drive_dir / ARCHIVE, name, runtime)


def resume_argument(run, value):
    """What `trainer.train(resume_from_checkpoint=...)` gets for the user's `value` (absent: None; False
    after `start_over`).

    Raises:
        ValueError: True, but the run has no valid checkpoint.
        CheckpointError: a path that is not a valid checkpoint (its manifest does not match).
    """
    if value is False:  # `start_over` has run (before the ranks agreed on where to resume)
        return False
    if value is None:  # left out: the kit resumes when it can
        return str(run.resume_from) if run.resume_from is not None else None
    if value is True:
        if run.resume_from is None:  # the Trainer's own words for this case
            raise ValueError(f"No valid checkpoint found in output directory ({run.local_dir}) nor in the run "
                             f"folder {run.drive_dir / CHECKPOINTS}: nothing to resume from. Leave "
                             f"resume_from_checkpoint out (the kit resumes whenever it can) or pass False")
        return str(run.resume_from)
    if not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"resume_from_checkpoint={value!r}: give True (the newest valid checkpoint), False (start "
                         f"at step 0) or the path of a checkpoint folder, as the Trainer takes it")
    path = Path(value)
    if not path.is_dir():
        raise ValueError(f"Can't find a valid checkpoint at {path}: no such folder")
    verdict = validity.check(path, step=step_of(path))
    if verdict.state == validity.UNFINISHED:  # no MANIFEST.json: not the kit's; the Trainer checks its files
        run.notices.add(f"{path} has no MANIFEST.json (not saved through the kit), so its files are not verified")
        run.notices.show()
        return str(path)
    if not verdict.valid:
        raise CheckpointError(f"{path} is not a checkpoint to resume from ({verdict}); nothing was changed. "
                              f"Leave resume_from_checkpoint out to resume from the newest valid one")
    run.resume_from, run.resume_manifest = path, verdict.manifest
    return str(path)


def start_over(run) -> None:
    """Train from step 0 in a run folder that has checkpoints: they are archived first, as
    `start_run(resume=False)` would have, and the run forgets them.

    Raises:
        DriveError: uploads under way did not finish, or the folder could not be moved; nothing
            was moved or deleted then.
    """
    had = run.resume_manifest.step if run.resume_manifest is not None else None
    if had is None or not run.ranks.writer:  # nothing to move; rank 0 moves the folder for every rank
        _forget_resume(run)
        return
    if run.durability == HUB:  # the replica's checkpoints would be moved aside, the Hub's not: refused
        raise ColabKitError(f"resume_from_checkpoint=False on a run kept on the Hugging Face Hub: a fresh start over "
                            f"its checkpoints is not supported yet (up to step {had}); nothing was moved. Give the run "
                            f"a new name in start_run, or delete {run.name}/ in the repo first")
    if not run.mirror.drain(timeout=_DRAIN_S):
        raise DriveError(f"resume_from_checkpoint=False: checkpoints of {run.drive_dir} are still being written "
                         f"(steps {run.mirror.pending_steps}), so they were not archived and nothing was started. "
                         f"Run the cell again once Drive answers")
    run.mirror.close()  # its worker no longer writes into the folder being moved (its gate still answers)
    try:
        archived = archive_checkpoints(run)
    except OSError as exc:
        raise DriveError(f"resume_from_checkpoint=False: the checkpoints of {run.drive_dir} could not be moved "
                         f"to {run.drive_dir / ARCHIVE} ({exc}); nothing was deleted. Run the cell again") from exc
    finally:
        run.mirror = run.new_mirror()
        run.mirror.adopt_existing()
    _forget_resume(run)
    run.journal.write("archive", moved_to=str(archived) if archived else None, because="resume_from_checkpoint=False")
    where = f"were moved to {archived}; nothing was deleted" if archived else "were only local copies, now removed"
    print(f"colab_kit: resume_from_checkpoint=False: training starts at step 0. The run's earlier checkpoints "
          f"(up to step {had}) {where}.", flush=True)


def _forget_resume(run) -> None:
    run.resume_from = run.resume_manifest = run.resume_best = None
    run.resume_state, run.clock = {}, TrainClock()
