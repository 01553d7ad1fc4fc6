"""Will it fit? A memory plan for the user's own model, made before the first step.

    plan = ck.plan_memory(trainer)                                  # its model, arguments and data
    plan = ck.plan_memory(model, args, lengths=[412, 512], gpu="T4")
    plan = ck.plan_memory(model, optimizer=opt, batch=example_batch)

For every configuration the user could pick (the precisions the GPU has, gradient checkpointing off
and on, micro-batches that keep the effective batch, the optimizer in use and Adafactor), the plan
gives the peak GPU memory of one steady training step split into weights, gradients, optimizer
state, activations and temporaries, inputs and the runtime's fixed costs; whether it fits with a
margin; a relative cost per optimizer step; and the one to use.

How it predicts (stated, since a user decides on it): `steptrace.FakeStep` traces one step of the
user's own model on fake tensors for each precision and checkpointing setting, at the whole
per-device batch and the longest sequence that will occur, and the optimizer step once. A model of
repeated blocks is traced as copies with 2 and 3 of them, and its full depth derived moment by moment
(`depth.py`): seconds, not minutes, for a 1.5 B model on 2 cores, the same bytes where the blocks are alike. A smaller
micro-batch holds the same weights, optimizer state and whole gradients (they accumulate) and the
activations, temporaries and inputs at the traced peak scaled by its share of the batch. What a GPU
holds outside the trace is added: the CUDA context (outside PyTorch's allocator) and cuBLAS's
workspace. The cost is the traced FLOPs (recomputation included) at the GPU's rate for the
precision plus a kernel launch per operation per micro-batch: a ranking, not a stopwatch.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

from .._units import format_bytes
from .gpus import GpuTarget, resolve_target
from .planinputs import PlanInputs, inputs_for
from .planrows import PlanRow, make_rows
from .recipes import checkpointing_arg

__all__ = ["PlanRow", "MemoryPlan", "plan_memory", "planned_micro_batch", "plan_for"]

_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@dataclass
class MemoryPlan:
    """What `plan_memory` found. `chosen` is the configuration to use (None when none fits)."""

    model: str
    gpu: GpuTarget
    gpu_note: str
    batch: int
    seq_len: int
    lengths_note: str
    margin: float
    rows: list = field(default_factory=list)
    host: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    seconds: float = 0.0

    @property
    def budget(self) -> int:
        """Bytes a configuration may use: the GPU's capacity less the margin."""
        return int(self.gpu.capacity * (1 - self.margin))

    @property
    def chosen(self) -> PlanRow | None:
        fitting = [r for r in self.rows if r.fits]
        if not fitting:
            return None
        return min(fitting, key=lambda r: (round(r.cost, 2), not r.current, r.micro_batches))

    @property
    def micro_batch(self) -> int | None:
        """The chosen configuration's micro-batch (None when none fits)."""
        return self.chosen.micro_batch if self.chosen else None

    def best_rows(self) -> list[PlanRow]:
        """Per precision, checkpointing and optimizer: the largest micro-batch that fits (else the smallest)."""
        groups: dict = {}
        for row in self.rows:
            groups.setdefault((row.precision, row.checkpointing, row.optimizer), []).append(row)
        best = []
        for rows in groups.values():
            fitting = [r for r in rows if r.fits]
            best.append(max(fitting, key=lambda r: r.micro_batch) if fitting else min(rows, key=lambda r: r.peak))
        return best

    def for_configuration(self, precision: str, checkpointing: bool, optimizer: str | None = None) -> PlanRow | None:
        """The largest fitting micro-batch in one configuration (None when none fits)."""
        rows = [r for r in self.rows if r.precision == precision and r.checkpointing == checkpointing and r.fits
                and (optimizer is None or r.optimizer == optimizer)]
        return max(rows, key=lambda r: r.micro_batch) if rows else None

    def advice(self) -> str:
        row = self.chosen
        if row is None:
            smallest = min(self.rows, key=lambda r: r.peak)
            return (f"nothing fits on the {self.gpu.name}: the smallest configuration ({smallest.describe()}) needs "
                    f"{format_bytes(smallest.peak)} of {format_bytes(self.budget)}. Shorten the sequences "
                    f"(max_length), freeze the lower layers (plan_memory(..., freeze=N)), or take a smaller model")
        current = next((r for r in self.rows if r.current), None)
        if current is not None and row.precision == current.precision and row.checkpointing == current.checkpointing \
                and row.optimizer == current.optimizer:
            if row.micro_batches == 1:
                return "use the run as it is: the whole batch fits"
            return (f"use micro-batches of {row.micro_batch}: run.train(trainer) starts there (the effective batch, "
                    f"the schedule and the data order stay as they are)")
        changes = []
        if current is None or row.precision != current.precision:
            changes.append(f"{row.precision}=True" if row.precision != "fp32" else "no fp16/bf16")
        if current is None or row.checkpointing != current.checkpointing:
            changes.append(f"{checkpointing_arg()}={row.checkpointing}")
        if current is None or row.optimizer != current.optimizer:
            changes.append(f"optim='{row.optimizer}'")
        tail = "" if row.micro_batches == 1 else f"; run.train then starts at micro-batches of {row.micro_batch}"
        return f"use {row.describe()}: TrainingArguments({', '.join(changes)}){tail}"

    def __str__(self) -> str:
        from .planview import plan_table

        return plan_table(self)

    def show(self):
        """The plan as a table and a bar per configuration (matplotlib); returns the figure."""
        from .planview import plan_figure

        print(self)
        return plan_figure(self)


