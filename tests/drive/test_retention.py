"""Retention: what may be deleted, given what is valid and what is in the cloud, and nothing on doubt."""

import errno
import shutil
import time

import pytest
from made import make_checkpoint

from colab_kit._notices import Notices
from colab_kit.checkpoints import storage
from colab_kit.checkpoints.journal import Journal, read_events
from colab_kit.checkpoints.manifest import read_manifest
from colab_kit.drive.cloud import CloudTracker, upload_for
from colab_kit.drive.drivefs import DRIVEFS, PLAIN, UNCONFIRMED, TrashFreeDeleter
from colab_kit.drive.retention import Pruner, Settle, prunable


def test_prune_on_written_state_keeps_newest_valid_ones_and_removes_invalid():
    # A plain folder: written and read back counts as safe, so every valid checkpoint is "safe".
    steps, valid = [10, 20, 30, 35, 40, 50], {10, 20, 30, 40}  # 35 and 50: crashed uploads
    assert prunable(steps, valid, safe=valid, keep=2) == [10, 20, 35, 50]


def test_prune_keeps_the_newest_in_the_cloud_and_whatever_is_on_its_way():
    # 30 is the newest in the cloud; 40 and 50 are written but still uploading.
    steps = [10, 20, 30, 40, 50]
    assert prunable(steps, set(steps), safe={10, 20, 30}, keep=2) == [10]
    # keep counts checkpoints in the cloud: with keep=1 only 30 of them stays, plus the two on their way
    assert prunable(steps, set(steps), safe={10, 20, 30}, keep=1) == [10, 20]


def test_prune_deletes_nothing_before_anything_is_in_the_cloud():
    # The rule before 0.2 deleted 10 and 20 here, and a disconnect then left no checkpoint in the cloud.
    assert prunable([10, 20, 30, 40], {10, 20, 30, 40}, safe=set(), keep=1) == []


def test_prune_removes_what_a_newer_cloud_checkpoint_supersedes_and_honours_protect():
    # 20 was written but never confirmed, and 30 is in the cloud: 20 is no longer needed.
    assert prunable([10, 20, 30], {10, 20, 30}, safe={10, 30}, keep=2) == [20]
    assert prunable([10, 20, 30], {10, 20, 30}, safe={10, 30}, keep=1, protect={10}) == [20]
    # a folder that no longer verifies is garbage even if it once reached the cloud; 10 stays
    assert prunable([10, 20], {10}, safe={10, 20}, keep=1) == [20]


def test_the_best_checkpoint_survives_keep_1_and_takes_one_of_the_keep_places():
    steps = [10, 20, 30, 40]
    # keep=1: the newest (resume) and the best (load_best_model_at_end) both stay, as in the Trainer
    assert prunable(steps, set(steps), safe=set(steps), keep=1, best=10) == [20, 30]
    # keep=3: the best counts against keep, so two more of the newest stay with it
    assert prunable(steps, set(steps), safe=set(steps), keep=3, best=10) == [20]
    # the best still uploading is kept (and does not count: keep counts what is in the cloud)
    assert prunable(steps, set(steps), safe={20, 30}, keep=1, best=10) == [20]
    # once no longer the best, it goes like any other
    assert prunable(steps, set(steps), safe=set(steps), keep=1, best=40) == [10, 20, 30]
    # a broken folder is no best checkpoint
    assert prunable(steps, {20, 30, 40}, safe={20, 30, 40}, keep=1, best=10) == [10, 20, 30]


class Folder:
    """A checkpoints folder with its tracker and pruner, as the mirror holds them."""

    def __init__(self, root, kind=PLAIN, keep=1, prune_after="cloud", settle=Settle()):
        self.root = root
        self.tracker = CloudTracker(kind)
        self.journal = Journal(root.parent / "events.jsonl")
        self.pruner = Pruner(root, kind=kind, prune_after=prune_after, keep=keep, journal=self.journal,
                             notices=Notices(), settle=settle)
        self.pruner.deleter = TrashFreeDeleter(PLAIN)  # decisions are tested here; Trash-free deletes elsewhere
        self.ours = set()
        self.lease = True

    def add(self, step, *, manifest=True, confirmed=None, written_ago=0.0, nbytes=None, ours=False, verified=True):
        folder = make_checkpoint(self.root, step, manifest=manifest)
        if ours:
            self.ours.add(folder)
        if manifest:
            upload = upload_for(folder, read_manifest(folder), f"checkpoint-{step}",
                                written_at=time.time() - written_ago, verified=verified)
            if nbytes is not None:
                upload.bytes = nbytes
            self.tracker.add(upload, confirmed=confirmed)
        return folder

    def prune(self, protect=(), best=None):
        doomed = self.pruner.prune(self.tracker, protect=set(protect), best=best, ours=self.ours,
                                   lease_ok=lambda: self.lease)
        self.pruner.deleter.poll()
        return doomed

    def steps(self):
        return sorted(int(p.name.split("-")[1]) for p in self.root.iterdir())


def test_a_pass_applies_the_rule_of_the_folders_kind(tmp_path):
    plain = Folder(tmp_path / "plain")
    for step in (10, 20, 30):
        plain.add(step)
    assert plain.prune(best=10) == [20] and plain.steps() == [10, 30]  # written is safe; the best stays

    drive = Folder(tmp_path / "drivefs", kind=DRIVEFS)
    for step in (10, 20, 30):
        drive.add(step)
    assert drive.prune() == [] and drive.steps() == [10, 20, 30]  # nothing confirmed, nothing deleted
    drive.tracker.get("checkpoint-20").confirmed = time.monotonic()
    assert drive.prune(protect={30}) == [10] and drive.steps() == [20, 30]

    old_rule = Folder(tmp_path / "written", kind=DRIVEFS, prune_after="written")
    for step in (10, 20, 30):
        old_rule.add(step)
    assert old_rule.prune() == [10, 20]  # the rule before 0.2: written is safe, on Drive too


