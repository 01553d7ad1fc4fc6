"""Checkpoint folders on disk: naming, finding the newest valid one, fetching, pruning.

Layout (readable without the kit):
    <run_dir>/checkpoints/checkpoint-<step>/   data files first, then MANIFEST.json last

A folder without a MANIFEST.json that verifies does not exist for resume. HF Trainer picks
the highest-numbered folder with no completeness check; we pick the highest-numbered one
that is VALID (`validity.py`), and say which ones were skipped and why. A folder that cannot be
read is neither: it is looked at again a few times, and then reported as unreadable, so that the
caller never takes "could not read" for "there is nothing".
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from . import storage, validity
from .manifest import MANIFEST, Manifest, read_manifest, write_manifest

__all__ = ["CHECKPOINTS", "ARCHIVE", "FINAL", "KIT_STATE", "Found", "Search", "checkpoint_dir", "list_checkpoints",
           "search_checkpoints", "find_latest", "fetch_checkpoint", "publish_folder", "model_signature", "step_of",
           "RETRY_WAITS"]

CHECKPOINTS = "checkpoints"
ARCHIVE = "archive"  # checkpoints moved aside by start_run(resume=False)
FINAL = "final"  # the exported model
KIT_STATE = "colab_kit_state.json"  # before 0.2 the training clock had its own file
_NAME = re.compile(r"^checkpoint-(\d+)$")
# Seconds between the tries of a checkpoint that could not be read (EIO, errno 107, a stall): doubt
# costs time first.
RETRY_WAITS = (1.0, 2.0, 4.0)
log = logging.getLogger(__name__)


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"checkpoint-{int(step)}"


def step_of(path: str | os.PathLike | None) -> int | None:
    """The step of a `checkpoint-<step>` folder path, or None for any other path."""
    match = _NAME.match(Path(path).name) if path else None
    return int(match.group(1)) if match else None


def list_checkpoints(root: str | Path, looks: int = 1) -> list[tuple[int, Path]]:
    """`checkpoint-<step>` folders under `root`, newest (highest step) first.

    `looks` > 1 lists the folder that many times and keeps every folder seen: Drive's listing can
    leave a file out for a moment, and a checkpoint left out of the one listing resume reads would
    make it resume from an older one.
    """
    found: dict[int, Path] = {}
    for _ in range(looks):
        try:
            entries = storage.list_dir(root)
        except FileNotFoundError:
            entries = []
        for entry in entries:
            match = _NAME.match(entry.name)
            if match and entry.is_dir():
                found[int(match.group(1))] = Path(entry.path)
    return sorted(found.items(), key=lambda sp: sp[0], reverse=True)


@dataclass(frozen=True)
class Found:
    """A checkpoint that verified, ready on local disk."""

    step: int
    path: Path  # local copy
    manifest: Manifest
    origin: str  # "drive" or "local"
    source: Path  # where it was found


def fetch_checkpoint(source: Path, manifest: Manifest, local_root: Path) -> Path:
    """Copy a checkpoint to `local_root/checkpoint-<step>`, hashing the bytes as they are read; what
    the hashes say of `source` is remembered (`validity.remember`).

    Raises:
        ValueError: a file does not match the manifest (nothing is left behind; `source` is INVALID).
        OSError: the copy failed: reading `source`, or writing to the local disk (nothing is known).
    """
    target = checkpoint_dir(local_root, manifest.step)
    tmp = local_root / f".fetch-{target.name}-{uuid.uuid4().hex[:8]}"
    try:
        for name, entry in manifest.files.items():
            dst = tmp / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            digest = storage.copy_file(source / name, dst)
            if digest != entry.sha256:
                reason = f"{name} does not match its sha256 (corrupted)"
                validity.remember(source, manifest, valid=False, reason=reason)
                raise ValueError(reason)
            if dst.stat().st_size != entry.size:
                raise ValueError(f"{name} has the wrong size (truncated?)")
        write_manifest(tmp, manifest)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    validity.remember(source, manifest, valid=True)
    validity.remember(target, manifest, valid=True)
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
    validity.remember(target, manifest, valid=True)  # every byte was just read back


@dataclass
class Search:
    """What a search for a checkpoint to resume from found.

    Attributes:
        found: the newest VALID checkpoint, on local disk (None: none).
        skipped: (folder, reason) of those read and found INVALID or UNFINISHED: never resumed from.
        unreadable: (folder, reason) of those that could not be read after every try: nothing is known.
    """

    found: Found | None = None
    skipped: list[tuple[Path, str]] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)


def search_checkpoints(places: Iterable[tuple[str, Path]], local_root: Path, *, step: int | None = None,
                       on_skip: Callable[[Path, str], None] | None = None,
                       waits: Iterable[float] | None = None) -> Search:
    """The newest VALID checkpoint across several places, copied to `local_root`.

    Args:
        places: ("drive" | "local", folder holding checkpoint-<step> folders). On a tie of steps the
            local one wins (no copy needed).
        local_root: where a checkpoint from Drive is copied to (verifying every sha256 on the way).
        step: only this step (the Trainer's best checkpoint), instead of the newest.
        on_skip: called with (folder, reason) for every checkpoint found INVALID or UNFINISHED.
        waits: seconds between the tries of a checkpoint that cannot be read (default `RETRY_WAITS`).
            One still unreadable after them is reported in `unreadable`, and the search goes on to
            older ones: the caller decides (start_run never starts fresh over an unreadable one).
    """
    waits = RETRY_WAITS if waits is None else tuple(waits)
    candidates = []
    result = Search()
    for origin, root in places:
        for wait in (0.0, *waits):
            time.sleep(wait)
            try:
                listed = list_checkpoints(root, looks=3 if origin == "drive" else 1)
                break
            except OSError as exc:
                listed, problem = None, f"the folder could not be listed ({exc.strerror or exc})"
        if listed is None:
            result.unreadable.append((Path(root), problem))
            continue
        for found_step, path in listed:
            if step is None or found_step == step:
                candidates.append((found_step, origin == "local", origin, path))
    candidates.sort(key=lambda c: (c[0], c[1]), reverse=True)
    for found_step, _, origin, path in candidates:
        for wait in (0.0, *waits):
            time.sleep(wait)
            found, verdict = _try_one(found_step, origin, path, local_root)
            if not verdict.unknown:
                break
        if found is not None:
            result.found = found
            return result
        if verdict.unknown:
            result.unreadable.append((path, verdict.reason))
        else:
            result.skipped.append((path, verdict.reason))
            if on_skip is not None:
                on_skip(path, verdict.reason)
    return result


def _try_one(step: int, origin: str, path: Path, local_root: Path) -> tuple[Found | None, validity.Verdict]:
    """One look at one candidate: (Found, VALID), or (None, the verdict)."""
    if origin == "local":  # hashed in place
        verdict = validity.check(path, step=step)
        return (Found(step, path, verdict.manifest, origin, path) if verdict.valid else None), verdict
    verdict = validity.check(path, step=step, hashes=False)  # Drive: sizes now, hashes while the bytes are copied
    if not verdict.valid and verdict.reason != validity.SIZES_MATCH:
        return None, verdict
    manifest = verdict.manifest
    try:
        local = fetch_checkpoint(path, manifest, local_root)
    except ValueError as exc:
        return None, validity.Verdict(validity.INVALID, str(exc), manifest)
    except OSError as exc:
        validity.forget(path)  # what was known of it no longer holds now: the next look reads it again
        where = "the local disk is full" if exc.errno in (errno.ENOSPC, errno.EDQUOT) else (exc.strerror or str(exc))
        return None, validity.Verdict(validity.UNKNOWN, f"could not be copied to local disk ({where})")
    return Found(step, local, manifest, origin, path), validity.Verdict(validity.VALID, "", manifest)


def find_latest(places: Iterable[tuple[str, Path]], local_root: Path,
                on_skip: Callable[[Path, str], None], *, step: int | None = None) -> Found | None:
    """`search_checkpoints(...).found`, with every unreadable checkpoint reported to `on_skip` too (for
    callers that resume from what they find and start nothing fresh over the others)."""
    result = search_checkpoints(places, local_root, step=step, on_skip=on_skip)
    for path, reason in result.unreadable:
        on_skip(path, f"unreadable ({reason})")
    return result.found


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
