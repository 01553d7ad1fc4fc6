"""best.py: reading the Trainer's best checkpoint, pointing a resumed state at it, early stopping."""

import json
from types import SimpleNamespace

from made import make_checkpoint

from colab_kit.lifecycle.best import early_stopped, fetch_best, recorded_best, restore_best, step_of


def write_state(folder, **state):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainer_state.json").write_text(json.dumps(state))
    return folder


def test_step_of_reads_checkpoint_folders_only():
    assert step_of("/content/x/checkpoint-120") == 120 and step_of("out/checkpoint-7/") == 7
    assert step_of(None) is None and step_of("/content/x/final") is None


def test_recorded_best_comes_from_trainer_state(tmp_path):
    old_vm = "/content/colab_kit_local/job/checkpoint-10"
    assert recorded_best(write_state(tmp_path / "checkpoint-30", best_model_checkpoint=old_vm)) == 10
    assert recorded_best(write_state(tmp_path / "checkpoint-40", best_model_checkpoint=None)) is None
    assert recorded_best(tmp_path / "nothing-here") is None  # CheckpointStore checkpoints have no Trainer state


def test_fetch_best_finds_the_named_step_and_verifies_it(tmp_path):
    drive, local = tmp_path / "drive", tmp_path / "local"
    local.mkdir()
    for step in (10, 20, 30):
        make_checkpoint(drive, step)
    def fetch(resumed, step, places):  # as start_run does: the best step read from the resumed checkpoint
        return fetch_best(recorded_best(resumed), resumed, step, places, local, skipped.append)

    resumed = write_state(local / "checkpoint-30", best_model_checkpoint="/old/checkpoint-10")
    skipped = []
    path = fetch(resumed, 30, [("drive", drive), ("local", local)])
    assert path == local / "checkpoint-10" and (path / "MANIFEST.json").is_file() and not skipped
    # the best one is the resumed one: nothing to fetch
    assert fetch(write_state(local / "checkpoint-20", best_model_checkpoint="/old/checkpoint-20"), 20,
                 [("drive", drive)]) == local / "checkpoint-20"
    # gone from Drive (pruned by an older kit): None, and the caller says so
    assert fetch(write_state(local / "checkpoint-50", best_model_checkpoint="/old/checkpoint-5"), 50,
                 [("drive", drive)]) is None


def test_restore_best_points_the_state_at_the_local_copy(tmp_path):
    out = tmp_path / "out"
    (out / "checkpoint-10").mkdir(parents=True)
    args = SimpleNamespace(output_dir=str(out))
    state = SimpleNamespace(best_model_checkpoint=None, best_global_step=10)  # the Trainer dropped the old path
    assert restore_best(out / "checkpoint-10", args, state) == str(out / "checkpoint-10")
    assert state.best_model_checkpoint == str(out / "checkpoint-10")
    # elsewhere than output_dir: the copy's own path
    (tmp_path / "other" / "checkpoint-10").mkdir(parents=True)
    state = SimpleNamespace(best_model_checkpoint="/gone/checkpoint-10", best_global_step=10)
    assert restore_best(tmp_path / "other" / "checkpoint-10", args, state) == str(tmp_path / "other" / "checkpoint-10")
    # a path that still exists is the Trainer's own: left alone; a different best step is not ours to set
    state = SimpleNamespace(best_model_checkpoint=str(out / "checkpoint-10"), best_global_step=10)
    assert restore_best(tmp_path / "other" / "checkpoint-10", args, state) is None
    state = SimpleNamespace(best_model_checkpoint=None, best_global_step=20)
    assert restore_best(out / "checkpoint-10", args, state) is None and state.best_model_checkpoint is None


def test_early_stopped_reads_the_callback_state(tmp_path):
    def saved(counter, patience=2):
        return {"EarlyStoppingCallback": {"args": {"early_stopping_patience": patience,
                                                   "early_stopping_threshold": 0.0},
                                          "attributes": {"early_stopping_patience_counter": counter}}}

    assert early_stopped(write_state(tmp_path / "a", stateful_callbacks=saved(2)))
    assert not early_stopped(write_state(tmp_path / "b", stateful_callbacks=saved(1)))
    assert early_stopped(write_state(tmp_path / "c", stateful_callbacks={
        "EarlyStoppingCallback": [saved(0)["EarlyStoppingCallback"], saved(3)["EarlyStoppingCallback"]]}))
    assert not early_stopped(write_state(tmp_path / "d", stateful_callbacks={}))
    assert not early_stopped(tmp_path / "missing")
