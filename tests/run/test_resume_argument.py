"""`run.train(trainer, resume_from_checkpoint=...)` takes what the Trainer takes (issue 21).

transformers' own scenarios (tests/trainer/test_trainer.py): `resume_from_checkpoint=False` trains
from scratch (#12970, which crashed in the kit with "expected str, bytes or os.PathLike object, not
bool"); `True` resumes from the newest checkpoint and gives the weights of an uninterrupted run, and
says "No valid checkpoint found in output directory" when there is none; a path resumes from that
checkpoint. The kit adds: False archives the run's earlier checkpoints (never deletes them), a path
is verified against its manifest.
"""

import shutil

import pytest
from test_run import StopAt, events, max_diff, start, weights

import colab_kit as ck
from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.validity import verify_folder
from colab_kit.tasks.demo import tiny_trainer

STEPS = 20


@pytest.fixture
def straight(drive, local):
    """The weights of an uninterrupted 20-step run (saves every 5)."""
    run = start(drive, local, "straight", save_every=5, quiet=True)
    trainer = tiny_trainer(run, max_steps=STEPS)
    run.train(trainer)
    return weights(trainer)


def crashed_run(drive, local, name="r", at=12):
    run = start(drive, local, name, save_every=5, quiet=True)
    trainer = tiny_trainer(run, max_steps=STEPS, callbacks=[StopAt(at)])
    with pytest.raises(RuntimeError, match="simulated crash"):
        run.train(trainer)
    shutil.rmtree(local / name)  # a new VM: only Drive survives


def test_false_on_a_fresh_run_trains_from_scratch(drive, local, straight):
    run = start(drive, local, "fresh", save_every=5, quiet=True)
    trainer = tiny_trainer(run, max_steps=STEPS)
    output = run.train(trainer, resume_from_checkpoint=False)
    assert output.global_step == STEPS
    assert max_diff(straight, weights(trainer)) <= 1e-6


def test_false_starts_at_step_0_and_archives_the_runs_checkpoints(drive, local, straight, capsys):
    crashed_run(drive, local)
    run = start(drive, local, "r", save_every=5, quiet=True)
    assert run.resume_from is not None and run.resume_from.name == "checkpoint-10"
    trainer = tiny_trainer(run, max_steps=STEPS)
    output = run.train(trainer, resume_from_checkpoint=False)

    assert output.global_step == STEPS and max_diff(straight, weights(trainer)) <= 1e-6  # from step 0
    said = capsys.readouterr().out
    assert "resume_from_checkpoint=False: training starts at step 0" in said
    assert "(up to step 10) were moved to" in said and "nothing was deleted" in said
    archived = list((run.drive_dir / "archive").iterdir())
    assert len(archived) == 1
    assert [step for step, _ in list_checkpoints(archived[0])] == [10, 5]
    assert all(verify_folder(path) is None for _, path in list_checkpoints(archived[0]))
    assert [step for step, _ in list_checkpoints(run.drive_dir / "checkpoints")][0] == STEPS  # the new run's
    assert events(run, "archive")[-1]["because"] == "resume_from_checkpoint=False"


def test_true_resumes_from_the_newest_checkpoint_exactly(drive, local, straight):
    crashed_run(drive, local)
    run = start(drive, local, "r", save_every=5, quiet=True)
    trainer = tiny_trainer(run, max_steps=STEPS)
    output = run.train(trainer, resume_from_checkpoint=True)
    assert output.global_step == STEPS
    assert max_diff(straight, weights(trainer)) <= 1e-6
    assert events(run, "resume")[-1]["step"] == 10


def test_true_without_any_checkpoint_says_so_before_training(drive, local):
    run = start(drive, local, "empty", quiet=True)
    trainer = tiny_trainer(run, max_steps=4)
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        run.train(trainer, resume_from_checkpoint=True)
    assert trainer.state.global_step == 0
    run.train(trainer)  # the run is still open for the corrected call
    assert trainer.state.global_step == 4


def test_a_path_resumes_from_that_checkpoint_after_checking_it(drive, local, straight):
    crashed_run(drive, local)
    run = start(drive, local, "r", save_every=5, quiet=True)
    older = run.drive_dir / "checkpoints" / "checkpoint-5"
    trainer = tiny_trainer(run, max_steps=STEPS)
    output = run.train(trainer, resume_from_checkpoint=str(older))
    assert output.global_step == STEPS
    assert max_diff(straight, weights(trainer)) <= 1e-6


def test_a_damaged_or_missing_path_is_refused_with_nothing_changed(drive, local):
    crashed_run(drive, local)
    run = start(drive, local, "r", save_every=5, quiet=True)
    assert run.mirror.drain(10)  # its first pass over the folder is done (a damaged old one would go in it)
    damaged = run.drive_dir / "checkpoints" / "checkpoint-5"
    weights_file = next(p for p in damaged.iterdir() if p.name.endswith(".safetensors"))
    weights_file.write_bytes(weights_file.read_bytes()[:-8])
    trainer = tiny_trainer(run, max_steps=STEPS)
    with pytest.raises(ck.CheckpointError, match="is not a checkpoint to resume from"):
        run.train(trainer, resume_from_checkpoint=str(damaged))
    with pytest.raises(ValueError, match="Can't find a valid checkpoint at"):
        run.train(trainer, resume_from_checkpoint=str(run.drive_dir / "checkpoints" / "checkpoint-7"))
    with pytest.raises(ValueError, match="give True .*False .*or the path of a checkpoint folder"):
        run.train(trainer, resume_from_checkpoint=5)
    assert trainer.state.global_step == 0 and run.resume_from.name == "checkpoint-10"
    run.finish()
