"""`start_run(time_limit=...)` in the Trainer: stop, save and confirm before the session is cut (issue 49).

At every step end the callback asks `TimeLimitWatch.due`: is what is left of the session still more than a
safe wind-down (`lifecycle/deadline.py`)? When it is not, this step is saved and training stops; `run.train`
then waits for the cloud until just before the limit, finishes the run (releasing the runtime when asked) and
raises `TimeLimitReached`, so that a "Run all" does not go on to evaluate and export a model halfway trained.
"""

from __future__ import annotations

import time

from .._units import format_age
from ..checkpoints.clock import clock
from ..drive.drivefs import PLAIN
from ..errors import TimeLimitReached
from ..lifecycle import deadline
from ..lifecycle.deadline import LOCAL_WRITE_BPS

__all__ = ["TimeLimitWatch", "end_at_limit"]

_STEP_EMA = 0.3  # the weight of the newest step in the step time's moving average


class TimeLimitWatch:
    """The Trainer's side of a run's session clock: the step time, the save time, the decision to stop."""

    def __init__(self, run):
        self.run = run
        self.step_s = 0.0
        self.save_s: float | None = None
        self._last_step_at: float | None = None
        self._asked_at: float | None = None
        self._model_bytes: int | None = None

    def step_ended(self) -> None:
        now = time.perf_counter()
        if self._last_step_at is not None:
            took = now - self._last_step_at
            self.step_s = took if not self.step_s else (1 - _STEP_EMA) * self.step_s + _STEP_EMA * took
        self._last_step_at = now

    def save_asked(self) -> None:
        self._asked_at = time.perf_counter()

    def saved(self) -> None:
        """After the Trainer's save (and the evaluation before it, if any): its time is the next save's guess."""
        if self._asked_at is not None:
            self.save_s = time.perf_counter() - self._asked_at
            self._asked_at = None
            self._last_step_at = time.perf_counter()  # the save is not a step's time

    def due(self, model, saving: bool = False) -> bool:
        """Is it time to save this step and stop (the run's clock leaves no more than a safe wind-down)?

        `saving`: the schedule saves this step anyway. Going on past it leaves that checkpoint to upload as well
        as the last one, so the wind-down of the next steps is asked now: if it no longer fits, this save is the
        last (else the estimate would jump by a checkpoint just after the save, too late)."""
        clock = self.run.session
        if clock is None or self.run.session_stop is not None:
            return False
        checkpoint = self._checkpoint_bytes(model)
        pending = self.run.mirror.tracker.pending_bytes + checkpoint * len(self.run.mirror.pending_steps)
        wind_down = clock.wind_down_s(checkpoint_bytes=checkpoint, pending_bytes=pending + (checkpoint if saving else 0),
                                      save_s=self.save_s, upload_bps=self._upload_bps(), step_s=self.step_s)
        if not clock.due(wind_down):
            return False
        self.run.session_stop = (f"{format_age(max(clock.left_s(), 0.0))} were left of the session "
                                 f"({clock.source}), and saving, uploading and confirming the last checkpoint "
                                 f"needs about {format_age(wind_down)}")
        return True

    def _checkpoint_bytes(self, model) -> int:
        if self.run.last_checkpoint_bytes:
            return self.run.last_checkpoint_bytes
        if self._model_bytes is None:  # before the first save: weights and AdamW's two moments
            params = model.parameters() if model is not None else ()
            self._model_bytes = 3 * sum(p.numel() * p.element_size() for p in params)
        return self._model_bytes

    def _upload_bps(self) -> float:
        """The upload rate to plan the end with: the measured one (start_run's assumed rate until a checkpoint is
        confirmed; a copy's speed on a plain folder), and never more than an upload still pending shows: B bytes
        not up after t seconds mean less than B/t (a first upload on a slow Drive, or one that stalls)."""
        tracker = self.run.mirror.tracker
        rate = tracker.rate_bps or (LOCAL_WRITE_BPS if self.run.durability == PLAIN
                                    else self.run._mirror_settings["pace_bps"])
        now = clock.monotonic()
        for upload in tracker.pending():
            age = now - upload.started
            if upload.measure and upload.bytes and age > 1.0:
                rate = min(rate, upload.bytes / age)
        return rate


def end_at_limit(run, step: int) -> None:
    """After training stopped for the session's limit: wait for the cloud until just before the limit, finish
    (releasing the runtime when asked), and raise `TimeLimitReached` with what is where.

    Raises:
        TimeLimitReached: always (the run is finished: a new session's "Run all" continues from the cloud).
    """
    left = run.session.left_s()
    run.journal.write("time_limit", step=step, left_s=round(left, 1), reason=run.session_stop)
    print(f"colab_kit: the session's limit is near: {run.session_stop}. Training stopped at step {step}; the "
          f"run now waits for the cloud and finishes.", flush=True)
    summary = run.finish(timeout=max(left - deadline.FINISH_S, 1.0), status="time limit", release_runtime=run.release_at_limit)
    where = (f"checkpoint-{summary.get('cloud_step')} is in the cloud" if summary.get("in_cloud")
             else f"not everything reached the cloud before the limit (pending: "
                  f"{', '.join(summary.get('pending') or []) or 'the journal'})")
    raise TimeLimitReached(
        f"run {run.name!r} stopped at step {step}, before the session's limit, and is finished: {where}. In a new "
        f"session, Runtime -> Run all continues from there (the evaluation and export cells after this one did "
        f"not run)")
