"""The run folder explains itself (issue 49): `STATUS.md` and `status.png` beside the run's files, written with the
lease's heartbeat, say the same state, step and newest checkpoint in the cloud as `python -m colab_kit status`,
at every checkpoint confirmed and at the end, on the DriveFS emulator and on the emulated Hub; a run taken over
is described by the runtime that holds it now.
"""

import re
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import TrainerCallback

import colab_kit as ck
from colab_kit.__main__ import main
from colab_kit.report.card import card_rows
from colab_kit.drive.lease import read_lease
from colab_kit.report.page import utc
from colab_kit.tasks.demo import tiny_trainer

sys.path.insert(0, str(Path(__file__).parents[1] / "scripts"))
import harness  # noqa: E402
from hub_state import HubError  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def every_confirmation_drawn(monkeypatch):
    """The picture drawn at each checkpoint confirmed (a run drawing at most once a minute is tested below)."""
    from colab_kit.report import reporter

    monkeypatch.setattr(reporter, "PICTURE_MIN_S", 0.0)


def said_by_page(text: str) -> dict:
    state = re.search(r"^# Run `[^`]+`: (.+)$", text, re.M).group(1)
    step = re.search(r"^\| step \| ([\d,]+)", text, re.M)
    cloud = re.search(r"^\| newest in the cloud \| checkpoint-(\d+)", text, re.M)
    return {"state": state, "step": int(step.group(1).replace(",", "")) if step else None,
            "cloud": int(cloud.group(1)) if cloud else None}


def updated_on_page(text: str) -> str:
    return re.search(r"^\| updated \| ([^,]+ UTC)", text, re.M).group(1)


def said_by_status(capsys, where) -> dict:
    assert main(["status", str(where), "--quick"] if not str(where).startswith("hf://") else ["status", str(where)]) == 0
    out = capsys.readouterr().out
    state = re.search(r"^state: (\w+(?: \([^)]*\))?)", out, re.M).group(1)
    step = re.search(r"^step: (\d+)", out, re.M)
    cloud = (re.search(r"^newest in the cloud: checkpoint-(\d+)", out, re.M)
             or re.search(r"^resume would use: checkpoint-(\d+)", out, re.M))  # the Hub: the newest whole there
    return {"state": state, "step": int(step.group(1)) if step else None, "cloud": int(cloud.group(1)) if cloud else None}


def wait_until(predicate, timeout=30.0, what="the status page"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"{what} never said it within {timeout:.0f} s")


class CompareAtEachCheckpoint(TrainerCallback):
    """At each step after a checkpoint reached the cloud (training waits here, as a reader may look at any moment):
    the page, once it says that checkpoint, and `status` must agree."""

    def __init__(self, run, read_page, status_of):
        self.run, self.read_page, self.status_of = run, read_page, status_of
        self.compared, self.pictures = [], []

    def on_step_end(self, args, state, control, **kwargs):
        time.sleep(0.1)  # a step of a real model's length: the cloud confirms while training goes on
        cloud = self.run.cloud_step
        if cloud is None or cloud in [c["cloud"] for c in self.compared]:
            return
        step = self.run.reporter.step  # the step the kit's callback (after this one) last recorded
        page = wait_until(lambda: (p := self.read_page()) and said_by_page(p[0])["cloud"] == cloud and
                          said_by_page(p[0])["step"] == step and p)
        store = self.status_of()
        assert said_by_page(page[0]) == store == {"state": "running", "step": step, "cloud": cloud}
        self.compared.append(store)
        self.pictures.append(page[1])


def test_on_the_drivefs_emulator_the_page_says_what_status_says_at_each_checkpoint_and_at_the_end(
        tmp_path, emulated_drive, capsys, every_confirmation_drawn):
    drive = emulated_drive(rate=4e6)
    folder = drive.mountpoint / "page"
    run = ck.start_run("page", drive=drive.mountpoint, local_dir=tmp_path / "vm", save_every=10, keep=2, quiet=True,
                       gauges=False, heartbeat_s=1.0)

    def read_page():
        try:
            return (folder / "STATUS.md").read_text(), (folder / "status.png").read_bytes()
        except OSError:
            return None

    compare = CompareAtEachCheckpoint(run, read_page, lambda: said_by_status(capsys, folder))
    trainer = tiny_trainer(run, max_steps=30, callbacks=[compare])
    run.train(trainer)
    run.finish(timeout=60)
    assert [c["cloud"] for c in compare.compared] == [10, 20]
    assert all(p.startswith(PNG) for p in compare.pictures) and compare.pictures[0] != compare.pictures[1]
    page = read_page()[0]
    assert said_by_page(page) == said_by_status(capsys, folder) == {"state": "finished", "step": 30, "cloud": 30}

    # Another runtime opens the run: the page is its own now (running, no step trained yet).
    again = ck.start_run("page", drive=drive.mountpoint, local_dir=tmp_path / "vm2", quiet=True, gauges=False,
                         heartbeat_s=1.0)
    try:
        wait_until(lambda: (p := read_page()) and said_by_page(p[0])["state"] == "running")
        assert said_by_status(capsys, folder)["state"] == "running"
        assert "step" not in said_by_page(read_page()[0]) or said_by_page(read_page()[0])["step"] is None
    finally:
        again.finish(timeout=30)


