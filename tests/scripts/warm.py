"""Start tiny_job.py runs as forks of a process that has already imported torch, transformers and the kit.

Importing transformers' Trainer costs about 6.5 s of CPU in every new Python process on the 2-core CI
machine, and the end-to-end tests start tiny_job.py dozens of times (every kill, every disconnect).
multiprocessing's forkserver imports those modules once (`preload`); each job is then a fork of it: a
process of its own, with its own pid, environment, working folder and output file, killed with
SIGKILL like any other. `start` returns an object with the `subprocess.Popen` methods the tests use.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import subprocess
import sys
import traceback
from pathlib import Path

_context = None


def preload() -> None:
    """What every job imports, once, in the forkserver (nothing is run: no thread, no tensor)."""
    import datasets  # noqa: F401
    import safetensors.torch  # noqa: F401
    import torch  # noqa: F401
    from transformers import (BertConfig, BertForSequenceClassification, EarlyStoppingCallback,  # noqa: F401
                              Trainer, TrainerCallback, TrainingArguments)

    import colab_kit  # noqa: F401
    import tiny_job  # noqa: F401
    from colab_kit.tasks import demo  # noqa: F401


def _ctx():
    global _context
    if _context is None:
        # The forkserver is a new interpreter: it finds this module (and tiny_job) through PYTHONPATH,
        # and preloads only when told to (an ImportError there would pass silently, and every job
        # would import everything again).
        here = str(Path(__file__).resolve().parent)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
        os.environ["COLAB_KIT_WARM_FORKSERVER"] = "1"
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload([__name__])
    return _context


if os.environ.get("COLAB_KIT_WARM_FORKSERVER") == "1":  # imported as the forkserver's preload
    preload()


def _run(argv: list[str], env: dict, cwd: str, out: str) -> None:
    """The job, in the fork: its own environment, folder and output, then tiny_job.main()."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    sys.argv = list(argv)
    import tiny_job

    code = 0
    try:
        tiny_job.main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported in the job's output, as a crashing script would
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # as the interpreter would at exit (the kit's run.finish at exit among them)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class WarmJob:
    """A running job: `poll`, `wait`, `communicate`, `send_signal`, `kill`, `pid`, `returncode`."""

    def __init__(self, process, out: Path):
        self._process, self._out = process, out

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            try:
                os.kill(self._process.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired("tiny_job.py", timeout)
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        return self._out.read_text(errors="replace"), None


def start(argv: list[str], *, env: dict, cwd: Path, out: Path) -> WarmJob:
    """Fork a job running `tiny_job.py` with `argv` (its arguments after the script's name)."""
    process = _ctx().Process(target=_run, args=(["tiny_job.py", *argv], env, str(cwd), str(out)), daemon=False)
    process.start()
    return WarmJob(process, Path(out))

