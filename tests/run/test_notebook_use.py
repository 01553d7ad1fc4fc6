"""The notebook as people use it (issue 28), in-process: a trainer kept in the kernel after its run
finished, a run that lost its lease, a cell run again under another name, a changed learning rate.

Each test ends by checking that no checkpoint was lost (the persistent folder holds a verified one of
the last step saved) and that the message printed names the next action.
"""

import json
import os
import signal
import time
from dataclasses import asdict

import pytest
from transformers import TrainerCallback

import colab_kit as ck
from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.journal import read_events
from colab_kit.checkpoints.validity import verify_folder
from colab_kit.drive.lease import LEASE, LeaseInfo
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
    run = ck.start_run(name, drive=drive, local_dir=local / name, gauges=False, quiet=True, **kw)
    # start_run's first beat (the first status page) runs in the heartbeat's thread: wait for it, so that a test
    # that then writes another runtime's lease does not race it (a beat that read our lease before that write
    # would rename ours over it, as any two writers of one Drive file can).
    deadline = time.monotonic() + 10
    while not (run.drive_dir / "STATUS.md").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return run


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


class TakeOverAt(TrainerCallback):
    """Another runtime takes the run folder over at `step`; this runtime's heartbeat then finds it."""

    def __init__(self, run, step):
        self.run, self.step = run, step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            assert self.run.mirror.drain(timeout=60)  # what was saved before is written (on a loaded machine too)
            foreign_lease(self.run.drive_dir)
            assert self.run.lease.step(self.run._lease_lost) is False  # the heartbeat's own check


def foreign_lease(folder):
    info = LeaseInfo(host="other-vm", pid=4242, pid_start=None, session="theirs", started=time.time(),
                     heartbeat=time.time(), heartbeat_s=30.0)
    (folder / LEASE).write_text(json.dumps(asdict(info)))


def test_finding_4_a_runtime_that_lost_its_lease_stops_training_at_the_next_step(drive, local):
    # Before: "this one stopped syncing ... training continues", and it trained to the end beside the new owner.
    run = start(drive, local, save_every=5)
    trainer = tiny_trainer(run, max_steps=60, callbacks=[TakeOverAt(run, 12)])
    with pytest.raises(ck.LeaseLostError) as err:
        run.train(trainer)
    said = str(err.value)
    assert trainer.state.global_step == 12  # stopped at the step where the loss was seen
    assert "host other-vm, pid 4242" in said and "stopped training at step 12" in said
    assert "checkpoint-10" in said and "run the start_run cell again with takeover=True" in said
    assert drive_steps(run)[-1] == 10  # what was written before the takeover stays
    assert json.loads((run.drive_dir / LEASE).read_text())["session"] == "theirs"  # the new owner's, untouched


def test_a_lost_lease_names_a_checkpoint_that_only_this_vm_holds(drive, local):
    # The takeover came before the uploader wrote the newest save: the message says where that one is.
    run = start(drive, local, save_every=None)
    (run.local_dir / "checkpoint-7").mkdir(parents=True)  # saved by the Trainer, not yet written to Drive
    run._lease_lost(LeaseInfo(host="other-vm", pid=4242, pid_start=None, session="theirs", started=time.time(),
                              heartbeat=time.time(), heartbeat_s=30.0))
    with pytest.raises(ck.LeaseLostError, match=r"stopped training at step 8: .*; checkpoint-7 was not written "
                       r"there and stays only on this VM's disk \(" + str(run.local_dir)):
        run.stop_if_lease_lost(8)
    run.finish(timeout=5)


def test_a_plain_loop_that_lost_its_lease_cannot_save(drive, local):
    import torch

    run = start(drive, local, save_every=None)
    store = run.checkpoint_store()
    foreign_lease(run.drive_dir)
    assert run.lease.step(run._lease_lost) is False
    with pytest.raises(ck.LeaseLostError, match="host other-vm, pid 4242.*takeover=True"):
        store.save(1, model=torch.nn.Linear(2, 2))
    run.finish(timeout=5)


