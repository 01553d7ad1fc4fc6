"""The end of a run: wait until what was written is in the cloud, say plainly what is not, let go.

`run.finish()` waits (with a countdown) for the last checkpoint and `final/`, records the finish,
stops the uploader and releases the lease. `run.train` ends the same way without waiting for the
cloud, so that evaluation cells are not held up; the notebook's last `run.finish()` waits.
"""

from __future__ import annotations

import logging
import os
import sys

from ..checkpoints.clock import Late, clock
from .._notices import Countdown
from .._units import format_age, format_bytes
from ..drive.drivefs import HUB, PLAIN, UNCONFIRMED, cloud_name
from ..drive.mount import flush_hint
from .registry import unheld_runs, unregister

__all__ = ["finish_run", "report", "flush_drive", "wait_for_cloud", "drain_with_countdown", "let_go", "close_run",
           "close_unheld_runs"]

log = logging.getLogger(__name__)
CLOSE_WAIT_S = 120.0  # how long a new run waits for the kernel's earlier run to write what it has


def finish_run(run, timeout: float | None, status: str, *, flush: bool = False, cloud_wait: bool = True) -> dict:
    """The body of `Run.finish` (see its docstring); `cloud_wait=False` at the end of `run.train`."""
    if os.getpid() != run._pid:  # a forked copy: the uploader and the lease belong to the original
        print(f"colab_kit: run {run.name!r} belongs to process {run._pid}; nothing to finish in this forked "
              f"copy (call ck.start_run inside the function given to notebook_launcher)", file=sys.stderr)
        return {"status": "not this process", "synced": False, "in_cloud": False}
    if not run.ranks.writer:  # a follower: rank 0 writes, waits and reports
        run.clock.stop()
        if not run._finished:
            run._finished = True
            run._summary = run.status() | {"status": status, "synced": None, "in_cloud": None}  # rank 0 knows
        return dict(run._summary)
    for store in list(getattr(run, "_stores", ())):  # its next call would publish it: a collective, not here
        if store.pending_step is not None:
            run.notices.add(f"checkpoint-{store.pending_step} was still being written in the background by "
                            f"run.checkpoint_store(), so it is not saved: call store.close() (on every rank) "
                            f"before run.finish()")
    deadline = None if timeout is None else clock.monotonic() + timeout
    if run._finished:  # again: wait for what is still on its way to the cloud
        return _finish_again(run, deadline, flush)
    run.clock.stop()
    run._close_gauges(error=None if status in ("finished", "completed") else status)
    run.poll()
    try:
        drained = drain_with_countdown(run.mirror, deadline)
    except KeyboardInterrupt:  # stop pressed while it waits: let go cleanly, then stop as asked
        let_go(run, f"{status}; stopped while writing to Drive")
        raise
    if not drained and not run.mirror.paused:  # paused: another runtime owns the folder now, or it is gone
        # The run stays open (finish() again goes on): its status says so, never "finished" beside synced False.
        summary = run.status() | {"status": "unsynced", "synced": False, "in_cloud": False}
        run.notices.add(_not_yet_written(run))
        run.journal.write("warn", what="finish_unsynced", **summary)
        run.notices.show()
        return summary
    tracker = run.mirror.tracker
    if cloud_wait and not run.mirror.paused:
        try:
            wait_for_cloud(tracker, deadline)
        except KeyboardInterrupt:
            let_go(run, f"{status}; stopped while waiting for the cloud")
            raise
    else:
        _within(deadline, lambda: tracker.poll(force=True))
    summary = run.status() | {"status": status, "synced": drained and not run.mirror.paused,
                              "in_cloud": _in_cloud(run)}
    if cloud_wait and summary["in_cloud"] is False and tracker.pending():
        run.journal.write("warn", what="not_in_cloud", pending=summary["pending"],
                          pending_bytes=summary["pending_bytes"], durability=run.durability)
    run.journal.write("finish", **summary)
    _within(deadline, run.journal.flush)
    if run.durability == HUB and not _journal_on_hub(run, deadline):  # the journal's last commit, said if it fails
        summary["in_cloud"] = summary["journal_in_cloud"] = False  # lines on this VM only: nothing released on them
    run.mirror.finish_deletions(max(1.0, deadline - clock.monotonic()) if deadline is not None else 60.0)
    run.mirror.close(timeout=_left(deadline, 10.0))
    _stop_filling(run)
    _closing(run, status)
    _within(deadline, run.lease.release, at_least=1.0)
    run._finished = True
    run._summary = summary
    unregister(run)
    run.notices.show()
    report(run, summary, waited=cloud_wait)
    if summary.get("oom"):
        print(f"colab_kit: {summary['oom']}.")
    if flush:
        flush_drive(run)
    return dict(summary)


