"""DriveFS semantics: the emulator itself, and the kit's reading of it (drivefs, cloud, the mirror).

The emulator (scripts/drivefs_emulator.py) is a real FUSE filesystem; these tests skip with the
reason where FUSE cannot mount, and fail instead under .ci/run (COLAB_KIT_REQUIRE_FUSE=1).
"""

import errno
import hashlib
import os
import time
from pathlib import Path

import pytest

import colab_kit as ck
from colab_kit._notices import Notices
from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.journal import Journal, read_events
from colab_kit.checkpoints.snapshot import take_snapshot
from colab_kit.checkpoints.validity import verify_folder
from colab_kit.drive.deleters import TrashFreeDeleter
from colab_kit.drive.drivefs import DRIVEFS, PLAIN, UNCONFIRMED, folder_kind, in_cloud, read_upload
from colab_kit.drive.mirror import Mirror


def wait_until(predicate, timeout=20.0, every=0.05):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(every)


def write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(data)


# -- the emulator -------------------------------------------------------------------------------
def test_a_closed_file_is_uncommitted_with_a_local_id_until_the_throttled_upload_lands(emulated_drive):
    drive = emulated_drive(rate=2e6)
    path = drive.mountpoint / "a" / "f.bin"
    data = os.urandom(1_000_000)
    started = time.monotonic()
    write(path, data)
    state = read_upload(path)
    assert state.uncommitted == b"1" and state.item_id.startswith(b"local-") and not state.in_cloud()
    assert not (drive.cloud / "a" / "f.bin").exists()
    wait_until(lambda: read_upload(path).uncommitted == b"0")
    assert time.monotonic() - started >= 0.45  # 1 MB at 2 MB/s
    state = read_upload(path)
    assert state.item_id.startswith(b"cloud-") and state.md5 == hashlib.md5(data).hexdigest().encode()
    assert state.in_cloud(hashlib.md5(data).hexdigest()) and not state.in_cloud("0" * 32)
    assert (drive.cloud / "a" / "f.bin").read_bytes() == data
    assert os.listxattr(path) == []  # DriveFS does not list its attributes: ask by name


def test_deletes_and_renames_of_cloud_items_overtake_pending_uploads_and_fill_the_trash(emulated_drive):
    drive = emulated_drive(rate=1e6)
    old, new = drive.mountpoint / "old.bin", drive.mountpoint / "big.bin"
    write(old, os.urandom(200_000))
    wait_until(lambda: read_upload(old).uncommitted == b"0")
    write(new, os.urandom(3_000_000))  # 3 s of upload ahead
    os.unlink(old)  # reaches the cloud at once, long before big.bin does
    assert not (drive.cloud / "old.bin").exists() and not (drive.cloud / "big.bin").exists()
    assert drive.trash_bytes() == 200_000  # Drive's Trash keeps the bytes, and they count
    os.rename(drive.mountpoint / "big.bin", drive.mountpoint / "moved.bin")
    wait_until(lambda: read_upload(drive.mountpoint / "moved.bin").uncommitted == b"0")
    assert (drive.cloud / "moved.bin").stat().st_size == 3_000_000


def test_truncating_first_leaves_only_an_empty_stub_in_the_trash(emulated_drive):
    drive = emulated_drive(rate=20e6)
    path = drive.mountpoint / "ckpt.bin"
    write(path, os.urandom(2_000_000))
    wait_until(lambda: read_upload(path).uncommitted == b"0")
    os.truncate(path, 0)  # a change of its own: uploaded (0 bytes) like any other
    wait_until(lambda: (drive.cloud / "ckpt.bin").stat().st_size == 0)
    assert read_upload(path).uncommitted == b"0"
    os.unlink(path)
    assert drive.trash_bytes() == 0 and len(list(drive.trash.iterdir())) == 1


def test_a_killed_daemon_answers_errno_107_and_a_new_vm_sees_only_the_cloud(emulated_drive):
    drive = emulated_drive(rate=1e6)
    write(drive.mountpoint / "up.bin", b"x" * 1000)
    wait_until(lambda: read_upload(drive.mountpoint / "up.bin").uncommitted == b"0")
    write(drive.mountpoint / "pending.bin", os.urandom(5_000_000))
    drive.kill()
    with pytest.raises(OSError) as info:
        os.listdir(drive.mountpoint)
    assert info.value.errno == errno.ENOTCONN
    drive.new_vm()
    assert sorted(os.listdir(drive.mountpoint)) == ["up.bin"]  # the pending upload died with the VM
    state = read_upload(drive.mountpoint / "up.bin")
    assert state.uncommitted == b"0" and state.item_id.startswith(b"cloud-")


