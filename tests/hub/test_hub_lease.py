"""One writer per run on the Hub (`colab_kit/hub/lease.py`): a second runtime is refused while the first one's
heartbeat moves and takes over a dead one; the runtime taken over cannot commit one file more (the Hub's
compare-and-swap refuses its stale parent); another run of the same repo committing in between is no loss;
a lease that cannot be read is never taken."""

import json
import threading

import pytest

from colab_kit.errors import LeaseHeldError
from colab_kit.hub.lease import HubLease, LeaseLost

REPO = "user/runs"
LEASE = "rna/lease.json"


def lease(repo, host: str, heartbeat_s: float = 0.6, **kwargs) -> HubLease:
    return HubLease(repo, "rna", heartbeat_s=heartbeat_s, host=host, pid=4242, process_start=lambda pid: 1.0, **kwargs)


def holder(hub) -> dict:
    return json.loads(hub.state.files(REPO)[LEASE])


def test_a_live_runtime_is_watched_and_kept_and_a_dead_one_is_taken_over(hub, make_repo):
    first = lease(make_repo(), "vm-1")
    assert first.acquire(run_name="rna") is None
    stop = threading.Event()
    beats = threading.Thread(target=lambda: [first.step(lambda who: None) for _ in iter(lambda: stop.wait(0.2), True)])
    beats.start()  # alive: a heartbeat commit whenever nothing was committed for 0.6 s
    try:
        second = lease(make_repo(), "vm-2")
        with pytest.raises(LeaseHeldError, match="heartbeat advanced while this runtime watched it"):
            second.acquire(run_name="rna")
        assert holder(hub)["session"] == first.info.session
    finally:
        stop.set()
        beats.join()

    # vm-1's runtime died (no more heartbeats): watched for 1.5 beats, then taken over by one commit.
    third = lease(make_repo(), "vm-3")
    replaced = third.acquire(run_name="rna")
    assert replaced.session == first.info.session and "did not advance" in third.took_over_because
    assert holder(hub)["session"] == third.info.session

    # The runtime taken over comes back (it was only slow): its commit on its old head is refused, nothing lands.
    heads = len(hub.state.commit_log(REPO))
    with pytest.raises(LeaseLost):
        first.commit("checkpoint-10", add={"rna/checkpoints/checkpoint-10/MANIFEST.json": b"{}"})
    assert first.check() is False and len(hub.state.commit_log(REPO)) == heads
    assert "rna/checkpoints/checkpoint-10/MANIFEST.json" not in hub.state.files(REPO)


def test_another_run_of_the_same_repo_committing_in_between_is_no_loss(hub, make_repo):
    ours = lease(make_repo(), "vm-1")
    ours.acquire(run_name="rna")
    neighbour = HubLease(make_repo(), "gpt2", host="vm-9")  # another notebook's run, same repo
    neighbour.acquire(run_name="gpt2")
    head = ours.commit("checkpoint-5", add={"rna/checkpoints/checkpoint-5/MANIFEST.json": b"{}"})
    assert head == hub.state.head(REPO) and ours.check() is True
    assert holder(hub)["session"] == ours.info.session


def test_a_dead_process_on_this_host_is_taken_over_at_once_and_a_released_lease_is_free(hub, make_repo):
    first = HubLease(make_repo(), "rna", host="vm-1", pid=4242, process_start=lambda pid: 1.0)
    first.acquire(run_name="rna")
    after_crash = HubLease(make_repo(), "rna", host="vm-1", pid=5151, process_start=lambda pid: None)  # 4242 ended
    assert after_crash.acquire(run_name="rna").session == first.info.session
    assert "has ended" in after_crash.took_over_because and after_crash.watched_s == 0.0
    after_crash.release()
    assert holder(hub)["released"] is True
    later = lease(make_repo(), "vm-2")
    assert later.acquire(run_name="rna") is None and later.watched_s == 0.0  # released: nothing to watch


def test_a_lease_that_cannot_be_read_is_never_taken_over(hub, make_repo):
    first = lease(make_repo(), "vm-1")
    first.acquire(run_name="rna")
    second = lease(make_repo(waits=(0.05,)), "vm-2")
    hub.faults.fail_next(500, 503, endpoint="resolve")  # the head answers, the lease cannot be downloaded
    with pytest.raises(LeaseHeldError, match="nothing was taken over"):
        second.acquire(run_name="rna")
    hub.faults.clear()
    hub.faults.fail_next(500, 503, endpoint="repo_info")  # nor the head
    with pytest.raises(LeaseHeldError, match="nothing was taken over"):
        second.acquire(run_name="rna")
    hub.faults.clear()
    assert holder(hub)["session"] == first.info.session and len(hub.state.commit_log(REPO)) == 2


def test_an_answer_other_than_yes_or_no_is_unknown_and_keeps_the_heartbeat(hub, make_repo):
    """A revoked token (401) or a revision the Hub does not know now is not a lost lease: `check` says unknown,
    and the heartbeat goes on (it used to end its thread with the traceback in the notebook)."""
    ours = lease(make_repo(), "vm-1", heartbeat_s=0.01)
    ours.acquire(run_name="rna")
    ours._checked_at = -float("inf")
    hub.faults.fail_next(20, 401, endpoint="repo_info")
    assert ours.check() is None
    hub.faults.fail_next(20, 401, endpoint="commit")
    lost = []
    assert ours.step(lost.append) is True and lost == [] and not ours.lost
    hub.faults.clear()
    assert ours.check() is True


def test_a_spell_of_429s_longer_than_the_watch_window_never_takes_a_live_runtime_over(hub, make_repo):
    """Issue 46, path 1 (rate limits): while the Hub refuses every commit (its limit of commits per repo), a live
    runtime's heartbeat cannot advance, and a silence is no evidence. Before, the second runtime watched through
    the spell, saw no beat and took the live run over with its first commit after the spell (its in-flight
    checkpoint then never landed). Now the watch begins only once the Hub took a commit of the watcher's own."""
    first = lease(make_repo(waits=(2.0,)), "vm-1")  # a refused beat waits 2 s before its next try, as the Hub asks
    first.acquire(run_name="rna")
    stop = threading.Event()
    beats = threading.Thread(target=lambda: [first.step(lambda who: None) for _ in iter(lambda: stop.wait(0.1), True)])
    beats.start()
    try:
        hub.faults.fail_for(2.0, 429, endpoint="commit")  # over twice the 0.9 s watch window
        second = lease(make_repo(waits=(0.5, 1.0, 1.0)), "vm-2")  # its tries go on past the spell's end
        with pytest.raises(LeaseHeldError):
            second.acquire(run_name="rna")
        assert holder(hub)["session"] == first.info.session
    finally:
        stop.set()
        beats.join()
    first.commit("checkpoint-10", add={"rna/checkpoints/checkpoint-10/MANIFEST.json": b"{}"})  # still the writer
    assert "rna/checkpoints/checkpoint-10/MANIFEST.json" in hub.state.files(REPO)
