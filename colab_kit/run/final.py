"""The exported model: `run.save_final` writes it to `<drive_dir>/final/` the way checkpoints travel.

Saved to local disk first (safetensors, config, tokenizer, metrics), then published to the
persistent folder with every file read back and verified, MANIFEST.json last, and followed
until it is in the cloud (`run.finish()` waits for it).
"""

from __future__ import annotations

import errno
import json
import shutil
import time
from pathlib import Path

from .._notices import no_shard_bars
from .._units import format_bytes
from ..checkpoints import storage
from ..checkpoints.checkpoint import FINAL, publish_folder
from ..checkpoints.manifest import Manifest, hash_folder
from ..drive.cloud import upload_for
from ..errors import DriveError

__all__ = ["save_final"]


def save_final(run, model, tokenizer=None, metrics: dict | None = None, retries: int = 3) -> Path:
    """The body of `Run.save_final` (see its docstring)."""
    run._require_own_process("save the final model")
    if not run.ranks.writer:  # rank 0 exports the (identical) model
        return run.drive_dir / FINAL
    local = run.local_dir / FINAL
    if local.exists():
        shutil.rmtree(local)
    with no_shard_bars():
        model.save_pretrained(local, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(local)
    metrics_json = (json.dumps(metrics, indent=1, default=float) + "\n").encode() if metrics is not None else None
    if metrics_json is not None:
        (local / "metrics.json").write_bytes(metrics_json)
    manifest = Manifest(step=int(run.global_step or 0), files=hash_folder(local),
                        fingerprint=run.fingerprint or {})
    target = run.drive_dir / FINAL
    for attempt in range(1, retries + 1):
        try:
            _check_lease(run)  # a newer export replaces the last one: only by the runtime that holds the run
            publish_folder(local, target, manifest, replace=True)
            break
        except OSError as exc:
            if attempt == retries:
                raise DriveError(f"could not copy the final model to {target}: {exc}. It is saved on local "
                                 f"disk at {local}; copy it yourself, or call run.save_final(...) again "
                                 f"when Drive works") from exc
            time.sleep(2 ** attempt)
    if metrics_json is not None:
        storage.atomic_write_bytes(run.drive_dir / "metrics.json", metrics_json)
    run.journal.write("final", path=str(target), bytes=manifest.total_bytes, files=len(manifest.files))
    run.mirror.tracker.add(upload_for(target, manifest, "final"))  # run.finish() waits for it
    print(f"colab_kit: final model saved to {target} ({format_bytes(manifest.total_bytes)}, "
          f"{len(manifest.files)} files, verified)")
    return target


def _check_lease(run) -> None:
    """Raises OSError unless the run's lease is this runtime's now (`Lease.check`)."""
    held = run.lease.check() if run.lease is not None else True
    if held is not True:
        raise OSError(errno.EAGAIN, "another runtime holds the run folder now" if held is False else
                      "the run's lease could not be confirmed now")
