"""A memory plan's rows: the traces (`steptrace.py`) turned into one row per configuration.

A micro-batch of m rows out of a per-device batch of B holds what the whole batch holds but for the
activations and temporaries at the traced peak, which scale by m / B; from the second micro-batch on
every gradient exists (they accumulate), so its rows count all of them. The optimizer step's own
peak (every gradient, the state, the update's temporaries) is traced once per optimizer; a step's
peak is the larger of the two. Another optimizer keeps the same activations: its rows swap the
resident state for its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from .gpus import GpuTarget
from .planinputs import PlanInputs
from .steptrace import FakeStep

__all__ = ["PlanRow", "make_rows", "micro_batches", "step_parts"]

CUBLAS_WORKSPACE = 9 << 20  # PyTorch's default cuBLAS (4 MiB x 2 + small) and cuBLASLt (1 MiB) workspaces
UTILISATION = 0.5  # of the datasheet rate a training step's matrix products reach
LAUNCH_S = 8e-6  # per operation per micro-batch on a GPU (launch and the small memory-bound kernels)
SAY_AFTER_S = 2.0  # a plan that has taken longer says what it traces next
SAY_AT_ONCE = 1 << 30  # bytes of weights from which a plan takes seconds: it says so from its first trace

@dataclass
class PlanRow:
    """One configuration: its predicted peak (bytes), parts, fit and relative cost."""

    precision: str
    checkpointing: bool
    micro_batch: int
    micro_batches: int  # per batch
    optimizer: str
    parts: dict
    peak: int
    fits: bool
    cost: float  # per optimizer step, relative to the configuration the run has now (1.0)
    current: bool = False  # the configuration the run has now (at the whole batch)

    def describe(self) -> str:
        split = "the whole batch" if self.micro_batches == 1 else (
            f"micro-batches of {self.micro_batch} ({self.micro_batches} per batch)")
        return (f"{self.precision}{' autocast' if self.precision != 'fp32' else ''}, checkpointing "
                f"{'on' if self.checkpointing else 'off'}, {split}, {self.optimizer}")



def micro_batches(batch: int) -> list[int]:
    """The whole batch, then halves down to one row."""
    sizes, m = [], batch
    while m >= 1:
        if m not in sizes:
            sizes.append(m)
        if m == 1:
            break
        m = (m + 1) // 2
    return sizes


def make_rows(inputs: PlanInputs, target: GpuTarget, budget: int, *, freeze: int | None = None,
              four_bit: bool = False, full_depth: bool = False, say=None):
    """Every configuration's row, and the host RAM the run needs at load, at save (and at merge, for an
    adapter). `say(line)` is told what is traced next once the plan has taken more than SAY_AFTER_S."""
    import torch

    quantized = (torch.bfloat16 if target.bf16 else torch.float16) if four_bit else None
    shallow = not full_depth
    steps = {inputs.optimizer_name: FakeStep(inputs.model, inputs.make_optimizer, four_bit=quantized,
                                             shallow=shallow)}
    lighter = _adafactor(inputs)
    if lighter is not None:
        steps["adafactor"] = FakeStep(inputs.model, lighter, four_bit=quantized, shallow=shallow)
    if freeze:
        steps[f"{inputs.optimizer_name}, {freeze} blocks frozen"] = FakeStep(inputs.model, inputs.make_optimizer,
                                                                              freeze=freeze, four_bit=quantized)
    main = steps[inputs.optimizer_name]
    if main.four_bit_layers:
        inputs.notes.append(f"{main.four_bit_layers} linear layers in 4 bits (NF4"
                            + (", double quantization" if four_bit else "") + "): packed weights and their "
                            "quantization state, a 16-bit dequantized copy of one layer at a time"
                            + ("; the other weights upcast to float32 by prepare_model_for_kbit_training"
                               if four_bit else ""))
    precisions = target.precisions()
    if inputs.precision not in precisions:
        precisions.append(inputs.precision)  # what the run has now, even where the GPU would not run it
    checkpointing = [False, True] if main.can_checkpoint else [False]
    fixed = target.context + CUBLAS_WORKSPACE
    rows: list[PlanRow] = []
    baseline = None
    traces: dict = {}  # (step, precision, checkpointing) -> its trace: another optimizer reuses the main one's
    owners = [step for name, step in steps.items() if step is main or "frozen" in name]  # the others reuse theirs
    progress = _Progress(say, len(owners) * len(precisions) * len(checkpointing), at_once=main.weights > SAY_AT_ONCE)
    for name, step in steps.items():
        optimizer_peak = step.trace_optimizer_step()
        for precision in precisions:
            for ckpt in checkpointing:
                own = step if (step is main or "frozen" in name) else main
                key = (id(own), precision, ckpt)
                if key not in traces:
                    progress.next(f"{precision}, checkpointing {'on' if ckpt else 'off'}"
                                  + (f", {name}" if "frozen" in name else ""))
                    traces[key] = own.trace(inputs.spec(inputs.batch_size), precision=precision, checkpointing=ckpt,
                                            keep_outputs=inputs.keep_outputs)
                trace = traces[key]
                swap = step.optimizer_state - own.optimizer_state  # another optimizer's resident state
                seconds = trace.flops / (target.tflops.get(precision, target.tflops["fp32"]) * 1e12 * UTILISATION)
                current = (name == inputs.optimizer_name and precision == inputs.precision
                           and ckpt == inputs.checkpointing)
                if current:
                    baseline = seconds + trace.ops * LAUNCH_S
                for m in micro_batches(inputs.batch_size):
                    k = -(-inputs.batch_size // m)
                    parts = step_parts(trace, step, optimizer_peak, swap, m / inputs.batch_size, k)
                    peak = sum(parts.values()) + fixed
                    parts["fixed"] = fixed
                    rows.append(PlanRow(precision=precision, checkpointing=ckpt, micro_batch=m, micro_batches=k,
                                        optimizer=name, parts=parts, peak=peak, fits=peak <= budget,
                                        cost=seconds + k * trace.ops * LAUNCH_S, current=current and k == 1))
    for row in rows:  # relative to the run as it is now
        row.cost = row.cost / baseline if baseline else 1.0
    inputs.notes.append(_how_traced(main, traces[(id(main), precisions[0], False)], len(traces)))
    return rows, _host(main, inputs.model, four_bit)


def _how_traced(main: FakeStep, trace, count: int) -> str:
    """What the plan traced and what it derived (said in the plan: a user decides on it)."""
    if trace.derived:
        how = (f"forward and backward traced {trace.derived} and derived for all {main.depth} (the bytes after every "
               f"operation follow a line in the depth; bench/plan_speed.py checks it against full-depth traces)")
    else:
        how = "forward and backward traced at full depth" + (
            f" ({main.depth} blocks)" if main.depth else "")
    return f"{count} configurations traced: {how}; the optimizer step traced on the whole model, once per optimizer"


class _Progress:
    """A line per trace once the plan has taken more than SAY_AFTER_S: a plan that is working says so."""

    def __init__(self, say, total: int, at_once: bool = False):
        import time

        self.say, self.total, self.done, self.at_once = say, total, 0, at_once
        self.started = time.perf_counter()

    def next(self, what: str) -> None:
        import time

        self.done += 1
        elapsed = time.perf_counter() - self.started
        if self.say is not None and (self.at_once or elapsed > SAY_AFTER_S):
            self.say(f"memory plan: {elapsed:.0f} s, tracing {what} ({self.done} of {self.total})")


def step_parts(trace, step: FakeStep, optimizer_peak, swap: int, share: float, k: int) -> dict:
    """The bytes at the larger of the forward/backward peak and the optimizer step's peak."""
    p = trace.parts
    weights = p.get("weights", 0) + p.get("buffers", 0)
    activations, temporaries = p.get("activations", 0), p.get("temporaries", 0)
    if k == 1:
        forward = {"weights": weights, "gradients": p.get("gradients", 0), "optimizer": p.get("optimizer", 0) + swap,
                   "activations": activations, "temporaries": temporaries, "inputs": p.get("inputs", 0)}
    else:
        forward = {"weights": weights, "gradients": step.trainable, "optimizer": p.get("optimizer", 0) + swap,
                   "activations": int(activations * share), "temporaries": int(temporaries * share),
                   "inputs": p.get("inputs", 0)}
    o = optimizer_peak.parts
    stepping = {"weights": o.get("weights", 0) + o.get("buffers", 0), "gradients": o.get("gradients", 0),
                "optimizer": o.get("optimizer", 0), "activations": 0,
                "temporaries": o.get("temporaries", 0) + o.get("inputs", 0) + o.get("activations", 0),
                "inputs": p.get("inputs", 0)}
    return forward if sum(forward.values()) >= sum(stepping.values()) else stepping


