"""How a step ended, agreed by every rank at once: fine, out of memory (all retry smaller), or failed.

The kit's training step runs its forward and backward passes without collectives (`gradients.py`), so
that one rank's error cannot strand the others inside one. Each part of the step that may fail on one
rank only (the micro-batches, the gradient averaging's allocations, the optimizer step) ends in one
small all-reduce that every rank reaches whatever happened: it carries each rank's outcome. When any
rank failed, every rank raises: the failing one its own exception (with a note naming its rank),
the others a `RankFailedError` naming that rank and its exception. Nobody waits for the process
group's timeout (30 minutes by default).

Without a process group every helper is the single-process answer: the error is raised as it is.
"""

from __future__ import annotations

from ..errors import RankFailedError
from .ranks import _device, all_agree, group

__all__ = ["agree_micro_batch", "agree_outcome", "RankFailedError"]

_TEXT = 400  # characters of a failing rank's message sent to the others


def agree_micro_batch(micro: int, oom: bool, error: BaseException | None = None, *, where: str = "step",
                      step: int | None = None) -> tuple[int, list[int]]:
    """Every rank adopts the smallest micro-batch and learns which ranks ran out of memory, so that
    all of them retry a step together; an `error` (anything but out of memory) on any rank is raised
    on every rank instead.

    Returns:
        (the micro-batch to use, the ranks that ran out of memory).

    Raises:
        `error` on its own rank, RankFailedError on the others.
    """
    dist = group()
    if dist is None:
        if error is not None:
            raise error
        return micro, [0] if oom else []
    import torch

    world, me = dist.get_world_size(), dist.get_rank()
    values = torch.zeros(1 + 2 * world, dtype=torch.int64, device=_device(dist))
    values[0] = -micro
    values[1 + me] = int(oom)
    values[1 + world + me] = int(error is not None)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    flags = values.tolist()
    failed = [r for r in range(world) if flags[1 + world + r]]
    if failed:
        _raise_everywhere(dist, failed, error, where, step)
    return int(-flags[0]), [r for r in range(world) if flags[1 + r]]


def agree_outcome(error: BaseException | None, where: str, *, step: int | None = None, pg=None) -> None:
    """Every rank learns whether any rank failed at this point; if one did, every rank raises. `pg`: a process
    group over every rank to agree on instead of the default one.

    Raises:
        `error` on its own rank, RankFailedError on the others.
    """
    dist = group()
    if dist is None:
        if error is not None:
            raise error
        return
    failed = all_agree(error is None, pg)  # the ranks that failed, known to every rank
    if failed:
        _raise_everywhere(dist, failed, error, where, step, pg)


def _describe(error: BaseException) -> str:
    text = str(error).strip().splitlines()[0][:_TEXT] if str(error).strip() else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _raise_everywhere(dist, failed: list[int], error: BaseException | None, where: str, step: int | None, pg=None):
    """Every rank learns what failed where (one all-gather of short texts), then raises."""
    world, me = dist.get_world_size(), dist.get_rank()
    told: list = [None] * world  # (where, what) from each failing rank: its own view of the step
    dist.all_gather_object(told, (where, _describe(error)) if error is not None else None, group=pg)
    at = f" at step {step}" if step is not None else ""
    others = [r for r in failed if r != me]
    if error is not None:
        also = f"; rank(s) {others} failed too" if others else ""
        error.add_note(f"colab_kit: raised on rank {me} of {world} in the {where}{at}; every rank was told and "
                       f"stops with it{also}")
        raise error
    first = failed[0]
    also = f" (and rank(s) {failed[1:]})" if len(failed) > 1 else ""
    raise RankFailedError(
        f"rank {first} of {world} failed in the {told[first][0]}{at}: {told[first][1]}{also}. This rank ({me}) stops too, "
        f"so that no process waits for it; the traceback is in rank {first}'s output. Fix the cause and run "
        f"again: training resumes from the last checkpoint.")