def stop_between_beats(proc, folder: Path, timeout: float = 30.0) -> None:
    """SIGSTOP the job at a moment when its page and its lease went out with the same beat (the lease is written
    first, then the page, so a stop between the two finds the page a beat behind: then let it run a little more).
    The test then kills it there, as a runtime cut between two beats."""
    deadline = time.monotonic() + timeout
    while True:
        proc.send_signal(signal.SIGSTOP)
        try:
            if updated_on_page((folder / "STATUS.md").read_text()) == utc(read_lease(folder).heartbeat):
                return
        except (OSError, AttributeError, ValueError):  # a page being written in place: look again
            pass
        proc.send_signal(signal.SIGCONT)
        assert time.monotonic() < deadline, "the page never caught up with the lease"
        time.sleep(0.05)


@pytest.mark.slow(40)
def test_a_killed_run_leaves_a_page_that_agrees_with_status_and_says_its_time_stopped(tmp_path, emulated_drive,
                                                                                      capsys):
    """A runtime killed (SIGKILL: no finish, no release) cannot write again: its last page and `status` agree on
    the state, the step and the newest checkpoint in the cloud, and the page's time, older than four beats, says
    that the runtime stopped (`status` says `running (but ...)`). A new runtime that takes the run over writes its
    own page."""
    drive = emulated_drive(rate=4e6)
    job = harness.Job(tmp_path, steps=400, save_every=10, step_sleep=0.1, drive_root=drive.mountpoint, name="killed",
                      extra=["--heartbeat", "1"])
    folder = job.run_dir
    proc = job.start()
    try:
        def cloud_on_page() -> int:
            try:
                return said_by_page((folder / "STATUS.md").read_text())["cloud"] or 0
            except (OSError, AttributeError):  # none yet, or read while it is written in place
                return 0

        wait_until(lambda: cloud_on_page() >= 20, timeout=120)
        stop_between_beats(proc, folder)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.send_signal(signal.SIGCONT)
        proc.communicate(timeout=60)
    page = (folder / "STATUS.md").read_text()
    said = said_by_page(page)
    assert said["state"] == "running" and said["cloud"] >= 20 and said["step"] >= said["cloud"], said
    assert "a time older than 4 s means its runtime stopped without finishing" in page
    # The page and the store agree on the step and the checkpoint; `status` also sees that the runtime is gone
    # (its process has ended, on this host), as the page's time tells a reader elsewhere. Nothing writes the page.
    status = said_by_status(capsys, folder)
    assert status["step"] == said["step"] and status["cloud"] == said["cloud"], (status, said)
    assert status["state"].startswith("running (but "), status
    time.sleep(3)
    assert (folder / "STATUS.md").read_text() == page

    # Another runtime (a new VM) takes the run over: its page is its own, and it finishes the run.
    again = ck.start_run("killed", drive=drive.mountpoint, local_dir=tmp_path / "vm2", quiet=True, gauges=False,
                         heartbeat_s=1.0)
    assert again.resume_manifest.step == said["cloud"]
    again.finish(timeout=60)
    assert said_by_page((folder / "STATUS.md").read_text()) == said_by_status(capsys, folder) == {
        "state": "finished", "step": None, "cloud": said["cloud"]}


def test_on_the_emulated_hub_the_page_rides_the_heartbeat_and_the_card_lists_the_run(hub_env, tmp_path, capsys,
                                                                                     every_confirmation_drawn):
    hub = hub_env
    run = ck.start_run("st", store="hf://user/runs", local_dir=tmp_path / "vm" / "st", save_every=10, keep=3,
                       gauges=False, quiet=True, heartbeat_s=2.0)

    def read_page():
        files = hub.state.files("user/runs")
        page, picture = files.get("st/STATUS.md"), files.get("st/status.png")
        return (page.decode(), picture) if page and picture else None

    compare = CompareAtEachCheckpoint(run, read_page, lambda: said_by_status(capsys, "hf://user/runs/st"))
    run.train(tiny_trainer(run, max_steps=20, callbacks=[compare]))
    run.finish(timeout=60)
    assert [c["cloud"] for c in compare.compared] == [10]
    assert said_by_page(read_page()[0]) == said_by_status(capsys, "hf://user/runs/st") == {
        "state": "finished", "step": 20, "cloud": 20}
    card = hub.state.files("user/runs")["README.md"].decode()
    assert "| finished | 20 | checkpoint-20 |" in card_rows(card)["st"]


