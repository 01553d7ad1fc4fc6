"""The background mirror: order of writes, supersede, retries, errno 107."""

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from colab_kit._notices import Notices
from colab_kit.checkpoints import storage
from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.journal import Journal, read_events
from colab_kit.checkpoints.manifest import MANIFEST
from colab_kit.checkpoints.snapshot import take_snapshot
from colab_kit.checkpoints.validity import verify_folder
from colab_kit.drive.mirror import Mirror


def local_checkpoint(local: Path, step: int, size: int = 50_000) -> Path:
    folder = local / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(os.urandom(size))
    (folder / "optimizer.pt").write_bytes(os.urandom(size // 2))
    (folder / "trainer_state.json").write_text('{"global_step": %d}' % step)
    return folder


@pytest.fixture
def mirror(drive):
    notices = Notices()
    m = Mirror(drive, keep=2, journal=Journal(drive / "events.jsonl"), notices=notices, backoff=(0.02, 0.1))
    yield m
    m.close()


@pytest.fixture
def held_uploads(monkeypatch):
    """Copies to the persistent folder wait (at most 5 s) until the returned event is set."""
    gate = threading.Event()
    copy = storage.copy_file
    monkeypatch.setattr(storage, "copy_file", lambda s, d, *a: (gate.wait(5), copy(s, d, *a))[1])
    return gate


def submit(mirror, local, step, **kw):
    folder = local_checkpoint(local, step, **kw)
    mirror.submit(take_snapshot(folder, local / ".snapshots", step, {"model": "abc"}))
    return folder


def test_data_files_first_manifest_last_and_verified(mirror, drive, local, monkeypatch):
    order = []
    copy, write = storage.copy_file, storage.atomic_write_bytes
    def record(path):
        if drive in Path(path).parents:
            order.append(Path(path).name)

    monkeypatch.setattr(storage, "copy_file", lambda s, d, *a: (record(d), copy(s, d, *a))[1])
    monkeypatch.setattr(storage, "atomic_write_bytes", lambda p, b, *a, **k: (record(p), write(p, b, *a, **k))[1])
    source = submit(mirror, local, 10)
    assert mirror.drain(10)
    assert order[-1] == MANIFEST and set(order[:-1]) == {"model.safetensors", "optimizer.pt", "trainer_state.json"}
    target = drive / "checkpoints" / "checkpoint-10"
    assert verify_folder(target) is None
    assert verify_folder(source) is None  # a local manifest too, for a restart on the same VM
    assert not (local / ".snapshots" / "checkpoint-10").exists()  # the snapshot is cleaned up
    events = read_events(drive / "events.jsonl")
    assert [e["event"] for e in events] == ["sync", "cloud"]  # a plain folder: in the cloud once written
    sync, cloud = events
    assert sync["step"] == 10 and "durable" not in sync and sync["bytes"] > 75_000
    assert cloud["step"] == 10 and cloud["bytes"] == sync["bytes"] and cloud["seconds"] >= 0


def test_snapshot_survives_trainer_pruning_the_source(mirror, drive, local, held_uploads):
    gate = held_uploads
    import shutil

    source = submit(mirror, local, 10)
    # The Trainer's save_total_limit deletes it while the upload waits, as the Trainer does it
    # (ignore_errors: the mirror's thread may be writing the local MANIFEST.json into it meanwhile)
    shutil.rmtree(source, ignore_errors=True)
    gate.set()
    assert mirror.drain(10)
    assert verify_folder(drive / "checkpoints" / "checkpoint-10") is None


def test_newer_checkpoint_supersedes_the_queued_one(mirror, drive, local, held_uploads):
    gate = held_uploads
    submit(mirror, local, 10)
    time.sleep(0.1)  # 10 is in flight
    submit(mirror, local, 20)
    submit(mirror, local, 30)  # replaces 20 in the queue
    assert mirror.pending_steps == [10, 30]
    gate.set()
    assert mirror.drain(10)
    steps = [e["step"] for e in read_events(drive / "events.jsonl") if e["event"] == "sync"]
    assert steps == [10, 30]
    assert not (local / ".snapshots" / "checkpoint-20").exists()


def test_the_best_checkpoint_is_never_superseded_in_the_queue(mirror, drive, local, held_uploads):
    gate = held_uploads
    submit(mirror, local, 10)
    time.sleep(0.1)  # 10 is in flight
    mirror.best_step = 20
    submit(mirror, local, 20)
    submit(mirror, local, 30)  # would replace 20, but 20 is the best
    submit(mirror, local, 40)  # replaces 30
    assert mirror.pending_steps == [10, 20, 40]
    mirror.best_step = 50
    submit(mirror, local, 50)  # 20 is no longer the best: superseded like any other
    assert mirror.pending_steps == [10, 50]
    gate.set()
    assert mirror.drain(10)
    steps = [e["step"] for e in read_events(drive / "events.jsonl") if e["event"] == "sync"]
    assert steps == [10, 50]


def test_a_failing_best_upload_does_not_hold_up_the_newer_one(mirror, drive, local, drive_faults, monkeypatch):
    mirror.keep = 1
    mirror.best_step = 10
    drive_faults.fail(errno.EIO)
    submit(mirror, local, 10)
    deadline = time.monotonic() + 5
    while mirror.failures < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    submit(mirror, local, 20)
    while mirror.pending_steps[:1] != [20] and time.monotonic() < deadline:
        time.sleep(0.005)
    assert mirror.pending_steps == [20, 10]  # 10 failed again with 20 queued: 20 goes first, 10 after
    drive_faults.heal()
    assert mirror.drain(10)
    steps = [e["step"] for e in read_events(drive / "events.jsonl") if e["event"] == "sync"]
    assert steps == [20, 10]  # both land, the best one too
    submit(mirror, local, 30)
    assert mirror.drain(10)
    deadline = time.monotonic() + 5
    while len(list_checkpoints(drive / "checkpoints")) > 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    # keep=1: the newest and the best stay
    assert [s for s, _ in list_checkpoints(drive / "checkpoints")] == [30, 10]


def test_prunes_only_after_confirming_and_keeps_keep(mirror, drive, local):
    for step in (10, 20, 30):
        submit(mirror, local, step)
        assert mirror.drain(10)
    assert [s for s, _ in list_checkpoints(drive / "checkpoints")] == [30, 20]


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EIO, errno.EACCES, errno.ENOTCONN])
def test_drive_errors_are_retried_reported_and_caught_up(mirror, drive, local, drive_faults, code):
    disconnected = []
    mirror.publisher.on_disconnected = lambda: disconnected.append(True)
    drive_faults.fail(code)
    submit(mirror, local, 10)
    deadline = time.monotonic() + 5
    while mirror.failures < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mirror.failures >= 3 and not mirror.drain(0.05)
    assert os.strerror(code) in mirror.unsynced_reason
    assert bool(disconnected) == (code == errno.ENOTCONN)
    drive_faults.heal()
    assert mirror.drain(10)
    assert mirror.written_step == 10 and mirror.unsynced_reason is None
    assert verify_folder(drive / "checkpoints" / "checkpoint-10") is None
    events = read_events(drive / "events.jsonl")
    warns = [e for e in events if e["event"] == "warn" and e["what"] == "sync_failed"]
    assert warns and warns[0]["errno"] == code  # written while Drive was down, landed after
    assert [e["event"] for e in events][-2:] == ["sync", "cloud"]


