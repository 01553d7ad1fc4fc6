"""The HF Trainer's optimizer steps as adaptive micro-batches (used by `run.train`).

`run.train` gives the Trainer the whole effective batch (per_device_train_batch_size x
gradient_accumulation_steps) as one batch, with accumulation 1: the same samples, in the same
order, make up each optimizer step, and the step count and schedule are unchanged. The
Trainer's `training_step` is then replaced, on this trainer instance only, by one that runs
that batch as micro-batches of a learned size (`splitstep.MicroBatcher`), halving on OOM. Each
micro-batch's loss is weighted so that the step's loss, gradients and clipping equal the Trainer's
unsplit step in every way the Trainer normalises a loss (`_normalisation`). Evaluation gets its
own micro-batch the same way; a micro-batch without label items never turns its mean into NaN.

The working size is kept in `<drive_dir>/micro_batch.json`, keyed by GPU name, model
fingerprint and sequence length, so a resumed run starts with it.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Mapping

from .._units import format_bytes
from ..distributed.agreement import agree_outcome
from ..distributed.gradients import reduce_gradients, unwrap_ddp
from .learned import MICRO_BATCH_FILE, MicroBatchMemory
from .oom import ELSEWHERE, batch_size, describe_memory, memory_numbers
from .splitstep import MicroBatcher
from .recipes import checkpointing_arg, checkpointing_requested

__all__ = ["MICRO_BATCH_FILE", "MicroBatchMemory", "TrainerMicroBatching"]

log = logging.getLogger(__name__)


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


def _own_mean(smoother) -> bool:
    """A label smoother that averages over its own items whatever the Trainer's N (transformers < 5)."""
    if smoother is None:
        return False
    return "num_items_in_batch" not in inspect.signature(type(smoother).__call__).parameters


def _weighted_loss(losses: list, items: list[int]):
    """The batch's mean loss from its micro-batches' means: weighted by their label items. A
    micro-batch without any (all -100) has a NaN mean and no weight: it is left out, since NaN x 0
    is still NaN. Without label items anywhere, every micro-batch counts alike."""
    if losses[0] is None:
        return None
    if sum(items) <= 0:
        items = [1] * len(losses)
    total = sum(items)
    return sum(loss * (n / total) for loss, n in zip(losses, items) if n > 0)