def _not_yet_written(run) -> str:
    """What finish says of checkpoints still waiting for the persistent folder, and what helps: waiting, or, where
    a folder of the same step can be neither read whole nor replaced (a doubt waiting does not end), a look at it."""
    pending = run.mirror.pending_steps
    blocked = run.mirror.publisher.blocked_by
    said = (f"NOT YET ON DRIVE: checkpoint(s) {pending} are only on local disk ({run.local_dir}) "
            f"({run.mirror.unsynced_reason or 'upload still running'}). ")
    if blocked is None:
        return said + "Keep this runtime connected and call run.finish() again to keep waiting."
    return said + (f"{blocked} holds files of another save of the same step that cannot be read whole or replaced "
                   f"now, and waiting helps only if Drive starts answering for it: look at it (python -m colab_kit "
                   f"status {run.drive_dir}); if it is not a checkpoint you need, delete {blocked.name} in Drive by "
                   f"hand, then call run.finish() again (the kit never deletes a folder it cannot read).")


def drain_with_countdown(mirror, deadline: float | None) -> bool:
    """`mirror.drain` until `deadline`, with a countdown after the first seconds (main thread only)."""
    countdown = None
    started = clock.monotonic()
    while True:
        left = None if deadline is None else deadline - clock.monotonic()
        if mirror.drain(timeout=1.0 if left is None else max(0.0, min(1.0, left))):
            return True
        left = None if deadline is None else deadline - clock.monotonic()
        if mirror.paused or not mirror.alive or (left is not None and left <= 0):
            return False
        if clock.monotonic() - started >= 3.0:
            countdown = countdown or Countdown()
            steps = mirror.pending_steps
            countdown.show(f"colab_kit: writing {', '.join(f'checkpoint-{s}' for s in steps) or 'the journal'} to the "
                           f"persistent folder" + (f" ({mirror.unsynced_reason})" if mirror.unsynced_reason else "")
                           + (f"; giving up in {format_age(left)}" if left is not None else "")
                           + ". Press stop to leave it on this VM's disk and release the run")


def _stop_filling(run) -> None:
    """On the Hub: no more fetching of the older checkpoints into the replica; what had not arrived stays on the
    Hub, whole (`hub/fill.py`)."""
    if run.durability == HUB:
        run.mirror.tracker.api.fill.stop()


def _closing(run, status: str) -> None:
    """The lease's release carries the run's last status page, saying how it ended (`report/`)."""
    if getattr(run, "reporter", None) is not None:
        run.reporter.closing(status)


def let_go(run, status: str) -> None:
    """Finish a run that cannot wait any longer (stop pressed during finish's waits, or a new start_run): it is
    left consistent (what is written stays, what is not stays on local disk), the uploader's thread stopped
    and the lease released; said plainly."""
    pending = run.mirror.pending_steps
    run.journal.write("finish", status=status, synced=False, in_cloud=False)
    run.mirror.close(timeout=5.0)
    _stop_filling(run)
    _closing(run, status)
    try:
        clock.within(5.0, run.lease.release)
    except Late:
        log.info("releasing the lease goes on in the background (Drive is slow)")
    run._finished = True
    run._summary = run.status() | {"status": status, "synced": False, "in_cloud": False}
    unregister(run)
    print(f"colab_kit: run {run.name!r} released ({status})"
          + (f"; checkpoint(s) {pending} were not written to {run.drive_dir} and stay on this VM's disk "
             f"({run.local_dir}): run the start_run cell again to go on from them" if pending else "")
          + ".", flush=True)


def close_unheld_runs(why: str, keep=None) -> None:
    """Finish the open runs (but `keep`) that no variable of the notebook holds any more (`registry.py`)."""
    for old in unheld_runs(keep):
        close_run(old, "no longer held", f"colab_kit: finishing run {old.name!r}, which no variable of this notebook "
                                          f"holds any more, {why} (its uploader and lease would live on)")


