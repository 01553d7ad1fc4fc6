"""HF Trainer callbacks: when to save (time- or step-based), and mirroring each save to Drive.

Both are thin: the Trainer keeps doing its own checkpointing into `output_dir` (local disk);
these callbacks decide *when* and hand every checkpoint to the run's background uploader.
A time-based interval stretches while Drive absorbs checkpoints more slowly than they are made,
so that the newest one can be in the cloud before the next is due.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from transformers import TrainerCallback

from .._units import format_age, format_bytes
from ..checkpoints.checkpoint import checkpoint_dir
from ..checkpoints.shards import IncompleteShards
from ..checkpoints.snapshot import SNAPSHOTS, take_snapshot
from ..distributed import ranks
from ..drive.drivefs import cloud_name
from ..errors import ColabKitError
from ..lifecycle.best import restore_best, step_of
from .disk import check_local_space
from .savesettings import saves_at_epoch_end, strategy
from .gaugescallback import GaugesCallback
from .timelimit import TimeLimitWatch

__all__ = ["SaveScheduleCallback", "DriveSyncCallback", "GaugesCallback", "bind", "rebind_output_dir"]

log = logging.getLogger(__name__)
STRETCH = 1.25  # a stretched interval leaves this much room over the expected upload time


def bind(run, trainer) -> tuple[list[str], object | None]:
    """Make the trainer this run's: the kit callbacks of another run are removed, this run's added, and an
    output_dir that was the earlier run's local folder becomes this run's (`rebind_output_dir`).

    A trainer outlives its run in a notebook: after the stop button, the `start_run` cell run again
    makes a new run, and the training cell hands it the trainer still in the kernel, whose callbacks
    belong to the finished run (its mirror closed). Left there, they would take every save and
    mirror none. Returns (the names of the callbacks replaced, the earlier run whose local folder the trainer
    saved into, or None)."""
    replaced, earlier = [], []
    for cb in list(trainer.callback_handler.callbacks):
        if isinstance(cb, KIT_CALLBACKS) and cb.run is not run:
            trainer.remove_callback(cb)
            replaced.append(f"{type(cb).__name__} of run {cb.run.name!r}")
            earlier.append(cb.run)
    present = {type(cb) for cb in trainer.callback_handler.callbacks}
    for cb in run.callbacks():
        if type(cb) not in present:
            trainer.add_callback(cb)
    return replaced, rebind_output_dir(run, trainer, earlier)


def rebind_output_dir(run, trainer, earlier: list):
    """A trainer made for an earlier run of the kernel (`earlier`: the runs whose callbacks it had), whose
    output_dir is that run's local folder, saves into this run's instead: else its checkpoints would be
    written over the earlier run's local ones (which that run, opened again, resumes from), and its rotation
    would delete them. What derives from output_dir moves with it: `logging_dir` (transformers 4.x computes
    it once, `output_dir/runs/<time_host>`), and the folder a TensorBoardCallback took at its first
    train (5.x). A user's own output_dir is left alone. Returns the earlier run, or None when nothing moved."""
    args = trainer.args
    old = Path(args.output_dir).absolute()
    owner = next((r for r in earlier if Path(r.local_dir).absolute() == old), None)
    if owner is None or old == Path(run.local_dir).absolute():
        return None
    args.output_dir = str(run.local_dir)
    logging_dir = getattr(args, "logging_dir", None)
    if logging_dir and Path(logging_dir).absolute().parent == old / "runs":
        args.logging_dir = str(Path(run.local_dir) / "runs" / Path(logging_dir).name)
    for cb in trainer.callback_handler.callbacks:
        folder = getattr(cb, "logging_dir", None)
        if type(cb).__name__ == "TensorBoardCallback" and folder and old in Path(folder).absolute().parents:
            cb.logging_dir = None  # taken again from the new output_dir at the next on_train_begin
            if getattr(cb, "tb_writer", None) is not None:  # open still after a stopped run: not into that folder
                cb.tb_writer.close()
                cb.tb_writer = None
    return owner