def test_a_run_no_variable_holds_is_finished_when_the_next_one_trains(drive, local, monkeypatch, capsys):
    # Before: the start_run cell run again under a new RUN_NAME left the old run open (two uploaders, two
    # lease threads, released: false until the kernel exited).
    from colab_kit.lifecycle import registry

    namespace = {}  # the notebook's variables
    monkeypatch.setattr(registry, "user_namespace", lambda: namespace)
    namespace["run"] = first = start(drive, local, name="a")
    namespace["pretrain_run"] = other = start(drive, local, name="a-mlm")
    assert not first._finished  # a run a variable holds stays open (the RNA notebook pre-trains this way)
    other.finish(timeout=10)
    namespace["run"] = second = start(drive, local, name="b")  # the cell again, RUN_NAME changed: `run` rebound
    assert not first._finished  # held by `run` while start_run ran
    second.train(tiny_trainer(second, max_steps=3))
    assert first._finished and json.loads((first.drive_dir / LEASE).read_text())["released"]
    assert not first.mirror.alive and not first.lease._thread.is_alive()
    assert ("finishing run 'a', which no variable of this notebook holds any more, before run 'b' trains"
            in capsys.readouterr().out)
    assert [e.get("status") for e in read_events(first.drive_dir / "events.jsonl") if e["event"] == "finish"] \
        == ["no longer held"]


class Rates(TrainerCallback):
    """The learning rate after each optimizer step, as the Trainer's scheduler reports it."""

    def __init__(self):
        self.at = {}

    def on_step_end(self, args, state, control, lr_scheduler=None, **kwargs):
        self.at[state.global_step] = lr_scheduler.get_last_lr()[0]


def test_finding_3_a_changed_learning_rate_is_said_as_the_trainer_applies_it(drive, local, capsys):
    # Before: "resuming with changed settings: learning_rate 0.002 -> 0.001, max_steps 20 -> 40", while the
    # restored scheduler kept 0.002 and the rate rose again on the longer schedule.
    first = start(drive, local)
    trainer = tiny_trainer(first, max_steps=20, learning_rate=2e-3, callbacks=[Interrupt(12)])
    with pytest.raises(KeyboardInterrupt):
        first.train(trainer)
    second = start(drive, local)
    rates = Rates()
    resumed = tiny_trainer(second, max_steps=40, learning_rate=1e-3, callbacks=[rates])
    second.train(resumed)
    second.finish(timeout=10)
    said = " ".join(capsys.readouterr().err.split())  # the kit's warnings go to stderr
    assert "learning_rate 0.002 -> 0.001 is not applied" in said and "keep the base rate 0.002" in said
    assert "ck.start_run('nb', resume=False)" in said and "set learning_rate=0.002 again" in said
    # Linear decay with no warmup: 0.002 * (20 - 10) / 20 = 1e-3 at step 10 before, 0.002 * 30 / 40 after.
    assert "max_steps 20 -> 40: the schedule is rebuilt" in said
    assert "at step 10 the rate goes from 1.00e-03 to 1.50e-03, up again" in said
    assert rates.at[11] == pytest.approx(2e-3 * 29 / 40)  # what the Trainer did: the words were true


class PressStop(TrainerCallback):
    """The notebook's stop button (SIGINT to the kernel) pressed `presses` times at `step`."""

    def __init__(self, step, presses=1):
        self.step, self.presses = step, presses

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.step = None
            for _ in range(self.presses):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # Python runs the handler between two bytecodes of this thread


@pytest.fixture
def notebook(monkeypatch):
    """A kernel's setting: in a notebook, with Python's own SIGINT handler (restored after the test)."""
    from colab_kit.trainer import stop

    monkeypatch.setattr(stop, "in_notebook", lambda: True)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def straight_weights(drive, local, steps):
    run = start(drive, local, name="straight")
    trainer = tiny_trainer(run, max_steps=steps)
    run.train(trainer)
    run.finish(timeout=10)
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


