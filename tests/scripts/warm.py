"""Start the test jobs (tiny_job.py, ddp_job.py) as forks of a process that has already imported torch,
transformers and the kit.

Importing transformers' Trainer costs about 6.5 s of CPU in every new Python process on the 2-core CI
machine, and the end-to-end tests start jobs dozens of times (every kill, every disconnect, every rank).
multiprocessing's forkserver imports those modules once (`preload`); each job is then a fork of it: a
process of its own, with its own pid, environment, working folder and output file, killed with
SIGKILL like any other. `start` returns an object with the `subprocess.Popen` methods the tests use;
`start_ranks` starts the ranks of one torch.distributed launch with the environment torchrun gives
them (the launchers themselves are tested with torchrun and notebook_launcher in tests/distributed).
"""

from __future__ import annotations

import atexit
import importlib.util
import multiprocessing
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

_context = None


def preload() -> None:
    """What every job imports, once, in the forkserver (nothing is run: no thread, no tensor)."""
    import datasets  # noqa: F401
    import matplotlib.backends.backend_agg  # noqa: F401 - the run's status picture (colab_kit/report/picture.py)
    import matplotlib.figure  # noqa: F401
    import ddp_job  # noqa: F401
    import plain_loop_job  # noqa: F401
    import ranks_job  # noqa: F401
    import safetensors.torch  # noqa: F401
    import sharded_job  # noqa: F401
    import tiny_job  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    from transformers import (  # noqa: F401
        BertConfig,
        BertForSequenceClassification,
        EarlyStoppingCallback,
        LlamaConfig,
        LlamaForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    import colab_kit  # noqa: F401
    from colab_kit.tasks import demo  # noqa: F401

    # The adapter jobs' (tiny_job --loop lora|sft): test requirements, imported where installed.
    if importlib.util.find_spec("peft") is not None:
        import peft  # noqa: F401
    if importlib.util.find_spec("trl") is not None:
        from trl import SFTConfig, SFTTrainer  # noqa: F401


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


def _run(script: str, argv: list[str], env: dict, cwd: str, out: str) -> None:
    """The job, in the fork: its own environment, folder and output, then `script`.main()."""
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
    if env.get("OMP_NUM_THREADS"):  # torch read it when the forkserver imported it; its threads start now
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    code = 0
    try:
        if script.endswith(".py"):  # a script by its path, run as `python script.py` would
            import runpy

            runpy.run_path(script, run_name="__main__")
        elif script.startswith("-m "):  # a module, as `python -m module` would
            import runpy

            runpy.run_module(script[3:], run_name="__main__", alter_sys=True)
        else:
            __import__(script).main()
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


def start(argv: list[str], *, env: dict, cwd: Path, out: Path, script: str = "tiny_job") -> WarmJob:
    """Fork a job running `script` with `argv` (its arguments after the script's name): a module of
    tests/scripts by name (its `main()`), any Python file by its path, or "-m package" (`python -m`)."""
    name = script if script.endswith(".py") else script[3:] if script.startswith("-m ") else f"{script}.py"
    process = _ctx().Process(target=_run, args=(script, [name, *argv], env, str(cwd), str(out)), daemon=False)
    process.start()
    return WarmJob(process, Path(out))


def ended_after(job, log: Path, marker: str, timeout: float) -> float:
    """Wait for `job` to end, watching `log` (another job's output) for `marker`, its error: the seconds from the
    marker's first sight to `job`'s end, 0 when `job` ended first. Timed from that error, not from the launch,
    which on a busy 2-core machine takes half a minute of imports and training by itself. Raises
    subprocess.TimeoutExpired when `job` has not ended after `timeout` seconds."""
    deadline, seen = time.monotonic() + timeout, None
    while job.poll() is None:
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired("the job", timeout)
        if seen is None and log.is_file() and marker in log.read_text(errors="replace"):
            seen = time.monotonic()
        time.sleep(0.1)
    return time.monotonic() - seen if seen is not None else 0.0


class WarmRanks:
    """The ranks of one launch, as one process to the tests: its output is every rank's, rank by rank;
    its return code the first failing rank's (0 when all succeeded), as torchrun reports it."""

    def __init__(self, jobs: list[WarmJob], store=None):
        self.jobs = jobs
        self.store = store  # the rendezvous store the ranks use: kept alive as long as they are

    @property
    def pid(self) -> int:
        return self.jobs[0].pid

    @property
    def returncode(self) -> int | None:
        codes = [job.returncode for job in self.jobs]
        if any(code is None for code in codes):
            return None
        return next((code for code in codes if code != 0), 0)

    def poll(self) -> int | None:
        return self.returncode

    def send_signal(self, sig: int) -> None:
        for job in self.jobs:
            job.send_signal(sig)

    def kill(self) -> None:
        for job in self.jobs:
            job.kill()

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        for job in self.jobs:
            job.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, None]:
        self.wait(timeout)
        return "".join(job.communicate()[0] for job in self.jobs), None


def start_ranks(argv, *, world: int, env: dict, cwd: Path, out_prefix: Path, script: str = "ddp_job",
                per_node: int | None = None) -> WarmRanks:
    """Start `world` ranks of `<script>.py` with torchrun's environment variables: `per_node` ranks to a
    node (default: all on one), `argv` the same for every rank or a function rank -> argv (a node's
    own local folder)."""
    # The rendezvous store is hosted here, as torchrun's agent hosts it: it listens before any rank
    # starts. A free port found by binding and closing, for rank 0 to bind again, was a race under
    # pytest-xdist (CI: a rank's TCPStore client hung on "Connection reset by peer" at that port, and
    # the launch with it): the port is in the ephemeral range, free for any other socket to take.
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    per_node = per_node or world
    jobs = []
    for rank in range(world):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank % per_node), WORLD_SIZE=str(world),
                        LOCAL_WORLD_SIZE=str(per_node), GROUP_RANK=str(rank // per_node), ROLE_RANK=str(rank),
                        ROLE_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                        TORCHELASTIC_USE_AGENT_STORE="True")
        args = argv(rank) if callable(argv) else argv
        jobs.append(start(args, env=rank_env, cwd=cwd, out=Path(f"{out_prefix}-rank{rank}.log"), script=script))
    return WarmRanks(jobs, store)

