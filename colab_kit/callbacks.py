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

__all__ = ["SaveScheduleCallback", "DriveSyncCallback"]

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
        pause = time.perf_counter() - started
        self.run.journal.write("save", step=step, local=str(folder), snapshot_s=round(pause, 4))
        self.run.poll()
