"""start_run / run.train with the real HF Trainer on a tiny BERT (in-process, CPU)."""

import errno
import json
import re
import shutil
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerCallback

import colab_kit as ck
from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.journal import read_events
from colab_kit.checkpoints.manifest import read_manifest
from colab_kit.checkpoints.validity import verify_folder
from colab_kit.drive.lease import read_lease
from colab_kit.trainer.callbacks import DriveSyncCallback, SaveScheduleCallback
from colab_kit.tasks.demo import tiny_trainer, toy_classification


class StopAt(TrainerCallback):
    """Simulates a crash: raises once training reaches `step`."""

    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise RuntimeError(f"simulated crash at step {state.global_step}")


def weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def start(drive, local, name="t", **kw):
    kw.setdefault("save_every", 10)
    return ck.start_run(name, drive=drive, local_dir=local / name, **kw)


def events(run, kind=None):
    run.journal.flush(timeout=5)  # lines reach Drive from the mirror's thread, a moment later
    found = read_events(run.drive_dir / "events.jsonl")
    return [e for e in found if kind is None or e["event"] == kind]


def test_start_prints_summary_and_lays_out_the_folder(drive, local, capsys):
    run = start(drive, local)
    out = capsys.readouterr().out
    assert "colab_kit · run 't'" in out and f"persistent folder: {drive / 't'}" in out
    assert "no checkpoint found, starting fresh" in out and "host RAM limit" in out
    assert "durability: a plain folder; a checkpoint counts as safe once written, fsynced and read back" in out
    assert run.drive_dir == drive / "t" and run.resume_from is None
    assert (run.drive_dir / "checkpoints").is_dir() and read_lease(run.drive_dir) is not None
    run.finish()
    assert read_lease(run.drive_dir).released
    assert [e["event"] for e in events(run)] == ["start", "finish"]
    run.finish()  # idempotent
    assert "already finished" in capsys.readouterr().out


def test_env_var_names_the_root(monkeypatch, tmp_path, local):
    monkeypatch.setenv("COLAB_KIT_DRIVE", str(tmp_path / "elsewhere"))
    run = ck.start_run("envrun", local_dir=local, quiet=True)
    assert run.drive_dir == tmp_path / "elsewhere" / "envrun"
    run.finish()


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="a/b"), "use letters, digits"),
    (dict(name=""), "use letters, digits"),
    (dict(keep=0), "keep at least 1"),
    (dict(save_every=1.5), "int number of steps"),
    (dict(save_every="10 parsecs"), "10min"),
    (dict(save_every=0), "at least 1"),
])
def test_bad_arguments_say_what_to_do(drive, local, kwargs, message):
    kwargs = {"name": "ok", "drive": drive, "local_dir": local} | kwargs
    with pytest.raises(ValueError, match=message):
        ck.start_run(**kwargs)


def test_exact_resume_from_drive_after_a_crash_and_a_new_vm(drive, local):
    straight_run = start(drive, local, "straight", quiet=True)
    straight = tiny_trainer(straight_run, max_steps=60, dropout=0.1)
    straight_run.train(straight)

    run = start(drive, local, "crashy", quiet=True)
    trainer = tiny_trainer(run, max_steps=60, dropout=0.1, callbacks=None)
    trainer.add_callback(StopAt(37))
    with pytest.raises(RuntimeError, match="simulated crash"):
        run.train(trainer)
    assert [e["status"] for e in events(run, "finish")] == ["error"]
    shutil.rmtree(local / "crashy")  # a new VM: only Drive survives

    run = start(drive, local, "crashy", quiet=True)
    assert run.resume_from == local / "crashy" / "checkpoint-30"
    assert events(run, "resume")[-1]["origin"] == "drive"
    resumed = tiny_trainer(run, max_steps=60, dropout=0.1)
    output = run.train(resumed)
    assert output.global_step == 60
    assert max_diff(weights(straight), weights(resumed)) <= 1e-6


def test_callbacks_are_added_once(drive, local):
    run = start(drive, local, quiet=True)
    trainer = tiny_trainer(run, max_steps=5, callbacks=run.callbacks())
    run.train(trainer)
    kinds = [type(cb) for cb in trainer.callback_handler.callbacks]
    assert kinds.count(SaveScheduleCallback) == 1 and kinds.count(DriveSyncCallback) == 1


def test_saves_and_the_export_print_no_shard_bars_and_leave_other_bars_alone(drive, local, capsys):
    from transformers.utils import logging as hf_logging

    run = start(drive, local, save_every=2, quiet=True)
    trainer = tiny_trainer(run, max_steps=6)
    run.train(trainer)
    run.save_final(trainer.model)
    out = capsys.readouterr()
    assert "Writing model shards" not in out.out + out.err  # 3 checkpoints and final/: 4 bars before
    assert hf_logging._tqdm_hook is None  # put back as it was
    trainer.save_model(str(local / "plain-save"))  # outside the kit, the Trainer's own bar is back
    assert "Writing model shards" in capsys.readouterr().err


