"""events.jsonl: the journal of what happened while the user was away.

One JSON object per line (start, resume, save, sync, oom, warn, finish, ...), appended and
fsynced. Writing it must never stop training, nor wait for Drive: `write` appends the line to a
local copy (the VM's disk) and queues it; the mirror's thread appends the queue to the persistent
folder, in order (`flush`), and a line that fails to go waits for the next flush. A crash loses at
most the lines not yet flushed, which the local copy still holds.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from .clock import Late, clock
from . import looks, storage

__all__ = ["EVENTS", "Journal", "SilentJournal", "read_events", "History", "history", "read_history"]

EVENTS = "events.jsonl"
_INLINE_WAIT_S = 10.0
_GONE_S = 60.0  # a journal missing at every look for this long was deleted: a new one starts
_GUARD_FRESH_S = 1.0  # how long the guard's answer (the lease is this runtime's) is trusted while lines go
log = logging.getLogger(__name__)


class Journal:
    """Appends events to `<drive_dir>/events.jsonl`; thread-safe.

    Args:
        path: the journal file in the persistent folder.
        local_copy: optional second file on local disk that always receives every line
            (useful when Drive is down, and for `python -m colab_kit status` on the VM).
        guard: asked before lines go to the persistent folder (the run's `Lease.check`): True lets them go;
            None (unknown) makes them wait; False (the folder is another runtime's) keeps them local for good.
    """

    def __init__(self, path: str | Path, local_copy: str | Path | None = None, guard=None):
        self.path = Path(path)
        self.local_copy = Path(local_copy) if local_copy else None
        self.guard = guard
        self.on_pending = None  # wakes the flusher thread after a line is queued (None: `write` flushes)
        self._pending: list[str] = []
        self._tail_suspect = True  # the first flush mends a line torn by a killed process
        self.stopped: str | None = None  # why nothing more goes to the persistent folder (the lease was lost)
        self.known_to_exist = False  # the journal file was seen there (missing at one look is then doubt)
        self._missing_since: float | None = None
        self._lock = threading.Lock()  # the queue: held for microseconds, never across I/O
        self._flushing = threading.Lock()  # one flusher at a time, so lines stay in order
        if self.local_copy is not None:
            try:
                self._mend_torn_tail(self.local_copy)
            except OSError as exc:
                log.debug("local journal copy %s: %s", self.local_copy, exc)

    @staticmethod
    def _mend_torn_tail(path: Path) -> None:
        # A kill in the middle of an append leaves a line without its newline; the next event
        # must start on a line of its own or it would be glued to the torn one.
        try:
            last = storage.read_tail(path, 1)
        except FileNotFoundError:
            return
        if last and last != b"\n":
            storage.append_line(path, "")

    @property
    def pending(self) -> int:
        """Lines not yet on the persistent folder."""
        with self._lock:
            return len(self._pending)

    def stop_persistent(self, reason: str) -> None:
        """From now on lines go to the local copy only (the run folder is another runtime's now)."""
        with self._lock:
            self.stopped = reason
            self._pending.clear()

    def write(self, event: str, **fields) -> dict:
        """Record one event; returns the record. Touches only the local disk, never raises for I/O."""
        record = {"event": event, "time": round(clock.time(), 3), **fields}
        line = json.dumps(record, default=str, sort_keys=False)
        if self.local_copy:
            try:
                storage.append_line(self.local_copy, line)
            except OSError as exc:
                log.debug("local journal copy failed: %s", exc)
        with self._lock:
            if self.stopped is not None:
                return record
            self._pending.append(line)
        if self.on_pending is not None:
            self.on_pending()
        else:  # no flusher thread (before the mirror starts, after it stopped): flushed now, waited for
            try:  # a bounded time on a stuck Drive (the lines wait for the next flush then)
                clock.within(_INLINE_WAIT_S, lambda: self.flush(timeout=0), name="colab_kit-journal")
            except Late:
                log.debug("journal flush to %s is slow; %d line(s) wait", self.path, self.pending)
        return record

    def flush(self, timeout: float | None = None, held: bool | None = None) -> bool:
        """Append the waiting lines to the persistent folder, in order; True when none are left.

        Called by the mirror's thread (and by `finish`); `timeout` bounds the wait for another flush
        under way (False when it does not end in time). `held=True`: the caller has just asked the guard."""
        if not self._flushing.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        try:
            if self.pending and not self._there():
                return False
            asked = clock.monotonic() if held is True else None  # the caller has just asked the guard
            while True:
                with self._lock:
                    if not self._pending:
                        return True
                    line = self._pending[0]
                # Asked again before a line once a second has passed: a slow look or append may outlast the answer.
                if self.guard is not None and (asked is None or clock.monotonic() - asked > _GUARD_FRESH_S):
                    held, asked = self._ask_guard()
                    if held is False:
                        self.stop_persistent("the run folder is another runtime's now")
                    if held is not True:
                        return False
                try:
                    if self._tail_suspect:  # a failed append may have written half a line
                        self._mend_torn_tail(self.path)
                    storage.append_line(self.path, line)
                    self._tail_suspect = False
                    self.known_to_exist = True
                except OSError as exc:
                    self._tail_suspect = True
                    log.debug("journal append to %s failed (%s); %d line(s) wait", self.path, exc, self.pending)
                    return False
                with self._lock:
                    self._pending.pop(0)
        finally:
            self._flushing.release()


    def _ask_guard(self) -> tuple[bool | None, float]:
        """(the guard's answer, when it was asked): an answer that took longer than `_GUARD_FRESH_S` to come
        (a stalled read) may be stale already, so it is asked once more; on a mount where every read is that
        slow, the second answer is as fresh as one can be."""
        asked = clock.monotonic()
        held = self.guard()
        if held is True and clock.monotonic() - asked > _GUARD_FRESH_S:
            asked = clock.monotonic()
            held = self.guard()
        return held, asked

    def _there(self) -> bool:
        """May lines be appended now? A journal that was there and is missing at this look is doubt: an append
        would start a new file over it (Drive hides files for a moment). After `_GONE_S` of looks it is
        taken as gone (deleted by hand) and a new one is started."""
        try:
            there = storage.exists(self.path)
        except OSError:
            return False
        if there or not self.known_to_exist:
            self._missing_since = None
            return True
        now = clock.monotonic()
        self._missing_since = self._missing_since or now
        if now - self._missing_since < _GONE_S:
            return False
        log.warning("colab_kit: %s was not there for %.0f s; a new journal starts",
                    self.path, now - self._missing_since)
        self.known_to_exist, self._missing_since = False, None
        return True


class SilentJournal(Journal):
    """The journal of a follower rank: rank 0 writes the run's only journal, so this one keeps nothing."""

    def __init__(self):
        super().__init__(Path(os.devnull))

    def write(self, event: str, **fields) -> dict:
        return {"event": event, "time": round(clock.time(), 3), **fields}

    def flush(self, timeout: float | None = None) -> bool:
        return True


def read_events(path: str | Path) -> list[dict]:
    """All events of a journal, oldest first; a torn or foreign line is skipped; [] when there is none."""
    try:
        return _parse(storage.read_bytes(path))
    except FileNotFoundError:
        return []


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
    events = _parse(raw or b"")
    if local_copy is not None:
        try:
            seen = {json.dumps(e, sort_keys=True) for e in events}
            events += [e for e in _parse(storage.read_bytes(local_copy)) if json.dumps(e, sort_keys=True) not in seen]
        except OSError:
            pass  # the local copy only adds what Drive has not got yet
    events.sort(key=lambda e: e.get("time", 0.0) if isinstance(e.get("time"), (int, float)) else 0.0)
    told = history(events)
    told.found = raw is not None
    return told


def _parse(raw: bytes) -> list[dict]:
    events = []
    for line in raw.decode("utf-8", errors="replace").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict) and "event" in obj:
            events.append(obj)
    return events
