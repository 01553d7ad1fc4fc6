"""The notebooks as people use them (issue 28), in real Jupyter kernels (`tests/scripts/notebook_kernel.py`): the stop
button mid-step and the cells run again, a trainer kept from an earlier run, a changed learning rate, a second
kernel taking the run over, a full local disk, a full persistent folder and a deleted run folder.

Each test asserts that no checkpoint is lost (the newest one saved verifies in the persistent folder once the
run is finished) and that what the kernel printed names the next action.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from notebook_kernel import NotebookKernel
from project import ROOT

from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.journal import read_events
from colab_kit.checkpoints.validity import verify_folder

GPT2 = ROOT / "notebooks" / "distilgpt2_finetune.ipynb"
RNA = ROOT / "notebooks" / "rna_bert_classification.ipynb"
NOTEBOOKS = {"gpt2": (GPT2, "distilgpt2-wikitext"), "rna": (RNA, "rna-bert")}
START_RUN_CELL = "run = ck.start_run(RUN_NAME"
FINISH_CELL = "run.finish()"
TRAINING_CELL = "result = run.train(trainer)"  # the same line in both notebooks
TRAINER_CELL = "trainer = Trainer("


def events(run_dir: Path, what: str | None = None) -> list[dict]:
    try:
        found = read_events(run_dir / "events.jsonl")
    except OSError:
        return []
    return [e for e in found if what is None or e["event"] == what]


def saved_after(run_dir: Path, step: int):
    """For `stop_when`: a checkpoint newer than `step` is saved (the stop then lands mid-training)."""
    return lambda: any(e.get("step", 0) > step for e in events(run_dir, "save"))


def drive_steps(run_dir: Path) -> list[int]:
    """The checkpoints in the persistent folder that verify (manifest and every file), oldest first."""
    return sorted(s for s, path in list_checkpoints(run_dir / "checkpoints") if verify_folder(path) is None)


def assert_nothing_lost(run_dir: Path, kernel: NotebookKernel) -> None:
    """The newest checkpoint any runtime saved verifies in the persistent folder."""
    newest = newest_saved(run_dir)
    assert newest in drive_steps(run_dir), f"checkpoint-{newest} is not in {run_dir}\n{kernel.transcript()}"


def train_on_to_the_end(kernel: NotebookKernel, run_dir: Path, steps: int) -> None:
    """The start_run cell and the training cell run again, as the messages say: training ends at `steps`,
    the run finishes, and nothing saved on the way is missing from the persistent folder."""
    assert kernel.run_cell(START_RUN_CELL).error is None, kernel.transcript()
    ran = kernel.run_cell(TRAINING_CELL)
    assert ran.error is None and f"completed; checkpoint-{steps} is saved" in ran.text, kernel.transcript()
    assert kernel.run_cell(FINISH_CELL).error is None
    assert drive_steps(run_dir)[-1] == steps
    assert_nothing_lost(run_dir, kernel)


def wait_until(condition, kernel: NotebookKernel, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, kernel.transcript()
        time.sleep(0.2)


def newest_saved(run_dir: Path) -> int:
    return max(e["step"] for e in events(run_dir, "save"))


def stopped_at(ran) -> int:
    """The step a stop press ended training at, from the kit's message ("stopped at step N; ...")."""
    assert ran.error and ran.error.startswith("KeyboardInterrupt"), ran
    assert "The run stays open: run this cell again to continue from there" in ran.text, ran
    return int(ran.text.split("stopped at step ")[1].split(";")[0])


