"""One training step of the user's own model, traced without its memory: the plan's measurements.

The model is copied with fake tensors (`FakeTensorMode`: shapes and dtypes, no storage; the user's
model is left as it is), an optimizer of the same class and settings is made for the copy and its
state created, and one step (forward under the autocast the Trainer would use, backward, optimizer
step) runs under PyTorch's own memory tracker (`torch.distributed._tools.mem_tracker.MemTracker`),
which follows every tensor made and freed and reports the peak in categories: weights, gradients,
optimizer state, activations, temporaries. A trace costs the dispatch of the step's operations
(seconds for BERT-base), none of their arithmetic. The tracker's tests accept 10 % of the CUDA
peak; the kit's CPU tests hold it to that against the profiler's own allocation events.

Two things the CPU would do differently from the GPU are set as the GPU does them:
- **Attention.** On a CUDA GPU, scaled-dot-product attention runs a fused kernel (FlashAttention-2
  from sm80, the memory-efficient kernel on a T4) that never holds the sequence x sequence scores,
  with dropout too; on the CPU, attention dropout sends it to the math path, which holds them. The
  trace calls it without dropout, as the fused kernels' memory is: their dropout keeps a seed.
- **Allocation.** PyTorch's caching allocator rounds every block up to 512 bytes; the tracker does so
  for CUDA tensors, and here for the CPU's too when the plan is for a GPU.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass

from .depth import SHALLOW, extrapolate, find_blocks, linear, recording
from .fakecopy import fake_copy, frozen_as_buffers, same_optimizer, tensor_bytes
from .fourbit import replace_linear
from .recipes import set_checkpointing
from .tracked import parts_of

__all__ = ["StepTrace", "FakeStep", "PRECISIONS"]

PRECISIONS = ("fp32", "fp16", "bf16")


@dataclass
class StepTrace:
    """One traced step: bytes live at its peak, split into categories, and what the step costs."""

    peak: int
    parts: dict  # category -> bytes at the peak (weights, buffers, gradients, optimizer, activations, ...)
    gradients: int  # every gradient, once the backward pass is over
    flops: int  # of the forward and backward passes (recomputation included)
    ops: int  # operations dispatched (each a kernel launch on a GPU)
    seconds: float
    derived: str = ""  # how it was found: "" traced at full depth, else what it was derived from (`depth.py`)
    timeline: object = None  # the bytes after every operation (`depth.Timeline`), when asked for


class FakeStep:
    """The user's model copied with fake tensors, with an optimizer whose state exists, ready to trace
    steps in several configurations.

    Args:
        model: the user's `torch.nn.Module` (any device; left untouched).
        optimizer: the user's optimizer (its class and settings are copied), a function making one from
            parameters, or None for AdamW. Its multi-tensor (`foreach`) form is used, as on a GPU.
        round_to: bytes each allocation is rounded up to (512 for a GPU's caching allocator, 1 for exact).
        freeze: blocks to freeze at the bottom of the copy (`recipes.freeze_layers`), 0 for none.
        four_bit: plan the model's linear layers as bitsandbytes would load them in 4 bits, computing in this
            dtype (`fourbit.replace_linear`); layers already in 4 bits are always planned as such.
        blocks: copy only the first `blocks` of the model's repeated blocks (`depth.find_blocks`); None: all.
        shallow: derive a deep model's forward and backward from copies with 2 and 3 blocks (`depth.py`),
            where its blocks are alike; False: trace every block.
    """

    def __init__(self, model, optimizer=None, *, round_to: int = 512, freeze: int = 0, four_bit=None,
                 blocks: int | None = None, shallow: bool = True):
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.torch = torch
        self.round_to = round_to
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if self.device.type == "meta":
            self.device = torch.device("cpu")
        found = find_blocks(model)
        self.blocks_path, self.depth = (found[0], len(found[1])) if found is not None else ("", 0)
        self._shallow_args = (model, optimizer, round_to, four_bit) if shallow and found and not freeze and \
            blocks is None else None
        self._shallow: list | None = None
        with self.mode, _quiet():
            memo: dict = {}
            if blocks is not None:  # the copy's block list holds the first `blocks` of the model's
                if found is None:
                    raise ValueError(f"{type(model).__name__} has no repeated blocks to take {blocks} of")
                memo[id(found[1])] = fake_copy(torch.nn.ModuleList(list(found[1])[:blocks]), self.mode, memo)
                self.depth = blocks
            self.model = fake_copy(model, self.mode, memo)
            if four_bit is not None:
                replace_linear(self.model, self.mode, four_bit)
            self.four_bit_layers = sum(type(m).__name__ == "FourBitLinear" for m in self.model.modules())
            if freeze:
                from .recipes import freeze_layers

                freeze_layers(self.model, freeze)
            self.frozen = frozen_as_buffers(self.model, round_to)
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.optimizer = same_optimizer(optimizer, params, torch)
            for p in params:  # the state the optimizer holds from its first step on
                p.grad = torch.zeros_like(p)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.weights = tensor_bytes(self.model.parameters(), round_to) + self.frozen
        self.buffers = tensor_bytes(self.model.buffers(), round_to) - self.frozen
        self.trainable = tensor_bytes(params, round_to)
        self.optimizer_state = tensor_bytes((v for s in self.optimizer.state.values() for v in s.values()
                                       if torch.is_tensor(v)), round_to)

    @property
    def can_checkpoint(self) -> bool:
        return bool(getattr(self.model, "supports_gradient_checkpointing", False))

    def trace(self, batch: dict, *, precision: str = "fp32", checkpointing: bool = False,
              keep_outputs: bool = False, optimizer_step: bool = False) -> StepTrace:
        """Forward (under autocast for fp16/bf16), backward, and the optimizer step when asked; a deep model's
        forward and backward derived from two shallow copies where its blocks are alike (`depth.py`, said in
        the trace's `derived`), else traced at full depth.

        Args:
            batch: name -> (shape, dtype) of the inputs the model is called with.
            keep_outputs: keep the model's outputs alive through the backward pass, as a plain loop's
                `out = model(**batch); out.loss.backward()` does; the Trainer keeps only the loss.
        """
        if precision not in PRECISIONS:
            raise ValueError(f"precision={precision!r}: one of {PRECISIONS}")
        settings = dict(precision=precision, checkpointing=checkpointing, keep_outputs=keep_outputs)
        if self._shallow_args is not None and not optimizer_step:
            derived = self._derived(batch, **settings)
            if derived is not None:
                return derived
        return self.traced(batch, optimizer_step=optimizer_step, **settings)

    def _derived(self, batch: dict, **settings) -> StepTrace | None:
        """The step of every block from copies with SHALLOW and SHALLOW + 1 (None when those do not line up)."""
        started = time.perf_counter()
        try:
            if self._shallow is None:
                model, optimizer, round_to, four_bit = self._shallow_args
                self._shallow = [FakeStep(model, optimizer, round_to=round_to, four_bit=four_bit, blocks=n,
                                          shallow=False) for n in (SHALLOW, SHALLOW + 1)]
            short, long = (step.traced(batch, timeline=True, **settings) for step in self._shallow)
        except Exception:  # noqa: BLE001 - a model whose code needs all its blocks (a count read from its config)
            self._shallow_args = None  # traced at full depth, as it was before; the full trace raises its own
            return None
        parts = extrapolate(short.timeline, long.timeline, SHALLOW, self.depth)
        if parts is None:
            self._shallow_args = None  # its blocks are not alike: every trace of this model goes full depth
            return None
        peak = parts.pop("Total")
        line = {name: int(linear(getattr(short, name), getattr(long, name), SHALLOW, self.depth))
                for name in ("gradients", "flops", "ops")}
        return StepTrace(peak=peak, parts=parts, **line, seconds=time.perf_counter() - started,
                         derived=f"from copies of {SHALLOW} and {SHALLOW + 1} of its {self.depth} blocks")

    def traced(self, batch: dict, *, precision: str = "fp32", checkpointing: bool = False,
               keep_outputs: bool = False, optimizer_step: bool = False, timeline: bool = False) -> StepTrace:
        """`trace`, every block of this copy traced; with `timeline`, the bytes after every operation too."""
        torch = self.torch
        from torch.distributed._tools.mem_tracker import MemTracker

        started = time.perf_counter()
        with self.mode, _quiet(), _checkpointing(self.model, checkpointing), _fused_attention(torch), \
                _rounding(self.round_to):
            inputs = {k: torch.zeros(shape, dtype=dtype, device=self.device) for k, (shape, dtype) in batch.items()}
            tracker = MemTracker()
            _peak_only(tracker)
            tracker.track_external(self.model, self.optimizer, *inputs.values())
            places = recording(tracker, self.model, self.blocks_path) if timeline else contextlib.nullcontext(
                (None, None))
            self.model.train()
            with tracker, places as (steps, after_op), _OpCounter(after_op) as counter:
                autocast = (torch.autocast(self.device.type, dtype=getattr(torch, {"fp16": "float16"}.get(
                    precision, "bfloat16"))) if precision != "fp32" else contextlib.nullcontext())
                with autocast:
                    outputs = self.model(**inputs)
                loss = outputs["loss"] if isinstance(outputs, dict) or hasattr(outputs, "keys") else outputs[0]
                if not keep_outputs:
                    del outputs
                loss.backward()
                gradients = tensor_bytes((p.grad for p in self.model.parameters() if p.grad is not None), self.round_to)
                if optimizer_step:
                    self.optimizer.step()
                del loss
                outputs = None
            self.optimizer.zero_grad(set_to_none=True)
            parts = parts_of(tracker.get_tracker_snapshot("peak"))
        peak = parts.pop("Total")
        return StepTrace(peak=peak, parts=parts, gradients=gradients, flops=int(counter.flops),
                         ops=counter.count, seconds=time.perf_counter() - started, timeline=steps)


    def trace_optimizer_step(self) -> StepTrace:
        """The optimizer step alone, with every gradient there: its peak does not depend on the batch,
        the precision or checkpointing."""
        torch = self.torch
        from torch.distributed._tools.mem_tracker import MemTracker

        started = time.perf_counter()
        with self.mode, _quiet(), _rounding(self.round_to):
            tracker = MemTracker()
            tracker.track_external(self.model, self.optimizer)
            counter = _OpCounter()
            with tracker, counter:
                for p in self.model.parameters():
                    if p.requires_grad:
                        p.grad = torch.zeros_like(p)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            parts = parts_of(tracker.get_tracker_snapshot("peak"))
        return StepTrace(peak=parts.pop("Total"), parts=parts, gradients=self.trainable, flops=0, ops=counter.count,
                         seconds=time.perf_counter() - started)


class _OpCounter:
    """Counts the operations a step dispatches and their FLOPs (PyTorch's own formulas, as its
    `FlopCounterMode` has them; that mode itself keeps non-reentrant checkpointing's activations alive)."""

    def __init__(self, after_op=None):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is torch.ops.aten._local_scalar_dense.default:
                    # A tensor's value read in Python (transformers 4.57's `(mask == 1).all()`): fake tensors
                    # have none, so the trace takes the common branch (no padding; a count of one).
                    dtype = args[0].dtype
                    return True if dtype == torch.bool else 1.0 if dtype.is_floating_point else 1
                out = func(*args, **kwargs)
                counter.count += 1
                formula = flop_registry.get(func._overloadpacket)
                if formula is not None:
                    counter.flops += formula(*args, **kwargs, out_val=out)
                if after_op is not None:  # the tracker below has counted what this operation made
                    after_op()
                return out

        self.count = self.flops = 0
        self._mode = _Mode()

    def __enter__(self):
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self._mode.__exit__(*exc)


@contextlib.contextmanager
def _checkpointing(model, on: bool):
    """Gradient checkpointing on the fake copy only (non-reentrant, as transformers 5 does it)."""
    if not on:
        yield
        return
    set_checkpointing(model, True)
    try:
        yield
    finally:
        set_checkpointing(model, False)


@contextlib.contextmanager
def _fused_attention(torch):
    """Scaled-dot-product attention as a GPU's fused kernel holds it: without the CPU's math path."""
    functional = torch.nn.functional
    original = functional.scaled_dot_product_attention

    def fused(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        return original(query, key, value, attn_mask, 0.0, *args, **kwargs)

    functional.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = original


@contextlib.contextmanager
def _rounding(round_to: int):
    """Every tracked allocation rounded up as the caching allocator rounds it (the tracker does this for
    CUDA tensors only)."""
    from torch.distributed._tools import mem_tracker

    original = mem_tracker._WeakRefInfo._calculate_mem_consumed

    def rounded(self) -> int:
        size = self.size * self.element_size
        return -(-size // round_to) * round_to

    if round_to > 1:
        mem_tracker._WeakRefInfo._calculate_mem_consumed = rounded
    try:
        yield
    finally:
        mem_tracker._WeakRefInfo._calculate_mem_consumed = original


def _peak_only(tracker) -> None:
    """This tracker keeps the peak of the whole step only: after every operation MemTracker also walks every module
    it has seen for their own peaks, which the plan never reads (a third of a trace's time for a 1.5 B model, and
    what made a full trace grow with the square of the depth). Set on the instance: other trackers keep theirs."""
    import types
    from copy import deepcopy

    from torch.distributed._tools import mem_tracker

    total = getattr(mem_tracker, "_TOTAL_KEY", None)
    if total is None or not hasattr(tracker, "_update_peak_stats"):  # another PyTorch: its own bookkeeping
        return

    def whole_step(self, peak_state) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[total]:
                self._peak_mem[device] = snapshot[total]
                self._peak_mem_snap[device] = deepcopy(snapshot)

    tracker._update_peak_stats = types.MethodType(whole_step, tracker)


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
