"""`Run`: a training run whose checkpoints survive a Colab disconnect (made by `start_run`).

    run = ck.start_run("rna-bert", save_every="10min", keep=3)
    trainer = Trainer(..., args=TrainingArguments(output_dir=run.local_dir, ...))
    run.train(trainer)          # resumes from Drive, mirrors checkpoints
    run.finish()                # waits until the last checkpoint and final/ are in the cloud
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from pathlib import Path

from .._notices import Notices
from ..checkpoints.checkpoint import list_checkpoints
from ..checkpoints.journal import Journal
from ..distributed.ranks import Ranks
from ..drive.drivefs import PLAIN
from ..drive.lease import Lease, LeaseInfo
from ..drive.mirror import Mirror
from ..drive.retention import Ladder
from ..drive.mount import remount_drive
from ..errors import ColabKitError, LeaseLostError
from ..runtime import RuntimeInfo
from ..lifecycle.registry import TrainClock

__all__ = ["Run"]

log = logging.getLogger(__name__)
_REMOUNT_EVERY_S = 300.0


class Run:
    """A training run with a persistent folder; made by `start_run`.

    Attributes:
        name: the run name (the folder name under the persistent root).
        drive_dir: the persistent folder, `<root>/<name>/`.
        local_dir: fast local scratch where the Trainer writes (`output_dir`).
        resume_from: local path of the newest valid checkpoint, or None on a fresh run.
        resume_best: local path of the Trainer's best checkpoint named in it (fetched too), or None.
        runtime: what `start_run` detected (Colab, GPU, RAM limit).
        ranks: this process's place among several (torchrun, accelerate, notebook_launcher):
            rank 0 writes, the other ranks follow (`ranks.py`). Their `resume_from` is set when
            `run.train` starts, from rank 0's choice.
        durability: what "in the cloud" means for `drive_dir`: "drivefs" (DriveFS reports each
            file's upload), "unconfirmed" (a Drive mount without those reports: nothing is ever
            called in the cloud) or "plain" (a local or network folder: written is enough).
        cloud_step, cloud_age_s: the newest checkpoint in the cloud and how long ago it was saved.
        pending_bytes, pending_eta_s: what is written but not yet in the cloud, and the time left
            at the measured upload rate (None while unknown).
    """

    def __init__(self, name: str, drive_dir: Path, local_dir: Path, *, on_drive: bool,
                 save_every_s: float | None, save_every_steps: int | None, keep: int,
                 runtime: RuntimeInfo, lease: Lease | None, journal: Journal, notices: Notices,
                 gauges: bool = True, kind: str = PLAIN, prune_after: str = "cloud", ranks: Ranks | None = None,
                 ladder: Ladder = Ladder(), pace_bps: float = 1e6, api=None, known_steps=(), confirmed_steps=(),
                 threaded: bool = True, kind_settled: bool = True):
        self.name = name
        self.drive_dir = drive_dir
        self.local_dir = local_dir
        self.on_drive = on_drive
        self.save_every_s = save_every_s
        self.save_every_steps = save_every_steps
        self.keep = keep
        self.runtime = runtime
        self.ranks = ranks or Ranks()
        self.lease = lease  # None on a follower rank
        self.journal = journal
        self.notices = notices
        self.resume_from: Path | None = None
        self.resume_manifest = None
        self.resume_best: Path | None = None
        self.resume_state: dict = {}
        self.clock = TrainClock()
        self._mirror_settings = {"kind": kind, "prune_after": prune_after, "ladder": ladder, "pace_bps": pace_bps,
                                 "api": api, "known_steps": set(known_steps),
                                 "confirmed_steps": set(confirmed_steps), "threaded": threaded,
                                 "kind_settled": kind_settled}
        self.mirror = self.new_mirror()
        self.fingerprint: dict | None = None
        self.show_gauges = gauges
        self.last_saved_step: int | None = None
        self.last_checkpoint_bytes = 0  # the size of the newest checkpoint saved (the local disk must hold one more)
        self.save_interval_s = save_every_s  # the time-based interval in force (it may stretch)
        self.global_step: int | None = None  # where the last run.train ended
        self.micro_batching = None  # the TrainerMicroBatching of the last run.train
        self.stop_button = None  # while run.train runs: the notebook's stop button (`stop.py`)
        self._callbacks: list | None = None
        self._last_remount = float("-inf")
        self.lost_to: str | None = None  # who took the run folder over, once the lease is lost
        self.session = None  # start_run(time_limit=...): the session's clock (`lifecycle/deadline.py`)
        self.session_stop, self.release_at_limit = None, False  # why training stopped for it, once it did
        self.reporter = None  # the status page's gatherer (`report/reporter.py`), on the writing rank
        self._finished = False
        self._stores = weakref.WeakSet()  # from checkpoint_store(): finish() names a save they still write
        self._summary: dict | None = None
        self._pid = os.getpid()  # a forked copy (notebook_launcher) has none of this process's threads

    def new_mirror(self) -> Mirror:
        """The uploader of this run folder (a fresh one after `resume_from_checkpoint=False`)."""
        return Mirror(self.drive_dir, keep=self.keep, journal=self.journal, notices=self.notices,
                      on_disconnected=self._remount, writer=self.ranks.writer, lease=self.lease,
                      on_lease_lost=lambda: self._lease_lost(None), **self._mirror_settings)

    # -- callbacks and training ----------------------------------------------------------------
    def callbacks(self) -> list:
        """The kit's `transformers.TrainerCallback`s for this run (the same objects each call):
        time/step-based saves, Drive mirroring and, unless `start_run(gauges=False)`, live gauges
        (on rank 0 only)."""
        if self._callbacks is None:
            from ..trainer.callbacks import DriveSyncCallback, GaugesCallback, SaveScheduleCallback

            self._callbacks = [SaveScheduleCallback(self), DriveSyncCallback(self)]
            if self.show_gauges and self.ranks.writer:
                self._callbacks.append(GaugesCallback(self))
        return list(self._callbacks)

    def train(self, trainer, *, oom_recovery: bool = True, grow_back_after: int | None = None,
              micro_batch: int | None = None, **train_kwargs):
        """Resume, train with the kit's callbacks and OOM recovery, and finish; returns the TrainOutput.

        Adds any of `callbacks()` the trainer lacks (no duplicates), resumes from
        `resume_from` unless `resume_from_checkpoint` is given, runs each optimizer step's
        effective batch as micro-batches that halve on out-of-memory (same effective batch,
        schedule and data order), and finishes the run at the end, also when training fails:
        the last checkpoint is written to the persistent folder; waiting for it to reach the
        cloud is left to the notebook's final `run.finish()`, so evaluation is not held up.

        Args:
            trainer: a `transformers.Trainer` whose `output_dir` is `run.local_dir`.
            oom_recovery: False runs the Trainer's own training step unchanged.
            grow_back_after: after this many clean steps, cautiously try a micro-batch twice
                as large again (off by default).
            micro_batch: start with micro-batches of this many rows instead of the whole
                effective batch (it still halves on out-of-memory). The rows of each batch are
                ordered by length first and every micro-batch is cut to its longest row, so
                this also trims padding: on a CPU, with lengths as varied as nRC's, micro-batches
                of 8 make a step about 1.4x faster.
            **train_kwargs: passed to `trainer.train`.
        """
        from ..trainer.training import train

        self._require_open("train")
        return train(self, trainer, oom_recovery=oom_recovery, grow_back_after=grow_back_after,
                     micro_batch=micro_batch, **train_kwargs)

    def check_compatible(self, model, args, total_steps: int | None = None) -> None:
        """Stop before training when the checkpoint to resume from cannot fit this model and these
        arguments (different tensor shapes or effective batch), with the call that starts fresh; say how
        the compatible changes act (a changed learning rate does not: the checkpoint's wins, as in the
        Trainer). `total_steps`: the Trainer's planned total, for the rate the rebuilt schedule gives.

        Raises:
            ResumeMismatchError: what changed, and `ck.start_run(name, resume=False)`.
        """
        from ..trainer.training import check_compatible

        check_compatible(self, model, args, total_steps)

    def save_final(self, model, tokenizer=None, metrics: dict | None = None, retries: int = 3, *,
                   merged: bool = False) -> Path:
        """Export the trained model to `<drive_dir>/final/`: safetensors, config, tokenizer, metrics
        (the metrics also go to `<drive_dir>/metrics.json`). A peft model exports its adapter; with
        `merged=True` also the base with the adapter merged in, in `final/merged/`, once host RAM is
        seen to hold it (otherwise the adapter alone, and the reason said).

        Written to local disk first, then copied to the persistent folder with every file read
        back and verified, MANIFEST.json last. Works after `finish()` too.

        Returns:
            The `final/` folder on the persistent folder.

        Raises:
            DriveError: the copy kept failing; the export stays on local disk (the message says where).
        """
        from ..export.final import save_final

        return save_final(self, model, tokenizer, metrics, retries, merged=merged)

    def checkpoint_store(self, async_save: bool = True):
        """A `CheckpointStore` for plain PyTorch loops that shares this run's folder and uploader.

        Under several processes every rank takes one (and calls save and restore_latest, as it calls its
        training step's collectives): rank 0 writes and mirrors, the others add their own share."""
        from ..loop.store import CheckpointStore

        self._require_own_process("open a checkpoint store")
        store = CheckpointStore(self.drive_dir, keep=self.keep, local_dir=self.local_dir, async_save=async_save,
                                _journal=self.journal if self.ranks.writer else None, _notices=self.notices,
                                _mirror=self.mirror if self.ranks.writer else None)
        self._stores.add(store)
        return store

    # -- main-thread housekeeping, called from the callbacks --------------------------------------
    def _remount(self) -> None:
        """After errno 107, from the mirror's thread (training never waits for it): remount Colab's Drive,
        at most every 5 minutes."""
        if not self.on_drive or time.monotonic() - self._last_remount < _REMOUNT_EVERY_S:
            return
        self._last_remount = time.monotonic()
        try:
            remount_drive()
            self.journal.write("warn", what="remounted_drive")
        except Exception as exc:  # remounting is best effort; the uploader keeps retrying
            self.notices.add(f"remounting Google Drive failed: {exc}")

    def poll(self) -> None:
        """Show the warnings the background threads queued (main thread only)."""
        self.notices.show()

    def _lease_lost(self, holder: LeaseInfo | None) -> None:
        """From the heartbeat's or the mirror's thread: another runtime holds the run folder now. The
        uploader stops for good here; training stops at its next step (`stop_if_lease_lost`)."""
        if self.lost_to is not None:  # the heartbeat and the mirror may both notice
            return
        self.lost_to = f"host {holder.host}, pid {holder.pid}" if holder else "another runtime"
        who = f"another runtime ({self.lost_to})" if holder else self.lost_to
        reason = f"{who} took over {self.drive_dir}; this one stopped syncing"
        self.mirror.pause(reason)
        self.notices.add(reason + ", and stops training at its next step")
        self.journal.write("warn", what="lease_lost", holder=self.lost_to)

    def stop_if_lease_lost(self, step: int) -> None:
        """At a step boundary, on the training thread: a runtime that lost the run folder (taken over, or
        missing at every look) trains no further: it never writes beside the runtime that owns it now, and
        never trains on for hours with nowhere to put its checkpoints.

        Raises:
            LeaseLostError: who took the folder over, or that it is gone; where this one's last checkpoint
                is, and what to do.
        """
        if self.lost_to is None and not self.mirror.folder_gone:
            return
        written = self.mirror.written_step
        on_disk = list_checkpoints(self.local_dir)
        saved = on_disk[0][0] if on_disk else None
        if self.lost_to is None:
            raise LeaseLostError(
                f"the run folder {self.drive_dir} is gone (deleted or moved?), so this runtime stopped training "
                f"at step {step}; nothing was deleted, and "
                + (f"checkpoint-{saved} is saved on this VM's disk ({self.local_dir})" if saved is not None
                   else "no checkpoint was saved yet")
                + ". Run the start_run cell again and then this cell: the folder is made anew, the newest "
                  "checkpoint is uploaded, and training continues from it")
        raise LeaseLostError(
            f"another runtime ({self.lost_to}) took over {self.drive_dir}, so this runtime stopped training at "
            f"step {step}: from now on, only that runtime writes the run folder"
            + (f" (its newest checkpoint from here is checkpoint-{written})" if written is not None else "")
            + (f"; checkpoint-{saved} was not written there and stays only on this VM's disk ({self.local_dir})"
               if saved is not None and (written is None or saved > written) else "")
            + ". Continue in that runtime; or, to take the run back here (that runtime then stops at its next "
              "step), run the start_run cell again with takeover=True")

    # -- the cloud -----------------------------------------------------------------------------
    @property
    def durability(self) -> str:
        return self.mirror.kind

    cloud_step = property(lambda self: self.mirror.tracker.summary()["cloud_step"])
    cloud_age_s = property(lambda self: self.mirror.tracker.summary()["cloud_age_s"])

    @property
    def pending_bytes(self) -> int:
        return self.mirror.tracker.pending_bytes

    @property
    def pending_eta_s(self) -> float | None:
        return self.mirror.tracker.eta_s()

    # -- end -----------------------------------------------------------------------------------
    def status(self) -> dict:
        """Where the run stands: steps saved, written and in the cloud, what is pending, failures."""
        oom = self.micro_batching.summary() if self.micro_batching is not None else None
        return {
            "oom": oom,
            "name": self.name,
            "drive_dir": str(self.drive_dir),
            "saved_step": self.last_saved_step,
            "written_step": self.mirror.written_step,
            "unwritten_steps": self.mirror.pending_steps,
            **self.mirror.tracker.summary(),
            "sync_failures": self.mirror.total_failures,
            "unsynced_reason": self.mirror.unsynced_reason,
            "train_seconds": round(self.clock.seconds, 1),
        }

    def _close_gauges(self, error: str | None = None) -> None:
        from ..trainer.callbacks import GaugesCallback

        for cb in self._callbacks or []:
            if isinstance(cb, GaugesCallback):
                cb.close(error=error)

    def finish(self, timeout: float | None = 300, status: str = "finished", flush: bool = False,
               release_runtime: bool = False) -> dict:
        """Wait until the last checkpoint and `final/` are in the cloud, then release the run folder.

        Waits up to `timeout` seconds in all, with a countdown: for checkpoints still being written to
        the persistent folder, then for Drive to upload them. When the writing cannot finish (Drive
        down) the run stays open: call `finish()` again to keep waiting. What is written but not in the
        cloud by then is said plainly (the run finishes; `finish()` again waits for it again).

        Args:
            timeout: seconds to wait in all (None: no limit).
            status: recorded in the `finish` event.
            flush: then Colab's `drive.flush_and_unmount()`: pushes Drive's cache and UNMOUNTS Drive.
            release_runtime: then give the Colab runtime back, only if everything is confirmed in the cloud
                (else it is kept, saying why: `run/release.py`).

        Returns:
            `status()` plus "status" ("unsynced": checkpoints wait, the run stays open), "synced", "in_cloud".
        """
        from ..lifecycle.finish import finish_run
        from .release import release_runtime as release
        summary = finish_run(self, timeout, status, flush=flush, cloud_wait=True)
        if release_runtime:
            release(self, summary)
        return summary

    def _require_own_process(self, what: str) -> None:
        if os.getpid() != self._pid:
            raise ColabKitError(
                f"run {self.name!r} was opened by process {self._pid} and this is process {os.getpid()}, a copy "
                f"made by fork (notebook_launcher starts each training process that way), so it cannot {what}: "
                f"the uploader and the lease heartbeat do not run in a copy. Call ck.start_run({self.name!r}, ...) "
                f"inside the function you pass to notebook_launcher, so that every process opens the run itself "
                f"(rank 0 writes, the others follow)")

    def _require_open(self, what: str) -> None:
        self._require_own_process(what)
        if self._finished:
            raise ColabKitError(f"run {self.name!r} is finished, so it cannot {what}: run the start_run cell "
                                f"again (with the notebook's own settings; it resumes from the newest checkpoint), "
                                f"then this cell")

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(status="finished" if exc_type is None else "error")

    def __repr__(self) -> str:
        return f"Run({self.name!r}, drive_dir={str(self.drive_dir)!r}, resume_from={self.resume_from})"
