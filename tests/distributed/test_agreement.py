"""Two gloo processes agree on how every step ended, and measure like one (issue 21).

- A ValueError on rank 1 in the forward pass, the backward pass or the optimizer step stops both
  processes within seconds, each naming rank 1 and the error: no rank waits for the process group's
  timeout (30 minutes by default): rank 0 ends within 20 s of rank 1's error, and a launch that has not ended
  after 90 s fails the test.
- `text.perplexity` under 2 processes on an evaluation set of odd size equals one process's number.
- The kit's gradient averaging allocates at most a DDP bucket beyond the Trainer's own DDP step.
"""

import json
import math
import os
import subprocess

import pytest
import torch
from ranks_job import perplexity_trainer
from test_ddp import Launch

import warm
from colab_kit import text

pytestmark = pytest.mark.slow


def job_environment() -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.pop("COLAB_KIT_DRIVE", None)
    return env


@pytest.mark.parametrize("where", ["forward", "backward", "optimizer"])
def test_an_error_on_one_rank_stops_every_rank_within_seconds(tmp_path, where):
    launch = Launch(tmp_path, "--steps", "6", "--step-sleep", "0", "--fail", f"1:{where}:3")
    proc = launch.start()
    try:
        took = warm.ended_after(proc.jobs[0], tmp_path / "launch-1-rank1.log", "injected on rank 1", timeout=90)
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"a rank was left waiting after rank 1 failed in the {where}:\n{proc.communicate()[0][-4000:]}")
    outputs = [job.communicate()[0] for job in proc.jobs]
    codes = [job.returncode for job in proc.jobs]
    assert all(code != 0 for code in codes), (codes, outputs[0][-2000:])
    phase = "optimizer step" if where == "optimizer" else where
    assert f"ValueError: injected on rank 1 in the {where} at step 3" in outputs[1]
    assert f"colab_kit: raised on rank 1 of 2 in the {phase} at step 3" in outputs[1]
    assert "RankFailedError: rank 1 of 2 failed in the " + phase in outputs[0], outputs[0][-3000:]
    assert "ValueError: injected on rank 1" in outputs[0]
    assert took < 20, f"rank 0 ended {took:.1f} s after rank 1's error"


def test_the_others_stop_even_while_the_failing_process_stays_alive(tmp_path):
    """Rank 1 fails and then lives on (a notebook kernel after an error): its connections stay open,
    so rank 0 learns of the failure only from the agreement, not from a closed socket."""
    launch = Launch(tmp_path, "--steps", "6", "--step-sleep", "0", "--fail", "1:backward:3", "--linger", "120")
    proc = launch.start()
    try:
        rank0, rank1 = proc.jobs
        try:
            took = warm.ended_after(rank0, tmp_path / "launch-1-rank1.log", "injected on rank 1", timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 was left waiting for the failed rank 1:\n{rank0.communicate(0)[0][-3000:]}")
        assert rank1.poll() is None  # still lingering: rank 0 did not need it to exit
    finally:
        proc.kill()
    said = rank0.communicate()[0]
    assert rank0.returncode != 0 and "RankFailedError: rank 1 of 2 failed in the backward at step 3" in said
    assert took < 20, f"rank 0 ended {took:.1f} s after rank 1's error"


def test_perplexity_under_two_processes_equals_one_process(tmp_path):
    env = job_environment()
    out = tmp_path / "two.json"
    ranks = warm.start_ranks(["perplexity", "--rows", "13", "--out", str(out)], world=2, env=env, cwd=tmp_path,
                             out_prefix=tmp_path / "perplexity", script="ranks_job")
    code = ranks.wait(timeout=120)
    said = ranks.communicate()[0]
    assert code == 0, said[-3000:]
    both = [json.loads(line.split("RESULT ", 1)[1]) for line in said.splitlines() if line.startswith("RESULT ")]
    assert sorted(r["rank"] for r in both) == [0, 1]

    single = text.perplexity(perplexity_trainer(str(tmp_path / "one"), 13), rows_per_forward=3)
    for result in both:  # 13 rows in batches of 4 per process: accelerate repeats 3 rows to even out
        assert math.isfinite(result["perplexity"])
        assert abs(result["perplexity"] / single - 1) <= 1e-6, (result, single)


def test_gradient_averaging_costs_at_most_a_ddp_bucket_beyond_the_trainers_ddp_step(tmp_path):
    env = job_environment()
    out = tmp_path / "memory.json"
    ranks = warm.start_ranks(["memory", "--drive", str(tmp_path / "drive"), "--scratch", str(tmp_path / "local"),
                              "--out", str(out)], world=2, env=env, cwd=tmp_path, out_prefix=tmp_path / "memory",
                             script="ranks_job")
    code = ranks.wait(timeout=240)
    assert code == 0, ranks.communicate()[0][-3000:]
    result = json.loads(out.read_text())
    bucket = result["bucket_bytes_cap"]
    assert result["gradient_bytes"] >= 50e6 and bucket == 25 * 1024 * 1024
    trainer, kit = result["peaks"]["trainer"], result["peaks"]["kit"]
    print(f"peak allocated during one step: Trainer's DDP step {trainer / 2**20:.1f} MiB, the kit's step "
          f"{kit / 2**20:.1f} MiB, extra {(kit - trainer) / 2**20:+.1f} MiB (bucket {bucket / 2**20:.0f} MiB, "
          f"gradients {result['gradient_bytes'] / 2**20:.0f} MiB)")
    assert trainer > 0 and kit - trainer <= bucket, result
    assert torch.__version__ == result["torch"]
