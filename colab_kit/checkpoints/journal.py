"""events.jsonl: the journal of what happened while the user was away.

One JSON object per line (start, resume, save, sync, oom, warn, finish, ...), appended and
fsynced. Writing it must never stop training, nor wait for Drive: `write` appends the line to a
local copy (the VM's disk) and queues it; the mirror's thread appends the queue to the persistent
folder, in order (`flush`), and a line that fails to go waits for the next flush. A crash loses at
most the lines not yet flushed, which the local copy still holds.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

from .clock import Late, clock
from . import storage

__all__ = ["EVENTS", "Journal", "SilentJournal", "read_events", "parse_events", "merge_journals"]

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
        self._caught_up = local_copy is None  # the first flush sends what an earlier process left unsent
        self._earlier: list[str] = []  # the local copy's lines before this process wrote any (what it may send)
        self.stopped: str | None = None  # why nothing more goes to the persistent folder (the lease was lost)
        self.known_to_exist = False  # the journal file was seen there (missing at one look is then doubt)
        self._missing_since: float | None = None
        self._lock = threading.Lock()  # the queue: held for microseconds, never across I/O
        # One writer at a time appends to the local copy and queues: two threads (the training loop, the mirror)
        # that did each step apart put their lines in one order on the VM and another in the persistent folder.
        self._ordering = threading.Lock()  # held across a local-disk append only, never Drive's I/O
        self._flushing = threading.Lock()  # one flusher at a time, so lines stay in order
        if self.local_copy is not None:
            try:
                self._mend_torn_tail(self.local_copy)
                # Read now, before this process appends: a line of its own read later, between its append to the
                # local copy and its queueing, would be sent twice (once caught up, once queued).
                self._earlier = _lines(storage.read_bytes(self.local_copy))
            except FileNotFoundError:
                pass
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
        with self._ordering:  # the local copy and the queue in one order (catching up relies on it)
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
            if not self._caught_up and not self._catch_up():
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

    def _catch_up(self) -> bool:
        """Queue, before this process's own lines, the lines an earlier process of this VM wrote to the local
        copy and never got to the persistent folder (a kernel restart, a kill): where the persistent journal's
        last line is one of the local copy's (this VM wrote last), the local lines after it. A journal whose
        last line the local copy lacks (another runtime wrote since, or the folder was made anew) gets none:
        it is not this VM's to continue, and lines out of their place would be stories of another folder.
        False when the persistent copy cannot be read now (unknown: asked again at the next flush)."""
        try:
            theirs = _lines(storage.read_bytes(self.path))
        except FileNotFoundError:
            theirs = []
        except OSError as exc:
            log.debug("journal %s unreadable before catching up: %s", self.path, exc)
            return False
        ours = self._earlier
        last = max((i for i, line in enumerate(ours) if line == theirs[-1]), default=None) if theirs else None
        with self._lock:
            unsent = ours[last + 1:] if last is not None else []
            if self.stopped is None:
                self._pending[:0] = unsent
        self._earlier = []
        self._caught_up = True
        if unsent:
            log.debug("journal %s: %d line(s) of an earlier process sent now", self.path, len(unsent))
        return True

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
        return parse_events(storage.read_bytes(path))
    except FileNotFoundError:
        return []


def merge_journals(theirs: bytes, ours: bytes) -> bytes:
    """One journal from two copies of it, never fewer lines than either: `theirs` (the store's copy, which
    other runtimes may have appended to) in its order, then each line of `ours` (this VM's, which may hold
    lines not yet uploaded) that it lacks, in their order. The journal is append-only, so no copy replaces
    another; a line torn by a killed process is left out (the readers skip it anyway), and every reader
    orders events by their time (`read_history`)."""
    merged = list(dict.fromkeys(_lines(theirs) + _lines(ours)))  # in order, each line once
    return "".join(f"{line}\n" for line in merged).encode()


def _lines(raw: bytes) -> list[str]:
    """The whole event lines of a journal, as written (a torn or foreign line left out)."""
    lines = (line.strip() for line in raw.decode("utf-8", errors="replace").splitlines())
    return [line for line in lines if line and parse_events(line.encode())]


def parse_events(raw: bytes) -> list[dict]:
    """The events of a journal's bytes (from a folder or the Hub): torn and foreign lines left out."""
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
