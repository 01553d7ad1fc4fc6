"""Several processes resume as one: every rank continues from the checkpoint rank 0 chose.

Rank 0 chose in `start_run` (it alone reads the persistent folder's checkpoints); once the process
group exists, its step is broadcast, every node's local rank 0 fetches that checkpoint into the
node's local folder, and every rank checks its copy. A rank that cannot read it stops every rank
with the same error; no rank deletes anything.
"""

from __future__ import annotations

from ..checkpoints.checkpoint import CHECKPOINTS, checkpoint_dir
from ..checkpoints.search import find_latest
from ..checkpoints import validity
from ..errors import CheckpointError
from .ranks import all_agree, barrier, broadcast_object, group

__all__ = ["agree_resume"]


def agree_resume(run) -> None:
    """Make every rank resume from rank 0's checkpoint (once the process group exists).

    Rank 0 chose in `start_run`; its step (and its best checkpoint's) is broadcast. On every node
    local rank 0 fetches that step from the persistent folder unless its local folder already
    holds a verified copy (the same node as rank 0); the other ranks wait, then check the copy.
    Any rank that cannot read it stops every rank with the same error. No rank deletes anything.

    Raises:
        CheckpointError: a rank has no readable copy of the chosen checkpoint.
    """
    if group() is None:
        if run.ranks.distributed:
            raise CheckpointError(f"WORLD_SIZE={run.ranks.world_size} but torch.distributed is not initialised, so "
                                  f"the ranks cannot agree on the checkpoint to resume from: create the Trainer (its "
                                  f"TrainingArguments start torch.distributed) before calling run.train")
        return
    mine = run.resume_manifest.step if run.resume_manifest is not None else None
    chosen = broadcast_object({"step": mine, "best": run.mirror.best_step if mine is not None else None})
    step, best = chosen["step"], chosen["best"]

    def local_copy(wanted: int):
        path = checkpoint_dir(run.local_dir, wanted)
        verdict = validity.check(path, step=wanted)  # local disk; cached for the copy rank 0 fetched
        return (path, verdict.manifest) if verdict.valid else (None, None)

    problem = None
    if step is not None:
        if run.ranks.node_leader and not run.ranks.writer:
            for wanted in {step, best} - {None}:
                if local_copy(wanted)[0] is None:
                    try:
                        find_latest([("drive", run.drive_dir / CHECKPOINTS)], run.local_dir,
                                    on_skip=lambda path, why: None, step=wanted)
                    except Exception as exc:  # noqa: BLE001 - reported to every rank below, never left hanging
                        problem = f"fetching checkpoint-{wanted} failed: {type(exc).__name__}: {exc}"
        barrier()  # the node's other ranks wait for its fetch
        path, manifest = local_copy(step)
        if path is None:
            problem = problem or f"no verified copy of checkpoint-{step} in {run.local_dir}"
        elif not run.ranks.writer:
            run.resume_from, run.resume_manifest = path, manifest
            run.resume_best = local_copy(best)[0] if best is not None else None
    elif not run.ranks.writer:
        run.resume_from = run.resume_manifest = run.resume_best = None
    failed = all_agree(problem is None)
    if failed:
        here = f" (rank {run.ranks.rank}: {problem})" if problem else ""
        raise CheckpointError(f"rank(s) {failed} cannot read checkpoint-{step}, which rank 0 resumes from{here}. "
                              f"Every rank needs it in its local folder: give every rank of a node the same "
                              f"local_dir (the default), and let every node read the persistent folder {run.drive_dir}")
