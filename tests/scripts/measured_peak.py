"""The peak memory of a real training step, measured independently of the memory plan's prediction.

PyTorch's profiler (`profile_memory=True`) records every CPU allocation and free with its size; the
events are replayed in time order to the live bytes, and the peak is taken inside the measured step.
The profiler must run from before the model is built: it does not report the frees of blocks that were
allocated before it started.
"""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import ProfilerActivity, profile, record_function

__all__ = ["measured_step_peak"]


def measured_step_peak(build, batch, *, precision="fp32", micro_batches=1, keep_outputs=False, warm_steps=1) -> int:
    """Bytes live at the peak of one training step (after `warm_steps` steps that create the optimizer's
    state), as the profiler's allocation events replay it.

    Args:
        build: () -> (model, optimizer), called inside the profiler.
        batch: the inputs (a dict of tensors), split along dim 0 into `micro_batches` equal parts whose
            gradients accumulate before the optimizer step.
    """
    from torch._C._profiler import _EventType

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model, optimizer = build()
        model.train()
        for step in range(warm_steps + 1):
            with record_function("MEASURED") if step == warm_steps else contextlib.nullcontext():
                _step(model, optimizer, batch, precision, micro_batches, keep_outputs)
    events = list(_walk(prof.profiler.kineto_results.experimental_event_tree()))
    window = next(e for e in events if e.name == "MEASURED")
    start, end = window.start_time_ns, window.start_time_ns + window.duration_time_ns
    allocations = sorted((e for e in events if e.typed[0] == _EventType.Allocation
                          and e.typed[1].device.type == "cpu"), key=lambda e: e.start_time_ns)
    live = peak = 0
    for event in allocations:
        if event.start_time_ns > end:
            break
        live += event.typed[1].alloc_size  # negative for a free
        if event.start_time_ns >= start:
            peak = max(peak, live)
    return peak


def _step(model, optimizer, batch, precision, micro_batches, keep_outputs):
    autocast = (torch.autocast("cpu", dtype=torch.float16 if precision == "fp16" else torch.bfloat16)
                if precision != "fp32" else contextlib.nullcontext())
    size = next(iter(batch.values())).shape[0] // micro_batches
    for i in range(micro_batches):
        part = {k: v[i * size:(i + 1) * size] for k, v in batch.items()}
        with autocast:
            outputs = model(**part)
        loss = outputs.loss
        if not keep_outputs:
            del outputs
        loss.backward()
        del loss
        outputs = None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _walk(nodes):
    stack = list(nodes)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children)
