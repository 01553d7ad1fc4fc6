"""The VM's local disk before a save (issue 28): a full disk is named before the Trainer writes, instead of
torch's "unexpected pos 1781312 vs 1781200" half-way through a checkpoint.

The Trainer saves every checkpoint to `output_dir` (the run's local scratch) first; the kit copies it to
Drive afterwards. So the local disk must hold one more checkpoint at each save. Its size is the last
checkpoint's, or, before the first, the model's weights and the optimizer's two moments (AdamW).
"""

from __future__ import annotations

import errno

from .._units import format_bytes
from ..checkpoints import storage
from ..distributed import ranks
from ..errors import ColabKitError

__all__ = ["check_local_space", "explain_disk_full", "LocalDiskFullError"]

MARGIN = 1.1  # the Trainer's small files (trainer_state, rng, scheduler) and the filesystem's own blocks
_TORCH_WRITE_FAILED = ("unexpected pos", "PytorchStreamWriter failed", "file write failed")


class LocalDiskFullError(ColabKitError, OSError):
    """The VM's disk cannot hold the next checkpoint (nothing was written; earlier checkpoints are kept)."""


def checkpoint_bytes(run, model) -> int:
    """What the next checkpoint will take: the last one's size, or the model's weights and AdamW's moments."""
    if run.last_checkpoint_bytes:
        return run.last_checkpoint_bytes
    if model is None:
        return 0
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    moments = sum(p.numel() * 4 * 2 for p in model.parameters() if p.requires_grad)  # fp32, 2 per parameter
    return weights + moments


def check_local_space(run, model, step: int) -> None:
    """Before the Trainer writes checkpoint-`step` to the run's local scratch. Rank 0 looks at its disk and
    every rank follows its answer (the Trainer's save is collective: one rank alone must not stop).

    Raises:
        LocalDiskFullError: how much is free where, how much the checkpoint needs, and what to do.
    """
    problem = _space_problem(run, model, f"checkpoint-{step}") if run.ranks.writer else None
    if ranks.from_writer(problem is not None):
        raise LocalDiskFullError(errno.ENOSPC, problem or "rank 0's disk cannot hold the next checkpoint")


def _space_problem(run, model, what: str) -> str | None:
    needed = int(checkpoint_bytes(run, model) * MARGIN)
    try:
        free = storage.free_bytes(run.local_dir)
    except OSError:
        return None  # unknown: the save itself will tell
    return _full(run, free, needed, what) if free is not None and free < needed else None


def explain_disk_full(run, exc: BaseException, model) -> None:
    """A save that failed on a full local disk (ENOSPC, or torch's failed write) gets a note that says so."""
    if isinstance(exc, LocalDiskFullError):
        return
    text = str(exc)
    if not (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) and not any(m in text for m in _TORCH_WRITE_FAILED):
        return
    try:
        free = storage.free_bytes(run.local_dir)
    except OSError:
        return
    needed = int(checkpoint_bytes(run, model) * MARGIN)
    if free is not None and free < max(needed, 1):
        exc.add_note("colab_kit: " + _full(run, free, needed, "the checkpoint being saved"))


def _full(run, free: int, needed: int, what: str) -> str:
    saved = run.last_saved_step
    return (f"the VM's disk is full: {run.local_dir} has {format_bytes(free)} free, and {what} needs about "
            f"{format_bytes(needed)}. Nothing was lost: "
            + (f"checkpoint-{saved} is the newest saved" if saved is not None else "no checkpoint was saved yet")
            + ". Free space on this disk (large files under /content, or ~/.cache/huggingface), then run the "
              "start_run cell and this cell again: training continues from the newest checkpoint")
