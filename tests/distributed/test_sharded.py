"""Sharded training without losing work (issue 31): FSDP2 + AdamW on 2 gloo processes, saved and resumed
through ck.CheckpointStore with torch.distributed.checkpoint, killed anywhere, resumed on another number
of processes; errors in a save reaching every rank; incomplete sharded checkpoints never used; the HF
Trainer's FSDP layout mirrored and resumed.
"""

import os
import random
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import harness
import pytest
from transformers import TrainerControl, TrainerState

import colab_kit as ck
import warm
from colab_kit.checkpoints import validity
from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.journal import read_events
from colab_kit.checkpoints.manifest import Manifest, hash_folder, read_manifest, write_manifest
from colab_kit.checkpoints.shards import IncompleteShards
from colab_kit.checkpoints.snapshot import take_snapshot
from colab_kit.trainer.callbacks import DriveSyncCallback

pytestmark = pytest.mark.slow

ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")


def launch(where: Path, world: int, *options, name: str = "job"):
    """`sharded_job.py` on `world` processes (one: no process group, a plain model) with the run folder
    `where/drive` and local disk `where/local`."""
    argv = ["--drive-dir", str(where / "drive"), "--local-dir", str(where / "local"), *map(str, options)]
    env = {k: v for k, v in ENV.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    if world == 1:
        return warm.start(argv, env=env, cwd=where, out=where / f"{name}.log", script="sharded_job")
    return warm.start_ranks(argv, world=world, env=env, cwd=where, out_prefix=where / name, script="sharded_job")


def run_to_end(where: Path, world: int, *options, name: str = "job") -> str:
    job = launch(where, world, *options, name=name)
    code = job.wait(timeout=180)
    said = job.communicate()[0]
    assert code == 0, said[-4000:]
    return said


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted 2-process run of 8 steps, saving every 2 (in the background): its folder and its
    final weights and optimizer state (whole tensors) in final.safetensors; final16.safetensors for 16 steps."""
    where = tmp_path_factory.mktemp("reference")
    run_to_end(where, 2, "--out", where / "final.safetensors")
    (where / "16").mkdir()
    run_to_end(where / "16", 2, "--steps", 16, "--out", where / "final16.safetensors")
    return where


@pytest.mark.parametrize("die", ["3:step", "4:save", "6:mirror"])
def test_a_sharded_run_killed_anywhere_resumes_to_the_uninterrupted_weights(tmp_path, reference, die):
    """Every rank killed at once: mid-training, right after an async save began (its shards half written),
    and once a checkpoint is queued for upload. The newest checkpoint on the run folder always verifies and
    the resumed run ends with the uninterrupted run's weights and Adam state."""
    killed = launch(tmp_path, 2, "--die", die, name="killed")
    assert killed.wait(timeout=180) == 9, killed.communicate()[0][-3000:]
    for path in (tmp_path / "drive" / "checkpoints").glob("checkpoint-*"):
        if (path / "MANIFEST.json").exists():  # a folder with a manifest is whole: never a half-written one
            assert validity.check(path).valid, path
    said = run_to_end(tmp_path, 2, "--out", tmp_path / "final.safetensors", name="resumed")
    resumed_at = int(said.split("RESUMED ")[1].split()[0])
    assert resumed_at % 2 == 0 and resumed_at <= int(die.split(":")[0]), said[-2000:]
    final = harness.load_weights(tmp_path / "final.safetensors")
    assert harness.max_abs_diff(final, harness.load_weights(reference / "final.safetensors")) <= 1e-6


RATE = 150e3  # bytes/s of the emulated Drive: ~1.3 s per checkpoint (~190 kB) while training makes one every 0.5 s


@pytest.mark.slow(90)
def test_a_sharded_run_on_drivefs_with_an_upload_backlog_killed_at_random_moments(tmp_path, emulated_drive,
                                                                                   reference):
    """`start_run` + `run.checkpoint_store()` on both ranks, the run folder on the DriveFS emulator, uploads
    falling behind. Both ranks and the emulator are killed together (the VM dies with its pending uploads) at
    random moments: mid-step, mid async save, mid upload; each restart is a new VM. At every kill: once a
    checkpoint was complete in the cloud, one always verifies there; every `cloud` claim is true; the
    restart resumes from the newest checkpoint valid in the cloud. At the end: the uninterrupted weights."""
    drive = emulated_drive(rate=RATE)
    rng = random.Random(31)
    cloud = drive.cloud / "sharded" / "checkpoints"
    reported: set[int] = set()
    complete_once, kills, expect, resumes = False, 0, None, []
    for cycle in range(8):
        where = tmp_path / f"vm-{cycle}"
        where.mkdir()
        argv = ["--open-run", "sharded", "--drive-dir", drive.mountpoint, "--local-dir", where / "local",
                "--steps", 16, "--step-sleep", 0.25, "--look-spacing", 0.2]
        job = warm.start_ranks([str(a) for a in argv], world=2, env=ENV, cwd=where, out_prefix=where / "job",
                               script="sharded_job")
        journal = where / "local" / "events.jsonl"  # the run's copy on the VM's disk: every event, uploaded or not
        deadline = time.monotonic() + 60
        while job.poll() is None and time.monotonic() < deadline and not any(
                e["event"] == "save" for e in (read_events(journal) if journal.exists() else [])):
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 3.0))
        killed = job.poll() is None
        job.kill()
        drive.kill()
        said = job.communicate(timeout=60)[0]
        if "RESUMED " in said and expect is not None:
            resumed = int(said.split("RESUMED ")[1].split()[0])
            assert resumed == expect, f"cycle {cycle}: resumed from {resumed}, the cloud held {expect}"
            resumes.append(resumed)
        reported = harness.reported_in_cloud(read_events(journal) if journal.exists() else [], reported)
        valid = {step for step, path in list_checkpoints(cloud) if validity.check(path).valid} if cloud.exists() \
            else set()
        complete_once |= bool(valid)
        if complete_once:
            assert valid, f"cycle {cycle}: no checkpoint in the cloud verifies, after one did"
        assert reported <= valid, f"cycle {cycle}: reported in the cloud {sorted(reported)}, valid {sorted(valid)}"
        expect = max(valid, default=0)
        kills += killed
        drive.new_vm()
        if kills >= 4 and complete_once:
            break
    assert kills >= 4 and complete_once, (kills, complete_once)
    print(f"{kills} kills; resumed from {resumes}; reported in the cloud at the end: {sorted(reported)}")
    where = tmp_path / "vm-last"
    where.mkdir()
    said = run_to_end(where, 2, "--open-run", "sharded", "--drive-dir", drive.mountpoint, "--local-dir",
                      where / "local", "--steps", 16, "--look-spacing", 0.2, "--out", where / "final.safetensors")
    assert f"RESUMED {expect} " in said, said[-2000:]
    final = harness.load_weights(where / "final.safetensors")
    assert harness.max_abs_diff(final, harness.load_weights(reference / "final16.safetensors")) <= 1e-6


