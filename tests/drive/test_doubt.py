"""Doubt never deletes (issue 20): a read of the persistent folder that fails is unknown. It costs time
(retried, reported), never a deletion, a takeover, a fresh start over existing checkpoints or a claim.

One test per finding of the issue, each with the fault injected on one named operation (`drive_faults`,
the storage seam); the retention findings (1, 2, 4, 10) have unit tests in test_retention.py too.
"""

import errno
import json
import os
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest

import colab_kit as ck
from colab_kit._notices import Notices
from colab_kit.checkpoints import storage
from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.journal import Journal, read_events
from colab_kit.checkpoints.manifest import MANIFEST, read_manifest
from colab_kit.checkpoints.snapshot import SNAPSHOTS, take_snapshot
from colab_kit.checkpoints.validity import verify_folder
from colab_kit.drive import upkeep
from colab_kit.drive.cloud import upload_for
from colab_kit.drive.drivefs import DRIVEFS
from colab_kit.drive.lease import LEASE, Lease, LeaseInfo, read_lease
from colab_kit.drive.mirror import Mirror
from colab_kit.errors import LeaseHeldError
from colab_kit.lifecycle.registry import unregister
from colab_kit.tasks.demo import tiny_trainer


def train_run(drive, local, name="t", steps=30, **kw):
    """A finished run with checkpoints every 10 steps on `drive`."""
    run = ck.start_run(name, drive=drive, local_dir=local / name, save_every=10, quiet=True, gauges=False, **kw)
    run.train(tiny_trainer(run, max_steps=steps))
    run.finish(timeout=30)
    return run.drive_dir


def corrupt(folder: Path) -> None:
    model = folder / "model.safetensors"
    model.write_bytes(bytes(b ^ 0xFF for b in model.read_bytes()[:64]) + model.read_bytes()[64:])


def test_2_resume_and_pruning_agree_a_skipped_checkpoint_is_neither_valid_nor_counted(drive, local):
    run_dir = train_run(drive, local, keep=3)
    corrupt(run_dir / "checkpoints" / "checkpoint-30")  # same size, other bytes
    run = ck.start_run("t", drive=drive, local_dir=local / "t2", keep=1, quiet=True, gauges=False)
    assert run.resume_manifest.step == 20  # 30 does not verify
    run.mirror.drain(10)
    time.sleep(0.3)  # a pruning pass (keep=1) has run in the mirror's thread
    assert run.status()["cloud_step"] == 20
    steps = [s for s, _ in list_checkpoints(run_dir / "checkpoints")]
    assert 20 in steps and verify_folder(run_dir / "checkpoints" / "checkpoint-20") is None  # before: deleted
    run.finish(timeout=10)


def test_2_one_failed_fetch_costs_a_retry_and_a_lasting_one_keeps_everything(drive, local, drive_faults):
    run_dir = train_run(drive, local, keep=3)
    drive_faults.fail(errno.EIO, ops=["copy_file"], match="checkpoint-30", times=1)  # transient
    run = ck.start_run("t", drive=drive, local_dir=local / "once", keep=3, quiet=True, gauges=False)
    assert run.resume_manifest.step == 30  # read again, not skipped
    run.finish(timeout=10)
    drive_faults.fail(errno.EIO, ops=["copy_file", "sha256_file"], match="checkpoint-30")  # lasting
    # 30 reached the cloud (the journal says so): it is never passed over for an older one because of a fault
    with pytest.raises(ck.DriveError, match=r"checkpoint-30 .*was written there.*no older checkpoint was taken"):
        ck.start_run("t", drive=drive, local_dir=local / "lasting", keep=1, quiet=True, gauges=False)
    # ... unless the user says so: the newest that can be read, said out loud
    run = ck.start_run("t", drive=drive, local_dir=local / "lasting", keep=1, quiet=True, gauges=False,
                       resume="readable")
    assert run.resume_manifest.step == 20
    assert any(e.get("what") == "unreadable_checkpoint" for e in read_events(local / "lasting" / "events.jsonl"))
    run.mirror.drain(10)
    time.sleep(0.3)
    assert {20, 30} <= {s for s, _ in list_checkpoints(run_dir / "checkpoints")}  # keep=1, yet 20 and 30 stay
    drive_faults.heal()
    run.finish(timeout=10)


