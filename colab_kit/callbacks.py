"""HF Trainer callbacks: when to save (time- or step-based), and mirroring each save to Drive.

Both are thin: the Trainer keeps doing its own checkpointing into `output_dir` (local disk);
these callbacks decide *when* and hand every checkpoint to the run's background uploader.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

from transformers import TrainerCallback

from . import storage
from .checkpoint import KIT_STATE, checkpoint_dir
from .sync import SNAPSHOTS, take_snapshot

__all__ = ["SaveScheduleCallback", "DriveSyncCallback", "GaugesCallback"]

log = logging.getLogger(__name__)


class SaveScheduleCallback(TrainerCallback):
    """Sets `control.should_save` every `save_every` (training time or steps) and at the last step.

    The clock counts training time only and is restored from the checkpoint, so "every 10min"
    keeps meaning 10 minutes of training across a resume (Composer's time-based intervals).
    """

    def __init__(self, run):
        self.run = run
        self._last_save_seconds = 0.0
        self._last_saved_step: int | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.run.clock.start()
        self._last_save_seconds = self.run.clock.seconds
        self._last_saved_step = state.global_step if self.run.resume_from is not None else None

    def on_step_end(self, args, state, control, **kwargs):
        self.run.poll()
        step = state.global_step
        due = bool(self.run.save_every_steps and step % self.run.save_every_steps == 0)
        if self.run.save_every_s is not None:
            due |= self.run.clock.seconds - self._last_save_seconds >= self.run.save_every_s
        due |= bool(state.max_steps) and step >= state.max_steps  # the final state is always kept
        if due and step != self._last_saved_step:
            control.should_save = True
        return control

    def on_save(self, args, state, control, **kwargs):
        self._last_save_seconds = self.run.clock.seconds
        self._last_saved_step = state.global_step

    def on_train_end(self, args, state, control, **kwargs):
        self.run.clock.stop()


class DriveSyncCallback(TrainerCallback):
    """After each Trainer save: record the kit's state, snapshot the folder, queue the upload."""

    def __init__(self, run):
        self.run = run

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and self.run.fingerprint is None:  # used without run.train()
            self.run.check_compatible(model, args)

    def on_save(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        started = time.perf_counter()
        step = state.global_step
        folder = checkpoint_dir(Path(args.output_dir), step)
        if not folder.is_dir():
            self.run.notices.add(f"the Trainer reported a save at step {step} but {folder} does not exist")
            return
        kit_state = {"step": step, "train_seconds": round(self.run.clock.seconds, 3),
                     "time": time.time()}
        storage.atomic_write_bytes(folder / KIT_STATE, json.dumps(kit_state).encode())
        snapshot = take_snapshot(folder, self.run.local_dir / SNAPSHOTS, step, self.run.fingerprint)
        self.run.mirror.submit(snapshot)
        self.run.last_saved_step = step
        pause = time.perf_counter() - started
        self.run.journal.write("save", step=step, local=str(folder), snapshot_s=round(pause, 4))
        self.run.poll()


class GaugesCallback(TrainerCallback):
    """Live gauges while the Trainer runs; updated from the training loop, closed at the end."""

    def __init__(self, run):
        self.run = run
        self.gauges = None

    def _status(self) -> dict:
        run = self.run
        batching = run.micro_batching
        backoffs = len(batching.train.backoffs) + len(batching.eval.backoffs) if batching is not None else 0
        return {"saved_step": run.last_saved_step, "durable_step": run.mirror.durable_step,
                "oom_backoffs": backoffs, "micro_batch": batching.train.micro_batch if batching else None}

    def on_train_begin(self, args, state, control, **kwargs):
        from .gauges import Gauges

        if self.gauges is not None and not self.gauges.closed:
            return
        run = self.run

        def warn(message):  # from the sampler thread: journal it; the gauges show it
            run.journal.write("warn", what="memory", message=message)

        self.gauges = Gauges(total_steps=state.max_steps or None, title=f"run {run.name!r}",
                             local_dir=run.local_dir, drive_dir=run.drive_dir,
                             save_html=run.drive_dir / "gauges.html", on_warn=warn)
        self.gauges.update(step=state.global_step, **self._status())

    def on_step_end(self, args, state, control, **kwargs):
        if self.gauges is not None:
            self.gauges.update(step=state.global_step, **self._status())

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.gauges is not None and logs and "loss" in logs:
            self.gauges.update(step=state.global_step, loss=logs["loss"])

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self, error: str | None = None) -> None:
        if self.gauges is not None and not self.gauges.closed:
            self.gauges.update(**self._status())
            self.gauges.close(error=error)
