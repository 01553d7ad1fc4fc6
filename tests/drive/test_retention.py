"""Retention: what the rules choose (given what is valid and what is in the cloud), the ladder where nothing
confirms uploads, and the gate that deletes only on a fresh proof, nothing on doubt."""

import errno
import os
import shutil
import time

import pytest
from made import make_checkpoint

from colab_kit.checkpoints import storage
from colab_kit.checkpoints.journal import Journal, read_events
from colab_kit.checkpoints.manifest import read_manifest
from colab_kit.drive.cloud import CloudTracker, upload_for
from colab_kit.drive.deleters import TrashFreeDeleter
from colab_kit.drive.drivefs import DRIVEFS, ITEM_ID, PLAIN, UNCOMMITTED, UNCONFIRMED
from colab_kit.drive.gate import CheckpointGate
from colab_kit.drive.retention import Ladder, Pruner, ladder, prunable


def test_prune_on_written_state_keeps_newest_valid_ones_and_what_is_newer():
    # A plain folder: written and read back counts as safe, so every valid checkpoint is "safe".
    steps, valid = [10, 20, 30, 35, 40, 50], {10, 20, 30, 40}  # 35 and 50: crashed uploads
    # 50 is newer than the newest safe one: never deleted on account of an older one (it may be on its way)
    assert prunable(steps, valid, safe=valid, keep=2) == [10, 20, 35]


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
    # issue 27, finding 1: a folder that does not verify *newer* than the newest good one stays
    assert prunable([10, 20], {10}, safe={10, 20}, keep=1) == []


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


def test_the_ladder_keeps_the_oldest_the_young_and_one_per_doubling_of_age():
    minute = 60.0
    written = {10 * k: k * 10 * minute for k in range(1, 13)}  # every 10 min for 2 hours
    now = 12 * 10 * minute
    kept = ladder(written, now, base_s=10 * minute)
    assert 10 in kept and 120 in kept  # the oldest and the newest (age 0)
    ages = sorted((now - written[s]) / minute for s in kept)
    # < 10 min, then the oldest written in each band [10,20), [20,40), [40,80) and [80,160): the run's oldest
    assert ages == [0.0, 10.0, 30.0, 70.0, 110.0]
    with pytest.raises(ValueError, match="longer than zero"):
        Ladder(0)
    with pytest.raises(ValueError, match="longer than zero"):
        Ladder(-5)


class Folder:
    """A checkpoints folder with its tracker, gate and pruner, as the mirror holds them. On a DRIVEFS folder
    the checkpoints confirmed in the cloud carry DriveFS's attributes (user xattrs on the test's disk)."""

    def __init__(self, root, kind=PLAIN, keep=1, base_s=600.0):
        self.root = root
        self.root.mkdir(parents=True, exist_ok=True)
        self.kind = kind
        self.tracker = CloudTracker(kind)
        self.journal = Journal(root.parent / "events.jsonl")
        self.lease = True
        self.gate = CheckpointGate(root, kind=kind, journal=self.journal, lease_check=lambda: self.lease)
        self.gate.deleter = TrashFreeDeleter(PLAIN)  # decisions are tested here; Trash-free deletes elsewhere
        self.pruner = Pruner(root, kind=kind, keep=keep, gate=self.gate, ladder=Ladder(base_s))

    def add(self, step, *, manifest=True, confirmed=None, written_ago=0.0, verified=True):
        folder = make_checkpoint(self.root, step, manifest=manifest)
        if written_ago and manifest:
            then = time.time() - written_ago
            os.utime(folder / "MANIFEST.json", (then, then))
        if confirmed and self.kind == DRIVEFS:
            mark_in_cloud(folder)
        if manifest:
            upload = upload_for(folder, read_manifest(folder), f"checkpoint-{step}",
                                written_at=time.time() - written_ago, verified=verified)
            self.tracker.add(upload, confirmed=confirmed)
        return folder

    def prune(self, protect=(), best=None):
        doomed = self.pruner.prune(self.tracker, protect=set(protect), best=best)
        self.gate.poll()
        return doomed

    def steps(self):
        return sorted(int(p.name.split("-")[1]) for p in self.root.iterdir())

    def kept(self):
        return [e for e in read_events(self.root.parent / "events.jsonl") if e["event"] == "kept"]


def mark_in_cloud(folder):
    """DriveFS's attributes for every file of `folder`: committed, with a cloud id."""
    for path in [p for p in folder.rglob("*") if p.is_file()]:
        os.setxattr(path, UNCOMMITTED, b"0")
        os.setxattr(path, ITEM_ID, b"cloud-" + path.name.encode())


