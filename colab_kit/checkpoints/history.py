"""What a run's journal says of its checkpoints: which were written to the persistent folder and which were
confirmed in the cloud, since the last fresh start. The finders (`search.py`, `lifecycle/find.py`) read it before they
trust an empty or a partial listing: absence is not evidence where the journal says a checkpoint was there.
"""

from __future__ import annotations

import errno
import json
from dataclasses import dataclass, field
from pathlib import Path

from . import looks, storage
from .clock import clock
from .journal import parse_events

__all__ = ["History", "history", "read_history"]


@dataclass
class History:
    """What a run's journal says of its checkpoints since its last fresh start (an `archive` event).

    Attributes:
        synced: steps written to the persistent folder (`sync`; or tried, `sync_failed`), not pruned since.
        confirmed: steps confirmed in the cloud (`cloud`), not pruned since: such a checkpoint becomes
            invalid only on positive evidence, never because it cannot be seen.
    """

    synced: set[int] = field(default_factory=set)
    confirmed: set[int] = field(default_factory=set)
    started: bool = False  # a runtime opened the run before (an empty listing is then looked at again)
    found: bool = False  # the journal file was there
    occupied: bool = False  # the run folder showed checkpoints or a journal at a look (`search.read_told`)

    @property
    def expected(self) -> set[int]:
        """The checkpoints that should be in the run folder."""
        return self.synced | self.confirmed

    @property
    def newest_confirmed(self) -> int | None:
        return max(self.confirmed, default=None)


def history(events: list[dict]) -> History:
    """Fold `events` (in time order) into a `History`."""
    told = History()
    for event in events:
        kind, step = event.get("event"), event.get("step")
        if kind == "archive":
            told = History()
        elif kind == "start":
            told.started = True
        elif kind in ("sync", "resume") and isinstance(step, int):  # written; or found there and resumed from
            told.synced.add(step)
        elif kind == "warn" and event.get("what") == "sync_failed" and isinstance(step, int):
            told.synced.add(step)  # a write that failed part-way may have finished all but its read-back
        elif kind == "cloud" and isinstance(step, int):
            told.confirmed.add(step)
        elif kind == "prune":
            for gone in event.get("steps") or []:
                told.synced.discard(gone)
                told.confirmed.discard(gone)
    return told


def read_history(path: str | Path, local_copy: str | Path | None = None, *, expected: bool = True,
                 waits=(1.0, 2.0, 4.0)) -> History:
    """The `History` of the journal at `path` (the persistent folder's) and its `local_copy` together.

    A journal that cannot be read is asked again after each of `waits`; one missing is looked for again
    (`looks.again`) before it counts as none, where one is `expected` (the folder holds checkpoints).

    Raises:
        OSError: the journal could not be read (what it says is unknown).
    """
    def look():
        try:
            raw = storage.read_bytes(path)
        except FileNotFoundError:
            return None
        if len(raw) != storage.stat(path).st_size:  # a torn read would forget what the journal says
            raise OSError(errno.EIO, f"{path} was not read whole")
        return raw

    for wait in (*waits, None):
        try:
            raw = looks.again(look, lambda answer: answer is None, None if expected else ())
            break
        except OSError:
            if wait is None:
                raise
            clock.sleep(wait)
    events = parse_events(raw or b"")
    if local_copy is not None:
        try:
            seen = {json.dumps(e, sort_keys=True) for e in events}
            events += [e for e in parse_events(storage.read_bytes(local_copy)) if json.dumps(e, sort_keys=True) not in seen]
        except OSError:
            pass  # the local copy only adds what Drive has not got yet
    events.sort(key=lambda e: e.get("time", 0.0) if isinstance(e.get("time"), (int, float)) else 0.0)
    told = history(events)
    told.found = raw is not None
    return told
