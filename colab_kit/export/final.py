"""The exported model: `run.save_final` writes it to `<drive_dir>/final/` the way checkpoints travel.

Saved to local disk first (safetensors, config, tokenizer, metrics), then published to the
persistent folder with every file read back and verified, MANIFEST.json last, and followed
until it is in the cloud (`run.finish()` waits for it).

`final/` is never half-replaced: "Run all" again exports the same model, which leaves the verified export as
it is; another one is written beside it (`.final.new-<id>/`) and swapped in once it verifies, the one it
replaces moved to `archive/final-<time>-<runtime>/` (nothing is deleted). A stop, a Drive error or a lost runtime
during the copy leaves the last export whole.
"""

from __future__ import annotations

import errno
import json
import shutil
import uuid
from pathlib import Path

from .._notices import no_shard_bars
from .._units import format_bytes
from ..checkpoints import storage, validity
from ..checkpoints.clock import clock
from ..checkpoints.checkpoint import FINAL, publish_folder
from ..checkpoints.manifest import Manifest, hash_folder
from ..drive.cloud import upload_for
from ..drive.drivefs import HUB
from ..drive.gate import act
from ..errors import ColabKitError, DriveError
from ..lifecycle.fresh import archive_path
from ..lifecycle.hubstart import PullProgress

_STAGING = f".{FINAL}.new-"  # a new export, written beside final/ until it verifies

__all__ = ["save_final"]


def save_final(run, model, tokenizer=None, metrics: dict | None = None, retries: int = 3, *,
               merged: bool = False) -> Path:
    """The body of `Run.save_final` (see its docstring)."""
    run._require_own_process("save the final model")
    if merged and not hasattr(model, "merge_and_unload"):
        raise ValueError("merged=True merges a peft adapter into its base model; this model has no adapter: "
                         "call run.save_final(model, ...) without merged")
    if not run.ranks.writer:  # rank 0 exports the (identical) model
        return run.drive_dir / FINAL
    local = run.local_dir / FINAL
    if storage.exists(local):  # local disk goes through the storage seam too (the simulator's VM disks)
        storage.remove_tree(local)
    with no_shard_bars():
        model.save_pretrained(local, safe_serialization=True)
    if merged:
        metrics = _merge_into(run, model, tokenizer, local, metrics)
    if tokenizer is not None:
        tokenizer.save_pretrained(local)
    metrics_json = (json.dumps(metrics, indent=1, default=float) + "\n").encode() if metrics is not None else None
    if metrics_json is not None:
        storage.atomic_write_bytes(local / "metrics.json", metrics_json, durable=False)
    manifest = Manifest(step=int(run.global_step or 0), files=hash_folder(local),
                        fingerprint=run.fingerprint or {})
    target = run.drive_dir / FINAL
    _fill_final(run)  # what final/ holds now, judged whole
    there = _holding(target, manifest)
    if there is not None:  # "Run all" again, or a resume whose best model is the export's: the same files
        run.journal.write("final", path=str(target), bytes=manifest.total_bytes, files=len(manifest.files),
                          unchanged=True)
        if run.mirror.tracker.get("final") is None:  # run.finish() waits for it, as written (its step may be older)
            run.mirror.tracker.add(upload_for(target, there, "final"))
        print(f"colab_kit: {target} already holds this model (verified); it is left as it is")
        return target
    archived = None
    staging = run.drive_dir / f"{_STAGING}{uuid.uuid4().hex[:8]}"  # one for this export: a retry writes into it
    for attempt in range(1, retries + 1):
        try:
            _check_lease(run)  # a newer export replaces the last one: only by the runtime that holds the run
            publish_folder(local, staging, manifest)
            archived = _swap_in(run, staging, target, manifest)
            break
        except OSError as exc:
            if attempt == retries:
                raise DriveError(f"could not copy the final model to {target}: {exc}. It is saved on local "
                                 f"disk at {local}; copy it yourself, or call run.save_final(...) again "
                                 f"when Drive works" + _what_final_holds(target)) from exc
            clock.sleep(2 ** attempt)  # the clock seam: the simulator's virtual time, the tests' short waits
        except KeyboardInterrupt:
            print(f"colab_kit: stopped while exporting the final model; it is saved on local disk at {local}"
                  f"{_what_final_holds(target)} Run this cell again to export it.", flush=True)
            raise
    if metrics_json is not None:
        storage.atomic_write_bytes(run.drive_dir / "metrics.json", metrics_json)
    run.journal.write("final", path=str(target), bytes=manifest.total_bytes, files=len(manifest.files),
                      archived=str(archived) if archived else None)
    run.mirror.tracker.add(upload_for(target, manifest, "final"))  # run.finish() waits for it
    print(f"colab_kit: final model saved to {target} ({format_bytes(manifest.total_bytes)}, "
          f"{len(manifest.files)} files, verified)"
          + (f"; the export it replaces is kept in {archived} (delete it at drive.google.com if it is not needed)"
             if archived else ""))
    return target


