"""Checkpoint folders on disk: naming, listing, publishing (files first, manifest last), repairing.

Layout (readable without the kit):
    <run_dir>/checkpoints/checkpoint-<step>/   data files first, then MANIFEST.json last

A folder without a MANIFEST.json that verifies does not exist for resume (`search.py` finds the one
to resume from; `validity.py` says whether a folder verifies).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path

from . import storage, validity
from .clock import clock
from .manifest import MANIFEST, Manifest, read_manifest, write_manifest

__all__ = ["CHECKPOINTS", "ARCHIVE", "FINAL", "KIT_STATE", "checkpoint_dir", "list_checkpoints", "publish_folder", "aside_path",
           "repair_folder", "model_signature", "step_of", "TRAINER_STATE", "trainer_state", "recorded_best"]

CHECKPOINTS = "checkpoints"
ARCHIVE = "archive"  # checkpoints moved aside by start_run(resume=False)
FINAL = "final"  # the exported model
KIT_STATE = "colab_kit_state.json"  # before 0.2 the training clock had its own file
TRAINER_STATE = "trainer_state.json"  # the HF Trainer's state in each of its checkpoints
_NAME = re.compile(r"^checkpoint-(\d+)$")
log = logging.getLogger(__name__)


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"checkpoint-{int(step)}"


def step_of(path: str | os.PathLike | None) -> int | None:
    """The step of a `checkpoint-<step>` folder path, or None for any other path."""
    match = _NAME.match(Path(path).name) if path else None
    return int(match.group(1)) if match else None


def trainer_state(checkpoint: str | os.PathLike) -> dict:
    """The Trainer's state saved in `checkpoint` ({} for a checkpoint that is not a Trainer's, or unreadable)."""
    try:
        return json.loads(storage.read_bytes(Path(checkpoint) / TRAINER_STATE))
    except (OSError, ValueError):  # not a Trainer checkpoint (CheckpointStore), or unreadable
        return {}


def recorded_best(checkpoint: str | os.PathLike) -> int | None:
    """The step of the checkpoint that `checkpoint`'s trainer_state.json names as best, or None. Read where a
    checkpoint is read: the resume (`lifecycle/find.py`) and the Hub's filling of a new VM (`hub/fill.py`)."""
    return step_of(trainer_state(checkpoint).get("best_model_checkpoint"))


def list_checkpoints(root: str | Path, missing_ok: bool = True) -> list[tuple[int, Path]]:
    """`checkpoint-<step>` folders under `root`, newest (highest step) first, from one listing (which on
    Drive may leave an entry out for a moment: whoever acts on what is *not* listed looks again,
    `search.py`). A missing `root` lists nothing (`missing_ok=False`: FileNotFoundError)."""
    try:
        entries = storage.list_dir(root)
    except FileNotFoundError:
        if not missing_ok:
            raise
        entries = []
    found = {int(m.group(1)): Path(e.path) for e in entries if (m := _NAME.match(e.name)) and e.is_dir()}
    return sorted(found.items(), key=lambda sp: sp[0], reverse=True)


def publish_folder(source: Path, target: Path, manifest: Manifest, *, replace: bool = False) -> None:
    """Copy the files of `manifest` from `source` to `target` (largest first), read each back and
    compare its sha256, remove leftovers, and only then write MANIFEST.json, atomically.

    `target` must hold no manifest (a new folder, or the leftovers of an interrupted copy): a folder with
    a manifest is a checkpoint, which only `drive.gate` may replace. `replace=True` (the exported model's
    `final/`, which a newer export replaces) removes its manifest first, so that no reader ever sees the
    old manifest next to new, half-copied files.

    Raises:
        FileExistsError: `target` holds a manifest (and `replace` is False): nothing was written.
        OSError: a copy or a read-back failed (the folder is then left without a manifest).
    """
    storage.make_dirs(target)
    if storage.exists(target / MANIFEST):
        if not replace:
            raise FileExistsError(errno.EEXIST, f"{target} holds a checkpoint already", str(target / MANIFEST))
        storage.unlink(target / MANIFEST)
    for name, entry in sorted(manifest.files.items(), key=lambda kv: -kv[1].size):
        _copy_verified(source / name, target / name, entry.sha256, target)
    for stray in storage.files_under(target):  # leftovers of an earlier, interrupted copy
        if stray.relative_to(target).as_posix() not in manifest.files:
            storage.unlink(stray)
    write_manifest(target, manifest)
    if read_manifest(target).files != manifest.files:
        raise OSError(errno.EIO, f"the manifest read back from {target} does not match")
    validity.remember(target, manifest, valid=True)  # every byte was just read back


def repair_folder(source: Path, target: Path, manifest: Manifest) -> list[str]:
    """Write again, from `source`, the files of `target` that do not match `manifest` (missing ones,
    say, that Drive lost), each read back; `target`'s manifest, the same, is never touched: a checkpoint
    in the cloud stays whole while it is repaired. Returns the names written.

    Raises:
        OSError: a copy or a read-back failed.
    """
    written = []
    for name, entry in sorted(manifest.files.items(), key=lambda kv: -kv[1].size):
        try:
            if storage.stat(target / name).st_size == entry.size and storage.sha256_file(target / name) == entry.sha256:
                continue
        except FileNotFoundError:
            pass
        _copy_verified(source / name, target / name, entry.sha256, target)
        written.append(name)
    return written


def _copy_verified(src: Path, dst: Path, sha256: str, target: Path) -> None:
    storage.make_dirs(dst.parent)
    digest = storage.copy_file(src, dst)
    if digest != sha256 or storage.sha256_file(dst) != sha256:
        raise OSError(errno.EIO, f"{dst.relative_to(target)} read back from {target} does not match")


def model_signature(model) -> dict:
    """Parameter count and a hash of every parameter/buffer name and shape.

    Equal signatures mean a checkpoint's tensors fit the model; dtype is left out on purpose
    (mixed precision keeps fp32 masters, and a user may switch fp16/bf16 between sessions).
    """
    digest = hashlib.sha256()
    n_params = 0
    for name, tensor in model.state_dict().items():
        digest.update(f"{name}:{tuple(tensor.shape)};".encode())
    for p in model.parameters():
        n_params += p.numel()
    return {"model": digest.hexdigest()[:16], "parameters": int(n_params)}


def aside_path(parent: Path, name: str, runtime: str | None = None) -> Path:
    """Where a folder `name` is moved aside into `parent`: `<name>-<UTC time>[-<runtime>]`, a name `parent` does
    not hold, so that nothing is ever moved onto another folder (merged with it, or refused half-way).

    The one home of the names of folders moved aside: a fresh start's checkpoints and a replaced export in a run's
    `archive/`, a local checkpoint set aside. The time alone is not enough: two moves can fall in one second, and
    on the Hub another runtime's `archive/` may hold the name without this replica showing it (archive/ is never
    fetched), so there `runtime` (the lease's session) tells runtimes apart. The time is the kit's clock."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(clock.time()))
    base = f"{name}-{stamp}" + (f"-{runtime}" if runtime else "")
    aside, again = parent / base, 1
    while storage.exists(aside):
        again += 1
        aside = parent / f"{base}-{again}"
    return aside