def test_a_checkpoint_of_two_processes_resumes_on_one_and_back(tmp_path, reference):
    """DCP reshards: the 2-process checkpoint loads into one process's plain model, exactly; that process
    trains on and saves a plain checkpoint, which loads into 2 sharded processes, exactly."""
    shutil.copytree(reference / "drive", tmp_path / "drive")
    run_to_end(tmp_path, 1, "--dump-restored", tmp_path / "on-one.safetensors", name="one")
    restored = harness.load_weights(tmp_path / "on-one.safetensors")
    assert harness.max_abs_diff(restored, harness.load_weights(reference / "final.safetensors")) == 0.0
    run_to_end(tmp_path, 1, "--steps", 10, "--out", tmp_path / "one-10.safetensors", name="one-on")
    assert (tmp_path / "drive" / "checkpoints" / "checkpoint-10" / "model.safetensors").is_file()
    said = run_to_end(tmp_path, 2, "--dump-restored", tmp_path / "on-two.safetensors", name="two")
    assert "RESUMED 10 extra={'seen': 10}" in said
    back = harness.load_weights(tmp_path / "on-two.safetensors")
    assert harness.max_abs_diff(back, harness.load_weights(tmp_path / "one-10.safetensors")) == 0.0


def failing(where: Path, *options) -> tuple[str, str]:
    """Launch 2 ranks where rank 1 fails (`--fail`) and lingers as a notebook kernel does. Rank 0 must end
    within 20 s of rank 1's error, and rank 1 must stay alive after its error; returns both outputs."""
    ranks = launch(where, 2, *options, "--linger", 120)
    rank0, rank1 = ranks.jobs
    log1 = where / "job-rank1.log"
    try:
        try:
            took = warm.ended_after(rank0, log1, "ERROR ", timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 was left waiting:\n{(where / 'job-rank0.log').read_text()[-3000:]}")
        said0 = rank0.communicate()[0]
        deadline = time.monotonic() + 30
        while "ERROR " not in log1.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        said1 = log1.read_text()
        alive = rank1.poll() is None
    finally:
        ranks.kill()
    assert rank0.returncode == 1, said0[-3000:]
    assert alive, said1[-3000:]
    assert took < 20, f"rank 0 ended {took:.1f} s after rank 1's error"
    return said0, said1


@pytest.mark.parametrize("where,how,step", [("files", "async", 4), ("state", "async", 2), ("shards", "async", 4),
                                            ("shards", "sync", 4)])
def test_an_error_on_one_rank_in_a_checkpoint_save_reaches_every_rank(tmp_path, where, how, step):
    """A ValueError on rank 1 while it writes its own files, while it takes the state DCP saves (before DCP's
    first collective, in the very first save), or inside DCP's write (in the background for an async save:
    it surfaces at the next save). Rank 0 names rank 1 and the ValueError; rank 1 raises its own and lives on;
    rank 0 ends within seconds; the failed checkpoint is never published."""
    said0, said1 = failing(tmp_path, "--fail", f"1:{where}:{step}", *(["--sync"] if how == "sync" else []))
    message = f"ValueError: injected on rank 1 in the checkpoint save at step {step}"
    assert f"ERROR RankFailedError: rank 1 of 2 failed in the checkpoint save at step {step}" in said0, said0[-3000:]
    assert message in said0 and f"ERROR {message}" in said1, said1[-3000:]
    published = [p.name for p in (tmp_path / "local").glob("checkpoint-*")]
    assert published == [f"checkpoint-{s}" for s in range(2, step, 2)], published


def test_after_a_background_save_failed_to_start_on_one_rank_the_next_saves_work(tmp_path, reference):
    """Rank 1 cannot start its background save of step 4, while rank 0's has begun and waits for rank 1's
    in a thread. Both ranks raise; the run goes on (as a user runs the cell again) and saves 6 and 8 as if
    nothing had happened: no save is left in flight, and no later save meets that thread."""
    said = run_to_end(tmp_path, 2, "--fail", "1:start:4", "--keep-going", "--out", tmp_path / "final.safetensors")
    assert "SAVE FAILED RankFailedError: rank 1 of 2 failed in the checkpoint save at step 4" in said, said[-3000:]
    assert "SAVE FAILED ValueError: injected on rank 1 in the checkpoint save at step 4" in said
    assert said.count("SAVE FAILED") == 2
    assert sorted(p.name for p in (tmp_path / "local").glob("checkpoint-*")) == ["checkpoint-6", "checkpoint-8"]
    assert validity.check(tmp_path / "drive" / "checkpoints" / "checkpoint-8").valid
    final = harness.load_weights(tmp_path / "final.safetensors")
    assert harness.max_abs_diff(final, harness.load_weights(reference / "final.safetensors")) == 0.0


def test_without_host_ram_for_the_copy_every_rank_saves_in_the_foreground(tmp_path, reference):
    """Rank 1 has too little host RAM for an async save's copy of its shards: every rank saves in the
    foreground (one kind of save for all: published before `save` returns), rank 0 says why, and nothing else
    changes."""
    (tmp_path / "first").mkdir()
    killed = launch(tmp_path / "first", 2, "--short-of-ram", 1, "--die", "2:save", name="killed")
    assert killed.wait(timeout=180) == 9, killed.communicate()[0][-3000:]
    assert (tmp_path / "first" / "local" / "checkpoint-2" / "shards" / ".metadata").is_file()
    said = run_to_end(tmp_path, 2, "--short-of-ram", 1, "--out", tmp_path / "final.safetensors")
    assert "checkpoint-2 is written in the foreground" in said and "rank(s) [1] have less than twice" in said, said
    assert validity.check(tmp_path / "drive" / "checkpoints" / "checkpoint-8").valid
    final = harness.load_weights(tmp_path / "final.safetensors")
    assert harness.max_abs_diff(final, harness.load_weights(reference / "final.safetensors")) == 0.0


@pytest.mark.parametrize("model", ["sharded", "replicated"])
def test_an_error_on_one_rank_in_a_restore_reaches_every_rank(tmp_path, reference, model):
    """Rank 1 cannot read the shards back: into its shard of the model (DCP's collective read), or into its
    whole replica (each rank reads every shard alone, where DCP names every failure rank 0's). Every rank
    stops; rank 0 names rank 1, which raises its own ValueError."""
    shutil.copytree(reference / "drive", tmp_path / "drive")
    said0, said1 = failing(tmp_path, "--fail", "1:restore:0", *(["--no-shard"] if model == "replicated" else []))
    message = "ValueError: injected on rank 1 in the checkpoint restore"
    assert "ERROR RankFailedError: rank 1 of 2 failed in the checkpoint restore at step 8" in said0, said0[-3000:]
    assert message in said0 and f"ERROR {message}" in said1, said1[-3000:]
    assert "RESUMED" not in said0 + said1


def _rewrite_manifest(folder: Path, keep_record: bool) -> None:
    """A manifest over what the folder holds now, as a writer that did not check would leave it."""
    old = read_manifest(folder)
    write_manifest(folder, Manifest(step=old.step, files=hash_folder(folder), fingerprint=old.fingerprint,
                                    shards=old.shards if keep_record else {}))


@pytest.mark.parametrize("lost", ["shards/__1_0.distcp", "shards/.metadata"])
def test_a_checkpoint_missing_a_shard_or_its_metadata_is_never_used(tmp_path, reference, lost):
    """checkpoint-8 loses one rank's shard or the .metadata, and a manifest is written over what is left.
    It is INVALID (never resumed from, counted or called in the cloud): status and a resume take
    checkpoint-6; and the kit never snapshots such a folder for upload."""
    shutil.copytree(reference / "drive", tmp_path / "drive")
    eight = tmp_path / "drive" / "checkpoints" / "checkpoint-8"
    assert validity.check(eight).valid
    (eight / lost).unlink()
    with pytest.raises(IncompleteShards):
        take_snapshot(eight, tmp_path / "snapshots", 8)
    _rewrite_manifest(eight, keep_record=lost != "shards/.metadata")
    verdict = validity.check(eight)
    assert verdict.state == validity.INVALID, verdict
    assert ("__1_0.distcp" in verdict.reason) if "distcp" in lost else (".metadata" in verdict.reason)
    status = subprocess.run([sys.executable, "-m", "colab_kit", "status", str(tmp_path / "drive")],
                            capture_output=True, text=True, timeout=120)
    assert "resume would use: checkpoint-6" in status.stdout, status.stdout
    said = run_to_end(tmp_path, 1, "--dump-restored", tmp_path / "restored.safetensors", name="one")
    assert "RESUMED 6 extra={'seen': 6}" in said, said[-2000:]


def test_the_trainers_fsdp_folders_are_mirrored_verified_and_resumed(tmp_path, drive, local):
    """A checkpoint in the layout of the Trainer's FSDP2 save (pytorch_model_fsdp_0/ and optimizer_0/ with
    their .metadata dotfiles, rng_state_<rank>.pth per rank), written by 2 processes: the kit's on_save
    mirrors it whole and records what each DCP folder needs; a fresh runtime resumes from it. The same
    checkpoint without optimizer_0/.metadata, or without rank 1's model shard (where it would be on two
    machines: on the other machine's disk), is not uploaded, and the message says why."""
    out = tmp_path / "trainer-out"
    run_to_end(tmp_path, 2, "--trainer-layout", out, name="layout")
    folder = out / "checkpoint-2"
    args = types.SimpleNamespace(output_dir=str(out), world_size=2, process_index=0, save_only_model=False)
    state = TrainerState(global_step=2, max_steps=8)
    state.is_world_process_zero = True

    run = ck.start_run("fsdp", drive=drive, local_dir=local, quiet=True, gauges=False)
    for lost in ("optimizer_0/.metadata", "pytorch_model_fsdp_0/__1_0.distcp"):
        incomplete = tmp_path / lost.replace("/", "-")
        shutil.copytree(folder, incomplete / "checkpoint-2")
        (incomplete / "checkpoint-2" / lost).unlink()
        DriveSyncCallback(run).on_save(types.SimpleNamespace(**{**vars(args), "output_dir": str(incomplete)}),
                                       state, TrainerControl())
    assert not (drive / "fsdp" / "checkpoints" / "checkpoint-2").exists()
    DriveSyncCallback(run).on_save(args, state, TrainerControl())
    run.finish()
    warned = [e["reason"] for e in read_events(drive / "fsdp" / "events.jsonl") if e.get("what") == "shards_missing"]
    assert len(warned) == 2 and "optimizer_0/.metadata is missing" in warned[0], warned
    assert "lacks __1_0.distcp" in warned[1] and "On several machines each machine's ranks write" in warned[1]

    copy = drive / "fsdp" / "checkpoints" / "checkpoint-2"
    manifest = read_manifest(copy)
    assert {"pytorch_model_fsdp_0/.metadata", "optimizer_0/.metadata", "rng_state_0.pth",
            "rng_state_1.pth"} <= set(manifest.files)
    assert manifest.shards == {"optimizer_0": ["__0_0.distcp", "__1_0.distcp"],
                               "pytorch_model_fsdp_0": ["__0_0.distcp", "__1_0.distcp"]}
    assert validity.check(copy).valid

    again = ck.start_run("fsdp", drive=drive, local_dir=tmp_path / "new-runtime", quiet=True, gauges=False)
    try:
        assert again.resume_from is not None and again.resume_from.name == "checkpoint-2"
        for name in manifest.files:
            assert (again.resume_from / name).read_bytes() == (folder / name).read_bytes(), name
    finally:
        again.finish()


def test_two_machines_are_refused_on_every_rank_within_seconds(tmp_path):
    """Two "machines" of one process each (torchrun --nnodes 2 sets LOCAL_WORLD_SIZE 1), each with its own
    local folder: both ranks raise the same ColabKitError when they create the store, and neither waits."""
    started = time.monotonic()
    ranks = warm.start_ranks(lambda rank: ["--drive-dir", str(tmp_path / "drive"), "--local-dir",
                                           str(tmp_path / f"node{rank}")],
                             world=2, env=ENV, cwd=tmp_path, out_prefix=tmp_path / "nodes", script="sharded_job",
                             per_node=1)
    assert ranks.wait(timeout=60) == 1
    for rank in (0, 1):
        said = (tmp_path / f"nodes-rank{rank}.log").read_text()
        assert "ERROR ColabKitError: CheckpointStore under 2 processes on 2 nodes" in said, said[-2000:]
    assert time.monotonic() - started < 30