@pytest.mark.slow(90)
@pytest.mark.parametrize("name", ["gpt2", "rna"])
def test_stop_then_start_run_again_and_the_old_trainer_mirrors_every_checkpoint(tmp_path, name):
    # Finding 1: before, the trainer kept from the stopped run mirrored nothing into the new one, silently.
    notebook, run_name = NOTEBOOKS[name]
    run_dir = tmp_path / "drive" / run_name
    with NotebookKernel(notebook, tmp_path, MAX_STEPS=40, SAVE_EVERY=5) as kernel:
        stop = kernel.run_through(TRAINING_CELL, stop_when=saved_after(run_dir, 5))
        first = newest_saved(run_dir)
        again = kernel.run_cell(START_RUN_CELL)  # the start_run cell again: the open run is closed first
        stop_again = kernel.execute("result = run.train(trainer)", stop_when=saved_after(run_dir, first + 5))
        second = newest_saved(run_dir)
        # every checkpoint the kept trainer saves reaches the persistent folder (before: none did); the stop says
        # it is "on its way", so it is waited for (the mirror copies it in the background, slower under load)
        assert second > first, kernel.transcript()
        wait_until(lambda: second in drive_steps(run_dir) and events(run_dir, "sync")[-1]["step"] == second, kernel,
                   timeout=60)
        rebound = [e for e in events(run_dir) if e.get("what") == "trainer_rebound"]
        assert rebound and f"of run '{run_name}'" in rebound[0]["replaced"][0], kernel.transcript()

        ran = kernel.run_cell(TRAINING_CELL)  # the training cell again: on from `second`, to the end
        assert ran.error is None and f"completed; checkpoint-40 is saved in {run_dir}" in ran.text, kernel.transcript()
        assert kernel.run_cell(FINISH_CELL).error is None
    assert drive_steps(run_dir)[-1] == 40
    assert_nothing_lost(run_dir, kernel)
    # each stop was a pause at a saved step, which the message names with the next action
    for ran, step in ((stop, first), (stop_again, second)):
        assert stopped_at(ran) == step and f"checkpoint-{step} is saved" in ran.text, ran
        assert "nothing will be redone" in ran.text, ran
    assert again.error is None and "reopened" in again.text and f"checkpoint-{first}" in again.text, again
    assert [e["step"] for e in events(run_dir, "resume")] == [first], kernel.transcript()  # the reopened run
    assert [e["step"] for e in events(run_dir, "stop")] == [first, second], kernel.transcript()


@pytest.mark.slow(70)
def test_a_changed_learning_rate_says_what_the_rate_will_do(tmp_path):
    notebook, run_name = NOTEBOOKS["rna"]
    run_dir = tmp_path / "drive" / run_name
    with NotebookKernel(notebook, tmp_path, MAX_STEPS=20, SAVE_EVERY=10) as kernel:
        assert kernel.run_through(TRAINING_CELL).error is None, kernel.transcript()
        kernel.set(LEARNING_RATE=0.001, MAX_STEPS=40)  # edited in the parameters cell, then run on from start_run
        assert kernel.run_cell(START_RUN_CELL).error is None, kernel.transcript()
        assert kernel.run_cell(TRAINER_CELL).error is None, kernel.transcript()  # the arguments use the parameters
        ran = kernel.run_cell(TRAINING_CELL)
        assert ran.error is None, kernel.transcript()
        assert "learning_rate 0.002 -> 0.001 is not applied" in ran.text, ran
        assert "To train at 0.001, start fresh, which moves every checkpoint to " in ran.text and \
            "ck.start_run('rna-bert', resume=False); to continue" in ran.text, ran
        assert "completed; checkpoint-40 is saved" in ran.text, ran
        assert kernel.run_cell(FINISH_CELL).error is None
    assert_nothing_lost(run_dir, kernel)