def _adafactor(inputs: PlanInputs):
    """Adafactor as the Trainer builds it for optim='adafactor', when the run uses an Adam: factored
    second moments, no first moment."""
    if "adam" not in inputs.optimizer_name.lower():
        return None
    try:
        from transformers.optimization import Adafactor
    except ImportError:
        return None
    lr = inputs.learning_rate

    def make(params):
        return Adafactor(params, lr=lr, scale_parameter=False, relative_step=False)

    return make


def _host(step: FakeStep, model, four_bit: bool) -> dict:
    """Host RAM on top of the process's own: at load, the model and the state dict it is loaded from;
    at save, safetensors' serialised copy of the weights and the largest optimizer tensor (torch.save
    copies one GPU tensor at a time). An adapter's checkpoint serialises the adapter only; merging it
    makes a 16-bit copy of the base in host RAM (`run.save_final(..., merged=True)` checks for it); a
    4-bit model is loaded from its 16-bit files."""
    from ..gauges.monitor import read_host
    from .adapters import base_elements, export_dtype, is_adapter_model

    reading = read_host()
    largest = max((v.numel() * v.element_size() for s in step.optimizer.state.values() for v in s.values()
                   if hasattr(v, "numel")), default=0)
    host = {"load": 2 * step.weights, "save": step.weights + largest, "process": reading.rss, "limit": reading.limit}
    if is_adapter_model(model):
        half = 2 if four_bit or step.four_bit_layers else export_dtype(model).itemsize
        host |= {"save": step.trainable + largest, "merge": base_elements(model) * half}
        if four_bit or step.four_bit_layers:
            host["load"] = host["merge"]
    return host