@pytest.mark.parametrize("presses", [1, 2], ids=["once", "twice"])
def test_finding_2_the_stop_button_pauses_and_the_cell_run_again_continues(drive, local, notebook, capsys, presses):
    # Before: the run was finished at the first press, and running the cell again said to call ck.start_run.
    run = start(drive, local, save_every=10)
    trainer = tiny_trainer(run, max_steps=20, callbacks=[PressStop(13, presses)])
    with pytest.raises(KeyboardInterrupt):  # the cell ends as stopped: a "Run all" goes no further
        run.train(trainer)
    said = " ".join(capsys.readouterr().out.split())
    assert not run._finished and trainer.state.global_step == 13
    if presses == 1:  # this step finished and was saved: nothing is redone
        assert "stopped at step 13; checkpoint-13 is saved" in said and "nothing will be redone" in said
    else:  # at once: back to the last save
        assert "stopped at step 13; checkpoint-10 is saved" in said and "the 3 step(s) since it will be redone" in said
    assert "The run stays open: run this cell again to continue from there." in said
    run.train(trainer)  # the training cell, run again
    run.finish(timeout=10)
    assert trainer.state.global_step == 20 and drive_steps(run)[-1] == 20
    final = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    reference = straight_weights(drive, local, 20)
    assert max((final[k] - reference[k]).abs().max().item() for k in final) <= 1e-6  # as if never stopped


def test_ctrl_c_in_a_script_still_stops_and_finishes_the_run(drive, local):
    # Outside a notebook the stop button is not armed: Ctrl-C keeps Python's meaning.
    run = start(drive, local, save_every=10)
    trainer = tiny_trainer(run, max_steps=20, callbacks=[Interrupt(13)])
    with pytest.raises(KeyboardInterrupt):
        run.train(trainer)
    assert run._finished
    with pytest.raises(ck.ColabKitError, match="run the start_run cell again .* then this cell"):
        run.train(trainer)


