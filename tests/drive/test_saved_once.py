"""A checkpoint step is written once per run (issue 38, finding 1).

With save_strategy="epoch", the Trainer saves at the end of the last epoch, right after the kit's own save of
the last step: two saves of one step, the second rewriting (in place) the files the first snapshot shares while
that snapshot uploads. On a slow Drive the first upload failed its read-back, and letting go of it removed the
second snapshot's folder: the last checkpoint never reached Drive while `finish` said everything was in the cloud.
Now the kit leaves that save to the Trainer's epoch end (one save, with the epoch's evaluation), and a second
save of one step, if something else asks for it, has a snapshot folder of its own that replaces the first.
"""

import json

import pytest

import colab_kit as ck
from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.journal import read_events
from colab_kit.checkpoints.validity import verify_folder
from colab_kit.tasks.demo import tiny_trainer, toy_classification

pytestmark = pytest.mark.slow
RATE = 60e3  # bytes per second: a slow Drive, as in the finding
# The notebooks' epoch settings: evaluate and save at each epoch's end, and end on the best model.
EPOCHS = dict(max_steps=-1, num_train_epochs=1, eval_strategy="epoch", save_strategy="epoch",
              load_best_model_at_end=True, metric_for_best_model="eval_loss")


def classifier(run, **args):
    """The RNA notebook's shape: a BERT-style sequence classifier."""
    return tiny_trainer(run, train_dataset=toy_classification(n=96), eval_dataset=toy_classification(n=32, seed=3),
                        **args)


def language_model(run, **args):
    """The GPT-2 notebook's shape: a causal LM on blocks of tokens (labels are the inputs)."""
    import datasets
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=2, n_head=2))

    def blocks(n, seed):
        ids = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(seed)).tolist()
        return datasets.Dataset.from_dict({"input_ids": ids, "labels": ids})

    training = TrainingArguments(str(run.local_dir), per_device_train_batch_size=16, learning_rate=1e-3,
                                 report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=10, **args)
    return Trainer(model=model, args=training, train_dataset=blocks(96, 0), eval_dataset=blocks(32, 1))


@pytest.mark.slow(30)
@pytest.mark.parametrize("make", [classifier, language_model], ids=["classifier", "language-model"])
def test_on_epoch_settings_the_last_checkpoint_reaches_the_cloud_and_finish_says_so(tmp_path, emulated_drive, make):
    drive = emulated_drive(rate=RATE)
    run = ck.start_run("epochs", drive=drive.mountpoint, local_dir=tmp_path / "local", quiet=True, gauges=False)
    trainer = make(run, **EPOCHS)
    run.train(trainer)
    summary = run.finish(timeout=120)
    last = trainer.state.global_step
    in_cloud = {step: path for step, path in list_checkpoints(drive.cloud / "epochs" / "checkpoints")}
    assert last in in_cloud and verify_folder(in_cloud[last]) is None, \
        f"checkpoint-{last} is not whole in the cloud: {sorted(in_cloud)}"
    assert summary["in_cloud"] is True and summary["cloud_step"] == last  # finish tells the truth
    # The one save of the last step is the Trainer's, at the epoch's end: it holds that epoch's evaluation.
    state = json.loads((in_cloud[last] / "trainer_state.json").read_text())
    assert any("eval_loss" in entry and entry["step"] == last for entry in state["log_history"])
    assert state["best_model_checkpoint"] is not None
    saves = [e["step"] for e in read_events(run.drive_dir / "events.jsonl") if e["event"] == "save"]
    assert saves.count(last) == 1