def _merge_into(run, model, tokenizer, local: Path, metrics: dict | None) -> dict | None:
    """The merged model (and the tokenizer) in `local/merged/`; when it cannot be made (host RAM, a base that
    cannot be read again, an error in peft), the adapter alone, and the reason said: the export is never lost
    to the merge. Returns the metrics with what happened added (when there are metrics)."""
    from .merge import MERGED, save_merged

    try:
        size = save_merged(model, local / MERGED, local)
        if tokenizer is not None:
            tokenizer.save_pretrained(local / MERGED)
    except Exception as exc:  # noqa: BLE001 - any failure leaves the adapter's export as it is
        shutil.rmtree(local / MERGED, ignore_errors=True)
        run.journal.write("warn", what="merge_skipped", reason=str(exc))
        print(f"colab_kit: the adapter was not merged: {exc}" if not isinstance(exc, ColabKitError)
              else f"colab_kit: {exc}", flush=True)
        return metrics if metrics is None else {**metrics, "merged": False}
    print(f"colab_kit: the adapter merged into the base model: {format_bytes(size)} in {MERGED}/", flush=True)
    return metrics if metrics is None else {**metrics, "merged": True}


def _fill_final(run) -> None:
    """On the Hub, a new VM fetches final/ after the resume began (`hub/fill.py`): the export this one replaces
    must be in the replica first, to be kept in archive/ (on the Hub too) rather than dropped from main.

    Raises:
        DriveError: the Hub did not give final/ now; nothing was replaced."""
    if run.durability != HUB:
        return
    fill = run.mirror.tracker.api.fill
    if not fill.fill(FINAL, progress=PullProgress(run.name)):  # bytes and time left once it takes a few seconds
        raise DriveError(f"cannot export the final model yet: the export in {run.drive_dir / FINAL} on the Hub has "
                         f"not reached this VM ({fill.failed}), and it is kept in archive/ when a new one replaces "
                         f"it. The model is saved on local disk at {run.local_dir / FINAL}; call "
                         f"run.save_final(...) again in a minute")


def _holding(target: Path, manifest: Manifest) -> Manifest | None:
    """The manifest of `target` when it verifies now with exactly the files of `manifest` (sizes and sha256),
    else None. Its step may differ: the same weights exported at a later step (a best model loaded at the end)."""
    try:
        verdict = validity.check(target) if storage.is_dir(target) else None
    except OSError:
        return None
    same = bool(verdict is not None and verdict.valid and {n: (e.size, e.sha256) for n, e in verdict.manifest.files.items()}
                == {n: (e.size, e.sha256) for n, e in manifest.files.items()})
    return verdict.manifest if same else None


def _swap_in(run, staging: Path, target: Path, manifest: Manifest) -> Path | None:
    """The verified `staging` becomes `target`; the export it replaces (and what an earlier, interrupted export
    left beside it: a copy half-written, or one a stop kept from its place) moves to archive/, never deleted.
    Returns where the replaced export went.

    Raises:
        OSError: the lease is not this runtime's now (nothing was moved), or a move failed."""
    moved = {}

    def swap():
        leftovers = [e.path for e in storage.list_dir(run.drive_dir)
                     if e.name.startswith(_STAGING) and e.path != str(staging)]
        for old in ([target] if storage.exists(target) else []) + [Path(p) for p in leftovers]:
            aside = archive_path(run, old.name.lstrip("."))
            storage.make_dirs(aside.parent)
            storage.replace(old, aside)
            validity.forget(old)
            moved.setdefault("final", aside if old == target else None)
        storage.replace(staging, target)
        validity.remember(target, manifest, valid=True)

    if not act("replace final", str(target), [lambda: None if _held(run) else "the lease is not this runtime's now"],
               swap, journal=run.journal):
        raise OSError(errno.EAGAIN, "the run's lease could not be confirmed now, so final/ was not replaced")
    return moved.get("final")


def _what_final_holds(target: Path) -> str:
    try:
        whole = storage.exists(target) and validity.check(target).valid
    except OSError:
        whole = False
    return f"; {target} still holds the previous export, whole." if whole else "."


def _held(run) -> bool:
    return (run.lease.check() if run.lease is not None else True) is True


def _check_lease(run) -> None:
    """Raises OSError unless the run's lease is this runtime's now (`Lease.check`)."""
    held = run.lease.check() if run.lease is not None else True
    if held is not True:
        raise OSError(errno.EAGAIN, "another runtime holds the run folder now" if held is False else
                      "the run's lease could not be confirmed now")
