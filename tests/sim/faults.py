"""The faults of a schedule, on the Drive mount's operations, drawn from the schedule's own seeded RNG.

As users report them of Colab's mount (`shared/research/drive-reality.md`) and as the DriveFS
emulator injects them (`tests/scripts/drivefs_emulator.py`): reads that fail with EIO, files and
folders that a read or a listing does not find for a moment (ENOENT windows, shorter than the kit's
looks: a file hidden for longer than anyone looks cannot be told from a lost one), listings short an
entry, torn reads, operations that stall, writes that fail, and errno 107 for a while.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

__all__ = ["FaultRates", "Faults"]


@dataclass
class FaultRates:
    """Per-operation probabilities (and the length of a stall)."""

    eio: float = 0.0  # a read, stat, listing or attribute read fails with EIO
    short: float = 0.0  # a listing leaves one entry out
    torn: float = 0.0  # a read returns part of the file
    stall: float = 0.0  # an operation takes `stall_s` seconds
    stall_s: float = 3.0
    write_eio: float = 0.0  # a write fails with EIO


class Faults:
    """The injector: rates, plus windows the world opens (`hide`, `disconnect`)."""

    READS = {"read", "stat", "list", "xattr"}

    def __init__(self, rates: FaultRates, rng, clock, log=None):
        self.rates, self.rng, self.clock, self.log = rates, rng, clock, log
        self._hidden: dict[str, float] = {}  # path -> hidden until (monotonic)
        self.enotconn_until = -1.0
        self.counts: dict[str, int] = {}

    def _note(self, kind: str, path: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if self.log is not None:
            self.log(f"fault {kind} {path}")

    def hide(self, path: str, seconds: float) -> None:
        self._hidden[path] = self.clock.monotonic() + seconds

    def disconnect(self, seconds: float) -> None:
        self.enotconn_until = max(self.enotconn_until, self.clock.monotonic() + seconds)

    def hidden(self, path: str, fs=None) -> bool:
        if not self._hidden:
            return False
        now = self.clock.monotonic()
        probe = path
        while len(probe) > 10:
            until = self._hidden.get(probe)
            if until is not None:
                if until > now:
                    return True
                del self._hidden[probe]
            probe = probe.rsplit("/", 1)[0]
        return False

    def before(self, op: str, path: str, fs, write: bool = False) -> None:
        """Raise the fault this operation meets, if any (and let a stall take its time)."""
        now = self.clock.monotonic()
        if now < self.enotconn_until:
            self._note("enotconn", path)
            raise OSError(errno.ENOTCONN, os.strerror(errno.ENOTCONN), path)
        rates, rng = self.rates, self.rng
        if rates.stall and rng.random() < rates.stall:
            self._note("stall", path)
            self.clock.advance(rates.stall_s)
        if write:
            if rates.write_eio and rng.random() < rates.write_eio:
                self._note("write_eio", path)
                raise OSError(errno.EIO, os.strerror(errno.EIO), path)
            return
        if rates.eio and rng.random() < rates.eio:
            self._note("eio", path)
            raise OSError(errno.EIO, os.strerror(errno.EIO), path)
        if op != "list" and self.hidden(path):
            self._note("hidden", path)
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path)

    def listing(self, folder: str, names: list[str], fs) -> list[str]:
        shown = [n for n in names if not self.hidden(f"{folder}/{n}")]
        if shown and self.rates.short and self.rng.random() < self.rates.short:
            gone = self.rng.choice(shown)
            self._note("short", f"{folder}/{gone}")
            shown = [n for n in shown if n != gone]
        return shown

    def torn(self, op: str, data: bytes) -> bytes:
        if len(data) > 1 and self.rates.torn and self.rng.random() < self.rates.torn:
            self._note("torn", op)
            return data[: self.rng.randrange(1, len(data))]
        return data
