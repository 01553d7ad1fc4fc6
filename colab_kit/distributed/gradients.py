"""Gradient averaging for the kit's training step under DistributedDataParallel, outside DDP's hooks.

The kit runs a step's micro-batches through the module inside DDP (`unwrap_ddp`), so that its forward
and backward run no collective and one rank's out-of-memory error cannot leave the others waiting in
one; the gradients are then averaged here, once, as DDP's backward would have.

Memory is the point of the exercise: this runs exactly when memory is short. DDP's own buckets stay
allocated (DDP made them), so nothing here copies the whole gradient again: a gradient at least a
quarter of a DDP bucket is all-reduced where it lies, and the smaller ones travel together through one
flat buffer of at most that size, reused for every group. Everything that allocates happens before
the first collective and is agreed on (`agreement.agree_outcome`): a rank that cannot allocate stops
every rank, none is left inside an all-reduce.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager

from .agreement import agree_outcome
from .ranks import _device, group

__all__ = ["DDP_BUCKET_BYTES", "reduce_gradients", "unwrap_ddp", "plan_buckets", "straight_to_module"]

DDP_BUCKET_BYTES = 25 * 1024 * 1024  # DistributedDataParallel's default bucket_cap_mb=25


def unwrap_ddp(model):
    """The module inside DistributedDataParallel (its forward and backward run no collective), or None."""
    torch = sys.modules.get("torch")
    ddp = getattr(getattr(getattr(torch, "nn", None), "parallel", None), "DistributedDataParallel", None)
    return model.module if ddp is not None and isinstance(model, ddp) else None


@contextmanager
def straight_to_module(ddp):
    """Within: a call of the DistributedDataParallel wrapper `ddp` is a call of its module. For a plain
    loop's `forward` that calls the wrapper (`lambda b: ddp(**b).loss`): DDP's forward would broadcast its
    buffers and arm its gradient hooks (a collective in the forward and in the backward), so one rank's
    error there would leave the others inside a collective it never reaches. The gradients are then
    averaged once with `reduce_gradients`, after every rank agreed how the step ended."""
    before = ddp.__dict__.get("forward")  # an instance attribute (nn.Module.__call__ looks there first)
    ddp.forward = ddp.module.__call__  # the module's own hooks run, as under DDP's forward
    try:
        yield ddp.module
    finally:
        if before is None:
            del ddp.forward
        else:
            ddp.forward = before


def plan_buckets(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of `sizes` (bytes) in groups to all-reduce together: a tensor of `limit` bytes or more
    alone (in place), the others in order, in groups of at most `limit` bytes (through the buffer)."""
    groups: list[list[int]] = []
    current: list[int] = []
    filled = 0
    for i, size in enumerate(sizes):
        if size >= limit:
            groups.append([i])
            continue
        if current and filled + size > limit:
            groups.append(current)
            current, filled = [], 0
        current.append(i)
        filled += size
    if current:
        groups.append(current)
    return groups


def reduce_gradients(module, *, bucket_bytes: int | None = None) -> None:
    """Average the gradients of `module`'s parameters across ranks, as DDP's backward would have.

    A parameter with a gradient on some ranks only gets zeros on the others (DDP's handling of
    unused parameters); one with no gradient anywhere keeps None. At most `bucket_bytes / 4`
    (a quarter of DDP's bucket, `bucket_bytes_cap`) is allocated beyond the gradients themselves.

    Raises:
        an allocation error on its own rank, RankFailedError on the others (nothing is left waiting).
    """
    dist = group()
    if dist is None:
        return
    import torch

    limit = max(1, int(bucket_bytes or DDP_BUCKET_BYTES) // 4)
    params = [p for p in module.parameters() if p.requires_grad]
    device = _device(dist)
    has = torch.tensor([int(p.grad is not None) for p in params], dtype=torch.int64, device=device)
    dist.all_reduce(has, op=dist.ReduceOp.MAX)
    error = None
    try:  # every allocation, before any collective of the averaging itself
        for p, anywhere in zip(params, has.tolist()):
            if anywhere and p.grad is None:
                p.grad = torch.zeros_like(p)
            elif p.grad is not None and not p.grad.is_contiguous():
                p.grad = p.grad.contiguous()
        kinds: dict = {}
        for p in params:
            if p.grad is not None:
                kinds.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        work = []
        for (dtype, grad_device), grads in kinds.items():
            groups = plan_buckets([g.numel() * g.element_size() for g in grads], limit)
            shared = max((sum(grads[i].numel() for i in g) for g in groups if len(g) > 1), default=0)
            buffer = torch.empty(shared, dtype=dtype, device=grad_device) if shared else None
            work.append((grads, groups, buffer))
    except Exception as exc:  # noqa: BLE001 - out of memory, most likely: every rank raises below
        error = exc
    agree_outcome(error, "gradient averaging")
    world = dist.get_world_size()
    for grads, groups, buffer in work:
        for indices in groups:
            if len(indices) == 1:
                grad = grads[indices[0]]
                dist.all_reduce(grad)
                grad.div_(world)
                continue
            members = [grads[i] for i in indices]
            flat = buffer[:sum(g.numel() for g in members)]
            torch.cat([g.view(-1) for g in members], out=flat)
            dist.all_reduce(flat)
            flat.div_(world)
            offset = 0
            for g in members:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