@pytest.fixture
def xattrs(tmp_path):
    probe = tmp_path / "probe"
    probe.write_bytes(b"x")
    try:
        os.setxattr(probe, UNCOMMITTED, b"0")
    except OSError as exc:
        pytest.skip(f"this disk keeps no user xattrs ({exc}): DriveFS's attributes cannot be stood in for")


def test_a_pass_applies_the_rule_of_the_folders_kind(tmp_path, xattrs):
    plain = Folder(tmp_path / "plain")
    for step in (10, 20, 30):
        plain.add(step)
    assert plain.prune(best=10) == [20] and plain.steps() == [10, 30]  # written is safe; the best stays

    drive = Folder(tmp_path / "drivefs", kind=DRIVEFS)
    for step in (10, 20, 30):
        drive.add(step)
    assert drive.prune() == [] and drive.steps() == [10, 20, 30]  # nothing confirmed, nothing deleted
    mark_in_cloud(tmp_path / "drivefs" / "checkpoint-20")
    drive.tracker.get("checkpoint-20").confirmed = time.monotonic()
    assert drive.prune(protect={30}) == [10] and drive.steps() == [20, 30]


def test_the_gate_asks_the_folder_itself_not_the_trackers_memory(tmp_path, xattrs):
    # The tracker believes checkpoint-20 is in the cloud, but DriveFS says its file is not committed now
    # (a re-upload, or a confirmation remembered from before): no proof, nothing deleted, `kept` said.
    drive = Folder(tmp_path / "checkpoints", kind=DRIVEFS)
    drive.add(10, confirmed=True)
    drive.add(20, confirmed=True)
    os.setxattr(tmp_path / "checkpoints" / "checkpoint-20" / "model.safetensors", UNCOMMITTED, b"1")
    assert drive.prune() == [] and drive.steps() == [10, 20]
    assert drive.kept()[-1]["step"] == 10 and "checkpoint-20 is not in the cloud now" in drive.kept()[-1]["reason"]
    os.setxattr(tmp_path / "checkpoints" / "checkpoint-20" / "model.safetensors", UNCOMMITTED, b"0")
    assert drive.prune() == [10]


def test_one_failed_read_in_a_pass_deletes_nothing_in_that_pass(tmp_path, monkeypatch, xattrs):
    # Finding 4 (issue 20): confirmed {10, 20, 30}, keep=2; one EIO on checkpoint-30's manifest used to mark
    # it invalid, and invalid was deleted in the same pass: the newest checkpoint in the cloud went.
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


def test_one_enoent_inside_the_newest_checkpoint_deletes_nothing(tmp_path, monkeypatch, xattrs):
    # Issue 27, finding 1: keep=1, 100 and 200 both in the cloud; one ENOENT on stat(checkpoint-200/model)
    # made 200 "invalid", and the pass chose 200 and truncated it. A missing file is doubt.
    folder = Folder(tmp_path / "checkpoints", kind=DRIVEFS, keep=1)
    for step in (100, 200):
        folder.add(step, confirmed=True)
    stat = storage.stat
    hidden = {"left": 1}

    def hide_once(path):
        if str(path).endswith("checkpoint-200/model.safetensors") and hidden["left"]:
            hidden["left"] -= 1
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", str(path))
        return stat(path)

    monkeypatch.setattr(storage, "stat", hide_once)
    assert folder.prune() is None and folder.steps() == [100, 200]
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "checkpoints" / "checkpoint-200").iterdir() if p.is_file()}
    assert all(sizes.values()) and "MANIFEST.json" in sizes  # nothing truncated
    assert folder.prune() == [100] and folder.steps() == [200]


def test_a_listing_that_misses_a_followed_checkpoint_deletes_nothing(tmp_path, monkeypatch, xattrs):
    folder = Folder(tmp_path / "checkpoints", kind=DRIVEFS, keep=1)
    for step in (10, 20, 30):
        folder.add(step, confirmed=True)
    listing = storage.list_dir
    monkeypatch.setattr(storage, "list_dir", lambda p: [e for e in listing(p) if e.name != "checkpoint-30"])
    assert folder.prune() is None and folder.steps() == [10, 20, 30]  # 30 gone for a moment is not gone
    monkeypatch.setattr(storage, "list_dir", listing)
    assert folder.prune() == [10, 20]


