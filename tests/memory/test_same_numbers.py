"""The kit's training step gives the plain Trainer's numbers in every way the Trainer normalises a loss (issue 21).

A table: {the model's mean loss, a causal LM's loss with loss kwargs, `compute_loss_func`, label smoothing}
x {the whole batch, micro_batch=8, an injected out-of-memory error above 8 rows} x {no clipping,
max_grad_norm=1.0, max_grad_norm=0.1 (which clips every step of every model here)}. Each case trains 5 steps with the plain Trainer (batch 32, no accumulation) and with
`run.train`; logged losses and gradient norms must agree to 1e-6 and the weights to 1e-5. Dropout is 0.
"""

import math

import pytest
import torch
from test_oom_trainer import RaggedData, build_model, inject, max_diff, pad_collate, state
from transformers import Trainer, TrainingArguments

import colab_kit as ck

STEPS = 5


def normalised_cross_entropy(outputs, labels, num_items_in_batch=None):
    """A compute_loss_func as the Trainer's documentation asks: summed, divided by the batch's items."""
    logits = outputs["logits"]
    total = torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1), reduction="sum")
    return total / (num_items_in_batch if num_items_in_batch is not None else labels.numel())


LOSSES = {  # name -> (model kind, causal labels?, extra TrainingArguments, Trainer keyword arguments)
    "model mean loss": ("bert", False, {}, {}),
    "causal LM loss kwargs": ("gpt2", True, {}, {}),
    "compute_loss_func": ("bert", False, {}, {"compute_loss_func": normalised_cross_entropy}),
    "label smoothing": ("gpt2", True, {"label_smoothing_factor": 0.1}, {}),
}


def make_trainer(out, loss: str, clip: float):
    kind, causal, extra, keywords = LOSSES[loss]
    args = TrainingArguments(str(out), max_steps=STEPS, per_device_train_batch_size=32, learning_rate=5e-3,
                             lr_scheduler_type="linear", warmup_steps=1, logging_steps=1, max_grad_norm=clip,
                             save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0, **extra)
    return Trainer(model=build_model(kind), args=args, train_dataset=RaggedData(causal=causal),
                   data_collator=pad_collate(causal), **keywords)


def logged(trainer, key: str) -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry and "train_runtime" not in entry]


_plain: dict = {}


def plain_run(tmp_path_factory, loss: str, clip: float):
    """The plain Trainer's run, once per (loss, clip): the reference of three splits."""
    if (loss, clip) not in _plain:
        trainer = make_trainer(tmp_path_factory.mktemp("plain"), loss, clip)
        trainer.train()
        _plain[loss, clip] = (state(trainer), logged(trainer, "loss"), logged(trainer, "grad_norm"))
    return _plain[loss, clip]


@pytest.mark.parametrize("clip", [0.0, 1.0, 0.1], ids=["no clipping", "max_grad_norm=1", "max_grad_norm=0.1"])
@pytest.mark.parametrize("split", ["whole batch", "micro_batch=8", "out of memory above 8"])
@pytest.mark.parametrize("loss", list(LOSSES))
def test_the_kits_step_gives_the_plain_trainers_numbers(drive, local, tmp_path_factory, loss, split, clip):
    weights, losses, norms = plain_run(tmp_path_factory, loss, clip)
    run = ck.start_run("same", drive=drive, local_dir=local, save_every=None, quiet=True, gauges=False)
    trainer = make_trainer(run.local_dir, loss, clip)
    if split == "out of memory above 8":
        inject(trainer.model, "forward")
    run.train(trainer, micro_batch=8 if split == "micro_batch=8" else None)

    assert len(logged(trainer, "loss")) == len(losses) == STEPS
    assert logged(trainer, "loss") == pytest.approx(losses, rel=1e-6, abs=1e-6)
    if clip:
        assert logged(trainer, "grad_norm") == pytest.approx(norms, rel=1e-6, abs=1e-6)
        if clip < 1:  # the classifiers' norms stay below 1: here clipping clips every step
            assert min(norms) > clip
    assert max_diff(weights, state(trainer)) <= 1e-5
    backoffs = [(b["from"], b["to"]) for b in run.micro_batching.train.backoffs]
    assert backoffs == ([(32, 16), (16, 8)] if split == "out of memory above 8" else [])


