"""The notebook's stop button during `run.train`: a pause, not a loss (issue 28).

Jupyter's stop button (and Colab's) interrupts the kernel: SIGINT, which Python turns into a
KeyboardInterrupt wherever the training loop happens to be. In a notebook, while `run.train` runs:

- the first press lets the current optimizer step finish, saves a checkpoint at that step, and then
  ends the cell with KeyboardInterrupt (an error, so that a "Run all" stops there instead of going
  on to the evaluation cells). Nothing is redone.
- a second press stops at once, as before (the steps since the last save are redone).

Either way the run stays open: running the training cell again continues from the newest checkpoint
saved, with the trainer still in the kernel. In a script, Ctrl-C keeps Python's meaning (it stops,
and the run finishes).
"""

from __future__ import annotations

import signal
import sys
import threading
from pathlib import Path

from ..checkpoints.checkpoint import checkpoint_dir
from ..checkpoints.manifest import MANIFEST, Manifest, hash_folder, read_manifest
from ..runtime import in_notebook

__all__ = ["StopButton", "keep_open_after_stop"]


class StopButton:
    """While entered (in a notebook's main thread): the first SIGINT asks for a save and a stop at the next
    step boundary (`requested`); the second raises KeyboardInterrupt at once."""

    def __init__(self, run):
        self.run = run
        self.presses = 0
        self.armed = False
        self._previous = None

    @property
    def requested(self) -> bool:
        return self.presses > 0

    def __enter__(self) -> "StopButton":
        # Only over Python's own handler: a handler someone else installed keeps its meaning.
        if (in_notebook() and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is signal.default_int_handler):
            self._previous = signal.signal(signal.SIGINT, self._press)
            self.armed = True
        self.run.stop_button = self
        return self

    def __exit__(self, *exc) -> None:
        if self.armed:
            signal.signal(signal.SIGINT, self._previous)
        self.run.stop_button = None

    def _press(self, signum, frame) -> None:
        self.presses += 1
        if self.presses > 1:
            raise KeyboardInterrupt
        print("colab_kit: stop pressed: this step finishes and is saved, then training pauses (the run stays "
              "open; run the cell again to continue). Press stop again to stop at once.", file=sys.stderr,
              flush=True)


def keep_open_after_stop(run, trainer, presses: int) -> None:
    """After a stop in a notebook: the run stays open and continues, at the next `run.train`, from the newest
    checkpoint this run saved; say where training stopped, what is saved, and what the next run redoes."""
    step = trainer.state.global_step
    run.clock.stop()
    run._close_gauges(error=f"stopped at step {step}")
    saved = run.last_saved_step
    folder = checkpoint_dir(Path(trainer.args.output_dir), saved) if saved is not None else None
    if folder is not None and folder.is_dir():
        run.resume_from, run.resume_manifest = folder, _manifest_of(folder, saved, run.fingerprint)
    since = run.resume_manifest.step if run.resume_manifest is not None else 0
    redo = step - since
    where = (f"checkpoint-{since} is saved (and on its way to {run.drive_dir})" if run.resume_from is not None
             else "no checkpoint is saved yet")
    print(f"colab_kit: run {run.name!r} stopped at step {step}; {where}"
          + (f"; the {redo} step(s) since it will be redone" if redo > 0 else "; nothing will be redone")
          + ". The run stays open: run this cell again to continue from there.", flush=True)
    run.journal.write("stop", step=step, saved=since if run.resume_from is not None else None, presses=presses)


def _manifest_of(folder: Path, step: int, fingerprint: dict | None) -> Manifest:
    """The manifest of a checkpoint this run saved (the uploader writes it beside the files, or has not yet:
    then its files are hashed here)."""
    if (folder / MANIFEST).is_file():
        try:
            return read_manifest(folder)
        except (OSError, ValueError):
            pass
    return Manifest(step=step, files=hash_folder(folder), fingerprint=dict(fingerprint or {}))