def test_a_checkpoint_that_does_not_verify_is_never_counted_or_claimed(tmp_path, xattrs):
    # Finding 2 (issue 20): pruning used to check sizes only, counted a corrupted newest checkpoint as valid
    # and in the cloud, and with keep=1 deleted the good one behind it.
    folder = Folder(tmp_path / "checkpoints", kind=DRIVEFS, keep=1)
    for step in (10, 20, 30):  # found at a restart: the attributes say "in the cloud", the bytes are not read
        folder.add(step, confirmed=True, verified=False)
    model = tmp_path / "checkpoints" / "checkpoint-30" / "model.safetensors"
    model.write_bytes(b"x" * model.stat().st_size)  # same size, other bytes
    mark_in_cloud(tmp_path / "checkpoints" / "checkpoint-30")
    assert folder.tracker.newest_in_cloud() is None  # nothing claimed before it is read
    # read: 30 is garbage, 20 is the one that counts; 30, newer, stays (nothing newer goes for an older one)
    assert folder.prune() == [10] and folder.steps() == [20, 30]
    assert folder.tracker.newest_in_cloud().step == 20


def test_nothing_is_deleted_without_the_lease(tmp_path):
    # Finding 10 (issue 20): a writer that lost its lease pruned the new writer's upload in progress.
    folder = Folder(tmp_path / "checkpoints", keep=1)
    folder.add(10, manifest=False)  # a killed upload found at start
    folder.add(15, manifest=False)  # an upload in progress, newer than the newest safe one
    folder.add(20)
    folder.add(30)
    folder.lease = None  # the lease cannot be read now
    assert folder.prune() == [] and folder.steps() == [10, 15, 20, 30]
    assert {e["reason"] for e in folder.kept()} == {"the lease could not be confirmed now"}
    folder.lease = True
    assert folder.prune() == [10, 15, 20] and folder.steps() == [30]


def test_where_nothing_confirms_uploads_the_ladder_keeps_one_whatever_the_rate(tmp_path):
    # Issue 27, finding 3: the settle rule bet on an upload rate and deleted the uploaded checkpoints while
    # the "settled" one still sat in Drive's queue. The ladder never deletes the oldest, whatever the age.
    folder = Folder(tmp_path / "checkpoints", kind=UNCONFIRMED, keep=3, base_s=600.0)
    every = 600.0
    for k in range(12):  # two hours of saves, every 10 minutes; "now" is the end
        folder.add(10 * (k + 1), written_ago=(11 - k) * every)
    assert folder.prune() is not None
    kept = folder.steps()
    assert kept[0] == 10 and kept[-1] == 120  # the oldest stays, whatever Drive's rate
    assert kept == [10, 50, 90, 110, 120]  # ages 110 (the oldest), 70, 30, 10 and 0 minutes
    for event in [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "prune"]:
        assert event["witness"] == 10  # every deletion was vouched for by the oldest, older than it


@pytest.mark.parametrize("damage", ["model file never arrived", "model file cut short"])
def test_an_invalid_oldest_checkpoint_is_reported_and_goes_instead_of_holding_every_deletion_back(tmp_path, damage,
                                                                                                 monkeypatch):
    """Issue 38, finding 2: a runtime recycled while its first checkpoint uploaded left a manifest whose model
    file never reached Drive. The ladder's anchor had to verify and was never a deletion target, so nothing was
    ever deleted again: unbounded growth against the quota. The anchor is now the oldest checkpoint that
    verifies; the invalid one is reported and goes, vouched for by it (a missing file: once missing at passes
    ABSENT_FOR_S apart; a file cut short is positive evidence at once)."""
    from colab_kit.drive import evidence

    monkeypatch.setattr(evidence, "ABSENT_FOR_S", 0.3)
    folder = Folder(tmp_path / "checkpoints", kind=UNCONFIRMED, keep=3, base_s=600.0)
    every = 600.0
    for k in range(12):
        folder.add(10 * (k + 1), written_ago=(11 - k) * every)
    model = folder.root / "checkpoint-10" / "model.safetensors"
    if damage == "model file never arrived":
        model.unlink()
    else:
        model.write_bytes(model.read_bytes()[:100])
    started = time.monotonic()  # before the first pass: its look begins the first series
    assert folder.prune() is not None
    if damage == "model file never arrived":  # one look a pass: a fact only after two spaced series of them
        from colab_kit.checkpoints import looks

        assert 10 in folder.steps()
        needs = 2 * looks.span() + evidence.ABSENT_FOR_S
        while 10 in folder.steps() and time.monotonic() - started < needs + 5:
            passed = time.monotonic() - started
            assert folder.prune() is not None
            assert 10 not in folder.steps() or passed < needs + 0.5
            assert 10 in folder.steps() or time.monotonic() - started >= needs, passed  # never sooner
            time.sleep(0.02)
    kept = folder.steps()
    assert 10 not in kept and kept[0] == 20 and kept[-1] == 120  # before: nothing went, pass after pass
    assert kept == [20, 50, 90, 110, 120]
    events = read_events(tmp_path / "events.jsonl")
    said = [e for e in events if e["event"] == "warn" and e.get("what") == "invalid_checkpoint"]
    assert [e["step"] for e in said] == [10]
    assert {e["witness"] for e in events if e["event"] == "prune"} == {20}


