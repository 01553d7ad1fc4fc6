"""Notebook habits (issue 38, finding 6): the stop button pressed while `start_run` watches another VM's lease
or opens the run, a trainer kept from an earlier run trained under a new RUN_NAME, and an export that does not
finish after "Run all" again. Nothing is left running, nothing of another run is written over, and `final/`
is never half-replaced; each says what happened and what to do next.
"""

import hashlib
import json
import threading
import time
from dataclasses import asdict

import pytest
from test_run import start

import colab_kit as ck
from colab_kit.checkpoints import storage
from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.validity import verify_folder
from colab_kit.drive.lease import LEASE, Lease, LeaseInfo, read_lease
from colab_kit.run import start as start_module
from colab_kit.lifecycle.registry import open_runs
from colab_kit.tasks.demo import tiny_trainer


def kit_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.name.startswith("colab_kit") and t.is_alive())


def foreign_lease(run_dir, heartbeat_s=1.0) -> LeaseInfo:
    run_dir.mkdir(parents=True, exist_ok=True)
    info = LeaseInfo(host="other-vm", pid=4242, pid_start=None, session="theirs", started=time.time(),
                     heartbeat=time.time(), heartbeat_s=heartbeat_s)
    (run_dir / LEASE).write_text(json.dumps(asdict(info)))
    return info


def stop_at(monkeypatch, owner, name):
    """The stop button, pressed when `owner.name` is called."""
    def pressed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, pressed)


# -- (a) the stop button while start_run claims or opens the run ---------------------------------------------
def test_stop_while_watching_another_vms_lease_takes_nothing_and_says_what_to_do(drive, local, monkeypatch, capsys):
    foreign_lease(drive / "r")
    before = kit_threads()

    class Pressed:  # the countdown of the watch is shown once a second: the stop lands while it watches
        def __init__(self, *args, **kwargs):
            pass

        def show(self, text):
            raise KeyboardInterrupt

    monkeypatch.setattr(start_module, "Countdown", Pressed)
    with pytest.raises(KeyboardInterrupt):
        ck.start_run("r", drive=drive, local_dir=local / "r", gauges=False)
    said = capsys.readouterr().out
    assert "stopped while watching whether host other-vm still writes" in said
    assert "nothing was taken over and no run is open. Run this cell again" in said and "takeover=True" in said
    assert read_lease(drive / "r").session == "theirs"  # untouched
    assert kit_threads() == before and open_runs() == []


@pytest.mark.parametrize("owner, name", [
    ("mirror", "adopt_existing"), ("start", "_journal_found"), ("lease", "start_heartbeat"), ("start", "register"),
])
def test_stop_while_the_run_opens_leaves_no_uploader_and_releases_the_folder(drive, local, monkeypatch, capsys,
                                                                             owner, name):
    """Before: a stop after the uploader started left its thread (or the heartbeat's) running for good, the
    lease unreleased, and no run registered to close it; the next start_run took the folder over from itself."""
    from colab_kit.drive.mirror import Mirror

    run = start(drive, local, "r", quiet=True, gauges=False)  # a checkpoint to resume from
    run.train(tiny_trainer(run, max_steps=10))
    run.finish(timeout=30)
    before = kit_threads()
    stop_at(monkeypatch, {"mirror": Mirror, "start": start_module, "lease": Lease}[owner], name)
    with pytest.raises(KeyboardInterrupt):
        ck.start_run("r", drive=drive, local_dir=local / "r", gauges=False)
    said = capsys.readouterr().out
    assert "is released again, so nothing more is written there. Run this cell again" in said
    assert kit_threads() == before and open_runs() == []
    assert read_lease(drive / "r").released
    monkeypatch.undo()
    again = start(drive, local, "r", gauges=False)
    assert "took over" not in capsys.readouterr().out and again.resume_manifest.step == 10
    again.finish(timeout=30)