def plan_memory(model_or_trainer, training_args=None, *, optimizer=None, batch=None, gpu="auto", lengths=None,
                margin: float = 0.10, freeze: int | None = None, four_bit: bool = False,
                verbose: bool = True, full_depth: bool = False) -> MemoryPlan:
    """A memory plan for one training step of this model on a GPU, made on fake tensors (nothing is
    allocated, nothing downloaded; seconds on a CPU).

    Args:
        model_or_trainer: a `transformers.Trainer` (its model, arguments, optimizer choice and training
            data), or a `torch.nn.Module`.
        training_args: the `TrainingArguments` for a model (batch size, precision, checkpointing, optim).
        optimizer: the optimizer of a plain loop (its class and settings are copied); AdamW otherwise.
        batch: an example batch (a dict of tensors, batch first) when there are no training arguments,
            or to give the inputs' names and types; its first dimension is the batch size.
        gpu: "T4", "L4", "A100-40GB", "auto" (the GPU attached; a T4 when there is none) or bytes.
        lengths: the sequence lengths that will occur (ints), or a dataset with `input_ids`; the plan
            is made for the longest. Default: the Trainer's training data, else the example batch.
        margin: the share of the GPU's capacity kept free (fragmentation, other tensors).
        freeze: also plan with the lowest `freeze` blocks frozen (`ck.recipes.freeze_layers`).
        four_bit: plan the model as QLoRA loads it, before loading it so (a model built on the `meta` device
            will do): its linear layers but the head in 4 bits (NF4, double quantization, computing in bf16
            where the GPU has it, else fp16), the other weights upcast to float32 by peft's
            `prepare_model_for_kbit_training`. A model already loaded in 4 bits is planned as it is.
        verbose: print the plan (and, when it takes more than two seconds, a line per configuration traced).
        full_depth: trace every block of the model. By default a model of repeated blocks is traced as copies
            with 2 and 3 of them and the full depth derived, the same bytes where its blocks are alike
            (`depth.py`; the plan's notes say which was done).
    """
    import time

    if not 0 <= margin < 0.5:
        raise ValueError(f"margin={margin}: give a share of the GPU's capacity between 0 and 0.5 (0.1 is 10 %)")
    started = time.perf_counter()
    target, gpu_note = resolve_target(gpu)
    inputs: PlanInputs = inputs_for(model_or_trainer, training_args, optimizer=optimizer, batch=batch,
                                    lengths=lengths)
    plan = MemoryPlan(model=type(inputs.model).__name__, gpu=target, gpu_note=gpu_note, batch=inputs.batch_size,
                      seq_len=inputs.seq_len, lengths_note=inputs.lengths_note, margin=margin,
                      notes=list(inputs.notes))
    say = (lambda line: print(line, flush=True)) if verbose else None
    plan.rows, plan.host = make_rows(inputs, target, plan.budget, freeze=freeze, four_bit=four_bit,
                                     full_depth=full_depth, say=say)
    plan.notes = list(inputs.notes)  # with what planning found
    plan.seconds = time.perf_counter() - started
    _PLANS[inputs.model] = plan  # for preflight's verdicts
    if inputs.trainer is not None:
        _PLANS[inputs.trainer] = plan  # for run.train's first micro-batch
    if verbose:
        print(plan)
    return plan


def planned_micro_batch(trainer) -> tuple[int | None, str]:
    """The micro-batch a plan made for this trainer gives its current configuration, and why (None:
    no plan, or the whole batch fits, or nothing fits)."""
    from .planinputs import current_configuration

    plan = _PLANS.get(trainer)
    if plan is None:
        return None, ""
    precision, checkpointing, optimizer = current_configuration(trainer.model, trainer.args)
    row = plan.for_configuration(precision, checkpointing, optimizer)
    if row is None:
        return None, f"the memory plan found no micro-batch that fits {precision} on the {plan.gpu.name}"
    if row.micro_batches == 1:
        return None, ""
    return row.micro_batch, (f"the memory plan's micro-batch for {precision} on the {plan.gpu.name} "
                             f"({format_bytes(row.peak)} of {format_bytes(plan.budget)})")


def plan_for(model_or_trainer) -> MemoryPlan | None:
    """The last plan made for this model or trainer in this kernel (None when none was made)."""
    try:
        return _PLANS.get(model_or_trainer)
    except TypeError:  # not weak-referenceable
        return None
