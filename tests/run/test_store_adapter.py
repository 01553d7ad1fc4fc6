"""`CheckpointStore` with a peft adapter (issue 39): a checkpoint holds the trainable tensors only, with a
fingerprint of the frozen base; it restores onto the same base exactly, and onto another base never."""

import shutil
import warnings

import pytest
import torch

import colab_kit as ck
from colab_kit.checkpoints.validity import verify_folder
from colab_kit.loop.statefiles import ADAPTER_FILE, MODEL_FILE


def adapter_model(base_seed=0, rank=4):
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(base_seed)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    torch.manual_seed(1000)  # the adapter's own start, whatever the base
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                               task_type="CAUSAL_LM"))


def train(model, steps=3):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 300, (4, 16), generator=torch.Generator().manual_seed(2))
    for _ in range(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return optimizer


def test_an_adapter_checkpoint_holds_the_trainable_tensors_and_restores_them_onto_the_same_base(drive, local):
    model = adapter_model()
    optimizer = train(model)
    with ck.CheckpointStore(drive, local_dir=local) as store:
        store.save(3, model=model, optimizer=optimizer)
    saved = drive / "checkpoints" / "checkpoint-3"
    assert verify_folder(saved) is None and not (saved / MODEL_FILE).exists()
    from safetensors.torch import load_file

    tensors = load_file(saved / ADAPTER_FILE)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(tensors) == trainable and all("lora_" in n for n in tensors)
    whole = sum(p.numel() * 4 for p in model.parameters())
    assert (saved / ADAPTER_FILE).stat().st_size < whole / 5  # the adapter's size, not the model's

    shutil.rmtree(local)  # a new VM: the base is built again from its source, the adapter comes from Drive
    again = adapter_model()
    optimizer2 = torch.optim.AdamW([p for p in again.parameters() if p.requires_grad], lr=1e-2)
    with ck.CheckpointStore(drive, local_dir=local) as store:
        assert store.restore_latest(model=again, optimizer=optimizer2) == 3
    for (name, a), b in zip(model.state_dict().items(), again.state_dict().values()):
        assert torch.equal(a, b), name
    assert optimizer2.state_dict()["state"][0]["step"] == optimizer.state_dict()["state"][0]["step"]


def test_an_adapter_is_never_restored_onto_another_base(drive, local):
    model = adapter_model(base_seed=0)
    train(model)
    with ck.CheckpointStore(drive, local_dir=local) as store:
        store.save(3, model=model)
    other = adapter_model(base_seed=1)  # the same names and shapes, other frozen weights
    before = {n: p.clone() for n, p in other.named_parameters()}
    with ck.CheckpointStore(drive, local_dir=local) as store:
        with pytest.raises(ck.ResumeMismatchError, match="adapter was trained on another base model than this one"):
            store.restore_latest(model=other)
    assert all(torch.equal(before[n], p) for n, p in other.named_parameters())  # nothing loaded
    with ck.CheckpointStore(drive, local_dir=local) as store:
        with pytest.raises(ck.ResumeMismatchError):
            store.restore_latest(model=adapter_model(base_seed=0, rank=8))  # another adapter on the same base
    norms_too = adapter_model(base_seed=0)  # the same tensors; the norms trained too, so frozen no more
    for name, p in norms_too.named_parameters():
        if name.endswith("norm.weight"):
            p.requires_grad_(True)
    with ck.CheckpointStore(drive, local_dir=local) as store:
        with pytest.raises(ck.ResumeMismatchError, match="adapter was trained on another base model"):
            store.restore_latest(model=norms_too)


def test_a_base_in_another_half_precision_is_named_as_such(drive, local):
    model = adapter_model().to(torch.bfloat16)
    with ck.CheckpointStore(drive, local_dir=local) as store:
        store.save(1, model=model)
    with ck.CheckpointStore(drive, local_dir=local) as store:
        with pytest.raises(ck.ResumeMismatchError, match="in bfloat16, and this one is in float16.*dtype=torch.bfloat16"):
            store.restore_latest(model=adapter_model().to(torch.float16))
