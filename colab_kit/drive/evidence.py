"""What the gate (`gate.py`) knows beyond one read: which checkpoints this runtime wrote, in which order, and
which folders have held no checkpoint for long enough to be taken as holding none.

Order. Where nothing confirms uploads, a deletion is vouched for by a checkpoint *written before* it (a VM
uploads files in the order they were written). That order is never read off a clock, which can be minutes
off and set back: this runtime's writes go by its own count, after every other runtime's (it took the lease
once they had written), and those go by the time their mount gave their files.

Holding no checkpoint. A folder whose manifest, read whole, does not match holds nothing a resume could use:
positive evidence, at once. One whose manifest lists a file that is missing holds nothing only once every
look agrees, spaced in time (`validity.settled`), and again at passes `ABSENT_FOR_S` apart (Drive hides files
for seconds, an upload that died with its VM is gone for good); and never where the cloud was once confirmed
to hold it (the tracker's word, or the journal's).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable

from ..checkpoints import validity
from ..checkpoints.clock import clock

__all__ = ["ABSENT_FOR_S", "Evidence"]

ABSENT_FOR_S = 120.0


class Evidence:
    """Args: confirmed: the steps confirmed in the cloud (the tracker's, with those the run's journal names)."""

    def __init__(self, confirmed: Callable[[], set[int]] = set):
        self.confirmed = confirmed
        self._written: dict[int, int] = {}  # step -> this runtime's count when it last wrote that checkpoint
        self._count = itertools.count(1)
        self._absent_since: dict[str, float] = {}  # folder -> when a file it lists was first missing at every look

    def wrote(self, folder: Path) -> None:
        """This runtime begins writing (publishing, repairing, replacing) the checkpoint `folder`: what it
        writes queues behind everything it wrote before."""
        self._written[_step(folder)] = next(self._count)

    def write_order(self, chosen) -> tuple:
        """A key that sorts `chosen` (a `gate.Chosen`) among the run's checkpoints in the order they were written."""
        count = self._written.get(chosen.step)
        return (1, count, 0.0, chosen.step) if count is not None else (0, 0, chosen.written_at, chosen.step)

    def holds_no_checkpoint(self, chosen) -> bool:
        """Does the folder `chosen` hold nothing a resume could use, by the rules of the module docstring? A read
        that fails is not an answer (False)."""
        if chosen.manifest_raw is None:
            return False
        key = str(chosen.path)
        verdict = validity.check(chosen.path, step=chosen.step)
        if verdict.state == validity.INVALID:
            return True
        if not (verdict.absent and verdict.manifest is not None) or chosen.step in self.confirmed():
            self._absent_since.pop(key, None)
            return False
        verdict = validity.settled(chosen.path, step=chosen.step, confirmed=False)
        if verdict.state != validity.INVALID:
            self._absent_since.pop(key, None)
            return False
        first = self._absent_since.setdefault(key, clock.monotonic())
        return clock.monotonic() - first >= ABSENT_FOR_S


def _step(folder: Path) -> int:
    return int(Path(folder).name.split("-")[-1])
