"""events.jsonl: the journal of what happened while the user was away.

One JSON object per line (start, resume, save, sync, oom, warn, finish, ...), appended and
fsynced. Writing it must never stop training: when the persistent folder fails, lines wait
in memory (and in a local copy) and are appended, in order, once it works again.
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
        self._pending: list[str] = []
        self._tail_suspect = False
        self._lock = threading.Lock()
        for path in filter(None, (self.path, self.local_copy)):
            try:
                self._mend_torn_tail(path)
            except OSError:
                self._tail_suspect = True  # try again before the first append

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
        return len(self._pending)

    def write(self, event: str, **fields) -> dict:
        """Record one event; returns the record. Never raises for I/O trouble."""
        record = {"event": event, "time": round(time.time(), 3), **fields}
        line = json.dumps(record, default=str, sort_keys=False)
        with self._lock:
            if self.local_copy:
                try:
                    storage.append_line(self.local_copy, line)
                except OSError as exc:
                    log.debug("local journal copy failed: %s", exc)
            self._pending.append(line)
            self._flush_locked()
        return record

    def flush(self) -> bool:
        """Try to append waiting lines; True when none are left."""
        with self._lock:
            return self._flush_locked()

    def _flush_locked(self) -> bool:
        while self._pending:
            try:
                if self._tail_suspect:  # a failed append may have written half a line
                    self._mend_torn_tail(self.path)
                storage.append_line(self.path, self._pending[0])
                self._tail_suspect = False
            except OSError as exc:
                self._tail_suspect = True
                log.debug("journal append to %s failed (%s); %d line(s) wait", self.path, exc,
                          len(self._pending))
                return False
            self._pending.pop(0)
        return True


class SilentJournal(Journal):
    """The journal of a follower rank: rank 0 writes the run's only journal, so this one keeps nothing."""

    def __init__(self):
        super().__init__(Path(os.devnull))

    def write(self, event: str, **fields) -> dict:
        return {"event": event, "time": round(time.time(), 3), **fields}

    def flush(self) -> bool:
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
