"""Out-of-memory: recognise it, free what it leaves behind, say where memory went.

A step that runs out is redone in smaller pieces by `splitstep.MicroBatcher`, after Composer's
automatic micro-batching: one optimizer step's batch is run as micro-batches of a learned size; on
OOM the same data is run again in halves, so the effective batch, the learning-rate schedule and
the data order never change. Each micro-batch's loss is weighted by its share of the batch's label
items (tokens for a causal LM, samples for classification), so a split step gives the same gradient
as the unsplit one.

Which errors count as out of memory is `oomforms.py`'s table; how a batch is cut into
micro-batches is `batching.py`. accelerate's `find_executable_batch_size` cleans up inside the
`except` block, where the exception still holds the failing frames (and their tensors); here
memory is freed (`release_for_retry`) after the `except` block has ended.
"""

from __future__ import annotations

import gc
import logging
import os
import sys
import warnings
from typing import Any

from .._units import format_bytes
from ..errors import ColabKitError, ColabKitWarning
from .batching import batch_size, split_batch
from .oomforms import is_fatal_cuda_error, is_oom_error

__all__ = ["is_oom_error", "is_fatal_cuda_error", "free_memory", "OutOfMemoryError", "split_batch", "batch_size",
           "memory_numbers", "describe_memory", "release_for_retry", "configure_allocator"]

log = logging.getLogger(__name__)
ELSEWHERE = "another process"  # where an out-of-memory error was, seen from a rank that had none


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


def release_for_retry() -> None:
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
    release_for_retry()
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