def test_final_step_is_always_saved_and_rerun_does_not_train_again(drive, local, capsys):
    run = start(drive, local, save_every="1h", quiet=True)
    run.train(tiny_trainer(run, max_steps=7))
    assert [s for s, _ in list_checkpoints(run.drive_dir / "checkpoints")] == [7]
    manifest = read_manifest(run.drive_dir / "checkpoints" / "checkpoint-7")
    assert manifest.fingerprint["effective_batch"] == 16 and manifest.kit_version == ck.__version__

    again = start(drive, local, save_every="1h", quiet=True)
    trainer = tiny_trainer(again, max_steps=7)
    before = weights(trainer)
    output = again.train(trainer)
    assert output.global_step == 7 and output.metrics["already_complete"]
    assert max_diff(before, weights(trainer)) > 0  # the trained weights were loaded
    assert "already reached step 7" in capsys.readouterr().out
    assert not (again.drive_dir / "checkpoints" / "checkpoint-8").exists()


@pytest.mark.parametrize("change, message", [
    (dict(batch_size=32), r"effective batch size: 16 then, 32 now"),
    (dict(gradient_accumulation_steps=2), r"effective batch size: 16 then, 32 now"),
])
def test_incompatible_change_stops_with_the_call_to_start_fresh(drive, local, change, message):
    run = start(drive, local, quiet=True)
    run.train(tiny_trainer(run, max_steps=10))
    run = start(drive, local, quiet=True)
    with pytest.raises(ck.ResumeMismatchError, match=message + r".*ck.start_run\('t', resume=False\)"):
        run.train(tiny_trainer(run, max_steps=20, **change))
    run.finish()


def test_different_model_shape_is_refused(drive, local):
    from transformers import BertForSequenceClassification

    from colab_kit.tasks.demo import tiny_bert_config

    run = start(drive, local, quiet=True)
    run.train(tiny_trainer(run, max_steps=10))
    run = start(drive, local, quiet=True)
    trainer = tiny_trainer(run, max_steps=20)
    trainer.model = BertForSequenceClassification(tiny_bert_config(hidden=48))
    with pytest.raises(ck.ResumeMismatchError, match="model tensor names/shapes"):
        run.train(trainer)
    run.finish()


def test_fresh_start_archives_old_checkpoints(drive, local, capsys):
    run = start(drive, local, quiet=True)
    run.train(tiny_trainer(run, max_steps=10))
    run = start(drive, local, resume=False)
    assert run.resume_from is None and "earlier checkpoints moved to" in capsys.readouterr().out
    archived = list((run.drive_dir / "archive").iterdir())
    assert len(archived) == 1 and verify_folder(archived[0] / "checkpoint-10") is None
    assert list_checkpoints(run.drive_dir / "checkpoints") == []
    run.finish()


def test_two_fresh_starts_in_one_second_keep_both_archives_whole(drive, local, monkeypatch):
    """A folder moved aside never lands on another one: two fresh starts within one second of the clock (a rerun
    cell) archive to two names, each checkpoint whole (the time alone named them once, and the second move went
    onto the first)."""
    from colab_kit.checkpoints import checkpoint

    monkeypatch.setattr(checkpoint, "time", SimpleNamespace(strftime=lambda fmt, t: "20261208-000000",
                                                            gmtime=time.gmtime))
    run = start(drive, local, quiet=True)
    run.train(tiny_trainer(run, max_steps=10))
    for _ in range(2):
        run = start(drive, local, resume=False, quiet=True)
        run.train(tiny_trainer(run, max_steps=10))
    run.finish()
    archived = sorted((run.drive_dir / "archive").iterdir())
    assert len(archived) == 2, archived
    assert all(a.name.startswith("checkpoints-20261208-000000-") for a in archived), archived
    assert [[p.name for _, p in list_checkpoints(a)] for a in archived] == [["checkpoint-10"]] * 2
    assert all(verify_folder(a / "checkpoint-10") is None for a in archived)


