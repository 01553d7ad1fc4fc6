"""The Trainer's best checkpoint (`load_best_model_at_end`, `EarlyStoppingCallback`) across a disconnect.

The Trainer records its best checkpoint as a local path (`state.best_model_checkpoint` in
trainer_state.json) and, on resume, drops it when that path is gone, which on a new VM it
always is; its own rotation never deletes it. The kit does the same on the persistent folder:

- the mirror is told which step is best: it is never superseded in the upload queue and never
  pruned while it is best, and takes one of the `keep` places (sync.py, retention.py);
- on resume, the best checkpoint is fetched too (`fetch_best`, from start_run) and the resumed
  state's path is pointed at the local copy before the first step (`restore_best`), so that
  `load_best_model_at_end` and early stopping behave as without a disconnect;
- a run that early stopping ended is complete, like one that reached max_steps (`early_stopped`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Callable, Iterable

from ..checkpoints.checkpoint import TRAINER_STATE, recorded_best, step_of
from ..checkpoints.checkpoint import trainer_state as _trainer_state
from ..checkpoints.search import find_latest

__all__ = ["TRAINER_STATE", "step_of", "recorded_best", "fetch_best", "restore_best", "early_stopped"]

log = logging.getLogger(__name__)


def fetch_best(best: int, resumed: Path, step: int, places: Iterable[tuple[str, Path]], local_root: Path,
               on_skip: Callable[[Path, str], None]) -> Path | None:
    """The local copy of checkpoint `best` (the one `recorded_best` names in the checkpoint `resumed`
    at `step`), fetched from `places` and verified; None when it cannot be found."""
    if best == step:
        return Path(resumed)
    found = find_latest(places, local_root, on_skip, step=best)
    return found.path if found is not None else None


def restore_best(best_local: Path | None, args, state) -> str | None:
    """Point the resumed Trainer state at the local copy of its best checkpoint; returns the path set.

    Called when training begins, after the Trainer has loaded (and, the recorded path being gone,
    dropped) `best_model_checkpoint`. The path is written the way the Trainer writes it
    (`output_dir/checkpoint-<step>`) when the copy lies in `output_dir`, so that its rotation
    recognises and keeps it.
    """
    current = getattr(state, "best_model_checkpoint", None)
    if best_local is None or (current is not None and os.path.isdir(current)):
        return None
    best_local = Path(best_local)
    if not best_local.is_dir() or getattr(state, "best_global_step", None) != step_of(best_local):
        return None
    output_dir = Path(args.output_dir)
    same_folder = output_dir.exists() and best_local.parent.resolve() == output_dir.resolve()
    path = os.path.join(args.output_dir, best_local.name) if same_folder else str(best_local)
    state.best_model_checkpoint = path
    log.info("the best checkpoint so far is %s (fetched at resume)", path)
    return path


def early_stopped(checkpoint: Path) -> bool:
    """True when `EarlyStoppingCallback` had run out of patience at `checkpoint`: the run is over."""
    saved = _trainer_state(checkpoint).get("stateful_callbacks", {}).get("EarlyStoppingCallback")
    if isinstance(saved, list):  # several instances: the Trainer stores a list
        saved = saved[-1] if saved else None
    if not isinstance(saved, dict):
        return False
    patience = saved.get("args", {}).get("early_stopping_patience")
    counter = saved.get("attributes", {}).get("early_stopping_patience_counter")
    return isinstance(patience, int) and isinstance(counter, int) and counter >= patience