@pytest.mark.slow(40)
def test_on_the_hub_a_killed_run_leaves_a_page_that_agrees_with_status_and_a_takeover_writes_its_own(
        hub_env, tmp_path, capsys):
    """On the Hub the page rides the lease's own commit, so a runtime killed (SIGKILL) leaves a page and a lease
    of the same beat: the page and `status` agree on the step and the newest checkpoint whole on the Hub, once no
    checkpoint's commit came after that beat's. A new runtime takes the run over (the old process is gone), resumes
    from that checkpoint, and the page is its own: finished, as `status` and the repository's card say."""
    hub = hub_env
    where = "hf://user/runs/hkilled"
    job = harness.Job(tmp_path / "first", steps=400, save_every=10, step_sleep=0.1, drive_root="hf://user/runs",
                      name="hkilled", extra=["--heartbeat", "1"])

    def page() -> str | None:
        try:
            data = hub.state.files("user/runs").get("hkilled/STATUS.md")
        except HubError:  # the job has not created the repository yet
            return None
        return data.decode() if data else None

    proc = job.start()
    job_pid = proc.pid
    try:
        wait_until(lambda: (p := page()) and (said_by_page(p)["cloud"] or 0) >= 10, timeout=120)
        # Stopped at a moment when no checkpoint's commit came after the page's beat (a checkpoint committed and
        # verified is confirmed with a beat of its own, a moment later): then killed there.
        deadline = time.monotonic() + 30
        while True:
            proc.send_signal(signal.SIGSTOP)
            said, status = said_by_page(page()), said_by_status(capsys, where)
            if said["cloud"] == status["cloud"]:
                break
            proc.send_signal(signal.SIGCONT)
            assert time.monotonic() < deadline, (said, status)
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.send_signal(signal.SIGCONT)
        text, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, text[-2000:]
    last = page()
    said = said_by_page(last)
    assert said["state"] == "running" and said["cloud"] >= 10 and said["step"] >= said["cloud"], said
    assert "a time older than 4 s means its runtime stopped without finishing" in last
    status = said_by_status(capsys, where)
    assert status["step"] == said["step"] and status["cloud"] == said["cloud"], (status, said)
    assert status["state"] == f"running (but its process {job_pid} on this host has ended)", status
    time.sleep(3)
    assert page() == last  # nothing writes the page of a runtime that is gone

    again = ck.start_run("hkilled", store="hf://user/runs", local_dir=tmp_path / "vm2" / "hkilled", quiet=True,
                         gauges=False, heartbeat_s=1.0)
    assert again.resume_manifest.step == said["cloud"]
    wait_until(lambda: (p := page()) and p != last and said_by_page(p)["state"] == "running")
    again.finish(timeout=60)
    assert said_by_page(page()) == said_by_status(capsys, where) == {"state": "finished", "step": None,
                                                                     "cloud": said["cloud"]}
    card = hub.state.files("user/runs")["README.md"].decode()
    assert f"| finished | - | checkpoint-{said['cloud']} |" in card_rows(card)["hkilled"]


def test_the_picture_is_drawn_when_there_is_something_new_at_most_once_a_minute_and_at_the_end():
    """A picture costs about 0.1 s of a CPU core that training shares: none before there is something to show, none
    in the run's first minute, one when a checkpoint reached the cloud but not twice in a minute, one every five
    minutes, and the last at the end."""
    from colab_kit.report.reporter import PICTURE_EVERY_S, PICTURE_MIN_S, Reporter

    reporter = Reporter(SimpleNamespace(name="cadence", lease=SimpleNamespace(beat_now=lambda: None)))
    now = 1_000_000.0
    assert reporter._draw(now) is None  # nothing to show yet (the first beat)
    reporter.record_loss(1, 0.7)
    reporter.confirmed(SimpleNamespace(step=10, confirmed_at=now + 5, saved=now))
    assert reporter._draw(now + 5) is None  # within the run's first minute: a short run draws only at its end
    first = reporter._draw(now + PICTURE_MIN_S)
    assert first.startswith(PNG)
    reporter.confirmed(SimpleNamespace(step=20, confirmed_at=now + PICTURE_MIN_S + 10, saved=now + PICTURE_MIN_S + 5))
    assert reporter._draw(now + PICTURE_MIN_S + 10) is None  # a second checkpoint within the minute waits
    assert reporter._draw(now + 2 * PICTURE_MIN_S).startswith(PNG)  # then it is drawn
    reporter.record_loss(2, 0.6)
    assert reporter._draw(now + 2 * PICTURE_MIN_S + 30) is None  # a loss alone waits for the five minutes
    assert reporter._draw(now + 2 * PICTURE_MIN_S + PICTURE_EVERY_S).startswith(PNG)
    reporter.closing("completed")
    assert reporter._draw(now + 2 * PICTURE_MIN_S + PICTURE_EVERY_S + 1).startswith(PNG)  # the run's last picture