def refuse_closed(run, step: int) -> None:
    """A save that no uploader will take is an error at once, never a silent drop."""
    run.stop_if_lease_lost(step)
    if run._finished:
        raise ColabKitError(
            f"checkpoint-{step} was saved for run {run.name!r}, which is finished: nothing would copy it to "
            f"{run.drive_dir}. Run the start_run cell again, then train with run.train(trainer): it binds "
            f"the trainer to the new run and resumes from the newest checkpoint")


class SaveScheduleCallback(TrainerCallback):
    """Sets `control.should_save` every `save_every` (training time or steps) and at the last step.

    The clock counts training time only and is restored from the checkpoint, so "every 10min"
    keeps meaning 10 minutes of training across a resume (Composer's time-based intervals).
    """

    def __init__(self, run):
        self.run = run
        self._last_save_seconds = 0.0
        self._last_saved_step: int | None = None
        self._at_epoch_end: int | None = None  # a step whose save is left to the Trainer's epoch-end save
        self._asked: int | None = None  # the step whose save the kit asked for, until the Trainer makes it
        self._journaled_interval: float | None = None
        self._told = False
        self.limit = TimeLimitWatch(run)  # start_run(time_limit=...): when to stop before the session ends

    def on_train_begin(self, args, state, control, **kwargs):
        self.run.clock.start()
        self._last_save_seconds = self.run.clock.seconds
        self._last_saved_step = state.global_step if self.run.resume_from is not None else None
        self._at_epoch_end = self._asked = None

    def on_step_begin(self, args, state, control, **kwargs):
        self.check_made(args)

    def check_made(self, args) -> None:
        """A save the kit asked for and the Trainer did not make (after the step's evaluation) is said and
        journaled: the run's history then lacks that step, and `finish` must not read as if it did not."""
        asked, self._asked = self._asked, None
        if asked is None or asked == self._last_saved_step:
            return
        saving = strategy(getattr(args, "save_strategy", None))
        self.run.journal.write("warn", what="save_dropped", step=asked, save_strategy=saving)
        self.run.notices.add(f"the Trainer did not make the save the kit asked for at step {asked} "
                             f"(save_strategy={saving!r}): that step is in no checkpoint")

    def on_step_end(self, args, state, control, **kwargs):
        self.run.poll()
        step = state.global_step
        self.run.stop_if_lease_lost(step)
        self.limit.step_ended()
        if getattr(self.run, "reporter", None) is not None:  # the step the next heartbeat and status page carry
            self.run.reporter.record_step(step, state.max_steps)
        button = getattr(self.run, "stop_button", None)
        if button is not None and button.requested:  # the stop button, pressed once: save this step, then pause
            control.should_training_stop = True
            wanted = step != self._last_saved_step
        else:
            wanted = self._due(step, state)
            if self._at_limit(kwargs.get("model"), saving=wanted):  # the session's end is near: save, then finish
                control.should_training_stop = True
                wanted = step != self._last_saved_step
        if wanted:
            self._ask(step, args, state, control, kwargs.get("model"))
        return control

    def _at_limit(self, model, saving: bool) -> bool:
        """Has the session's end come near (rank 0 decides, every rank stops at the same step)? `saving`: a save
        is due at this step anyway, so going on means one more checkpoint to upload at the end."""
        if getattr(self.run, "session", None) is None:
            return False
        if self.run.session_stop is None:
            due = ranks.from_writer(self.limit.due(model, saving=saving) if self.run.ranks.writer else False)
            if due and self.run.session_stop is None:  # a follower: rank 0 saw it
                self.run.session_stop = "rank 0 saw the session's limit near"
        return self.run.session_stop is not None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs and getattr(self.run, "reporter", None) is not None:
            self.run.reporter.record_loss(state.global_step, logs["loss"])

    def on_epoch_end(self, args, state, control, **kwargs):
        if self._at_epoch_end == state.global_step:  # the save left to this epoch end: made sure of, once
            control.should_save = True
            self._asked = state.global_step
            check_local_space(self.run, kwargs.get("model"), state.global_step)
        self._at_epoch_end = None
        return control

    def _due(self, step: int, state) -> bool:
        due = bool(self.run.save_every_steps and step % self.run.save_every_steps == 0)
        if self.run.save_every_s is not None:
            # Each rank's clock differs: rank 0 decides, every rank saves (the Trainer's save is collective).
            due |= ranks.from_writer(self.run.clock.seconds - self._last_save_seconds >= self.interval())
        due |= bool(state.max_steps) and step >= state.max_steps  # the final state is always kept
        return due and step != self._last_saved_step

    def _ask(self, step: int, args, state, control, model) -> None:
        """Ask the Trainer to save `step`, once. With save_strategy="epoch" the Trainer saves at the end of every
        epoch, and the last step of training ends one: a save asked for now would write that step's checkpoint
        twice (the second save rewriting the files of the first while it uploads), so that save is left to the
        epoch's end, where it also holds the epoch's evaluation (`on_epoch_end` makes sure it happens)."""
        if saves_at_epoch_end(args) and _epoch_ends(state, control):
            self._at_epoch_end = step
            return
        control.should_save = True
        self._asked = step
        self.limit.save_asked()
        check_local_space(self.run, model, step)  # the Trainer writes it to local disk next: a full disk is named first

    def interval(self) -> float:
        """The time-based interval in force: `save_every`, or longer while uploads are slower."""
        asked = self.run.save_every_s
        if self.run.mirror.prune_after == "written":  # the behaviour before 0.2, for comparisons
            return asked
        tracker = self.run.mirror.tracker
        expected = tracker.expected_upload_s(tracker.last_bytes)
        interval = max(asked, STRETCH * expected) if expected else asked
        self.run.save_interval_s = interval
        last = self._journaled_interval
        if (last is None and interval > asked) or (last is not None and abs(interval - last) > 0.25 * last):
            self._announce(interval, expected, stretched=interval > asked)
        return interval

    def _announce(self, interval: float, expected: float, *, stretched: bool) -> None:
        self._journaled_interval = interval
        self._journal_interval(interval, expected, asked_s=self.run.save_every_s)
        if stretched and not self._told:
            self._told = True
            self.run.notices.add(f"{self._drive_speed(expected)}; saving every {format_age(interval)} instead "
                                 f"of every {format_age(self.run.save_every_s)}, so that each checkpoint can "
                                 f"reach the cloud before the next one")

    def _journal_interval(self, interval: float, expected: float, **asked) -> None:
        tracker = self.run.mirror.tracker
        self.run.journal.write("warn", what="save_interval", interval_s=round(interval, 1), **asked,
                               expected_upload_s=round(expected, 1), rate_bps=round(tracker.rate_bps or 0),
                               checkpoint_bytes=tracker.last_bytes)

    def _drive_speed(self, expected: float) -> str:
        tracker = self.run.mirror.tracker
        return (f"{cloud_name(tracker.kind)} uploads ~{format_bytes(tracker.rate_bps)}/s; a {format_bytes(tracker.last_bytes)} "
                f"checkpoint needs ~{format_age(expected)}")

    def on_save(self, args, state, control, **kwargs):
        since = self.run.clock.seconds - self._last_save_seconds
        if self.run.save_every_steps and self._last_saved_step is not None and not self._told:
            # A step-based interval is kept as given; say so once when Drive cannot keep up.
            tracker = self.run.mirror.tracker
            expected = tracker.expected_upload_s(tracker.last_bytes)
            if expected and expected > since > 0:
                self._told = True
                self._journal_interval(since, expected, asked_steps=self.run.save_every_steps)
                cloud, minutes = cloud_name(self.run.mirror.tracker.kind), max(1, round(STRETCH * expected / 60))
                self.run.notices.add(
                    f"{self._drive_speed(expected)}, but saves come every {format_age(since)} "
                    f"({self.run.save_every_steps} steps): newer checkpoints replace ones still waiting "
                    f"for {cloud}. A duration such as save_every=\"{minutes}min\" stretches by itself")
        self._last_save_seconds = self.run.clock.seconds
        self._last_saved_step = state.global_step
        self.limit.saved()

    def on_train_end(self, args, state, control, **kwargs):
        self.check_made(args)
        self.run.clock.stop()


