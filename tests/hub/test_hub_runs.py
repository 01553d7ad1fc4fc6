"""Runs kept on the Hugging Face Hub (issue 40), on the emulated Hub: `ck.start_run(name, store="hf://...")`
commits each checkpoint, calls it in the cloud only once the Hub lists its files with the manifest's sha256,
keeps `keep` of them, resumes on a new VM from the Hub, refuses a second runtime while the first lives, and
runs killed at random moments on a faulty Hub resume exactly. Kaggle picks the Hub by itself."""

import json
import random
import shutil
import signal
import subprocess
import time

import harness
import pytest
from hub_checks import ever_verified, head_files, hub_checkpoints, verified_on_hub

import colab_kit as ck
from colab_kit.checkpoints.journal import read_events
from colab_kit.tasks.demo import tiny_trainer


def test_a_run_on_the_hub_is_committed_verified_by_sha256_pruned_and_resumed_on_a_new_vm(hub_env, tmp_path, capsys):
    hub = hub_env
    run = ck.start_run("rna", store="hf://user/runs", local_dir=tmp_path / "vm1" / "rna", save_every=5, keep=2,
                       gauges=False)
    said = capsys.readouterr().out
    assert "a replica of the Hugging Face Hub (hf://user/runs, folder rna)" in said and "the Hugging Face Hub: each" in said
    trainer = tiny_trainer(run, max_steps=20)
    run.train(trainer)
    run.save_final(trainer.model)
    summary = run.finish(timeout=60)
    assert summary["in_cloud"] is True and summary["cloud_step"] == 20 and summary["durability"] == "hub"
    events = read_events(tmp_path / "vm1" / "rna.hub" / "events.jsonl")
    claimed = {e["step"] for e in events if e["event"] == "cloud" and "step" in e}
    kept = hub_checkpoints(hub, "rna")  # keep=2: the older ones deleted by commits once 20 verified
    assert 20 in kept and len(kept) == 2 and kept <= claimed <= ever_verified(hub, "rna")
    assert all(e.get("via") == "hub" for e in events if e["event"] == "cloud")
    files = head_files(hub)
    assert verified_on_hub(files, "rna/final")  # final/ too, committed whole and verified
    # The journal on the Hub is the replica's, to its last line (final/ confirmed), and the lease is released.
    assert files["rna/events.jsonl"].content == (tmp_path / "vm1" / "rna.hub" / "events.jsonl").read_bytes()
    assert any(e["event"] == "cloud" and e.get("what") == "final" for e in events)
    assert json.loads(files["rna/lease.json"].content)["released"]

    # A new VM: nothing on its disk; the run comes back from the Hub and goes on from checkpoint-20.
    run = ck.start_run("rna", store="hf://user/runs", local_dir=tmp_path / "vm2" / "rna", save_every=5, keep=2,
                       gauges=False)
    assert run.resume_from is not None and run.resume_from.name == "checkpoint-20"
    run.train(tiny_trainer(run, max_steps=25))
    assert run.finish(timeout=60)["cloud_step"] == 25 and hub_checkpoints(hub, "rna") == {20, 25}
    # Each run's first deletion says the quota truth, once: deleted files stay in the history until it is squashed.
    assert 1 <= "".join(capsys.readouterr()).count("count against your Hub storage quota until the history is") <= 2
    assert read_events(tmp_path / "vm2" / "rna.hub" / "events.jsonl")[0]["event"] == "start"  # the journal came back


def test_a_second_runtime_is_refused_while_the_first_lives(hub_env, tmp_path):
    job = harness.Job(tmp_path / "first", steps=400, save_every=5, step_sleep=0.2, drive_root="hf://user/runs",
                      name="live")
    first = job.start()
    try:
        deadline = time.monotonic() + 120
        while "live/lease.json" not in head_files(hub_env):  # the first has claimed the run
            assert first.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        with pytest.raises(ck.LeaseHeldError, match="in use by another runtime"):
            ck.start_run("live", store="hf://user/runs", local_dir=tmp_path / "second" / "live", gauges=False)
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)


