"""The notebook as people use it (issue 28), in-process: a trainer kept in the kernel after its run
finished, a run that lost its lease, a cell run again under another name, a changed learning rate.

Each test ends by checking that no checkpoint was lost (the persistent folder holds a verified one of
the last step saved) and that the message printed names the next action.
"""

import pytest
from transformers import TrainerCallback

import colab_kit as ck
from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.journal import read_events
from colab_kit.checkpoints.validity import verify_folder
from colab_kit.tasks.demo import tiny_trainer


class Interrupt(TrainerCallback):
    """The stop button pressed twice (the kernel's KeyboardInterrupt) once training reaches `step`."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.step = None
            raise KeyboardInterrupt


def start(drive, local, name="nb", **kw):
    kw.setdefault("save_every", 10)
    return ck.start_run(name, drive=drive, local_dir=local / name, gauges=False, quiet=True, **kw)


def drive_steps(run) -> list[int]:
    """The checkpoints in the persistent folder that verify (manifest and every file)."""
    return sorted(step for step, path in list_checkpoints(run.drive_dir / "checkpoints") if verify_folder(path) is None)


def test_finding_1_a_trainer_kept_from_a_finished_run_mirrors_into_the_new_one(drive, local):
    # The stop button, then the start_run cell and the training cell run again with the trainer object
    # still in the kernel: before, training went on to the end and Drive kept checkpoint-20.
    first = start(drive, local)
    trainer = tiny_trainer(first, max_steps=60, callbacks=[Interrupt(25)])
    with pytest.raises(KeyboardInterrupt):
        first.train(trainer)
    assert drive_steps(first)[-1] == 20
    second = start(drive, local)
    assert second.resume_from is not None and second.resume_from.name == "checkpoint-20"
    second.train(trainer)
    second.finish(timeout=30)
    assert trainer.state.global_step == 60
    assert drive_steps(second)[-1] == 60  # every save of the second run reached the persistent folder
    rebound = [e for e in read_events(second.drive_dir / "events.jsonl") if e.get("what") == "trainer_rebound"]
    assert rebound and "of run 'nb'" in rebound[0]["replaced"][0]


def test_a_save_into_a_finished_run_is_an_error_at_once(drive, local):
    # The trainer used without run.train (its callbacks given to the Trainer), after the run finished.
    run = start(drive, local)
    trainer = tiny_trainer(run, max_steps=20, callbacks=run.callbacks())
    run.finish(timeout=10)
    with pytest.raises(ck.ColabKitError, match=r"checkpoint-10 was saved for run 'nb', which is finished") as err:
        trainer.train()
    assert "Run the start_run cell again" in str(err.value) and "run.train(trainer)" in str(err.value)


def test_a_store_of_a_finished_run_refuses_to_save(drive, local):
    import torch

    run = start(drive, local, save_every=None)
    store = run.checkpoint_store()
    run.finish(timeout=10)
    with pytest.raises(ck.CheckpointError, match="run start_run again and take a new store"):
        store.save(1, model=torch.nn.Linear(2, 2))