@pytest.mark.parametrize("fault", [errno.EIO, errno.ENOSPC])
def test_3_checkpoints_that_cannot_be_read_never_mean_a_fresh_start(drive, local, drive_faults, fault):
    run_dir = train_run(drive, local)
    # EIO: Drive cannot be read. ENOSPC: the copy back fails because the local disk is full.
    drive_faults.fail(fault, ops=["copy_file"])
    with pytest.raises(ck.DriveError) as raised:
        ck.start_run("t", drive=drive, local_dir=local / "new-vm", quiet=True, gauges=False)
    said = str(raised.value)
    assert "checkpoint-30" in said and "nothing was started, moved or deleted" in said and "resume=False" in said
    assert "resume='readable'" in said  # it reached the cloud: an older one is taken only when asked for
    assert ("disk is full" in said) == (fault == errno.ENOSPC)
    drive_faults.heal()
    assert read_lease(run_dir).released  # the lease was let go, not kept by the failed start
    assert [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [30, 20, 10]
    run = ck.start_run("t", drive=drive, local_dir=local / "new-vm", quiet=True, gauges=False)
    assert run.resume_manifest.step == 30
    run.finish(timeout=10)
    fresh = ck.start_run("t", drive=drive, local_dir=local / "fresh", resume=False, quiet=True, gauges=False)
    assert fresh.resume_from is None and list((run_dir / "archive").iterdir())  # moved aside, not deleted
    fresh.finish(timeout=10)


def _foreign_lease(drive, **fields) -> LeaseInfo:
    info = LeaseInfo(host="other-vm", pid=4242, pid_start=None, session="theirs", started=time.time(),
                     heartbeat=time.time(), heartbeat_s=1.0, **fields)
    (drive / LEASE).write_text(json.dumps(asdict(info)))
    return info


def test_5_a_lease_that_cannot_be_read_is_never_taken_over(drive, drive_faults):
    _foreign_lease(drive)
    drive_faults.fail(errno.EIO, ops=["read_bytes"], match=LEASE)  # every read fails
    with pytest.raises(LeaseHeldError, match="cannot read the lease .* nothing was taken over"):
        Lease(drive).acquire(run_name="t")
    drive_faults.heal()
    assert read_lease(drive).session == "theirs"

    # One failed read, then a live heartbeat: refused, not "released while this runtime watched it".
    info = _foreign_lease(drive)
    stop = threading.Event()

    def beat():
        while not stop.wait(0.3):
            info.heartbeat = time.time()
            storage.atomic_write_json(drive / LEASE, asdict(info))

    beater = threading.Thread(target=beat)
    beater.start()
    drive_faults.fail(errno.EIO, ops=["read_bytes"], match=LEASE, times=2)
    try:
        with pytest.raises(LeaseHeldError, match="advanced while this runtime watched it"):
            Lease(drive).acquire(run_name="t")
    finally:
        stop.set()
        beater.join()
    assert read_lease(drive).session == "theirs"

    # A dead runtime's lease, read successfully twice with the same heartbeat: taken over.
    _foreign_lease(drive)
    drive_faults.fail(errno.EIO, ops=["read_bytes"], match=LEASE, times=3)  # doubt costs time only
    lease = Lease(drive)
    assert lease.acquire(run_name="t").host == "other-vm" and "did not advance" in lease.took_over_because


def test_6_a_newer_complete_local_checkpoint_is_resumed_not_deleted(drive, local, monkeypatch):
    # A kernel restart on the same VM (host RAM ran out) while checkpoint-40 waited behind an upload:
    # the Trainer had finished saving it, the kit had not hashed it yet.
    run = ck.start_run("t", drive=drive, local_dir=local / "t", save_every=10, quiet=True, gauges=False)
    gate = threading.Event()
    copy = storage.copy_file

    def held(src, dst):
        if "checkpoint-30" in str(dst):
            gate.wait(30)  # 30's upload hangs: 40 waits in the queue
        return copy(src, dst)

    monkeypatch.setattr(storage, "copy_file", held)
    trainer = tiny_trainer(run, max_steps=40)
    training = threading.Thread(target=lambda: run.train(trainer), daemon=True)
    training.start()
    deadline = time.monotonic() + 60
    while not (local / "t" / SNAPSHOTS / "checkpoint-40.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (local / "t" / "checkpoint-40").is_dir() and not (local / "t" / "checkpoint-40" / MANIFEST).exists()
    # The kernel dies here: nothing of this process goes on (its threads stop where they are, queue and
    # all; its run is forgotten).
    with run.mirror._cond:
        run.mirror._paused = True
        run.mirror._cond.notify_all()
    run.lease._stop.set()
    training.join(30)
    unregister(run)
    gate.set()
    monkeypatch.setattr(storage, "copy_file", copy)
    again = ck.start_run("t", drive=drive, local_dir=local / "t", save_every=10, quiet=True, gauges=False)
    assert again.resume_manifest.step == 40 and again.resume_from == local / "t" / "checkpoint-40"
    assert again.mirror.drain(30)
    assert verify_folder(again.drive_dir / "checkpoints" / "checkpoint-40") is None  # and now uploaded
    again.finish(timeout=10)


def mirror_writing_checkpoint_10(drive, local, files: dict[str, int]):
    """A mirror on `drive` (a DriveFS folder) given checkpoint-10 of random `files` (name -> size) to write;
    returns it and the checkpoint's folder there."""
    mirror = Mirror(drive, keep=2, journal=Journal(drive / "events.jsonl"), notices=Notices(), kind=DRIVEFS,
                    backoff=(0.02, 0.1))
    folder = local / "checkpoint-10"
    folder.mkdir(parents=True)
    for name, size in files.items():
        (folder / name).write_bytes(os.urandom(size))
    mirror.submit(take_snapshot(folder, local / SNAPSHOTS, 10))
    return mirror, drive / "checkpoints" / "checkpoint-10"


def test_7_an_upload_missing_for_a_moment_stays_pending_and_one_lost_is_uploaded_again(
        drive, local, monkeypatch):
    monkeypatch.setattr(upkeep, "MISSING_GRACE_S", 0.3)
    mirror, target = mirror_writing_checkpoint_10(drive, local, {"model.safetensors": 20_000})
    try:
        assert mirror.drain(10)
        (target / "model.safetensors").unlink()  # Drive lost it (or hides it): the poll cannot find it
        mirror.wake()
        deadline = time.monotonic() + 10
        while not (target / "model.safetensors").exists() and time.monotonic() < deadline:
            mirror.tracker.get("checkpoint-10").next_poll = 0
            mirror.wake()
            time.sleep(0.05)
        assert mirror.tracker.pending() and mirror.tracker.pending()[0].label == "checkpoint-10"  # not forgotten
        assert verify_folder(target) is None  # uploaded again from the kept local copy
        while not mirror.kept.reuploads and time.monotonic() < deadline:  # the worker journals it next
            time.sleep(0.02)
        assert mirror.drain(10)  # and its line is flushed before the journal is read
        assert any(e.get("what") == "reuploaded" for e in read_events(drive / "events.jsonl"))
        assert not mirror.tracker.all_in_cloud()  # finish() cannot say "everything is in the cloud"
    finally:
        mirror.close()


def test_8_a_folder_under_content_drive_without_a_mount_is_refused(tmp_path, monkeypatch, fake_colab):
    import colab_kit.drive.mount as mount

    monkeypatch.setattr(mount, "COLAB_MOUNT", str(tmp_path / "content" / "drive"))
    root = tmp_path / "content" / "drive" / "MyDrive" / "runs"
    with pytest.raises(ck.DriveError, match=r"not mounted there.*drive\.mount.*outside"):
        ck.start_run("t", drive=root, local_dir=tmp_path / "local", quiet=True)
    assert not (tmp_path / "content").exists()  # nothing made on the VM's disk under the mount point
    fake_colab.drive.mount(str(tmp_path / "content" / "drive"))  # mounted: now it is Google Drive
    run = ck.start_run("t", drive=root, local_dir=tmp_path / "local", quiet=True, gauges=False)
    assert run.on_drive  # remounts after errno 107 and finish(flush=True) apply
    run.finish(timeout=10)


def test_9_the_training_thread_never_waits_on_a_stalled_drive(drive, local, monkeypatch):
    from colab_kit.gauges.monitor import History, Sampler
    from colab_kit.memory.learned import MicroBatchMemory

    stalled = threading.Event()
    append, write = storage.append_line, storage.atomic_write_bytes

    def stall_on_drive(function):
        def held(path, *args):
            if drive in Path(path).parents:
                stalled.wait(30)
            return function(path, *args)
        return held

    monkeypatch.setattr(storage, "append_line", stall_on_drive(append))
    monkeypatch.setattr(storage, "atomic_write_bytes", stall_on_drive(write))
    journal = Journal(drive / "events.jsonl", local_copy=local / "events.jsonl")
    mirror = Mirror(drive, keep=2, journal=journal, notices=Notices())
    try:
        started = time.perf_counter()
        for i in range(20):  # the training loop journals while the mirror's thread is stuck in Drive
            journal.write("save", step=i)
        memory = MicroBatchMemory(drive / "micro_batch.json", write=mirror.write_later)
        memory.record("T4", "abc", 128, 8)
        assert time.perf_counter() - started < 0.5
        assert len(read_events(local / "events.jsonl")) == 20  # the local copy has every line already
        stalled.set()
        assert mirror.drain(10)
        assert [e["step"] for e in read_events(drive / "events.jsonl")] == list(range(20))  # in order
        assert json.loads((drive / "micro_batch.json").read_text())["entries"][0]["micro_batch"] == 8
    finally:
        stalled.set()
        mirror.close()

    # The gauges' sampler reads Drive's free space; on a stalled mount stop() still returns.
    hang = threading.Event()
    monkeypatch.setattr("colab_kit.gauges.monitor.read_disk", lambda *a: hang.wait(30))
    sampler = Sampler(History(), interval=0.05, disk_paths=(local, drive), disk_every=0.0)
    sampler.start()
    time.sleep(0.2)
    started = time.monotonic()
    sampler.stop(timeout=1.0)
    assert time.monotonic() - started < 2.5
    hang.set()


def test_10_a_writer_that_lost_its_lease_writes_and_deletes_nothing(drive, local):
    lease = Lease(drive, heartbeat_s=30)
    lease.acquire()
    journal = Journal(drive / "events.jsonl")
    lost = []
    mirror = Mirror(drive, keep=1, journal=journal, notices=Notices(), lease=lease, backoff=(0.02, 0.1),
                    on_lease_lost=lambda: lost.append(True))
    try:
        new_writers = drive / "checkpoints" / "checkpoint-50"  # the new writer's upload in progress
        new_writers.mkdir(parents=True)
        (new_writers / "model.safetensors").write_bytes(b"half")
        _foreign_lease(drive)  # another runtime took over
        folder = local / "checkpoint-60"
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(os.urandom(1000))
        mirror.submit(take_snapshot(folder, local / SNAPSHOTS, 60))
        deadline = time.monotonic() + 5
        while not mirror.paused and time.monotonic() < deadline:
            time.sleep(0.02)
        assert mirror.paused and lost
        assert not (drive / "checkpoints" / "checkpoint-60").exists()  # nothing published after the loss
        assert (new_writers / "model.safetensors").read_bytes() == b"half"  # and nothing of theirs deleted
    finally:
        mirror.close()


def test_4_a_failed_manifest_read_in_a_pass_keeps_the_newest_in_the_cloud(drive, local, drive_faults):
    # The mirror-level form of the retention unit test: keep=2, confirmed {10, 20, 30} (a plain folder
    # confirms on write), one EIO on checkpoint-30's manifest during a pass.
    run_dir = train_run(drive, local, keep=3)
    run = ck.start_run("t", drive=drive, local_dir=local / "t", keep=2, quiet=True, gauges=False)
    drive_faults.fail(errno.EIO, ops=["read_bytes"], match="checkpoint-30/MANIFEST", times=2)
    run.mirror.adopt_existing()
    run.mirror.drain(10)
    time.sleep(0.3)
    assert 30 in {s for s, _ in list_checkpoints(run_dir / "checkpoints")}
    run.finish(timeout=10)


def test_an_upload_for_helper_keeps_what_reupload_needs(tmp_path):
    folder = tmp_path / "checkpoint-1"
    folder.mkdir()
    (folder / "a.bin").write_bytes(b"x")
    from colab_kit.checkpoints.manifest import Manifest, hash_folder, write_manifest

    write_manifest(folder, Manifest(step=1, files=hash_folder(folder)))
    upload = upload_for(folder, read_manifest(folder), "checkpoint-1", source=tmp_path / "snap")
    assert upload.manifest.step == 1 and upload.source == tmp_path / "snap" and upload.verified


def test_9_an_upload_again_never_writes_into_another_runtimes_checkpoint_of_the_same_step(
        drive, local, monkeypatch):
    """Issue 46, path 9: this VM's checkpoint-10 went missing from Drive and the run was taken over meanwhile (this
    VM's view of the lease is late): the new owner's checkpoint-10 is there now. Uploading again from the kept
    local copy (the optimizer file theirs lacks is "missing") must read the folder now and leave another checkpoint alone (before: our files written into it,
    after one look at the lease, so that the new owner's checkpoint no longer verified)."""
    from colab_kit.checkpoints.checkpoint import publish_folder
    from colab_kit.checkpoints.manifest import Manifest, hash_folder

    monkeypatch.setattr(upkeep, "MISSING_GRACE_S", 0.3)
    mirror, target = mirror_writing_checkpoint_10(drive, local, {"model.safetensors": 20_000, "optimizer.pt": 5_000})
    try:
        assert mirror.drain(10)
        shutil.rmtree(target)  # lost from Drive; then the new owner's own checkpoint of the same step
        theirs = local / "theirs"
        theirs.mkdir()
        (theirs / "model.safetensors").write_bytes(os.urandom(20_000))  # the same model's size; no optimizer
        publish_folder(theirs, target, Manifest(step=10, files=hash_folder(theirs)))
        expected = read_manifest(target)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and mirror.tracker.get("checkpoint-10") is not None:
            mirror.tracker.get("checkpoint-10").next_poll = 0
            mirror.wake()
            time.sleep(0.05)
        assert read_manifest(target) == expected and verify_folder(target) is None  # theirs, untouched
        assert mirror.kept.reuploads == 0
        assert mirror.tracker.get("checkpoint-10") is None  # no longer followed: not this runtime's
        assert mirror.drain(10)
        assert any(e.get("what") == "not_ours_now" for e in read_events(drive / "events.jsonl"))
    finally:
        mirror.close()


def test_10_a_same_step_folder_that_stays_unreadable_is_said_with_what_helps(drive, local, drive_faults, capsys):
    """Issue 46, path 10: another save's checkpoint-10 sits in the run folder and its model file cannot be read.
    The publisher retries (it never deletes what it cannot read), and finish says so; before, its advice was
    "call run.finish() again to keep waiting", which cannot help, and the open run's summary said status
    'finished' beside synced False."""
    from transformers import TrainerCallback

    from colab_kit.checkpoints.checkpoint import publish_folder
    from colab_kit.checkpoints.manifest import Manifest, hash_folder

    run = ck.start_run("t", drive=drive, local_dir=local / "t", save_every=10, quiet=True, gauges=False)
    run.mirror.backoff = (0.01, 0.05)
    target = run.drive_dir / "checkpoints" / "checkpoint-10"

    class AnotherSave(TrainerCallback):  # written by another save of this step while this one trains
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                theirs = local / "theirs"
                theirs.mkdir()
                (theirs / "model.safetensors").write_bytes(os.urandom(20_000))
                publish_folder(theirs, target, Manifest(step=10, files=hash_folder(theirs)))
                drive_faults.fail(errno.EIO, ops="reads", match="checkpoint-10/model")

    trainer = tiny_trainer(run, max_steps=10, callbacks=[*run.callbacks(), AnotherSave()])
    trainer.train()
    summary = run.finish(timeout=2)
    said = capsys.readouterr().err
    assert summary["status"] == "unsynced" and summary["synced"] is False, summary
    assert "NOT YET ON DRIVE" in said and f"{target}" in said and "delete checkpoint-10 in Drive by hand" in said, said
    assert read_manifest(target).files["model.safetensors"].size == 20_000  # theirs: nothing deleted or written
    drive_faults.heal()  # Drive answers again: the gate can judge it now (a whole checkpoint of the step stays)
    summary = run.finish(timeout=30)
    assert summary["status"] != "unsynced" and run.mirror.publisher.blocked_by is None, summary


def test_10_an_invalid_checkpoint_never_holds_the_mirrors_thread(drive, local, monkeypatch):
    """Issue 46, path 10: a recycled runtime's checkpoint (its manifest, not its model file), where nothing
    confirms uploads. Each pass waited out the spaced looks at it (absence is not evidence) on the mirror's
    thread: 11 s a pass, and with saves 0.8 s apart the mirror wrote 3 of 12 to the run folder. The looks are
    now one a pass, spread over the passes: every save reaches the folder, and the invalid one still goes only
    once two spaced series of looks, ABSENT_FOR_S apart, found the file missing."""
    from colab_kit.checkpoints import looks
    from colab_kit.checkpoints.checkpoint import publish_folder
    from colab_kit.checkpoints.manifest import Manifest, hash_folder
    from colab_kit.drive import evidence
    from colab_kit.drive.drivefs import UNCONFIRMED

    monkeypatch.setattr(looks, "WAITS", (1.0, 2.0, 3.0))  # the kit's own spacing: what held the thread
    monkeypatch.setattr(evidence, "ABSENT_FOR_S", 4.0)
    recycled = local / "recycled"
    recycled.mkdir()
    (recycled / "model.safetensors").write_bytes(os.urandom(5_000))
    target = drive / "checkpoints" / "checkpoint-1"
    publish_folder(recycled, target, Manifest(step=1, files=hash_folder(recycled)))
    (target / "model.safetensors").unlink()  # its upload died with its runtime
    os.utime(target / MANIFEST, (time.time() - 7200, time.time() - 7200))

    journal = Journal(drive / "events.jsonl")
    mirror = Mirror(drive, keep=2, journal=journal, notices=Notices(), kind=UNCONFIRMED, backoff=(0.02, 0.1))
    steps = list(range(10, 130, 10))
    started = time.time()
    try:
        for step in steps:  # saves 0.8 s apart
            folder = local / f"checkpoint-{step}"
            folder.mkdir()
            (folder / "model.safetensors").write_bytes(os.urandom(20_000))
            mirror.submit(take_snapshot(folder, local / SNAPSHOTS, step))
            time.sleep(0.8)
        assert mirror.drain(30)
        synced = [e["step"] for e in read_events(drive / "events.jsonl") if e["event"] == "sync"]
        assert len(synced) >= len(steps) - 1, synced  # before: 3 of 12 ([10, 80, 120]), each pass held the thread

        def pruned() -> list[dict]:
            return [e for e in read_events(drive / "events.jsonl") if e["event"] == "prune" and 1 in e["steps"]]

        deadline = time.monotonic() + 20  # the spaced looks go on without saves: passes are due for them
        while not pruned() and time.monotonic() < deadline:
            time.sleep(0.1)
        warned = [e for e in read_events(drive / "events.jsonl") if e.get("what") == "invalid_checkpoint"]
        assert pruned() and [e["step"] for e in warned] == [1]
        assert warned[0]["time"] - started >= 2 * looks.span() + evidence.ABSENT_FOR_S  # never sooner
        assert (target / MANIFEST).stat().st_size == 0  # emptied (Trash-free), unlinked after Drive's grace
    finally:
        mirror.close()
