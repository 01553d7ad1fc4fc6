"""Absence is not evidence (issue 27, findings 1, 2, 3 and 6): a file missing from one read, a mount whose
kind is not known, an upload rate nobody measured, one short listing: none of them may delete a checkpoint,
resume an older one, or start fresh next to one.

Each test injects one fault at the storage seam (`drive_faults`, or a patch of one named operation); each
fails on f65fb4d.
"""

import errno
import time
from pathlib import Path

import harness
import pytest

import colab_kit as ck
from colab_kit.checkpoints import storage
from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.journal import read_events
from colab_kit.checkpoints.validity import verify_folder
from colab_kit.drive.drivefs import PLAIN, UNCONFIRMED, folder_kind
from colab_kit.tasks.demo import tiny_trainer


def trained(drive, local, name="t", steps=20, keep=3):
    """A finished run with checkpoints every 10 steps on `drive`; its run folder."""
    run = ck.start_run(name, drive=drive, local_dir=local / name, save_every=10, keep=keep, quiet=True, gauges=False)
    run.train(tiny_trainer(run, max_steps=steps))
    run.finish(timeout=30)
    return run.drive_dir


def once(monkeypatch, op: str, suffix: str, exc, times: int = 1):
    """Make `storage.<op>` raise `exc` for a path ending in `suffix`, `times` times."""
    original = getattr(storage, op)
    left = {"n": times}

    def faulty(path, *args, **kwargs):
        if str(path).endswith(suffix) and left["n"]:
            left["n"] -= 1
            raise exc
        return original(path, *args, **kwargs)

    monkeypatch.setattr(storage, op, faulty)
    return left


def enoent(path="a file"):
    return FileNotFoundError(errno.ENOENT, "No such file or directory", path)


# -- finding 1: one ENOENT is not a fact ---------------------------------------------------------------
def test_finding_1_one_enoent_in_a_pass_never_deletes_the_newest(drive, local, monkeypatch):
    run_dir = trained(drive, local)
    run = ck.start_run("t", drive=drive, local_dir=local / "again", keep=3, quiet=True, gauges=False)
    assert run.mirror.drain(10)
    assert {s for s, _ in list_checkpoints(run_dir / "checkpoints")} == {10, 20}
    # keep=1 now, and one ENOENT on the newest's model while the pass reads it: before, 20 was "invalid"
    # and went (a folder newer than the newest counted), and 10 stayed.
    run.mirror.pruner.keep = 1
    left = once(monkeypatch, "stat", "checkpoint-20/model.safetensors", enoent(), times=3)
    run.mirror.adopt_existing()  # a pass that reads every checkpoint again
    assert run.mirror.drain(10)
    time.sleep(0.2)
    assert left["n"] < 3  # the pass met the fault
    left["n"] = 0
    assert verify_folder(run_dir / "checkpoints" / "checkpoint-20") is None
    run.mirror.adopt_existing()  # the next pass, nothing hidden: 10 goes, on the proof that 20 is there
    assert run.mirror.drain(10)
    time.sleep(0.2)
    assert {s for s, _ in list_checkpoints(run_dir / "checkpoints")} == {20}
    run.finish(timeout=10)


def test_finding_1_one_enoent_on_the_manifest_at_start_resumes_the_newest(drive, local, monkeypatch):
    trained(drive, local)
    once(monkeypatch, "read_bytes", "checkpoint-20/MANIFEST.json", enoent())
    run = ck.start_run("t", drive=drive, local_dir=local / "new-vm", quiet=True, gauges=False)
    assert run.resume_manifest.step == 20  # before: 10, the newest that answered the first look
    run.finish(timeout=10)


def test_finding_1_the_only_checkpoint_hidden_for_a_moment_is_no_fresh_start(drive, local, monkeypatch, capsys):
    run_dir = trained(drive, local, steps=10)
    once(monkeypatch, "read_bytes", "checkpoint-10/MANIFEST.json", enoent(), times=2)
    run = ck.start_run("t", drive=drive, local_dir=local / "new-vm", quiet=False, gauges=False)
    said = capsys.readouterr().out
    assert run.resume_manifest.step == 10 and "starting fresh" not in said
    run.finish(timeout=10)
    assert verify_folder(run_dir / "checkpoints" / "checkpoint-10") is None


