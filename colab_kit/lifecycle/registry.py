"""The runs this process has open, one per run folder, and the training clock each carries.

`start_run` registers a run here; `run.finish()` unregisters it. Both import this module, neither imports
the other. A run of the same folder opened again (its cell run twice) closes the earlier one; so does a run
that no variable of the notebook holds any more (the `start_run` cell run again under a new RUN_NAME
rebinds `run`), at the next `start_run` or `run.train`: without that, its uploader and lease would live on
until the kernel exits. A run a variable still holds stays open (the RNA notebook pre-trains in a second
run while the first is open).
"""

from __future__ import annotations

import time
import weakref

__all__ = ["register", "unregister", "open_runs", "unheld_runs", "user_namespace", "TrainClock"]

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


def user_namespace() -> dict | None:
    """The notebook's variables (IPython's user namespace), or None outside a notebook."""
    from ..runtime import in_notebook

    if not in_notebook():
        return None
    import IPython

    return IPython.get_ipython().user_ns


def unheld_runs(keep=None) -> list:
    """The open runs (but `keep`) that no variable of the notebook holds any more; none outside a notebook."""
    namespace = user_namespace()
    if namespace is None:
        return []
    held = {id(value) for value in list(namespace.values())}
    return [run for run in open_runs() if run is not keep and id(run) not in held]


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
