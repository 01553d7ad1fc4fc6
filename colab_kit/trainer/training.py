"""`run.train`: the HF Trainer with the kit's callbacks, checks, out-of-memory recovery and finish.

Before training: the kit's callbacks are added (no duplicates), the checkpoint to resume from is
checked against this model and these arguments, and the arguments are adjusted where the kit
needs it. During: adaptive micro-batches (`microbatch.py`). After, also on failure: `run.finish()`.
"""

from __future__ import annotations

import math
from pathlib import Path

from .._notices import no_shard_bars
from .._units import is_count
from ..distributed.resume import agree_resume
from ..drive.drivefs import HUB
from ..errors import ColabKitError, ResumeMismatchError
from ..memory.recipes import make_length_grouping_resumable
from ..runtime import library_versions
from ..lifecycle.best import TRAINER_STATE, early_stopped, restore_best
from .callbacks import bind
from .changes import describe_changes
from ..lifecycle.drift import note_failure
from .disk import explain_disk_full
from ..lifecycle.fresh import fresh_start_advice, resume_argument, start_over
from .savesettings import check_save_settings, keep_asked_saves
from .stop import StopButton, keep_open_after_stop
from .timelimit import end_at_limit

__all__ = ["train", "trainer_fingerprint", "check_compatible", "adjust_args", "planned_max_steps"]

# Fingerprint fields that make a checkpoint unusable; the others only earn a warning.
INCOMPATIBLE = {"model": "model tensor names/shapes", "effective_batch": "effective batch size",
                "world_size": "number of processes (each has its own data shard and RNG state)"}


