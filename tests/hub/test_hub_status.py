"""`python -m colab_kit status` on a run kept on the Hub (issue 46, path 6): it reads the Hub itself. Before, on
the replica it said "a plain folder; safe once written", named a resume checkpoint the Hub does not hold and
"lease: none" while a runtime wrote; `status hf://...` was refused as no folder."""

import shutil
import socket
import time

from colab_kit.__main__ import main
import colab_kit as ck
from colab_kit.checkpoints.journal import read_events
from colab_kit.tasks.demo import tiny_trainer


def status(capsys, where) -> tuple[int, str]:
    code = main(["status", str(where)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def wait_for_cloud(replica, step, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e["event"] == "cloud" and e.get("step") == step for e in read_events(replica / "events.jsonl")):
            return
        time.sleep(0.1)
    raise AssertionError(f"checkpoint-{step} never confirmed on the Hub")


def test_status_reads_a_run_on_the_hub_from_the_hub_live_and_finished(hub_env, tmp_path, capsys):
    from transformers import TrainerCallback

    run = ck.start_run("st", store="hf://user/runs", local_dir=tmp_path / "vm" / "st", save_every=5, keep=3,
                       gauges=False, quiet=True)
    replica = tmp_path / "vm" / "st.hub"
    seen = {}

    class AskStatus(TrainerCallback):  # another terminal asks while the runtime trains and holds the run
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 8:
                wait_for_cloud(replica, 5)
                seen["code"], seen["said"] = status(capsys, "hf://user/runs/st")

    trainer = tiny_trainer(run, max_steps=10)
    trainer.add_callback(AskStatus())
    run.train(trainer)
    said = seen["said"]
    assert seen["code"] == 0, said
    assert "durability: the Hugging Face Hub" in said
    assert f"lease: host {socket.gethostname()}, pid" in said and "released" not in said
    assert "checkpoint-5" in said and "in the cloud" in said and "resume would use: checkpoint-5" in said
    assert "start " in said  # the journal's lines, as committed
    code, said = status(capsys, "hf://user/runs/st")  # the run completed: everything committed, lease released
    assert "resume would use: checkpoint-10" in said and "lease: released by host" in said

    # A checkpoint on this VM's replica only (never committed) is no checkpoint of the run: status on the
    # replica asks the Hub, and names what a new VM would resume from.
    shutil.copytree(replica / "checkpoints" / "checkpoint-10", replica / "checkpoints" / "checkpoint-99")
    code, said = status(capsys, replica)
    assert code == 0, said
    assert "replica of a run on the Hugging Face Hub" in said and "hf://user/runs/st" in said
    assert "resume would use: checkpoint-10" in said and "checkpoint-99" not in said
    assert "lease: released by host" in said


def test_status_of_an_address_without_a_run_says_what_to_write(hub_env, capsys):
    code, said = status(capsys, "hf://user/runs")
    assert code == 2 and "hf://<user>/<repo>/<run>" in said
    code, said = status(capsys, "hf://spaces/user/x/run")
    assert code == 2 and "Space" in said
