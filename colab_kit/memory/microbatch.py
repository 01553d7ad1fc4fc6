"""The HF Trainer's optimizer steps as adaptive micro-batches (used by `run.train`).

`run.train` gives the Trainer the whole effective batch (per_device_train_batch_size x
gradient_accumulation_steps) as one batch, with accumulation 1: the same samples, in the same
order, make up each optimizer step, and the step count and schedule are unchanged. The
Trainer's `training_step` is then replaced, on this trainer instance only, by one that runs
that batch as micro-batches of a learned size (`oom.MicroBatcher`), each loss weighted by its
share of the label items, halving on OOM. Evaluation gets its own micro-batch the same way.

The working size is kept in `<drive_dir>/micro_batch.json`, keyed by GPU name, model
fingerprint and sequence length, so a resumed run starts with it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from pathlib import Path

from .._units import format_bytes
from ..checkpoints import storage
from ..distributed import ranks
from .oom import ELSEWHERE, MicroBatcher, batch_size, describe_memory, memory_numbers
from .recipes import checkpointing_requested

__all__ = ["MICRO_BATCH_FILE", "MicroBatchMemory", "TrainerMicroBatching"]

MICRO_BATCH_FILE = "micro_batch.json"
log = logging.getLogger(__name__)


class MicroBatchMemory:
    """The micro-batch that worked, per (GPU, model fingerprint, sequence length), in a JSON file.

    Args:
        write: how the file is written; `run.train` hands it to the mirror's thread
            (`Mirror.write_later`), so that a back-off never waits for Drive. Default: at once.
    """

    def __init__(self, path: str | Path, notices=None, write=None):
        self.path = Path(path)
        self.notices = notices
        self._write = write
        try:
            self.entries = list(json.loads(storage.read_bytes(self.path)).get("entries", []))
        except (OSError, ValueError, AttributeError):
            self.entries = []

    def lookup(self, gpu: str, model: str, seq_len: int) -> int | None:
        """The size learned for the tightest recorded length >= `seq_len`; for a longer sequence
        than any recorded, the smallest size known for this GPU and model."""
        mine = [e for e in self.entries if e["gpu"] == gpu and e["model"] == model]
        if not mine:
            return None
        longer = [e for e in mine if e["max_seq_len"] >= seq_len]
        if longer:
            return min(longer, key=lambda e: (e["max_seq_len"], e["micro_batch"]))["micro_batch"]
        return min(e["micro_batch"] for e in mine)

    def record(self, gpu: str, model: str, seq_len: int, micro: int) -> None:
        self.entries = [e for e in self.entries
                        if (e["gpu"], e["model"], e["max_seq_len"]) != (gpu, model, seq_len)]
        self.entries.append({"gpu": gpu, "model": model, "max_seq_len": int(seq_len),
                             "micro_batch": int(micro), "time": time.time()})
        document = {"entries": list(self.entries)}
        if self._write is not None:
            self._write(self.path, document)
            return
        try:
            storage.atomic_write_json(self.path, document)
        except OSError as exc:  # kept in memory for this session; Drive trouble is reported elsewhere
            if self.notices is not None:
                self.notices.add(f"could not save the learned micro-batch to {self.path}: {exc}")


def _seq_len(batch) -> int:
    if isinstance(batch, Mapping):
        for key in ("input_ids", "inputs_embeds", "attention_mask"):
            value = batch.get(key)
            if hasattr(value, "ndim") and value.ndim >= 2:
                return int(value.shape[1])
    return 0


def _concat(parts: list):
    import torch

    first = parts[0]
    if first is None:
        return None
    if isinstance(first, torch.Tensor):
        return torch.cat(parts, dim=0) if first.ndim > 0 else torch.stack(parts)
    if isinstance(first, Mapping):
        return type(first)({k: _concat([p[k] for p in parts]) for k in first})
    if isinstance(first, (list, tuple)):
        return type(first)(_concat(list(group)) for group in zip(*parts))
    return first


class TrainerMicroBatching:
    """Installs adaptive micro-batching on one Trainer for the duration of `run.train`."""

    def __init__(self, run, trainer, *, grow_back_after: int | None = None, micro_batch: int | None = None):
        self.run = run
        self.trainer = trainer
        self.memory = MicroBatchMemory(run.drive_dir / MICRO_BATCH_FILE, run.notices, write=run.mirror.write_later)
        self.train = MicroBatcher(micro_batch, on_backoff=lambda r: self._on_backoff(r, training=True),
                                  grow_back_after=grow_back_after, diagnose=self._diagnosis)
        self.eval = MicroBatcher(on_backoff=lambda r: self._on_backoff(r, training=False), diagnose=self._diagnosis)
        self.after_step = False  # True between a training step and the next: the optimizer's turn
        self._saved: dict | None = None
        self._gpu = run.runtime.gpu.name if run.runtime.gpu else "cpu"
        self._shifts = self._loss_shifts_labels(trainer)

    # -- install / uninstall -------------------------------------------------------------------
    def why_not(self) -> str | None:
        """Why micro-batching cannot be installed on this trainer (None when it can)."""
        from transformers import Trainer

        t = self.trainer
        if type(t).training_step is not Trainer.training_step:
            return "this Trainer subclass overrides training_step"
        if getattr(t, "is_deepspeed_enabled", False) or getattr(t, "is_fsdp_enabled", False):
            return "DeepSpeed/FSDP manage their own micro-batches"
        if str(getattr(t.args, "optim", "")).lower() in ("lomo", "adalomo"):
            return "LOMO optimizers fuse the backward pass with the update"
        return None

    def install(self) -> bool:
        reason = self.why_not()
        if reason is not None:
            self.run.notices.add(f"out-of-memory recovery is off: {reason}")
            return False
        t, args = self.trainer, self.trainer.args
        self._saved = {"per_device": args.per_device_train_batch_size, "accum": args.gradient_accumulation_steps,
                       "train_batch": t._train_batch_size, "auto_find": args.auto_find_batch_size}
        if args.auto_find_batch_size:
            self.run.notices.add("auto_find_batch_size is turned off: the kit keeps the effective batch "
                                 "and splits it on out-of-memory instead")
            args.auto_find_batch_size = False
        args.per_device_train_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps
        args.gradient_accumulation_steps = 1
        t._train_batch_size = args.train_batch_size
        t.training_step = self.training_step
        self._prediction_step = t.prediction_step  # bound: a subclass's own prediction_step is kept
        t.prediction_step = self.prediction_step
        return True

    def uninstall(self) -> None:
        if self._saved is None:
            return
        t, args = self.trainer, self.trainer.args
        args.per_device_train_batch_size = self._saved["per_device"]
        args.gradient_accumulation_steps = self._saved["accum"]
        args.auto_find_batch_size = self._saved["auto_find"]
        t._train_batch_size = self._saved["train_batch"]
        for name in ("training_step", "prediction_step"):
            t.__dict__.pop(name, None)
        self._saved = None

    # -- training ------------------------------------------------------------------------------
    @staticmethod
    def _loss_shifts_labels(trainer) -> bool:
        """Does the model's loss predict label[i+1] from position i (causal LM)?

        Decided from the model: the Trainer's own `_loss_shifts_labels` reads `config.loss_type`,
        which is None for a model built from a config, and then says False for GPT-2.
        """
        model = trainer.accelerator.unwrap_model(trainer.model)
        if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
            return False
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if type(model).__name__ in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
            return True
        return bool(getattr(trainer, "_loss_shifts_labels", False))

    def _items(self, chunk) -> int:
        """Label items a micro-batch's mean loss is averaged over (samples when unknown)."""
        if isinstance(chunk, Mapping):
            if "shift_labels" in chunk:
                return int(chunk["shift_labels"].ne(-100).sum())
            labels = chunk.get("labels")
            if labels is not None and hasattr(labels, "ne"):
                if self._shifts and labels.ndim >= 2:
                    labels = labels[..., 1:]
                return int(labels.ne(-100).sum())
        return batch_size(chunk)

    def _remembered(self, batcher: MicroBatcher, inputs) -> None:
        learned = self.memory.lookup(self._gpu, self.run.fingerprint["model"], _seq_len(inputs))
        if learned is not None and (batcher.micro_batch is None or learned < batcher.micro_batch):
            batcher.micro_batch = learned

    def training_step(self, model, inputs, num_items_in_batch=None):
        t = self.trainer
        self.after_step = False
        model.train()
        # Under DDP the micro-batches run through the wrapped module: its forward and backward then
        # run no collective, so a rank that runs out of memory half-way leaves no other rank
        # waiting in one. The ranks agree on the outcome, then the gradients are averaged once.
        inner = ranks.unwrap_ddp(model)
        net = inner if inner is not None else model
        if hasattr(t.optimizer, "train") and callable(t.optimizer.train):
            t.optimizer.train()
        custom_loss = t.compute_loss_func is not None

        def forward(chunk):
            chunk = t._prepare_inputs(chunk)
            with t.compute_loss_context_manager():
                if custom_loss:  # the user's loss normalises by the whole batch's item count
                    loss = t.compute_loss(net, chunk, num_items_in_batch=num_items_in_batch)
                else:  # the model's own mean over this micro-batch, weighted below
                    loss = t.compute_loss(net, chunk)
            return loss.mean() if t.args.n_gpu > 1 else loss

        self._remembered(self.train, inputs)
        self._seq = _seq_len(inputs)
        loss = self.train.step(inputs, forward, zero_grad=lambda: model.zero_grad(set_to_none=True),
                               backward=t.accelerator.backward,
                               weight=(lambda c: 1.0) if custom_loss else self._items,
                               context={"step": t.state.global_step + 1})
        if inner is not None:
            ranks.reduce_gradients(inner)
        self.after_step = True
        return loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self.after_step = False
        self._seq = _seq_len(inputs)
        chunks, outputs = self.eval.map(
            inputs, lambda c: self._prediction_step(model, c, prediction_loss_only, ignore_keys=ignore_keys),
            context={"step": self.trainer.state.global_step})
        if len(outputs) == 1:
            return outputs[0]
        losses = [o[0] for o in outputs]
        loss = None
        if losses[0] is not None:  # the model's per-micro-batch means, weighted by their items
            weights = [self._items(c) for c in chunks]
            total = sum(weights) or len(weights)
            loss = sum(l * (w / total) for l, w in zip(losses, weights))
        return loss, _concat([o[1] for o in outputs]), _concat([o[2] for o in outputs])

    # -- reporting -------------------------------------------------------------------------------
    def _on_backoff(self, report: dict, *, training: bool) -> None:
        if not self.run.ranks.writer:  # every rank backs off alike; rank 0 says so and records it
            return
        where, old, new = report["where"], report["from"], report["to"]
        if training:
            self.memory.record(self._gpu, self.run.fingerprint["model"], self._seq, new)
        world = self.run.ranks.world_size
        what = f"the effective batch of {report['batch'] * world}" if training else \
            f"the evaluation batch of {report['batch']}"
        if world > 1:
            what += f" ({report['batch']} per process x {world} processes)"
        on = f" on rank {', '.join(map(str, report['ranks']))}" if report.get("ranks") else ""
        place = f" in {where}" if where != ELSEWHERE else ""
        print(f"colab_kit: out of memory{on}{place} at step {report.get('step')}: micro-batch {old} -> {new} "
              f"({what} is kept; {describe_memory(report)})", flush=True)
        self.run.journal.write("oom", step=report.get("step"), where=where, micro_from=old, micro_to=new,
                               batch=report["batch"], seq_len=self._seq, error=report["error"],
                               ranks=report.get("ranks"),
                               **{k: report[k] for k in ("gpu_used", "gpu_total", "reserved", "allocated")
                                  if k in report})

    def _diagnosis(self) -> str:
        t, args = self.trainer, self.trainer.args
        params = sum(p.numel() for p in t.model.parameters())
        trainable = sum(p.numel() for p in t.model.parameters() if p.requires_grad)
        precision = "bf16 autocast" if args.bf16 else "fp16 autocast" if args.fp16 else "fp32"
        gc_on = checkpointing_requested(t.accelerator.unwrap_model(t.model), args)
        lines = [f"Model: {params:,} parameters ({format_bytes(params * 4)} of fp32 weights; AdamW's training "
                 f"state adds about 12 bytes per trainable parameter: {format_bytes(trainable * 12)}). "
                 f"Sequence length {self._seq or 'n/a'}, {precision}, gradient checkpointing "
                 f"{'on' if gc_on else 'off'}. Next steps:"]
        if precision == "fp32":
            gpu = self.run.runtime.gpu
            flag = "bf16=True" if gpu is not None and gpu.bf16 else "fp16=True"
            lines.append(f"- TrainingArguments({flag}) for mixed precision;")
        if not gc_on:
            lines.append("- TrainingArguments(gradient_checkpointing=True): drops most activations for "
                         "about 20-30 % more time;")
        if self._seq:
            lines.append(f"- a shorter max_length than {self._seq} when tokenizing;")
        lines.append("- a smaller model, or freezing the lowest layers.")
        return "\n".join(lines)

    def optimizer_oom_message(self) -> str:
        params = sum(p.numel() for p in self.trainer.model.parameters() if p.requires_grad)
        return (f"out of memory in the optimizer step (after the forward and backward passes had fit): "
                f"the optimizer state does not fit. AdamW keeps 8 bytes per trainable parameter "
                f"({format_bytes(params * 8)} for {params:,}); this is not retried with smaller "
                f"micro-batches because they would not help. Try TrainingArguments(optim='adafactor') "
                f"or optim='adamw_bnb_8bit' (needs bitsandbytes), freeze layers, or use a smaller model. "
                f"{describe_memory(memory_numbers())}")

    def summary(self) -> str | None:
        events = self.train.backoffs + self.eval.backoffs
        if not events:
            return None
        parts = []
        if self.train.backoffs:
            parts.append(f"training micro-batch {self.train.backoffs[0]['from']} -> {self.train.micro_batch}")
        if self.eval.backoffs:
            parts.append(f"evaluation micro-batch {self.eval.backoffs[0]['from']} -> {self.eval.micro_batch}")
        effective = self.run.fingerprint.get("effective_batch") if self.run.fingerprint else None
        return (f"{len(events)} out-of-memory back-off(s): " + ", ".join(parts)
                + (f"; the effective batch stayed {effective}" if effective else ""))