# -- finding 2: a mount is plain only when it is known to be local ------------------------------------------
def test_finding_2_a_network_mount_without_attributes_is_unconfirmed(emulated_drive, tmp_path):
    rclone = emulated_drive(attrs=False, name="rclone")  # mounted as fuse.rclone, no DriveFS attributes
    assert folder_kind(rclone.mountpoint) == UNCONFIRMED  # before: plain, where written means in the cloud
    assert folder_kind(tmp_path) == PLAIN  # this machine's own disk


def test_finding_2_a_run_folder_reached_through_a_symlink_is_where_it_leads(emulated_drive, tmp_path):
    drive = emulated_drive(attrs=False)  # Google Drive's mount (fuse.drive), no attributes
    link = tmp_path / "runs"
    link.symlink_to(drive.mountpoint)
    assert folder_kind(link) == UNCONFIRMED  # before: plain (the path was not resolved)
    run = ck.start_run("linked", drive=link, local_dir=tmp_path / "local", save_every=5, quiet=True, gauges=False)
    assert run.durability == UNCONFIRMED
    run.train(tiny_trainer(run, max_steps=10))
    summary = run.finish(timeout=30)
    assert summary["in_cloud"] is False and summary["cloud_step"] is None
    assert not [e for e in read_events(run.drive_dir / "events.jsonl") if e["event"] == "cloud"]  # no claim


# -- finding 3: no upload rate is guessed ---------------------------------------------------------------------
@pytest.mark.slow
def test_finding_3_without_attributes_the_cloud_keeps_one_at_a_tenth_of_the_assumed_rate(tmp_path, emulated_drive):
    # ~2 MB checkpoints every ~1 s, Drive at 0.1 MB/s (20 s each), the old settle rule's numbers at their
    # shortest: settled 2 s + size at 1 MB/s (4 s) after written. Before: every uploaded checkpoint was
    # deleted once a newer one "settled", still queued behind it, and the cloud held none for good.
    drive = emulated_drive(rate=1e5, attrs=False)
    job = harness.Job(tmp_path, steps=400, save_every=5, step_sleep=0.15, drive_root=drive.mountpoint,
                      extra=["--vocab", "5000", "--keep", "1", "--settle", "2s", "--assumed-rate", "1MB/s"])
    proc = job.start()
    # Watched every 0.25 s from the start until 15 s after the first checkpoint was complete in the cloud
    # (~20 s into the job on a quiet machine; up to 90 s are allowed for a busy one).
    seen = []
    deadline = time.monotonic() + 90
    while proc.poll() is None and time.monotonic() < deadline:
        steps = {s for s, p in list_checkpoints(drive.cloud / job.name / "checkpoints") if verify_folder(p) is None}
        seen.append(bool(steps))
        if seen.count(True) == 1:
            deadline = min(deadline, time.monotonic() + 15)
        time.sleep(0.25)
    proc.kill()
    proc.communicate()
    assert True in seen, "no checkpoint reached the cloud in 90 s: the test's rates are off"
    first = seen.index(True)
    assert all(seen[first:]), "the cloud held no valid checkpoint for a moment, after one was complete"
    kept = [e for e in job.local_events() if e["event"] == "prune"]
    assert all(e["witness"] < min(e["steps"]) for e in kept)  # every deletion vouched for by an older one


# -- finding 6: one short listing decides nothing --------------------------------------------------------------
def test_finding_6_a_checkpoint_hidden_from_listings_for_half_a_second_is_resumed(drive, local, monkeypatch):
    trained(drive, local, steps=30)
    listing = storage.list_dir
    until = time.monotonic() + 0.5

    def hidden_for_a_moment(path):
        entries = listing(path)
        if time.monotonic() < until:
            entries = [e for e in entries if e.name != "checkpoint-30"]
        return entries

    monkeypatch.setattr(storage, "list_dir", hidden_for_a_moment)
    run = ck.start_run("t", drive=drive, local_dir=local / "new-vm", quiet=True, gauges=False)
    assert run.resume_manifest.step == 30  # before: 20 (three listings back to back, all within 0.5 s)
    run.finish(timeout=10)


