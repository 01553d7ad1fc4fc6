"""The session's clock: a run that ends on its own before the session is cut (issue 49).

Colab cuts a runtime at its session's cap (12 h free, 24 h paid, often sooner) and Kaggle at 12 h (its
documented limit for CPU and GPU sessions, kaggle.com/docs/notebooks); the work since the last checkpoint
is lost then, and the cut often falls in the middle of an upload. With `start_run(..., time_limit="11h30m")`
the run stops *before* the limit, early enough to save, upload and confirm that last checkpoint and to
release the run folder:

    left <= 1.5 x (save + upload of what is pending and of one more checkpoint) + 2 x step + FINISH_S

checked at every optimizer step (arithmetic only; the training thread never waits for it). The save's and
the upload's times are the ones measured in this run (the newest checkpoint's size and pause, the upload
rate the cloud confirmed), guessed until then from the model's size and the run's assumed rate.

The clock counts from the runtime's start where the platform's cap does (Colab, Kaggle: the container's
first process, so a restarted kernel keeps the time already spent), else from `start_run`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .._units import format_age, parse_duration

__all__ = ["SessionClock", "KAGGLE_LIMIT_S", "FINISH_S", "resolve_time_limit", "runtime_started"]

KAGGLE_LIMIT_S = 12 * 3600.0  # Kaggle's documented cap of a CPU or GPU session
FINISH_S = 20.0  # the journal's last lines, the lease's release, the last status page: seconds at most
LOCAL_WRITE_BPS = 200e6  # a first save's time, guessed before one is measured (a VM's local disk)
MARGIN = 1.5  # over the measured (or guessed) wind-down: a slower upload than the last one still fits


def runtime_started() -> float | None:
    """When this container's first process started (Colab's and Kaggle's session clocks count from there), or
    None where that cannot be asked."""
    try:
        import psutil

        return psutil.Process(1).create_time()
    except Exception:  # no psutil, or no access to pid 1
        return None


def resolve_time_limit(time_limit, *, colab: bool, kaggle: bool, now: float | None = None) -> "SessionClock | None":
    """The clock `start_run(time_limit=...)` asks for: a duration ("11h30m", "90min", seconds), None (none, or
    Kaggle's 12 h on Kaggle) or False (none, even on Kaggle).

    Raises:
        ValueError: a time limit that cannot be read, with the forms that can.
    """
    now = time.time() if now is None else now
    if time_limit is False:
        return None
    if time_limit is None:
        if not kaggle:
            return None
        limit_s, source = KAGGLE_LIMIT_S, "Kaggle's 12 h session limit"
    else:
        if isinstance(time_limit, bool) or not isinstance(time_limit, (int, float, str)):
            raise ValueError(f"time_limit={time_limit!r}: give a duration such as \"11h30m\" or \"90min\", seconds, "
                             f"or None")
        try:
            limit_s = float(time_limit) if isinstance(time_limit, (int, float)) else parse_duration(time_limit)
        except ValueError:
            raise ValueError(f"time_limit={time_limit!r}: cannot be read as a duration; give one such as \"11h30m\", "
                             f"\"90min\" or \"12h\", or seconds") from None
        if limit_s <= 0:
            raise ValueError(f"time_limit={time_limit!r}: the session's limit must be longer than zero")
        source = f"time_limit={time_limit!r}"
    started = runtime_started() if colab or kaggle else None
    counted = "the runtime's start" if started is not None else "start_run"
    return SessionClock(limit_s, started if started is not None and started <= now else now, source=source,
                        counted_from=counted)


@dataclass
class SessionClock:
    """A session that ends `limit_s` seconds after `started` (wall clock)."""

    limit_s: float
    started: float
    source: str = "time_limit"
    counted_from: str = "start_run"

    @property
    def ends(self) -> float:
        return self.started + self.limit_s

    def left_s(self, now: float | None = None) -> float:
        return self.ends - (time.time() if now is None else now)

    def describe(self, now: float | None = None) -> str:
        left = self.left_s(now)
        return (f"session: {format_age(max(left, 0.0))} left" if left > 0 else "session: its time limit has passed")

    def wind_down_s(self, *, checkpoint_bytes: int, pending_bytes: int, save_s: float | None,
                    upload_bps: float | None, step_s: float) -> float:
        """Seconds from now to a run finished and confirmed: one more save, what is pending and that save uploaded,
        a step or two, the finish, with `MARGIN` over the estimates."""
        save = save_s if save_s is not None else checkpoint_bytes / LOCAL_WRITE_BPS
        upload = (pending_bytes + checkpoint_bytes) / upload_bps if upload_bps else 0.0
        return MARGIN * (save + upload) + 2 * step_s + FINISH_S

    def due(self, wind_down_s: float, now: float | None = None) -> bool:
        """Time to stop: what is left no longer holds a safe wind-down."""
        return self.left_s(now) <= wind_down_s
