"""What the gate (`gate.py`) knows beyond one read: which checkpoints this runtime wrote, in which order, and
which folders have held no checkpoint for long enough to be taken as holding none.

Order. Where nothing confirms uploads, a deletion is vouched for by a checkpoint *written before* it (a VM
uploads files in the order they were written). That order is never read off a clock, which can be minutes
off and set back: this runtime's writes go by its own count, after every other runtime's (it took the lease
once they had written), and those go by the time their mount gave their files.

Holding no checkpoint. A folder whose manifest, read whole, does not match holds nothing a resume could use:
positive evidence, at once. One whose manifest lists a file that is missing holds nothing only once two
series of looks, each over `looks.span()` and `ABSENT_FOR_S` apart, found it missing at every look, with
every look between them (Drive hides files for seconds, an upload that died with its VM is gone for good); and
never where the cloud was once confirmed to hold it (the tracker's word, or the journal's).

The looks are spread over the passes that ask, one look a pass at most: a pass never sleeps on them. (A pass
that waited out the spaced looks held the mirror's thread: 11 s a pass on one invalid checkpoint, and with
saves 0.8 s apart the mirror wrote 3 of 12 of them.)
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Callable

from ..checkpoints import looks, validity
from ..checkpoints.clock import clock

__all__ = ["ABSENT_FOR_S", "Evidence"]

ABSENT_FOR_S = 120.0


class Evidence:
    """Args: confirmed: the steps confirmed in the cloud (the tracker's, with those the run's journal names)."""

    def __init__(self, confirmed: Callable[[], set[int]] = set):
        self.confirmed = confirmed
        self._written: dict[int, int] = {}  # step -> this runtime's count when it last wrote that checkpoint
        self._count = itertools.count(1)
        self._absent: dict[str, _Absence] = {}  # folder -> the looks that found a file it lists missing
        self._pass_began = float("-inf")

    def wrote(self, folder: Path) -> None:
        """This runtime begins writing (publishing, repairing, replacing) the checkpoint `folder`: what it
        writes queues behind everything it wrote before."""
        self._written[_step(folder)] = next(self._count)

    def write_order(self, chosen) -> tuple:
        """A key that sorts `chosen` (a `gate.Chosen`) among the run's checkpoints in the order they were written."""
        count = self._written.get(chosen.step)
        return (1, count, 0.0, chosen.step) if count is not None else (0, 0, chosen.written_at, chosen.step)

    def new_pass(self, listed) -> None:
        """A pruning pass begins, over the checkpoint folders `listed`: the looks at any other folder are
        forgotten (deleted, or hidden by this listing: its looks start again, which costs time only)."""
        listed = {str(path) for path in listed}
        self._absent = {key: absence for key, absence in self._absent.items() if key in listed}
        self._pass_began = clock.monotonic()

    def next_look_at(self, folders=None) -> float:
        """When the next of the spaced looks is due (monotonic; inf: none) at `folders`, or at those this pass
        looked at: the caller's next try then, so that an absence becomes a fact without a try waiting for it."""
        if folders is not None:
            keys = {str(path) for path in folders}
            due = [a.due() for key, a in self._absent.items() if key in keys]
        else:
            due = [a.due() for a in self._absent.values() if a.looked_at >= self._pass_began]
        return min(due, default=float("inf"))

    def holds_no_checkpoint(self, chosen) -> bool:
        """Does the folder `chosen` hold nothing a resume could use, by the rules of the module docstring? A read
        that fails is not an answer (False)."""
        if chosen.manifest_raw is None:
            return False
        key = str(chosen.path)
        verdict = validity.check(chosen.path, step=chosen.step)  # this pass's one look
        if verdict.state == validity.INVALID:
            return True
        if not (verdict.absent and verdict.manifest is not None) or chosen.step in self.confirmed():
            self._absent.pop(key, None)
            return False
        return self._absent.setdefault(key, _Absence()).missing_again(clock.monotonic())


class _Absence:
    """The looks at one folder that found a file its manifest lists missing, all of them since the first: a
    series over `looks.span()` (its looks due as `looks.WAITS` spaces them; a look later than several of them
    stands for them all: what proves an absence is the time it lasted), single looks for `ABSENT_FOR_S`, then a
    second series. A look that finds the file (or cannot read) ends it: the caller forgets this and starts
    again."""

    def __init__(self):
        self.series_began: float | None = None  # the first look of the series under way (None: between them)
        self.first_done: float | None = None  # when the first series was complete
        self.done = False
        self.looked_at = float("-inf")  # the last look, counted or not

    def due(self) -> float:
        """When the next look that counts can be taken (inf: none is needed)."""
        if self.done:
            return float("inf")
        if self.series_began is None:
            return self.looked_at if self.first_done is None else self.first_done + ABSENT_FOR_S
        passed = self.looked_at - self.series_began
        marks = [mark for mark in itertools.accumulate(looks.WAITS) if mark > passed]
        return self.series_began + (marks[0] if marks else 0.0)

    def missing_again(self, now: float) -> bool:
        """Missing at this look, at `now`: True once both series are complete, every look of them missing."""
        self.looked_at = now
        if self.done:
            return True  # it stays a fact while every look agrees
        if self.series_began is None:
            if self.first_done is not None and now - self.first_done < ABSENT_FOR_S:
                return False  # between the series: every try looks, none counts
            self.series_began = now
            return False
        if now - self.series_began < looks.span():
            return False
        if self.first_done is None:
            self.first_done, self.series_began = now, None
            return False
        self.done = True
        return True


def _step(folder: Path) -> int:
    return int(Path(folder).name.split("-")[-1])