@pytest.mark.slow(90)
def test_a_second_kernel_takes_the_run_over_and_the_first_stops_at_its_next_step(tmp_path):
    notebook, run_name = NOTEBOOKS["gpt2"]
    run_dir = tmp_path / "drive" / run_name
    drive = str(tmp_path / "drive")
    (tmp_path / "vm1").mkdir()
    (tmp_path / "vm2").mkdir()
    with NotebookKernel(notebook, tmp_path / "vm1", MAX_STEPS=100000, SAVE_EVERY=5, DRIVE_DIR=drive) as first, \
            NotebookKernel(notebook, tmp_path / "vm2", MAX_STEPS=40, SAVE_EVERY=5, DRIVE_DIR=drive) as second, \
            ThreadPoolExecutor(1) as pool:
        assert first.run_through(TRAINING_CELL, upto=True).error is None, first.transcript()
        training = pool.submit(first.run_cell, TRAINING_CELL)
        assert second.run_through(START_RUN_CELL, upto=True).error is None, second.transcript()
        wait_until(saved_after(run_dir, 5), first)
        refused = second.run_cell(START_RUN_CELL)
        assert refused.error.startswith("LeaseHeldError") and "takeover=True" in refused.error, refused
        taken = second.execute("run = ck.start_run(RUN_NAME, drive=DRIVE_DIR, save_every=settings.save_every, "
                               "takeover=True)")
        assert taken.error is None and "took over" in taken.text, taken
        lost = training.result(timeout=300)
        assert lost.error.startswith("LeaseLostError") and "stopped training at step" in lost.error, lost
        assert "Continue in that runtime" in lost.error and "takeover=True" in lost.error, lost
        taken_at = next(i for i, e in enumerate(events(run_dir)) if e["event"] == "start" and e["took_over"])
        # the first kernel writes nothing into the run folder once the second holds it
        later = [e for e in events(run_dir)[taken_at + 1:] if "/vm1/" in e.get("local", "")]
        assert not later, later
        assert second.run_through(TRAINING_CELL).error is None, second.transcript()
        assert second.run_cell(FINISH_CELL).error is None
    assert drive_steps(run_dir)[-1] == 40
    assert_nothing_lost(run_dir, second)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real filesystem that fills up: a tmpfs of `size` bytes mounted at the returned folder."""
    mounted = []

    def mount(folder: Path, size: int) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            why = f"cannot mount a tmpfs here (needs root): {proc.stderr.strip()}"
            if os.environ.get("COLAB_KIT_REQUIRE_TMPFS"):  # set by .ci/run
                pytest.fail(f"COLAB_KIT_REQUIRE_TMPFS is set, but {why}")
            pytest.skip(why)
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.mark.slow(70)
def test_a_full_local_disk_is_named_and_training_goes_on_once_there_is_room(tmp_path, small_tmpfs):
    notebook, run_name = NOTEBOOKS["gpt2"]
    run_dir = tmp_path / "drive" / run_name
    scratch = small_tmpfs(tmp_path / "scratch", 64 << 20)  # the kernel's local folder (/content in Colab)
    filler = scratch / "filler.bin"
    with NotebookKernel(notebook, tmp_path, MAX_STEPS=40, SAVE_EVERY=5) as kernel:
        assert kernel.run_through(TRAINING_CELL, upto=True).error is None, kernel.transcript()
        free = shutil.disk_usage(scratch).free
        filler.write_bytes(b"\0" * (free - (14 << 20)))  # room for about two checkpoints of 5.7 MiB
        ran = kernel.run_cell(TRAINING_CELL)
        assert ran.error and ran.error.startswith("LocalDiskFullError") and "the VM's disk is full" in ran.error, ran
        assert "Free space on this disk" in ran.error and "run the start_run cell and this cell again" in ran.error
        filler.unlink()
        train_on_to_the_end(kernel, run_dir, 40)


@pytest.mark.slow(90)
def test_a_full_persistent_folder_makes_room_by_the_deletion_rules(tmp_path, emulated_drive):
    notebook, run_name = NOTEBOOKS["gpt2"]
    drive = emulated_drive(rate=50e6, quota=15 << 20)  # DriveFS (emulated), room for about 2.5 checkpoints
    run_dir = drive.mountpoint / run_name
    with NotebookKernel(notebook, tmp_path, MAX_STEPS=40, SAVE_EVERY=10, DRIVE_DIR=str(drive.mountpoint)) as kernel:
        ran = kernel.run_through(TRAINING_CELL)
        assert ran.error is None and "completed" in ran.text, kernel.transcript()
        finished = kernel.run_cell(FINISH_CELL)
        assert finished.error is None and "checkpoint-40" in finished.text, kernel.transcript()
    full = [e for e in events(run_dir) if e.get("what") == "drive_full"]
    assert full and full[0]["deleted"], kernel.transcript()
    assert "Drive is full: deleted checkpoint-" in kernel.transcript() and "Free space at drive.google.com" in \
        kernel.transcript()
    assert drive_steps(run_dir)[-1] == 40
    assert_nothing_lost(run_dir, kernel)


@pytest.mark.slow(70)
def test_a_deleted_run_folder_stops_training_and_the_cells_run_again_make_it_anew(tmp_path):
    # Before: "the run's lease could not be confirmed", training went on, and nothing more was mirrored.
    notebook, run_name = NOTEBOOKS["rna"]
    run_dir = tmp_path / "drive" / run_name
    with NotebookKernel(notebook, tmp_path, MAX_STEPS=100, SAVE_EVERY=10) as kernel:
        assert kernel.run_through(TRAINING_CELL, upto=True).error is None, kernel.transcript()
        deleted = []

        def delete_the_run_folder():  # at drive.google.com, say, while the cell trains
            if not deleted and saved_after(run_dir, 10)():
                # Gone at once, as Drive's delete is (the uploader may be writing into it right now): moved out
                # of the way in one rename, then removed.
                gone = run_dir.with_name(".deleted")
                run_dir.rename(gone)
                shutil.rmtree(gone, ignore_errors=True)
                deleted.append(True)

        ran = kernel.run_cell(TRAINING_CELL, meanwhile=delete_the_run_folder)
        assert ran.error and ran.error.startswith("LeaseLostError"), kernel.transcript()
        assert f"the run folder {run_dir} is gone (deleted or moved?), so this runtime stopped training" in ran.error
        assert "Run the start_run cell again and then this cell" in ran.error, ran
        train_on_to_the_end(kernel, run_dir, 100)