def test_finding_5_a_full_local_disk_is_named_before_the_save(drive, local, monkeypatch):
    # Before: torch's "unexpected pos 1781312 vs 1781200" half-way through the checkpoint, and nothing said
    # the disk was full. Here the VM's disk fills after checkpoint-10 (a fault at the storage seam).
    from colab_kit.checkpoints import storage

    run = start(drive, local, save_every=10)
    real_free = storage.free_bytes
    full = {"now": False}
    monkeypatch.setattr(storage, "free_bytes",
                        lambda path: 5_000 if full["now"] and str(path).startswith(str(local)) else real_free(path))

    class FillDisk(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            full["now"] = state.global_step >= 15

    trainer = tiny_trainer(run, max_steps=30, callbacks=[FillDisk()])
    with pytest.raises(OSError, match=r"the VM's disk is full: .* has 4.9 KiB free, and checkpoint-20 needs") as err:
        run.train(trainer)
    said = str(err.value)
    assert "Nothing was lost: checkpoint-10 is the newest saved" in said
    assert "run the start_run cell and this cell again" in said
    assert isinstance(err.value, ck.ColabKitError) and trainer.state.global_step == 20
    assert drive_steps(run)[-1] == 10 and not (run.local_dir / "checkpoint-20").exists()  # nothing half-written


def test_a_failed_write_on_a_full_disk_gets_a_note_that_says_so(tmp_path, monkeypatch):
    import types

    from colab_kit.checkpoints import storage
    from colab_kit.trainer.disk import explain_disk_full

    run = types.SimpleNamespace(local_dir=tmp_path, last_checkpoint_bytes=2_000_000, last_saved_step=40)
    monkeypatch.setattr(storage, "free_bytes", lambda path: 120_000)
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1781312 vs 1781200")
    explain_disk_full(run, torch_error, None)
    note = torch_error.__notes__[0]
    assert "the VM's disk is full" in note and "checkpoint-40 is the newest saved" in note
    other = RuntimeError("mat1 and mat2 shapes cannot be multiplied")
    explain_disk_full(run, other, None)
    assert not getattr(other, "__notes__", None)  # only a failed write is explained as a full disk


def test_finding_6_a_deleted_run_folder_is_named_and_the_start_run_cell_goes_on(drive, local, capsys, monkeypatch):
    # Before: "the run's lease could not be confirmed", with no hint that the folder was gone.
    import shutil

    import torch

    run = start(drive, local, save_every=None)
    store = run.checkpoint_store()
    model = torch.nn.Linear(2, 2)
    store.save(10, model=model)
    assert run.mirror.drain(timeout=10) and drive_steps(run) == [10]
    # Deleted in Drive's web page, say. The lease's heartbeat may write its temporary file meanwhile (the
    # checkpoint's confirmation beats at once): delete again until the folder is gone, as a person would.
    for _ in range(50):
        shutil.rmtree(run.drive_dir, ignore_errors=True)
        if not run.drive_dir.exists():
            break
        time.sleep(0.02)
    assert not run.drive_dir.exists()
    store.save(20, model=model)
    deadline = time.monotonic() + 10
    while run.mirror.publisher.failures == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    run.poll()
    said = " ".join(capsys.readouterr().err.split())
    assert f"the run folder {run.drive_dir} is gone (deleted or moved?): checkpoint-20 and what follows stay on " \
        f"this VM's disk, and training stops at its next step. Run the start_run cell again" in said
    with pytest.raises(ck.LeaseLostError, match=r"is gone \(deleted or moved\?\), so this runtime stopped training "
                       r"at step 21; nothing was deleted, and checkpoint-20 is saved on this VM's disk"):
        run.stop_if_lease_lost(21)  # what the training loop asks at its next step
    from colab_kit.lifecycle import finish

    monkeypatch.setattr(finish, "CLOSE_WAIT_S", 2.0)  # the earlier run can write nothing: it lets go
    again = start(drive, local, save_every=None)  # what the message says to do
    assert run._finished and not run.mirror.alive and not run.lease._thread.is_alive()
    assert again.resume_from is not None and again.resume_from.name == "checkpoint-20"  # nothing was lost
    again.finish(timeout=10)


def test_stop_pressed_while_finish_waits_releases_the_run_cleanly(drive, local, monkeypatch, capsys):
    # Before: a stop pressed during finish's silent wait left the run open, its lease held, its uploader alive.
    import torch

    from colab_kit.lifecycle import finish

    run = start(drive, local, save_every=None)
    run.mirror.publisher.may_write_next = lambda now, pace: False  # the write waits (a slow Drive)
    run.checkpoint_store().save(10, model=torch.nn.Linear(2, 2))
    waits = {"n": 0}
    show = finish.Countdown.show

    def press_stop_at_the_countdown(self, text):
        show(self, text)
        waits["n"] += 1
        raise KeyboardInterrupt

    monkeypatch.setattr(finish.Countdown, "show", press_stop_at_the_countdown)
    with pytest.raises(KeyboardInterrupt):
        run.finish(timeout=60)
    said = " ".join(capsys.readouterr().err.split() + capsys.readouterr().out.split())
    assert waits["n"] == 1 and run._finished and not run.mirror.alive  # the uploader's thread stopped
    assert json.loads((run.drive_dir / LEASE).read_text())["released"]  # the lease released
    assert "writing checkpoint-10 to the persistent folder" in said and "Press stop to leave it" in said


def test_finding_7_a_gpt2_resume_says_nothing_about_its_tied_head(drive, local, caplog):
    # Before: every resume logged "There were missing keys in the checkpoint model loaded: ['lm_head.weight']".
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, default_data_collator

    def trainer_for(run, steps):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
        ids = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(1))
        rows = [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": i} for i in ids]
        args = TrainingArguments(str(run.local_dir), max_steps=steps, per_device_train_batch_size=8, use_cpu=True,
                                 report_to=[], save_strategy="no", disable_tqdm=True)
        return Trainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator)

    first = start(drive, local, save_every=5)
    first.train(trainer_for(first, 5))
    first.finish(timeout=10)
    second = start(drive, local, save_every=5)
    trainer = trainer_for(second, 10)
    with caplog.at_level("WARNING"):
        second.train(trainer)
    second.finish(timeout=10)
    assert second.resume_from is not None and trainer.state.global_step == 10
    assert not [r for r in caplog.records if "missing keys" in r.getMessage()]
    assert trainer.model.lm_head.weight is trainer.model.transformer.wte.weight  # still tied
