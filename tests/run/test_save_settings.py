"""Every Trainer save setting keeps the kit's saves (issue 46, path 2), through `run.train`.

The table of docs/trainer.md, row by row: the kit saves every 4 steps and at the end (`save_every=4`, 12 steps);
whatever the Trainer's own settings, each of those saves is made (a "save" line in the journal), the final
state is a whole checkpoint in the run folder, nothing is said dropped, and load_best_model_at_end still ends
on the Trainer's best. With save_strategy="best", "best" is the HIGHEST eval_loss (greater_is_better=True), which
training seldom beats: before the fix the Trainer dropped every kit save that was not a new best, the final
state included. A combination the kit cannot honour is refused before training, saying what to set instead.
"""

import pytest
import torch

import colab_kit as ck
from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.journal import read_events
from colab_kit.checkpoints.validity import verify_folder
from colab_kit.errors import ColabKitError
from colab_kit.trainer.callbacks import bind
from colab_kit.tasks.demo import tiny_trainer, toy_classification

pytestmark = pytest.mark.slow
STEPS, EVERY = 12, 4
BATCH = 16
EPOCH_ROWS = 6 * BATCH  # 6 steps an epoch: epochs end at 6 and 12
WORST = dict(metric_for_best_model="eval_loss", greater_is_better=True)  # seldom a new best

TABLE = {
    "no": dict(save_strategy="no"),
    "steps": dict(save_strategy="steps", save_steps=5, save_total_limit=1),
    "steps-best-at-end": dict(save_strategy="steps", save_steps=3, eval_strategy="steps", eval_steps=3,
                              load_best_model_at_end=True, metric_for_best_model="eval_loss"),
    "epoch": dict(save_strategy="epoch", eval_strategy="epoch", load_best_model_at_end=True,
                  metric_for_best_model="eval_loss", epochs=2),
    "best-eval-steps": dict(save_strategy="best", eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                            **WORST),
    "best-eval-epoch": dict(save_strategy="best", eval_strategy="epoch", **WORST, epochs=2),
    "best-limit-1": dict(save_strategy="best", eval_strategy="steps", eval_steps=4, save_total_limit=1,
                         load_best_model_at_end=True, **WORST),
    "best-model-only": dict(save_strategy="best", eval_strategy="steps", eval_steps=4, save_only_model=True,
                            **WORST),
    "eval-no-save-no": dict(save_strategy="no", eval_strategy="steps", eval_steps=3),
}


def trainer_for(run, settings: dict):
    settings = dict(settings)
    epochs = settings.pop("epochs", None)
    length = dict(max_steps=-1, num_train_epochs=epochs) if epochs else dict(max_steps=STEPS)
    evaluates = settings.get("eval_strategy", "no") != "no"
    return tiny_trainer(run, batch_size=BATCH, train_dataset=toy_classification(n=EPOCH_ROWS),
                        eval_dataset=toy_classification(n=32, seed=3) if evaluates else None, **length, **settings)


@pytest.mark.slow(12)
@pytest.mark.parametrize("row", list(TABLE))
def test_every_save_setting_keeps_the_kits_saves_and_the_final_state(tmp_path, row, capsys):
    run = ck.start_run("table", drive=tmp_path / "drive", local_dir=tmp_path / "local", save_every=EVERY, keep=10,
                       gauges=False, quiet=True)
    trainer = trainer_for(run, TABLE[row])
    run.train(trainer)
    summary = run.finish(timeout=60)
    last = trainer.state.global_step
    assert last == STEPS
    events = read_events(run.drive_dir / "events.jsonl")
    saved = {e["step"] for e in events if e["event"] == "save"}
    assert {EVERY, 2 * EVERY, STEPS} <= saved, f"{row}: the kit's saves {saved}"
    assert not [e for e in events if e.get("what") == "save_dropped"]
    in_store = dict(list_checkpoints(run.drive_dir / "checkpoints"))
    assert STEPS in in_store and verify_folder(in_store[STEPS]) is None  # the final state, whole
    assert summary["cloud_step"] == STEPS
    assert "did not make the save" not in capsys.readouterr().err
    best = trainer.state.best_model_checkpoint
    if TABLE[row].get("load_best_model_at_end"):  # the Trainer's own best, as without the kit
        assert best is not None and trainer.state.best_global_step in saved | set(range(0, STEPS + 1, 2))
        from safetensors.torch import load_file

        weights = load_file(f"{best}/model.safetensors")
        ended = trainer.model.state_dict()
        assert all(torch.equal(weights[name], ended[name]) for name in weights)


def test_a_save_the_trainer_still_drops_is_said(tmp_path, capsys):
    """The detector behind the table: a callback that vetoes every save (as a later setting could) leaves the
    kit's asked steps unsaved, and the run says which, in the journal and at finish."""
    from transformers import TrainerCallback

    class Veto(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_save = False  # added after the kit's callbacks, so it runs after them

    run = ck.start_run("veto", drive=tmp_path / "drive", local_dir=tmp_path / "local", save_every=EVERY,
                       gauges=False, quiet=True)
    trainer = trainer_for(run, TABLE["no"])
    bind(run, trainer)  # the kit's callbacks first (run.train adds none twice), then the veto after them
    trainer.add_callback(Veto())
    run.train(trainer)
    run.finish(timeout=30)
    dropped = [e["step"] for e in read_events(run.drive_dir / "events.jsonl") if e.get("what") == "save_dropped"]
    assert dropped == [EVERY, 2 * EVERY, STEPS]
    assert f"did not make the save the kit asked for at step {STEPS}" in capsys.readouterr().err


def test_pushing_the_trainers_checkpoints_into_the_runs_own_repo_is_refused_before_training(hub_env, tmp_path,
                                                                                          monkeypatch):
    from huggingface_hub import HfApi, hf_api
    from transformers.utils import hub as transformers_hub

    # The Trainer's create_repo at its __init__, on the emulated Hub (HF_ENDPOINT was read at import): 4.x calls
    # huggingface_hub's shared HfApi, 5.x one of its own.
    monkeypatch.setattr(hf_api.api, "endpoint", hub_env.url)
    monkeypatch.setattr(transformers_hub, "_hf_api", HfApi(endpoint=hub_env.url), raising=False)
    run = ck.start_run("pushed", store="hf://user/runs", local_dir=tmp_path / "vm" / "pushed", save_every=EVERY,
                       gauges=False, quiet=True)
    try:
        trainer = trainer_for(run, dict(save_strategy="no", push_to_hub=True, hub_model_id="user/runs"))
        with pytest.raises(ColabKitError, match="push_to_hub=False"):
            run.train(trainer)
        assert trainer.state.global_step == 0 and run.last_saved_step is None
    finally:
        summary = run.finish(timeout=30)
    assert summary["status"] == "finished"  # refused before anything changed: the run is open, then finished
