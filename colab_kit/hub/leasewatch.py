"""Whether another host's runtime lives, on the Hub: its lease is watched for 1.5 of its heartbeats, and a
heartbeat that does not advance means a dead runtime, but only while the Hub takes commits.

Under a rate limit (the Hub's commits per repo, a spell of 429s for minutes) no runtime can commit, a live one
included: its heartbeat stands still while it trains. A watch through such a spell took a live run over with
its first commit after the spell (issue 46, path 1). So the watch begins with a commit of the watcher's own, a
small file beside the lease (`lease.watch.json`: who watches whom, since when; never the lease, which stays
the holder's): once the Hub took that, it takes commits, and a live holder, whose refused beats are tried again
every quarter heartbeat, shows within the window. The mark is committed again at that cadence (six small
commits a watch): a spell of refusals that begins inside the window starts the window again once it ends. The
Hub refusing the mark for long is no answer: nothing is taken over, and the user is told why. The file is left
in the run's folder, overwritten by the next watch.
"""

from __future__ import annotations

import json
from .._units import format_age
from ..checkpoints.clock import clock
from ..checkpoints.leasefile import LeaseInfo
from ..errors import LeaseHeldError
from .repo import HeadMoved, HubUnavailable

__all__ = ["WATCH_BEATS", "WATCH_MARK", "watch", "held_error"]

WATCH_BEATS = 1.5
WATCH_MARK = "lease.watch.json"
_MOVES = 8
# `lease` below is the watcher's `lease.HubLease` (not imported: lease.py imports this module).


def watch(lease, previous: LeaseInfo, on_watch, run_name: str) -> str:
    """Watch another host's lease `previous` for `WATCH_BEATS` of its heartbeats in which the Hub took the
    watcher's commits; returns the head at which it was seen unchanged at the end (dead), or raises
    `LeaseHeldError` (it changed: alive; it could not be read; the Hub took no commit)."""
    window = WATCH_BEATS * previous.heartbeat_s
    every = min(30.0, previous.heartbeat_s / 4)  # the holder's own cadence of tries (`HubLease.start_heartbeat`)
    announce(lease, previous, run_name)  # refused: nothing is watched, and the user is told why
    probed = taken = clock.monotonic()
    limit = taken + 3 * window + 120.0  # a watch that keeps starting again ends, refused, by then
    deadline, give_up, refused = taken + window, taken + window + max(30.0, 2 * window), None
    while True:
        now = clock.monotonic()
        if on_watch is not None and deadline > now:
            on_watch(previous, deadline - now)
        clock.sleep(min(max(deadline - now, 0.2), max(0.2, min(5.0, previous.heartbeat_s / 10)), every))
        if clock.monotonic() - probed >= every:
            # The mark again, at the holder's cadence: a spell in which the Hub takes no commit (refused, or
            # answered only after its Retry-After) hides the holder's beats as well, so the window starts again
            # once the Hub takes commits. (The sim's seed 1044 of issue 46: a spell from 0.6 to 1.6 windows in,
            # and the claim landed 5 s after its end, before the live holder's next beat.)
            probed = clock.monotonic()
            try:
                announce(lease, previous, run_name)
            except LeaseHeldError as exc:
                refused = exc
            else:
                if clock.monotonic() - taken > 2 * every + 1.0:  # (a second for a slow answer)
                    deadline = clock.monotonic() + window
                    give_up = min(deadline + max(30.0, 2 * window), limit)
                taken, refused = clock.monotonic(), None
        try:
            head = lease.repo.head()
            current = lease._lease_at(head, run_name)
        except (HubUnavailable, LeaseHeldError):
            current = False  # unknown: neither alive nor dead
        if current is not False:
            if current is None or current.session != previous.session or current.heartbeat != previous.heartbeat:
                if current is not None and current.session == previous.session and current.released:
                    lease.took_over_because = "it was released while this runtime watched it"
                    return head
                raise held_error(lease, previous, run_name)  # it moved: alive (or a third runtime claimed it)
            if clock.monotonic() >= deadline and refused is None:
                lease.took_over_because = f"its heartbeat did not advance in {format_age(window)}"
                return head
        if clock.monotonic() >= give_up:
            if refused is not None:
                raise refused  # the Hub stopped taking commits while this runtime watched: not taken over
            if current is not False:
                raise LeaseHeldError(
                    f"the Hub took this runtime's commits only now and then while it watched the lease of "
                    f"{lease.repo.address}/{lease.folder} (host {previous.host}), so whether that runtime's "
                    f"heartbeat advances could not show, and it was not taken over. Run this cell again in a few "
                    f"minutes; if that runtime is gone: ck.start_run({run_name!r}, ..., takeover=True)")
            raise LeaseHeldError(f"the lease of {lease.repo.address}/{lease.folder} (host {previous.host}) could "
                                 f"not be read again to see whether its heartbeat advances, so it was not taken "
                                 f"over. Run this cell again; if that runtime is gone: "
                                 f"ck.start_run({run_name!r}, takeover=True)")


def announce(lease, previous: LeaseInfo, run_name: str) -> str:
    """Commit the watcher's mark beside the lease; returns the new head. Raises LeaseHeldError when the Hub does
    not take it: a heartbeat that cannot be committed says nothing of the runtime that holds the run."""
    path = f"{lease.folder}/{WATCH_MARK}" if lease.folder else WATCH_MARK
    mark = json.dumps({"host": lease.info.host, "session": lease.info.session, "watching": previous.session,
                       "since": clock.time()}).encode()
    try:
        head = lease.repo.head()
        for _ in range(_MOVES):
            try:
                return lease.repo.commit(f"colab_kit: {run_name} watched by {lease.info.host}", parent=head,
                                         add={path: mark})
            except HeadMoved as moved:  # another commit landed first (the holder's beat, another run's)
                head = moved.head or lease.repo.head()
    except HubUnavailable as exc:
        raise LeaseHeldError(
            f"the Hub does not take commits now ({exc}): whether the runtime that holds {lease.repo.address}/"
            f"{lease.folder} (host {previous.host}) lives cannot show, since its heartbeat cannot be committed "
            f"either (a rate limit stops every runtime's commits), so it was not taken over. Run this cell again "
            f"in a few minutes; if that runtime is gone: ck.start_run({run_name!r}, ..., takeover=True)") from exc
    raise LeaseHeldError(f"the Hub repo {lease.repo.address} moved on {_MOVES} times while this runtime began to "
                         f"watch {lease.folder}: run the cell again in a minute")


def held_error(lease, previous: LeaseInfo, run_name: str) -> LeaseHeldError:
    return LeaseHeldError(
        f"run {lease.repo.address}/{lease.folder} is in use by another runtime (host {previous.host}, pid "
        f"{previous.pid}): its heartbeat advanced while this runtime watched it, or its process lives on this "
        f"host. Two writers would overwrite each other's checkpoints. Stop it (in its tab: Runtime -> "
        f"Disconnect and delete runtime), or take over now: ck.start_run({run_name!r}, ..., takeover=True)")
