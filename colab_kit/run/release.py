"""The session's end: give the Colab runtime back, but only once everything is confirmed in the cloud.

    run.finish(release_runtime=True)

A runtime kept after training burns the user's compute units (and a free user's daily GPU time); a runtime
released too early loses what Drive had not uploaded yet (files written to the Drive mount live in
DriveFS's cache on the VM until uploaded: colabtools#4314). So the runtime is released only when
`finish` found every checkpoint and `final/` confirmed in the cloud (`summary["in_cloud"] is True`) and
written in full; anything less (still uploading, a folder whose uploads cannot be confirmed, a plain local
folder, the lease lost) keeps the runtime and says why. Colab's own call is
`google.colab.runtime.unassign()`; elsewhere there is nothing to release, and it says so.
"""

from __future__ import annotations

import logging
import sys

from ..drive.drivefs import PLAIN, UNCONFIRMED

__all__ = ["release_runtime", "why_not_release"]

log = logging.getLogger(__name__)


def why_not_release(run, summary: dict) -> str | None:
    """Why the runtime must be kept after `finish` returned `summary` (None: everything is in the cloud)."""
    if run.mirror.paused:
        return "this runtime no longer writes the run folder (another runtime took it over, or it is gone)"
    if not summary.get("synced"):
        return f"checkpoint(s) {run.mirror.pending_steps} are not yet written to {run.drive_dir}"
    if run.durability == PLAIN:
        return (f"{run.drive_dir} is a plain folder on this machine, with no cloud behind it: releasing the "
                f"runtime would lose it")
    if run.durability == UNCONFIRMED:
        return ("this Drive mount does not report uploads, so nothing confirms that the checkpoints are in the "
                "cloud (ck.drive_check() shows what it reports; confirm='api' checks with Drive's API)")
    if summary.get("in_cloud") is not True:
        labels = run.mirror.tracker.pending_labels()
        return f"{labels or 'the last checkpoint'} is not yet confirmed in the cloud"
    return None


def release_runtime(run, summary: dict) -> bool:
    """Release the Colab runtime if `summary` (what `finish` just found) says everything is in the cloud;
    else keep it and say why. Returns whether the runtime was asked to go."""
    if summary.get("status") == "not this process" or not run.ranks.writer:
        return False  # a forked copy or a follower rank: the run's writer (rank 0) decides
    if not run.runtime.colab:
        print(f"colab_kit: release_runtime=True gives a Google Colab runtime back; run {run.name!r} is not in "
              f"Colab, so nothing is released.", flush=True)
        return False
    reason = why_not_release(run, summary)
    if reason is not None:
        print(f"colab_kit: the runtime is KEPT: {reason}. Call run.finish(release_runtime=True) again to wait "
              f"and release it then.", flush=True)
        return False
    try:
        from google.colab import runtime as colab_runtime
    except ImportError as exc:
        print(f"colab_kit: the runtime is kept: google.colab.runtime cannot be imported ({exc}).", flush=True)
        return False
    newest = run.mirror.tracker.newest_in_cloud()
    print("colab_kit: everything is in the cloud" + (f" (newest checkpoint-{newest.step})" if newest else "")
          + "; releasing this Colab runtime now (Runtime -> Run all in a new one resumes or finds the run done).",
          flush=True)
    sys.stderr.flush()
    try:
        colab_runtime.unassign()
    except Exception as exc:  # noqa: BLE001 - google.colab.errors.RuntimeManagementError, or the backend's trouble
        print(f"colab_kit: Colab did not release the runtime ({exc}); everything is in the cloud, so "
              f"Runtime -> Disconnect and delete runtime is safe.", flush=True)
        return False
    return True
