"""One writer per run folder."""

import contextlib
import json
import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import pytest

from colab_kit.drive.lease import LEASE, Lease, LeaseInfo, lease_staleness, read_lease
from colab_kit.errors import LeaseHeldError


def _foreign_lease(drive, **overrides) -> LeaseInfo:
    info = LeaseInfo(host="other-vm", pid=4242, pid_start=None, session="theirs", started=time.time(),
                     heartbeat=time.time(), heartbeat_s=30.0)
    for key, value in overrides.items():
        setattr(info, key, value)
    (drive / LEASE).write_text(json.dumps(asdict(info)))
    return info


@contextlib.contextmanager
def beating(drive, info: LeaseInfo, every: float, skew: float = 0.0):
    """The other VM, alive: its heartbeat rewritten every `every` s, by its clock (`skew` s off this one's)."""
    stop = threading.Event()

    def beat():
        while not stop.wait(every):
            info.heartbeat = time.time() + skew
            (drive / LEASE).write_text(json.dumps(asdict(info)))

    thread = threading.Thread(target=beat)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def test_a_live_owner_on_this_host_is_refused_at_once_with_the_way_out(drive):
    import os

    import psutil

    parent = psutil.Process(os.getppid())
    _foreign_lease(drive, host=socket.gethostname(), pid=parent.pid, pid_start=parent.create_time())
    started = time.monotonic()
    with pytest.raises(LeaseHeldError, match=r"pid \d+.*wait .* to go stale.*start_run\('rna', \.\.\., takeover=True\)"):
        Lease(drive).acquire(run_name="rna")
    assert time.monotonic() - started < 1  # the pid says it is alive: nothing to watch
    assert read_lease(drive).session == "theirs"  # untouched


def test_a_dead_vm_whose_lease_still_looks_fresh_is_taken_over_after_watching_it(drive):
    # A reconnect lands on a new VM while the old VM's lease is 2 s old: its heartbeat does not
    # advance for 1.5 intervals, so it is dead, and the folder is taken over without takeover=True.
    _foreign_lease(drive, heartbeat=time.time() - 2, heartbeat_s=1.0)
    ticks = []
    started = time.monotonic()
    lease = Lease(drive)
    previous = lease.acquire(on_watch=lambda holder, left: ticks.append(left))
    waited = time.monotonic() - started
    assert previous.host == "other-vm" and read_lease(drive).session == lease.info.session
    assert 1.4 <= waited < 2.5, waited
    assert "did not advance" in lease.took_over_because
    assert ticks and ticks[0] == pytest.approx(1.5, abs=0.1) and ticks == sorted(ticks, reverse=True)


def test_a_live_owner_on_another_host_is_refused_when_its_heartbeat_advances(drive):
    info = _foreign_lease(drive, heartbeat_s=1.0)
    with beating(drive, info, every=0.3):
        with pytest.raises(LeaseHeldError, match=r"host other-vm.*advanced while this runtime watched.*"
                                                 r"takeover=True") as refused:
            Lease(drive).acquire(run_name="rna")
        assert "last heartbeat" not in str(refused.value)  # another VM's clock: its age would say nothing true
    assert read_lease(drive).session == "theirs"


def test_takeover_replaces_a_live_lease(drive):
    _foreign_lease(drive)
    lease = Lease(drive)
    previous = lease.acquire(takeover=True)
    assert previous.host == "other-vm" and read_lease(drive).session == lease.info.session


def test_an_old_heartbeat_is_stale_on_this_host_and_watched_on_another(drive):
    import os

    import psutil

    parent = psutil.Process(os.getppid())  # alive: only the heartbeat's age can make it stale here
    _foreign_lease(drive, host=socket.gethostname(), pid=parent.pid, pid_start=parent.create_time(),
                   heartbeat=time.time() - 5 * 30)
    assert "heartbeat was 3 min" in lease_staleness(read_lease(drive))  # one clock: its age means something
    _foreign_lease(drive, heartbeat=time.time() - 5 * 30, heartbeat_s=0.4)
    assert lease_staleness(read_lease(drive)) is None  # another VM's clock: its age proves nothing
    lease = Lease(drive)
    assert lease.acquire().host == "other-vm"
    assert lease.watched_s >= 1.5 * 0.4 and "did not advance" in lease.took_over_because


def test_a_live_owner_whose_clock_is_minutes_behind_is_refused_not_taken_in_two_seconds(drive):
    """Issue 38, finding 4: a heartbeat "10 minutes old" by this VM's clock, from a VM whose clock is 10
    minutes behind (or whose lease.json reached Drive late), took the quick path: one read after 2 s, and a
    heartbeat every 3 s was not seen to advance. Only a heartbeat seen to change counts."""
    info = _foreign_lease(drive, heartbeat=time.time() - 600.0, heartbeat_s=3.0)
    with beating(drive, info, every=3.0, skew=-600.0):  # alive, by a clock 10 minutes behind
        with pytest.raises(LeaseHeldError, match="advanced while this runtime watched it"):
            Lease(drive).acquire(run_name="rna")
    assert read_lease(drive).session == "theirs"


def test_dead_process_on_this_host_is_stale(drive):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    _foreign_lease(drive, host=socket.gethostname(), pid=proc.pid)
    assert "ended" in lease_staleness(read_lease(drive))
    Lease(drive).acquire()


def test_killed_process_left_as_a_zombie_is_stale(drive):
    # A kernel killed with its parent can stay a zombie where nothing reaps it (CI containers):
    # it still has a pid and a start time, but holds nothing.
    import psutil

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 30
    while psutil.Process(proc.pid).status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
        time.sleep(0.05)  # not waited for: it stays a zombie until proc.wait()
    assert psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
    _foreign_lease(drive, host=socket.gethostname(), pid=proc.pid,
                   pid_start=psutil.Process(proc.pid).create_time())
    try:
        assert "ended" in lease_staleness(read_lease(drive))
    finally:
        proc.wait()


def test_reused_pid_is_recognised_by_its_start_time(drive):
    import os

    _foreign_lease(drive, host=socket.gethostname(), pid=os.getppid(), pid_start=1.0)
    assert "different process" in lease_staleness(read_lease(drive))


def test_same_process_may_reopen_its_run(drive):
    first = Lease(drive)
    first.acquire()
    Lease(drive).acquire()  # re-running the start_run cell in the same kernel


def test_heartbeat_notices_a_takeover(drive):
    mine = Lease(drive, heartbeat_s=0.05)
    mine.acquire()
    lost = []
    mine.start_heartbeat(on_lost=lost.append)
    Lease(drive).acquire(takeover=True)
    deadline = time.monotonic() + 5
    while not lost and time.monotonic() < deadline:
        time.sleep(0.02)
    mine.release()
    assert mine.lost and lost and lost[0].session != mine.info.session
    assert read_lease(drive) is not None  # the new holder's lease is not removed by the loser


def test_release_marks_the_lease_released_and_frees_the_folder(drive):
    lease = Lease(drive)
    lease.acquire()
    lease.release()
    assert read_lease(drive).released and "released" in lease_staleness(read_lease(drive))
    _foreign_lease(drive, released=True)
    Lease(drive).acquire()  # a released lease holds nobody out