# -- (b) a trainer kept from an earlier run, trained under a new RUN_NAME -----------------------------------
def local_hashes(folder) -> dict:
    return {path.name: hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()
            for _, path in list_checkpoints(folder)}


def test_a_trainer_kept_from_run_a_saves_into_run_bs_folder_and_run_a_resumes_its_own_weights(drive, local, capsys):
    run_a = start(drive, local, "a", save_every=5, quiet=True, gauges=False)
    trainer = tiny_trainer(run_a, max_steps=10)
    run_a.train(trainer)
    run_a.finish(timeout=30)
    a_before = local_hashes(run_a.local_dir)
    run_b = start(drive, local, "b", save_every=5, quiet=True, gauges=False)
    run_b.train(trainer)  # the same trainer object, still in the kernel
    run_b.finish(timeout=30)
    said = capsys.readouterr().out
    assert f"this trainer was made for run 'a': it now saves into the local folder of run 'b', {run_b.local_dir}" in said
    assert "starts at step 0 from those weights" in said
    assert trainer.args.output_dir == str(run_b.local_dir)
    assert local_hashes(run_a.local_dir) == a_before  # before: run b's saves were written over run a's
    assert [s for s, _ in list_checkpoints(run_b.local_dir)] == [10, 5]
    again = start(drive, local, "a", save_every=5, quiet=True, gauges=False)
    drive_copy = drive / "a" / "checkpoints" / "checkpoint-10" / "model.safetensors"
    resumed = again.resume_from / "model.safetensors"
    assert resumed.read_bytes() == drive_copy.read_bytes()  # before: run b's weights, from the local disk
    again.finish(timeout=30)


# -- (c) the export after "Run all" again ------------------------------------------------------------------------
def test_run_all_again_leaves_the_verified_export_and_a_stopped_new_one_never_half_replaces_it(drive, local,
                                                                                               monkeypatch, capsys):
    run = start(drive, local, "f", quiet=True, gauges=False)
    trainer = tiny_trainer(run, max_steps=5)
    run.train(trainer)
    target = run.save_final(trainer.model, metrics={"accuracy": 0.5})
    first = (target / "MANIFEST.json").read_bytes()
    stamp = (target / "MANIFEST.json").stat().st_mtime_ns
    capsys.readouterr()
    run.save_final(trainer.model, metrics={"accuracy": 0.5})  # "Run all" again: the same model
    assert "already holds this model (verified); it is left as it is" in capsys.readouterr().out
    assert (target / "MANIFEST.json").stat().st_mtime_ns == stamp
    copy_file = storage.copy_file
    copied = []

    def stopped_on_the_second_file(src, dst, *args, **kwargs):
        if ".final.new-" in str(dst):
            copied.append(dst)
            if len(copied) == 2:
                raise KeyboardInterrupt
        return copy_file(src, dst, *args, **kwargs)

    monkeypatch.setattr(storage, "copy_file", stopped_on_the_second_file)
    with pytest.raises(KeyboardInterrupt):
        run.save_final(trainer.model, metrics={"accuracy": 0.75})  # another export, stopped half-way
    assert "still holds the previous export, whole. Run this cell again" in capsys.readouterr().out
    assert verify_folder(target) is None and (target / "MANIFEST.json").read_bytes() == first  # before: no manifest
    monkeypatch.undo()
    run.save_final(trainer.model, metrics={"accuracy": 0.75})
    assert verify_folder(target) is None
    assert json.loads((target / "metrics.json").read_text()) == {"accuracy": 0.75}
    archived = sorted((drive / "f" / "archive").iterdir())
    assert any((path / "MANIFEST.json").is_file() and (path / "MANIFEST.json").read_bytes() == first
               and verify_folder(path) is None for path in archived)  # the replaced export is kept, whole
    assert not [p for p in (drive / "f").iterdir() if p.name.startswith(".final.new-")]
    run.finish(timeout=30)
