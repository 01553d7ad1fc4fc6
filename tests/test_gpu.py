"""GPU checks: the real ones run only where CUDA exists; their code path is smoke-tested on CPU."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import warm
from project import ROOT  # noqa: E402


def run_script(*args, timeout=900):
    """Run a bench script as `python SCRIPT ARGS` would (on a CUDA machine), or on a CPU as a fork of the
    warm test process (tests/scripts/warm.py: torch and transformers are imported already)."""
    if torch.cuda.is_available():
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        code, out = proc.returncode, proc.stdout + proc.stderr
    else:
        import os
        import tempfile

        log = Path(tempfile.mkdtemp(prefix="gpu-smoke-")) / "out.txt"
        job = warm.start(list(args[1:]), env=dict(os.environ), cwd=ROOT, out=log, script=str(ROOT / args[0]))
        code = job.wait(timeout)
        out = log.read_text(errors="replace")
    start = out.index("{\n")
    return code, json.loads(out[start:out.rindex("}") + 1]), SimpleNamespace(stdout=out, stderr="")


@pytest.mark.slow
def test_gpu_oom_script_code_path_on_cpu():
    code, report, proc = run_script("bench/gpu_oom.py", "--cpu-smoke", "--seq", "16")
    assert code == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["ok"] and report["provoked"]["recognised"] and report["kit"]["micro_batch"] == 8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: a real OOM under a 15 GiB cap")
def test_real_oom_recovery_on_a_capped_gpu():
    code, report, proc = run_script("bench/gpu_oom.py")
    assert code == 0 and report["ok"], json.dumps(report, indent=1)
    assert report["provoked"]["oom"] and report["kit"]["peak_allocated_gib"] <= report["cap_gib"]


@pytest.mark.slow
def test_gpu_gpt2_script_code_path_on_cpu():
    code, report, proc = run_script("bench/gpu_gpt2.py", "--cpu-smoke")
    assert code == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["ok"] and report["seed"]["error"] is None and report["kit"]["steps"] == 6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: DistilGPT2 configurations under a 15 GiB cap")
def test_seed_vs_kit_gpt2_on_a_capped_gpu():
    code, report, proc = run_script("bench/gpu_gpt2.py")
    assert code == 0 and report["ok"], json.dumps(report, indent=1)
    assert report["seed"]["out_of_memory"] and report["kit"]["peak_allocated_gib"] <= report["cap_gib"]


@pytest.mark.slow
def test_gpu_plan_script_code_path_on_cpu():
    code, report, proc = run_script("bench/gpu_plan.py", "--cpu-smoke")
    assert code == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert report["ok"] and len(report["rows"]) == 4
    assert all(abs(r["error"]) <= 0.10 for r in report["rows"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: the memory plan against real steps under a "
                    "15 GiB cap")
def test_the_memory_plan_against_real_steps_on_a_capped_gpu():
    code, report, proc = run_script("bench/gpu_plan.py")
    assert code == 0 and report["ok"], json.dumps(report, indent=1)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs: the Trainer with FSDP2, killed and "
                    "resumed from its sharded checkpoint")
def test_the_trainer_with_fsdp2_killed_and_resumed_on_two_gpus():
    code, report, proc = run_script("bench/gpu_fsdp.py")
    assert code == 0 and report["ok"], json.dumps(report, indent=1)
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(report["newest"]["shards"])
