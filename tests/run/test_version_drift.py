"""Version drift (issue 39): every manifest records what wrote it; a resume under other versions says what changed
and what it may do, goes on, and a load that fails is told which change it met."""

import json
import shutil

import pytest
import transformers
from test_run import start

from colab_kit.checkpoints.journal import read_events
from colab_kit.checkpoints.manifest import read_manifest
from colab_kit.runtime import library_versions
from colab_kit.tasks.demo import tiny_trainer


def trained_once(drive, local):
    run = start(drive, local, "v", save_every=5, quiet=True, gauges=False)
    run.train(tiny_trainer(run, max_steps=10))
    run.finish(timeout=30)
    shutil.rmtree(local / "v")  # a new runtime: only the run folder is left
    return drive / "v" / "checkpoints" / "checkpoint-10"


def written_under(folder, **versions) -> None:
    """Edit the record of what wrote checkpoint `folder` (its files, and so its verdict, stay the same)."""
    manifest = json.loads((folder / "MANIFEST.json").read_text())
    manifest["versions"].update(versions)
    (folder / "MANIFEST.json").write_text(json.dumps(manifest))


def test_every_manifest_records_the_versions_that_wrote_it(drive, local):
    recorded = read_manifest(trained_once(drive, local)).versions
    assert recorded["transformers"] == transformers.__version__
    assert {"python", "torch", "transformers", "accelerate", "gpu"} <= set(recorded)
    assert recorded == library_versions()


def test_a_resume_under_another_transformers_says_what_changed_and_goes_on(drive, local, capsys):
    written_under(trained_once(drive, local), transformers="4.99.0")
    capsys.readouterr()
    run = start(drive, local, "v", save_every=5, gauges=False)
    said = capsys.readouterr()
    said = said.out + said.err
    assert f"checkpoint-10 was written under other versions than this runtime has: transformers 4.99.0 -> " \
           f"{transformers.__version__} (the Trainer reads back" in said
    assert "pip install transformers==4.99.0, then restart the runtime" in said
    assert run.resume_manifest.step == 10
    run.train(tiny_trainer(run, max_steps=15))  # it goes on
    run.finish(timeout=30)
    drifts = [e for e in read_events(drive / "v" / "events.jsonl") if e.get("what") == "version_drift"]
    assert drifts and drifts[0]["changed"] == {"transformers": ["4.99.0", transformers.__version__]}


def test_a_checkpoint_from_the_same_versions_says_nothing(drive, local, capsys):
    trained_once(drive, local)
    capsys.readouterr()
    run = start(drive, local, "v", save_every=5, gauges=False)
    said = capsys.readouterr()
    assert "other versions" not in said.out + said.err
    run.finish(timeout=30)


def test_a_load_that_fails_is_told_which_version_changed(drive, local, monkeypatch):
    from transformers import Trainer

    written_under(trained_once(drive, local), peft="9.0.0")

    def cannot_load(self, *args, **kwargs):
        raise ValueError("unknown option in adapter_config.json")

    monkeypatch.setattr(Trainer, "_load_from_checkpoint", cannot_load)
    run = start(drive, local, "v", save_every=5, quiet=True, gauges=False)
    with pytest.raises(ValueError, match="unknown option") as failed:
        run.train(tiny_trainer(run, max_steps=15))
    notes = "\n".join(getattr(failed.value, "__notes__", []))
    assert "checkpoint-10 was written under peft 9.0.0 (now" in notes and "resume=False" in notes
