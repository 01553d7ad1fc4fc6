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
import time
from pathlib import Path

from . import storage

__all__ = ["EVENTS", "Journal", "SilentJournal", "read_events"]

EVENTS = "events.jsonl"
_INLINE_WAIT_S = 10.0
log = logging.getLogger(__name__)


class Journal:
    """Appends events to `<drive_dir>/events.jsonl`; thread-safe.

    Args:
        path: the journal file in the persistent folder.
        local_copy: optional second file on local disk that always receives every line
            (useful when Drive is down, and for `python -m colab_kit status` on the VM).
    """

    def __init__(self, path: str | Path, local_copy: str | Path | None = None):
        self.path = Path(path)
        self.local_copy = Path(local_copy) if local_copy else None
        self.on_pending = None  # wakes the flusher thread after a line is queued (None: `write` flushes)
        self._pending: list[str] = []
        self._tail_suspect = True  # the first flush mends a line torn by a killed process
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
            with open(path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                if fh.tell() == 0:
                    return
                fh.seek(-1, os.SEEK_END)
                torn = fh.read(1) != b"\n"
        except FileNotFoundError:
            return
        if torn:
            storage.append_line(path, "")

    @property
    def pending(self) -> int:
        """Lines not yet on the persistent folder."""
        with self._lock:
            return len(self._pending)

    def write(self, event: str, **fields) -> dict:
        """Record one event; returns the record. Touches only the local disk, never raises for I/O."""
        record = {"event": event, "time": round(time.time(), 3), **fields}
        line = json.dumps(record, default=str, sort_keys=False)
        if self.local_copy:
            try:
                storage.append_line(self.local_copy, line)
            except OSError as exc:
                log.debug("local journal copy failed: %s", exc)
        with self._lock:
            self._pending.append(line)
        if self.on_pending is not None:
            self.on_pending()
        else:  # no flusher thread (before the mirror starts, after it stopped): the writer flushes,
            self.flush(timeout=_INLINE_WAIT_S)  # waiting a bounded time for a flush stuck on Drive
        return record

    def flush(self, timeout: float | None = None) -> bool:
        """Append the waiting lines to the persistent folder, in order; True when none are left.

        Called by the mirror's thread (and by `finish`); `timeout` bounds the wait for another flush
        under way (False when it does not end in time)."""
        if not self._flushing.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return False
        try:
            while True:
                with self._lock:
                    if not self._pending:
                        return True
                    line = self._pending[0]
                try:
                    if self._tail_suspect:  # a failed append may have written half a line
                        self._mend_torn_tail(self.path)
                    storage.append_line(self.path, line)
                    self._tail_suspect = False
                except OSError as exc:
                    self._tail_suspect = True
                    log.debug("journal append to %s failed (%s); %d line(s) wait", self.path, exc, self.pending)
                    return False
                with self._lock:
                    self._pending.pop(0)
        finally:
            self._flushing.release()


class SilentJournal(Journal):
    """The journal of a follower rank: rank 0 writes the run's only journal, so this one keeps nothing."""

    def __init__(self):
        super().__init__(Path(os.devnull))

    def write(self, event: str, **fields) -> dict:
        return {"event": event, "time": round(time.time(), 3), **fields}

    def flush(self, timeout: float | None = None) -> bool:
        return True


def read_events(path: str | Path) -> list[dict]:
    """All events of a journal, oldest first; a torn or foreign line is skipped."""
    events = []
    try:
        lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
    except FileNotFoundError:
        return []
    for line in lines:
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
