"""ranks.py without a process group: the launcher's environment, and the single-process answers."""

import pytest
import torch

from colab_kit.distributed import agreement, gradients, ranks
from colab_kit.runtime import _visible_indices


def test_ranks_come_from_the_launchers_environment():
    assert ranks.detect({}) == ranks.Ranks(0, 0, 1, 1)
    torchrun = {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"}
    r = ranks.detect(torchrun)
    assert (r.rank, r.local_rank, r.world_size, r.local_world_size) == (3, 1, 4, 2)
    assert not r.writer and not r.node_leader and r.distributed
    assert "4 processes on 2 nodes; this is rank 3, a follower" == r.describe()
    leader = ranks.detect({"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2"})
    assert leader.node_leader and not leader.writer
    assert ranks.detect({"RANK": "0", "WORLD_SIZE": "2"}).describe().endswith(
        "rank 0, the one that writes to the persistent folder")


@pytest.mark.parametrize("env, what", [({"WORLD_SIZE": "two"}, "is not a whole number"),
                                       ({"RANK": "2", "WORLD_SIZE": "2"}, "inconsistent")])
def test_a_broken_launcher_environment_says_what_is_wrong(env, what):
    with pytest.raises(ValueError, match=what):
        ranks.detect(env)


def test_without_a_process_group_every_helper_is_the_single_process_answer(tmp_path):
    assert ranks.group() is None
    ranks.barrier()
    assert ranks.from_writer(True) is True and ranks.broadcast_object({"step": 3}) == {"step": 3}
    assert ranks.all_agree(True) == [] and ranks.all_agree(False) == [0]
    assert ranks.sum_over_ranks([1.5, 2.0]) == [1.5, 2.0]
    assert agreement.agree_micro_batch(8, False) == (8, []) and agreement.agree_micro_batch(4, True) == (4, [0])
    assert ranks.gather_rank_files(tmp_path, ["rng_state_0.pth"]) == 0
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    before = model.weight.grad.clone()
    gradients.reduce_gradients(model)
    assert torch.equal(model.weight.grad, before)
    assert gradients.unwrap_ddp(model) is None


def test_rank_files_missing_names_each_absent_rank(tmp_path):
    (tmp_path / "rng_state_0.pth").write_bytes(b"x")
    assert ranks.rank_files_missing(tmp_path, 1) == []
    assert ranks.rank_files_missing(tmp_path, 3) == ["rng_state_1.pth", "rng_state_2.pth"]


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert _visible_indices(3) == [0, 1, 2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    assert _visible_indices(3) == [2, 0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,-1,0")
    assert _visible_indices(3) == [1]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert _visible_indices(3) == []