def close_run(old, status: str, message: str) -> None:
    """Finish `old`; what cannot be written within `CLOSE_WAIT_S` (with a countdown; stop ends the wait)
    stays on local disk, where a new run of the same folder resumes from it."""
    print(message, flush=True)
    old.finish(timeout=CLOSE_WAIT_S, status=status)
    if not old._finished:  # its writes could not finish in time: it lets go all the same
        let_go(old, f"{status}; not everything was written")


def _finish_again(run, deadline: float | None, flush: bool) -> dict:
    """`finish()` on a finished run: wait for what is on its way, and prune what that allows."""
    wait_for_cloud(run.mirror.tracker, deadline)
    if run.mirror.tracker.all_in_cloud() and not run.mirror.paused:  # what reached the cloud since allows pruning
        _within(deadline, lambda: run.mirror.prune_now(deadline if deadline is not None else clock.monotonic() + 60))
    journal_up = True
    if run.durability == HUB and not run.mirror.paused:  # what was journaled since (final/ in the cloud, say)
        _within(deadline, run.journal.flush)
        journal_up = _journal_on_hub(run, deadline)
    summary = run.status() | {k: run._summary[k] for k in ("status", "synced")} | {
        "in_cloud": _in_cloud(run) and journal_up, "journal_in_cloud": journal_up}
    run.notices.show()  # what the uploads and deletions since the first finish had to say
    report(run, summary, again=True)
    if flush:
        flush_drive(run)
    return summary


def wait_for_cloud(tracker, deadline: float | None) -> bool:
    """Poll `tracker` until everything written is in the cloud or `deadline` (monotonic) passes, showing a
    countdown (main thread only); False at once on a folder that cannot confirm uploads. A poll that hangs on
    Drive goes on in the background: the deadline holds."""
    countdown = None
    while True:
        try:
            clock.within(None if deadline is None else max(0.05, deadline - clock.monotonic()), tracker.poll)
        except Late:
            pass
        if tracker.all_in_cloud() or tracker.kind == UNCONFIRMED:
            return tracker.all_in_cloud()
        left = None if deadline is None else deadline - clock.monotonic()
        if left is not None and left <= 0:
            return False
        countdown = countdown or Countdown()
        eta, rate = tracker.eta_s(), tracker.rate_bps
        countdown.show(f"colab_kit: waiting for {cloud_name(tracker.kind)} to upload {format_bytes(tracker.pending_bytes)} "
                       f"({tracker.pending_labels()})"
                       + (f": ~{format_age(eta)} left at {format_bytes(rate)}/s" if eta and rate else "")
                       + (f"; giving up in {format_age(left)}" if left is not None else ""))
        clock.sleep(min(1.0, left) if left is not None else 1.0)


def wait_a_while(mirror, deadline: float | None, longest: float) -> tuple[bool, bool]:
    """Wait up to `longest` seconds (and not past `deadline`) for `mirror` to write everything and Drive to
    upload it: (everything is in the cloud, waiting longer would change nothing)."""
    until = clock.monotonic() + longest if deadline is None else min(deadline, clock.monotonic() + longest)
    done = mirror.drain(max(0.0, until - clock.monotonic())) and wait_for_cloud(mirror.tracker, until)
    stuck = mirror.paused or not mirror.alive or mirror.tracker.kind == UNCONFIRMED
    return done, done or stuck or (deadline is not None and clock.monotonic() >= deadline)


def _in_cloud(run) -> bool | None:
    """Everything written is confirmed in the cloud (None on a plain folder, which has no cloud; False
    when the lease was lost with checkpoints this runtime never wrote)."""
    if run.durability == PLAIN:
        return None
    return run.mirror.tracker.all_in_cloud() and not run.mirror.dropped_steps


def _journal_on_hub(run, deadline: float | None) -> bool:
    """Commit the journal's last lines (and the small files) to the Hub; False, and said, when they did not go:
    "everything is in the cloud" then is not true, and the runtime is not released on it."""
    if _within(deadline, lambda: run.mirror.sync_store(force=True)) is True:
        return True
    run.notices.add(f"the journal's last lines (events.jsonl) are not on the Hub yet ({run.mirror.tracker.api.describe()}"
                    f" did not take the commit now): they are on this VM only. Keep the runtime and call run.finish() "
                    f"again")
    return False


def _left(deadline: float | None, most: float) -> float:
    return most if deadline is None else max(0.0, min(most, deadline - clock.monotonic()))


