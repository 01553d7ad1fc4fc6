"""One writer per run: a lease file in the run folder with host, pid and a heartbeat.

Two runtimes writing the same run folder (two browser tabs, or a reconnect while the old
runtime is still alive) would interleave checkpoints and prune each other's files. The
lease makes the second one stop with a clear message. A lease is *stale*, and taken over at
once, when its process is gone on this host or its heartbeat is older than a few intervals.

After a disconnect Colab gives the user a *new* VM (another host name) within a minute or two,
while the dead VM's lease still looks fresh. A lease of another host is therefore watched for 1.5
of its heartbeat intervals: a heartbeat that does not change belongs to a dead runtime and is
taken over; one that changes is refused. The time it holds is never compared with this VM's clock:
it was written by another clock (minutes off, or set back), and lease.json can reach Drive late.

A read of the lease that fails (EIO, errno 107, a file that cannot be parsed) is unknown: it is
never taken for "released" or "no lease", and neither is a lease file missing at one look (absence
is not evidence: `checkpoints/looks.py`). A lease of another host is taken over only after it was
read successfully twice with a heartbeat that did not advance between the two reads; the writer
checks that the lease is still its own (`check`) before every upload, publish and delete, and the
heartbeat rewrites lease.json only while `check` says True (`gate.act`): a runtime that could not
read its lease never writes its old claim over a new owner's.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from pathlib import Path
from typing import Callable

from ..checkpoints.clock import clock
from .._units import format_age
from ..checkpoints import looks, storage
from ..errors import LeaseHeldError
from .gate import act
from ..checkpoints.leasefile import LEASE, STALE_AFTER_BEATS, LeaseInfo, lease_staleness, process_start, read_lease

__all__ = ["LEASE", "LeaseInfo", "Lease", "read_lease", "lease_staleness"]  # the first, last two: leasefile.py

WATCH_BEATS = 1.5  # how long a live lease of another host is watched before it counts as dead
log = logging.getLogger(__name__)


class Lease:
    """This process's claim on a run folder.

    Args:
        run_dir: the run's persistent folder.
        heartbeat_s: how often the heartbeat is renewed; readers call the lease stale after
            `STALE_AFTER_BEATS` missed beats.
        host, pid, process_start, session: who this is (default: this machine and process); the
            simulator gives each of its runtimes its own.
    """

    def __init__(self, run_dir: str | Path, heartbeat_s: float = 30.0, *, host: str | None = None,
                 pid: int | None = None, process_start: Callable[[int], float | None] = process_start,
                 session: str | None = None):
        self.path = Path(run_dir) / LEASE
        self.heartbeat_s = float(heartbeat_s)
        self._process_start = process_start
        pid = os.getpid() if pid is None else pid
        self.info = LeaseInfo(host=host or socket.gethostname(), pid=pid, pid_start=process_start(pid),
                              session=session or uuid.uuid4().hex, started=clock.time(), heartbeat=clock.time(),
                              heartbeat_s=self.heartbeat_s)
        self.lost = False
        self.took_over_because: str | None = None
        self.acquired_at: float | None = None  # clock.monotonic() when acquired
        self.quiet_s = 0.0  # after a takeover: how long the runtime it replaced may not have seen it yet
        self.watched_s = 0.0  # how long the last acquire watched another host's lease
        self.watching: LeaseInfo | None = None  # the other host's lease while acquire watches it
        self._stop = threading.Event()
        self._wake = threading.Event()  # a beat now (a checkpoint reached the cloud), not at the next interval
        self._thread: threading.Thread | None = None
        self.progress: Callable[[], int | None] | None = None  # the training step each beat carries
        self.after_beat: Callable[[], None] | None = None  # the status page, written after each beat (`report/`)

    def acquire(self, takeover: bool = False, run_name: str = "NAME",
                on_watch: Callable[[LeaseInfo, float], None] | None = None) -> LeaseInfo | None:
        """Claim the folder; returns the lease that was replaced, if any.

        A lease of another host is watched first (see the module's docstring); `on_watch` is called
        about once a second with that lease and the seconds left, for a countdown.
        `self.took_over_because` then says why it was taken over.

        Raises:
            LeaseHeldError: a live lease from another process, or one that cannot be read (its owner
                may be alive), unless `takeover`.
        """
        self.took_over_because = None
        self.watched_s = 0.0
        if takeover:  # asked for: whose lease it was is said if it can be read, and taken either way
            try:
                previous = read_lease(self.path)
            except (OSError, ValueError):
                previous = None
        else:
            previous = self._read_patiently(run_name)
            if previous is None and self._run_folder_used():  # absence is not evidence: look again
                previous = looks.again(lambda: self._read_patiently(run_name), lambda found: found is None)
        if previous is not None and previous.session != self.info.session:
            same_process = previous.host == self.info.host and previous.pid == self.info.pid
            stale = lease_staleness(previous, host=self.info.host, process_start=self._process_start)
            if not same_process and not previous.released and not takeover:
                if previous.host == self.info.host:  # this host can ask whether the process lives
                    if stale is None:
                        raise self._held(previous, run_name)
                    self.took_over_because = stale
                else:  # another VM: only a heartbeat seen to change (or not) says whether it lives
                    watch_started, self.watching = clock.monotonic(), previous
                    try:
                        alive = not self._dead_while_watched(previous, on_watch, run_name)
                        self.watching = None
                    finally:
                        self.watched_s = clock.monotonic() - watch_started
                    if alive:
                        raise self._held(previous, run_name)
        why = "asked for (takeover=True)" if takeover else (self.took_over_because or "nobody else holds it")
        act("take the lease", LEASE, [lambda: None], self._write_patiently)  # the proof: `why`, reached above
        log.debug("lease of %s taken: %s", self.path.parent, why)
        # Drive has no exclusive create: read back so that of two simultaneous starters at
        # most one believes it holds the lease.
        try:
            confirmed = self._read_patiently(run_name)
        except BaseException:  # written, but no run holds it: let it go again (where it is still this one's)
            self.release()
            raise
        if confirmed is None or confirmed.session != self.info.session:
            raise LeaseHeldError(f"another runtime claimed {self.path.parent} at the same moment; run "
                                 f"ck.start_run({run_name!r}) again in a minute")
        # A lease released at a clean finish was not taken over from anyone.
        taken = previous is not None and previous.session != self.info.session and not previous.released
        self.acquired_at = clock.monotonic()
        # Drive has no compare-and-swap: the runtime taken over (if it lives) learns of it at its next
        # heartbeat, and a claim of its still on its way to the cloud may land after this one.
        self.quiet_s = WATCH_BEATS * previous.heartbeat_s if taken else 0.0
        return previous if taken else None

    def quiet_left(self) -> float:
        """Seconds until the runtime this one took the run over from has had a heartbeat to see that (0 when
        nothing was taken over). Nothing is deleted before (`gate.py`): its last claim may still land."""
        if self.acquired_at is None:
            return 0.0
        return max(0.0, self.quiet_s - (clock.monotonic() - self.acquired_at))

    def _run_folder_used(self) -> bool:
        """Does the run folder hold anything besides the lease (so that a lease would be expected)?
        A folder that cannot be listed counts as used."""
        try:
            entries = storage.list_dir(self.path.parent)
        except FileNotFoundError:
            return False
        except OSError:
            return True
        for entry in entries:
            if entry.name == LEASE:
                continue
            if not entry.is_dir():
                return True
            try:
                if storage.list_dir(entry.path):
                    return True
            except OSError:
                return True
        return False

    def _write_patiently(self, waits=(0.5, 1.0, 2.0)) -> None:
        """Write the lease, again after a failure that may pass (not a full or read-only folder)."""
        storage.patiently(self._write, waits)

    def _read_patiently(self, run_name: str, waits=(0.5, 1.0, 2.0)) -> LeaseInfo | None:
        """The lease, read again after a failed read (a failed read is never "no lease").

        Raises:
            LeaseHeldError: it could not be read at all.
        """
        for wait in (0.0, *waits):
            clock.sleep(wait)
            try:
                return read_lease(self.path)
            except (OSError, ValueError) as exc:
                problem = getattr(exc, "strerror", None) or str(exc)
        raise LeaseHeldError(f"cannot read the lease of {self.path.parent} ({problem}), so whether another runtime "
                             f"writes this run is unknown: nothing was taken over. Run this cell again in a minute; "
                             f"if no other runtime can be using it: ck.start_run({run_name!r}, takeover=True)")

    @staticmethod
    def watch_s(previous: LeaseInfo) -> float:
        """How long another host's lease `previous` is watched before it counts as dead."""
        return WATCH_BEATS * previous.heartbeat_s

    def _dead_while_watched(self, previous: LeaseInfo, on_watch, run_name: str) -> bool:
        """Watch `previous` (another host's) for `WATCH_BEATS` of its heartbeats: True when a successful read
        after the watch shows the same heartbeat (taken over), False when a read shows it change (alive).
        Reads that fail count for nothing; a lease that stays unreadable is refused."""
        window = WATCH_BEATS * previous.heartbeat_s
        deadline = clock.monotonic() + window
        give_up = deadline + max(30.0, 2 * window)
        while True:
            left = deadline - clock.monotonic()
            if on_watch is not None and left > 0:
                on_watch(previous, left)
            # A tenth of its heartbeat between reads (0.2 to 5 s): a beat is seen within that.
            clock.sleep(min(max(left, 0.2), max(0.2, min(5.0, previous.heartbeat_s / 10))))
            try:
                current = read_lease(self.path)
            except (OSError, ValueError):
                current = False  # unknown: neither alive nor dead
            if current is not False and current is not None:
                if current.session == previous.session and current.released:
                    self.took_over_because = "it was released while this runtime watched it"
                    return True
                if current.session != previous.session or current.heartbeat != previous.heartbeat:
                    return False  # alive (or a third runtime claimed it)
                if clock.monotonic() >= deadline:
                    self.took_over_because = f"its heartbeat did not advance in {format_age(window)}"
                    return True
            elif clock.monotonic() >= give_up:
                raise LeaseHeldError(f"the lease of {self.path.parent} (host {previous.host}) could not be read "
                                     f"again to see whether its heartbeat advances, so it was not taken over. Run "
                                     f"this cell again; if that runtime is gone: ck.start_run({run_name!r}, "
                                     f"takeover=True)")

    def _held(self, previous: LeaseInfo, run_name: str) -> LeaseHeldError:
        if previous.host == self.info.host:  # one clock: the heartbeat's age means something
            age = clock.time() - previous.heartbeat
            wait = format_age(STALE_AFTER_BEATS * previous.heartbeat_s - age)
            seen = f", last heartbeat {format_age(age)} ago"
            how = f"Stop the other runtime, or wait {wait} for its lease to go stale"
        else:  # another VM's clock: what counts is that its heartbeat moved, not the time it wrote
            seen = ""
            how = ("Its heartbeat advanced while this runtime watched it, so it is alive. Stop it "
                   "(in its tab: Runtime -> Disconnect and delete runtime)")
        return LeaseHeldError(
            f"run folder {self.path.parent} is in use by another runtime (host {previous.host}, "
            f"pid {previous.pid}{seen}). Two writers would overwrite each other's checkpoints. {how}, or take "
            f"over now: run the start_run cell again with takeover=True (ck.start_run({run_name!r}, ..., "
            f"takeover=True))")

    def _write(self) -> None:
        self.info.heartbeat = clock.time()
        if self.progress is not None:
            self.info.step = self.progress()
        # One line: rewritten at every heartbeat. A flat dataclass: asdict's deep copy is not needed.
        storage.atomic_write_json(self.path, dict(vars(self.info)), indent=None)

    def beat(self) -> bool | None:
        """Renew the heartbeat, only while the lease is this runtime's: True (renewed), False (another
        runtime's: `lost`), None (it could not be confirmed now: not renewed, never written over an
        unread lease; the next beat tries again).

        Raises:
            OSError: the lease was confirmed but could not be written (the next beat tries again).
        """
        if self.lost:
            return False
        held = {}

        def ours_now() -> str | None:
            held["now"] = self.check()
            return None if held["now"] is True else "the lease is not confirmed as this runtime's now"

        act("renew the lease", LEASE, [ours_now], self._write)
        return held["now"]

    def check(self) -> bool | None:
        """Is the lease still this runtime's? True, False (another runtime's: `lost`), or None when it
        cannot be read now (unknown: do not write, delete or claim; ask again later)."""
        if self.lost:
            return False
        try:
            current = read_lease(self.path)
        except (OSError, ValueError):
            return None
        if current is None:
            return None  # the file is not there now: a listing that hides it, or a deletion
        if current.session != self.info.session:
            self.lost = True
            return False
        return True

    def step(self, on_lost: Callable[[LeaseInfo | None], None],
             on_error: Callable[[OSError], None] | None = None) -> bool:
        """One heartbeat (its thread calls this every `heartbeat_s`; so does the simulator). Returns False
        once the lease is lost (`on_lost` was called with whoever holds it now), True otherwise."""
        try:
            beat = self.beat()
        except OSError as exc:  # Drive trouble: keep trying (unknown is not lost); the mirror reports it
            log.debug("lease heartbeat failed: %s", exc)
            return on_error(exc) or True if on_error else True
        if beat is False:
            try:
                holder = read_lease(self.path)
            except (OSError, ValueError):
                holder = None
            on_lost(holder)
            return False
        if beat:
            self._after_beat()
        return True

    def _after_beat(self) -> None:
        if self.after_beat is not None:
            try:
                self.after_beat()
            except Exception as exc:  # noqa: BLE001 - the status page never costs the lease
                log.debug("the status page was not written: %s", exc)

    def beat_now(self) -> None:
        """Beat at once rather than at the next interval (the heartbeat's thread does it)."""
        self._wake.set()

    def start_heartbeat(self, on_lost: Callable[[LeaseInfo | None], None],
                        on_error: Callable[[OSError], None] | None = None) -> None:
        """Renew the lease every `heartbeat_s` seconds in a daemon thread."""

        def loop():
            while True:
                self._wake.wait(self.heartbeat_s)
                self._wake.clear()
                if self._stop.is_set() or not self.step(on_lost, on_error):
                    return

        self._thread = threading.Thread(target=loop, name="colab_kit-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and mark the lease released if it is still ours.

        The file stays (marked released) rather than being deleted, so that a runtime this one
        took the folder from still sees, at its next heartbeat, that it no longer owns it.
        """
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.lost:
            return

        def mark_released():
            self.info.released = True
            self._write()
            self._after_beat()  # the run's last page

        try:
            act("release the lease", LEASE, [lambda: None if self.check() is True else "not confirmed as ours now"],
                mark_released)
        except OSError as exc:
            log.warning("could not release the lease %s: %s (it goes stale by itself)", self.path, exc)