class TrainerMicroBatching:
    """Installs adaptive micro-batching on one Trainer for the duration of `run.train`."""

    def __init__(self, run, trainer, *, grow_back_after: int | None = None, micro_batch: int | None = None,
                 planned: bool = False):
        self.run = run
        self._planned = planned  # micro_batch came from a memory plan: a learned size replaces it
        self.trainer = trainer
        self.memory = MicroBatchMemory(run.drive_dir / MICRO_BATCH_FILE, run.notices, write=run.mirror.write_later)
        self.train = MicroBatcher(micro_batch, on_backoff=lambda r: self._on_backoff(r, training=True),
                                  grow_back_after=grow_back_after, diagnose=self._diagnosis)
        self.eval = MicroBatcher(on_backoff=lambda r: self._on_backoff(r, training=False), diagnose=self._diagnosis)
        self.after_step = False  # True between a training step and the next: the optimizer's turn
        self._saved: dict | None = None
        self._gpu = run.runtime.gpu.name if run.runtime.gpu else "cpu"
        self._shifts = self._loss_shifts_labels(trainer)
        self._smoother_own_mean = _own_mean(getattr(trainer, "label_smoother", None))  # once, not every step

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
        self._guarded = None
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
        if self._guarded is not None:  # the optimizer's own step again (or the wrapper it had)
            opt, before = self._guarded
            if before is None:
                vars(opt).pop("step", None)
            else:
                opt.step = before
            self._guarded = None
        self._saved = None

    # -- training ------------------------------------------------------------------------------
    @staticmethod
    def _loss_shifts_labels(trainer) -> bool:
        """Does the model's loss predict label[i+1] from position i (causal LM)?

        Decided from the model: the Trainer's own `_loss_shifts_labels` reads `config.loss_type`,
        which is None for a model built from a config, and then says False for GPT-2.
        """
        model = trainer.accelerator.unwrap_model(trainer.model)
        if callable(getattr(model, "get_base_model", None)):  # a peft adapter: the loss is its base model's
            model = model.get_base_model()
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
        if learned is None:
            return
        if batcher.micro_batch is None or learned < batcher.micro_batch or (batcher is self.train and self._planned):
            batcher.micro_batch = learned  # what this GPU showed outranks a prediction
        if batcher is self.train:
            self._planned = False

    def training_step(self, model, inputs, num_items_in_batch=None):
        t = self.trainer
        self.after_step = False
        model.train()
        # Under DDP the micro-batches run through the wrapped module: its forward and backward then
        # run no collective, so a rank that runs out of memory half-way leaves no other rank
        # waiting in one. The ranks agree on the outcome, then the gradients are averaged once.
        inner = unwrap_ddp(model)
        net = inner if inner is not None else model
        if hasattr(t.optimizer, "train") and callable(t.optimizer.train):
            t.optimizer.train()
        self._guard_optimizer()
        items, weight, total = self._normalisation(num_items_in_batch)

        def forward(chunk):
            chunk = t._prepare_inputs(chunk)
            with t.compute_loss_context_manager():
                loss = t.compute_loss(net, chunk, num_items_in_batch=items) if items is not None else \
                    t.compute_loss(net, chunk)
            return loss.mean() if t.args.n_gpu > 1 else loss

        self._remembered(self.train, inputs)
        self._seq = _seq_len(inputs)
        loss = self.train.step(inputs, forward, zero_grad=lambda: model.zero_grad(set_to_none=True),
                               backward=t.accelerator.backward, weight=weight, total=total,
                               context={"step": t.state.global_step + 1})
        if inner is not None:
            reduce_gradients(inner, bucket_bytes=getattr(model, "bucket_bytes_cap", None))
        self.after_step = True
        return loss

    def _normalisation(self, num_items_in_batch):
        """How each micro-batch's loss is weighted so that the step equals the Trainer's unsplit one.

        Returns (what to pass as num_items_in_batch, MicroBatcher weight, its total). The Trainer
        hands a loss the whole batch's item count N when the model accepts loss kwargs or a
        `compute_loss_func` is set, and then counts the loss as already normalised:
        - `compute_loss_func` (or `loss_is_scaled_for_ga=True`): the user's loss divides by N, so
          each micro-batch gets N too and the shares are added ("sum");
        - the model's own loss and label smoothing: some models divide by N, others ignore it (BERT's
          classification and masked-LM heads), so no micro-batch gets N: each returns its own mean,
          weighted by its label items over N. That is the Trainer's number when the model divides by N,
          and the true mean when it does not. With `average_tokens_across_devices` N counts every
          process's items and the Trainer multiplies the loss by the number of processes: so does
          the kit (N / processes as the total);
        - without N, or a label smoother that does not take it (transformers < 5): items over the
          batch's own items.
        """
        t = self.trainer
        declared = getattr(t, "loss_is_scaled_for_ga", None)
        if num_items_in_batch is not None and (declared or (declared is None and t.compute_loss_func is not None)):
            return num_items_in_batch, "sum", None
        if t.compute_loss_func is not None:  # declared a per-batch mean: the Trainer still passes N
            return num_items_in_batch, self._items, None
        if num_items_in_batch is None or t.args.n_gpu > 1 or self._smoother_own_mean:
            return None, self._items, None
        total = float(num_items_in_batch)
        if getattr(t.args, "average_tokens_across_devices", False) and t.model_accepts_loss_kwargs:
            total /= t.accelerator.num_processes  # the Trainer's loss x processes, for a global N
        return None, self._items, total

    def _guard_optimizer(self) -> None:
        """Make the optimizer step part of the step the ranks agree on: an error in it on one rank
        stops every rank at once (`agreement.agree_outcome`), instead of leaving the others waiting in
        the next step's collectives until the process group times out."""
        opt = self.trainer.optimizer
        if opt is None or getattr(opt.step, "colab_kit_guard", False):
            return
        step = opt.step  # may be an instance attribute already: torch's LR scheduler wraps step too

        @functools.wraps(step)  # keeps the LR scheduler's mark on it (else torch warns of an overridden step)
        def guarded_step(*args, **kwargs):
            error = result = None
            try:
                result = step(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - every rank raises just below
                error = exc
            agree_outcome(error, "optimizer step", step=self.trainer.state.global_step + 1)
            return result

        guarded_step.colab_kit_guard = True
        self._guarded = (opt, vars(opt).get("step"))
        opt.step = guarded_step

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        self.after_step = False
        self._seq = _seq_len(inputs)
        chunks, outputs = self.eval.map(
            inputs, lambda c: self._prediction_step(model, c, prediction_loss_only, ignore_keys=ignore_keys),
            context={"step": self.trainer.state.global_step})
        if len(outputs) == 1:
            return outputs[0]
        return _weighted_loss([o[0] for o in outputs], [self._items(c) for c in chunks]), \
            _concat([o[1] for o in outputs]), _concat([o[2] for o in outputs])

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
            lines.append(f"- TrainingArguments({checkpointing_arg()}=True): drops most activations for "
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
