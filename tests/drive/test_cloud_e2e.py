"""End to end on an emulated Google Drive: "in the cloud" holds through disconnects.

Training runs through `start_run` + `run.train` with ~8 MB checkpoints written faster than the
DriveFS emulator uploads them; the job and the emulator are SIGKILLed together (the VM dies, and
every pending upload with it) and training continues on a new VM whose Drive is the cloud folder.
The same scenario under the pruning rule before 0.2 shows what these tests guard against.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter

import harness  # noqa: E402
import pytest
from drive_api_server import DriveApiServer

import colab_kit as ck
from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.journal import read_events
from colab_kit.checkpoints.manifest import read_manifest
from colab_kit.checkpoints.validity import verify_folder
from colab_kit.tasks.demo import tiny_trainer

pytestmark = pytest.mark.slow
HEAVY = ["--vocab", "20000"]  # ~8 MB per checkpoint (weights + AdamW state), steps stay fast
SIZE = 8.0e6  # bytes of one HEAVY checkpoint
# The emulator leaves an entry out of one listing at a time: looks spaced by 0.2 s are spaced enough here
# (the simulator, tests/sim/, holds the kit's own spacing against files hidden for seconds).
LOOKS = ["--look-spacing", "0.2"]
RATE = 1.5e6  # bytes/s: ~5.3 s per checkpoint, while training makes one every ~1.5 s


def cloud_valid_steps(drive, name: str) -> set[int]:
    """The checkpoints in the emulator's cloud folder whose manifest verifies (sizes and sha256)."""
    return {step for step, path in list_checkpoints(drive.cloud / name / "checkpoints") if verify_folder(path) is None}


