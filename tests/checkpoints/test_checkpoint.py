"""Manifests, choosing the newest valid checkpoint, corruption, pruning."""


import pytest
from made import make_checkpoint

from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.search import fetch_checkpoint, find_latest
from colab_kit.checkpoints.manifest import MANIFEST, read_manifest
from colab_kit.checkpoints.validity import verify_folder


def test_manifest_lists_files_with_sizes_and_hashes(tmp_path):
    folder = make_checkpoint(tmp_path, 7)
    m = read_manifest(folder)
    assert m.step == 7 and set(m.files) == {"model.safetensors", "optimizer.pt", "sub/state.json"}
    assert m.files["model.safetensors"].size == 4096 and len(m.files["optimizer.pt"].sha256) == 64
    assert verify_folder(folder) is None


def _truncate(folder):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])


def _flip_byte(folder):
    path = folder / "optimizer.pt"
    data = bytearray(path.read_bytes())
    data[500] ^= 0xFF
    path.write_bytes(bytes(data))


def _drop_manifest(folder):
    (folder / MANIFEST).unlink()


def _drop_listed_file(folder):
    (folder / "sub" / "state.json").unlink()


def _garble_manifest(folder):
    (folder / MANIFEST).write_text('{"step": 3, "fil')


@pytest.mark.parametrize("damage, reason", [
    (_truncate, "truncated"),
    (_flip_byte, "sha256"),
    (_drop_manifest, "no MANIFEST.json"),
    (_drop_listed_file, "state.json is missing"),
    (_garble_manifest, "unreadable MANIFEST.json"),
])
@pytest.mark.parametrize("origin", ["drive", "local"])
def test_damaged_newest_checkpoint_is_skipped_and_named(tmp_path, damage, reason, origin):
    root, local = tmp_path / "ckpts", tmp_path / "local"
    local.mkdir()
    make_checkpoint(root, 10)
    newest = make_checkpoint(root, 20)
    damage(newest)
    skipped = []
    found = find_latest([(origin, root)], local, on_skip=lambda p, r: skipped.append((p, r)))
    assert found is not None and found.step == 10
    assert len(skipped) == 1 and skipped[0][0] == newest and reason in skipped[0][1]
    assert verify_folder(found.path) is None
    if origin == "drive":
        assert found.path == local / "checkpoint-10"  # copied to local disk, verified


def test_newest_valid_across_drive_and_local_prefers_local_on_ties(tmp_path):
    drive, local = tmp_path / "drive", tmp_path / "local"
    local.mkdir()
    make_checkpoint(drive, 30)
    make_checkpoint(local, 30)
    found = find_latest([("drive", drive), ("local", local)], local, on_skip=lambda *a: None)
    assert (found.step, found.origin) == (30, "local")
    make_checkpoint(drive, 40)
    found = find_latest([("drive", drive), ("local", local)], local, on_skip=lambda *a: None)
    assert (found.step, found.origin, found.path) == (40, "drive", local / "checkpoint-40")


def test_nothing_valid_means_none(tmp_path):
    make_checkpoint(tmp_path / "d", 5, manifest=False)
    (tmp_path / "l").mkdir()
    assert find_latest([("drive", tmp_path / "d")], tmp_path / "l", on_skip=lambda *a: None) is None


def test_fetch_refuses_corrupt_bytes_and_leaves_nothing(tmp_path):
    src = make_checkpoint(tmp_path / "d", 3)
    manifest = read_manifest(src)
    _flip_byte(src)
    local = tmp_path / "l"
    local.mkdir()
    with pytest.raises(ValueError, match="sha256"):
        fetch_checkpoint(src, manifest, local)
    assert list(local.iterdir()) == []


def test_list_ignores_other_names_and_sorts_numerically(tmp_path):
    for name in ("checkpoint-9", "checkpoint-10", "checkpoint-100", "checkpoint-x", "notes", "checkpoint-5.tmp-1"):
        (tmp_path / name).mkdir()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [100, 10, 9]


def test_a_second_save_of_a_step_gets_a_snapshot_folder_of_its_own_and_a_restart_recovers_it(tmp_path):
    """Issue 38, finding 1: a second save of one step never shares the first one's snapshot folder, and after a
    kill, the record that matches the Trainer's files (the second save's) gives the local checkpoint its
    manifest."""
    from colab_kit.checkpoints.manifest import read_manifest
    from colab_kit.checkpoints.snapshot import discard, recover_saved, take_snapshot

    source = make_checkpoint(tmp_path / "out", 10, manifest=False)
    first = take_snapshot(source, tmp_path / "snaps", 10)
    (source / "sub" / "state.json").unlink()  # the Trainer writes the step again: new files
    (source / "sub" / "state.json").write_text('{"step": 10, "eval": 1}')
    second = take_snapshot(source, tmp_path / "snaps", 10)
    assert first.path.name == "checkpoint-10" and second.path.name == "checkpoint-10.2"
    discard(first)  # letting go of the first leaves the second whole
    assert (second.path / "sub" / "state.json").read_text() == '{"step": 10, "eval": 1}'
    assert recover_saved(tmp_path / "snaps") == [10]
    assert read_manifest(source).files["sub/state.json"].size == len('{"step": 10, "eval": 1}')
