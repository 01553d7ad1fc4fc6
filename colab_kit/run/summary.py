"""What `start_run` prints: one summary of the run it opened (runtime, folders, durability, saves, what it
resumes from), and, when the notebook's stop button ends it before the run is open, what was done and what
to do next."""

from __future__ import annotations

import time
from pathlib import Path

from .._units import format_age, format_bytes
from ..checkpoints.search import Found
from ..drive.drivefs import HUB, PLAIN, UNCONFIRMED, describe_kind

__all__ = ["summary", "stopped_claiming", "stopped_opening"]


def summary(run, found: Found | None, replaced, because: str | None, archived: Path | None, save_every) -> str:
    """The one summary `start_run` prints (`replaced`: the lease taken over, and `because` why)."""
    lines = [f"colab_kit · run {run.name!r}", *("  " + line for line in run.runtime.describe().splitlines()),
             f"  persistent folder: {run.drive_dir}" + (" (Google Drive)" if run.on_drive else "")
             + (f", a replica of {run.mirror.tracker.api.describe()}" if run.durability == HUB else ""),
             f"  durability: {describe_kind(run.durability)}",
             f"  local folder: {run.local_dir}"]
    if run.ranks.distributed:
        lines.append(f"  processes: {run.ranks.describe()} (the others follow: no lease, uploads or output)")
    every = f"{save_every} of training" if run.save_every_s else (
        f"{run.save_every_steps} steps" if run.save_every_steps else "the Trainer's save_steps")
    lines.append(f"  saves: every {every} and at the end; {run.keep} kept in the cloud")
    if run.session is not None:
        lines.append(f"  {run.session.describe()} ({run.session.source}, counted from {run.session.counted_from}): "
                     f"before it, training saves, waits for the cloud and finishes")
    if run.durability == UNCONFIRMED:  # said once: what the kit keeps where it cannot know
        lines.append(f"  pruning: nothing here confirms an upload, so no rate is guessed: the kit keeps "
                     f"{run.mirror.ladder.describe()} (start_run(settle=) sets where the doubling begins); "
                     f"checkpoints are never called in the cloud" + (
                         ". To confirm uploads and prune by keep instead: ck.start_run(..., confirm='api')"
                         if run.on_drive else ""))
    if run.runtime.kaggle and not run.on_drive and run.durability == PLAIN:
        lines.append("  Kaggle: there is no Google Drive here, so the persistent folder is on this session's disk: it "
                     "outlives the session only through Save Version (its output), not a restart or a timeout")
    if replaced is not None:
        lines.append(f"  took over the run folder from host {replaced.host}, pid {replaced.pid}"
                     + (f": {because}" if because else ""))
    if archived is not None:
        lines.append(f"  fresh start: earlier checkpoints moved to {archived}")
    if found is not None:
        age = format_age(time.time() - found.manifest.created)
        lines.append(f"  resume: checkpoint-{found.step} (step {found.step}, saved {age} ago, "
                     f"{format_bytes(found.manifest.total_bytes)}, from "
                     f"{'Drive' if found.origin == 'drive' else 'local disk'})")
        if run.resume_best is not None and run.mirror.best_step != found.step:
            lines.append(f"  best so far: checkpoint-{run.mirror.best_step} (fetched too, for "
                         f"load_best_model_at_end)")
    else:
        lines.append("  resume: no checkpoint found, starting fresh")
    if run.mirror.tracker.pending() or run.cloud_step is not None:
        lines.append(f"  checkpoints {run.mirror.tracker.describe()}")
    return "\n".join(lines)


def stopped_claiming(name: str, drive_dir: Path, lease) -> str:
    """The stop button pressed while start_run claims the run folder (`Lease.acquire`): nothing was taken."""
    holder = lease.watching
    if holder is None:
        return (f"colab_kit: start_run stopped before run {name!r} was opened; nothing in {drive_dir} was changed. "
                f"Run this cell again.")
    return (f"colab_kit: stopped while watching whether host {holder.host} still writes {drive_dir} (watched "
            f"{format_age(lease.watched_s)} of {format_age(lease.watch_s(holder))}): nothing was taken over and no "
            f"run is open. Run this cell again to watch again (a runtime whose heartbeat stopped is taken over at "
            f"the end of the watch); if that runtime is gone for good (its tab closed, or Runtime -> Disconnect and "
            f"delete runtime there), take over at once: ck.start_run({name!r}, ..., takeover=True)")


def stopped_opening(name: str, drive_dir: Path, replaced) -> str:
    """The stop button pressed while start_run opens the claimed folder: the uploader stopped, the lease let go."""
    return (f"colab_kit: stopped while opening run {name!r}"
            + (f" (taken over from host {replaced.host})" if replaced is not None else "")
            + f": its uploader is stopped and {drive_dir} is released again, so nothing more is written there. "
              f"Run this cell again to open it.")
