"""Mirror checkpoints from local disk to the persistent folder in a background thread.

The training loop only pays for a snapshot (hard links, or a local copy where links are not
possible) so that the Trainer's own pruning cannot delete files under the upload. A single
worker then, for the newest snapshot only:

1. hashes the snapshot (and leaves a MANIFEST.json beside the local checkpoint too),
2. copies every data file to `<drive_dir>/checkpoints/checkpoint-<step>/`, reading each back
   to verify size and sha256,
3. writes MANIFEST.json last, atomically, and reads it back,
4. only then prunes older checkpoints (never the newest valid one).

Drive errors (ENOSPC, EIO, permissions, errno 107 "Transport endpoint is not connected") are
retried with exponential backoff; they are reported, never raised into training.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import storage
from ._notices import Notices
from ._units import format_bytes
from .checkpoint import CHECKPOINTS, checkpoint_dir, prune_checkpoints, publish_folder
from .journal import Journal
from .manifest import MANIFEST, Manifest, hash_folder, read_manifest, verify_folder, write_manifest

__all__ = ["Snapshot", "Mirror", "take_snapshot"]

log = logging.getLogger(__name__)
SNAPSHOTS = ".snapshots"


@dataclass
class Snapshot:
    """An immutable local copy of one checkpoint, waiting to be mirrored."""

    step: int
    path: Path
    fingerprint: dict = field(default_factory=dict)
    stamps: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (size, mtime_ns)
    source: Path | None = None  # the folder it was taken from (gets a local MANIFEST too)
    taken: float = field(default_factory=time.time)


def _stamp(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns


def take_snapshot(source: str | Path, snapshots_root: str | Path, step: int,
                  fingerprint: dict | None = None) -> Snapshot:
    """Hard-link (or copy) every file of `source` into `snapshots_root/checkpoint-<step>`.

    Hard links cost no time or space and survive the Trainer deleting `source`. They share
    bytes with `source`, so the worker re-checks sizes and mtimes before trusting its hashes.
    """
    source = Path(source)
    target = Path(snapshots_root) / f"checkpoint-{step}"
    if target.exists():
        shutil.rmtree(target)
    stamps = {}
    for path in sorted(source.rglob("*")):
        if not path.is_file() or path.name == MANIFEST or storage.is_temp_name(path.name):
            continue
        name = path.relative_to(source).as_posix()
        dst = target / name
        dst.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(path, dst)
        except OSError:  # EXDEV, or a filesystem without hard links
            shutil.copy2(path, dst)
        stamps[name] = _stamp(dst)
    return Snapshot(step=step, path=target, fingerprint=dict(fingerprint or {}), stamps=stamps,
                    source=source)


class Mirror:
    """The background uploader of one run folder.

    Args:
        run_dir: the persistent run folder; checkpoints go to `run_dir/checkpoints/`.
        keep: checkpoints to keep on the persistent folder (at least 1).
        journal: where `sync` and `warn` events go.
        notices: where messages for the user go.
        kit_version: recorded in each manifest.
        on_disconnected: called (from the worker) on errno 107, to ask for a Drive remount.
    """

    def __init__(self, run_dir: str | Path, *, keep: int, journal: Journal, notices: Notices,
                 kit_version: str = "", on_disconnected: Callable[[], None] | None = None,
                 backoff: tuple[float, float] = (2.0, 120.0)):
        self.run_dir = Path(run_dir)
        self.keep = max(1, int(keep))
        self.journal = journal
        self.notices = notices
        self.kit_version = kit_version
        self.on_disconnected = on_disconnected
        self.backoff = backoff
        self.durable_step: int | None = None
        self.durable_time: float | None = None
        self.failures = 0  # consecutive failed attempts
        self.total_failures = 0
        self.unsynced_reason: str | None = None
        self._queued: Snapshot | None = None
        self._current: Snapshot | None = None
        self._paused = False
        self._closed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="colab_kit-mirror", daemon=True)
        self._thread.start()

    # -- main-thread API -------------------------------------------------------------------
    def submit(self, snapshot: Snapshot) -> None:
        """Queue `snapshot`; it replaces a queued, older one (never the one being uploaded)."""
        with self._cond:
            if self._closed or self._paused:
                _discard(snapshot)
                return
            if self._queued is not None:
                log.info("checkpoint-%d superseded by checkpoint-%d before upload",
                         self._queued.step, snapshot.step)
                _discard(self._queued)
            self._queued = snapshot
            self._cond.notify_all()

    @property
    def pending_steps(self) -> list[int]:
        with self._cond:
            return [s.step for s in (self._current, self._queued) if s is not None]

    @property
    def paused(self) -> bool:
        return self._paused

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted checkpoint is durable; False on timeout or when paused."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._paused:
                return False
            while self._current is not None or self._queued is not None:
                if self._paused:
                    return False
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(timeout=left if left is not None else 1.0)
        return True

    def pause(self, reason: str) -> None:
        """Stop uploading for good (the lease was lost to another runtime)."""
        with self._cond:
            self._paused = True
            self.unsynced_reason = reason
            for snap in (self._queued,):
                if snap is not None:
                    _discard(snap)
            self._queued = None
            self._cond.notify_all()

    def close(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=timeout)

    # -- worker ------------------------------------------------------------------------------
    def _next(self) -> Snapshot | None:
        with self._cond:
            while True:
                if self._closed or self._paused:
                    return None
                if self._current is None and self._queued is not None:
                    self._current, self._queued = self._queued, None
                if self._current is not None:
                    return self._current
                self._cond.wait()

    def _loop(self) -> None:
        while (snap := self._next()) is not None:
            try:
                self._upload(snap)
            except _SnapshotChanged as exc:  # overwritten in place: a newer save will follow
                self.notices.add(f"{exc}; skipped it")
                self.journal.write("warn", what="snapshot_changed", step=snap.step, error=str(exc))
            except OSError as exc:
                self._failed(snap, exc)
                continue
            except Exception as exc:  # a bug must not kill the thread silently
                log.exception("unexpected error mirroring checkpoint-%d", snap.step)
                self._failed(snap, exc)
                continue
            with self._cond:
                self._current = None
                self._cond.notify_all()
            _discard(snap)

    def _failed(self, snap: Snapshot, exc: BaseException) -> None:
        self.failures += 1
        self.total_failures += 1
        self.unsynced_reason = f"{type(exc).__name__}: {exc}"
        delay = min(self.backoff[1], self.backoff[0] * 2 ** (self.failures - 1))
        disconnected = isinstance(exc, OSError) and exc.errno == errno.ENOTCONN
        message = (f"could not sync checkpoint-{snap.step} to {self.run_dir} ({exc}); training "
                   f"continues, retrying in {delay:.0f} s")
        if disconnected:
            message += " (Drive disconnected: remounting)"
        if self.failures in (1, 2, 4) or self.failures % 10 == 0:  # loud, but not every retry
            self.notices.add(message)
        self.journal.write("warn", what="sync_failed", step=snap.step, error=str(exc),
                           errno=getattr(exc, "errno", None), attempt=self.failures, retry_in=delay)
        if disconnected and self.on_disconnected is not None:
            self.on_disconnected()
        with self._cond:
            if self._queued is not None:  # a newer checkpoint exists: stop retrying this one
                _discard(snap)
                self._current = None
                self._cond.notify_all()
                return
            self._cond.wait(timeout=delay)  # woken early by a newer checkpoint or close()

    def _manifest_for(self, snap: Snapshot) -> Manifest:
        files = hash_folder(snap.path)
        for name, (size, mtime) in snap.stamps.items():
            if name not in files or _stamp(snap.path / name) != (size, mtime):
                raise _SnapshotChanged(f"{name} of checkpoint-{snap.step} changed after it was saved")
        manifest = Manifest(step=snap.step, files=files, fingerprint=snap.fingerprint,
                            created=snap.taken, kit_version=self.kit_version)
        # A manifest beside the local checkpoint lets a restart on the same VM resume from it.
        # Same sizes and mtimes as the snapshot mean the same bytes (hard links share the
        # inode; copy2 keeps the mtime), so the hashes carry over without reading again.
        if snap.source is not None:
            try:
                if all(_stamp(snap.source / n) == s for n, s in snap.stamps.items()):
                    write_manifest(snap.source, manifest)
            except OSError as exc:  # the Trainer may have pruned it already
                log.debug("no local manifest for %s: %s", snap.source, exc)
        return manifest

    def _upload(self, snap: Snapshot) -> None:
        started = time.monotonic()
        manifest = self._manifest_for(snap)
        target = checkpoint_dir(self.run_dir / CHECKPOINTS, snap.step)
        if target.is_dir() and _same_manifest(target, manifest) and verify_folder(target, hashes=False) is None:
            log.info("checkpoint-%d is already on %s", snap.step, self.run_dir)
        else:
            publish_folder(snap.path, target, manifest)
        seconds = time.monotonic() - started
        self.durable_step, self.durable_time = snap.step, time.time()
        if self.failures:
            self.notices.add(f"sync to {self.run_dir} works again; checkpoint-{snap.step} is durable")
        self.failures, self.unsynced_reason = 0, None
        self.journal.write("sync", step=snap.step, durable=True, seconds=round(seconds, 3),
                           bytes=manifest.total_bytes)
        log.info("checkpoint-%d durable on %s (%s in %.1f s)", snap.step, self.run_dir,
                 format_bytes(manifest.total_bytes), seconds)
        self.journal.flush()
        removed = prune_checkpoints(self.run_dir / CHECKPOINTS, keep=self.keep, newest_valid=snap.step)
        if removed:
            self.journal.write("prune", steps=removed)


class _SnapshotChanged(Exception):
    pass


def _same_manifest(folder: Path, manifest: Manifest) -> bool:
    try:
        return read_manifest(folder).files == manifest.files
    except ValueError:
        return False


def _discard(snap: Snapshot) -> None:
    shutil.rmtree(snap.path, ignore_errors=True)
