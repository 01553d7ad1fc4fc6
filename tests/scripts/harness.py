"""Run tiny_job.py in subprocesses, kill it, restart it, and check what survived.

Used by tests/test_e2e_resume.py (a few kills) and bench/kill_anywhere.py (many).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import warm

JOB = Path(__file__).with_name("tiny_job.py")
PHASES = ("step", "local_save", "upload", "manifest", "prune", "journal", "fetch")


@dataclass
class Job:
    root: Path
    loop: str = "trainer"
    steps: int = 60
    save_every: int | str = 10
    name: str = "job"
    step_sleep: float = 0.0
    extra: list = field(default_factory=list)  # more tiny_job.py options (--vocab, --keep, ...)
    drive_root: Path | None = None  # the persistent root (an emulated Drive's mount); default root/drive
    log: list = field(default_factory=list)
    started: int = 0

    @property
    def drive(self) -> Path:
        return self.drive_root or self.root / "drive"

    @property
    def local(self) -> Path:
        return self.root / "local"

    @property
    def run_dir(self) -> Path:
        return self.drive / self.name

    def command(self, out: Path, kill: str | None) -> list[str]:
        cmd = [sys.executable, str(JOB), "--drive", str(self.drive), "--local", str(self.local),
               "--out", str(out), "--name", self.name, "--loop", self.loop, "--steps", str(self.steps),
               "--save-every", str(self.save_every), "--step-sleep", str(self.step_sleep), *map(str, self.extra)]
        return cmd + (["--kill", kill] if kill else [])

    def start(self, kill: str | None = None, out: Path | None = None):
        """Start the job: a fork of a process that has imported torch and transformers already
        (`warm.py`; a new interpreter would spend ~6.5 s of CPU importing them). It returns an object
        with Popen's methods; the job's output goes to a log file in `root`."""
        out = out or self.root / "final.safetensors"
        self.root.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        env.pop("COLAB_KIT_DRIVE", None)
        self.started += 1
        log = self.root / f"job-{self.started}.log"
        return warm.start(self.command(out, kill)[2:], env=env, cwd=self.root, out=log)

    def run(self, kill: str | None = None, timeout: float = 300, out: Path | None = None) -> tuple[int, str]:
        proc = self.start(kill, out)
        text, _ = proc.communicate(timeout=timeout)
        self.log.append((kill, proc.returncode, text))
        return proc.returncode, text

    def run_and_kill_after(self, seconds: float, timeout: float = 300) -> tuple[int, str]:
        """Start the job and SIGKILL it from outside after `seconds` (if still running)."""
        proc = self.start()
        try:
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGKILL)
        text, _ = proc.communicate(timeout=timeout)
        self.log.append((f"after {seconds:.2f}s", proc.returncode, text))
        return proc.returncode, text

    def new_vm(self) -> None:
        """Wipe local disk, as a Colab runtime reset does; only the Drive folder survives."""
        shutil.rmtree(self.local, ignore_errors=True)

    def events(self) -> list[dict]:
        from colab_kit.checkpoints.journal import read_events

        return read_events(self.run_dir / "events.jsonl")

    def local_events(self) -> list[dict]:
        """The journal's copy on local disk: every event of this VM, also those Drive never got."""
        from colab_kit.checkpoints.journal import read_events

        return read_events(self.local / "events.jsonl")


def kill_when(job: Job, ready: Callable[[list[dict]], bool], timeout: float = 120) -> list[dict]:
    """Start the job and SIGKILL it from outside as soon as `ready(events)` holds for its journal on
    the persistent folder; returns those events. Fails when the job ends before that."""
    proc = job.start()
    deadline = time.monotonic() + timeout
    events: list[dict] = []
    while time.monotonic() < deadline and proc.poll() is None:
        events = job.events()
        if ready(events):
            proc.send_signal(signal.SIGKILL)
            break
        time.sleep(0.02)
    text, _ = proc.communicate(timeout=60)
    job.log.append(("from outside", proc.returncode, text))
    assert proc.returncode == -signal.SIGKILL, f"the job was not killed mid-run:\n{text[-2000:]}"
    return events


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL `proc` and all its descendants, then wait until they are gone. A process-group kill is
    not enough: torchrun starts each rank in a session of its own."""
    import psutil

    if isinstance(proc, warm.WarmRanks):  # ranks forked by warm.py: no launcher between them
        proc.kill()
        proc.wait(timeout=60)
        return

    try:
        parent = psutil.Process(proc.pid)
        children = parent.children(recursive=True)
    except psutil.NoSuchProcess:
        return
    for victim in (*children, parent):  # the workers first: the job dies, not just its launcher
        try:
            victim.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=60)
    # SIGKILL lands asynchronously; orphans may stay zombies where nothing reaps them.
    deadline = time.monotonic() + 60
    for child in children:
        while time.monotonic() < deadline:
            try:
                if child.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.05)


def synced_steps(events: list[dict]) -> set[int]:
    """The checkpoints written to the persistent folder, from its journal."""
    return {e["step"] for e in events if e["event"] == "sync"}


def last_saved_step(job: Job) -> int:
    """Highest step the job reported saving (journal on Drive, plus its local copy if still there)."""
    steps = [e["step"] for e in job.events() + job.local_events() if e["event"] == "save"]
    return max(steps, default=0)


_RESUMED = re.compile(r"resume: checkpoint-(\d+) ")


def resumed_from(text: str) -> int | None:
    """The step a run resumed from, from its printed start summary: 0 for a fresh start, None
    when it was killed before printing it (while fetching its checkpoint from Drive).

    The printed summary is read rather than events.jsonl because a kill half-way through the
    `resume` journal line leaves that line torn (and so unreadable) after a successful resume.
    """
    match = _RESUMED.search(text)
    if match:
        return int(match.group(1))
    return 0 if "no checkpoint found, starting fresh" in text else None


def load_weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def max_abs_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def reference_weights(root: Path, loop: str, steps: int = 60, save_every: int | str = 10,
                      extra: list | None = None, shared: Path | None = None) -> dict:
    """Final weights of an uninterrupted run. With `shared` (a folder every pytest worker sees), the first
    worker that needs a reference computes it and the others wait for it and read it (a file lock)."""
    if shared is None:
        return _reference(root, loop, steps, save_every, extra)
    import fcntl

    key = "-".join(map(str, (loop, steps, save_every, *(extra or [])))).replace("/", "_")
    cached = shared / f"reference-{key}.safetensors"
    with open(shared / f"reference-{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not cached.exists():
            _reference(root, loop, steps, save_every, extra)
            shutil.copy(root / "final.safetensors", cached)
    return load_weights(cached)


def _reference(root: Path, loop: str, steps: int, save_every, extra) -> dict:
    root.mkdir(parents=True, exist_ok=True)
    job = Job(root, loop=loop, steps=steps, save_every=save_every, name="reference", extra=list(extra or []))
    code, text = job.run()
    assert code == 0, text[-3000:]
    return load_weights(root / "final.safetensors")


def reported_in_cloud(events: list, reported: set[int]) -> set[int]:
    """Steps the journal reports in the cloud and not pruned since, after `events`."""
    reported = set(reported)
    for event in events:
        if event["event"] == "cloud" and "step" in event:
            reported.add(event["step"])
        elif event["event"] == "prune":
            reported -= set(event["steps"])
    return reported