def train(run, trainer, *, oom_recovery: bool = True, grow_back_after: int | None = None,
          micro_batch: int | None = None, **train_kwargs):
    """The body of `Run.train` (see its docstring)."""
    from ..memory.microbatch import TrainerMicroBatching
    from ..memory.oom import OutOfMemoryError, is_fatal_cuda_error, is_oom_error
    from ..memory.plan import planned_micro_batch
    from ..lifecycle.finish import close_unheld_runs, finish_run

    # Refused before anything changes: the run stays open for a corrected call.
    if micro_batch is not None and not is_count(micro_batch):
        raise ValueError(f"micro_batch={micro_batch!r}: give a whole number of rows >= 1, or None "
                         f"(the whole effective batch at once)")
    if micro_batch is not None and not oom_recovery:
        raise ValueError("micro_batch needs the kit's training step: leave oom_recovery=True, or use "
                         "gradient_accumulation_steps in TrainingArguments instead")
    check_save_settings(run, trainer)
    close_unheld_runs(f"before run {run.name!r} trains", keep=run)  # an earlier run the notebook let go of
    replaced, moved_from = bind(run, trainer)  # a trainer kept from an earlier run of the kernel: this run's now
    if replaced:
        run.journal.write("warn", what="trainer_rebound", replaced=replaced,
                          output_dir=str(run.local_dir) if moved_from is not None else None)
    if moved_from is not None:
        _say_rebound(run, trainer, moved_from)
    if run.ranks.distributed and int(getattr(trainer.args, "world_size", 1) or 1) == 1:
        # Every process would train the whole model alone and write the same checkpoint files.
        raise ColabKitError(
            f"{run.ranks.world_size} processes were launched, but the Trainer does not share the training between "
            f"them (TrainingArguments.parallel_mode is {getattr(trainer.args, 'parallel_mode', '?')}), so each "
            f"would train alone and overwrite the others' checkpoints. Without a GPU, pass use_cpu=True to "
            f"TrainingArguments; or launch a single process")
    resume = train_kwargs.pop("resume_from_checkpoint", None)
    if resume is False:
        start_over(run)  # from step 0: the run's checkpoints are archived first (never deleted)
    agree_resume(run)  # several processes: every rank resumes from rank 0's checkpoint
    resume = resume_argument(run, resume)  # True: the newest valid one; a path: verified
    planned = planned_max_steps(trainer) if run.resume_manifest is not None else None  # one dataloader, once
    check_compatible(run, trainer.model, trainer.args, total_steps=planned)
    adjust_args(run, trainer.args)
    name_tied_copies(trainer.model)
    make_length_grouping_resumable(trainer)
    if resume is not None:
        train_kwargs["resume_from_checkpoint"] = resume
    from_plan = None
    if micro_batch is None and oom_recovery:  # a memory plan made for this trainer: its micro-batch first
        from_plan, why = planned_micro_batch(trainer)
        if from_plan is not None:
            print(f"colab_kit: training starts with micro-batches of {from_plan}: {why}; a micro-batch learned on "
                  f"this GPU, and any out-of-memory, still win")
            run.journal.write("plan", micro_batch=from_plan)
    run.micro_batching = TrainerMicroBatching(run, trainer, grow_back_after=grow_back_after,
                                              micro_batch=micro_batch or from_plan, planned=from_plan is not None)
    guard = run.micro_batching if oom_recovery and run.micro_batching.install() else None
    status = "error"
    stop = StopButton(run)  # in a notebook: the first press saves this step and pauses, the second stops at once
    try:
        with stop:
            if _already_complete(run, planned, train_kwargs.get("resume_from_checkpoint")):
                output = _load_completed(run, trainer, Path(train_kwargs["resume_from_checkpoint"]))
            else:
                with no_shard_bars(), keep_asked_saves(trainer):
                    output = trainer.train(**train_kwargs)
        if stop.requested:  # the step ended and was saved: the cell ends as stopped, so "Run all" stops here
            raise KeyboardInterrupt
        limited = run.session_stop is not None and trainer.state.global_step < (trainer.state.max_steps or 1 << 62)
        status = "time limit" if limited else "completed"
        return output
    except KeyboardInterrupt:
        status = "stopped" if stop.armed else "interrupted"
        raise
    except Exception as exc:
        explain_disk_full(run, exc, trainer.model)
        resumed = run.resume_manifest
        if resumed is not None and trainer.state.global_step <= resumed.step:  # it failed loading the checkpoint
            note_failure(exc, resumed.step, resumed.versions, library_versions(),
                         fresh_start_advice(run.name, run.drive_dir, on_hub=run.durability == HUB))
        run._close_gauges(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        if guard is not None and guard.after_step and is_oom_error(exc) and not isinstance(exc, OutOfMemoryError):
            run.journal.write("oom", step=trainer.state.global_step + 1, where="optimizer step",
                              error=str(exc).splitlines()[0][:300])
            raise OutOfMemoryError(guard.optimizer_oom_message()) from exc
        if is_fatal_cuda_error(exc):
            exc.add_note("colab_kit: this CUDA error breaks the CUDA context, so it cannot be retried "
                         "in place. Restart the runtime (Runtime -> Restart session) and run all "
                         "cells: training resumes from the last checkpoint. To find the failing "
                         "operation, set os.environ['CUDA_LAUNCH_BLOCKING'] = '1' first.")
        raise
    finally:
        run.global_step = trainer.state.global_step
        if guard is not None:
            guard.uninstall()
        if status == "stopped":  # the run stays open: the training cell run again continues
            keep_open_after_stop(run, trainer, stop.presses)
        elif status == "time limit":  # saved: it waits for the cloud, finishes, raises TimeLimitReached
            end_at_limit(run, trainer.state.global_step)
        else:
            finish_run(run, 300, status, cloud_wait=False)  # the notebook's run.finish() waits for the cloud


def _say_rebound(run, trainer, earlier) -> None:
    """Say that a trainer made for the kernel's earlier run `earlier` now saves into this run's local folder,
    and, where this run starts fresh, that its model is the one the earlier run trained."""
    trained = trainer.state.global_step
    fresh = run.resume_from is None and trained
    print(f"colab_kit: this trainer was made for run {earlier.name!r}: it now saves into the local folder of run "
          f"{run.name!r}, {run.local_dir} (TrainingArguments.output_dir was {earlier.local_dir}, whose checkpoints "
          f"stay as they are)." + (f" Its model is the one run {earlier.name!r} trained to step {trained}, so run "
                           f"{run.name!r} starts at step 0 from those weights; to train it from the model's first "
                           f"weights, run the model and Trainer cells again before this one." if fresh else ""),
          flush=True)


def _already_complete(run, planned: int | None, checkpoint) -> bool:
    # Resuming from a checkpoint at max_steps makes the Trainer run one step too many (its
    # stop check comes after a step), and resuming after early stopping trains on (the Trainer
    # clears should_training_stop at the start), so a finished run is recognised here instead.
    if not checkpoint or run.resume_manifest is None:
        return False
    if early_stopped(Path(checkpoint)):
        return True
    return planned is not None and run.resume_manifest.step >= planned


def _load_completed(run, trainer, checkpoint: Path):
    from transformers.trainer_callback import TrainerState
    from transformers.trainer_utils import TrainOutput

    trainer._load_from_checkpoint(str(checkpoint))  # the Trainer's own loader (sharded, PEFT, ...)
    trainer.state = TrainerState.load_from_json(str(checkpoint / TRAINER_STATE))
    # The Trainer ends on the best weights with load_best_model_at_end: so does a finished run.
    if trainer.args.load_best_model_at_end:
        restore_best(run.resume_best, trainer.args, trainer.state)
        best = trainer.state.best_model_checkpoint
        if best is not None and Path(best).is_dir():
            trainer._load_best_model()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    step = trainer.state.global_step
    print(f"colab_kit: run {run.name!r} already reached step {step}; loaded its final weights "
          f"instead of training again.")
    run.journal.write("complete", step=step, checkpoint=str(checkpoint))
    return TrainOutput(step, losses[-1] if losses else float("nan"), {"already_complete": True})


def trainer_fingerprint(model, args) -> dict:
    """What a checkpoint records about the model and the training arguments that matter."""
    from ..checkpoints.checkpoint import model_signature

    fp = model_signature(model)
    world = max(1, int(getattr(args, "world_size", 1) or 1))
    fp["effective_batch"] = int(args.per_device_train_batch_size * args.gradient_accumulation_steps * world)
    fp["world_size"] = world
    for key in ("per_device_train_batch_size", "gradient_accumulation_steps", "learning_rate",
                "seed", "max_steps", "num_train_epochs", "warmup_steps", "weight_decay"):
        fp[key] = getattr(args, key, None)
    fp["lr_scheduler_type"] = str(getattr(args, "lr_scheduler_type", ""))
    return fp


def check_compatible(run, model, args, total_steps: int | None = None) -> None:
    """Stop before training when the checkpoint to resume from cannot fit this setup; say how the
    compatible changes will act (`changes.py`). `total_steps`: the Trainer's planned total, when known.

    Raises:
        ResumeMismatchError: different model shapes or effective batch, with the exact
            call that starts fresh instead.
    """
    run.fingerprint = trainer_fingerprint(model, args)
    if run.resume_manifest is None:
        return
    saved = run.resume_manifest.fingerprint
    problems = []
    for key, value in run.fingerprint.items():
        if key not in saved or saved[key] == value or key not in INCOMPATIBLE:
            continue
        what = INCOMPATIBLE[key]
        if key == "model":
            problems.append(f"{what}: {saved.get('parameters', 0):,} parameters then, "
                            f"{run.fingerprint['parameters']:,} now, different tensors")
        else:
            problems.append(f"{what}: {saved[key]} then, {value} now")
    if problems:
        raise ResumeMismatchError(
            f"checkpoint-{run.resume_manifest.step} in {run.drive_dir} was made by a different "
            "setup, so training cannot continue from it: " + "; ".join(problems) + ". "
            "Restore the old settings to continue, or "
            + fresh_start_advice(run.name, run.drive_dir, on_hub=run.durability == HUB))
    compatible = {k: v for k, v in run.fingerprint.items() if k not in INCOMPATIBLE}
    said = describe_changes(run, saved, compatible, args, total_steps)
    for sentence in said:
        run.notices.add(sentence)
    if said:
        changes = [f"{k} {saved[k]} -> {v}" for k, v in compatible.items() if k in saved and saved[k] != v
                   and k != "parameters"]
        run.journal.write("warn", what="changed_settings", changes=changes)
        run.notices.show()


def adjust_args(run, args) -> None:
    """Warn about settings that defeat the kit, cap local checkpoints (Drive keeps the history), and
    restore the callbacks' state on resume."""
    out = Path(args.output_dir).absolute()
    if out == run.drive_dir or run.drive_dir in out.parents:
        run.notices.add(f"output_dir {out} is inside the persistent folder: every save then "
                        f"blocks on Drive. Use TrainingArguments(output_dir=run.local_dir); the "
                        f"kit mirrors checkpoints to Drive in the background")
    if args.save_total_limit is None:
        # The kit keeps the history on Drive; unlimited local copies only fill the VM disk.
        args.save_total_limit = max(run.keep, 2)
    if hasattr(args, "restore_callback_states_from_checkpoint"):
        # An exact resume includes the callbacks' saved state (early stopping's patience counter,
        # the Trainer's control flags); the Trainer restores it only when asked.
        args.restore_callback_states_from_checkpoint = True
    if getattr(args, "save_only_model", False):
        run.notices.add("save_only_model=True: checkpoints hold no optimizer, scheduler or RNG "
                        "state, so a resume will not continue exactly")
    run.notices.show()


def name_tied_copies(model) -> None:
    """A checkpoint stores a tied weight once (GPT-2's lm_head is wte's weight), so the Trainer's resume
    reports it missing ("There were missing keys in the checkpoint model loaded: ['lm_head.weight']"):
    harmless, and said at every resume. `_keys_to_ignore_on_save` is the Trainer's own name for keys a
    checkpoint leaves out: given the tied copy, its load re-ties it and says nothing. Only for the
    embeddings tied as the config declares (so that a saved model re-ties them too); a model that names
    such keys itself is left alone."""
    config = getattr(model, "config", None)  # a plain nn.Module in a Trainer has none, and ties nothing
    if getattr(model, "_keys_to_ignore_on_save", None) or not getattr(config, "tie_word_embeddings", False):
        return
    try:
        tied = model.get_output_embeddings().weight
        if tied is not model.get_input_embeddings().weight:
            return
    except (AttributeError, NotImplementedError):  # no embeddings to tie (an encoder's head, a custom model)
        return
    names = [name for name, parameter in model.named_parameters(remove_duplicate=False) if parameter is tied]
    if len(names) > 1:
        model._keys_to_ignore_on_save = set(names[1:])  # the copies; the first is what the checkpoint stores


def planned_max_steps(trainer) -> int | None:
    """The Trainer's total optimizer steps, computed as `Trainer.set_initial_training_values` does."""
    args = trainer.args
    if args.max_steps is not None and args.max_steps > 0:
        return int(args.max_steps)
    try:
        batches = len(trainer.get_train_dataloader())
    except (TypeError, ValueError):  # an iterable dataset without a length
        return None
    per_epoch = max(math.ceil(batches / args.gradient_accumulation_steps), 1)
    return math.ceil(args.num_train_epochs * per_epoch)
