"""What a lease file says: `lease.json` in a run folder (who writes the run, and its heartbeat), read back
and judged. Holding one is `lease.py`'s business.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .._units import format_age
from . import storage
from .clock import clock

__all__ = ["LEASE", "STALE_AFTER_BEATS", "LeaseInfo", "read_lease", "parse_lease", "lease_staleness", "process_start"]

LEASE = "lease.json"
STALE_AFTER_BEATS = 4


def process_start(pid: int) -> float | None:
    """When process `pid` on this host started, or None when it has ended.

    A killed process whose parent died too stays a zombie until something reaps it, and in a
    container without a reaping init that can be forever: a zombie holds nothing, so it
    counts as ended.
    """
    try:
        import psutil

        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return None
        return process.create_time()
    except Exception:
        return None


@dataclass
class LeaseInfo:
    host: str
    pid: int
    pid_start: float | None
    session: str
    started: float
    heartbeat: float
    heartbeat_s: float
    released: bool = False
    step: int | None = None  # the training step at this heartbeat (the status page says the same: `report/`)


def read_lease(path: str | Path) -> LeaseInfo | None:
    """The lease in `path` (a run folder or the lease file), or None when there is no lease file.

    Raises:
        OSError: the file could not be read. ValueError: it holds no lease (torn or foreign).
    """
    path = path if isinstance(path, Path) else Path(path)
    if path.name != LEASE:
        path = path / LEASE
    try:
        raw = storage.read_bytes(path)
    except FileNotFoundError:
        return None
    try:
        return parse_lease(raw)
    except ValueError as exc:
        raise ValueError(f"{path} holds no lease ({exc})") from None


def parse_lease(raw: bytes) -> LeaseInfo:
    """The lease that `raw` (a lease.json's bytes, from a folder or the Hub) says. Raises ValueError: none."""
    try:
        obj = json.loads(raw)
        return LeaseInfo(**{k: obj[k] for k in LeaseInfo.__dataclass_fields__ if k in obj})
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(str(exc) or type(exc).__name__) from None


def lease_staleness(info: LeaseInfo, now: float | None = None, *, host: str | None = None,
                    process_start: Callable[[int], float | None] = process_start) -> str | None:
    """Why `info` no longer protects its run (a reason), or None while it may be live. `host` is this
    machine's name (whose processes can be asked after); `process_start` asks when a pid started.

    Only this host's leases are judged here: their heartbeat was written by this clock. Another host's
    heartbeat time was written by another clock (minutes off, or set back), and a lease.json can reach Drive
    late, so its age proves nothing: whether that runtime lives shows only by watching its heartbeat change
    (`Lease.acquire`)."""
    now = clock.time() if now is None else now
    if info.released:
        return "it was released when its run finished"
    if info.host != (host or socket.gethostname()):
        return None
    start = process_start(info.pid)
    if start is None:
        return f"its process {info.pid} on this host has ended"
    if info.pid_start is not None and abs(start - info.pid_start) > 1.0:
        return f"process {info.pid} on this host is a different process now"
    age = now - info.heartbeat
    if age > STALE_AFTER_BEATS * info.heartbeat_s:
        return f"its last heartbeat was {format_age(age)} ago"
    return None
