"""ck.preflight on the seed's model and arguments, and on a sound configuration."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

import colab_kit as ck


class SeedModel(torch.nn.Module):
    """The seed notebook's model: DistilGPT2 with a Linear(50257, 50257) on top of its logits."""

    def __init__(self):
        super().__init__()
        self.gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=6))  # DistilGPT2's shape
        self.lm_head2 = torch.nn.Linear(50257, 50257)

    def get_input_embeddings(self):
        return self.gpt2.get_input_embeddings()

    def forward(self, input_ids, labels=None):
        return self.lm_head2(self.gpt2(input_ids).logits)


def seed_args(tmp_path, **overrides):
    return TrainingArguments(str(tmp_path), **({"learning_rate": 0.1, "warmup_steps": 2500, "max_steps": 3,
                                                "report_to": []} | overrides))


def test_the_seed_head_is_flagged_by_name_and_size_without_allocating_it(tmp_path, capsys):
    with torch.device("meta"):
        model = SeedModel()
    report = ck.preflight(model, seed_args(tmp_path))
    head = [f for f in report.findings if f.code == "huge_layer"]
    assert len(head) == 1 and head[0].level == "error"
    assert "'lm_head2' is Linear(50257 -> 50257) with 2,525,816,306 parameters" in head[0].message
    assert "vocabulary-to-vocabulary projection" in head[0].message and "remove 'lm_head2'" in head[0].fix
    assert all(p.is_meta for p in model.parameters())  # nothing was materialised
    assert report.memory["weights"] == report.parameters * 4 and report.memory["optimizer"] == 2 * report.memory["weights"]
    assert "lm_head2" in capsys.readouterr().out


def test_the_seed_arguments_are_flagged(tmp_path):
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=6))
    report = ck.preflight(model, seed_args(tmp_path), verbose=False)
    assert {"learning_rate", "warmup"} <= report.codes()
    lr = next(f for f in report.findings if f.code == "learning_rate")
    warmup = next(f for f in report.findings if f.code == "warmup")
    assert "learning rate 0.1 with adamw" in lr.message and "5e-5" in lr.fix
    assert "warm-up of 2,500 steps for a run of 3 steps" in warmup.message


def test_total_steps_come_from_the_dataset_when_max_steps_is_unset(tmp_path):
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=100))
    args = TrainingArguments(str(tmp_path), num_train_epochs=1, per_device_train_batch_size=8, warmup_steps=50,
                             report_to=[])
    assert "warmup" in ck.preflight(model, args, train_dataset=list(range(80)), verbose=False).codes()
    assert "steps_unknown" in ck.preflight(model, args, verbose=False).codes()


def test_a_sound_configuration_has_no_findings(tmp_path):
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=6))
    args = TrainingArguments(str(tmp_path), learning_rate=5e-5, warmup_steps=0.06, num_train_epochs=3,
                             per_device_train_batch_size=8, report_to=[])
    report = ck.preflight(model, args, train_dataset=list(range(2000)), verbose=False)
    assert report.ok and report.findings == []


def test_a_tokenizer_longer_than_the_embeddings_is_an_error(tmp_path):
    from colab_kit.text import generate_corpus, train_bpe_tokenizer

    tokenizer = train_bpe_tokenizer(generate_corpus(20), vocab_size=300)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=len(tokenizer)))
    assert ck.preflight(model, tokenizer=tokenizer, verbose=False).ok
    tokenizer.add_special_tokens({"pad_token": "[PAD]"})  # the seed's added pad token
    report = ck.preflight(model, tokenizer=tokenizer, verbose=False)
    finding = next(f for f in report.findings if f.code == "tokenizer_size")
    assert finding.level == "error" and "device-side assert" in finding.message and "needs no [PAD]" in finding.fix


def test_frozen_embeddings_with_reentrant_checkpointing_are_flagged(tmp_path, monkeypatch):
    import transformers

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100))
    model.get_input_embeddings().weight.requires_grad_(False)
    name = "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__ \
        else "gradient_checkpointing"
    args = TrainingArguments(str(tmp_path), report_to=[], max_steps=10, **{name: True})
    assert "no_gradient" not in ck.preflight(model, args, verbose=False).codes()  # transformers 5 handles it
    monkeypatch.setattr(transformers, "__version__", "4.57.1")  # 4.x: reentrant, no input gradients
    assert "no_gradient" in ck.preflight(model, args, verbose=False).codes()
    model.enable_input_require_grads()
    assert "no_gradient" not in ck.preflight(model, args, verbose=False).codes()


def test_training_state_larger_than_the_free_gpu_memory(tmp_path, fake_nvml):
    fake_nvml.used = fake_nvml.total - 1024**3  # 1 GiB free
    with torch.device("meta"):
        model = GPT2LMHeadModel(GPT2Config(n_layer=6))
    report = ck.preflight(model, verbose=False)
    finding = next(f for f in report.findings if f.code == "training_state")
    assert "exceed the free GPU memory (1.0 GiB)" in finding.message


def test_freeze_layers_freezes_embeddings_and_the_lowest_blocks():
    from colab_kit.memory.recipes import freeze_layers

    model = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=100, n_positions=64))
    frozen = freeze_layers(model, 2)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert not any(n.startswith(("transformer.wte", "transformer.wpe", "transformer.h.0.", "transformer.h.1."))
                   for n in trainable)
    assert any(n.startswith("transformer.h.3.") for n in trainable)
    assert frozen == sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert freeze_layers(model, 0) == 0
    with pytest.raises(ValueError, match="has 4 blocks"):
        freeze_layers(model, 5)
    report = ck.preflight(model, verbose=False)
    assert report.memory["optimizer"] == 8 * (report.trainable)  # no optimizer state for frozen parameters