def _epoch_ends(state, control) -> bool:
    """Does the Trainer end an epoch right after this step? It does when training or the epoch stops here, and
    after the epoch's last batch, where the Trainer's epoch count (epoch + batches done / batches) is whole."""
    epoch = state.epoch
    return bool(control.should_training_stop or control.should_epoch_stop
                or (epoch is not None and float(epoch) > 0 and float(epoch).is_integer()))


class DriveSyncCallback(TrainerCallback):
    """After each Trainer save: record the kit's state, snapshot the folder, queue the upload."""

    def __init__(self, run):
        self.run = run

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None and self.run.fingerprint is None:  # used without run.train()
            self.run.check_compatible(model, args, total_steps=state.max_steps or None)
        restore_best(self.run.resume_best, args, state)

    def on_save(self, args, state, control, **kwargs):
        started = time.perf_counter()
        step = state.global_step
        refuse_closed(self.run, step)
        folder = checkpoint_dir(Path(args.output_dir), step)
        world = max(1, int(getattr(args, "world_size", 1) or 1))  # the Trainer's: one file per rank it trains on
        per_rank = world > 1 and not getattr(args, "save_only_model", False)  # rng_state_<r>.pth files expected
        # Every rank has written its files when it gets here; this also waits for all of them (a
        # barrier before the snapshot) and brings each rank's RNG state to rank 0 across nodes.
        ranks.gather_rank_files(folder, [f"rng_state_{getattr(args, 'process_index', 0)}.pth"] if per_rank else [])
        if not (state.is_world_process_zero and self.run.ranks.writer):
            return
        # Set before the upload is queued: a queued best checkpoint is never superseded.
        self.run.mirror.best_step = step_of(state.best_model_checkpoint)
        if not folder.is_dir():
            self.run.notices.add(f"the Trainer reported a save at step {step} but {folder} does not exist")
            return
        missing = ranks.rank_files_missing(folder, world) if per_rank else []
        if missing:  # a resume from it could not be exact: not published
            self.run.notices.add(f"checkpoint-{step} lacks {', '.join(missing)} (the RNG state of those ranks), so it "
                                 f"is not uploaded; the next checkpoint will be")
            self.run.journal.write("warn", what="rank_files_missing", step=step, missing=missing)
            return
        kit_state = {"step": step, "train_seconds": round(self.run.clock.seconds, 3), "time": time.time()}
        try:
            snapshot = take_snapshot(folder, self.run.local_dir / SNAPSHOTS, step, self.run.fingerprint, kit_state)
        except IncompleteShards as exc:  # FSDP's sharded folders: a resume from it would fail
            self.run.notices.add(f"checkpoint-{step} is not uploaded: {exc}")
            self.run.journal.write("warn", what="shards_missing", step=step, reason=str(exc))
            return
        self.run.mirror.submit(snapshot)
        self.run.last_saved_step, self.run.last_checkpoint_bytes = step, snapshot.bytes
        pause = time.perf_counter() - started
        self.run.journal.write("save", step=step, local=str(folder), snapshot_s=round(pause, 4))
        if self.run.reporter is not None:
            self.run.reporter.record_save(step)
        self.run.poll()


KIT_CALLBACKS = (SaveScheduleCallback, DriveSyncCallback, GaugesCallback)