def wait_for_event(job: harness.Job, proc, kind: str, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if any(e["event"] == kind for e in job.local_events()):
            return True
        time.sleep(0.05)
    return False


def kill_cycle(job: harness.Job, drive, after: str, delay: float) -> tuple[bool, str, list]:
    """Start the job, SIGKILL it and the emulator `delay` s after its first `after` event.
    Returns (killed, its output, the events it journaled)."""
    proc = job.start()
    killed = False
    if wait_for_event(job, proc, after):
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            killed = True
    drive.kill()  # the VM is gone, with Drive's cache and its pending uploads
    text, _ = proc.communicate(timeout=120)
    events = job.local_events()
    return killed, text, events


@pytest.fixture(scope="module")
def heavy_reference(tmp_path_factory, shared_tmp):
    return harness.reference_weights(tmp_path_factory.mktemp("ref"), "trainer", steps=60, save_every=5, extra=HEAVY,
                                     shared=shared_tmp)  # computed once for every worker


def disconnect_scenario(tmp_path, drive, reference, *, seed: int, kills_wanted: int = 8, delay: float = 9.0,
                        extra=(), loop: str = "trainer", steps: int = 60, step_sleep: float = 0.3,
                        after: str = "save") -> dict:
    """Kill the job and the emulator together `kills_wanted`+ times at random moments of an upload backlog,
    each restart on a new VM, then let it finish. Checked at every kill: after the first checkpoint is
    complete in the cloud the cloud always holds one that verifies; every `cloud` claim is true; each
    restart resumes from the newest checkpoint valid in the cloud. At the end: the weights of an
    uninterrupted run. Returns what was seen."""
    # 0.3 s a step: a job trains longer than the longest delay, so that most cycles end in a kill
    job = harness.Job(tmp_path, loop=loop, steps=steps, save_every=5, step_sleep=step_sleep, drive_root=drive.mountpoint,
                      extra=[*HEAVY, "--keep", "2", *LOOKS, *extra])
    rng = random.Random(seed)
    reported: set[int] = set()
    complete_once, kills, expect_resume, claims = False, 0, None, 0
    for cycle in range(3 * kills_wanted):
        killed, text, events = kill_cycle(job, drive, after, rng.uniform(0.0, delay))
        resumed = harness.resumed_from(text)
        if expect_resume is not None and resumed is not None:
            assert resumed == expect_resume, f"cycle {cycle}: resumed from {resumed}, the cloud held {expect_resume}"
        reported = harness.reported_in_cloud(events, reported)
        claims += len([e for e in events if e["event"] == "cloud"])
        valid = cloud_valid_steps(drive, job.name)
        complete_once |= bool(valid)
        if complete_once:
            assert valid, f"cycle {cycle}: no checkpoint in the cloud verifies, after one did"
        assert reported <= valid, f"cycle {cycle}: reported in the cloud {sorted(reported)}, valid there {sorted(valid)}"
        expect_resume = max(valid, default=0)
        kills += killed
        if killed and kills >= kills_wanted and complete_once:
            break
        job.new_vm()
        drive.new_vm()
    assert kills >= kills_wanted, f"only {kills} kills landed"
    job.new_vm()
    drive.new_vm()
    code, text = job.run()
    assert code == 0, text[-3000:]
    assert harness.resumed_from(text) == expect_resume
    final = harness.load_weights(tmp_path / "final.safetensors")
    assert harness.max_abs_diff(reference, final) <= 1e-6
    return {"kills": kills, "claims": claims, "faults": drive.faults_seen(), "job": job}


@pytest.mark.slow(110)
def test_disconnects_during_an_upload_backlog_never_lose_the_cloud_checkpoint(tmp_path, emulated_drive,
                                                                            heavy_reference):
    disconnect_scenario(tmp_path, emulated_drive(rate=RATE), heavy_reference, seed=10)


# EIO on 1 % of reads, stats, listings and attribute reads; an entry missing from 2 % of listings;
# 0.5 % of all operations held for 3 s; errno 107 on 0.2 % of them.
FAULTS = "eio=0.01,vanish=0.02,stall=0.005:3,enotconn=0.002"


# The real FUSE mount with faults injected, with and without attributes (about 2 minutes each): every .ci/run
# runs both, in a step of its own beside the 10,000 simulated schedules (COLAB_KIT_FULL_E2E=1), which keeps the
# test command under 12 minutes. The test command covers the same faults through the simulator (its "attrs",
# "none" and "other" modes, 1,000 schedules) and the real mount through the disconnect, stall and ladder tests here.
IN_CI_ONLY = pytest.mark.skipif(not os.environ.get("COLAB_KIT_FULL_E2E"), reason=(
    "about 2 minutes: .ci/run runs it in every run (COLAB_KIT_FULL_E2E=1); the test command covers faults through "
    "the simulator (tests/drive/test_simulation.py) and the real mount through the disconnect tests here"))


@pytest.mark.slow(150)
@IN_CI_ONLY
@pytest.mark.parametrize("attrs", [pytest.param(True, id="attributes"), pytest.param(False, id="no-attributes")])
def test_a_faulty_drive_costs_time_never_a_checkpoint(tmp_path, emulated_drive, heavy_reference, attrs):
    # At 7.5 MB/s (~1 s a checkpoint): the slow-upload backlog with faults is the simulator's to cover, over
    # thousands of schedules (tests/drive/test_simulation.py); here, the real FUSE mount and training.
    rate = 7.5e6
    drive = emulated_drive(rate=rate, attrs=attrs, faults=FAULTS, seed=int(rate) + attrs)
    # Kills land anywhere from the first save to past one checkpoint's upload time (~8 MB).
    seen = disconnect_scenario(tmp_path, drive, heavy_reference, seed=7, delay=2.0 + SIZE / rate, kills_wanted=4)
    kinds = Counter(f["fault"] for f in seen["faults"])
    print(f"{seen['kills']} kills, faults injected: {dict(kinds)}")
    # The faults did happen (the log is the emulator's). A listing's entry hidden for a moment is drawn
    # per listing, and runs without attributes list rarely: test_retention.py and test_doubt.py have it.
    assert kinds["eio"] and kinds["stall"] and sum(kinds.values()) >= 10, kinds
    if not attrs:
        assert seen["claims"] == 0  # where nothing reports uploads, nothing is ever called in the cloud


def test_a_stalled_drive_never_stalls_the_training_loop(tmp_path, emulated_drive):
    # Every operation of the mount held for 5 s, twice, while the job trains and saves every 2 steps.
    stall_s = 5.0
    drive = emulated_drive(rate=20e6, stall_s=stall_s)
    timings = tmp_path / "timings.txt"
    job = harness.Job(tmp_path, steps=160, save_every=2, step_sleep=0.1, drive_root=drive.mountpoint,
                      extra=["--timings", str(timings)])
    proc = job.start()
    assert wait_for_event(job, proc, "save")
    stalls = []
    for _ in range(2):
        stalls.append(time.time())
        drive.stall()
        time.sleep(stall_s + 1.0)
    text, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, text[-3000:]
    steps = [tuple(map(float, line.split())) for line in timings.read_text().splitlines()]
    during = [seconds for _, seconds, at in steps if any(t <= at <= t + stall_s for t in stalls)]
    assert len(during) >= 10, "the loop kept stepping while the mount stalled"
    # A loop that waited on the mount would pause for the rest of a stall: ~5 s at the first save in it.
    # The bound is half that, not a step's usual ~0.1 s: a step (its local save and pruning included) took
    # up to 1.4 s on a 2-core CI machine shared with the other test workers.
    assert max(during) < stall_s / 2, max(during)  # the longest pause of the loop while Drive stood still
    assert any(f["fault"] == "signal_stall" for f in drive.faults_seen())


def test_without_attributes_the_ladder_keeps_one_in_the_cloud_and_stays_bounded(tmp_path, emulated_drive):
    # A mount without attributes, the ladder from 3 s (every checkpoint younger than that, then one per
    # doubling of age, and the oldest) and Drive at 1.5 MB/s (~5.3 s per ~8 MB checkpoint, one saved
    # every ~1.5 s): uploads lag behind the saves. Watched every 0.25 s: once a checkpoint is complete in
    # the cloud, one always is; what Drive holds stays bounded (about log2(age / 3 s) + 2, plus the young).
    drive = emulated_drive(rate=1.5e6, attrs=False)
    job = harness.Job(tmp_path, steps=160, save_every=5, step_sleep=0.2, drive_root=drive.mountpoint,
                      extra=[*HEAVY, "--keep", "1", "--settle", "3s", "--assumed-rate", "1MB/s", *LOOKS])
    proc = job.start()
    seen, peak = [], (0, 0)
    while proc.poll() is None:
        valid = cloud_valid_steps(drive, job.name)
        seen.append(bool(valid))
        folders = list_checkpoints(drive.cloud / job.name / "checkpoints")
        held = sum(p.stat().st_size for _, f in folders for p in f.rglob("*") if p.is_file())
        peak = max(peak, (len(folders), held))
        time.sleep(0.25)
    text, _ = proc.communicate()
    assert proc.returncode == 0, text[-3000:]
    first = seen.index(True)
    assert all(seen[first:]), "the cloud held no valid checkpoint for a moment, after one was complete"
    pruned = [e for e in job.local_events() if e["event"] == "prune"]
    assert pruned, "nothing was let go: the run was too short to show the ladder"
    assert all(e["witness"] < min(e["steps"]) for e in pruned)  # each vouched for by an older checkpoint
    print(f"peak in the cloud: {peak[0]} checkpoints, {peak[1] / 1e6:.0f} MB")
    assert peak[0] <= 12  # the ladder's rungs over ~50 s, the ones younger than 3 s, the oldest


def test_the_rule_before_0_2_loses_every_cloud_checkpoint_in_a_backlog(tmp_path, emulated_drive):
    # Pruning once a newer manifest is *written* (keep=3, the default): a checkpoint every ~2.5 s,
    # 5.4 s of upload each. The first one reaches the cloud; it is deleted at once when the third
    # newer one is written, while those are still queued behind each other, and a disconnect from
    # then on leaves no checkpoint in the cloud.
    drive = emulated_drive(rate=RATE)
    lost = []
    for seed in range(8):
        job = harness.Job(tmp_path / f"seed{seed}", steps=80, save_every=10, step_sleep=0.2,
                          drive_root=drive.mountpoint, name=f"old{seed}", extra=[*HEAVY, "--prune-after", "written"])
        killed, _, events = kill_cycle(job, drive, "cloud", random.Random(seed).uniform(1.0, 8.0))
        confirmed = any(e["event"] == "cloud" for e in events)
        if killed and confirmed and not cloud_valid_steps(drive, job.name):
            lost.append(seed)
            break
        drive.new_vm()
    assert lost, "the emulator should reproduce the loss of every cloud checkpoint under the old rule"


def test_pruning_leaves_only_empty_stubs_in_drives_trash(tmp_path, emulated_drive):
    from transformers import TrainerCallback

    class Slow(TrainerCallback):  # ~0.3 s between saves; each ~3 MB checkpoint uploads in ~0.1 s
        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(0.15)

    drive = emulated_drive(rate=40e6)
    run = ck.start_run("pruned", drive=drive.mountpoint, local_dir=tmp_path / "local", save_every=2, keep=1,
                       quiet=True, gauges=False)
    run.train(tiny_trainer(run, max_steps=24, vocab_size=8000, callbacks=[Slow()]))
    summary = run.finish(timeout=60)
    assert summary["in_cloud"] is True
    events = read_events(tmp_path / "local" / "events.jsonl")
    sizes = {e["step"]: e["bytes"] for e in events if e["event"] == "sync"}
    pruned = [s for e in events if e["event"] == "prune" for s in e["steps"]]
    # Every checkpoint written but the last was pruned (how many were written, rather than superseded in the
    # queue, depends on the machine's load: 12 on a quiet one, 6 under CI's).
    assert sorted(pruned) == sorted(set(sizes) - {24}) and len(pruned) >= 3, (pruned, sorted(sizes))
    pruned_bytes = sum(sizes[s] for s in pruned)
    assert drive.trash_bytes() <= 0.01 * pruned_bytes, (drive.trash_bytes(), pruned_bytes)
    assert [s for s, _ in list_checkpoints(drive.cloud / "pruned" / "checkpoints")] == [24]


@pytest.mark.slow(55)
def test_a_time_interval_stretches_to_the_upload_rate_and_bounds_the_work_at_risk(tmp_path, emulated_drive):
    from transformers import TrainerCallback

    class Slow(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            time.sleep(0.15)

    drive = emulated_drive(rate=RATE)
    run = ck.start_run("stretch", drive=drive.mountpoint, local_dir=tmp_path / "local", save_every="2s",
                       keep=2, quiet=True, gauges=False)
    run.train(tiny_trainer(run, max_steps=260, vocab_size=20000, callbacks=[Slow()]))
    run.finish(timeout=60)
    events = read_events(tmp_path / "local" / "events.jsonl")
    stretched = [e for e in events if e["event"] == "warn" and e.get("what") == "save_interval"]
    assert stretched and stretched[0]["asked_s"] == 2.0
    interval = stretched[-1]["interval_s"]
    upload_s = SIZE / RATE
    assert 1.0 * upload_s <= interval <= 2.0 * upload_s, interval  # what the emulator absorbs, with room
    since = stretched[0]["time"]
    cloud = [e for e in events if e["event"] == "cloud" and "step" in e and e["time"] - e["seconds"] >= since]
    assert len(cloud) >= 3
    at_risk = [b["time"] - (a["time"] - a["seconds"]) for a, b in zip(cloud, cloud[1:])]
    assert max(at_risk) <= 2 * interval, (at_risk, interval)


def test_a_reconnect_from_another_host_takes_over_a_dead_lease_but_not_a_live_one(tmp_path):
    first = harness.Job(tmp_path, steps=400, save_every=10, step_sleep=0.05,
                        extra=["--hostname", "vm-old", "--heartbeat", "2"])
    proc = first.start()
    assert wait_for_event(first, proc, "save"), proc.communicate()[0][-2000:]
    second = harness.Job(tmp_path / "vm-new", steps=400, save_every=10, drive_root=first.drive,
                         extra=["--hostname", "vm-new", "--heartbeat", "2"])  # another VM: its own local disk
    live = second.start()  # the first job is alive: refused after watching its heartbeat
    text, _ = live.communicate(timeout=120)
    assert live.returncode == 3 and "LEASE HELD" in text and "advanced while this runtime watched" in text, text[-2000:]
    proc.send_signal(signal.SIGKILL)  # the first VM dies with a fresh-looking lease
    proc.communicate(timeout=60)
    second.steps = 20
    code, text = second.run()  # at once, from another host name, without takeover=True
    assert code == 0, text[-3000:]
    start = [e for e in read_events(second.run_dir / "events.jsonl") if e["event"] == "start"][-1]
    assert start["host"] == "vm-new" and start["took_over"] == "vm-old"
    assert "did not advance in 3 s" in start["took_over_because"]
    # 1.5 heartbeats of watching (not the lease's stale age), read every 0.2 s; measured around the watch alone,
    # since the rest of start_run (imports, the first listing) stretches with the machine's load.
    assert 1.5 * 2 <= start["watched_s"] <= 1.5 * 2 + 2.0, start["watched_s"]


def test_drive_check_prints_the_attribute_timeline_and_the_upload_rate(emulated_drive):
    drive = emulated_drive(rate=2e6)
    out = subprocess.run([sys.executable, "-m", "colab_kit", "drive-check", str(drive.mountpoint), "--size-mb", "8",
                          "--interval", "0.25"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["drive_mount"] and report["attributes"] == {
        "user.drive.uncommitted": True, "user.drive.id": True, "user.drive.md5": False}  # md5 only once uploaded
    first, last = report["timeline"][0], report["timeline"][-1]
    assert first["user.drive.uncommitted"] == "1" and first["user.drive.id"].startswith("local-")
    assert last["user.drive.uncommitted"] == "0" and last["user.drive.id"].startswith("cloud-")
    assert 0.8 * 2e6 <= report["upload_bytes_per_s"] <= 1.2 * 2e6, report["upload_bytes_per_s"]
    assert report["delete"]["unlinked"] and drive.trash_bytes() == 0
    assert not list(drive.cloud.iterdir())


def test_status_shows_what_is_in_the_cloud_and_what_is_pending(tmp_path, emulated_drive):
    drive = emulated_drive(rate=1e6)
    run = ck.start_run("seen", drive=drive.mountpoint, local_dir=tmp_path / "local", save_every=5, keep=2,
                       quiet=True, gauges=False)
    run.train(tiny_trainer(run, max_steps=10, vocab_size=8000))  # ~3 MB checkpoints, ~3 s each
    out = subprocess.run([sys.executable, "-m", "colab_kit", "status", str(run.drive_dir)], capture_output=True,
                         text=True, timeout=60).stdout
    assert "durability: Google Drive" in out
    assert "checkpoint-10" in out and ("uploading:" in out or "in the cloud" in out)
    summary = run.finish(timeout=60)
    assert summary["in_cloud"] and summary["cloud_step"] == 10 and summary["pending_bytes"] == 0
    out = subprocess.run([sys.executable, "-m", "colab_kit", "status", str(run.drive_dir)], capture_output=True,
                         text=True, timeout=60).stdout
    assert "newest in the cloud: checkpoint-10" in out and "pending upload" not in out
    assert read_manifest(drive.cloud / "seen" / "checkpoints" / "checkpoint-10").step == 10


@pytest.mark.slow(80)
def test_disconnects_with_api_confirmation_never_lose_the_cloud_checkpoint(tmp_path, emulated_drive, heavy_reference,
                                                                          monkeypatch):
    """Issue 10's disconnect scenario on a mount without attributes, confirmed through the API: 6+
    kills of the job and the emulator together; every `cloud` claim is complete in the cloud at the next
    kill, each restart resumes from the newest valid cloud checkpoint, the weights are an uninterrupted
    run's (`disconnect_scenario` checks all of it). At 7.5 MB/s; the slow-upload backlog, confirmed through the
    API with its 403s and 5xx, is the simulator's to cover."""
    rate = 7.5e6
    drive = emulated_drive(rate=rate, attrs=False)
    server = DriveApiServer(drive.cloud, drive.trash).start()
    monkeypatch.setenv("COLAB_KIT_DRIVE_API", server.url)
    monkeypatch.setenv("COLAB_KIT_DRIVE_ROOT", str(drive.mountpoint))
    try:
        # Kills land from the first save to past one upload and its first API listing, so that some
        # confirmations are made, and checked, before a kill.
        seen = disconnect_scenario(tmp_path, drive, heavy_reference, seed=11, delay=4.0 + 1.4 * SIZE / rate,
                                   extra=["--confirm", "api"], kills_wanted=6)
    finally:
        server.stop()
    clouds = [e for e in read_events(drive.cloud / "job" / "events.jsonl") if e["event"] == "cloud" and "step" in e]
    assert seen["claims"] > 0 and clouds and all(e["via"] == "api" for e in clouds)
    calls = [e["api_calls"] for e in clouds]
    print(f"{seen['kills']} kills, {seen['claims']} cloud claims, API calls per confirmed checkpoint: {calls}")
    assert max(calls) <= 10, calls