@pytest.mark.slow(70)
def test_runs_killed_at_random_moments_on_a_faulty_hub_resume_exactly_and_claim_nothing_the_hub_does_not_show(
        hub_env, tmp_path, shared_tmp):
    hub = hub_env
    reference = harness.reference_weights(tmp_path / "ref", "trainer", steps=20, save_every=5, shared=shared_tmp)
    job = harness.Job(tmp_path / "job", steps=20, save_every=5, step_sleep=0.15, drive_root="hf://user/runs",
                      name="job", extra=["--keep", "2"])
    rng = random.Random(40)
    kills, complete_once = 0, False
    for cycle in range(8):
        # The Hub misbehaves a little every time: 5xx and 429s, a commit whose answer never comes, a listing
        # that misses a file. Each costs time, never a checkpoint nor a claim.
        hub.faults.fail_next(rng.randint(1, 2), rng.choice([500, 502, 503]), endpoint="commit")
        hub.faults.fail_next(1, 429, endpoint="tree", retry_after=0)
        hub.faults.hide_in_listing(r"optimizer\.pt$", n=rng.randint(1, 3))
        if rng.random() < 0.5:
            hub.faults.commit_completes_after_client_gives_up(seconds=30.0, drop=rng.random() < 0.5)
        proc = job.start()
        try:
            proc.wait(timeout=rng.uniform(2.5, 7.0))
            killed = False
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
            killed = True
        text, _ = proc.communicate(timeout=120)
        hub.faults.clear()
        now = hub_checkpoints(hub, "job")
        complete_once |= bool(now)
        if complete_once:
            assert now, f"cycle {cycle}: no checkpoint verifies on the Hub, after one did"
        claimed = {e["step"] for e in job.local_events() if e["event"] == "cloud"}
        assert claimed <= ever_verified(hub, "job"), f"cycle {cycle}: claimed {claimed}, never whole on the Hub"
        kills += killed
        if not killed:
            break
        job.new_vm()  # this VM's disk is gone, its replica of the Hub too
        shutil.rmtree(job.root / "local.hub", ignore_errors=True)
    assert kills >= 3, f"only {kills} kills landed"
    if proc.returncode != 0:  # the last cycle was a kill: let it finish
        job.new_vm()
        shutil.rmtree(job.root / "local.hub", ignore_errors=True)
        code, text = job.run()
        assert code == 0, text[-3000:]
    assert harness.max_abs_diff(reference, harness.load_weights(job.root / "final.safetensors")) <= 1e-6
    assert max(hub_checkpoints(hub, "job")) == 20


