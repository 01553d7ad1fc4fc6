"""`start_run`: open (or reopen) a run folder, find what to resume from, say what was found.

    run = ck.start_run("rna-bert", save_every="10min", keep=3)

After a reconnect, "Runtime -> Run all" runs the same cells: `start_run` finds the newest
checkpoint whose manifest verifies (on Drive or still on local disk), copies it to local disk,
and `run.train` continues from it.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import weakref
from pathlib import Path

from ..checkpoints.clock import clock
from .._notices import Countdown, Notices
from .._units import format_age
from ..checkpoints import storage
from ..checkpoints.checkpoint import CHECKPOINTS
from ..checkpoints.journal import EVENTS, Journal, SilentJournal
from ..checkpoints.search import RETRY_WAITS, Found
from ..checkpoints.snapshot import SNAPSHOTS, recover_saved, take_snapshot
from ..distributed.ranks import detect as detect_ranks
from ..drive.confirm import choose_confirmation
from ..drive.drivefs import HUB, folder_kind, probe_kind
from ..drive.lease import Lease
from ..drive.mount import resolve_root
from ..drive.retention import Ladder
from ..errors import DriveError
from ..runtime import detect_runtime, in_colab, in_kaggle, library_versions
from ..lifecycle.deadline import resolve_time_limit
from ..lifecycle.drift import describe_drift, drift
from ..lifecycle.find import fetch_best_of, find_resume, kit_state, set_aside_newer
from ..lifecycle.fresh import archive_checkpoints
from ..lifecycle.hubstart import hub_address, open_hub, replica_of
from .startargs import check_settings
from ..lifecycle.finish import close_run, close_unheld_runs
from ..lifecycle.registry import TrainClock, open_runs, register, unregister
from ..report.reporter import attach as attach_reporter
from .run import Run
from .summary import stopped_claiming, stopped_opening, summary

__all__ = ["start_run"]

log = logging.getLogger(__name__)
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# "cloud": prune only once a newer checkpoint is in the cloud. The tests and
# bench/work_at_risk.py set "written" (the rule before 0.2) to show what it loses.
_PRUNE_AFTER = "cloud"


def _default_local_dir(name: str) -> Path:
    # In Colab /content is the fast VM disk (wiped on disconnect); on Kaggle /tmp is the big scratch disk
    # (/kaggle/working holds 19.5 GB, and all of it goes into a saved version); elsewhere a folder beside
    # ./drive, so a restart on the same machine can still resume from local checkpoints.
    if in_colab():
        return Path("/content/colab_kit_local") / name
    return Path("/tmp/colab_kit_local" if in_kaggle() else "scratch").absolute() / name


def _clean_local(local_dir: Path) -> None:
    # Leftovers of a killed process: snapshots whose upload never finished (the checkpoints
    # themselves are still there), half-fetched and half-staged folders.
    for entry in storage.list_dir(local_dir):
        if entry.name == SNAPSHOTS or entry.name.startswith((".fetch-", ".staging-")):
            try:
                storage.remove_tree(entry.path)
            except OSError as exc:
                log.debug("could not remove %s: %s", entry.path, exc)


def start_run(name: str, *, drive: str | os.PathLike | None = None, local_dir: str | os.PathLike | None = None,
              save_every: str | int | None = "10min", keep: int = 3, resume: bool | str = True,
              takeover: bool = False, gauges: bool = True, heartbeat_s: float | None = None, quiet: bool = False,
              settle: str | float = "10min", assumed_rate: str | float = "1MB/s", confirm="auto",
              store: str | None = None, time_limit: str | float | None = None, release_at_limit: bool = False) -> Run:
    """Open (or reopen) a run whose checkpoints survive a runtime reset.

    Args:
        name: the run's name; its folder is `<root>/<name>/`.
        drive: the root folder playing the role of `MyDrive/colab_kit` (default: Google Drive in
            Colab, `$COLAB_KIT_DRIVE` when set, else `./drive`).
        local_dir: fast local scratch for the Trainer's `output_dir` (default: under /content in
            Colab, `./scratch/<name>` elsewhere).
        save_every: a duration of training time ("90s", "10min", "1h") or an int number of
            optimizer steps; None leaves saving to the Trainer's own `save_steps`. A final
            checkpoint is always saved at the last step. A duration stretches when Drive uploads
            checkpoints more slowly than they are made (the user is told).
        keep: checkpoints in the cloud to keep (older ones are deleted once a newer one is in the
            cloud; at least one always remains).
        resume: True resumes from the newest checkpoint that verifies (and stops, saying so, when one
            the journal confirmed in the cloud cannot be seen or read now); False starts fresh, moving
            existing checkpoints to `<drive_dir>/archive/`; "readable" resumes from the newest one that
            can be read now (for a checkpoint that is gone for good).
        takeover: take the run folder over from another live runtime. A lease of another host
            whose heartbeat stops for 1.5 intervals (a disconnected VM) is taken over without it.
        gauges: live GPU/RAM gauges while `run.train` runs (a summary stays, and is written to
            `<drive_dir>/gauges.html`).
        heartbeat_s: lease heartbeat interval (a lease is stale after 4 missed beats; default 30 s on a folder,
            2 minutes on the Hub, where each beat is a commit).
        quiet: do not print the summary.
        settle: where nothing confirms uploads (durability "unconfirmed"), no guess about the upload rate
            deletes anything: the kit keeps the run's oldest checkpoint, every one younger than `settle`, and
            one per doubling of age beyond it (`drive/retention.py`). A duration ("10min", or seconds, above
            zero). Nothing is ever reported as in the cloud there.
        assumed_rate: there, it only paces writes: the next checkpoint goes after the previous one's size at
            this rate ("1MB/s", or bytes per second).
        confirm: how a checkpoint is known to be in the cloud: "auto" (DriveFS's attributes where
            they answer, else unconfirmed), "attributes" (an error where they are missing), "api"
            (every file's size and md5 through Drive's API; asks consent once in Colab; pruned
            checkpoints are deleted for good), or a `ck.DriveApi(endpoint, root)`. Without the
            package, consent or network, "api" goes on as "auto" and says so (`drive/confirm.py`).
        store: "hf://<user>/<repo>" (or "hf://datasets/<user>/<repo>", with a folder after it if wanted) keeps
            the run in `<repo>/<name>/` on the Hugging Face Hub instead of a folder: each checkpoint one commit,
            in the cloud once the repo lists every file with the manifest's sha256; the token from $HF_TOKEN,
            Colab's or Kaggle's secrets (HF_TOKEN), or a saved login (`lifecycle/hubstart.py`). `drive=` may hold
            such an address too. On Kaggle, with neither, the Hub is used when a token is found.
        time_limit: the session's limit ("11h30m", "90min", or seconds; default none, and 12 h on Kaggle, its
            documented cap; False: none even there). Before it, `run.train` saves, waits until that checkpoint is
            in the cloud, finishes the run and raises `TimeLimitReached` (so "Run all" stops there), so the
            session's end never falls in the middle of an upload. It counts from the runtime's start in Colab
            and on Kaggle (a restarted kernel keeps the time spent), else from this call
            (`lifecycle/deadline.py`).
        release_at_limit: then also give the Colab runtime back, once everything is confirmed in the cloud.

    Several processes (torchrun, `accelerate launch`, `notebook_launcher`: RANK and WORLD_SIZE
    set): every rank calls start_run; rank 0 holds the lease, uploads, journals and prints, and
    the others get a follower run that resumes from rank 0's checkpoint when `run.train` starts.

    Returns:
        The `Run`; `run.resume_from` is the checkpoint to continue from, or None.

    Raises:
        ValueError: bad arguments. DriveError: the persistent folder cannot be used.
        LeaseHeldError: another live runtime is writing this run (see `takeover`).
    """
    if not isinstance(name, str) or not _NAME_OK.match(name):
        raise ValueError(f"run name {name!r}: use letters, digits, '.', '_' and '-' (it becomes a "
                         f"folder name), for example ck.start_run('rna-bert')")
    ladder, pace_bps, (save_every_s, save_every_steps) = check_settings(keep, confirm, resume, settle, assumed_rate,
                                                                   save_every)
    runtime = detect_runtime()
    session = resolve_time_limit(time_limit, colab=runtime.colab, kaggle=runtime.kaggle)
    early = Notices()
    address = hub_address(store, drive, kaggle=runtime.kaggle, say=early.add)
    if address is not None and resume is False:
        raise ValueError(f"resume=False on the Hub store {address}: a fresh start over a run kept on the Hub is not "
                         f"supported yet; give the run a new name, or delete {name}/ in the repo first")
    if address is None:
        drive_dir, local, on_drive = _resolve(name, drive, local_dir)
    else:
        local = Path(local_dir).absolute() if local_dir is not None else _default_local_dir(name)
        local.mkdir(parents=True, exist_ok=True)
        drive_dir, on_drive = replica_of(name, local), False
    ranks = detect_ranks()
    if not ranks.writer:  # no lease, no uploader, no journal: rank 0 is the run's one writer
        follower = Run(name, drive_dir, local, on_drive=on_drive, save_every_s=save_every_s,
                       save_every_steps=save_every_steps, keep=keep, runtime=runtime, lease=None,
                       journal=SilentJournal(), notices=Notices(silent=True), gauges=False,
                       kind=folder_kind(drive_dir, on_drive=on_drive), prune_after=_PRUNE_AFTER, ranks=ranks)
        follower.session = session  # rank 0's clock decides; every rank asks it at the same steps
        return follower

    close_earlier_runs(name, drive_dir)

    hub = None
    if address is None:
        lease = Lease(drive_dir, heartbeat_s=heartbeat_s or 30.0)
        replaced = _claim(lease, name, drive_dir, takeover, quiet)
    else:
        opened = open_hub(name, address, local, heartbeat_s=heartbeat_s, takeover=takeover,
                          claim=lambda lease: _claim(lease, name, f"{address}/{lease.folder}", takeover, quiet))
        lease, replaced, hub = opened.lease, opened.replaced, opened.store
    try:
        run, found, archived = open_claimed(name, drive_dir, local, lease=lease, runtime=runtime, on_drive=on_drive,
                                            confirm=confirm, resume=resume, keep=keep, save_every_s=save_every_s,
                                            save_every_steps=save_every_steps, gauges=gauges, ladder=ladder,
                                            pace_bps=pace_bps, ranks=ranks, replaced=replaced, save_every=save_every,
                                            hub=hub, said=early)
        if hub is not None:
            hub.say = run.notices.add  # the Hub's quota truth, said once at the first deletion
            hub.fill.start(on_filled=run.mirror.adopt_existing)  # the older checkpoints and final/, behind training
    except KeyboardInterrupt:  # the stop button: open_claimed stopped its uploader and let the lease go
        print(stopped_opening(name, drive_dir, replaced), flush=True)
        raise
    run.session, run.release_at_limit = session, release_at_limit
    run.reporter = attach_reporter(run)  # the status page and picture, with the lease's beats
    try:
        register(run)
        lease.start_heartbeat(run._lease_lost)
        lease.beat_now()  # the first page now: what this runtime resumes, since when
        atexit.register(_finish_at_exit, weakref.ref(run))
    except BaseException as exc:  # as open_claimed does: nothing of the run is left running
        unregister(run)
        run.mirror.close(timeout=5.0)
        lease.release()
        if isinstance(exc, KeyboardInterrupt):
            print(stopped_opening(name, drive_dir, replaced), flush=True)
        raise

    if not quiet:
        print(summary(run, found, replaced, lease.took_over_because, archived, save_every))
    if session is not None:
        run.journal.write("session", limit_s=session.limit_s, ends=round(session.ends, 1), source=session.source)
    run.notices.show()
    return run


def close_earlier_runs(name: str, drive_dir: Path) -> None:
    """Finish the kernel's open run of this folder (the start_run cell run again) and the open runs that no
    variable of the notebook holds any more (the cell run again under a new name: `registry.py`)."""
    for old in open_runs():
        if old.drive_dir == drive_dir:
            close_run(old, "reopened", f"colab_kit: finishing this kernel's open run {old.name!r} first")
    close_unheld_runs(f"before run {name!r} starts")


def open_claimed(name: str, drive_dir: Path, local: Path, *, lease: Lease, runtime, on_drive: bool, confirm,
                 resume, keep: int, save_every_s, save_every_steps, gauges: bool, ladder: Ladder, pace_bps: float,
                 ranks, replaced=None, save_every=None, threaded: bool = True, hub=None,
                 said: Notices | None = None) -> tuple[Run, Found | None, Path | None]:
    """The run folder, its lease held: how uploads are confirmed, what to resume from, the uploader.
    (`start_run`'s core; the deterministic simulator calls it too, with `threaded=False`: then nothing
    runs in the background, and the simulator calls the workers' step functions.)

    Returns:
        (the Run, the checkpoint it resumes from or None, where `resume=False` archived the old ones).
    Raises:
        DriveError: the checkpoints or the journal could not be read, or one the journal confirmed in the
            cloud cannot be used now (the lease is released: nothing was started).
    """
    notices = said or Notices()
    run = None
    try:
        if hub is None:
            kind, settled = probe_kind(drive_dir, on_drive=on_drive)
            kind, api = choose_confirmation(confirm, drive_dir, kind, colab=runtime.colab, say=notices.add)
        else:  # a replica of a run on the Hub: the Hub confirms, commits and deletes (`hub/store.py`)
            kind, settled, api = HUB, True, hub
        journal = Journal(drive_dir / EVENTS, local_copy=local / EVENTS, guard=lease.check)
        recover_saved(local / SNAPSHOTS)  # saves the Trainer finished but the kit never got to upload
        _clean_local(local)
        finding = find_resume(name, drive_dir, local, resume=resume, notices=notices, journal=journal,
                              on_hub=hub is not None)
        found = finding.found
        run = Run(name, drive_dir, local, on_drive=on_drive, save_every_s=save_every_s,
                  save_every_steps=save_every_steps, keep=keep, runtime=runtime, lease=lease,
                  journal=journal, notices=notices, gauges=gauges, kind=kind, prune_after=_PRUNE_AFTER, ranks=ranks,
                  ladder=ladder, pace_bps=pace_bps, api=api, known_steps=finding.told.expected,
                  confirmed_steps=finding.told.confirmed, threaded=threaded, kind_settled=settled)
        archived = None if resume is not False else archive_checkpoints(run, expected=bool(finding.told.expected))
        if found is not None:
            fetch_best_of(run, finding)  # before adopt_existing may prune it
        run.mirror.adopt_existing()
        if found is not None:
            _take(run, found)
        journal.write("start", run=name, drive_dir=str(drive_dir), local_dir=str(local),
                      host=lease.info.host, pid=lease.info.pid, colab=runtime.colab,
                      gpu=runtime.gpu.name if runtime.gpu else None, ram_limit=runtime.ram_limit_bytes,
                      save_every=save_every, keep=keep, durability=run.durability, world_size=ranks.world_size,
                      took_over=replaced.host if replaced else None, took_over_because=lease.took_over_because,
                      watched_s=round(lease.watched_s, 2))
        _journal_found(run, found, archived)
    except BaseException:  # a stop or a failure before the run is handed out: its uploader and the lease go
        if run is not None:
            run.mirror.close(timeout=5.0)
        lease.release()
        raise
    return run, found, archived


def _journal_found(run: Run, found: Found | None, archived: Path | None) -> None:
    if archived is not None:
        run.journal.write("archive", moved_to=str(archived))
    if found is not None:
        run.journal.write("resume", step=found.step, origin=found.origin, source=str(found.source),
                          checkpoint_age_s=round(clock.time() - found.manifest.created, 1),
                          train_seconds=round(run.clock.seconds, 1), best=run.mirror.best_step,
                          best_fetched=run.resume_best is not None)


def _resolve(name: str, drive, local_dir) -> tuple[Path, Path, bool]:
    """(the run folder, made; the local folder, made; whether it is on Colab's Drive mount)."""
    root, on_drive = resolve_root(drive)
    drive_dir = root / name
    try:
        storage.patiently(lambda: storage.make_dirs(drive_dir / CHECKPOINTS), RETRY_WAITS)
    except OSError as exc:
        raise DriveError(f"cannot create the run folder {drive_dir}: {exc}. Check that the folder "
                         f"is writable (and, on Drive, that it is not full), or pass drive='<another "
                         f"folder>'") from exc
    local = Path(local_dir).absolute() if local_dir is not None else _default_local_dir(name)
    local.mkdir(parents=True, exist_ok=True)
    return drive_dir, local, on_drive


def _claim(lease, name: str, drive_dir, takeover: bool, quiet: bool):
    """Acquire `lease` (a `Lease` or a `HubLease`) with a countdown while it watches another VM's; returns the
    lease it replaced, if any."""
    countdown = None if quiet else Countdown(every=10.0)

    def watching(holder, left):  # its heartbeat's time is another VM's clock: only whether it changes is said
        countdown.show(f"colab_kit: run folder {drive_dir} is held by host {holder.host}; watching whether its "
                       f"heartbeat advances (a heartbeat every {format_age(holder.heartbeat_s)}): {left:.0f} s left")

    try:
        replaced = lease.acquire(takeover=takeover, run_name=name, on_watch=watching if countdown else None)
    except KeyboardInterrupt:  # the stop button, while it watches another VM's lease (say so, and what next)
        print(stopped_claiming(name, drive_dir, lease), flush=True)
        raise
    except OSError as exc:
        raise DriveError(f"cannot write the lease file in {drive_dir}: {exc}. Check that the folder is "
                         f"writable and not full, then run this cell again") from exc
    return replaced


def _take(run: Run, found: Found) -> None:
    """Make `found` the checkpoint `run.train` resumes from (and say what versions changed since it was written)."""
    run.resume_from, run.resume_manifest = found.path, found.manifest
    then, now = found.manifest.versions, library_versions()
    drifted = drift(then, now)
    if drifted:
        run.notices.add(describe_drift(found.step, then, now))
        run.journal.write("warn", what="version_drift", step=found.step,
                          changed={name: list(pair) for name, pair in drifted.items()})
    run.resume_state = kit_state(found)
    run.clock = TrainClock(run.resume_state.get("train_seconds", 0.0))
    set_aside_newer(run.local_dir, found.step, run.journal)
    if found.origin == "drive":
        run.mirror.written_step = found.step
    else:
        # Found on local disk (a kernel restart on the same VM): its upload may never have
        # finished, so queue it; the uploader skips it when Drive already has it.
        run.mirror.submit(take_snapshot(found.path, run.local_dir / SNAPSHOTS, found.step,
                                        found.manifest.fingerprint, found.manifest.kit_state,
                                        taken=found.manifest.created))


def _finish_at_exit(ref: "weakref.ref[Run]") -> None:
    run = ref()
    if run is not None and not run._finished:
        try:
            run.finish(timeout=120, status="exit")
        except Exception as exc:  # never let an exit handler raise
            log.warning("colab_kit: finishing run at exit failed: %s", exc)
