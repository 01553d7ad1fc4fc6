"""Checkpoint folders on disk: naming, finding the newest valid one, fetching, pruning.

Layout (readable without the kit):
    <run_dir>/checkpoints/checkpoint-<step>/   data files first, then MANIFEST.json last

A folder without a MANIFEST.json that verifies does not exist for resume. HF Trainer picks
the highest-numbered folder with no completeness check; we pick the highest-numbered one
whose manifest verifies, and say which ones were skipped and why.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from . import storage
from .manifest import MANIFEST, Manifest, read_manifest, verify_folder, write_manifest

__all__ = ["CHECKPOINTS", "ARCHIVE", "FINAL", "KIT_STATE", "Found", "checkpoint_dir", "list_checkpoints",
           "find_latest", "fetch_checkpoint", "publish_folder", "model_signature", "step_of"]

CHECKPOINTS = "checkpoints"
ARCHIVE = "archive"  # checkpoints moved aside by start_run(resume=False)
FINAL = "final"  # the exported model
KIT_STATE = "colab_kit_state.json"  # before 0.2 the training clock had its own file
_NAME = re.compile(r"^checkpoint-(\d+)$")
log = logging.getLogger(__name__)


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"checkpoint-{int(step)}"


def step_of(path: str | os.PathLike | None) -> int | None:
    """The step of a `checkpoint-<step>` folder path, or None for any other path."""
    match = _NAME.match(Path(path).name) if path else None
    return int(match.group(1)) if match else None


def list_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """`checkpoint-<step>` folders under `root`, newest (highest step) first."""
    try:
        entries = list(os.scandir(root))
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        match = _NAME.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), Path(entry.path)))
    return sorted(found, key=lambda sp: sp[0], reverse=True)


@dataclass(frozen=True)
class Found:
    """A checkpoint that verified, ready on local disk."""

    step: int
    path: Path  # local copy
    manifest: Manifest
    origin: str  # "drive" or "local"
    source: Path  # where it was found


def fetch_checkpoint(source: Path, manifest: Manifest, local_root: Path) -> Path:
    """Copy a checkpoint to `local_root/checkpoint-<step>`, hashing the bytes as they are read.

    Raises:
        ValueError: a file does not match the manifest (nothing is left behind).
        OSError: the copy failed.
    """
    target = checkpoint_dir(local_root, manifest.step)
    tmp = local_root / f".fetch-{target.name}-{uuid.uuid4().hex[:8]}"
    try:
        for name, entry in manifest.files.items():
            dst = tmp / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            digest = storage.copy_file(source / name, dst)
            if digest != entry.sha256:
                raise ValueError(f"{name} does not match its sha256 (corrupted)")
            if dst.stat().st_size != entry.size:
                raise ValueError(f"{name} has the wrong size (truncated?)")
        write_manifest(tmp, manifest)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def publish_folder(source: Path, target: Path, manifest: Manifest) -> None:
    """Copy the files of `manifest` from `source` to `target` (largest first), read each back and
    compare its sha256, remove leftovers, and only then write MANIFEST.json, atomically.

    Re-publishing into an existing folder first removes its manifest, so no reader ever sees the
    old manifest next to new, half-copied files.

    Raises:
        OSError: a copy or a read-back failed (the folder is then left without a manifest).
    """
    storage.make_dirs(target)
    if (target / MANIFEST).exists():
        (target / MANIFEST).unlink()
    for name, entry in sorted(manifest.files.items(), key=lambda kv: -kv[1].size):
        dst = target / name
        storage.make_dirs(dst.parent)
        digest = storage.copy_file(source / name, dst)
        if digest != entry.sha256 or storage.sha256_file(dst) != entry.sha256:
            raise OSError(errno.EIO, f"{name} read back from {target} does not match")
    for stray in target.rglob("*"):  # leftovers of an earlier, interrupted copy
        if stray.is_file() and stray.relative_to(target).as_posix() not in manifest.files:
            stray.unlink()
    write_manifest(target, manifest)
    if read_manifest(target).files != manifest.files:
        raise OSError(errno.EIO, f"the manifest read back from {target} does not match")


def find_latest(places: Iterable[tuple[str, Path]], local_root: Path,
                on_skip: Callable[[Path, str], None], *, step: int | None = None) -> Found | None:
    """The newest checkpoint that verifies, across several places, copied to `local_root`.

    Args:
        places: ("drive" | "local", folder holding checkpoint-<step> folders). On a tie of
            steps the local one wins (no copy needed).
        local_root: where a checkpoint from Drive is copied to (verifying every sha256).
        on_skip: called with (folder, reason) for every checkpoint that does not verify.
        step: only this step (the Trainer's best checkpoint), instead of the newest.
    """
    candidates = []
    for origin, root in places:
        for found_step, path in list_checkpoints(root):
            if step is None or found_step == step:
                candidates.append((found_step, origin == "local", origin, path))
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
    for step, _, origin, path in candidates:
        try:
            manifest = read_manifest(path)
        except ValueError as exc:
            on_skip(path, str(exc))
            continue
        except OSError as exc:
            on_skip(path, f"unreadable ({exc})")
            continue
        if manifest.step != step:
            on_skip(path, f"its manifest is for step {manifest.step}, not {step}")
            continue
        # Local files are hashed in place; Drive files are hashed while they are copied.
        try:
            reason = verify_folder(path, manifest, hashes=(origin == "local"))
            if reason is None and origin != "local":
                local = fetch_checkpoint(path, manifest, local_root)
                return Found(step, local, manifest, origin, path)
        except ValueError as exc:
            reason = str(exc)
        except OSError as exc:
            reason = f"could not be read ({exc})"
        if reason is not None:
            on_skip(path, reason)
            continue
        return Found(step, path, manifest, origin, path)
    return None


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
