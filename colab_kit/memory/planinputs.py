"""What a memory plan is made from: the model, the optimizer the run will build, the inputs' names,
types and shapes, the per-device batch and the longest sequence that will occur.

Nothing here may change the run it plans: the example batch is collated from two rows of the
training data with every random state saved and restored (a masking collator draws from them), and
no data loader is made (a sampler's first iteration would draw its seed from the global generator,
and the plan would change the data order).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from .recipes import checkpointing_requested

__all__ = ["PlanInputs", "inputs_for", "current_configuration"]

LENGTH_ROWS = 200_000  # rows read for their lengths before the rest are left out (and said so)


@dataclass
class PlanInputs:
    model: object
    trainer: object | None
    make_optimizer: object  # an optimizer to copy, or params -> optimizer
    optimizer_name: str
    batch_size: int  # per device
    seq_len: int
    template: dict  # name -> (shape with None for the batch and "seq" for the sequence, dtype)
    precision: str  # what the run has now
    checkpointing: bool
    keep_outputs: bool
    lengths_note: str
    learning_rate: float = 5e-5
    notes: list = field(default_factory=list)

    def spec(self, micro_batch: int) -> dict:
        """name -> (shape, dtype) of a micro-batch at the longest sequence."""
        return {name: (tuple(micro_batch if d is None else self.seq_len if d == "seq" else d for d in shape), dtype)
                for name, (shape, dtype) in self.template.items()}


def current_configuration(model, args) -> tuple[str, bool, str]:
    """(precision, checkpointing, optimizer name) the run has now."""
    precision = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"
    return precision, checkpointing_requested(model, args), _optim_name(args)


def _optim_name(args) -> str:
    optim = getattr(args, "optim", None) or "adamw_torch"
    return str(getattr(optim, "value", optim))


def inputs_for(model_or_trainer, training_args=None, *, optimizer=None, batch=None, lengths=None) -> PlanInputs:
    import torch

    trainer = model_or_trainer if hasattr(model_or_trainer, "args") and hasattr(model_or_trainer, "model") else None
    model = trainer.model if trainer is not None else model_or_trainer
    args = trainer.args if trainer is not None else training_args
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"plan_memory needs a transformers Trainer or a torch.nn.Module, not "
                        f"{type(model_or_trainer).__name__}")
    notes: list = []
    example = batch if batch is not None else _example_batch(trainer) if trainer is not None else None
    if example is None:
        raise ValueError("plan_memory needs to know the inputs: pass batch= (an example batch, e.g. "
                         "next(iter(train_loader))), or a Trainer with its train_dataset")
    example = {k: v for k, v in dict(example).items() if torch.is_tensor(v)}
    if not example:
        raise ValueError("the example batch has no tensors: give a dict such as {'input_ids': ..., 'labels': ...}")
    rows, example_len = _batch_and_seq(example)
    batch_size = int(args.per_device_train_batch_size) if args is not None else rows
    seq_len, lengths_note = _longest(lengths, trainer, example_len, example, notes)
    template = {name: (tuple(None if i == 0 else "seq" if (i == 1 and v.shape[1] == example_len) else d
                             for i, d in enumerate(v.shape)), v.dtype) for name, v in example.items()}
    if args is not None:
        precision, checkpointing, name = current_configuration(model, args)
        make = (trainer.optimizer if trainer is not None and trainer.optimizer is not None
                else _trainer_optimizer(args, model))
        learning_rate = float(args.learning_rate)
    else:
        precision, checkpointing = "fp32", checkpointing_requested(model)
        name = type(optimizer).__name__ if optimizer is not None else "AdamW"
        make, learning_rate = optimizer, float(optimizer.defaults.get("lr", 1e-3)) if optimizer is not None else 1e-3
    return PlanInputs(model=model, trainer=trainer, make_optimizer=make, optimizer_name=name, batch_size=batch_size,
                      seq_len=seq_len, template=template, precision=precision, checkpointing=checkpointing,
                      keep_outputs=args is None, lengths_note=lengths_note, learning_rate=learning_rate, notes=notes)


def _trainer_optimizer(args, model):
    """params -> the optimizer the Trainer would build from these arguments."""
    from transformers import Trainer

    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)

    def make(params):
        return cls(params, **kwargs)

    return make


def _batch_and_seq(example: dict) -> tuple[int, int | None]:
    first = example.get("input_ids", next(iter(example.values())))
    return int(first.shape[0]), (int(first.shape[1]) if first.dim() >= 2 else None)


def _longest(lengths, trainer, example_len, example, notes) -> tuple[int, str]:
    """The sequence length to plan for, and a line on where it came from."""
    if example_len is None:
        return 1, "inputs without a sequence dimension"
    source = lengths
    if source is None and trainer is not None and trainer.train_dataset is not None:
        source = trainer.train_dataset
    if source is None:
        return example_len, f"the example batch's length ({example_len})"
    found = _lengths_of(source, notes)
    if not found:
        return example_len, f"the example batch's length ({example_len})"
    longest = max(found)
    ordered = sorted(found)
    median, p95 = ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]
    multiple = getattr(getattr(trainer, "data_collator", None), "pad_to_multiple_of", None) or 1
    padded = -(-max(_lengths_of_rows(example)) // multiple) * multiple
    fixed = example_len > padded  # the collator pads every batch to one length
    seq = max(longest, example_len) if fixed else -(-longest // multiple) * multiple
    note = f"planned for {seq} tokens: the longest of {len(found):,} sequences (median {median}, 95 % up to {p95})"
    if multiple > 1 and not fixed:
        note += f", padded to a multiple of {multiple}"
    if fixed:
        note += f"; the collator pads every batch to {example_len}"
    return seq, note


def _lengths_of_rows(example: dict) -> list[int]:
    mask = example.get("attention_mask")
    if mask is not None and mask.dim() == 2:
        return [int(n) for n in mask.sum(dim=1)]
    ids = example.get("input_ids", next(iter(example.values())))
    return [int(ids.shape[1])] * int(ids.shape[0]) if ids.dim() >= 2 else [1]


def _lengths_of(source, notes: list) -> list[int]:
    if isinstance(source, int):
        return [source]
    if isinstance(source, (list, tuple)) and all(isinstance(n, int) for n in source):
        return list(source)
    column = None
    if hasattr(source, "column_names") and "input_ids" in source.column_names:  # a datasets.Dataset
        rows = source.select(range(min(len(source), LENGTH_ROWS))) if len(source) > LENGTH_ROWS else source
        column = rows["input_ids"]
    elif hasattr(source, "__getitem__") and hasattr(source, "__len__"):
        column = []
        for i in range(min(len(source), LENGTH_ROWS)):
            row = source[i]
            ids = row.get("input_ids") if isinstance(row, dict) else None
            if ids is None:
                return []
            column.append(ids)
    if column is None:
        raise TypeError(f"lengths={type(source).__name__}: give a list of ints or a dataset with input_ids")
    if len(source) > LENGTH_ROWS:
        notes.append(f"lengths read from the first {LENGTH_ROWS:,} of {len(source):,} rows")
    return [len(ids) for ids in column]


def _example_batch(trainer) -> dict | None:
    """Two rows of the training data through the Trainer's collator, every random state kept."""
    import numpy as np
    import torch

    dataset = trainer.train_dataset
    if dataset is None or len(dataset) == 0:
        return None
    if hasattr(trainer, "_remove_unused_columns") and hasattr(dataset, "column_names"):
        dataset = trainer._remove_unused_columns(dataset, description="training")
    states = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            rows = [dataset[i] for i in range(min(2, len(dataset)))]
            return trainer.data_collator(rows)
        finally:
            random.setstate(states[0])
            np.random.set_state(states[1])
