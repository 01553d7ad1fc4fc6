"""Out-of-memory: recognise it, free what it leaves behind, and retry a step in smaller pieces.

The model here is Composer's automatic micro-batching: one optimizer step's batch is run as
micro-batches of a learned size; on OOM the same data is run again in halves, so the
effective batch, the learning-rate schedule and the data order never change. Each
micro-batch's loss is weighted by its share of the batch's label items (tokens for a causal
LM, samples for classification), so a split step gives the same gradient as the unsplit one.

accelerate's `find_executable_batch_size` matches message text only and cleans up inside the
`except` block, where the exception still holds the failing frames (and their tensors); here
the type is checked along the whole cause/context chain, and memory is freed after the
`except` block has ended.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any, Callable

from ._units import format_bytes
from .errors import ColabKitError, ColabKitWarning

__all__ = ["is_oom_error", "is_fatal_cuda_error", "free_memory", "OutOfMemoryError", "MicroBatcher",
           "split_batch", "batch_size", "memory_numbers", "describe_memory", "configure_allocator"]

log = logging.getLogger(__name__)

# Lower-cased fragments of every OOM message PyTorch and its backends produce.
_OOM_MESSAGES = (
    "cuda out of memory",
    "cuda error: out of memory",
    "cublas_status_alloc_failed",
    "cudnn_status_not_supported",  # cuDNN's answer to a workspace it cannot allocate (large batch)
    "hip out of memory",
    "xpu out of memory",
    "mps backend out of memory",
    "defaultcpuallocator: can't allocate memory",
)
# Errors that leave the CUDA context broken: never retried, they need a runtime restart.
_FATAL_CUDA = ("device-side assert", "illegal memory access", "unspecified launch failure",
               "misaligned address", "an illegal instruction", "cuda error: ")


def _chain(exc: BaseException | None):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _is_oom_single(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, getattr(torch, "OutOfMemoryError", ())):
        return True
    if isinstance(exc, MemoryError):  # host RAM (Python's own), and the kit's OutOfMemoryError
        return True
    text = str(exc).lower()
    return any(fragment in text for fragment in _OOM_MESSAGES)


def is_oom_error(exc: BaseException) -> bool:
    """True for every out-of-memory error, anywhere in the exception's cause/context chain.

    Recognises `torch.OutOfMemoryError` and `MemoryError` by type and the known messages of
    CUDA, cuBLAS, cuDNN (a large batch), HIP, XPU, MPS and the CPU allocator. False for device-side asserts, illegal
    memory accesses and other CUDA errors: those break the CUDA context and need a restart.

    Example:
        >>> is_oom_error(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
    """
    return any(_is_oom_single(e) for e in _chain(exc))


def is_fatal_cuda_error(exc: BaseException) -> bool:
    """A CUDA error (not an OOM) after which the runtime must be restarted."""
    if is_oom_error(exc):
        return False
    return any(fragment in str(e).lower() for e in _chain(exc) for fragment in _FATAL_CUDA)


class OutOfMemoryError(ColabKitError, MemoryError):
    """Out of memory even at micro-batch 1; the message holds the diagnosis and next steps."""


def _cuda_ready():
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch
    return None


def memory_numbers() -> dict:
    """GPU (if CUDA is in use) and host memory right now; never initialises CUDA."""
    numbers: dict[str, Any] = {}
    torch = _cuda_ready()
    if torch is not None:
        free, total = torch.cuda.mem_get_info()
        numbers.update(gpu_used=total - free, gpu_total=total, reserved=torch.cuda.memory_reserved(),
                       allocated=torch.cuda.memory_allocated())
    try:
        import psutil

        numbers["rss"] = psutil.Process().memory_info().rss
    except Exception:
        pass
    return numbers


def describe_memory(numbers: dict) -> str:
    if "gpu_total" in numbers:
        return (f"GPU {format_bytes(numbers['gpu_used'])} of {format_bytes(numbers['gpu_total'])} used, "
                f"PyTorch reserved {format_bytes(numbers['reserved'])}")
    return f"host RSS {format_bytes(numbers.get('rss'))}"


def _release() -> None:
    """gc + empty the CUDA cache: what a retry needs (called after the `except` block ended)."""
    gc.collect()
    torch = _cuda_ready()
    if torch is not None:
        torch.cuda.empty_cache()


def _drop_ipython_references() -> int:
    """Forget the last uncaught exception the way IPython keeps it (three places)."""
    dropped = 0
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            delattr(sys, name)
            dropped += 1
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is not None:
        result = getattr(shell, "last_execution_result", None)
        if result is not None and getattr(result, "error_in_exec", None) is not None:
            result.error_in_exec = None
            dropped += 1
        tb_handler = getattr(shell, "InteractiveTB", None)
        if tb_handler is not None and getattr(tb_handler, "tb", None) is not None:
            tb_handler.tb = None
            dropped += 1
    return dropped


def free_memory(verbose: bool = True) -> dict:
    """Free what an out-of-memory error left behind, and say how much it was.

    Drops IPython's references to the last exception (`sys.last_*`, the shell's last execution
    result and its traceback handler: each keeps the failing frames and their GPU tensors
    alive), runs the garbage collector and empties PyTorch's CUDA cache. Safe without CUDA or
    IPython.

    Returns:
        {"dropped_references": n, "before": {...}, "after": {...}} with memory numbers.
    """
    before = memory_numbers()
    dropped = _drop_ipython_references()
    _release()
    after = memory_numbers()
    if verbose:
        if "allocated" in before:
            freed = before["allocated"] - after["allocated"]
            print(f"colab_kit: freed {format_bytes(max(freed, 0))} of GPU memory held by PyTorch "
                  f"({format_bytes(after['allocated'])} still allocated; {describe_memory(after)})")
        else:
            freed = before.get("rss", 0) - after.get("rss", 0)
            print(f"colab_kit: released {format_bytes(max(freed, 0))} of host memory "
                  f"({describe_memory(after)}); no CUDA in use")
    return {"dropped_references": dropped, "before": before, "after": after}


# -- splitting a batch --------------------------------------------------------------------------

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


def _agree(micro: int, failed: bool) -> tuple[int, bool]:
    """Under torch.distributed, every rank adopts the smallest micro-batch and learns whether any
    rank ran out of memory, so that no rank waits in a collective the others never reach."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return micro, failed
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    values = torch.tensor([-micro, int(failed)], device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return int(-values[0]), bool(values[1])


class MicroBatcher:
    """Forward + backward of one optimizer step's batch in micro-batches, halving on OOM.

    The working micro-batch size is remembered between steps. For plain PyTorch loops:

        mb = ck.MicroBatcher()
        for batch in loader:                       # batch = the whole effective batch
            loss = mb.step(batch, lambda b: model(**b).loss, model=model)
            optimizer.step()
            optimizer.zero_grad()

    Args:
        micro_batch: starting micro-batch size (None: the whole batch).
        on_backoff: called with a dict describing each back-off (for logs and journals).
        grow_back_after: after this many clean steps below the full batch, try doubling the
            micro-batch once more (off by default; a failed try is not repeated).
        diagnose: returns extra text for the error raised when even 1 sample does not fit.
    """

    def __init__(self, micro_batch: int | None = None, *, on_backoff: Callable[[dict], None] | None = None,
                 grow_back_after: int | None = None, diagnose: Callable[[], str] | None = None):
        self.micro_batch = micro_batch
        self.on_backoff = on_backoff
        self.grow_back_after = grow_back_after
        self.diagnose = diagnose
        self.backoffs: list[dict] = []
        self.phase = "idle"
        self._clean_steps = 0
        self._growing = False
        self._ceiling: int | None = None  # a size that failed after growing back

    def step(self, batch, forward: Callable[[Any], Any], *, model=None, backward: Callable | None = None,
             zero_grad: Callable[[], None] | None = None, weight: str | Callable[[Any], float] = "samples",
             context: dict | None = None):
        """Run `forward` and the backward pass over `batch` in micro-batches; returns the loss.

        Args:
            batch: one optimizer step's data (dict of tensors, tuple/list of tensors, or a tensor).
            forward: micro-batch -> scalar loss, a *mean* over that micro-batch's items.
            model: whose gradients are zeroed before a retry (or give `zero_grad`).
            backward: loss -> None; default `loss.backward()` (pass `lambda l: scaler.scale(l).backward()`
                for fp16 with a GradScaler).
            weight: "samples", "tokens" (label entries that are not -100), or a callable
                micro-batch -> number of items its loss is averaged over.
            context: extra fields for the back-off report (e.g. the step number).

        Returns:
            The batch's loss (a detached tensor): the items-weighted mean of the micro-batch losses.

        Raises:
            OutOfMemoryError: even a micro-batch of 1 does not fit (with a diagnosis).
        """
        if model is None and zero_grad is None:
            raise ValueError("give model= (or zero_grad=) so gradients can be cleared before a retry")
        zero_grad = zero_grad or (lambda: model.zero_grad(set_to_none=True))
        backward = backward or (lambda loss: loss.backward())
        weigh = _weigher(weight)
        return self._retrying(batch, lambda chunks: self._forward_backward(chunks, forward, backward, weigh),
                              on_retry=zero_grad, trim_padding=True, context=context)

    def map(self, batch, fn: Callable[[Any], Any], *, context: dict | None = None) -> tuple[list, list]:
        """Apply `fn` to micro-batches of `batch` (no backward pass: evaluation, prediction).

        Halves the micro-batch on OOM and starts over. Micro-batches keep the batch's padded
        length, so their outputs can be concatenated.

        Returns:
            (micro-batches, outputs), in order.
        """
        def run_all(chunks):
            self.phase = "evaluation"
            outputs = [fn(chunk) for chunk in chunks]
            self.phase = "idle"
            return chunks, outputs

        return self._retrying(batch, run_all, on_retry=None, trim_padding=False, context=context)

    def _retrying(self, batch, run_chunks, *, on_retry, trim_padding, context):
        rows = batch_size(batch)
        micro = self._maybe_grow(min(self.micro_batch or rows, rows), rows)
        while True:
            error = None
            try:
                result = run_chunks(split_batch(batch, micro, trim_padding=trim_padding))
            except Exception as exc:  # noqa: BLE001 - anything but an OOM is re-raised just below
                if not is_oom_error(exc):
                    raise
                error = str(exc).splitlines()[0][:300]  # only text: the exception (and its frames) go
            micro, failed = _agree(micro, error is not None)
            if not failed:
                self._succeeded(micro, rows)
                return result
            where = self.phase
            if on_retry is not None:
                on_retry()
            _release()
            if micro <= 1:
                raise OutOfMemoryError(self._bounded_message(where, error))
            self._backoff(micro, max(1, micro // 2), where, error, rows, context or {})
            micro = max(1, micro // 2)

    def _forward_backward(self, chunks, forward, backward, weigh):
        weights = [weigh(c) for c in chunks]
        total_weight = sum(weights)
        if total_weight <= 0:  # no label items at all: fall back to rows
            weights = [batch_size(c) for c in chunks]
            total_weight = sum(weights)
        total = None
        for chunk, w in zip(chunks, weights):
            if w == 0:
                continue  # no label items: contributes no gradient (its mean loss would be NaN)
            self.phase = "forward"
            loss = forward(chunk) * (w / total_weight)
            self.phase = "backward"
            backward(loss)
            loss = loss.detach()
            total = loss if total is None else total + loss
            del loss
        self.phase = "idle"
        return total

    def _succeeded(self, micro: int, rows: int) -> None:
        # Only a back-off or a successful grow-back changes the remembered size: a small last
        # batch of an epoch must not shrink it.
        if self._growing:
            self.micro_batch = micro
            self._growing = False
        self._clean_steps += 1

    def _maybe_grow(self, micro: int, rows: int) -> int:
        self._growing = False
        if (self.grow_back_after and micro < rows and self._clean_steps >= self.grow_back_after
                and (self._ceiling is None or micro * 2 < self._ceiling)):
            self._clean_steps = 0
            self._growing = True
            return min(rows, micro * 2)
        return micro

    def _backoff(self, old: int, new: int, where: str, error: str, rows: int, context: dict) -> None:
        if self._growing:
            self._ceiling = old  # growing back failed: never try this size again
            self._growing = False
        self._clean_steps = 0
        self.micro_batch = new
        report = {"where": where, "from": old, "to": new, "batch": rows, "error": error,
                  **memory_numbers(), **context}
        self.backoffs.append(report)
        if self.on_backoff is not None:
            self.on_backoff(report)
        else:
            print(f"colab_kit: out of memory in {where}: micro-batch {old} -> {new} "
                  f"(the batch of {rows} is kept; {describe_memory(report)})", flush=True)

    def _bounded_message(self, where: str, error: str) -> str:
        extra = self.diagnose() if self.diagnose else ""
        return (f"out of memory in {where} even with a micro-batch of 1 sample ({error}). "
                f"{describe_memory(memory_numbers())}. {extra}".strip())


def _weigher(weight) -> Callable[[Any], float]:
    if callable(weight):
        return weight
    if weight == "samples":
        return batch_size
    if weight == "tokens":
        def tokens(chunk):
            labels = chunk["labels"] if isinstance(chunk, Mapping) else chunk[-1]
            return int(labels.ne(-100).sum())

        return tokens
    raise ValueError(f"weight={weight!r}: use 'samples', 'tokens' or a function micro-batch -> item count")


def configure_allocator() -> None:
    """Ask PyTorch's CUDA allocator for expandable segments (less fragmentation), if still possible.

    Set only when the user set nothing and CUDA is not initialised yet (the allocator reads the
    variable once). PYTORCH_CUDA_ALLOC_CONF is used rather than the newer PYTORCH_ALLOC_CONF:
    torch 2.9.1 ignores the new name for expandable segments (pytorch/pytorch#183387), while the
    old one works everywhere (2.8-2.11 print a deprecation warning for it).
    """
    if os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF"):
        return
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        warnings.warn("CUDA was initialised before colab_kit was imported, so expandable segments "
                      "(less memory fragmentation) cannot be enabled for this session; import "
                      "colab_kit before anything touches the GPU", ColabKitWarning, stacklevel=3)
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
