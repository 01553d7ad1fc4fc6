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
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import tempfile
import uuid
from pathlib import Path

from ..checkpoints.clock import clock
from .._notices import Notices
from ..checkpoints import storage
from ..checkpoints.checkpoint import CHECKPOINTS, checkpoint_dir, list_checkpoints, model_signature
from ..checkpoints.search import search_checkpoints
from ..checkpoints.journal import EVENTS, Journal, read_history
from ..checkpoints.snapshot import SNAPSHOTS, take_snapshot
from ..drive.drivefs import folder_kind
from ..drive.mirror import Mirror
from ..errors import CheckpointError, DriveError, LeaseLostError, ResumeMismatchError
from .finish import wait_for_cloud

__all__ = ["CheckpointStore"]

log = logging.getLogger(__name__)
MODEL_FILE = "model.safetensors"
RNG_FILE = "rng_state.pt"
EXTRA_FILE = "extra.pt"
_STATE_FILES = {"optimizer": "optimizer.pt", "scheduler": "scheduler.pt", "scaler": "scaler.pt"}


def _rng_state() -> dict:
    import numpy as np
    import torch

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        # numpy's state holds an ndarray, which weights_only loading refuses: store plain ints.
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    import numpy as np
    import torch

    random.setstate(_as_tuple(state["python"]))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _as_tuple(obj):
    return tuple(_as_tuple(x) for x in obj) if isinstance(obj, (list, tuple)) else obj


def _save_fsynced(obj, path: Path) -> None:
    import torch

    with open(path, "wb") as fh:
        torch.save(obj, fh)
        fh.flush()
        os.fsync(fh.fileno())


