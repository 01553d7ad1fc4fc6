"""The session's end (issue 40): `run.finish(release_runtime=True)` gives the Colab runtime back only once
every checkpoint and `final/` is confirmed in the cloud, and keeps it, saying why, whenever something is not.

The runtime is released through a stand-in `google.colab.runtime` whose `unassign` records what the cloud
(the DriveFS emulator's cloud side) held at the moment it was called.
"""

import types

import pytest

import colab_kit as ck
from colab_kit.checkpoints.manifest import read_manifest
from colab_kit.tasks.demo import tiny_trainer


@pytest.fixture
def colab_runtime(fake_colab, monkeypatch):
    """`google.colab.runtime` whose `unassign` runs `colab_runtime.on_unassign()` and records its answer."""
    module = types.ModuleType("google.colab.runtime")
    module.released, module.on_unassign = [], lambda: True

    def unassign():
        module.released.append(module.on_unassign())

    module.unassign = unassign
    fake_colab.runtime = module
    monkeypatch.setitem(__import__("sys").modules, "google.colab.runtime", module)
    return module


def test_the_runtime_is_released_only_once_the_last_checkpoint_and_final_are_in_the_cloud(tmp_path, emulated_drive,
                                                                                         colab_runtime, capsys):
    drive = emulated_drive(rate=3e5)  # a ~3 MB checkpoint takes ~10 s to reach the cloud
    run = ck.start_run("end", drive=drive.mountpoint, local_dir=tmp_path / "local", save_every=5, keep=2,
                       quiet=True, gauges=False)
    trainer = tiny_trainer(run, max_steps=10, vocab_size=8000)
    run.train(trainer)
    run.save_final(trainer.model)

    def cloud_holds_everything():  # what the cloud side holds when Colab is asked to let the VM go
        cloud = drive.cloud / "end"
        return read_manifest(cloud / "checkpoints" / "checkpoint-10").step == 10 and any((cloud / "final").iterdir())

    colab_runtime.on_unassign = cloud_holds_everything
    summary = run.finish(timeout=1, release_runtime=True)  # still uploading: kept
    assert summary["in_cloud"] is False and colab_runtime.released == []
    said = capsys.readouterr().out
    assert "the runtime is KEPT" in said and "not yet confirmed in the cloud" in said

    summary = run.finish(timeout=120, release_runtime=True)  # waits for the cloud, then lets the runtime go
    assert summary["in_cloud"] is True
    assert colab_runtime.released == [True]  # called once, and the cloud held everything by then
    assert "everything is in the cloud (newest checkpoint-10); releasing this Colab runtime" in capsys.readouterr().out


def test_a_mount_without_upload_attributes_keeps_the_runtime(tmp_path, emulated_drive, colab_runtime, capsys):
    drive = emulated_drive(rate=4e6, attrs=False)  # nothing can confirm an upload there
    run = ck.start_run("blind", drive=drive.mountpoint, local_dir=tmp_path / "local", save_every=5, quiet=True,
                       gauges=False)
    run.train(tiny_trainer(run, max_steps=5))
    run.finish(timeout=30, release_runtime=True)
    assert colab_runtime.released == []
    assert "the runtime is KEPT: this Drive mount does not report uploads" in capsys.readouterr().out


def test_a_plain_folder_keeps_the_runtime_and_outside_colab_nothing_is_released(drive, local, colab_runtime,
                                                                                capsys, monkeypatch):
    run = ck.start_run("plain", drive=drive, local_dir=local / "plain", save_every=5, quiet=True, gauges=False)
    run.train(tiny_trainer(run, max_steps=5))
    run.finish(timeout=30, release_runtime=True)
    assert colab_runtime.released == []
    assert "is a plain folder on this machine, with no cloud behind it" in capsys.readouterr().out

    monkeypatch.delitem(__import__("sys").modules, "google.colab")  # a laptop: not Colab
    monkeypatch.delenv("COLAB_RELEASE_TAG", raising=False)
    run = ck.start_run("laptop", drive=drive, local_dir=local / "laptop", save_every=5, quiet=True, gauges=False)
    run.train(tiny_trainer(run, max_steps=5))
    run.finish(timeout=30, release_runtime=True)
    assert colab_runtime.released == []
    assert "is not in Colab, so nothing is released" in capsys.readouterr().out


def test_on_the_hub_the_runtime_is_kept_until_the_journals_last_lines_are_committed(hub_env, tmp_path,
                                                                                    colab_runtime, capsys):
    """Issue 46, path 4: finish(release_runtime=True) on the Hub judged "everything in the cloud" before the
    journal's last commit, which could fail unsaid: the runtime went with lines on its disk only."""
    import time

    hub = hub_env
    run = ck.start_run("end", store="hf://user/runs", local_dir=tmp_path / "vm" / "end", save_every=5, quiet=True,
                       gauges=False)
    trainer = tiny_trainer(run, max_steps=5)
    run.train(trainer)  # ends with the run's first finish: checkpoint-5 and the journal so far are committed
    run.save_final(trainer.model)
    deadline = time.monotonic() + 60
    while not run.mirror.tracker.all_in_cloud():  # final/ committed and verified; its "cloud" line is not yet up
        assert time.monotonic() < deadline
        run.mirror.tracker.poll(force=True)  # as finish() does (the run's uploader stopped at its first finish)
        time.sleep(0.1)
    hub.faults.fail_next(1000, 500, endpoint="commit")  # the Hub takes no commit for now
    summary = run.finish(timeout=15, release_runtime=True)
    said = capsys.readouterr().out
    assert summary["in_cloud"] is False and colab_runtime.released == []
    assert "the runtime is KEPT" in said and "journal's last lines (events.jsonl) are on this VM only" in said
    hub.faults.clear()
    summary = run.finish(timeout=60, release_runtime=True)  # the commit goes now: then the runtime is let go
    assert summary["in_cloud"] is True and colab_runtime.released == [True]
    assert any(e["event"] == "cloud" and e.get("what") == "final" for e in hub_events(hub, "end"))


def hub_events(hub, run):
    import json

    from hub_checks import head_files

    content = head_files(hub)[f"{run}/events.jsonl"].content.decode()
    return [json.loads(line) for line in content.splitlines() if line.strip()]
