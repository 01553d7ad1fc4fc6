"""Run the project's notebooks headless (`python -m colab_kit run`, i.e. papermill) the way a user
would, kill them mid-run, and read what their runs journaled. Used by tests/test_notebooks.py
(quick presets) and tests/test_full_rehearsal.py (full presets, offline)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import harness


def run_notebook(path, workdir, *params, popen=False, env=None):
    """Run notebook `path` with PRESET "quick" (a later ("PRESET", ...) wins) and the persistent folder
    in `workdir/drive`; `params` are (NAME, VALUE) pairs as given to `-p`; `env` adds variables."""
    cmd = [sys.executable, "-m", "colab_kit", "run", str(path), "-o", str(workdir / "out.ipynb"),
           "-p", "PRESET", "quick", "-p", "DRIVE_DIR", str(workdir / "drive")]
    for name, value in params:
        cmd += ["-p", name, value]
    environ = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    environ.pop("COLAB_KIT_DRIVE", None)
    if popen:
        return subprocess.Popen(cmd, cwd=workdir, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
    return subprocess.run(cmd, cwd=workdir, env=environ, capture_output=True, text=True, timeout=900)


def printed(workdir) -> str:
    """Everything the executed notebook (`workdir/out.ipynb`) printed, cell after cell."""
    out = json.loads((workdir / "out.ipynb").read_text())
    return "".join("".join(o.get("text", "")) for c in out["cells"] for o in c.get("outputs", []))


def events(run_dir):
    from colab_kit.checkpoints.journal import read_events

    return read_events(run_dir / "events.jsonl")


def kill_after_first_durable_checkpoint_and_rerun(notebook, workdir, run_dir, *params, env=None, new_vm=False,
                                                  durable_event="sync") -> tuple[int, list, str]:
    """Run the notebook, kill its kernel once a checkpoint is durable (its `durable_event` journaled: "sync" on a
    plain folder, "cloud" on the Hub), run it again (with `new_vm`, after deleting the local folder, as a
    reconnect to a fresh VM finds it); returns (the first durable step, the events of the second run, what the
    second run printed to the terminal)."""
    proc = run_notebook(notebook, workdir, *params, popen=True, env=env)
    deadline = time.monotonic() + 600
    durable = None
    while time.monotonic() < deadline and proc.poll() is None and durable is None:
        synced = [e["step"] for e in events(run_dir) if e["event"] == durable_event and "step" in e]
        durable = synced[0] if synced else None
        time.sleep(0.2)
    if durable is None:
        said = proc.communicate()[0] if proc.poll() is not None else ""
        raise AssertionError(f"no durable checkpoint before the notebook ended:\n{said[-3000:]}")
    harness.kill_tree(proc)
    assert not (run_dir / "metrics.json").exists(), "the first run finished before it could be killed"
    if new_vm:
        shutil.rmtree(workdir / "scratch")  # the local folder outside Colab (./scratch); /content in Colab
    again = run_notebook(notebook, workdir, *params, env=env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    log = events(run_dir)
    starts = [i for i, e in enumerate(log) if e["event"] == "start"]
    assert len(starts) == 2, [log[i] for i in starts]  # this run and the killed one, each journaled once
    return durable, log[starts[1]:], again.stdout
