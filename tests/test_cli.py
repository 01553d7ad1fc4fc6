"""python -m colab_kit: status, run (papermill) and demo."""

import json
import os
import subprocess
import sys

import nbformat
import pytest

from colab_kit.__main__ import _literal, main


def test_status_lists_checkpoints_lease_and_events(drive, local, capsys):
    import colab_kit as ck
    from colab_kit.tasks.demo import tiny_trainer

    run = ck.start_run("st", drive=drive, local_dir=local, save_every=5, quiet=True)
    run.train(tiny_trainer(run, max_steps=10))
    (drive / "st" / "checkpoints" / "checkpoint-10" / "model.safetensors").write_bytes(b"broken")
    capsys.readouterr()
    assert main(["status", str(drive / "st"), "-n", "3"]) == 0
    out = capsys.readouterr().out
    assert "lease: host" in out and "released" in out
    assert "checkpoint-10" in out and "INVALID" in out and "checkpoint-5" in out and "valid" in out
    assert "resume would use: checkpoint-5" in out
    assert "last 3 of" in out and "finish" in out


def test_status_of_a_missing_folder_says_what_a_run_folder_is(tmp_path, capsys):
    assert main(["status", str(tmp_path / "nope")]) == 2
    assert "no run folder" in capsys.readouterr().err


@pytest.mark.parametrize("text, value", [("20", 20), ("None", None), ("quick", "quick"), ("0.5", 0.5),
                                         ("'a b'", "a b"), ("True", True)])
def test_parameter_values_are_python_literals_or_text(text, value):
    assert _literal(text) == value


@pytest.mark.slow
def test_run_executes_a_notebook_with_parameters(tmp_path, monkeypatch):
    nb = nbformat.v4.new_notebook()
    params = nbformat.v4.new_code_cell("STEPS = 1\nNAME = 'x'")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell(
        "import json, os\nopen('result.json', 'w').write(json.dumps({'steps': STEPS, 'name': NAME, "
        "'folder': sorted(os.listdir('.'))}))")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    src = tmp_path / "tiny.ipynb"
    nbformat.write(nb, src)
    monkeypatch.chdir(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "colab_kit", "run", str(src), "-p", "STEPS", "7",
                           "-p", "NAME", "demo"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["steps"], result["name"]) == (7, "demo")
    assert "tiny.ipynb" in result["folder"] and not [n for n in result["folder"] if n.startswith("kernel-")], (
        result)  # the kernel's IPC sockets are in Jupyter's runtime folder, not the working folder
    assert (tmp_path / "outputs" / "tiny.ipynb").exists()
    # Only what the kit prints: no kernel's warning about TCP without encryption (ipykernel 7), no debugger's
    # about frozen modules (ipykernel 6, as in Colab), nothing on stderr.
    assert proc.stderr == "", proc.stderr
    assert [line.split(" ")[0] for line in proc.stdout.splitlines()] == ["running", "done"], proc.stdout


@pytest.mark.slow
def test_run_reports_the_failing_cell(tmp_path, monkeypatch):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("raise ValueError('bad input file')")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, tmp_path / "bad.ipynb")
    monkeypatch.chdir(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "colab_kit", "run", "bad.ipynb"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1 and "ValueError: bad input file" in proc.stderr


@pytest.mark.slow
def test_demo_runs_and_a_second_run_does_not_train_again(tmp_path):
    cmd = [sys.executable, "-m", "colab_kit", "demo", "--steps", "30", "--drive", str(tmp_path / "d")]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert "demo: 30 steps, held-out accuracy" in first.stdout
    # The second as a fork of the warm test process (the same CLI, without importing transformers again)
    import warm

    second = warm.start(cmd[3:], env=dict(os.environ), cwd=tmp_path, out=tmp_path / "second.txt", script="-m colab_kit")
    assert second.wait(300) == 0 and "already reached step 30" in (tmp_path / "second.txt").read_text()
