"""A deep model's step from the traces of two shallow copies: a transformer's blocks repeat.

Tracing every block of the model took minutes on 2 cores for a 1.5 B model (issue 47): the dispatch of each
operation grows with depth, and so does the memory tracker's bookkeeping (it visits every module at every
operation), so a full trace grows with the square of the depth. A model whose blocks are alike holds, at any
moment of its step, bytes that are a linear function of its depth: weights, gradients and optimizer state per
block, the activations the blocks already run have saved. So the bytes after each operation of copies with 2 and
3 blocks (`SHALLOW`: the lowest block may run differently, a mask cast once in it) give them for L blocks,

    bytes_L = bytes_2 + (L - 2) * (bytes_3 - bytes_2),

moment by moment, matched by their place in the step: before the blocks, the first block's forward and the last
one's (the blocks between lie on the line between those two), after the blocks, and the same through the backward
pass. The peak of L blocks is the largest of those moments, with its parts; FLOPs and operations follow the same
line. It is the whole step's peak, not a sum of per-block peaks: where the peak lies can move with depth (the
logits' moment for a shallow model, the gradients' end of the backward pass for a deep one), and every candidate
moment is extrapolated.

`find_blocks` takes only blocks of one class and the same parameters, and `aligned` refuses copies that do not
line up (another order of blocks, operations between blocks): the step is then traced at full depth, and the
plan says which it did.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

from .tracked import parts_of

__all__ = ["Timeline", "find_blocks", "recording", "aligned", "extrapolate", "linear", "SHALLOW"]

SHALLOW = 2  # the copies have 2 and 3 blocks: the lowest block may run differently (a mask made once)
MIN_BLOCKS = 8  # below this a full trace costs about what the two copies do (each runs the embeddings and the head)


@dataclass
class Timeline:
    """The bytes after every operation of one traced step, in runs of one place (`label`): ("fwd" or "bwd", the
    block's index or None outside the blocks)."""

    labels: list = field(default_factory=list)
    runs: list = field(default_factory=list)  # per run: a list of {category: bytes} snapshots, one per operation

    def add(self, label, snapshot: dict) -> None:
        if not self.labels or self.labels[-1] != label:
            self.labels.append(label)
            self.runs.append([])
        self.runs[-1].append(snapshot)


def find_blocks(model):
    """(the dotted path, the ModuleList) of the model's repeated blocks: the ModuleList holding the most
    parameters whose modules are of one class with the same parameter shapes; None when there is none of at
    least MIN_BLOCKS."""
    import torch

    best, best_size = None, 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) < MIN_BLOCKS:
            continue
        shapes = [(type(m), [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in m.named_parameters()])
                  for m in module]
        if any(s != shapes[0] for s in shapes[1:]):
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = (name, module), size
    return best


@contextlib.contextmanager
def recording(tracker, model, blocks_path: str):
    """Yields (a Timeline, after_op): `after_op()`, called after each operation dispatched under `tracker` (a
    MemTracker), adds the tracker's bytes at that moment with its place in the step.

    The place comes from hooks on the blocks: a block's forward runs between its pre-hook and its hook; its
    backward begins when the gradient of its output arrives (the same moment ends the backward of the block
    above), and the lowest block's ends when the gradient of its input does. Recomputation (gradient
    checkpointing) runs inside the backward of its block, and is counted there."""
    import torch

    blocks = model.get_submodule(blocks_path)
    timeline = Timeline()
    # The tracker's bytes now, read without its deep copy where this PyTorch keeps them where 2.13 does.
    current = (lambda: tracker._curr_mem_snap) if isinstance(getattr(tracker, "_curr_mem_snap", None), dict) \
        else tracker.get_tracker_snapshot
    state = {"fwd": [], "bwd": None}

    def in_backward() -> bool:
        return torch._C._current_graph_task_id() != -1

    def first_grad_tensor(*trees):
        for tree in trees:
            for t in torch.utils._pytree.tree_leaves(tree):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    return t
        return None

    def hooks_for(i: int, block):
        def before(module, args, kwargs):
            if in_backward():
                return
            state["fwd"].append(i)
            if i == 0:
                start = first_grad_tensor(args, kwargs)
                if start is not None:  # its gradient ends the lowest block's backward
                    start.register_hook(lambda grad: state.__setitem__("bwd", None))

        def after(module, args, kwargs, output):
            if in_backward():
                return
            state["fwd"].pop()
            out = first_grad_tensor(output)
            if out is not None:  # its gradient begins this block's backward
                out.register_hook(lambda grad: state.__setitem__("bwd", i))

        return (block.register_forward_pre_hook(before, with_kwargs=True),
                block.register_forward_hook(after, with_kwargs=True))

    def after_op():
        if in_backward():
            label = ("bwd", state["bwd"])
        else:
            label = ("fwd", state["fwd"][-1] if state["fwd"] else None)
        timeline.add(label, parts_of(current()))

    handles = [h for i, block in enumerate(blocks) for h in hooks_for(i, block)]
    try:
        yield timeline, after_op
    finally:
        for handle in handles:
            handle.remove()


def aligned(short: Timeline, long: Timeline, blocks: int) -> list | None:
    """Pairs (run of `short`, run of `long`) at the same place of the step, for copies of `blocks` and
    `blocks + 1` blocks: outside the blocks in order, the lowest block with the lowest, the top one with the top
    one (the blocks between lie on the line between those two); None when the two do not line up."""
    top = blocks - 1
    expected, pairs = [], []
    for i, (phase, block) in enumerate(short.labels):
        if block is None:
            pairs.append((i, len(expected)))
            expected.append((phase, None))
            continue
        if block not in (0, top):
            continue  # a block between: only the long copy's is looked for, and not paired
        # forward: blocks 0, 1, ..., top + 1; backward: top + 1, ..., 0. The short run pairs with its place.
        if phase == "fwd" and block == 0:
            pairs.append((i, len(expected)))
            expected += [("fwd", b) for b in range(blocks + 1)]
        elif phase == "fwd":
            pairs.append((i, len(expected) - 1))
        elif block == top:
            pairs.append((i, len(expected)))
            expected += [("bwd", b) for b in range(blocks, -1, -1)]
        else:
            pairs.append((i, len(expected) - 1))
    if expected != long.labels:
        return None
    if any(len(short.runs[i]) != len(long.runs[j]) for i, j in pairs):
        return None
    return pairs


def extrapolate(short: Timeline, long: Timeline, blocks: int, depth: int) -> dict | None:
    """The parts at the peak of a step with `depth` blocks ({category: bytes}, "Total" included), from the
    timelines of copies with `blocks` and `blocks + 1`; None when those do not line up."""
    pairs = aligned(short, long, blocks)
    if pairs is None:
        return None
    best = None
    for i, j in pairs:
        for a, b in zip(short.runs[i], long.runs[j]):
            moment = {k: a.get(k, 0) + (depth - blocks) * (b.get(k, 0) - a.get(k, 0)) for k in set(a) | set(b)}
            if best is None or moment["Total"] > best["Total"]:
                best = moment
    if best is None or any(v < 0 for v in best.values()):
        return None
    return best


def linear(short: float, long: float, blocks: int, depth: int) -> float:
    """A count (FLOPs, operations, bytes of gradients) of `depth` blocks from copies of `blocks` and `blocks + 1`."""
    return short + (depth - blocks) * (long - short)
