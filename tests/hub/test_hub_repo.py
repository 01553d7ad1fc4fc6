"""The kit's client of a Hub repo (`colab_kit/hub/repo.py`, `verify.py`) on the emulated Hub with faults:
a commit whose answer is lost is recognised (never made twice, never taken for lost), 429s and 5xx are
backed off, a moved head is a `HeadMoved`, and "in the cloud" is what the listing's LFS sha256 proves."""

import hashlib
import json
import time

import pytest

from colab_kit.checkpoints.manifest import FileEntry, Manifest
from colab_kit.hub.repo import MARK, HeadMoved, HubUnavailable
from colab_kit.hub.verify import GITATTRIBUTES, lfs_rule, not_shown

REPO = "user/runs"
FILES = {"model.safetensors": b"\x01" * 300_000, "optimizer.pt": b"\x02" * 200_000, "trainer_state.json": b'{"step": 5}'}


def checkpoint(folder: str, files=FILES) -> tuple[dict, Manifest, bytes]:
    """What the kit commits for one checkpoint: its files and MANIFEST.json (sizes and sha256)."""
    manifest = Manifest(step=5, files={name: FileEntry(len(data), hashlib.sha256(data).hexdigest())
                                       for name, data in files.items()})
    raw = json.dumps(manifest.to_json()).encode()
    add = {f"{folder}/{name}": data for name, data in files.items()}
    add[f"{folder}/MANIFEST.json"] = raw
    return add, manifest, raw


def test_every_checkpoint_file_goes_to_lfs_and_the_listing_proves_it_by_sha256(hub, make_repo):
    repo = make_repo()
    head = repo.commit("lfs for the runs", parent=repo.head(), add={GITATTRIBUTES: (lfs_rule("") + "\n").encode()})
    folder = "rna/checkpoints/checkpoint-5"
    add, manifest, raw = checkpoint(folder)
    repo.commit("checkpoint-5", parent=head, add=add)
    listing = repo.listing("rna")
    assert all(listing[f"{folder}/{name}"].sha256 == hashlib.sha256(data).hexdigest() for name, data in FILES.items())
    assert not_shown(folder, manifest, raw, listing) == []

    hub.faults.hide_in_listing(r"optimizer\.pt$")  # a listing that misses a file proves nothing
    assert not_shown(folder, manifest, raw, repo.listing("rna")) == ["optimizer.pt"]
    other = dict(FILES, **{"optimizer.pt": b"\x03" * 200_000})  # same name and size, other content
    _, other_manifest, other_raw = checkpoint(folder, other)
    assert not_shown(folder, other_manifest, other_raw, repo.listing("rna")) == ["optimizer.pt", "MANIFEST.json"]


@pytest.mark.parametrize("drop", [False, True], ids=["answer-too-late", "connection-dropped"])
def test_a_commit_whose_answer_is_lost_is_recognised_and_never_made_twice(hub, make_repo, drop):
    repo = make_repo(commit_wait=(1.0, 1e7))
    parent = repo.head()
    hub.faults.commit_completes_after_client_gives_up(seconds=3.0, drop=drop)  # applied, then no answer in time
    add, _, _ = checkpoint("rna/checkpoints/checkpoint-5")
    made = repo.commit("checkpoint-5", parent=parent, add=add)
    log = hub.state.commit_log(REPO)
    assert made == log[0].id == hub.state.head(REPO)
    assert sum(MARK in c.message for c in log) == 1  # the lost answer's commit, found by its mark, not made again
    assert set(add) <= set(hub.state.files(REPO))


def test_429_and_5xx_are_backed_off_and_a_commit_lands_once(hub, make_repo):
    repo = make_repo()
    parent = repo.head()
    hub.faults.fail_next(1, 503, endpoint="commit")
    hub.faults.fail_next(1, 429, endpoint="commit", retry_after=0)
    made = repo.commit("checkpoint-5", parent=parent, add=checkpoint("rna/checkpoints/checkpoint-5")[0])
    assert made == hub.state.head(REPO) and len(hub.state.commit_log(REPO)) == 2  # the repo's first, and this one
    hub.faults.fail_next(10, 502, endpoint="repo_info")  # a Hub that stays down: unknown, an OSError
    with pytest.raises(HubUnavailable) as caught:
        repo.head()
    assert isinstance(caught.value, OSError)


def test_a_commit_on_a_head_that_moved_is_refused_and_said(hub, make_repo):
    repo = make_repo()
    parent = repo.head()
    moved = repo.commit("another writer", parent=parent, add={"other/x.json": b"{}"})
    with pytest.raises(HeadMoved) as caught:
        repo.commit("checkpoint-5", parent=parent, add=checkpoint("rna/checkpoints/checkpoint-5")[0])
    assert caught.value.head == moved and hub.state.head(REPO) == moved
    assert "rna/checkpoints/checkpoint-5/MANIFEST.json" not in hub.state.files(REPO)


def test_reads_say_what_is_there_and_a_missing_file_is_none(hub, make_repo):
    repo = make_repo()
    head = repo.commit("one file", parent=repo.head(), add={"rna/lease.json": b'{"a": 1}'})
    hub.faults.fail_next(1, 500, endpoint="tree")
    assert set(repo.listing("rna")) == {"rna/lease.json"} and repo.listing("nothing-here") == {}
    assert repo.read("rna/lease.json", revision=head) == b'{"a": 1}'
    assert repo.read("rna/missing.json", revision=head) is None


def test_a_stalled_read_is_cut_short_and_said_unknown(hub, make_repo):
    """The client gives most calls no timeout: a Hub that accepts the connection and never answers would hold
    start_run (or the uploader) for good. The kit waits `read_wait` per try, then the read is unknown."""
    repo = make_repo(read_wait=0.5)
    hub.faults.stall(30.0, n=10, endpoint="repo_info")
    with pytest.raises(HubUnavailable, match="cannot read the repo's head"):
        repo.head()
    hub.faults.clear()


def test_a_commit_still_on_its_way_is_never_sent_twice(hub, make_repo):
    """A commit whose answer is late is not sent again beside it (a slow link would pile up uploads): the next
    try is refused while it runs; once it lands, it is found by its mark."""
    repo = make_repo(commit_wait=(0.5, 1e9))
    parent = repo.head()
    hub.faults.stall(2.0, n=1, endpoint="commit")  # held before the Hub applies it
    add, _, _ = checkpoint("rna/checkpoints/checkpoint-5")
    with pytest.raises(HubUnavailable, match="did not take a commit"):
        repo.commit("checkpoint-5", parent=parent, add=add)
    with pytest.raises(HubUnavailable, match="still on its way"):
        repo.commit("checkpoint-5", parent=parent, add=add)
    deadline = time.monotonic() + 10
    while hub.state.head(REPO) == parent and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hub.state.count("commit", "POST") == 1 and len(hub.state.commit_log(REPO)) == 2
