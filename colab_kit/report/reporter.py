"""The runtime's side of the status page: what it gathers, and when and how the page and the picture are written
into the run folder, within the store contract (docs/stores.md): small writes, never on the training thread.

The page goes with the lease's heartbeat, so that the page and `lease.json` say the same step at the same
moment (the lease carries the step; `python -m colab_kit status` reads it there):

- on a folder (Drive), right after each beat, from the heartbeat's thread, through the gate: written only while
  the lease is this runtime's (`gate.act`), in place (`storage.overwrite_bytes`): a file renamed over the old
  page would send the old one to Drive's Trash, about 40 KB of picture each time, counted against the quota;
- on the Hub, inside the heartbeat's own commit (no commit of its own), and the repository's card with it when
  a checkpoint reached the cloud;
- a checkpoint confirmed in the cloud beats at once (one more lease write, or one more commit on the Hub), so the
  page says it within seconds; the release of the lease carries the run's last page.

The picture is drawn again every `PICTURE_EVERY_S`, and when a checkpoint reached the cloud (what a reader looks
for in it), but not more often than every `PICTURE_MIN_S`: it costs about 0.1 s of a CPU core, which training on
Colab's two cores shares: the first one comes `PICTURE_MIN_S` after the first beat at the soonest. The last one
is drawn as the run finishes. Nothing is drawn before there is something to show (a loss or a checkpoint in the
cloud).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque

from ..checkpoints import storage
from ..drive.drivefs import HUB, describe_kind
from ..drive.gate import act
from .card import CARD, update_card
from .page import STATUS_PAGE, STATUS_PICTURE, PageFacts, render_page
from .picture import Series, render_picture
from .state import state_of

__all__ = ["Reporter", "attach", "PICTURE_EVERY_S", "PICTURE_MIN_S"]

log = logging.getLogger(__name__)
PICTURE_EVERY_S = 300.0
PICTURE_MIN_S = 60.0
_MEMORY_POINTS = 720  # a sample per beat: 6 h at 30 s
_RATE_WINDOW_S = 300.0


class Reporter:
    """Gathers a run's progress from its threads and writes its status page with its lease's beats."""

    def __init__(self, run):
        self.run = run
        self.series = Series()
        self.step: int | None = None
        self.total_steps: int | None = None
        self._beats: deque = deque(maxlen=64)  # (time, step) at each beat, for the rate
        self._lock = threading.Lock()
        self._picture: bytes | None = None
        self._picture_at: float | None = None  # the first look (the first beat)
        self._picture_stale = True
        self._card_due = True
        self._closing: str | None = None  # the finish's status, once the run finishes

    # -- from the run's threads (cheap: no I/O) ------------------------------------------------------------
    def record_step(self, step: int, total: int | None) -> None:
        self.step, self.total_steps = step, total or None

    def record_loss(self, step: int, loss: float) -> None:
        with self._lock:
            self.series.losses.append((step, float(loss)))

    def record_save(self, step: int) -> None:
        with self._lock:
            self.series.saves[step] = time.time()  # drawn with the next picture

    def confirmed(self, upload) -> None:
        """The tracker's hook: `upload` is in the cloud. The page says so at the next beat, which comes now."""
        if upload.step is None:
            return
        with self._lock:
            self.series.clouds[upload.step] = upload.confirmed_at or time.time()
            self.series.saves.setdefault(upload.step, upload.saved)
            self._picture_stale = self._card_due = True
        if self._closing is None:
            self.run.lease.beat_now()
        else:  # confirmed after the run finished (`finish()` again waited for it): the last page says so
            self.rewrite_last_page()

    def rewrite_last_page(self) -> None:
        """The finished run's page again (its heartbeat has stopped), still only while the lease is this runtime's."""
        lease = self.run.lease
        try:
            if self.run.durability == HUB:
                lease.commit("colab_kit: status", add=self.hub_files(lease.info.step, time.time()))
            else:
                self.write_to_folder()
        except OSError as exc:  # the page is a view: the journal and the lease hold the truth
            log.debug("the last status page was not rewritten: %s", exc)

    def closing(self, status: str) -> None:
        """The run finishes with `status`: the release of the lease carries the last page."""
        self._closing = status
        self._picture_stale = self._card_due = True

    # -- the page --------------------------------------------------------------------------------------------
    def progress(self) -> int | None:
        """The step the lease's next beat carries (the lease calls this)."""
        return self.step

    def facts(self, step: int | None, updated: float) -> PageFacts:
        run, lease = self.run, self.run.lease
        tracker = run.mirror.tracker
        newest = tracker.newest_in_cloud()
        summary = tracker.summary()
        self._beats.append((updated, step))
        return PageFacts(
            name=run.name, state=state_of(self._closing is not None, self._closing), host=lease.info.host,
            where=_where(run.runtime), started=lease.info.started, updated=updated, heartbeat_s=lease.heartbeat_s,
            durability=describe_kind(run.durability), step=step, total_steps=self.total_steps,
            steps_per_s=self._rate(), saved_step=run.last_saved_step,
            cloud_step=newest.step if newest else None, cloud_saved=newest.saved if newest else None,
            uploading=summary["pending"], pending_bytes=summary["pending_bytes"],
            pending_eta_s=summary["pending_eta_s"],
            session=run.session.describe(updated) if run.session is not None and self._closing is None else None,
            note=self._note())

    def files(self, step: int | None, updated: float) -> dict[str, bytes]:
        """The page (and the picture, when it is due) for the beat at `updated` that carries `step`."""
        facts = self.facts(step, updated)
        files = {STATUS_PAGE: render_page(facts).encode()}
        picture = self._draw(updated)
        if picture is not None:
            files[STATUS_PICTURE] = picture
        return files

    def _draw(self, now: float) -> bytes | None:
        """The picture when it is due (None: the one written last still holds)."""
        self._sample_memory(now)
        if self._picture_at is None:
            self._picture_at = now  # the first look: a run shorter than PICTURE_MIN_S draws once, at its end
        since = now - self._picture_at
        if not (self._closing is not None or since >= PICTURE_EVERY_S or self._picture_stale and since >= PICTURE_MIN_S):
            return None
        with self._lock:
            if not (self.series.losses or self.series.clouds):
                return None
            snapshot = Series(list(self.series.losses), list(self.series.memory), dict(self.series.saves),
                              dict(self.series.clouds))
            self._picture_stale = False
        try:
            self._picture = render_picture(snapshot, f"run {self.run.name}", now=now)
        except Exception as exc:  # noqa: BLE001 - a picture never costs the page or the lease
            log.debug("the status picture could not be drawn: %s", exc)
            return None
        self._picture_at = now
        return self._picture

    def _sample_memory(self, now: float) -> None:
        try:
            import psutil

            host = psutil.Process(os.getpid()).memory_info().rss / 2**30
        except Exception:  # noqa: BLE001
            return
        gpu = None
        torch = __import__("sys").modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():  # never the first to touch CUDA
            gpu = torch.cuda.memory_allocated() / 2**30
        with self._lock:
            self.series.memory = (self.series.memory + [(now, host, gpu)])[-_MEMORY_POINTS:]

    def _rate(self) -> float | None:
        known = [(t, s) for t, s in self._beats if s is not None]
        if len(known) < 2:
            return None
        latest = known[-1]
        first = next((b for b in known if latest[0] - b[0] <= _RATE_WINDOW_S), known[0])
        if first is latest:
            first = known[-2]
        seconds = latest[0] - first[0]
        return (latest[1] - first[1]) / seconds if seconds > 0 and latest[1] >= first[1] else None

    def _note(self) -> str | None:
        run = self.run
        if self._closing is None and getattr(run, "stop_button", None) is None and run.global_step is not None:
            return (f"Training is paused at step {run.global_step} (the notebook's stop button, or its training "
                    f"cell ended); the run is open in its kernel.")
        return None

    # -- writing: on a folder, after each beat; on the Hub, in the beat's commit ------------------------------
    def write_to_folder(self) -> None:
        """After a beat on a folder (the heartbeat's thread): the page and the picture, while the lease is ours."""
        lease = self.run.lease
        files = self.files(lease.info.step, lease.info.heartbeat)
        for name, data in files.items():
            act(f"write the status {'page' if name == STATUS_PAGE else 'picture'}", name,
                [lambda: None if lease.check() is True else "the lease is not confirmed as this runtime's now"],
                lambda: storage.overwrite_bytes(self.run.drive_dir / name, data))  # in place: no Trash

    def hub_files(self, step: int | None, updated: float) -> dict[str, bytes]:
        """For a commit of the Hub's lease: the page, the picture, and the repository's card when it is due,
        as paths in the repo."""
        lease = self.run.lease
        folder = lease.folder
        files = {f"{folder}/{name}" if folder else name: data for name, data in self.files(step, updated).items()}
        if self._card_due and folder:
            card = self._card(lease, step, updated)
            if card is not None:
                files[CARD] = card
        return files

    def _card(self, lease, step, updated) -> bytes | None:
        try:
            existing = lease.repo.read(CARD, revision=lease.head)
        except OSError as exc:  # unknown: the card waits for the next checkpoint (never written over unread)
            log.debug("the repo's card could not be read: %s", exc)
            return None
        self._card_due = False
        tracker = self.run.mirror.tracker
        newest = tracker.newest_in_cloud()
        return update_card(existing, lease.folder, state=state_of(self._closing is not None, self._closing),
                           step=step, cloud_step=newest.step if newest else None, updated=updated)


def attach(run) -> Reporter:
    """Give `run` its reporter: the lease carries its step, and the page goes with the lease's beats."""
    reporter = Reporter(run)
    lease = run.lease
    lease.progress = reporter.progress
    if run.durability == HUB:
        lease.riders = reporter.hub_files
    else:
        lease.after_beat = reporter.write_to_folder
    run.mirror.tracker.on_confirmed = reporter.confirmed
    return reporter


def _where(runtime) -> str:
    place = "Google Colab" if runtime.colab else "Kaggle" if runtime.kaggle else "not Colab or Kaggle"
    return place + (f", {runtime.gpu.name}" if runtime.gpu else ", no GPU")

