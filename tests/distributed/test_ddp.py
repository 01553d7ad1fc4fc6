"""Several processes, one run (issue 11): 2 CPU processes on gloo through torchrun and notebook_launcher.

Each test launches tests/scripts/ddp_job.py, the same code on every rank: start_run, a tiny BERT
Trainer, run.train, run.save_final. Rank 0 must be the run's one writer; every rank must resume
from the same step; time-based saves and out-of-memory retries must be collective decisions.

The launchers themselves are tested with the real ones (torchrun, notebook_launcher, two torchrun
nodes, the notebook as a torchrun script); the tests of the kit's behaviour under several processes
start the ranks as forks of a warm process (tests/scripts/warm.py) with torchrun's environment,
which spares every rank the ~6.5 s of CPU of importing transformers.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import harness  # noqa: E402
import pytest
import warm
from project import NOTEBOOKS, SCRIPTS  # noqa: E402

from colab_kit.checkpoints.checkpoint import list_checkpoints  # noqa: E402
from colab_kit.checkpoints.journal import read_events  # noqa: E402
from colab_kit.checkpoints.manifest import read_manifest  # noqa: E402
from colab_kit.checkpoints.validity import verify_folder  # noqa: E402

pytestmark = pytest.mark.slow
JOB = SCRIPTS / "ddp_job.py"
_RANK = re.compile(r"RANK (\d) micro=(\S+) resumed=(\d+)")


class Launch:
    """One run folder, launched with 2 processes again and again."""

    def __init__(self, root: Path, *options):
        self.root = root
        self.options = [str(o) for o in options]
        self.launches = 0
        root.mkdir(parents=True, exist_ok=True)

    @property
    def run_dir(self) -> Path:
        return self.root / "drive" / "ddp"

    def command(self, launcher: str, out: str, extra) -> list[str]:
        job = [str(JOB), *self.arguments(out, extra)]
        if launcher == "torchrun":
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *job]
        if launcher == "notebook":
            return [sys.executable, *job, "--launcher", "notebook"]
        return [sys.executable, *job]  # one process

    def arguments(self, out: str, extra) -> list[str]:
        return ["--drive", str(self.root / "drive"), "--scratch", str(self.root / "local"),
                "--out", str(self.root / out), *self.options, *map(str, extra)]

    def start(self, launcher="warm", out="final.safetensors", extra=()):
        """`launcher`: "warm" (2 ranks forked with torchrun's environment), "torchrun", "notebook"
        (accelerate's notebook_launcher) or "one process"."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
        env.pop("COLAB_KIT_DRIVE", None)
        self.launches += 1
        if launcher == "warm":
            return warm.start_ranks(self.arguments(out, extra), world=2, env=env, cwd=self.root,
                                    out_prefix=self.root / f"launch-{self.launches}")
        if launcher == "one process":
            return warm.start(self.arguments(out, extra), env=env, cwd=self.root, script="ddp_job",
                              out=self.root / f"launch-{self.launches}.log")
        return subprocess.Popen(self.command(launcher, out, extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, env=env, cwd=self.root, start_new_session=True)

    def run(self, launcher="warm", out="final.safetensors", extra=(), timeout=300) -> tuple[int, str]:
        proc = self.start(launcher, out, extra)
        try:
            text, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            harness.kill_tree(proc)
            text, _ = proc.communicate()
            pytest.fail(f"the launch hung (no result in {timeout} s):\n{text[-4000:]}")
        return proc.returncode, text

    def kill_after_sync(self, step: int, timeout=240) -> int:
        """Launch, and SIGKILL the launcher and every rank once checkpoint `step` is in the persistent
        folder; returns the newest checkpoint written there by then."""
        proc = self.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            if step in harness.synced_steps(self.events()):
                harness.kill_tree(proc)
                break
            time.sleep(0.02)
        text, _ = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, f"the launch was not killed mid-run:\n{text[-3000:]}"
        return max(harness.synced_steps(self.events()))

    def events(self) -> list[dict]:
        return read_events(self.run_dir / "events.jsonl")

    def new_vm(self) -> None:
        import shutil

        shutil.rmtree(self.root / "local", ignore_errors=True)

    def weights(self, out="final.safetensors") -> dict:
        return harness.load_weights(self.root / out)


def ranks_said(text: str) -> dict[int, tuple[str, int]]:
    """{rank: (micro-batch, resumed step)} from each rank's last line."""
    return {int(r): (micro, int(step)) for r, micro, step in _RANK.findall(text)}


def assert_rank_files_in(folder: Path) -> None:
    manifest = read_manifest(folder)
    assert verify_folder(folder) is None
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(manifest.files), sorted(manifest.files)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final weights of an uninterrupted 2-process run (30 steps, saves every 10)."""
    launch = Launch(tmp_path_factory.mktemp("ddp-reference"), "--step-sleep", "0")
    code, text = launch.run()
    assert code == 0, text[-4000:]
    return launch.weights()


@pytest.mark.parametrize("launcher", ["torchrun", "notebook"])
def test_one_writer_whatever_the_launcher(tmp_path, reference, launcher):
    # The reference ran with warm-forked ranks: the real launchers must train alike.
    launch = Launch(tmp_path)
    code, text = launch.run(launcher)
    assert code == 0, text[-4000:]
    events = launch.events()
    kinds = [e["event"] for e in events]
    assert kinds.count("start") == 1 and kinds.count("finish") == 1, kinds
    assert [e["step"] for e in events if e["event"] == "save"] == [10, 20, 30]  # no rank saved twice
    start = next(e for e in events if e["event"] == "start")
    assert start["world_size"] == 2 and "processes: 2 processes" in text
    assert text.count("colab_kit · run 'ddp'") == 1  # only rank 0 prints its summary
    assert "no checkpoint was saved" not in text and "no checkpoint is saved" not in text
    assert json.loads((launch.run_dir / "lease.json").read_text())["pid"] == start["pid"]
    assert (launch.run_dir / "gauges.html").is_file()
    assert not list(launch.root.rglob("gauges*.html"))[1:], "one gauges.html"
    assert_rank_files_in(launch.run_dir / "checkpoints" / "checkpoint-30")
    assert harness.max_abs_diff(reference, launch.weights()) == 0.0  # both launchers train alike


@pytest.mark.parametrize("slow_reads", [0.0, 0.3])
def test_a_killed_launch_resumes_every_rank_from_the_same_step(tmp_path, reference, slow_reads):
    launch = Launch(tmp_path, "--step-sleep", "0.15", "--slow-reads", slow_reads)
    durable = launch.kill_after_sync(10)
    assert durable < 30
    launch.new_vm()
    code, text = launch.run()
    assert code == 0, text[-4000:]
    assert ranks_said(text) == {0: ("None", durable), 1: ("None", durable)}  # the same step on both ranks
    assert harness.max_abs_diff(reference, launch.weights()) <= 1e-6
    for _, folder in list_checkpoints(launch.run_dir / "checkpoints"):
        assert_rank_files_in(folder)


def test_time_based_saves_with_a_stalled_rank_neither_hang_nor_lose_a_rank(tmp_path):
    launch = Launch(tmp_path, "--save-every", "1s", "--step-sleep", "0.1", "--stall", "1:15:1.5")
    code, text = launch.run(timeout=240)
    assert code == 0, text[-4000:]
    published = list_checkpoints(launch.run_dir / "checkpoints")
    assert len([e for e in launch.events() if e["event"] == "sync"]) >= 3
    for _, folder in published:
        assert_rank_files_in(folder)


def test_the_kits_step_averages_gradients_as_ddp_does(tmp_path, reference):
    """Micro-batches run outside DDP's hooks and the gradients are averaged once: the same training
    as the Trainer's own DDP step (all-reduce in backward), bit for bit. The Trainer's step is run
    with average_tokens_across_devices=False: by default it multiplies this classification loss by
    the number of processes (meant for token sums it divides back), which doubles the gradients."""
    plain = Launch(tmp_path, "--plain-ddp")
    code, text = plain.run()
    assert code == 0, text[-4000:]
    assert harness.max_abs_diff(reference, plain.weights()) == 0.0


def test_an_oom_on_one_rank_is_retried_by_both_together(tmp_path):
    clean = Launch(tmp_path / "clean", "--dropout", "0", "--steps", "12")
    code, text = clean.run()
    assert code == 0, text[-4000:]
    oom = Launch(tmp_path / "oom", "--dropout", "0", "--steps", "12", "--oom", "1:4")
    code, text = oom.run(timeout=240)
    assert code == 0, text[-4000:]
    assert ranks_said(text) == {0: ("4", 0), 1: ("4", 0)}  # the same micro-batch on both ranks
    events = [e for e in oom.events() if e["event"] == "oom"]
    assert len(events) == 1 and events[0]["ranks"] == [1] and events[0]["micro_to"] == 4
    assert "effective batch of 16 (8 per process x 2 processes) is kept" in text
    assert harness.max_abs_diff(clean.weights(), oom.weights()) <= 1e-5


def test_a_relaunch_with_fewer_processes_stops_with_a_clear_message(tmp_path):
    launch = Launch(tmp_path, "--step-sleep", "0.15")
    assert launch.kill_after_sync(10) < 30
    code, text = launch.run("one process", timeout=240)
    assert code != 0
    assert "number of processes" in text and "2 then, 1 now" in text, text[-3000:]
    assert "FINAL" not in text


def test_start_run_before_notebook_launcher_is_refused_in_the_children(tmp_path):
    launch = Launch(tmp_path)
    code, text = launch.run("notebook", extra=["--start-in-parent"], timeout=240)
    assert "Call ck.start_run('ddp', ...) inside the function you pass to notebook_launcher" in text, text[-3000:]
    finished = re.search(r"PARENT FINISHED in ([\d.]+) s", text)
    assert finished and float(finished.group(1)) < 120  # finish() did not wait for a dead uploader


def test_two_nodes_with_their_own_local_disks(tmp_path, reference):
    """Two "nodes" of one process each (LOCAL_RANK 0 on both, as torchrun sets it for --nnodes 2
    --nproc_per_node 1), sharing only the persistent folder: rank 1's RNG state reaches rank 0's
    checkpoints, and on resume node 1 fetches the checkpoint itself."""
    drive = tmp_path / "drive"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    launches = iter(range(1, 10))

    def launch_nodes(kill_after: int | None = None, extra=()) -> list[str]:
        def node(rank: int) -> list[str]:
            return ["--drive", str(drive), "--scratch", str(tmp_path / f"local{rank}"),
                    "--out", str(tmp_path / f"final{rank}.safetensors"), "--step-sleep", "0.15", *extra]

        ranks = warm.start_ranks(node, world=2, per_node=1, env=env, cwd=tmp_path,
                                 out_prefix=tmp_path / f"nodes-{next(launches)}")
        deadline = time.monotonic() + 240
        while kill_after is not None and time.monotonic() < deadline and ranks.poll() is None:
            if kill_after in harness.synced_steps(read_events(drive / "ddp" / "events.jsonl")):
                harness.kill_tree(ranks)
                break
            time.sleep(0.02)
        try:
            ranks.wait(timeout=240)
        except subprocess.TimeoutExpired:
            harness.kill_tree(ranks)
            said = [job.communicate()[0][-3000:] for job in ranks.jobs]
            pytest.fail(f"a node hung; node 0 said:\n{said[0]}\nnode 1 said:\n{said[1]}")
        return [job.communicate()[0] for job in ranks.jobs]

    launch_nodes(kill_after=10)
    durable = max(harness.synced_steps(read_events(drive / "ddp" / "events.jsonl")))
    assert durable < 30
    assert_rank_files_in(drive / "ddp" / "checkpoints" / "checkpoint-10")  # rng_state_1 came from node 1
    for node in (0, 1):
        shutil.rmtree(tmp_path / f"local{node}", ignore_errors=True)
    texts = launch_nodes()
    said = {**ranks_said(texts[0]), **ranks_said(texts[1])}
    assert said == {0: ("None", durable), 1: ("None", durable)}, texts[1][-3000:]
    assert (tmp_path / "local1" / f"checkpoint-{durable}" / "MANIFEST.json").is_file()  # node 1 fetched its copy
    assert harness.max_abs_diff(reference, harness.load_weights(tmp_path / "final0.safetensors")) <= 1e-6

    # Node 1 loses its local folder and cannot read the persistent one: every rank stops, none hangs.
    shutil.rmtree(tmp_path / "local1")
    texts = launch_nodes(extra=["--fetch-fails-on", "1"])
    for text in texts:
        assert "rank(s) [1] cannot read checkpoint-30, which rank 0 resumes from" in text, text[-3000:]


def test_a_notebook_runs_as_a_script_under_torchrun(tmp_path):
    """The "More than one GPU" recipe (docs/multi-gpu.md): the GPT-2 notebook's cells as a script, quick preset."""
    notebook = json.loads((NOTEBOOKS / "distilgpt2_finetune.ipynb").read_text())
    cells = []
    for cell in notebook["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        if "parameters" in (cell["metadata"].get("tags") or []):  # what papermill's -p would inject
            source += f'\nPRESET = "quick"\nDRIVE_DIR = {str(tmp_path / "drive")!r}\nMAX_STEPS = 12\n'
        cells.append(source)
    script = tmp_path / "distilgpt2_finetune.py"
    cells.append("import torch.distributed\ntorch.distributed.destroy_process_group()")  # the recipe's last line
    script.write_text("\n\n".join(cells) + "\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script)], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    run_dir = tmp_path / "drive" / "distilgpt2-wikitext"
    events = read_events(run_dir / "events.jsonl")
    assert [e["event"] for e in events].count("start") == 1
    newest = list_checkpoints(run_dir / "checkpoints")[0][1]
    assert_rank_files_in(newest)
    assert (run_dir / "final" / "MANIFEST.json").is_file()
