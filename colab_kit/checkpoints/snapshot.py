"""Snapshots: an immutable local copy of a checkpoint, taken in the training loop, uploaded later.

The training loop pays only for hard links (or a local copy where links are not possible), so
that the Trainer's own pruning cannot delete files under the upload. Hard links share bytes with
the source, so `stamps` (size, mtime) let the uploader check that nothing changed before it
trusts its hashes.

Each snapshot also leaves a small record beside it (`checkpoint-<step>.json`: its files' sizes and
mtimes): the Trainer had finished that save. A kernel restart on the same VM that finds a local
checkpoint without a manifest and a record that matches it knows the save was complete, hashes it
and resumes from it (`recover_saved`), instead of taking an older checkpoint from Drive.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from .clock import clock
from . import shards, storage
from .manifest import MANIFEST, Manifest, hash_folder, write_manifest

__all__ = ["SNAPSHOTS", "Snapshot", "SnapshotChanged", "take_snapshot", "snapshot_manifest", "stamp", "discard",
           "keep_on_disk", "recover_saved"]

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
    taken: float = field(default_factory=clock.time)
    kit_state: dict = field(default_factory=dict)  # recorded in the manifest
    shards: dict = field(default_factory=dict)  # DCP folder -> the files it needs (`shards.record`)

    @property
    def bytes(self) -> int:
        return sum(size for size, _ in self.stamps.values())


def stamp(path: Path) -> tuple[int, int]:
    st = storage.stat(path)
    return st.st_size, st.st_mtime_ns


def take_snapshot(source: str | Path, snapshots_root: str | Path, step: int,
                  fingerprint: dict | None = None, kit_state: dict | None = None,
                  taken: float | None = None) -> Snapshot:
    """Hard-link (or copy) every file of `source` into a folder of its own under `snapshots_root`
    (`checkpoint-<step>`; `checkpoint-<step>.<n>` for a later save of the same step).

    Hard links cost no time or space and survive the Trainer deleting `source`. They share
    bytes with `source`, so the worker re-checks sizes and mtimes before trusting its hashes.

    Raises:
        IncompleteShards: `source` is a sharded checkpoint that lacks a shard or its `.metadata`
            (nothing is taken: it must not be published).
    """
    source = Path(source)
    needs = shards.record(source)
    target = _own_folder(Path(snapshots_root), step)
    stamps = {}
    for path in storage.files_under(source):
        if path.name == MANIFEST or storage.is_temp_name(path.name):
            continue
        name = path.relative_to(source).as_posix()
        dst = target / name
        storage.make_dirs(dst.parent)
        try:
            storage.link(path, dst)
        except OSError:  # EXDEV, or a filesystem without hard links
            storage.copy_file(path, dst, durable=False)
        stamps[name] = stamp(dst)
    snap = Snapshot(step=step, path=target, fingerprint=dict(fingerprint or {}), stamps=stamps,
                    source=source, kit_state=dict(kit_state or {}), shards=needs)
    if taken is not None:  # a checkpoint saved before (found at a restart): its manifest stays the same bytes
        snap.taken = taken
    # Written whole (temp + rename) but not fsynced: it guards against a dead process, whose page cache
    # the VM keeps, and an fsync right after a large save can wait for all of it to reach the disk.
    storage.atomic_write_bytes(_record(snap.path), json.dumps(
        {"step": step, "stamps": stamps, "fingerprint": snap.fingerprint, "kit_state": snap.kit_state,
         "taken": snap.taken, "source": str(source), "shards": needs}).encode(), durable=False)
    return snap


def _record(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def _own_folder(root: Path, step: int) -> Path:
    """A folder no other snapshot uses: `checkpoint-<step>`, or `checkpoint-<step>.<n>` for a second save of the
    same step while the first snapshot is still there (its upload may be reading it, and letting go of it must
    never remove the newer one's files)."""
    target, n = root / f"checkpoint-{step}", 1
    while storage.exists(target) or storage.exists(_record(target)):
        n += 1
        target = root / f"checkpoint-{step}.{n}"
    return target


def discard(snap: Snapshot) -> None:
    """Let go of a snapshot's local links (the Trainer's own folder, and the persistent folder, keep theirs)."""
    try:
        storage.unlink(_record(snap.path))
    except OSError:
        pass  # never written, or the local disk is in trouble: nothing else to do
    try:
        storage.remove_tree(snap.path)
    except OSError as exc:
        log.debug("could not remove %s: %s", snap.path, exc)


def keep_on_disk(snap: Snapshot) -> None:
    """Let go of a snapshot that will not be uploaded (its run folder is gone), leaving the Trainer's checkpoint
    resumable on this disk: its manifest is written beside it first (when its files still match)."""
    try:
        snapshot_manifest(snap)
    except (OSError, SnapshotChanged) as exc:
        log.debug("checkpoint-%d left without a manifest: %s", snap.step, exc)
    discard(snap)


def recover_saved(snapshots_root: str | Path) -> list[int]:
    """Give a MANIFEST.json to every local checkpoint whose save the Trainer had finished (a snapshot
    record matches its files) but whose manifest was never written (the process died first); returns
    their steps. What does not match its record is left as it is."""
    recovered = []
    try:
        records = sorted(Path(e.path) for e in storage.list_dir(snapshots_root)
                         if e.name.startswith("checkpoint-") and e.name.endswith(".json"))
    except OSError:
        return recovered
    for record in records:
        try:
            data = json.loads(storage.read_bytes(record))
            snap = Snapshot(step=int(data["step"]), path=record.with_suffix(""), fingerprint=data["fingerprint"],
                            stamps={k: tuple(v) for k, v in data["stamps"].items()}, source=Path(data["source"]),
                            taken=float(data["taken"]), kit_state=data["kit_state"],
                            shards=data.get("shards") or {})
        except (OSError, ValueError, KeyError, TypeError):
            continue
        try:
            if storage.exists(snap.source / MANIFEST) or not storage.is_dir(snap.source):
                continue
            if not all(stamp(snap.source / n) == s for n, s in snap.stamps.items()):
                continue
            files = hash_folder(snap.source)
            if set(files) != set(snap.stamps):
                continue
            write_manifest(snap.source, Manifest(step=snap.step, files=files, fingerprint=snap.fingerprint,
                                                 created=snap.taken, kit_state=snap.kit_state, shards=snap.shards))
            recovered.append(snap.step)
        except OSError as exc:
            log.debug("cannot recover %s: %s", snap.source, exc)
    return recovered


class SnapshotChanged(Exception):
    """A file of a snapshot changed after it was taken (overwritten in place)."""


def snapshot_manifest(snap: Snapshot) -> Manifest:
    """Hash the snapshot into its manifest, checking first that no file changed since it was taken.

    Raises:
        SnapshotChanged: a file's size or mtime differs from the stamp taken with the snapshot.
    """
    files = hash_folder(snap.path)
    for name, (size, mtime) in snap.stamps.items():
        if name not in files or stamp(snap.path / name) != (size, mtime):
            raise SnapshotChanged(f"{name} of checkpoint-{snap.step} changed after it was saved")
    manifest = Manifest(step=snap.step, files=files, fingerprint=snap.fingerprint,
                        created=snap.taken, kit_state=snap.kit_state, shards=snap.shards)
    # A manifest beside the local checkpoint lets a restart on the same VM resume from it.
    # Same sizes and mtimes as the snapshot mean the same bytes (hard links share the
    # inode; copy2 keeps the mtime), so the hashes carry over without reading again.
    if snap.source is not None:
        try:
            if all(stamp(snap.source / n) == s for n, s in snap.stamps.items()):
                write_manifest(snap.source, manifest)
        except OSError as exc:  # the Trainer may have pruned it already
            log.debug("no local manifest for %s: %s", snap.source, exc)
    return manifest