class Every8(torch.utils.data.Dataset):
    """Causal rows whose 8 last ones carry no label at all (every position -100)."""

    def __init__(self):
        generator = torch.Generator().manual_seed(3)
        self.ids = torch.randint(3, 30, (24, 12), generator=generator)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        labels = self.ids[i].clone() if i < 16 else torch.full_like(self.ids[i], -100)
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": labels}


@pytest.mark.parametrize("kind", ["gpt2", "bert-mlm"])
def test_an_evaluation_micro_batch_without_labels_leaves_the_loss_finite_and_equal(drive, local, tmp_path, kind):
    args = dict(per_device_eval_batch_size=24, report_to=[], use_cpu=True, disable_tqdm=True)
    plain = Trainer(model=build_model(kind), args=TrainingArguments(str(tmp_path), **args), eval_dataset=Every8())
    expected = plain.evaluate()["eval_loss"]
    assert math.isfinite(expected)

    run = ck.start_run("eval", drive=drive, local_dir=local, save_every=None, quiet=True, gauges=False)
    trainer = Trainer(model=build_model(kind), args=TrainingArguments(str(run.local_dir), max_steps=0, **args),
                      eval_dataset=Every8())
    inject(trainer.model, "forward", limit=8, training_only=False)  # 24 -> 12 -> 6: the last 6 rows, no labels
    from colab_kit.memory.microbatch import TrainerMicroBatching

    guard = TrainerMicroBatching(run, trainer)
    assert guard.install()
    try:
        measured = trainer.evaluate()["eval_loss"]
    finally:
        guard.uninstall()
        run.finish(timeout=30)
    assert [(b["from"], b["to"]) for b in guard.eval.backoffs] == [(24, 12), (12, 6)]
    assert math.isfinite(measured) and measured == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("split", ["whole batch", "micro_batch=8", "out of memory above 8"])
def test_with_a_lora_adapter_the_kits_step_gives_the_plain_trainers_numbers(drive, local, tmp_path_factory, split):
    """Issue 39: a peft LoRA adapter on the causal LM (loss kwargs, clipping on): the same losses, gradient norms and
    adapter weights, whole or split, as the plain Trainer's."""
    peft = pytest.importorskip("peft", reason="peft is a test requirement (requirements-test.txt)")

    def lora_trainer(out):
        trainer = make_trainer(out, "causal LM loss kwargs", 1.0)
        config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["c_attn"], fan_in_fan_out=True,
                                 task_type="CAUSAL_LM")
        torch.manual_seed(0)
        return Trainer(model=peft.get_peft_model(trainer.model, config), args=trainer.args,
                       train_dataset=trainer.train_dataset, data_collator=trainer.data_collator)

    plain = lora_trainer(tmp_path_factory.mktemp("plain-lora"))
    plain.train()
    run = ck.start_run("same-lora", drive=drive, local_dir=local, save_every=None, quiet=True, gauges=False)
    trainer = lora_trainer(run.local_dir)
    if split == "out of memory above 8":
        inject(trainer.model, "forward")
    run.train(trainer, micro_batch=8 if split == "micro_batch=8" else None)
    assert logged(trainer, "loss") == pytest.approx(logged(plain, "loss"), rel=1e-6, abs=1e-6)
    assert logged(trainer, "grad_norm") == pytest.approx(logged(plain, "grad_norm"), rel=1e-6, abs=1e-6)
    assert max_diff(state(plain), state(trainer)) <= 1e-5
    assert any("lora_" in name for name in state(trainer))
    backoffs = [(b["from"], b["to"]) for b in run.micro_batching.train.backoffs]
    assert backoffs == ([(32, 16), (16, 8)] if split == "out of memory above 8" else [])
