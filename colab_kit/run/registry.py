"""The runs this process has open, one per run folder, and the training clock each carries.

`start_run` registers a run here and closes the kernel's earlier open runs first (a cell run twice, or
run again under another name: one run at a time trains in a kernel); `run.finish()` unregisters it. Both
import this module, neither imports the other.
"""

from __future__ import annotations

import time
import weakref

__all__ = ["register", "unregister", "open_runs", "TrainClock"]

_OPEN: dict[str, weakref.ref] = {}  # run folder -> the open Run of this process


def register(run) -> None:
    _OPEN[str(run.drive_dir)] = weakref.ref(run)


def unregister(run) -> None:
    ref = _OPEN.get(str(run.drive_dir))
    if ref is not None and ref() is run:
        del _OPEN[str(run.drive_dir)]


def open_runs() -> list:
    """Every unfinished run of this process, oldest first."""
    runs = (ref() for ref in list(_OPEN.values()))
    return [run for run in runs if run is not None and not run._finished]


class TrainClock:
    """Training wall time, carried across resumes (so "every 10min" means training time)."""

    def __init__(self, seconds: float = 0.0):
        self._base = float(seconds)
        self._t0: float | None = None

    def start(self) -> None:
        if self._t0 is None:
            self._t0 = time.monotonic()

    def stop(self) -> None:
        if self._t0 is not None:
            self._base += time.monotonic() - self._t0
            self._t0 = None

    @property
    def seconds(self) -> float:
        return self._base + (time.monotonic() - self._t0 if self._t0 is not None else 0.0)
