"""The Trainer's best checkpoint across a kill and a new VM (issue 13).

HF's early-stopping resume scenario through `start_run` + `run.train`: `load_best_model_at_end`,
`metric_for_best_model` (minimised, or maximised with greater_is_better=True) and an
`EarlyStoppingCallback`, with the best checkpoint an early one (step 10 of the 30 that early
stopping allows). The job is SIGKILLed once the best checkpoint and a later one are on the
persistent folder, the local folder is wiped, and the rerun must end exactly as the
uninterrupted run does: on the best weights, with the same best metric and step.
"""

import re
import signal

import harness  # noqa: E402
import pytest

from colab_kit.checkpoints.checkpoint import list_checkpoints  # noqa: E402

pytestmark = pytest.mark.slow
_BEST = re.compile(r"BEST step=(\d+) metric=(\S+) stopped_at=(\d+)")


def best_line(text: str) -> tuple[int, str, int]:
    match = _BEST.search(text)
    assert match, text[-3000:]
    return int(match.group(1)), match.group(2), int(match.group(3))


@pytest.mark.parametrize("direction, keep", [("min", 1), ("max", 3)])
def test_the_best_model_survives_a_kill_and_a_new_vm(tmp_path, direction, keep):
    extra = ["--best", direction, "--keep", str(keep)]
    reference = harness.Job(tmp_path / "reference", extra=extra)
    code, text = reference.run()
    assert code == 0, text[-3000:]
    expected = best_line(text)
    assert expected[0] == 10 and expected[2] == 30, f"the scenario needs an early best and early stopping: {expected}"
    best_weights = harness.load_weights(tmp_path / "reference" / "final.safetensors")

    job = harness.Job(tmp_path / "job", extra=extra, step_sleep=0.3)
    harness.kill_when(job, lambda events: {10, 20} <= harness.synced_steps(events))
    # keep=1 and checkpoint-20 in the cloud: without protection checkpoint-10 would be pruned by now
    assert (job.run_dir / "checkpoints" / "checkpoint-10" / "MANIFEST.json").is_file()
    job.new_vm()
    code, text = job.run()
    assert code == 0, text[-3000:]
    assert harness.resumed_from(text) == 20
    assert "best so far: checkpoint-10 (fetched too" in text
    assert best_line(text) == expected  # best_global_step, best_metric, and early stopping at the same step
    resumed = harness.load_weights(tmp_path / "job" / "final.safetensors")
    assert harness.max_abs_diff(best_weights, resumed) == 0.0
    steps = [s for s, _ in list_checkpoints(job.run_dir / "checkpoints")]
    assert 10 in steps and steps[0] == 30 and (keep > 1 or steps == [30, 10])

    # "Run all" once more on another new VM: the early-stopped run is complete and ends on the best weights
    job.new_vm()
    code, text = job.run(out=tmp_path / "again.safetensors")
    assert code == 0, text[-3000:]
    assert "already reached step 30" in text
    assert harness.max_abs_diff(best_weights, harness.load_weights(tmp_path / "again.safetensors")) == 0.0
    assert code != -signal.SIGKILL