def test_an_invalid_oldest_checkpoint_stays_while_nothing_newer_verifies(tmp_path):
    folder = Folder(tmp_path / "checkpoints", kind=UNCONFIRMED, keep=3, base_s=600.0)
    for k in range(3):
        folder.add(10 * (k + 1), written_ago=(5 - k) * 600.0)
    for step in (10, 20, 30):
        (folder.root / f"checkpoint-{step}" / "optimizer.pt").write_bytes(b"x")  # none verifies
    assert not folder.prune()  # nothing safe vouches for anything: nothing goes
    assert folder.steps() == [10, 20, 30]


def test_pruning_is_journaled_before_the_first_file_goes(tmp_path):
    folder = Folder(tmp_path / "checkpoints", keep=1)
    for step in (10, 20):
        folder.add(step)
    folder.prune()
    prune = [e for e in read_events(tmp_path / "events.jsonl") if e["event"] == "prune"]
    assert prune and prune[0]["steps"] == [10] and prune[0]["witness"] == 20


@pytest.fixture(autouse=True)
def _clean(tmp_path):
    yield
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_checkpoint_the_journal_confirmed_is_never_taken_for_none_when_a_file_hides(tmp_path, monkeypatch):
    """Where nothing confirms uploads now, a checkpoint an earlier runtime's journal said reached the cloud, with
    a file missing at every look of a pass (and for longer than ABSENT_FOR_S), is kept: only positive evidence
    makes such a checkpoint invalid."""
    from colab_kit.drive import evidence

    monkeypatch.setattr(evidence, "ABSENT_FOR_S", 0.0)
    folder = Folder(tmp_path / "checkpoints", kind=UNCONFIRMED, keep=3, base_s=600.0)
    for k in range(6):
        folder.add(10 * (k + 1), written_ago=(5 - k) * 3600.0)
    folder.gate.evidence.confirmed = lambda: {10}  # the journal's word (Mirror passes it)
    (folder.root / "checkpoint-10" / "model.safetensors").rename(tmp_path / "hidden")
    assert folder.prune() is not None and folder.prune() is not None
    assert 10 in folder.steps()


def test_a_folder_that_holds_no_checkpoint_is_written_over_without_a_witness_and_a_whole_one_is_not(tmp_path):
    from colab_kit.drive.gate import choose

    folder = Folder(tmp_path / "checkpoints", kind=DRIVEFS, keep=1)
    whole = folder.add(10)
    broken = folder.add(20)
    (broken / "model.safetensors").write_bytes(b"cut short")  # positive evidence: another size
    written = []
    assert folder.gate.replace(choose(broken, 20), None, lambda: written.append(20)) is None
    why = folder.gate.replace(choose(whole, 10), None, lambda: written.append(10))
    assert written == [20] and why == "no checkpoint vouches for it"


def test_written_before_is_this_runtimes_own_count_after_every_other_runtimes_writes(tmp_path):
    """The order the gate trusts where nothing confirms uploads: never the files' times for this runtime's own
    writes (a clock set back gives a later write an earlier time)."""
    from colab_kit.drive.gate import choose

    folder = Folder(tmp_path / "checkpoints", kind=UNCONFIRMED, keep=3)
    theirs = folder.add(10, written_ago=60.0)
    later, earlier = folder.add(30, written_ago=7200.0), folder.add(20)  # 30 written after 20, its time earlier
    order = folder.gate.evidence
    order.wrote(earlier)
    order.wrote(later)
    keys = {step: order.write_order(choose(path, step)) for step, path in ((10, theirs), (20, earlier), (30, later))}
    assert sorted(keys, key=keys.get) == [10, 20, 30]
