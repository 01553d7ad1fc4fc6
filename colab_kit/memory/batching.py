"""Cutting one optimizer step's batch into micro-batches (for `splitstep.MicroBatcher`).

Rows are only regrouped, never changed, so a gradient summed over the micro-batches is the
whole batch's; each micro-batch can be cut to its own longest row (dynamic padding).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping

__all__ = ["batch_size", "split_batch"]


def batch_size(batch) -> int:
    """Rows in a batch: the first dimension of its first tensor."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(batch, torch.Tensor):
        return int(batch.shape[0])
    values = batch.values() if isinstance(batch, Mapping) else batch
    for value in values:
        if hasattr(value, "shape") and len(value.shape) > 0:
            return int(value.shape[0])
        if isinstance(value, (list, tuple)):
            return len(value)
    raise ValueError("cannot tell the batch size: the batch holds no tensor or list")


def _slice(value, start: int, stop: int, rows: int):
    if hasattr(value, "shape") and len(value.shape) > 0 and value.shape[0] == rows:
        return value[start:stop]
    if isinstance(value, (list, tuple)) and len(value) == rows:
        return value[start:stop]
    return value  # per-batch values (flags, scalars) go to every micro-batch


def _sorted_by_length(batch: Mapping, rows: int) -> Mapping:
    """The batch's rows ordered by their attention-mask length (stable; unchanged without a mask)."""
    mask = batch.get("attention_mask")
    if mask is None or not hasattr(mask, "ndim") or mask.ndim != 2 or mask.shape[0] != rows:
        return batch
    order = mask.sum(dim=1).argsort(stable=True)
    if bool((order == order.new_tensor(range(rows))).all()):
        return batch
    index = order.tolist()

    def take(value):
        if isinstance(value, type(order)) and value.ndim > 0 and value.shape[0] == rows:
            return value[order.to(value.device)]
        if hasattr(value, "shape") and len(value.shape) > 0 and value.shape[0] == rows:  # numpy
            return value[index]
        if isinstance(value, (list, tuple)) and len(value) == rows:
            return type(value)(value[i] for i in index)
        return value

    return {k: take(v) for k, v in batch.items()}  # a plain dict, as the micro-batches are


def _trim_right_padding(chunk: dict) -> dict:
    """Cut padding columns that no row of the micro-batch uses (dynamic padding per micro-batch)."""
    mask = chunk.get("attention_mask")
    if mask is None or not hasattr(mask, "ndim") or mask.ndim != 2:
        return chunk
    used = mask.sum(dim=0).nonzero()
    if used.numel() == 0:
        return chunk
    length, full = int(used.max()) + 1, mask.shape[1]
    if length == full or not bool(mask[:, :length].any(dim=0).all()):  # left padding: leave it
        return chunk
    # contiguous: losses such as the masked LM's view the labels flat
    return {k: (v[:, :length].contiguous() if hasattr(v, "ndim") and v.ndim >= 2 and v.shape[1] == full else v)
            for k, v in chunk.items()}


def split_batch(batch, micro: int, trim_padding: bool = True) -> list:
    """Split a batch (dict, tuple/list or tensor) into micro-batches of at most `micro` rows.

    With `trim_padding`, a dict batch that is split is first ordered by length (its attention
    mask), so that rows of similar length share a micro-batch, and each micro-batch is then cut
    to its own longest row. The rows are the same, only grouped differently, so a gradient
    summed over the micro-batches is the whole batch's; the padding computed on shrinks (with
    the nRC lengths, 8,192 padded tokens per 32-row batch become about 5,500 in micro-batches of 8).
    """
    rows = batch_size(batch)
    if trim_padding and micro < rows and isinstance(batch, Mapping):
        batch = _sorted_by_length(batch, rows)
    chunks = []
    for start in range(0, rows, max(1, micro)):
        stop = min(rows, start + micro)
        if isinstance(batch, Mapping):
            chunk = {k: _slice(v, start, stop, rows) for k, v in batch.items()}
            chunks.append(_trim_right_padding(chunk) if trim_padding and stop - start < rows else chunk)
        elif isinstance(batch, (list, tuple)) and not hasattr(batch, "shape"):
            chunks.append(type(batch)(_slice(v, start, stop, rows) for v in batch))
        else:
            chunks.append(batch[start:stop])
    return chunks