class CheckpointStore:
    """Durable, verified checkpoints of a state-dict set, for plain PyTorch loops.

    Args:
        dir: the persistent folder (a Drive folder in Colab); checkpoints go to
            `dir/checkpoints/checkpoint-<step>/`, events to `dir/events.jsonl`.
        keep: checkpoints in the cloud kept on `dir` (older ones are deleted once a newer one is in
            the cloud; on Google Drive that is when DriveFS reports it uploaded).
        local_dir: fast local scratch for staging; a temporary folder by default.

    Attributes:
        extra: the keyword arguments given to the `save` that `restore_latest` restored.
    """

    def __init__(self, dir: str | os.PathLike, keep: int = 3, *, local_dir: str | os.PathLike | None = None,
                 _journal: Journal | None = None, _notices: Notices | None = None,
                 _mirror: Mirror | None = None):
        if int(keep) < 1:
            raise ValueError(f"keep={keep!r}: keep at least 1 checkpoint")
        self.dir = Path(dir)
        self.keep = int(keep)
        storage.make_dirs(self.dir / CHECKPOINTS)
        self.local_dir = Path(local_dir) if local_dir else Path(tempfile.mkdtemp(prefix="colab_kit-store-"))
        self.local_dir.mkdir(parents=True, exist_ok=True)
        self._notices = _notices or Notices()
        self._journal = _journal or Journal(self.dir / EVENTS)
        self._owns_mirror = _mirror is None
        if _mirror is None:
            _mirror = Mirror(self.dir, keep=self.keep, journal=self._journal, notices=self._notices, kind=folder_kind(self.dir))
        self._mirror = _mirror
        # What is already in the folder is adopted (and may be pruned) only after restore_latest has
        # looked at it, or at the first save: a damaged checkpoint is named to the user, not just deleted.
        self._adopted = not self._owns_mirror
        self.extra: dict = {}
        self._closed = False

    # -- saving ----------------------------------------------------------------------------
    def save(self, step: int, model=None, optimizer=None, scheduler=None, scaler=None, **extra) -> Path:
        """Write a checkpoint locally and queue its upload; returns the local folder.

        Args:
            step: the number of optimizer steps done (names the folder).
            model: saved with safetensors (shared/tied tensors handled).
            optimizer, scheduler, scaler: their `state_dict()`s.
            **extra: small picklable-free values (numbers, strings, lists, dicts, tensors),
                available as `store.extra` after `restore_latest`.
        """
        from safetensors.torch import save_model

        if self._closed:
            raise CheckpointError("this CheckpointStore is closed; create a new one to save again")
        if self._mirror.closed:  # the run it came from is finished: nothing would copy this checkpoint
            raise CheckpointError(f"the run this CheckpointStore belongs to is finished, so checkpoint-{int(step)} "
                                  f"would never reach {self.dir}: run start_run again and take a new "
                                  f"store from it (run.checkpoint_store()); it resumes from the newest checkpoint")
        if self._mirror.paused:  # the lease was lost: another runtime writes the folder now
            raise LeaseLostError(f"{self._mirror.unsynced_reason}: checkpoint-{int(step)} is not saved, and this "
                                 f"runtime should train no further. Continue in the runtime that took over; or, to "
                                 f"take the run back here, run the start_run cell again with takeover=True")
        self._adopt()
        step = int(step)
        staging = self.local_dir / f".staging-{step}-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        try:
            if model is not None:
                save_model(model, str(staging / MODEL_FILE))
            for key, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
                if obj is not None:
                    _save_fsynced(obj.state_dict(), staging / _STATE_FILES[key])
            _save_fsynced(_rng_state(), staging / RNG_FILE)
            _save_fsynced(dict(extra), staging / EXTRA_FILE)
            for path in staging.iterdir():  # safetensors does not fsync
                with open(path, "rb+") as fh:
                    os.fsync(fh.fileno())
            final = checkpoint_dir(self.local_dir, step)
            if final.exists():
                shutil.rmtree(final)
            os.replace(staging, final)
            storage.fsync_dir(self.local_dir)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        fingerprint = model_signature(model) if model is not None else {}
        self._mirror.submit(take_snapshot(final, self.local_dir / SNAPSHOTS, step, fingerprint))
        self._journal.write("save", step=step, local=str(final))
        for _, old in list_checkpoints(self.local_dir)[self.keep:]:
            shutil.rmtree(old, ignore_errors=True)  # the snapshot keeps its own links
        self._notices.show()
        return final

    # -- restoring ---------------------------------------------------------------------------
    def restore_latest(self, model=None, optimizer=None, scheduler=None, scaler=None, *,
                       map_location="cpu") -> int | None:
        """Load the newest checkpoint that verifies; returns its step, or None when there is none.

        Invalid checkpoints (no manifest, truncated or corrupted files) are skipped with a
        warning naming them. RNG states (Python, NumPy, torch CPU and CUDA) are restored too.

        Raises:
            ResumeMismatchError: the checkpoint's tensors do not fit `model`.
            DriveError: checkpoints exist but none could be read (retried first): never taken for none.
        """
        import torch
        from safetensors.torch import load_model

        def skipped(path: Path, reason: str) -> None:
            self._notices.add(f"skipping checkpoint {path}: {reason}")
            self._journal.write("warn", what="invalid_checkpoint", path=str(path), reason=reason)

        try:
            told = read_history(self.dir / EVENTS, expected=bool(list_checkpoints(self.dir / CHECKPOINTS)))
        except OSError as exc:
            raise DriveError(f"the journal of {self.dir} ({EVENTS}) could not be read ({exc}), so which checkpoints "
                             f"reached the cloud is unknown: nothing was restored or deleted. Call restore_latest() "
                             f"again once the folder answers") from exc
        search = search_checkpoints([("drive", self.dir / CHECKPOINTS), ("local", self.local_dir)],
                                    self.local_dir, on_skip=skipped, told=told)
        if search.blocked:
            path, reason = search.blocked[0]
            raise DriveError(f"{path.name} in {self.dir / CHECKPOINTS} cannot be used now ({reason}), so nothing was "
                             f"restored (an older checkpoint is never taken in its place) and nothing was deleted. "
                             f"Call restore_latest() again in a minute")
        for path, reason in search.unreadable:
            self._journal.write("warn", what="unreadable_checkpoint", path=str(path), reason=reason)
        if search.unreadable and search.found is None:  # "could not read" is never "nothing to restore"
            raise DriveError(f"checkpoints in {self.dir / CHECKPOINTS} could not be read "
                             f"({'; '.join(f'{p.name}: {r}' for p, r in search.unreadable)}), so nothing was "
                             f"restored and nothing was deleted. Call restore_latest() again once the folder "
                             f"answers, or save into another folder to start fresh")
        if search.unreadable:
            self._notices.add(f"could not read {', '.join(p.name for p, _ in search.unreadable)}; restoring "
                              f"checkpoint-{search.found.step}, the newest that could be read")
        self._adopt()
        self._notices.show()
        found = search.found
        if found is None:
            return None
        saved = found.manifest.fingerprint
        if model is not None and saved.get("model") and saved["model"] != model_signature(model)["model"]:
            raise ResumeMismatchError(
                f"checkpoint-{found.step} in {found.source.parent} holds a model of "
                f"{saved.get('parameters', '?'):,} parameters with different tensor names or shapes "
                f"than this one ({model_signature(model)['parameters']:,}). Load it into the same "
                f"architecture, or save into a new folder: ck.CheckpointStore('<another folder>')")
        path = found.path
        if model is not None:
            load_model(model, str(path / MODEL_FILE), strict=True)
        for key, obj in (("optimizer", optimizer), ("scheduler", scheduler), ("scaler", scaler)):
            if obj is not None:
                file = path / _STATE_FILES[key]
                if not file.exists():
                    raise CheckpointError(f"checkpoint-{found.step} has no {key} state ({file.name}); "
                                          f"it was saved without {key}=")
                obj.load_state_dict(torch.load(file, map_location=map_location, weights_only=True))
        self.extra = torch.load(path / EXTRA_FILE, map_location=map_location, weights_only=True)
        _set_rng_state(torch.load(path / RNG_FILE, weights_only=True))
        self._journal.write("resume", step=found.step, origin=found.origin, source=str(found.source))
        return found.step

    def _adopt(self) -> None:
        if not self._adopted:
            self._adopted = True
            self._mirror.adopt_existing()

    # -- lifecycle -----------------------------------------------------------------------------
    def wait(self, timeout: float | None = None) -> bool:
        """Block until every saved checkpoint is written to `dir` and in the cloud; False on timeout
        (and always False on a Drive mount that cannot confirm uploads)."""
        deadline = None if timeout is None else clock.monotonic() + timeout
        done = self._mirror.drain(timeout) and wait_for_cloud(self._mirror.tracker, deadline)
        self._notices.show()
        return done

    def close(self, timeout: float | None = 600) -> bool:
        """Wait for pending uploads (up to `timeout` seconds) and stop the worker; idempotent."""
        if self._closed:
            return True
        done = self.wait(timeout)
        if not done:
            tracker = self._mirror.tracker
            self._notices.add(f"not everything is in the cloud: {tracker.describe()}; not yet written to "
                              f"{self.dir}: {self._mirror.pending_steps or 'none'} "
                              f"({self._mirror.unsynced_reason or 'upload still running'})")
            self._notices.show()
        if self._owns_mirror:
            self._mirror.close()
        self._closed = True
        return done

    def __enter__(self) -> "CheckpointStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
