"""Fresh proof for every deletion and overwrite (issue 27, findings 4, 5, 7, 8, 9 and 10): leases written only
while held, API ids that belong to one folder, a 403 that costs time, bounded local copies, edges that keep
their deadlines, and no false word. Each test fails on f65fb4d."""

import errno
import json
import os
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest

import colab_kit as ck
from colab_kit._notices import Notices
from colab_kit.checkpoints import storage
from colab_kit.checkpoints.journal import Journal, read_events
from colab_kit.checkpoints.snapshot import SNAPSHOTS, take_snapshot
from colab_kit.drive.drivefs import DRIVEFS
from colab_kit.drive.lease import LEASE, Lease, LeaseInfo, read_lease
from colab_kit.drive.mirror import Mirror
from colab_kit.errors import LeaseHeldError
from colab_kit.tasks.demo import tiny_trainer


def foreign_lease(folder: Path, *, heartbeat_s: float = 1.0) -> LeaseInfo:
    info = LeaseInfo(host="other-vm", pid=4242, pid_start=None, session="theirs", started=time.time(),
                     heartbeat=time.time(), heartbeat_s=heartbeat_s)
    (folder / LEASE).write_text(json.dumps(asdict(info)))
    return info


def fail_reads_of(monkeypatch, name: str, exc_factory, times: int):
    read = storage.read_bytes
    left = {"n": times}

    def faulty(path, *args, **kwargs):
        if Path(path).name == name and left["n"]:
            left["n"] -= 1
            raise exc_factory(path)
        return read(path, *args, **kwargs)

    monkeypatch.setattr(storage, "read_bytes", faulty)
    return left


# -- finding 4: a lease is written only while it is held --------------------------------------------------
def test_finding_4_a_heartbeat_never_writes_over_a_lease_it_could_not_read(drive, monkeypatch):
    mine = Lease(drive, heartbeat_s=30)
    mine.acquire()
    foreign_lease(drive)  # another runtime took the run over
    fail_reads_of(monkeypatch, LEASE, lambda p: OSError(errno.EIO, "Input/output error", str(p)), times=1)
    assert mine.beat() is None  # unknown: not renewed
    assert read_lease(drive).session == "theirs"  # before: the old runtime's lease was written over theirs
    assert mine.beat() is False and mine.lost


def test_finding_4_a_lease_missing_at_one_look_is_watched_before_it_is_taken(drive, monkeypatch):
    info = foreign_lease(drive, heartbeat_s=1.0)
    (drive / "events.jsonl").write_text("{}\n")  # a run folder in use
    stop = threading.Event()

    def beat():  # the other runtime lives
        while not stop.wait(0.2):
            info.heartbeat = time.time()
            storage.atomic_write_json(drive / LEASE, asdict(info))

    beater = threading.Thread(target=beat)
    beater.start()
    fail_reads_of(monkeypatch, LEASE, lambda p: FileNotFoundError(errno.ENOENT, "No such file", str(p)), times=1)
    try:
        with pytest.raises(LeaseHeldError, match="advanced while this runtime watched it"):
            Lease(drive).acquire(run_name="t")  # before: "no lease", written over theirs at once
    finally:
        stop.set()
        beater.join()
    assert read_lease(drive).session == "theirs"


# -- finding 8: local copies are bounded while confirmations stall --------------------------------------------
def test_finding_8_local_copies_stay_bounded_when_drive_never_confirms(drive, local):
    notices = Notices()
    # DriveFS's kind, on a folder that never shows an upload done: confirmations never come.
    mirror = Mirror(drive, keep=1, journal=Journal(drive / "events.jsonl"), notices=notices, kind=DRIVEFS,
                    backoff=(0.02, 0.1))
    mirror.publisher.may_write_next = lambda now, pace: True  # no waiting for the one in flight
    try:
        for step in range(10, 70, 10):
            folder = local / f"checkpoint-{step}"
            folder.mkdir(parents=True)
            (folder / "model.safetensors").write_bytes(os.urandom(50_000))
            mirror.submit(take_snapshot(folder, local / SNAPSHOTS, step))
            assert mirror.drain(10)
        snapshots = [p for p in (local / SNAPSHOTS).iterdir() if p.is_dir()]
        assert len(snapshots) <= 2, sorted(p.name for p in snapshots)  # before: one per checkpoint, forever
        said = notices.show()
        assert said >= 1
    finally:
        mirror.close()
    assert any(e.get("what") == "kept_copies_bounded" for e in read_events(drive / "events.jsonl"))


# -- finding 9: the edges keep their deadlines -------------------------------------------------------------------
def stall_drive(monkeypatch, drive: Path, ops, seconds: float) -> threading.Event:
    """Hold the named storage operations on paths under `drive` for `seconds` (or until the event is set)."""
    released = threading.Event()
    for op in ops:
        original = getattr(storage, op)

        def held(*args, _original=original, **kwargs):
            if any(isinstance(a, (str, os.PathLike)) and Path(drive) in [Path(a), *Path(a).parents] for a in args):
                released.wait(seconds)
            return _original(*args, **kwargs)

        monkeypatch.setattr(storage, op, held)
    return released


