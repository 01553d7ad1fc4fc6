"""Changed settings on resume, said as they will act: the Trainer's behaviour is the reference.

When the Trainer resumes, it loads the optimizer's and the scheduler's state from the checkpoint: the
base learning rate (and weight decay) of the checkpoint win over the new `TrainingArguments`, while the
schedule's shape (total steps, warmup, type) is built from the new arguments and applied to that base
rate. So "learning_rate 0.002 -> 0.001" changes nothing, and "max_steps 60 -> 120" can make the rate
jump back up at the resumed step. The kit does not override the Trainer here; it says which values win,
the rate before and after the resume, and how to get the new rate (a fresh start).
"""

from __future__ import annotations

from pathlib import Path

from ..drive.drivefs import HUB
from ..lifecycle.fresh import fresh_start_advice

__all__ = ["describe_changes", "SCHEDULE_SHAPE"]

SCHEDULE_SHAPE = ("max_steps", "num_train_epochs", "warmup_steps", "lr_scheduler_type")
SCHEDULER_FILE = "scheduler.pt"


def describe_changes(run, saved: dict, now: dict, args, total_steps: int | None) -> list[str]:
    """Sentences for the changed, compatible settings of a resume (empty: nothing changed)."""
    changed = [key for key, value in now.items() if key in saved and saved[key] != value and key != "parameters"]
    if not changed:
        return []
    step = run.resume_manifest.step
    sentences = []
    if "learning_rate" in changed:
        old, new = saved["learning_rate"], now["learning_rate"]
        sentences.append(
            f"learning_rate {old} -> {new} is not applied: the optimizer and the schedule restored from "
            f"checkpoint-{step} keep the base rate {old}, as the Trainer does when it resumes. To train at {new}, "
            + fresh_start_advice(run.name, run.drive_dir, on_hub=run.durability == HUB)
            + f"; to continue this run as it was, set learning_rate={old} again")
    shape = [key for key in changed if key in SCHEDULE_SHAPE]
    if shape:
        what = ", ".join(f"{key} {saved[key]} -> {now[key]}" for key in shape)
        before = _rate_saved(run.resume_from)
        after = _rate_rebuilt(args, saved.get("learning_rate", args.learning_rate), total_steps, step)
        rates = (f": at step {step} the rate goes from {before:.2e} to {after:.2e}"
                 + (", up again" if after > 1.01 * before else "")) if before is not None and after is not None else ""
        sentences.append(f"{what}: the schedule is rebuilt from these on the restored base rate{rates}")
    rest = [key for key in changed if key != "learning_rate" and key not in SCHEDULE_SHAPE]
    if rest:
        sentences.append("resuming with changed settings: " + ", ".join(f"{k} {saved[k]} -> {now[k]}" for k in rest))
    return sentences


def _rate_saved(checkpoint: Path | None) -> float | None:
    """The learning rate the checkpoint's scheduler had reached (its own record), or None."""
    import torch

    try:
        state = torch.load(Path(checkpoint) / SCHEDULER_FILE, map_location="cpu", weights_only=True)
        return float(state["_last_lr"][0])
    except Exception:  # noqa: BLE001 - no scheduler saved, or one of another kind: say less, not wrong
        return None


def _rate_rebuilt(args, base_rate: float, total_steps: int | None, step: int) -> float | None:
    """The rate at `step` of the schedule the Trainer builds from `args`, on the checkpoint's base rate."""
    import torch
    from transformers import get_scheduler

    if not total_steps:
        return None
    try:
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=base_rate)
        scheduler = get_scheduler(args.lr_scheduler_type, optimizer,
                                  num_warmup_steps=args.get_warmup_steps(total_steps),
                                  num_training_steps=total_steps,
                                  scheduler_specific_kwargs=getattr(args, "lr_scheduler_kwargs", None) or {})
        return base_rate * scheduler.lr_lambdas[0](step)
    except Exception:  # noqa: BLE001 - a scheduler without a rate function (reduce_lr_on_plateau): say less
        return None
