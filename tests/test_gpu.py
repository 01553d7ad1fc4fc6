"""GPU checks: the real ones run only where CUDA exists; their code path is smoke-tested on CPU."""

import json
import subprocess
import sys

import pytest
import torch
from project import ROOT  # noqa: E402


def run_script(*args, timeout=900):
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    start = proc.stdout.index("{\n")
    return proc.returncode, json.loads(proc.stdout[start:proc.stdout.rindex("}") + 1]), proc


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