def test_finding_6_one_empty_listing_never_means_nothing_to_archive(drive, local, monkeypatch):
    run_dir = trained(drive, local, steps=30)
    listing = storage.list_dir
    left = {"n": 1}

    def empty_once(path):
        if Path(path).name == "checkpoints" and left["n"]:
            left["n"] -= 1
            return []
        return listing(path)

    monkeypatch.setattr(storage, "list_dir", empty_once)
    fresh = ck.start_run("t", drive=drive, local_dir=local / "fresh", resume=False, quiet=True, gauges=False)
    assert fresh.resume_from is None
    assert not list_checkpoints(run_dir / "checkpoints")  # the old run's checkpoints went to the archive
    archived = [p for p in (run_dir / "archive").iterdir()]
    assert len(archived) == 1 and {s for s, _ in list_checkpoints(archived[0])} == {10, 20, 30}
    fresh.finish(timeout=10)


# -- finding 7: attributes that could not be read at the start do not decide the whole run -------------------------
def test_finding_7_attributes_unreadable_at_the_start_are_asked_again(emulated_drive, tmp_path, monkeypatch):
    from colab_kit.drive import worker

    monkeypatch.setattr(worker, "REPROBE_S", 0.3)
    drive = emulated_drive(rate=20e6)  # DriveFS's attributes answer
    left = once(monkeypatch, "getxattr", "", OSError(errno.EIO, "Input/output error"), times=4)
    run = ck.start_run("t", drive=drive.mountpoint, local_dir=tmp_path / "local", save_every=5, quiet=True,
                       gauges=False)
    assert left["n"] == 0 and run.durability == UNCONFIRMED  # every read at the start failed
    run.train(tiny_trainer(run, max_steps=10))
    summary = run.finish(timeout=30)
    assert run.durability == "drivefs" and summary["in_cloud"] is True  # before: unconfirmed to the end
    assert any(e["event"] == "cloud" for e in read_events(run.drive_dir / "events.jsonl"))


# -- issue 38, finding 3: "is anything here" is decided by looks spaced in time, the listing and the journal together
def test_a_busy_mount_showing_no_checkpoints_and_no_journal_for_2_s_resumes_instead_of_starting_fresh(
        drive, local, monkeypatch):
    from colab_kit.checkpoints import looks

    run_dir = trained(drive, local, steps=30)  # checkpoints 10, 20 and 30, whole
    monkeypatch.setattr(looks, "WAITS", (1.0, 2.0, 3.0))  # the kit's own spacing: the mount is busy for 2 s
    list_dir, stat, read_bytes = storage.list_dir, storage.stat, storage.read_bytes
    busy_until = time.monotonic() + 2.0

    def busy(path) -> bool:
        return time.monotonic() < busy_until and Path(path).parent == run_dir

    def listing(path, *args, **kwargs):
        return [] if busy(path) and Path(path).name == "checkpoints" else list_dir(path, *args, **kwargs)

    def hiding(original):
        def read(path, *args, **kwargs):
            if busy(path) and Path(path).name == "events.jsonl":
                raise enoent(str(path))
            return original(path, *args, **kwargs)
        return read

    monkeypatch.setattr(storage, "list_dir", listing)
    monkeypatch.setattr(storage, "stat", hiding(stat))
    monkeypatch.setattr(storage, "read_bytes", hiding(read_bytes))
    run = ck.start_run("t", drive=drive, local_dir=local / "new-vm", quiet=True, gauges=False)
    assert run.resume_manifest is not None and run.resume_manifest.step == 30  # before: a fresh start over 30
    run.finish(timeout=10)
    assert time.monotonic() >= busy_until  # the looks outlasted the busy moment