def test_a_quota_fails_writes_with_enospc_counting_the_trash(emulated_drive):
    drive = emulated_drive(rate=50e6, quota=3_000_000)
    write(drive.mountpoint / "a.bin", os.urandom(2_000_000))
    wait_until(lambda: read_upload(drive.mountpoint / "a.bin").uncommitted == b"0")
    os.unlink(drive.mountpoint / "a.bin")  # its 2 MB now sit in the Trash
    st = os.statvfs(drive.mountpoint)
    assert st.f_bavail * st.f_frsize <= 1_000_000
    with pytest.raises(OSError) as info:
        write(drive.mountpoint / "b.bin", os.urandom(2_000_000))
    assert info.value.errno == errno.ENOSPC


# -- the kit's reading of it --------------------------------------------------------------------
def test_folder_kinds(emulated_drive, tmp_path):
    assert folder_kind(emulated_drive().mountpoint) == DRIVEFS
    assert folder_kind(emulated_drive(attrs=False).mountpoint) == UNCONFIRMED  # a Drive mount without them
    assert folder_kind(tmp_path) == PLAIN
    assert folder_kind(tmp_path, on_drive=True) == UNCONFIRMED


def test_in_cloud_needs_every_file_committed_and_counts_what_is_pending(emulated_drive):
    drive = emulated_drive(rate=2e6)
    folder = drive.mountpoint / "ckpt"
    write(folder / "small.json", b"{}")
    wait_until(lambda: read_upload(folder / "small.json").uncommitted == b"0")
    write(folder / "big.bin", os.urandom(1_000_000))
    files = {"small.json": hashlib.md5(b"{}").hexdigest(), "big.bin": None}
    assert in_cloud(folder, files, DRIVEFS) == (False, 1_000_000)
    assert in_cloud(folder, files, UNCONFIRMED) == (False, 1_000_002)
    wait_until(lambda: in_cloud(folder, files, DRIVEFS)[0])
    assert in_cloud(folder, {"small.json": "0" * 32}, DRIVEFS)[0] is False  # the cloud holds other bytes


def test_trash_free_deleter_empties_files_before_unlinking(emulated_drive):
    drive = emulated_drive(rate=10e6)
    folder = drive.mountpoint / "checkpoint-10"
    write(folder / "model.safetensors", os.urandom(3_000_000))
    write(folder / "MANIFEST.json", b"{}")
    wait_until(lambda: read_upload(folder / "model.safetensors").uncommitted == b"0")
    deleter = TrashFreeDeleter(DRIVEFS)
    deleter.start(folder, first="MANIFEST.json")
    assert folder.exists() and (folder / "model.safetensors").stat().st_size == 0
    wait_until(lambda: deleter.poll() == [folder] or not deleter.pending)
    assert not folder.exists() and not (drive.cloud / "checkpoint-10").exists()
    assert drive.trash_bytes() == 0


def checkpoint(local: Path, step: int, size: int) -> Path:
    folder = local / f"checkpoint-{step}"
    write(folder / "model.safetensors", os.urandom(size))
    write(folder / "trainer_state.json", b'{"global_step": %d}' % step)
    return folder


def test_the_mirror_reports_written_then_in_the_cloud_and_prunes_only_after_confirmation(emulated_drive, tmp_path):
    drive = emulated_drive(rate=2e6)
    run_dir = drive.mountpoint / "run"
    run_dir.mkdir()
    journal = Journal(run_dir / "events.jsonl", local_copy=tmp_path / "events.jsonl")
    mirror = Mirror(run_dir, keep=1, journal=journal, notices=Notices(), kind=DRIVEFS)
    try:
        for step in (10, 20, 30):  # produced at once, 1 s of upload each
            mirror.submit(take_snapshot(checkpoint(tmp_path, step, 2_000_000), tmp_path / ".snapshots", step))
        wait_until(lambda: mirror.written_step == 30 and mirror.tracker.all_in_cloud(), timeout=30)
        wait_until(lambda: [s for s, _ in list_checkpoints(run_dir / "checkpoints")] == [30], timeout=30)
    finally:
        mirror.close()
    events = read_events(tmp_path / "events.jsonl")
    kinds = [(e["event"], e.get("step")) for e in events if e["event"] in ("sync", "cloud")]
    # 20 was superseded while 10 uploaded: one checkpoint at a time is in Drive's queue
    assert kinds == [("sync", 10), ("cloud", 10), ("sync", 30), ("cloud", 30)]
    cloud = [e for e in events if e["event"] == "cloud"]
    assert all(e["seconds"] >= 0.9 and e["bytes"] > 2_000_000 for e in cloud)
    assert 1.0e6 <= cloud[-1]["rate_bps"] <= 2.1e6  # measured from the confirmations (2 MB/s; writes and polls lag)
    prune = [e for e in events if e["event"] == "prune"]
    assert prune and prune[0]["steps"] == [10] and prune[0]["trash_free"]
    assert events.index(prune[0]) > events.index(cloud[-1])  # only once 30 was in the cloud
    assert verify_folder(drive.cloud / "run" / "checkpoints" / "checkpoint-30") is None
    assert drive.trash_bytes() < 2_000_000 * 0.01


