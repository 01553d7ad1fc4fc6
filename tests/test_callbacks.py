"""The save schedule: time- and step-based, final step, and the clock carried over a resume."""

import json
import types

import pytest
from transformers import TrainerControl, TrainerState

import colab_kit as ck
from colab_kit.callbacks import SaveScheduleCallback
from colab_kit.demo import tiny_trainer


class FakeClock:
    def __init__(self, seconds=0.0):
        self.seconds = seconds

    def start(self):
        pass

    def stop(self):
        pass


def fake_run(save_every_s=None, save_every_steps=None, clock=None, resumed=False):
    return types.SimpleNamespace(save_every_s=save_every_s, save_every_steps=save_every_steps,
                                 clock=clock or FakeClock(), resume_from="x" if resumed else None,
                                 poll=lambda: None)


def step(cb, state, n):
    state.global_step = n
    control = TrainerControl()
    cb.on_step_end(None, state, control)
    if control.should_save:
        cb.on_save(None, state, control)
    return control.should_save


def test_time_interval_counts_training_time():
    clock = FakeClock()
    cb = SaveScheduleCallback(fake_run(save_every_s=600, clock=clock))
    state = TrainerState(max_steps=1000)
    cb.on_train_begin(None, state, TrainerControl())
    clock.seconds = 599
    assert not step(cb, state, 1)
    clock.seconds = 600
    assert step(cb, state, 2)
    clock.seconds = 1100
    assert not step(cb, state, 3)
    clock.seconds = 1200
    assert step(cb, state, 4)


def test_time_interval_carries_over_a_resume():
    # Saved at 3000 s of training; the restored clock starts there, so the next save is due
    # 600 s of training later, not 600 s after the wall-clock start of the new session.
    clock = FakeClock(3000)
    cb = SaveScheduleCallback(fake_run(save_every_s=600, clock=clock, resumed=True))
    state = TrainerState(max_steps=1000, global_step=40)
    cb.on_train_begin(None, state, TrainerControl())
    clock.seconds = 3599
    assert not step(cb, state, 41)
    clock.seconds = 3600
    assert step(cb, state, 42)


def test_step_interval_and_final_step():
    cb = SaveScheduleCallback(fake_run(save_every_steps=10))
    state = TrainerState(max_steps=25)
    cb.on_train_begin(None, state, TrainerControl())
    saves = [n for n in range(1, 26) if step(cb, state, n)]
    assert saves == [10, 20, 25]


def test_train_seconds_are_stored_in_the_checkpoint_and_restored(drive, local):
    run = ck.start_run("clock", drive=drive, local_dir=local, save_every=5, quiet=True)
    run.train(tiny_trainer(run, max_steps=10))
    saved = json.loads((drive / "clock" / "checkpoints" / "checkpoint-10" / "colab_kit_state.json").read_text())
    assert saved["step"] == 10 and saved["train_seconds"] > 0
    again = ck.start_run("clock", drive=drive, local_dir=local, save_every=5, quiet=True)
    assert again.clock.seconds == pytest.approx(saved["train_seconds"], abs=1e-3)
    again.finish()