def test_a_corrupted_copy_is_detected_by_reading_back(mirror, drive, local, monkeypatch):
    copy = storage.copy_file
    broken = {"left": 1}

    def bitrot(src, dst):
        digest = copy(src, dst)
        if broken["left"] and Path(dst).name == "model.safetensors":
            broken["left"] -= 1
            data = bytearray(Path(dst).read_bytes())
            data[10] ^= 1
            Path(dst).write_bytes(bytes(data))
        return digest

    monkeypatch.setattr(storage, "copy_file", bitrot)
    submit(mirror, local, 10)
    assert mirror.drain(10)
    assert mirror.total_failures == 1
    assert verify_folder(drive / "checkpoints" / "checkpoint-10") is None


def test_pause_stops_uploads(mirror, drive, local):
    mirror.pause("lease lost")
    submit(mirror, local, 10)
    assert not mirror.drain(0.2)
    assert not (drive / "checkpoints" / "checkpoint-10").exists()


def test_what_one_failed_read_left_unknown_is_read_again(tmp_path, monkeypatch):
    """A checkpoint found at the start whose state could not be read is adopted at a later round (it was never
    followed, so never pruned), and an upload whose manifest size could not be read as it was written gets it
    at the next poll (without it, Drive's API could never confirm the folder)."""
    from made import make_checkpoint

    from colab_kit.checkpoints.manifest import read_manifest
    from colab_kit.drive.cloud import CloudTracker
    from colab_kit.drive.drivefs import DRIVEFS
    from colab_kit.drive.uploads import learn_manifest, upload_for

    root = tmp_path / "checkpoints"
    for step in (10, 20):
        make_checkpoint(root, step)
    tracker = CloudTracker(DRIVEFS)
    stat = storage.stat

    def eio_on_20(path):
        if "checkpoint-20" in str(path):
            raise OSError(errno.EIO, "Input/output error", str(path))
        return stat(path)

    monkeypatch.setattr(storage, "stat", eio_on_20)
    assert tracker.adopt(root) is False and tracker.checkpoint_steps() == {10}
    monkeypatch.setattr(storage, "stat", stat)
    assert tracker.adopt(root) is True and tracker.checkpoint_steps() == {10, 20}

    monkeypatch.setattr(storage, "stat", eio_on_20)
    upload = upload_for(root / "checkpoint-20", read_manifest(root / "checkpoint-20"), "checkpoint-20")
    assert MANIFEST not in upload.sizes
    monkeypatch.setattr(storage, "stat", stat)
    learn_manifest(upload)
    assert upload.sizes[MANIFEST] == (root / "checkpoint-20" / MANIFEST).stat().st_size
