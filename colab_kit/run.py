"""`start_run`: one call that makes a training run survive a Colab disconnect.

    run = ck.start_run("rna-bert", save_every="10min", keep=3)
    trainer = Trainer(..., args=TrainingArguments(output_dir=run.local_dir, ...))
    run.train(trainer)          # resumes from Drive, mirrors checkpoints, finishes

After a reconnect, "Runtime -> Run all" runs the same cells: `start_run` finds the newest
checkpoint whose manifest verifies (on Drive or still on local disk), copies it to local disk
and `run.train` continues from it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import shutil
import time
import weakref
from datetime import datetime, timezone
from pathlib import Path

from . import storage
from ._notices import Notices
from ._units import format_age, format_bytes, is_count, parse_duration
from .checkpoint import ARCHIVE, CHECKPOINTS, FINAL, KIT_STATE, Found, find_latest, list_checkpoints
from .drive import flush_hint, remount_drive, resolve_root
from .errors import ColabKitError, DriveError
from .journal import EVENTS, Journal
from .lease import Lease, LeaseInfo
from .runtime import RuntimeInfo, detect_runtime, in_colab
from .sync import SNAPSHOTS, Mirror, take_snapshot

__all__ = ["Run", "start_run"]

log = logging.getLogger(__name__)
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_ACTIVE: dict[str, "weakref.ref[Run]"] = {}  # run folder -> the open Run of this process
_REMOUNT_EVERY_S = 300.0


def _default_local_dir(name: str) -> Path:
    # In Colab /content is the fast VM disk (wiped on disconnect); elsewhere a folder beside
    # ./drive, so a restart on the same machine can still resume from local checkpoints.
    return Path("/content/colab_kit_local" if in_colab() else "scratch").absolute() / name


class _TrainClock:
    """Training wall time, carried across resumes (so "every 10min" means training time)."""

    def __init__(self, seconds: float = 0.0):
        self._base = float(seconds)
        self._t0: float | None = None

    def start(self) -> None:
        if self._t0 is None:
            self._t0 = time.monotonic()

    def stop(self) -> None:
        if self._t0 is not None:
            self._base += time.monotonic() - self._t0
            self._t0 = None

    @property
    def seconds(self) -> float:
        return self._base + (time.monotonic() - self._t0 if self._t0 is not None else 0.0)


class Run:
    """A training run with a persistent folder; made by `start_run`.

    Attributes:
        name: the run name (the folder name under the persistent root).
        drive_dir: the persistent folder, `<root>/<name>/`.
        local_dir: fast local scratch where the Trainer writes (`output_dir`).
        resume_from: local path of the newest valid checkpoint, or None on a fresh run.
        runtime: what `start_run` detected (Colab, GPU, RAM limit).
    """

    def __init__(self, name: str, drive_dir: Path, local_dir: Path, *, on_drive: bool,
                 save_every_s: float | None, save_every_steps: int | None, keep: int,
                 runtime: RuntimeInfo, lease: Lease, journal: Journal, notices: Notices, gauges: bool = True):
        from . import __version__

        self.name = name
        self.drive_dir = drive_dir
        self.local_dir = local_dir
        self.on_drive = on_drive
        self.save_every_s = save_every_s
        self.save_every_steps = save_every_steps
        self.keep = keep
        self.runtime = runtime
        self.lease = lease
        self.journal = journal
        self.notices = notices
        self.resume_from: Path | None = None
        self.resume_manifest = None
        self.resume_state: dict = {}
        self.clock = _TrainClock()
        self.mirror = Mirror(drive_dir, keep=keep, journal=journal, notices=notices,
                             kit_version=__version__, on_disconnected=self._want_remount)
        self.fingerprint: dict | None = None
        self.show_gauges = gauges
        self.last_saved_step: int | None = None
        self.global_step: int | None = None  # where the last run.train ended
        self.micro_batching = None  # the TrainerMicroBatching of the last run.train
        self._callbacks: list | None = None
        self._remount_wanted = False
        self._last_remount = 0.0
        self._finished = False
        self._summary: dict | None = None

    # -- callbacks and training ----------------------------------------------------------------
    def callbacks(self) -> list:
        """The kit's `transformers.TrainerCallback`s for this run (the same objects each call):
        time/step-based saves, Drive mirroring and, unless `start_run(gauges=False)`, live gauges."""
        if self._callbacks is None:
            from .callbacks import DriveSyncCallback, GaugesCallback, SaveScheduleCallback

            self._callbacks = [SaveScheduleCallback(self), DriveSyncCallback(self)]
            if self.show_gauges:
                self._callbacks.append(GaugesCallback(self))
        return list(self._callbacks)

    def train(self, trainer, *, oom_recovery: bool = True, grow_back_after: int | None = None,
              micro_batch: int | None = None, **train_kwargs):
        """Resume, train with the kit's callbacks and OOM recovery, and finish; returns the TrainOutput.

        Adds any of `callbacks()` the trainer lacks (no duplicates), resumes from
        `resume_from` unless `resume_from_checkpoint` is given, runs each optimizer step's
        effective batch as micro-batches that halve on out-of-memory (same effective batch,
        schedule and data order), and calls `finish()` at the end, also when training fails.

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
        from .training import train

        self._require_open("train")
        return train(self, trainer, oom_recovery=oom_recovery, grow_back_after=grow_back_after,
                     micro_batch=micro_batch, **train_kwargs)

    def check_compatible(self, model, args) -> None:
        """Stop before training when the checkpoint to resume from cannot fit this model and these
        arguments (different tensor shapes or effective batch), with the call that starts fresh.

        Raises:
            ResumeMismatchError: what changed, and `ck.start_run(name, resume=False)`.
        """
        from .training import check_compatible

        check_compatible(self, model, args)

    def save_final(self, model, tokenizer=None, metrics: dict | None = None, retries: int = 3) -> Path:
        """Export the trained model to `<drive_dir>/final/`: safetensors, config, tokenizer, metrics
        (the metrics also go to `<drive_dir>/metrics.json`).

        Written to local disk first, then copied to the persistent folder with every file read
        back and verified, MANIFEST.json last. Works after `finish()` too.

        Returns:
            The `final/` folder on the persistent folder.

        Raises:
            DriveError: the copy kept failing; the export stays on local disk (the message says where).
        """
        from .checkpoint import publish_folder
        from .manifest import Manifest, hash_folder

        local = self.local_dir / FINAL
        if local.exists():
            shutil.rmtree(local)
        model.save_pretrained(local, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(local)
        metrics_json = (json.dumps(metrics, indent=1, default=float) + "\n").encode() if metrics is not None else None
        if metrics_json is not None:
            (local / "metrics.json").write_bytes(metrics_json)
        from . import __version__

        manifest = Manifest(step=int(self.global_step or 0), files=hash_folder(local), kit_version=__version__,
                            fingerprint=self.fingerprint or {})
        target = self.drive_dir / FINAL
        for attempt in range(1, retries + 1):
            try:
                publish_folder(local, target, manifest)
                break
            except OSError as exc:
                if attempt == retries:
                    raise DriveError(f"could not copy the final model to {target}: {exc}. It is saved on local "
                                     f"disk at {local}; copy it yourself, or call run.save_final(...) again "
                                     f"when Drive works") from exc
                time.sleep(2 ** attempt)
        if metrics_json is not None:
            storage.atomic_write_bytes(self.drive_dir / "metrics.json", metrics_json)
        self.journal.write("final", path=str(target), bytes=manifest.total_bytes, files=len(manifest.files))
        print(f"colab_kit: final model saved to {target} ({format_bytes(manifest.total_bytes)}, "
              f"{len(manifest.files)} files, verified)")
        return target

    def checkpoint_store(self):
        """A `CheckpointStore` for plain PyTorch loops that shares this run's folder and uploader."""
        from .store import CheckpointStore

        return CheckpointStore(self.drive_dir, keep=self.keep, local_dir=self.local_dir,
                               _journal=self.journal, _notices=self.notices, _mirror=self.mirror)

    # -- main-thread housekeeping, called from the callbacks --------------------------------------
    def _want_remount(self) -> None:
        self._remount_wanted = True

    def poll(self) -> None:
        """Show queued warnings and remount Drive if the uploader asked (main thread only)."""
        self.notices.show()
        if self._remount_wanted and self.on_drive and time.monotonic() - self._last_remount > _REMOUNT_EVERY_S:
            self._remount_wanted = False
            self._last_remount = time.monotonic()
            try:
                remount_drive()
                self.journal.write("warn", what="remounted_drive")
            except Exception as exc:  # remounting is best effort; the uploader keeps retrying
                self.notices.add(f"remounting Google Drive failed: {exc}")

    def _lease_lost(self, holder: LeaseInfo | None) -> None:
        who = f"host {holder.host}, pid {holder.pid}" if holder else "another runtime"
        reason = f"another runtime ({who}) took over {self.drive_dir}; this one stopped syncing"
        self.mirror.pause(reason)
        self.notices.add(reason + ". Checkpoints from now on stay local to this runtime.")
        self.journal.write("warn", what="lease_lost", holder=who)

    # -- end -----------------------------------------------------------------------------------
    def status(self) -> dict:
        oom = self.micro_batching.summary() if self.micro_batching is not None else None
        return {
            "oom": oom,
            "name": self.name,
            "drive_dir": str(self.drive_dir),
            "durable_step": self.mirror.durable_step,
            "pending_steps": self.mirror.pending_steps,
            "sync_failures": self.mirror.total_failures,
            "unsynced_reason": self.mirror.unsynced_reason,
            "train_seconds": round(self.clock.seconds, 1),
        }

    def _close_gauges(self, error: str | None = None) -> None:
        from .callbacks import GaugesCallback

        for cb in self._callbacks or []:
            if isinstance(cb, GaugesCallback):
                cb.close(error=error)

    def finish(self, timeout: float | None = 600, status: str = "finished") -> dict:
        """Wait for pending uploads, record the finish, release the run folder; idempotent.

        When uploads cannot finish within `timeout` seconds (Drive down), says so and keeps the
        uploader running: call `finish()` again to keep waiting.
        """
        if self._finished:
            print(f"colab_kit: run {self.name!r} is already finished (newest durable checkpoint: "
                  f"step {self._summary.get('durable_step')}).")
            return dict(self._summary)
        self.clock.stop()
        self._close_gauges(error=None if status in ("finished", "completed") else status)
        self.poll()
        drained = self.mirror.drain(timeout)
        summary = self.status() | {"status": status, "synced": drained}
        if not drained and not self.mirror.paused:  # paused: another runtime owns the folder now
            self.notices.add(
                f"NOT YET ON DRIVE: checkpoint(s) {self.mirror.pending_steps} are only on local disk "
                f"({self.mirror.unsynced_reason or 'upload still running'}). Keep this runtime "
                f"connected and call run.finish() again to keep waiting.")
            self.journal.write("warn", what="finish_unsynced", **summary)
            self.notices.show()
            return summary
        self.journal.write("finish", **summary)
        self.journal.flush()
        self.mirror.close()
        self.lease.release()
        self._finished = True
        self._summary = summary
        _ACTIVE.pop(str(self.drive_dir), None)
        self.notices.show()
        durable = self.mirror.durable_step
        where = f"step {durable} is durable in {self.drive_dir}" if durable is not None else \
            f"no checkpoint was saved in this session; folder {self.drive_dir}"
        print(f"colab_kit: run {self.name!r} {status}; {where}.")
        if summary.get("oom"):
            print(f"colab_kit: {summary['oom']}.")
        if self.on_drive:
            print("colab_kit: " + flush_hint())
        return dict(summary)

    def _require_open(self, what: str) -> None:
        if self._finished:
            raise ColabKitError(f"run {self.name!r} is finished, so it cannot {what}; start it again "
                                f"(it resumes from its newest checkpoint): ck.start_run({self.name!r})")

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.finish(status="finished" if exc_type is None else "error")

    def __repr__(self) -> str:
        return f"Run({self.name!r}, drive_dir={str(self.drive_dir)!r}, resume_from={self.resume_from})"


def _parse_save_every(save_every) -> tuple[float | None, int | None]:
    if save_every is None:
        return None, None
    if isinstance(save_every, bool):
        raise ValueError("save_every must be a duration such as \"10min\" or an int number of steps")
    if isinstance(save_every, int):
        if save_every < 1:
            raise ValueError(f"save_every={save_every}: the number of steps must be at least 1")
        return None, save_every
    if isinstance(save_every, float):
        raise ValueError(f"save_every={save_every}: give an int number of steps, or a duration "
                         f"string such as \"90s\", \"10min\" or \"1h\"")
    return parse_duration(save_every), None


def _clean_local(local_dir: Path) -> None:
    # Leftovers of a killed process: snapshots whose upload never finished (the checkpoints
    # themselves are still there), half-fetched and half-staged folders.
    shutil.rmtree(local_dir / SNAPSHOTS, ignore_errors=True)
    for entry in local_dir.glob(".fetch-*"):
        shutil.rmtree(entry, ignore_errors=True)
    for entry in local_dir.glob(".staging-*"):
        shutil.rmtree(entry, ignore_errors=True)


def _archive_checkpoints(drive_dir: Path, local_dir: Path) -> Path | None:
    """Move old checkpoints aside for a fresh start (nothing is deleted from Drive)."""
    moved = None
    if list_checkpoints(drive_dir / CHECKPOINTS):
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        moved = drive_dir / ARCHIVE / f"checkpoints-{stamp}"
        storage.make_dirs(moved.parent)
        os.replace(drive_dir / CHECKPOINTS, moved)
    for _, path in list_checkpoints(local_dir):
        shutil.rmtree(path, ignore_errors=True)
    return moved


def start_run(name: str, *, drive: str | os.PathLike | None = None, local_dir: str | os.PathLike | None = None,
              save_every: str | int | None = "10min", keep: int = 3, resume: bool = True,
              takeover: bool = False, gauges: bool = True, heartbeat_s: float = 30.0, quiet: bool = False) -> Run:
    """Open (or reopen) a run whose checkpoints survive a runtime reset.

    Args:
        name: the run's name; its folder is `<root>/<name>/`.
        drive: the root folder playing the role of `MyDrive/colab_kit` (default: Google Drive in
            Colab, `$COLAB_KIT_DRIVE` when set, else `./drive`).
        local_dir: fast local scratch for the Trainer's `output_dir` (default: under /content in
            Colab, `./scratch/<name>` elsewhere).
        save_every: a duration of training time ("90s", "10min", "1h") or an int number of
            optimizer steps; None leaves saving to the Trainer's own `save_steps`. A final
            checkpoint is always saved at the last step.
        keep: checkpoints kept on the persistent folder.
        resume: False starts fresh, moving existing checkpoints to `<drive_dir>/archive/`.
        takeover: take the run folder over from another live runtime.
        gauges: live GPU/RAM gauges while `run.train` runs (a summary stays, and is written to
            `<drive_dir>/gauges.html`).
        heartbeat_s: lease heartbeat interval (a lease is stale after 4 missed beats).
        quiet: do not print the summary.

    Returns:
        The `Run`; `run.resume_from` is the checkpoint to continue from, or None.

    Raises:
        ValueError: bad arguments. DriveError: the persistent folder cannot be used.
        LeaseHeldError: another live runtime is writing this run (see `takeover`).
    """
    if not isinstance(name, str) or not _NAME_OK.match(name):
        raise ValueError(f"run name {name!r}: use letters, digits, '.', '_' and '-' (it becomes a "
                         f"folder name), for example ck.start_run('rna-bert')")
    if not is_count(keep):
        raise ValueError(f"keep={keep!r}: keep at least 1 checkpoint on Drive")
    save_every_s, save_every_steps = _parse_save_every(save_every)

    runtime = detect_runtime()
    root, on_drive = resolve_root(drive)
    drive_dir = root / name
    try:
        storage.make_dirs(drive_dir / CHECKPOINTS)
    except OSError as exc:
        raise DriveError(f"cannot create the run folder {drive_dir}: {exc}. Check that the folder "
                         f"is writable (and, on Drive, that it is not full), or pass drive='<another "
                         f"folder>'") from exc
    local = Path(local_dir).absolute() if local_dir is not None else _default_local_dir(name)
    local.mkdir(parents=True, exist_ok=True)

    previous = _ACTIVE.get(str(drive_dir))
    if previous is not None and previous() is not None and not previous()._finished:
        old = previous()
        print(f"colab_kit: closing the earlier open run {name!r} of this kernel first")
        old.finish(timeout=120, status="restarted")

    lease = Lease(drive_dir, heartbeat_s=heartbeat_s)
    try:
        replaced = lease.acquire(takeover=takeover, run_name=name)
    except OSError as exc:
        raise DriveError(f"cannot write the lease file in {drive_dir}: {exc}. Check that the folder is "
                         f"writable and not full, then run this cell again") from exc
    notices = Notices()
    journal = Journal(drive_dir / EVENTS, local_copy=local / EVENTS)
    _clean_local(local)

    archived = None if resume else _archive_checkpoints(drive_dir, local)
    run = Run(name, drive_dir, local, on_drive=on_drive, save_every_s=save_every_s,
              save_every_steps=save_every_steps, keep=keep, runtime=runtime, lease=lease,
              journal=journal, notices=notices, gauges=gauges)

    def skipped(path: Path, reason: str) -> None:
        notices.add(f"skipping checkpoint {path}: {reason}")
        journal.write("warn", what="invalid_checkpoint", path=str(path), reason=reason)

    found: Found | None = None
    if resume:
        found = find_latest([("drive", drive_dir / CHECKPOINTS), ("local", local)], local, on_skip=skipped)
    if found is not None:
        run.resume_from, run.resume_manifest = found.path, found.manifest
        try:
            run.resume_state = json.loads((found.path / KIT_STATE).read_text())
        except (OSError, ValueError):
            run.resume_state = {}
        run.clock = _TrainClock(run.resume_state.get("train_seconds", 0.0))
        for step, path in list_checkpoints(local):
            if step > found.step:  # unverifiable leftovers newer than what we resume from
                shutil.rmtree(path, ignore_errors=True)
        if found.origin == "drive":
            run.mirror.durable_step = found.step
        else:
            # Found on local disk (a kernel restart on the same VM): its upload may never have
            # finished, so queue it; the uploader skips it when Drive already has it.
            run.mirror.submit(take_snapshot(found.path, local / SNAPSHOTS, found.step,
                                            found.manifest.fingerprint))

    journal.write("start", run=name, drive_dir=str(drive_dir), local_dir=str(local),
                  host=lease.info.host, pid=lease.info.pid, colab=runtime.colab,
                  gpu=runtime.gpu.name if runtime.gpu else None, ram_limit=runtime.ram_limit_bytes,
                  save_every=save_every, keep=keep, took_over=replaced.host if replaced else None)
    if archived is not None:
        journal.write("archive", moved_to=str(archived))
    if found is not None:
        journal.write("resume", step=found.step, origin=found.origin, source=str(found.source),
                      checkpoint_age_s=round(time.time() - found.manifest.created, 1),
                      train_seconds=round(run.clock.seconds, 1))
    lease.start_heartbeat(run._lease_lost)
    _ACTIVE[str(drive_dir)] = weakref.ref(run)
    atexit.register(_finish_at_exit, weakref.ref(run))

    if not quiet:
        lines = [f"colab_kit · run {name!r}", *("  " + line for line in runtime.describe().splitlines()),
                 f"  persistent folder: {drive_dir}" + (" (Google Drive)" if on_drive else ""),
                 f"  local folder: {local}"]
        every = f"{save_every} of training" if save_every_s else (
            f"{save_every_steps} steps" if save_every_steps else "the Trainer's save_steps")
        lines.append(f"  saves: every {every} and at the end; {keep} kept on the persistent folder")
        if replaced is not None:
            lines.append(f"  took over the run folder from host {replaced.host}, pid {replaced.pid}")
        if archived is not None:
            lines.append(f"  fresh start: earlier checkpoints moved to {archived}")
        if found is not None:
            age = format_age(time.time() - found.manifest.created)
            lines.append(f"  resume: checkpoint-{found.step} (step {found.step}, saved {age} ago, "
                         f"{format_bytes(found.manifest.total_bytes)}, from "
                         f"{'Drive' if found.origin == 'drive' else 'local disk'})")
        else:
            lines.append("  resume: no checkpoint found, starting fresh")
        print("\n".join(lines))
    notices.show()
    return run


def _finish_at_exit(ref: "weakref.ref[Run]") -> None:
    run = ref()
    if run is not None and not run._finished:
        try:
            run.finish(timeout=120, status="exit")
        except Exception as exc:  # never let an exit handler raise
            log.warning("colab_kit: finishing run at exit failed: %s", exc)