def test_a_second_runtime_is_refused_while_the_lease_is_live(drive, local):
    import subprocess
    import sys

    run = start(drive, local, quiet=True)
    second = ("import colab_kit as ck, sys\n"
              "try:\n"
              f"    ck.start_run('t', drive={str(drive)!r}, local_dir={str(local / 'b')!r}, quiet=True)\n"
              "except ck.LeaseHeldError as e:\n"
              "    print(e); sys.exit(3)\n")
    refused = subprocess.run([sys.executable, "-c", second], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 3, refused.stderr
    assert "in use by another runtime" in refused.stdout and "takeover=True" in refused.stdout
    taking = second.replace("quiet=True)", "quiet=True, takeover=True).finish()")
    took = subprocess.run([sys.executable, "-c", taking], capture_output=True, text=True, timeout=120)
    assert took.returncode == 0, took.stderr
    assert run.lease.beat() is False and run.lease.lost  # the first runtime notices it lost the folder
    run._lease_lost(None)
    summary = run.finish(timeout=1)
    assert summary["synced"] is False and run._finished


def test_rerunning_start_run_in_the_same_kernel_closes_the_first(drive, local, capsys):
    first = start(drive, local, quiet=True)
    second = start(drive, local, quiet=True)
    assert "finishing this kernel's open run 't' first\n" in capsys.readouterr().out
    assert [e.get("status") for e in events(second, "finish")] == ["reopened"]
    second.finish()
    assert first._finished


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.ENOTCONN])
def test_drive_trouble_during_training_never_stops_it(drive, local, drive_faults, capsys, code):
    class Trouble(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 15:
                drive_faults.fail(code)
            if state.global_step == 45:
                drive_faults.heal()

    run = start(drive, local, quiet=True)
    run.mirror.backoff = (0.01, 0.05)
    trainer = tiny_trainer(run, max_steps=60)
    trainer.add_callback(Trouble())
    output = run.train(trainer)
    assert output.global_step == 60
    # Which checkpoint fails first depends on how far the upload of checkpoint-10 got.
    assert re.search(r"could not sync checkpoint-(10|20|30|40) ", capsys.readouterr().err)
    warns = [e for e in events(run, "warn") if e["what"] == "sync_failed"]
    assert warns and warns[0]["errno"] == code
    assert events(run, "finish")[-1]["synced"] is True and run.mirror.written_step == 60
    assert verify_folder(run.drive_dir / "checkpoints" / "checkpoint-60") is None


def test_finish_reports_unsynced_checkpoints_and_can_be_called_again(drive, local, drive_faults, capsys):
    run = start(drive, local, quiet=True)
    run.mirror.backoff = (0.01, 0.05)
    trainer = tiny_trainer(run, max_steps=10)
    drive_faults.fail(errno.EIO)
    trainer.train()  # the user's own train() call with run.callbacks() not added: add them
    trainer.add_callback(run.callbacks()[0])
    trainer.add_callback(run.callbacks()[1])
    trainer.args.max_steps = 12
    trainer.train(resume_from_checkpoint=None)
    summary = run.finish(timeout=0.3)
    assert summary["synced"] is False and "NOT YET ON DRIVE" in capsys.readouterr().err
    drive_faults.heal()
    summary = run.finish(timeout=10)
    assert summary["synced"] is True and run.mirror.written_step == 12


class CountingDataset(torch.utils.data.Dataset):
    def __init__(self, base):
        self.base, self.loads = base, 0

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        self.loads += 1
        return self.base[i]


@pytest.mark.parametrize("stop", [20, 50])
def test_resume_skips_seen_data_by_index_without_loading_it(drive, local, stop):
    name = f"count{stop}"
    run = start(drive, local, name, quiet=True)
    trainer = tiny_trainer(run, max_steps=60, batch_size=8)
    trainer.add_callback(StopAt(stop + 1))
    with pytest.raises(RuntimeError):
        run.train(trainer)
    run = start(drive, local, name, quiet=True)
    assert run.resume_from.name == f"checkpoint-{stop}"
    data = CountingDataset(toy_classification(n=1024))
    run.train(tiny_trainer(run, max_steps=60, batch_size=8, train_dataset=data))
    # Only the samples still to train on, plus the one batch accelerate's DataLoaderShard reads
    # ahead to detect the end: constant, not growing with the position (skipping by loading
    # would cost stop * 8 more loads).
    assert (60 - stop) * 8 <= data.loads <= (60 - stop + 1) * 8


def test_a_corrupted_newest_checkpoint_on_drive_is_skipped_with_a_warning(drive, local, capsys):
    run = start(drive, local, quiet=True)
    run.train(tiny_trainer(run, max_steps=20))
    shutil.rmtree(local / "t")
    newest = drive / "t" / "checkpoints" / "checkpoint-20" / "model.safetensors"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x01
    newest.write_bytes(bytes(data))
    run = start(drive, local)
    err = capsys.readouterr().err
    assert run.resume_from == local / "t" / "checkpoint-10"
    assert "skipping checkpoint" in err and "checkpoint-20" in err and "sha256" in err
    warn = [e for e in events(run, "warn") if e["what"] == "invalid_checkpoint"][-1]
    assert warn["path"].endswith("checkpoint-20")
    run.finish()


def test_errno_107_remounts_colabs_drive_from_the_mirrors_thread_never_the_training_loop(
        drive, local, fake_colab, monkeypatch, tmp_path, drive_faults):
    import threading

    import colab_kit.drive.mount

    monkeypatch.setattr(colab_kit.drive.mount, "COLAB_MOUNT", str(tmp_path / "content" / "drive"))
    mount, where = fake_colab.drive.mount, []
    fake_colab.drive.mount = lambda *a, **k: (where.append(threading.current_thread().name), mount(*a, **k))[1]
    run = start(drive, local, quiet=True, save_every=2)
    run.on_drive = True  # as if the folder were on /content/drive
    drive_faults.fail(errno.ENOTCONN)  # the mount answers "Transport endpoint is not connected"

    def heal_once_remounted():
        deadline = time.monotonic() + 20
        while not where and time.monotonic() < deadline:
            time.sleep(0.02)
        drive_faults.heal()

    healer = threading.Thread(target=heal_once_remounted)
    healer.start()
    run.train(tiny_trainer(run, max_steps=6))  # ends once the last checkpoint is written, after the heal
    healer.join()
    assert fake_colab.calls == [(str(tmp_path / "content" / "drive"), True)]  # force_remount=True, and once
    assert where == ["colab_kit-mirror"]  # not the training loop: a remount may hang on a sick mount
    assert run.status()["written_step"] == 6
    assert "remounted_drive" in [e.get("what") for e in events(run, "warn")]


def test_an_unwritable_drive_at_start_is_a_clear_drive_error(drive, local, drive_faults):
    drive_faults.fail(errno.EROFS)
    with pytest.raises(ck.DriveError, match="cannot create the run folder .*writable"):
        start(drive, local)


def test_length_grouped_batches_resume_exactly_in_a_later_epoch(drive, local):
    """LengthGroupedSampler has no per-epoch seed of its own: the kit gives it one."""
    from colab_kit.tasks.demo import toy_classification

    def ragged():
        data = toy_classification(n=96)
        return data.map(lambda row, i: {"input_ids": row["input_ids"][: 8 + i % 16]}, with_indices=True)

    def trainer_for(run):
        from colab_kit.rna import nucleotide_tokenizer
        from transformers import DataCollatorWithPadding

        trainer = tiny_trainer(run, max_steps=30, batch_size=8, dropout=0.0, train_dataset=ragged(),
                               **ck.memory_args(run.runtime))
        trainer.data_collator = DataCollatorWithPadding(nucleotide_tokenizer())  # pads with id 0
        return trainer

    straight_run = start(drive, local, "lg-straight", quiet=True)
    straight = trainer_for(straight_run)
    straight_run.train(straight)

    run = start(drive, local, "lg", quiet=True)
    trainer = trainer_for(run)
    trainer.add_callback(StopAt(27))  # 12 steps per epoch: the crash is in epoch 3
    with pytest.raises(RuntimeError):
        run.train(trainer)
    shutil.rmtree(local / "lg")
    run = start(drive, local, "lg", quiet=True)
    assert run.resume_from.name == "checkpoint-20"
    resumed = trainer_for(run)
    run.train(resumed)
    assert max_diff(weights(straight), weights(resumed)) <= 1e-6


def test_save_final_exports_a_verified_model_after_the_run(drive, local, drive_faults):
    from colab_kit.rna import nucleotide_tokenizer
    from transformers import AutoModelForSequenceClassification

    from colab_kit.checkpoints.manifest import read_manifest

    run = start(drive, local, "final", quiet=True)
    trainer = tiny_trainer(run, max_steps=5)
    run.train(trainer)
    target = run.save_final(trainer.model, nucleotide_tokenizer(), metrics={"accuracy": 0.5})
    assert target == drive / "final" / "final"
    assert verify_folder(target) is None and read_manifest(target).step == 5
    assert {"model.safetensors", "config.json", "tokenizer.json", "metrics.json"} <= set(read_manifest(target).files)
    reloaded = AutoModelForSequenceClassification.from_pretrained(target)
    assert max_diff(weights(trainer), {k: v for k, v in reloaded.state_dict().items()}) == 0
    assert events(run, "final")[-1]["path"] == str(target)
    assert json.loads((drive / "final" / "metrics.json").read_text()) == {"accuracy": 0.5}
    drive_faults.fail(errno.EIO)
    with pytest.raises(ck.DriveError, match="saved on local disk at .*call run.save_final.*still holds the previous "
                                            "export, whole"):
        run.save_final(trainer.model, retries=1)
    drive_faults.heal()
    assert verify_folder(target) is None  # a failed export never half-replaces the last one (issue 38)