def test_without_attributes_nothing_is_called_in_the_cloud(emulated_drive, tmp_path):
    drive = emulated_drive(rate=50e6, attrs=False)
    run = ck.start_run("plainless", drive=drive.mountpoint, local_dir=tmp_path / "local", save_every=5,
                       keep=1, quiet=True)
    assert run.durability == UNCONFIRMED
    from colab_kit.tasks.demo import tiny_trainer

    run.train(tiny_trainer(run, max_steps=20))
    summary = run.finish(timeout=2)
    assert summary["in_cloud"] is False and summary["cloud_step"] is None
    events = read_events(tmp_path / "local" / "events.jsonl")
    assert not [e for e in events if e["event"] == "cloud"]
    # Uploads are spaced by the assumed rate (nothing reports them): newer saves replace waiting ones
    synced = [e["step"] for e in events if e["event"] == "sync"]
    assert synced[-1] == 20 and set(synced) <= {5, 10, 15, 20}  # one saved while another uploads may be replaced
    remaining = list_checkpoints(run.drive_dir / "checkpoints")
    assert remaining and verify_folder(remaining[0][1]) is None  # pruning kept a checkpoint that verifies


def test_finish_waits_with_a_countdown_says_plainly_what_is_not_in_the_cloud_and_waits_again(
        emulated_drive, tmp_path, capsys):
    from colab_kit.tasks.demo import tiny_trainer

    drive = emulated_drive(rate=1e6)
    run = ck.start_run("slow", drive=drive.mountpoint, local_dir=tmp_path / "local", save_every=10, quiet=True,
                       gauges=False)
    assert run.durability == DRIVEFS
    run.train(tiny_trainer(run, max_steps=10, vocab_size=8000))  # one ~3 MB checkpoint: ~3 s of upload
    out = capsys.readouterr()
    assert "uploading checkpoint-10" in out.out and "run.finish() at the end waits for it" in out.out
    summary = run.finish(timeout=0.5)
    out = capsys.readouterr()
    assert summary["in_cloud"] is False and summary["pending"] == ["checkpoint-10"] and summary["pending_bytes"] > 0
    assert "NOT YET IN THE CLOUD: checkpoint-10" in out.out and "lost if the runtime is recycled" in out.out
    assert "waiting for Drive to upload" in out.err and "giving up in" in out.err  # the countdown
    summary = run.finish(timeout=60)
    assert summary["in_cloud"] is True and summary["cloud_step"] == 10 and summary["pending_bytes"] == 0
    assert "already finished" in capsys.readouterr().out
    events = read_events(tmp_path / "local" / "events.jsonl")
    cloud = [e for e in events if e["event"] == "cloud"]
    assert [e["step"] for e in cloud] == [10] and cloud[0]["seconds"] >= 2.0


def test_finish_flush_calls_colabs_flush_and_says_it_unmounted(drive, local, fake_colab, capsys):
    flushed = []
    fake_colab.drive.flush_and_unmount = lambda *a, **k: flushed.append(True)
    run = ck.start_run("flushed", drive=drive, local_dir=local, quiet=True)
    run.finish(flush=True)
    assert not flushed and "nothing to flush" in capsys.readouterr().out  # not on Colab's mount
    run.on_drive = True  # as if the folder were on /content/drive
    run.finish(flush=True)
    assert flushed == [True] and "UNMOUNTED" in capsys.readouterr().out
    assert read_events(run.drive_dir / "events.jsonl")[-1]["event"] == "flush"


def test_an_upload_that_cannot_fit_is_not_started_and_the_numbers_are_said(emulated_drive, tmp_path):
    drive = emulated_drive(rate=50e6, quota=5_000_000)
    run_dir = drive.mountpoint / "run"
    run_dir.mkdir()
    journal = Journal(run_dir / "events.jsonl", local_copy=tmp_path / "events.jsonl")
    notices = Notices()
    mirror = Mirror(run_dir, keep=1, journal=journal, notices=notices, kind=DRIVEFS, backoff=(0.05, 0.1))
    try:
        mirror.submit(take_snapshot(checkpoint(tmp_path, 10, 3_000_000), tmp_path / ".snapshots", 10))
        wait_until(lambda: mirror.tracker.all_in_cloud() and mirror.written_step == 10)
        mirror.submit(take_snapshot(checkpoint(tmp_path, 20, 3_000_000), tmp_path / ".snapshots", 20))
        wait_until(lambda: mirror.failures >= 1)
    finally:
        mirror.close()
    warn = [e for e in read_events(tmp_path / "events.jsonl") if e.get("what") == "sync_failed"][0]
    assert warn["errno"] == errno.ENOSPC and "free, but checkpoint-20 needs 2.9 MiB" in warn["error"]
    assert "was not started" in warn["error"] and "Trash counts too" in warn["error"]
    assert not (run_dir / "checkpoints" / "checkpoint-20").exists()  # nothing half-copied to clean up
    assert verify_folder(run_dir / "checkpoints" / "checkpoint-10") is None
