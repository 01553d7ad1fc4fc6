"""The micro-batch that worked, remembered on Drive (`<drive_dir>/micro_batch.json`) for the next session.

Keyed by GPU name, model fingerprint and sequence length, so that a resumed run on the same GPU
starts with the size that fitted instead of running out of memory again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from ..checkpoints.clock import Late, clock
from ..checkpoints import storage

__all__ = ["MICRO_BATCH_FILE", "MicroBatchMemory"]

MICRO_BATCH_FILE = "micro_batch.json"


class MicroBatchMemory:
    """The micro-batch that worked, per (GPU, model fingerprint, sequence length), in a JSON file.

    Args:
        write: how the file is written; `run.train` hands it to the mirror's thread
            (`Mirror.write_later`), so that a back-off never waits for Drive. Default: at once.
        wait_s: how long the file is waited for on Drive when it is read (at the start of `run.train`): a
            stalled mount costs the learned size, never the training's start. What could not be read is
            merged with what is learned when the file is written, never written over.
    """

    def __init__(self, path: str | Path, notices=None, write=None, wait_s: float = 3.0):
        self.path = Path(path)
        self.notices = notices
        self._write = write
        self._read_all = True
        try:
            self.entries = _entries(clock.within(wait_s, lambda: storage.read_bytes(self.path)))
        except FileNotFoundError:
            self.entries = []
        except (Late, OSError, ValueError, AttributeError):
            self.entries, self._read_all = [], False

    def lookup(self, gpu: str, model: str, seq_len: int) -> int | None:
        """The size learned for the tightest recorded length >= `seq_len`; for a longer sequence
        than any recorded, the smallest size known for this GPU and model."""
        mine = [e for e in self.entries if e["gpu"] == gpu and e["model"] == model]
        if not mine:
            return None
        longer = [e for e in mine if e["max_seq_len"] >= seq_len]
        if longer:
            return min(longer, key=lambda e: (e["max_seq_len"], e["micro_batch"]))["micro_batch"]
        return min(e["micro_batch"] for e in mine)

    def record(self, gpu: str, model: str, seq_len: int, micro: int) -> None:
        self.entries = [e for e in self.entries
                        if (e["gpu"], e["model"], e["max_seq_len"]) != (gpu, model, seq_len)]
        self.entries.append({"gpu": gpu, "model": model, "max_seq_len": int(seq_len),
                             "micro_batch": int(micro), "time": time.time()})
        document = {"entries": list(self.entries)}
        if not self._read_all:  # what was there could not be read: merged in when written, never written over
            mine = list(self.entries)
            document = lambda there: _encode(_merged(there, mine))  # noqa: E731
        if self._write is not None:
            self._write(self.path, document)
            return
        try:
            data = document(storage.read_bytes(self.path)) if callable(document) else _encode(document["entries"])
            storage.atomic_write_bytes(self.path, data)
        except OSError as exc:  # kept in memory for this session; Drive trouble is reported elsewhere
            if self.notices is not None:
                self.notices.add(f"could not save the learned micro-batch to {self.path}: {exc}")


def _entries(raw: bytes | None) -> list:
    return list(json.loads(raw).get("entries", [])) if raw else []


def _merged(there: bytes | None, mine: list) -> list:
    try:
        theirs = _entries(there)
    except (ValueError, AttributeError):
        theirs = []
    keys = {(e["gpu"], e["model"], e["max_seq_len"]) for e in mine}
    return [e for e in theirs if (e.get("gpu"), e.get("model"), e.get("max_seq_len")) not in keys] + mine


def _encode(entries: list) -> bytes:
    return (json.dumps({"entries": entries}, indent=1, sort_keys=True) + "\n").encode()
