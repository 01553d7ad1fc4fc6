"""The save schedule: time- and step-based, final step, the clock carried over a resume, and the
interval that stretches while Drive uploads more slowly than checkpoints are made."""

import types
from pathlib import Path

import pytest
from transformers import TrainerControl, TrainerState

import colab_kit as ck
from colab_kit._notices import Notices
from colab_kit.checkpoints.manifest import read_manifest
from colab_kit.drive.cloud import CloudTracker
from colab_kit.drive.drivefs import PLAIN
from colab_kit.trainer.callbacks import SaveScheduleCallback
from colab_kit.tasks.demo import tiny_trainer


class FakeClock:
    def __init__(self, seconds=0.0):
        self.seconds = seconds

    def start(self):
        pass

    def stop(self):
        pass


class FakeJournal:
    def __init__(self):
        self.events = []

    def write(self, event, **fields):
        self.events.append({"event": event, **fields})


def fake_run(save_every_s=None, save_every_steps=None, clock=None, resumed=False, rate_bps=None, last_bytes=0):
    """What the schedule reads of a run; `rate_bps` and `last_bytes` stand for measured uploads."""
    tracker = CloudTracker(PLAIN)
    if rate_bps:
        tracker._samples = [rate_bps]
    tracker.last_bytes = last_bytes
    return types.SimpleNamespace(save_every_s=save_every_s, save_every_steps=save_every_steps,
                                 clock=clock or FakeClock(), resume_from="x" if resumed else None,
                                 poll=lambda: None, stop_if_lease_lost=lambda step: None, local_dir=Path("."),
                                 last_checkpoint_bytes=0, last_saved_step=None, ranks=types.SimpleNamespace(writer=True),
                                 mirror=types.SimpleNamespace(tracker=tracker, prune_after="cloud"),
                                 journal=FakeJournal(), notices=Notices(), save_interval_s=save_every_s)


def begin(run, max_steps, global_step=0):
    """The schedule of `run`, after on_train_begin at `global_step`."""
    cb = SaveScheduleCallback(run)
    state = TrainerState(max_steps=max_steps, global_step=global_step)
    cb.on_train_begin(None, state, TrainerControl())
    return cb, state


def step(cb, state, n):
    state.global_step = n
    control = TrainerControl()
    cb.on_step_end(None, state, control)
    if control.should_save:
        cb.on_save(None, state, control)
    return control.should_save


def test_time_interval_counts_training_time():
    clock = FakeClock()
    cb, state = begin(fake_run(save_every_s=600, clock=clock), 1000)
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
    cb, state = begin(fake_run(save_every_s=600, clock=clock, resumed=True), 1000, global_step=40)
    clock.seconds = 3599
    assert not step(cb, state, 41)
    clock.seconds = 3600
    assert step(cb, state, 42)


def test_step_interval_and_final_step():
    cb, state = begin(fake_run(save_every_steps=10), 25)
    saves = [n for n in range(1, 26) if step(cb, state, n)]
    assert saves == [10, 20, 25]


def test_a_time_interval_stretches_to_what_drive_absorbs_and_says_so_once(capsys):
    # 10 MB checkpoints at 100 kB/s take 100 s to upload: "every 30s" becomes 125 s (25 % room).
    clock = FakeClock()
    run = fake_run(save_every_s=30, clock=clock, rate_bps=100_000, last_bytes=10_000_000)
    cb, state = begin(run, 1000)
    clock.seconds = 31
    assert not step(cb, state, 1)
    assert run.save_interval_s == pytest.approx(125)
    clock.seconds = 125
    assert step(cb, state, 2)
    clock.seconds = 200
    assert not step(cb, state, 3)
    assert run.notices.show() == 1  # told once, with the numbers
    told = capsys.readouterr().err
    assert "Drive uploads ~97.7 KiB/s; a 9.5 MiB checkpoint needs ~2 min; saving every 2 min instead of every 30 s" in told
    journaled = [e for e in run.journal.events if e.get("what") == "save_interval"]
    assert len(journaled) == 1 and journaled[0]["interval_s"] == 125 and journaled[0]["asked_s"] == 30
    run.mirror.tracker._samples = [1_000_000]  # uploads got fast again: back to every 30 s, journaled
    clock.seconds = 260
    assert step(cb, state, 4)
    assert run.save_interval_s == 30 and len([e for e in run.journal.events if e.get("what") == "save_interval"]) == 2


def test_a_step_interval_is_kept_but_a_slow_drive_is_pointed_out(capsys):
    clock = FakeClock()
    run = fake_run(save_every_steps=10, clock=clock, rate_bps=100_000, last_bytes=10_000_000)
    cb, state = begin(run, 100)
    saves = []
    for n in range(1, 31):
        clock.seconds = n * 2.0  # 20 s between saves, 100 s per upload
        if step(cb, state, n):
            saves.append(n)
    assert saves == [10, 20, 30]
    assert run.notices.show() == 1
    assert "saves come every 20 s (10 steps)" in capsys.readouterr().err
    assert [e["what"] for e in run.journal.events] == ["save_interval"]


def test_train_seconds_are_stored_in_the_manifest_and_restored(drive, local):
    run = ck.start_run("clock", drive=drive, local_dir=local, save_every=5, quiet=True)
    run.train(tiny_trainer(run, max_steps=10))
    folder = drive / "clock" / "checkpoints" / "checkpoint-10"
    saved = read_manifest(folder).kit_state
    assert saved["step"] == 10 and saved["train_seconds"] > 0
    assert not (folder / "colab_kit_state.json").exists()  # one file fewer to upload per checkpoint
    again = ck.start_run("clock", drive=drive, local_dir=local, save_every=5, quiet=True)
    assert again.clock.seconds == pytest.approx(saved["train_seconds"], abs=1e-3)
    again.finish()