def test_finding_9_finish_keeps_its_timeout_on_a_stalled_drive(drive, local, monkeypatch):
    run = ck.start_run("t", drive=drive, local_dir=local, save_every=10, quiet=True, gauges=False)
    run.train(tiny_trainer(run, max_steps=10))
    released = stall_drive(monkeypatch, drive, ["read_bytes", "append_line", "atomic_write_bytes", "stat",
                                                "getxattr", "list_dir"], 12.0)
    started = time.monotonic()
    run.finish(timeout=2)
    took = time.monotonic() - started
    released.set()
    assert took < 4.0, took  # before: 12 s (poll, journal flush and lease release on the caller's thread)


def test_finding_9_a_stores_first_save_never_waits_on_drive(drive, local, monkeypatch):
    import torch

    store = ck.CheckpointStore(drive, keep=2, local_dir=local)
    model = torch.nn.Linear(4, 2)
    released = stall_drive(monkeypatch, drive, ["list_dir", "read_bytes", "stat"], 8.0)
    started = time.monotonic()
    store.save(1, model=model)
    took = time.monotonic() - started
    released.set()
    store.close(timeout=30)
    assert took < 2.0, took  # before: 8 s and more (the folder was listed on the caller's thread)


def test_finding_9_the_learned_micro_batch_is_read_without_waiting_on_drive(drive, monkeypatch):
    from colab_kit.memory.learned import MicroBatchMemory

    (drive / "micro_batch.json").write_text(json.dumps({"entries": []}))
    released = stall_drive(monkeypatch, drive, ["read_bytes"], 8.0)
    started = time.monotonic()
    MicroBatchMemory(drive / "micro_batch.json")
    took = time.monotonic() - started
    released.set()
    assert took < 4.0, took


def test_finding_9_nothing_is_written_after_the_lease_is_lost(drive, local):
    run = ck.start_run("t", drive=drive, local_dir=local, save_every=10, quiet=True, gauges=False)
    foreign_lease(run.drive_dir)  # another runtime took over
    assert run.mirror._lease_ok() is False and run.mirror.paused
    run.mirror.write_later(run.drive_dir / "micro_batch.json", {"entries": []})
    run.finish(timeout=5)
    assert not (run.drive_dir / "micro_batch.json").exists()  # before: written on the caller's thread
    assert read_lease(run.drive_dir).session == "theirs"


# -- finding 10: no false word ----------------------------------------------------------------------------------------
def test_finding_10_a_plain_folder_is_not_the_cloud(drive, local, capsys):
    run = ck.start_run("t", drive=drive, local_dir=local, save_every=10, quiet=True, gauges=False)
    run.train(tiny_trainer(run, max_steps=10))
    assert "in the cloud" not in run.mirror.tracker.describe()  # the gauges' line
    summary = run.finish(timeout=10)
    assert summary["in_cloud"] is None  # before: True, on a folder with no cloud
    assert "in the cloud" not in capsys.readouterr().out


def test_finding_10_finish_after_a_lost_lease_never_says_everything_is_in_the_cloud(drive, local, capsys):
    run = ck.start_run("t", drive=drive, local_dir=local, save_every=5, quiet=True, gauges=False)
    run.mirror.publisher.may_write_next = lambda now, pace: False  # saves wait in the queue
    tiny_trainer(run, max_steps=10, callbacks=run.callbacks()).train()
    foreign_lease(run.drive_dir)
    assert run.lease.step(run._lease_lost) is False  # the heartbeat finds another runtime's lease: queue dropped
    summary = run.finish(timeout=5)
    out = capsys.readouterr().out
    assert "everything is in the cloud" not in out and "another runtime took over" in out
    assert summary["in_cloud"] in (False, None)


def test_finding_10_a_settle_age_of_zero_or_less_is_refused(drive):
    for settle in (0, -5, "0s"):
        with pytest.raises(ValueError, match="settle"):
            ck.start_run("t", drive=drive, settle=settle, quiet=True, gauges=False)


def test_finding_10_an_unreadable_best_checkpoint_is_said_so_and_stays_protected(drive, local, drive_faults, capsys):
    from made import make_checkpoint

    from colab_kit.checkpoints.manifest import Manifest, hash_folder, write_manifest

    checkpoints = drive / "t" / "checkpoints"
    for step in (10, 20, 30):
        folder = make_checkpoint(checkpoints, step, manifest=False)
        (folder / "trainer_state.json").write_text(json.dumps({"best_model_checkpoint": "/old-vm/checkpoint-10"}))
        write_manifest(folder, Manifest(step=step, files=hash_folder(folder)))
    drive_faults.fail(errno.EIO, ops=["copy_file", "sha256_file", "file_digests"], match="checkpoint-10")
    run = ck.start_run("t", drive=drive, local_dir=local, keep=1, quiet=True, gauges=False)
    said = capsys.readouterr().err
    assert run.resume_manifest.step == 30 and run.resume_best is None
    assert "checkpoint-10, could not be read now" in said and "is not in" not in said  # before: "not in ... any more"
    drive_faults.heal()
    run.mirror.best_step = None  # the Trainer's state dropped the best path it could not find (its on_save says so)
    run.mirror.adopt_existing()
    assert run.mirror.drain(10)
    time.sleep(0.2)
    steps = {int(p.name.split("-")[1]) for p in checkpoints.iterdir()}
    assert steps == {10, 30}  # keep=1, and 10 stays: the best, never let go for not being read (before: deleted)
    run.finish(timeout=10)
