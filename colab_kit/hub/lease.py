"""One writer per run on the Hub: the lease is a file in the run's folder, and every commit is fenced by it.

Drive has no compare-and-swap, so a runtime taken over there learns of it only at its next heartbeat
(`drive/lease.py`). The Hub has one: a commit made with `parent_commit` lands only on that head. So here
every commit of a run (checkpoints, the journal, deletions, heartbeats) is made through `HubLease.commit`,
on the head at which this runtime last saw the lease as its own, and carries the lease with a fresh
heartbeat. When the head has moved, the lease is read at the new head: still this runtime's (another run
of the same repo committed), the commit is made again on it; another runtime's, the lease is lost and
nothing more is written. A runtime taken over can therefore never commit after the takeover, not even a
commit already on its way: the Hub refuses it.

Whether another host's runtime lives shows only by watching its heartbeat change (its clock is not this
one): its lease is watched for 1.5 of its heartbeats, as on Drive. A read that fails is unknown: it never
makes a takeover, a claim or a loss.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import uuid
from dataclasses import asdict
from typing import Callable

from ..checkpoints.clock import clock
from ..checkpoints.leasefile import LEASE, LeaseInfo, lease_staleness, parse_lease, process_start
from ..errors import LeaseHeldError
from .leasewatch import WATCH_BEATS, held_error, watch
from .repo import HeadMoved, HubRepo, HubUnavailable
from .verify import git_blob_id

__all__ = ["HubLease", "LeaseLost", "HUB_HEARTBEAT_S"]

log = logging.getLogger(__name__)
# Every commit renews the lease, and a repo takes about 128 commits an hour (the Hub's answer beyond that:
# "You have exceeded the rate limit for repository commits (128 per hour)"); a heartbeat commit every 2
# minutes when nothing else was committed costs at most 30 of them.
HUB_HEARTBEAT_S = 120.0
_CHECK_S = 10.0  # a check that found the lease this runtime's stands this long
_MOVES = 8  # heads moved by other runs of the repo, in a row, before a commit gives up for now


class LeaseLost(OSError):
    """The run's lease is another runtime's: this one writes nothing more to the run. (An OSError, as the
    Hub's other trouble is, so that the uploader's callers keep what they were doing pending; the uploader's
    next lease check sees the loss and stops for good.)"""

    def __init__(self, holder: LeaseInfo | None):
        super().__init__(f"the run was taken over by host {holder.host if holder else 'unknown'}")
        self.holder = holder


class HubLease:
    """This runtime's claim on a run folder in a Hub repo (see the module docstring).

    Args:
        repo: the `HubRepo`.
        folder: the run's folder in the repo (`address.path(name)`).
        heartbeat_s: the longest time between two commits of this runtime (a heartbeat commit fills the gap).
    """

    def __init__(self, repo: HubRepo, folder: str, heartbeat_s: float = HUB_HEARTBEAT_S, *, host: str | None = None,
                 pid: int | None = None, process_start: Callable[[int], float | None] = process_start):
        self.repo, self.folder, self.heartbeat_s = repo, folder, heartbeat_s
        self.path = f"{folder}/{LEASE}" if folder else LEASE
        pid = os.getpid() if pid is None else pid
        self._process_start = process_start
        self.info = LeaseInfo(host=host or socket.gethostname(), pid=pid, pid_start=process_start(pid),
                              session=uuid.uuid4().hex, started=clock.time(), heartbeat=clock.time(),
                              heartbeat_s=heartbeat_s)
        self.head: str | None = None  # the newest head at which the lease was seen to be this runtime's
        self.lost = False
        self.holder: LeaseInfo | None = None  # who holds it, once lost
        self.took_over_because: str | None = None
        self.watched_s = 0.0
        self.watching: LeaseInfo | None = None
        self.committed_at = clock.monotonic()
        self._checked_at = -float("inf")
        self._lock = threading.Lock()  # one commit at a time: the heartbeat thread and the uploader
        self._committed: bytes | None = None  # the lease's bytes in this runtime's last commit
        self._stop = threading.Event()
        self._wake = threading.Event()  # a beat now (a checkpoint reached the cloud), not at the next interval
        self._force = False
        self._thread: threading.Thread | None = None
        self.progress: Callable[[], int | None] | None = None  # the training step each heartbeat carries
        # The status page's files for a heartbeat commit: (step, time) -> {path in the repo: bytes} (`report/`)
        self.riders: Callable[[int | None, float], dict] | None = None

    # -- claiming ---------------------------------------------------------------------------------------
    def acquire(self, takeover: bool = False, run_name: str = "NAME",
                on_watch: Callable[[LeaseInfo, float], None] | None = None) -> LeaseInfo | None:
        """Claim the run; returns the lease that was replaced, if any (`took_over_because` says why).

        Raises:
            LeaseHeldError: a live lease of another runtime, or one that cannot be read, unless `takeover`.
        """
        self.took_over_because, self.watched_s = None, 0.0
        head, previous = self._read_or_refuse(run_name, takeover)
        if previous is not None and not takeover and not self._free(previous):
            if previous.host == self.info.host:
                raise self._held(previous, run_name)
            started, self.watching = clock.monotonic(), previous
            try:
                head = self._watch(previous, on_watch, run_name)
            finally:
                self.watched_s, self.watching = clock.monotonic() - started, None
        self.head = head
        for _ in range(_MOVES):
            try:
                self._commit_lease(f"colab_kit: {run_name} claimed by {self.info.host}")
                break
            except HeadMoved as moved:  # someone committed since the lease was read: is it still what was judged?
                head = self._head_after(moved, run_name)
                now = self._lease_at(head, run_name)
                if now is not None and now.session == self.info.session:  # this claim landed, its answer lost
                    self.head = head
                    break
                if not takeover and ((now is None) != (previous is None) or now is not None and (
                        now.session, now.heartbeat, now.released) != (previous.session, previous.heartbeat,
                                                                      previous.released)):
                    raise LeaseHeldError(f"another runtime claimed {self.repo.address}/{self.folder} at the same "
                                         f"moment; run ck.start_run({run_name!r}) again in a minute") from None
                self.head = head
        else:
            raise LeaseHeldError(f"the Hub repo {self.repo.address} moved on {_MOVES} times while this runtime "
                                 f"claimed {self.folder}: run the cell again in a minute")
        taken = previous is not None and previous.session != self.info.session and not previous.released
        if taken and self.took_over_because is None:
            self.took_over_because = "asked for (takeover=True)" if takeover else "it was stale"
        return previous if taken else None

    def _head_after(self, moved: HeadMoved, run_name: str) -> str:
        """The head a claim met instead of its parent (read again when the 412's answer did not say)."""
        try:
            return moved.head or self.repo.head()
        except HubUnavailable as exc:
            raise LeaseHeldError(f"the Hub repo {self.repo.address} moved while this runtime claimed {self.folder}, "
                                 f"and its head cannot be read now ({exc}): nothing was taken over. Run this cell "
                                 f"again in a minute") from exc

    def quiet_left(self) -> float:
        """0: a runtime taken over cannot commit after the takeover (the Hub refuses its stale parent)."""
        return 0.0

    def _free(self, previous: LeaseInfo) -> bool:
        """Is `previous` free to take without watching: this session's, released, or a dead process here?"""
        if previous.session == self.info.session or previous.released:
            return True
        if previous.host != self.info.host:
            return False
        if previous.pid == self.info.pid and previous.pid_start == self.info.pid_start:
            self.took_over_because = "it was this process's own earlier claim (start_run run again)"
            return True
        stale = lease_staleness(previous, host=self.info.host, process_start=self._process_start)
        self.took_over_because = stale
        return stale is not None

    def _read_or_refuse(self, run_name: str, takeover: bool) -> tuple[str, LeaseInfo | None]:
        try:
            head = self.repo.head()
            return head, self._lease_at(head, run_name)
        except LeaseHeldError:
            if not takeover:
                raise
            return self.repo.head(), None
        except HubUnavailable as exc:
            raise LeaseHeldError(f"cannot read the lease of {self.repo.address}/{self.folder} ({exc}), so whether "
                                 f"another runtime writes this run is unknown: nothing was taken over. Run this "
                                 f"cell again in a minute") from exc

    def _lease_at(self, head: str, run_name: str) -> LeaseInfo | None:
        raw = self.repo.read(self.path, revision=head)
        if raw is None:
            return None
        try:
            return parse_lease(raw)
        except ValueError:
            raise LeaseHeldError(f"{self.path} in {self.repo.address} holds no lease that can be read, so whether "
                                 f"another runtime writes this run is unknown. If none does: "
                                 f"ck.start_run({run_name!r}, ..., takeover=True)") from None

    def _watch(self, previous: LeaseInfo, on_watch, run_name: str) -> str:
        return watch(self, previous, on_watch, run_name)  # `leasewatch.py`: from a moment the Hub takes commits

    def _held(self, previous: LeaseInfo, run_name: str) -> LeaseHeldError:
        return held_error(self, previous, run_name)

    # -- writing, fenced ---------------------------------------------------------------------------------
    def commit(self, message: str, *, add: dict | None = None, delete: list[str] = ()) -> str:
        """Commit `add` and `delete` (paths in the repo) with the lease renewed, on a head where the lease is
        this runtime's. Returns the new head.

        Raises:
            LeaseLost: another runtime holds the lease (nothing was committed, and nothing more will be).
            HubUnavailable: the Hub did not answer, or the lease could not be read at a moved head (unknown).
        """
        if self.lost:
            raise LeaseLost(None)
        # The data first, outside the lock: a checkpoint's upload (minutes) never holds up the heartbeat, whose
        # commits go on meanwhile; only the commit that names the data waits for the lock (a second).
        with self.repo.uploaded(add or {}) as sent, self._lock:
            for _ in range(_MOVES):
                if self.lost:
                    raise LeaseLost(None)
                try:
                    return self._commit_lease(message, sent=sent, delete=delete)
                except HeadMoved as moved:
                    held = self._held_at(moved.head)
                    if held is None:
                        raise HubUnavailable(f"the lease of {self.folder} could not be read at the Hub's new head "
                                             f"{moved.head}: not committed now") from None
            raise HubUnavailable(f"the Hub repo {self.repo.address} moved on {_MOVES} times in a row: not committed now")

    def _commit_lease(self, message: str, sent: list = (), delete: list[str] = ()) -> str:
        if self.head is None:  # a commit without a parent would not be fenced
            raise HubUnavailable("no head of the repo is known where the lease is this runtime's: nothing committed")
        self.info.heartbeat = clock.time()
        files = {self.path: json.dumps(asdict(self.info)).encode()}
        self.head = self.repo.commit(message, parent=self.head, add=files, delete=list(delete), sent=sent)
        self._committed = files[self.path]
        self.committed_at = self._checked_at = clock.monotonic()
        return self.head

    def _held_at(self, head: str | None) -> bool | None:
        """Is the lease this runtime's at `head` (then it becomes the parent of the next commit)? False makes
        the lease lost; None is unknown."""
        try:
            head = head or self.repo.head()
            if self._unchanged_at(head):
                self.head = head
                return True
            current = self._lease_at(head, "NAME")
        except (OSError, LeaseHeldError):  # HubUnavailable, or another answer (401, 404): unknown, never lost
            return None
        if current is None:
            return None  # a lease missing from one read is not a loss
        if current.session != self.info.session:
            self.lost, self.holder = True, current
            raise LeaseLost(current)
        self.head = head
        return True

    def _unchanged_at(self, head: str) -> bool:
        """Does the lease at `head` hold the very bytes this runtime committed last? Asked of the tree listing
        (the Hub's API), not by a download: a head moved by another commit (a watcher's mark, another run of the
        repo) is then followed while downloads fail, as they do when the Hub's file servers are down and its API
        answers. A watch's marks, every quarter heartbeat, made every beat of the holder fail then (the sim's
        seed 1044 of issue 46). Nobody else writes these bytes: a claim writes its own session."""
        if self._committed is None:
            return False
        try:
            listed = self.repo.listing(self.folder, revision=head).get(self.path)
        except OSError:
            return False  # the read below decides (or says unknown)
        if listed is None:
            return False  # missing from one listing: read it
        return (listed.sha256 == hashlib.sha256(self._committed).hexdigest() if listed.sha256
                else listed.blob_id == git_blob_id(self._committed))

    def check(self) -> bool | None:
        """Is the lease still this runtime's? True, False (lost), or None (unknown now). Asked before every write
        of the replica too, so the Hub is asked at most every `_CHECK_S` seconds: the commits themselves are
        fenced (a taken-over runtime's commit never lands), this only stops the writes sooner."""
        if self.lost:
            return False
        if clock.monotonic() - self._checked_at < _CHECK_S:
            return True
        try:
            head = self.repo.head()
        except OSError:  # HubUnavailable, or another answer (a revoked token): unknown
            return None
        try:
            held = True if head == self.head else self._held_at(head)
        except LeaseLost:
            return False
        if held:
            self._checked_at = clock.monotonic()
        return held

    @staticmethod
    def watch_s(previous: LeaseInfo) -> float:
        """How long another host's lease `previous` is watched before it counts as dead."""
        return WATCH_BEATS * previous.heartbeat_s

    # -- heartbeat and release ---------------------------------------------------------------------------
    def step(self, on_lost: Callable[[LeaseInfo | None], None], on_error: Callable[[OSError], None] | None = None) -> bool:
        """One heartbeat: a commit of the lease alone when no other commit renewed it for `heartbeat_s`.
        Returns False once the lease is lost (`on_lost` called with the holder), True otherwise."""
        if not self._force and clock.monotonic() - self.committed_at < self.heartbeat_s:
            return not self.lost
        self._force = False
        try:
            self.commit("colab_kit: heartbeat", add=self._riders())
        except LeaseLost as exc:
            on_lost(exc.holder)
            return False
        except OSError as exc:  # HubUnavailable or another answer: unknown is not lost, the next beat tries again
            log.debug("lease heartbeat failed: %s", exc)
            if on_error:
                on_error(exc)
        return True

    def beat_now(self) -> None:
        """Commit a heartbeat at once (with the status page) rather than at the next interval."""
        self._force = True
        self._wake.set()

    def _riders(self) -> dict | None:
        """The files a heartbeat commit carries beside the lease: the status page (`report/`), with the step the
        lease carries too; none when they cannot be made (the heartbeat never waits on a page)."""
        if self.progress is not None:
            self.info.step = self.progress()
        if self.riders is None:
            return None
        try:
            return self.riders(self.info.step, clock.time())
        except Exception as exc:  # noqa: BLE001
            log.debug("the status page was not made: %s", exc)
            return None

    def start_heartbeat(self, on_lost: Callable[[LeaseInfo | None], None],
                        on_error: Callable[[OSError], None] | None = None) -> None:
        def loop():
            while True:
                self._wake.wait(min(30.0, self.heartbeat_s / 4))
                self._wake.clear()
                if self._stop.is_set() or not self.step(on_lost, on_error):
                    return

        self._thread = threading.Thread(target=loop, name="colab_kit-hub-lease", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Stop the heartbeat and commit the lease released, if it is still this runtime's."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self.lost:
            return
        self.info.released = True
        try:
            self.commit("colab_kit: lease released", add=self._riders())  # with the run's last page
        except OSError as exc:  # LeaseLost, HubUnavailable, another answer
            log.warning("could not release the lease of %s: %s (another runtime takes it after watching it)",
                        self.folder, exc)