def test_kaggle_keeps_the_run_on_the_hub_by_itself(hub_env, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    monkeypatch.delenv("COLAB_KIT_DRIVE", raising=False)
    run = ck.start_run("k", local_dir=tmp_path / "k", save_every=5, gauges=False)
    try:
        said = "".join(capsys.readouterr())  # the summary on stdout, the notice on stderr
        assert "Kaggle has no Google Drive: the run is kept on the Hugging Face Hub, in hf://user/colab_kit" in said
        assert f"persistent folder: {tmp_path / 'k.hub'}, a replica of the Hugging Face Hub" in said
        assert run.durability == "hub" and "k/lease.json" in head_files(hub_env, "user/colab_kit")
    finally:
        run.finish(timeout=30)


def test_a_fresh_start_over_a_run_on_the_hub_is_refused_and_changes_nothing(hub_env, tmp_path):
    """resume=False / resume_from_checkpoint=False would move the replica's checkpoints aside while the Hub keeps
    them: the next VM would bring the old run back beside the new one. Refused, saying what to do."""
    run = ck.start_run("old", store="hf://user/runs", local_dir=tmp_path / "old", save_every=5, gauges=False,
                       quiet=True)
    run.train(tiny_trainer(run, max_steps=5))
    run.finish(timeout=60)
    with pytest.raises(ValueError, match="a fresh start over a run kept on the Hub is not supported yet"):
        ck.start_run("old", store="hf://user/runs", local_dir=tmp_path / "old", resume=False, gauges=False)
    run = ck.start_run("old", store="hf://user/runs", local_dir=tmp_path / "old", save_every=5, gauges=False,
                       quiet=True)
    before = hub_checkpoints(hub_env, "old")
    try:
        with pytest.raises(ck.ColabKitError, match="resume_from_checkpoint=False on a run kept on the Hugging Face"):
            run.train(tiny_trainer(run, max_steps=5), resume_from_checkpoint=False)
        assert hub_checkpoints(hub_env, "old") == before == {5}
    finally:
        run.finish(timeout=60)


def test_a_kernel_restart_keeps_the_journals_newer_lines_and_the_hub_gets_them(hub_env, tmp_path):
    """Issue 46, path 3: lines written after the Hub's last journal commit (a kernel restart came first) were
    lost for good when the next start_run on the same VM replaced the replica's journal with the Hub's older
    copy. Now the replica keeps them (merged, never replaced) and the next commits take them to the Hub."""
    local = tmp_path / "vm1" / "rna"
    run = ck.start_run("rna", store="hf://user/runs", local_dir=local, save_every=5, gauges=False, quiet=True)
    run.train(tiny_trainer(run, max_steps=10))
    run.finish(timeout=60)
    replica = tmp_path / "vm1" / "rna.hub" / "events.jsonl"
    assert head_files(hub_env)["rna/events.jsonl"].content == replica.read_bytes()
    unsent = json.dumps({"event": "warn", "what": "written_before_the_restart", "time": time.time()})
    for copy in (replica, local / "events.jsonl"):  # what the kernel's journal wrote before its commit
        copy.write_text(copy.read_text() + unsent + "\n")

    run = ck.start_run("rna", store="hf://user/runs", local_dir=local, save_every=5, gauges=False, quiet=True)
    assert unsent in replica.read_text().splitlines()
    run.finish(timeout=60)
    on_hub = head_files(hub_env)["rna/events.jsonl"].content.decode().splitlines()
    assert on_hub.count(unsent) == 1 and on_hub.index(unsent) < len(on_hub) - 1  # once, before this start's lines


def test_the_advice_to_start_fresh_on_the_hub_is_a_call_the_hub_store_takes(hub_env, tmp_path):
    """Issue 46, path 8: a resume that cannot fit advised start_run(..., resume=False), which the Hub store
    refuses. On the Hub the advice is a new name, and that call works."""
    run = ck.start_run("rna", store="hf://user/runs", local_dir=tmp_path / "vm" / "rna", save_every=5,
                       gauges=False, quiet=True)
    run.train(tiny_trainer(run, max_steps=5))
    run.finish(timeout=60)
    run = ck.start_run("rna", store="hf://user/runs", local_dir=tmp_path / "vm" / "rna", save_every=5,
                       gauges=False, quiet=True)
    try:
        with pytest.raises(ck.ResumeMismatchError) as raised:
            run.train(tiny_trainer(run, max_steps=10, batch_size=8))  # another effective batch
    finally:
        run.finish(timeout=60)
    advice = str(raised.value)
    assert "resume=False)" not in advice and "ck.start_run('rna-2', store=...)" in advice
    with pytest.raises(ValueError, match="resume=False on the Hub store"):  # what the old advice led to
        ck.start_run("rna", store="hf://user/runs", local_dir=tmp_path / "vm" / "rna", resume=False, quiet=True)
    again = ck.start_run("rna-2", store="hf://user/runs", local_dir=tmp_path / "vm" / "rna-2", save_every=5,
                         gauges=False, quiet=True)
    again.train(tiny_trainer(again, max_steps=5, batch_size=8))
    assert again.finish(timeout=60)["cloud_step"] == 5


def test_a_checkpoint_uploading_longer_than_the_watch_window_keeps_the_runtime_alive(hub_env, tmp_path, monkeypatch):
    """Issue 46, path 1: the lease's heartbeat is a commit, and a checkpoint's commit held the lease's lock
    while its files uploaded. An upload longer than the watch window (1.5 beats; here 1 s beats and an upload
    stalled 8 s: a 1 GB checkpoint at 2 MB/s, scaled down) froze the heartbeat, a second runtime judged the
    first dead and took the run over while it trained, and the checkpoint never landed. Now the data goes up
    before the commit, outside the lock: the heartbeat beats on, the second runtime is refused, the checkpoint
    lands."""
    import socket

    from transformers import TrainerCallback

    hub = hub_env
    seen = {}

    class SecondRuntime(TrainerCallback):  # on the main thread, as a second notebook's start_run cell would be
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 5:  # the kit has queued checkpoint-5: its model file will hang 8 s
                import hashlib

                model = (tmp_path / "vm1" / "long" / "checkpoint-5" / "model.safetensors").read_bytes()
                seen["puts"] = hub.state.count("lfs_upload", "PUT")
                hub.faults.stall(8.0, endpoint="lfs_upload", path=hashlib.sha256(model).hexdigest())

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step != 6:
                return
            started = time.monotonic()
            while hub.state.count("lfs_upload", "PUT") == seen["puts"]:  # the checkpoint's upload has begun
                assert time.monotonic() - started < 30
                time.sleep(0.05)
            with monkeypatch.context() as other_vm:
                other_vm.setattr(socket, "gethostname", lambda: "vm2")  # another host: watched for 1.5 beats
                try:
                    second = ck.start_run("long", store="hf://user/runs", local_dir=tmp_path / "vm2" / "long",
                                          gauges=False, quiet=True)
                    second.finish(timeout=10)  # it took the run over: the test fails below
                    seen["second"] = "took the run over"
                except ck.LeaseHeldError as exc:
                    seen["second"] = str(exc)
            seen["answered_s"] = time.monotonic() - started

    run = ck.start_run("long", store="hf://user/runs", local_dir=tmp_path / "vm1" / "long", save_every=5,
                       heartbeat_s=1.0, gauges=False, quiet=True)
    trainer = tiny_trainer(run, max_steps=10, callbacks=[SecondRuntime()])
    run.train(trainer)
    summary = run.finish(timeout=60)
    assert "in use by another runtime" in seen["second"] and seen["answered_s"] < 8.0  # refused while it uploaded
    assert summary["cloud_step"] == 10 and summary["in_cloud"] is True and not run.lease.lost
    events = read_events(tmp_path / "vm1" / "long.hub" / "events.jsonl")
    assert {5, 10} <= {e["step"] for e in events if e["event"] == "cloud" and "step" in e}  # both landed


def test_a_new_export_replaces_final_on_the_hub_whole_and_keeps_the_old_one_in_archive(hub_env, tmp_path):
    """Issue 46, path 5: commits only add files, so after a second export the Hub's final/ held the new weights
    beside the first export's metrics.json while finish said it was in the cloud, and the archive/ that the
    message named existed only on the VM. Now final/ on the Hub holds exactly the new export, and the old one
    is in archive/ there."""
    run = ck.start_run("fin", store="hf://user/runs", local_dir=tmp_path / "vm" / "fin", save_every=5, gauges=False,
                       quiet=True)
    trainer = tiny_trainer(run, max_steps=5)
    run.train(trainer)
    run.save_final(trainer.model, metrics={"accuracy": 0.5})
    assert run.finish(timeout=60)["in_cloud"] is True
    assert "fin/final/metrics.json" in head_files(hub_env)

    run = ck.start_run("fin", store="hf://user/runs", local_dir=tmp_path / "vm" / "fin", save_every=5, gauges=False,
                       quiet=True)
    trainer = tiny_trainer(run, max_steps=10)
    run.train(trainer)
    run.save_final(trainer.model)  # no metrics this time
    assert run.finish(timeout=60)["in_cloud"] is True
    files = head_files(hub_env)
    final = {path for path in files if path.startswith("fin/final/")}
    replica = tmp_path / "vm" / "fin.hub"
    assert final == {f"fin/final/{p.relative_to(replica / 'final').as_posix()}"
                     for p in (replica / "final").rglob("*") if p.is_file()}  # exactly the new export
    assert "fin/final/metrics.json" not in final and verified_on_hub(files, "fin/final")
    archived = [path for path in files if path.startswith("fin/archive/") and path.endswith("/metrics.json")]
    assert len(archived) == 1  # the first export, kept where the store keeps things
    assert json.loads(files[archived[0]].content) == {"accuracy": 0.5}
