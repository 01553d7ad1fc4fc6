"""LoRA adapters on an emulated Google Drive (issue 39): a peft LoRA run through the HF Trainer, and the same
through TRL's SFTTrainer, killed with the DriveFS emulator at random moments of an upload backlog and resumed on
new VMs, end on the adapter of an uninterrupted run; their checkpoints hold the adapter, not the model.

The kill loop and its checks are `test_cloud_e2e.disconnect_scenario`'s: after the first checkpoint is complete
in the cloud one always verifies there, every `cloud` claim is true, each restart resumes from the newest valid
one, and the final weights match (<= 1e-6).
"""

import harness
import pytest
from test_cloud_e2e import HEAVY, disconnect_scenario

from colab_kit.checkpoints.checkpoint import list_checkpoints
from colab_kit.checkpoints.manifest import read_manifest

pytest.importorskip("peft", reason="peft is a test requirement (requirements-test.txt): pip install -e '.[test]'")
pytestmark = pytest.mark.slow
STEPS = 30
RATE = 100e3  # bytes per second: an adapter checkpoint (45 kB; 90 kB with the tokenizer SFTTrainer saves) takes up to
# ~1 s, and one is saved every ~1 s
BASE_BYTES = 20000 * 32 * 4 * 2  # the base's embedding and head alone (HEAVY's vocabulary), in fp32


@pytest.mark.slow(60)
@pytest.mark.parametrize("loop", ["lora", "sft"])
def test_an_adapter_run_killed_at_random_moments_resumes_to_the_uninterrupted_adapter(tmp_path, emulated_drive,
                                                                                      shared_tmp, loop):
    if loop == "sft":
        pytest.importorskip("trl", reason="trl is a test requirement (requirements-test.txt): pip install -e '.[test]'")
    reference = harness.reference_weights(tmp_path / "ref", loop, steps=STEPS, save_every=5, extra=HEAVY,
                                          shared=shared_tmp)
    # Each kill comes at a random moment after the run's first `cloud` event of that runtime (every checkpoint
    # takes a few seconds to reach this emulator's cloud, so most kills land while others are on their way).
    seen = disconnect_scenario(tmp_path / "run", emulated_drive(rate=RATE), reference, seed=39, kills_wanted=3,
                               delay=4.0, loop=loop, steps=STEPS, step_sleep=0.2, after="cloud")
    assert seen["kills"] >= 3
    folder = list_checkpoints(seen["job"].run_dir / "checkpoints")[0][1]
    manifest = read_manifest(folder)
    assert "adapter_model.safetensors" in manifest.files and "model.safetensors" not in manifest.files
    assert manifest.total_bytes < BASE_BYTES / 10  # the adapter's size (and its optimizer's), not the model's