def test_one_failed_read_in_a_pass_deletes_nothing_in_that_pass(tmp_path, monkeypatch):
    # Finding 4: confirmed {10, 20, 30}, keep=2; one EIO on checkpoint-30's manifest used to mark it
    # invalid, and invalid was deleted in the same pass: the newest checkpoint in the cloud went.
    folder = Folder(tmp_path / "checkpoints", kind=DRIVEFS, keep=2)
    for step in (10, 20, 30):
        folder.add(step, confirmed=True)
    read = storage.read_bytes
    failing = {"left": 1}

    def flaky(path):
        if "checkpoint-30" in str(path) and failing["left"]:
            failing["left"] -= 1
            raise OSError(errno.EIO, "Input/output error")
        return read(path)

    monkeypatch.setattr(storage, "read_bytes", flaky)
    assert folder.prune() is None and folder.steps() == [10, 20, 30]  # doubt: nothing at all
    assert "checkpoint-30" in folder.pruner.last_doubt
    assert folder.prune() == [10] and folder.steps() == [20, 30]  # read again: only what keep=2 allows


def test_a_listing_that_misses_a_followed_checkpoint_deletes_nothing(tmp_path, monkeypatch):
    folder = Folder(tmp_path / "checkpoints", kind=DRIVEFS, keep=1)
    for step in (10, 20, 30):
        folder.add(step, confirmed=True)
    listing = storage.list_dir
    monkeypatch.setattr(storage, "list_dir", lambda p: [e for e in listing(p) if e.name != "checkpoint-30"])
    assert folder.prune() is None and folder.steps() == [10, 20, 30]  # 30 gone for a moment is not gone
    monkeypatch.setattr(storage, "list_dir", listing)
    assert folder.prune() == [10, 20]


def test_a_checkpoint_that_does_not_verify_is_never_counted_or_claimed(tmp_path):
    # Finding 2: pruning used to check sizes only, counted a corrupted newest checkpoint as valid and in
    # the cloud, and with keep=1 deleted the good one behind it.
    folder = Folder(tmp_path / "checkpoints", kind=DRIVEFS, keep=1)
    for step in (10, 20, 30):  # found at a restart: the attributes say "in the cloud", the bytes are not read
        folder.add(step, confirmed=True, verified=False)
    model = tmp_path / "checkpoints" / "checkpoint-30" / "model.safetensors"
    model.write_bytes(b"x" * model.stat().st_size)  # same size, other bytes
    assert folder.tracker.newest_in_cloud() is None  # nothing claimed before it is read
    assert folder.prune() == [10, 30] and folder.steps() == [20]  # read: 30 is garbage, 20 is the one that counts
    assert folder.tracker.newest_in_cloud().step == 20


def test_unfinished_folders_go_only_when_they_are_this_writers(tmp_path):
    # Finding 10: a writer that lost its lease pruned any folder without a manifest, including the new
    # writer's upload in progress. Unfinished folders are deleted only by the writer that made (or
    # found) them, and nothing is deleted without the lease.
    folder = Folder(tmp_path / "checkpoints", keep=1)
    folder.add(10, manifest=False, ours=True)  # a killed upload found at start
    folder.add(15, manifest=False)  # someone else's upload in progress
    folder.add(20)
    folder.add(30)
    folder.lease = None  # the lease cannot be read now
    assert folder.prune() is None and folder.steps() == [10, 15, 20, 30]
    folder.lease = True
    assert folder.prune() == [10, 20] and folder.steps() == [15, 30]


def test_on_a_mount_without_attributes_one_settled_checkpoint_always_stays(tmp_path):
    # Finding 1: 1.3 GB every 10 minutes, keep=3. The settle age is 10 min + 1,300 s (31.7 min). Before,
    # checkpoints left keep as they aged and none lived to settle: after each save the oldest kept was
    # 0, 10, 20, 20, 20 ... minutes old. Now nothing goes until a newer one is settled.
    folder = Folder(tmp_path / "checkpoints", kind=UNCONFIRMED, keep=3)
    size, every = 1_300_000_000, 600.0
    settle = folder.pruner.settle.age(size)
    assert round(settle / 60, 1) == 31.7
    oldest_kept, counts = [], []
    for k in range(12):
        now = k * every
        folder.add(10 * (k + 1), nbytes=size)
        for upload in folder.tracker.pending():  # each one's age at this moment of the run
            upload.written_at = time.time() - (now - (int(upload.step) // 10 - 1) * every)
        folder.prune()
        kept = folder.steps()
        oldest_kept.append(now - (min(kept) // 10 - 1) * every)
        counts.append(len(kept))
        if now >= settle:
            assert oldest_kept[-1] >= settle  # one old enough to have uploaded
    # bounded: keep counts settled checkpoints (the oldest of 3 is at most 3 intervals past settling), and
    # what is not settled yet stays on top of them
    assert max(oldest_kept) <= settle + 3 * every and max(counts) <= 3 + int(settle // every) + 1


def test_pruning_is_journaled_before_the_first_file_goes(tmp_path):
    folder = Folder(tmp_path / "checkpoints", keep=1)
    for step in (10, 20):
        folder.add(step)
    folder.prune()
    prune = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "prune"]
    assert prune and prune[0]["steps"] == [10]


@pytest.fixture(autouse=True)
def _clean(tmp_path):
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)
