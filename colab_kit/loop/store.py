"""CheckpointStore: the kit's durable checkpoints for plain PyTorch training loops.

    store = ck.CheckpointStore(run.drive_dir, keep=3)        # or run.checkpoint_store()
    step = store.restore_latest(model=model, optimizer=opt, scheduler=sched) or 0
    for step in range(step, total_steps):
        ...train one step...
        if (step + 1) % 100 == 0:
            store.save(step + 1, model=model, optimizer=opt, scheduler=sched, epoch=epoch)
    store.close()   # waits for the last upload

`save` writes to local disk (fast) and returns; a background worker mirrors the checkpoint to
`<dir>/checkpoints/checkpoint-<step>/` with the same guarantees as the Trainer path. Model
tensors go to safetensors; everything else is read back with `torch.load(weights_only=True)`.

Under several processes (torchrun, DDP or FSDP2) every rank creates the store and calls `save` and
`restore_latest` with the same arguments, as it calls the collectives of its training step. Rank 0
chooses, writes the replicated state and mirrors; every rank writes its RNG state and, for a sharded
model (FSDP2), its own shards (`distributed/sharded.py`), in the background unless `async_save=False`.
Each phase ends in one small agreement (`agreement.py`): when a rank fails, every rank raises, the
failing one its own exception, the others a `RankFailedError` naming it, and none is left waiting.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from ..checkpoints.clock import clock
from .._notices import Notices
from .._units import format_bytes
from ..checkpoints import storage
from ..checkpoints.checkpoint import CHECKPOINTS, checkpoint_dir, list_checkpoints, model_signature
from ..checkpoints.journal import EVENTS, Journal
from ..checkpoints.snapshot import SNAPSHOTS, take_snapshot
from ..distributed import ranks, sharded
from ..distributed.agreement import agree_outcome
from ..drive.drivefs import folder_kind
from ..drive.mirror import Mirror
from . import statefiles
from ..lifecycle.finish import wait_a_while
from .storefind import check_fits, find_checkpoint
from .storeload import restore_into
from .storerules import refuse_launch, refuse_unusable

__all__ = ["CheckpointStore"]

log = logging.getLogger(__name__)
_SAVE, _RESTORE, _OPEN, _WAIT = "checkpoint save", "checkpoint restore", "checkpoint store", "checkpoint wait"
# The store's agreements run on a gloo group of their own: while rank 0 fetches a checkpoint or waits for
# uploads, the other ranks wait in one of them, up to this long (the default group's timeout is 10 minutes
# on NCCL); waits for uploads go in slices of _SLICE_S, each ending in an agreement.
_AGREE_MINUTES, _SLICE_S = 60, 60.0


def _failure(exc: BaseException, rank: int) -> BaseException | None:
    """What this rank reports to the agreement for `exc`: its own error (None when DCP says only other ranks
    failed). An interrupt or exit is not reported: it is raised at once."""
    if not isinstance(exc, Exception) and type(exc).__name__ != "CheckpointException":
        raise exc
    return sharded.own_error(exc, rank)


class CheckpointStore:
    """Durable, verified checkpoints of a state-dict set, for plain PyTorch loops.

    Args:
        dir: the persistent folder (a Drive folder in Colab); checkpoints go to
            `dir/checkpoints/checkpoint-<step>/`, events to `dir/events.jsonl`.
        keep: checkpoints in the cloud kept on `dir` (older ones are deleted once a newer one is in
            the cloud; on Google Drive that is when DriveFS reports it uploaded).
        local_dir: fast local scratch for staging; a temporary folder by default (rank 0's, for every
            rank of the machine).
        async_save: write a sharded model's shards in the background (the loop pauses only while they are
            copied to host RAM, which holds one checkpoint's worth per process until the write ends).

    Attributes:
        extra: the keyword arguments given to the `save` that `restore_latest` restored.
    """

    def __init__(self, dir: str | os.PathLike, keep: int = 3, *, local_dir: str | os.PathLike | None = None,
                 async_save: bool = True, _journal: Journal | None = None, _notices: Notices | None = None,
                 _mirror: Mirror | None = None):
        if int(keep) < 1:
            raise ValueError(f"keep={keep!r}: keep at least 1 checkpoint")
        self.dir, self.keep, self.async_save = Path(dir), int(keep), bool(async_save)
        refuse_launch(ranks.detect())  # the same answer on every rank (the launcher's environment): nobody waits
        self._rank, self._world = ranks.place()
        self._writer = self._rank == 0
        self._pg = ranks.side_group(_AGREE_MINUTES) if self._world > 1 else None
        self.async_save = bool(ranks.broadcast_object(self.async_save, self._pg))  # one answer: it makes groups
        self._shards = sharded.ShardWriter(background=self.async_save)
        self._notices = _notices or Notices()
        self._pending: tuple[int, Path, dict] | None = None  # a background save: (step, staging, fingerprint)
        self.extra: dict = {}
        self._journal, self._mirror, self._owns_mirror, self._closed = None, None, False, False
        # One staging folder for every rank of the machine (DCP writes every rank's shards into one): rank 0's.
        made = self._agreed(lambda: str(local_dir or tempfile.mkdtemp(prefix="colab_kit-store-"))
                            if self._writer else None, _OPEN)
        self.local_dir = Path(ranks.broadcast_object(made, self._pg))
        try:
            self._agreed(lambda: self._open(_journal, _mirror), _OPEN)
        except BaseException:
            if self._owns_mirror and self._mirror is not None:
                self._mirror.close()
            raise
        # What is already in the folder is adopted (and may be pruned) only after restore_latest has
        # looked at it, or at the first save: a damaged checkpoint is named to the user, not just deleted.
        self._adopted = not self._owns_mirror

    def _open(self, journal: Journal | None, mirror: Mirror | None) -> None:
        self.local_dir.mkdir(parents=True, exist_ok=True)
        if not self._writer:
            return  # the followers never touch the persistent folder
        storage.make_dirs(self.dir / CHECKPOINTS)
        self._journal = journal or Journal(self.dir / EVENTS)
        self._owns_mirror = mirror is None
        self._mirror = mirror or Mirror(self.dir, keep=self.keep, journal=self._journal, notices=self._notices,
                                        kind=folder_kind(self.dir))
        statefiles.remove_abandoned_staging(self.local_dir)

    # -- saving ----------------------------------------------------------------------------
    def save(self, step: int, model=None, optimizer=None, scheduler=None, scaler=None, **extra) -> Path:
        """Write a checkpoint locally and queue its upload; returns the local folder.

        Under several processes every rank calls it. A sharded model's shards may still be written in the
        background when it returns: the next call of the store finishes that save first (one in flight).

        Args:
            step: the number of optimizer steps done (names the folder).
            model: saved with safetensors (shared/tied tensors handled); a sharded model (FSDP2) with
                torch.distributed.checkpoint, together with `optimizer`.
            optimizer: its `state_dict()`.
            scheduler: its `state_dict()`.
            scaler: its `state_dict()` (a `torch.amp.GradScaler`).
            **extra: small picklable-free values (numbers, strings, lists, dicts, tensors),
                available as `store.extra` after `restore_latest`.

        Raises:
            RankFailedError: another rank failed in this save (this rank's own error is raised as it is)."""
        self._finish_pending()
        step = int(step)
        is_sharded = model is not None and sharded.is_sharded(model)
        background = is_sharded and self.async_save
        staging = self.local_dir / ranks.broadcast_object(statefiles.staging_name(step, uuid.uuid4().hex[:8]),
                                                          self._pg)
        try:
            fingerprint = self._agreed(lambda: self._write_rank_files(step, staging, is_sharded, model, optimizer,
                                                                      scheduler, scaler, extra), _SAVE, step)
            if is_sharded:  # each of these either reaches DCP's collectives on every rank or fails before any
                state = self._agreed(lambda: sharded.state(model, optimizer), _SAVE, step)
                background = background and self._room_for_copy(state, step)
                self._start(staging, state, background, step)
        except BaseException:
            self._discard(staging)
            raise
        if background:
            self._pending = (step, staging, fingerprint)
            return checkpoint_dir(self.local_dir, step)
        return self._publish(step, staging, fingerprint)

    def _start(self, staging: Path, state: dict, background: bool, step: int) -> None:
        try:
            self._agreed(lambda: self._shards.start(staging / sharded.SHARDS, state, background=background),
                         _SAVE, step)
        except Exception:  # raised on every rank by the agreement: none may keep a half-begun save
            self._shards.abandon()
            raise

    def _room_for_copy(self, state: dict, step: int) -> bool:
        """Every rank has host RAM for its async copy (else all save in the foreground: one kind of save)."""
        fits, need, _ = self._agreed(lambda: sharded.room_for_copy(state), _SAVE, step)
        short = ranks.all_agree(fits, self._pg)
        if short and self._writer:
            self._notices.add(f"checkpoint-{step} is written in the foreground: a background save copies each "
                              f"rank's shards to host RAM first ({format_bytes(need)} on rank 0), and rank(s) "
                              f"{short} have less than twice their copy's size free")
        return not short

    def _write_rank_files(self, step, staging, is_sharded, model, optimizer, scheduler, scaler, extra) -> dict:
        if self._writer:
            refuse_unusable(self, step)
            self._adopt()
        statefiles.write_rank_files(staging, self._rank, self._world, sharded=is_sharded, model=model,
                                    optimizer=optimizer, scheduler=scheduler, scaler=scaler, extra=extra)
        return model_signature(model) if model is not None and self._writer else {}

    def _finish_pending(self) -> None:
        """Wait for the background save, agree that every rank wrote its shards, and publish it."""
        if self._pending is None:
            return
        step, staging, fingerprint = self._pending
        self._pending = None
        try:
            self._agreed(self._shards.finish, _SAVE, step)
        except BaseException:
            self._discard(staging)
            raise
        self._publish(step, staging, fingerprint)

    @property
    def pending_step(self) -> int | None:
        """The step of the save still being written in the background (published by the next call), or None."""
        return self._pending[0] if self._pending else None

    def _publish(self, step: int, staging: Path, fingerprint: dict) -> Path:
        """Rank 0 renames the finished checkpoint into place and queues its upload; every rank learns how it went."""
        final = checkpoint_dir(self.local_dir, step)

        def publish() -> None:
            if not self._writer:
                return
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            storage.fsync_dir(self.local_dir)
            self._mirror.submit(take_snapshot(final, self.local_dir / SNAPSHOTS, step, fingerprint))
            self._journal.write("save", step=step, local=str(final))
            for _, old in list_checkpoints(self.local_dir)[self.keep:]:
                shutil.rmtree(old, ignore_errors=True)  # the snapshot keeps its own links

        try:  # every file is fsynced by its writer (DCP's too: its FileSystemWriter syncs by default)
            self._agreed(publish, _SAVE, step)
        except BaseException:
            self._discard(staging)
            raise
        self._show()
        return final

    # -- restoring ---------------------------------------------------------------------------
    def restore_latest(self, model=None, optimizer=None, scheduler=None, scaler=None, *,
                       map_location="cpu") -> int | None:
        """Load the newest checkpoint that verifies; returns its step, or None when there is none.

        Invalid checkpoints (no manifest, truncated or corrupted files, a shard or `.metadata` missing) are
        skipped with a warning naming them. RNG states (Python, NumPy, torch CPU and CUDA) are restored too,
        each rank's its own. A checkpoint of a sharded model loads into another number of processes, and
        into a plain model on one process (and a plain checkpoint into a sharded model).

        Raises:
            ResumeMismatchError: the checkpoint's tensors do not fit `model`.
            DriveError: checkpoints exist but none could be read (retried first): never taken for none.
            RankFailedError: another rank failed in this restore.
        """
        self._finish_pending()
        found, has_shards = self._agreed(lambda: self._choose(model), _RESTORE) or (None, False)
        chosen = ranks.broadcast_object(found and (found.step, str(found.path), has_shards), self._pg)
        if chosen is None:
            return None
        step, path, has_shards = chosen
        self.extra = restore_into(self._agreed, Path(path), step, has_shards, self._rank, model=model,
                                  optimizer=optimizer, scheduler=scheduler, scaler=scaler, map_location=map_location)
        if found is not None:
            self._journal.write("resume", step=found.step, origin=found.origin, source=str(found.source))
        return step

    def _choose(self, model):
        """Rank 0: (the checkpoint to restore or None, whether it holds shards), checked against `model`."""
        if not self._writer:
            return None
        found = find_checkpoint(self.dir, self.local_dir, self._journal, self._notices)
        self._adopt()
        self._show()
        if found is not None:
            check_fits(found, model)
        return found, found is not None and (found.path / sharded.SHARDS).is_dir()

    def _adopt(self) -> None:
        if not self._adopted:
            self._adopted = True
            self._mirror.adopt_existing()

    # -- every rank together -----------------------------------------------------------------
    def _agreed(self, part, where: str, step: int | None = None):
        """Run `part` on this rank, then let every rank learn whether any rank failed in it (and raise);
        returns what `part` returned."""
        error = value = None
        try:
            value = part()
        except BaseException as exc:
            error = _failure(exc, self._rank)
        agree_outcome(error, where, step=step, pg=self._pg)
        return value

    def _discard(self, staging: Path) -> None:
        if self._writer:
            shutil.rmtree(staging, ignore_errors=True)

    def _show(self) -> None:
        if self._writer:
            self._notices.show()

    # -- lifecycle -----------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Block until every saved checkpoint is written to `dir` and in the cloud; False on timeout
        (and always False on a Drive mount that cannot confirm uploads). Every rank gets rank 0's answer."""
        self._finish_pending()
        deadline = None if timeout is None else clock.monotonic() + timeout
        while True:  # in slices, each ending in an agreement: no rank waits long inside one collective
            waited = self._agreed(lambda: self._writer and wait_a_while(self._mirror, deadline, _SLICE_S), _WAIT)
            done, final = ranks.broadcast_object(waited, self._pg)
            self._show()
            if final:
                return done

    def close(self, timeout: float | None = 600) -> bool:
        """Wait for pending uploads (up to `timeout` seconds) and stop the worker; idempotent."""
        if self._closed:
            return True
        done = self.wait(timeout)
        if not done and self._writer:
            tracker = self._mirror.tracker
            self._notices.add(f"not everything is in the cloud: {tracker.describe()}; not yet written to "
                              f"{self.dir}: {self._mirror.pending_steps or 'none'} "
                              f"({self._mirror.unsynced_reason or 'upload still running'})")
            self._notices.show()
        if self._owns_mirror:
            self._mirror.close()
        self._shards.close()  # nothing is in flight: wait() finished it
        ranks.drop_group(self._pg)
        self._pg, self._closed = None, True
        return done

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None or self._world == 1:
            self.close()
        elif not self._closed:  # an error on this rank alone: no collective (the others may not come)
            if self._writer:  # what was published still goes up (the worker needs no other rank)
                self._mirror.drain(600)
            if self._owns_mirror:
                self._mirror.close()
            self._closed = True

