"""A plain PyTorch loop under 2 gloo processes: `ck.MicroBatcher().step` on a DDP model (issue 31).

DDP's own forward broadcasts buffers and its backward all-reduces gradients: a ValueError on one rank in
either left the other inside a collective that the failing rank never reached (gloo then aborted the
failing process: a dead kernel in a notebook). The kit's step runs the module inside DDP, agrees how the
step ended on every rank, and averages the gradients itself, once.
"""

import os
import subprocess
import time

import harness
import pytest

import warm

pytestmark = pytest.mark.slow


def launch(tmp_path, *options):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    return warm.start_ranks(["--out", str(tmp_path / "final.safetensors"), *map(str, options)], world=2, env=env,
                            cwd=tmp_path, out_prefix=tmp_path / "plain", script="plain_loop_job")


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_error_on_one_rank_reaches_every_rank_and_the_failing_one_lives_on(tmp_path, where):
    ranks = launch(tmp_path, "--fail", f"1:{where}:3", "--linger", "120")
    rank0, rank1 = ranks.jobs
    try:
        try:
            took = warm.ended_after(rank0, tmp_path / "plain-rank1.log", "ERROR ", timeout=90)
        except subprocess.TimeoutExpired:
            pytest.fail(f"rank 0 was left waiting after rank 1 failed in the {where}:\n"
                        f"{(tmp_path / 'plain-rank0.log').read_text()[-3000:]}")
        said0 = rank0.communicate()[0]
        deadline = time.monotonic() + 30
        while "ERROR " not in (tmp_path / "plain-rank1.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        said1 = (tmp_path / "plain-rank1.log").read_text()
        alive = rank1.poll() is None  # lingering, as a notebook kernel does after an error: not aborted
    finally:
        ranks.kill()
    assert rank0.returncode == 1, said0[-3000:]
    assert f"ERROR RankFailedError: rank 1 of 2 failed in the {where} at step 3" in said0, said0[-3000:]
    assert f"ValueError: injected on rank 1 in the {where} at step 3" in said0
    assert f"ERROR ValueError: injected on rank 1 in the {where} at step 3" in said1, said1[-3000:]
    assert alive, said1[-3000:]
    assert "GRADIENTS LEFT 0" in said0 and "GRADIENTS LEFT 0" in said1  # nothing half averaged for a rerun
    assert took < 20, f"rank 0 ended {took:.1f} s after rank 1's error"


def test_the_kits_step_gives_ddps_weights(tmp_path):
    """Micro-batches of 2 of each rank's 4 rows, averaged by the kit: the weights of DDP's own step."""
    for name, extra in (("kit", []), ("ddp", ["--ddp-backward"])):
        (tmp_path / name).mkdir()
        ranks = launch(tmp_path / name, *extra)
        code = ranks.wait(timeout=120)
        assert code == 0, ranks.communicate()[0][-3000:]
    kit = harness.load_weights(tmp_path / "kit" / "final.safetensors")
    ddp = harness.load_weights(tmp_path / "ddp" / "final.safetensors")
    assert harness.max_abs_diff(kit, ddp) <= 1e-6, harness.max_abs_diff(kit, ddp)