def _within(deadline: float | None, fn, at_least: float = 0.2):
    """`fn()` on a helper thread, waited for until `deadline` (at least `at_least` s): a call that hangs on
    Drive goes on in the background, and `finish` keeps its timeout. Returns fn's result, None when late."""
    try:
        return clock.within(None if deadline is None else max(at_least, deadline - clock.monotonic()), fn)
    except Late:
        log.info("%s goes on in the background (Drive is slow)", getattr(fn, "__name__", "a call"))
        return None


def report(run, summary: dict, *, waited: bool = True, again: bool = False) -> None:
    """The one status line of finish(): what is in the cloud, and plainly what is not."""
    tracker = run.mirror.tracker
    newest, pending = tracker.newest_in_cloud(), tracker.pending()
    labels = tracker.pending_labels()
    head = f"colab_kit: run {run.name!r} " + (f"is already finished ({summary['status']})" if again
                                              else summary["status"])
    if run.mirror.paused:
        dropped, gone = run.mirror.dropped_steps, run.mirror.folder_gone
        print(f"{head}; " + (f"the run folder {run.drive_dir} is gone (deleted or moved?)" if gone
                             else f"another runtime took over {run.drive_dir}")
              + ", so this one wrote nothing more there"
              + (f": checkpoint(s) {dropped} stay only on this VM's disk ({run.local_dir})" if dropped else "")
              + (". Run the start_run cell again: it makes the folder anew and uploads the newest checkpoint." if gone
                 else ". The run continues in the other runtime."))
        return
    if run.durability == PLAIN:
        saved = f"checkpoint-{newest.step} is" if newest else "no checkpoint is"
        print(f"{head}; {saved} saved in {run.drive_dir} (a plain folder: safe once written and read back).")
        return
    if run.durability == UNCONFIRMED:
        print(f"{head}; {labels or 'nothing'} written to Google Drive in {run.drive_dir}, but the kit cannot know "
              f"whether it is in the cloud: this mount does not report uploads (ck.drive_check() shows what it "
              f"reports). No guess about Drive's upload rate deletes anything: the kit keeps "
              f"{run.mirror.ladder.describe()}. Keep the runtime connected for a while, or call "
              f"run.finish(flush=True) (it pushes Drive's cache and unmounts Drive).")
        return
    where = (f"the newest checkpoint in the cloud is checkpoint-{newest.step} (saved "
             f"{format_age(clock.time() - newest.saved)} ago)") if newest else "no checkpoint is in the cloud"
    if summary.get("journal_in_cloud") is False:
        print(f"{head}; {where}. NOT YET IN THE CLOUD: the journal's last lines (events.jsonl) are on this VM only. "
              f"Keep this runtime connected and call run.finish() again.")
        return
    if not pending:
        print(f"{head}; everything is in the cloud: {where}.")
        return
    eta, rate = tracker.eta_s(), tracker.rate_bps
    left = f"; ~{format_age(eta)} left at {format_bytes(rate)}/s" if eta and rate else ""
    if not waited and not again:  # the end of run.train: the notebook's run.finish() waits
        print(f"{head}; {where}; uploading {labels} ({format_bytes(tracker.pending_bytes)}){left}. "
              f"run.finish() at the end waits for it.")
        return
    print(f"{head}. NOT YET IN THE CLOUD: {labels} ({format_bytes(tracker.pending_bytes)}) is written to "
          f"Drive's cache on this VM only, and is lost if the runtime is recycled now{left}; {where}. "
          f"Keep this runtime connected and call run.finish() again to wait, or "
          f"run.finish(flush=True) to push it (this unmounts Drive).")
    if run.on_drive:
        print("colab_kit: " + flush_hint())


def flush_drive(run) -> None:
    """finish(flush=True): Colab's drive.flush_and_unmount(), said out loud (it unmounts Drive)."""
    from ..drive.mount import flush_and_unmount

    if not run.on_drive:
        print(f"colab_kit: flush=True pushes Google Drive's cache in Colab; {run.drive_dir} is not on "
              f"Colab's Drive mount, so there is nothing to flush.")
        return
    run.journal.write("flush", what="drive.flush_and_unmount")
    flush_and_unmount()
    print("colab_kit: Drive's cache was pushed to the cloud and Google Drive is now UNMOUNTED "
          "(drive.flush_and_unmount()). ck.start_run(...) mounts it again.")
